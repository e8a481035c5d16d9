"""QAE: Quantile Advantage Estimation, GRPO with a K-quantile group baseline instead of the group mean
(Wu et al. 2025, "Quantile Advantage Estimation for Entropy-Safe Reasoning", arXiv:2509.22611).

Reference: the authors' release (github junkangwu/QAE, README "One-Line Core Change"): a fork of verl whose
``compute_grpo_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``) sets a group's baseline to
``torch.quantile(scores, quantile_k)`` when ``0 < quantile_k < 1`` instead of ``torch.mean(scores)``;
everything else is verl's GRPO (the std, ``norm_adv_by_std_in_grpo``, epsilon, the group-of-one rule).
The fork's source file itself was not available to us; the README states the change, and this
estimator is verl's ``compute_grpo_outcome_advantage`` with that change. ``quantile_k`` outside (0, 1)
makes the fork fall back to the mean (plain GRPO); here it is INVALID_ARGUMENT (use ``grpo`` with
semantics = verl for the mean baseline).

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions, or over the
mask = 1 positions with ``sum_rewards_over_mask``), ``mask`` [B, T]. Output: advantages [B, T]; no
returns (verl returns the advantages twice), no metrics.

Math, per prompt group g with n >= 2 samples, scores r, K = ``quantile_k``:
    sort ascending: x_0 <= ... <= x_{n-1}; h = K (n - 1); lo = floor(h); hi = ceil(h)
    q_g = x_lo + (h - lo) (x_hi - x_lo)        (torch.quantile's default, interpolation = "linear")
    A_i = (r_i - q_g) / (std_g + epsilon)       when normalize_rewards (std_g = sample std, torch.std)
    A_i = r_i - q_g                             otherwise
    A_{i,t} = A_i * mask_{i,t}
A group of one has baseline 0 and std 1 (verl's rule): A = r / (1 + epsilon) (1 + epsilon rounded to float32
as verl's torch.tensor(1.0) + epsilon is), or r. A tied group gets 0, also with epsilon = 0 (where verl divides 0 by 0); so does any sample whose reward
equals its group's quantile.
Defaults: quantile_k = 0.4 (the release's recommended value; its scripts pass ++algorithm.quantile_k=0.4),
normalize_rewards = true (verl norm_adv_by_std_in_grpo), epsilon = 1e-6.

Kernel: samples sorted within their groups (two stable sorts) and the two order statistics gathered per
group (no loop over groups); the std by :func:`~advantage_server.estimators.groups.verl_group_stats`;
:func:`qae_loop` is the per-group loop twin (test oracle).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.groups import (
    exclude_empty_field, group_sizes, groups_of, verl_group_stats, verl_std_plus_eps,
)
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.pkpo import sort_within_groups
from advantage_server.estimators.rewards import outcome_scores, sum_over_mask_field
from advantage_client.layout import BROADCAST_TIMES_MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class QAEConfig(EstimatorConfig):
    quantile_k: float = field(default=0.4, metadata={
        "doc": "K: the group baseline is the K-quantile of the group's rewards (linear interpolation, as "
               "torch.quantile), 0 < K < 1. The QAE release's quantile_k; 0.4 is its recommended value.",
        "range": (0.0, 1.0), "open": True})
    normalize_rewards: bool = field(default=True, metadata={
        "doc": "Divide by the group's sample std + epsilon (verl norm_adv_by_std_in_grpo)."})
    epsilon: float = field(default=1e-6, metadata={"doc": "Added to the std before dividing.", "range": (0.0, None)})
    exclude_empty_responses: bool = exclude_empty_field()
    sum_rewards_over_mask: bool = sum_over_mask_field()

    def validate(self) -> None:
        """As :meth:`EstimatorConfig.validate` (``quantile_k`` in the open interval (0, 1), its ``range``),
        with the way to the mean baseline in the ``quantile_k`` message (INVALID_ARGUMENT on
        ``config.quantile_k``: the release falls back to the mean baseline outside (0, 1))."""
        if math.isfinite(self.quantile_k) and not 0.0 < self.quantile_k < 1.0:
            raise InvalidInput("config.quantile_k",
                               f"must be in the open interval (0.0, 1.0) (the bounds excluded), got "
                               f"{self.quantile_k} (for the mean baseline use the grpo estimator with "
                               f"semantics = verl)")
        super().validate()


def group_quantile(group: torch.Tensor, scores: torch.Tensor, q: float) -> torch.Tensor:
    """float64 ``[B]``: the ``q``-quantile of each sample's group, linear interpolation between the two
    nearest order statistics as ``torch.quantile`` computes it (rank h = q (n - 1), lerp by h - floor(h))."""
    s = scores.to(torch.float64)
    if s.numel() == 0:
        return s
    order, rank, size = sort_within_groups(group, s)
    x = s[order]
    start = torch.arange(s.shape[0], device=s.device) - rank  # sorted index of each sample's group start
    h = q * (size - 1).to(torch.float64)
    lo = torch.floor(h).to(torch.int64)
    hi = torch.ceil(h).to(torch.int64)
    base_sorted = torch.lerp(x[start + lo], x[start + hi], h - lo.to(torch.float64))
    return torch.empty_like(base_sorted).scatter_(0, order, base_sorted)


def qae_scalars(group: torch.Tensor, scores: torch.Tensor, quantile_k: float, normalize: bool,
                epsilon: float) -> torch.Tensor:
    """Per-sample QAE advantage, float64 ``[B]`` (see the module docstring)."""
    s = scores.to(torch.float64)
    _, std = verl_group_stats(group, s)
    base = torch.where(group_sizes(group) <= 1, 0.0, group_quantile(group, s, quantile_k))
    adv = s - base
    if normalize:  # r = q (every member of a tied group) stays 0, also with epsilon = 0 (verl: 0 / 0)
        adv = torch.where(adv == 0, adv, adv / verl_std_plus_eps(group, std, epsilon))
    return adv


def qae_loop(group: torch.Tensor, scores: torch.Tensor, quantile_k: float, normalize: bool,
             epsilon: float) -> torch.Tensor:
    """Loop twin of :func:`qae_scalars` (test oracle): one group at a time, as the verl fork does."""
    s = scores.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    out = [0.0] * len(s)
    one_plus_eps = float(torch.tensor(1.0) + epsilon)  # verl: torch.tensor(1.0) (float32) + epsilon
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        n = len(members)
        if n == 1:
            i = members[0]
            out[i] = s[i] / one_plus_eps if normalize else s[i]
            continue
        vals = sorted(s[i] for i in members)
        h = quantile_k * (n - 1)
        lo, hi = math.floor(h), math.ceil(h)
        base = vals[lo] + (h - lo) * (vals[hi] - vals[lo])
        mu = sum(vals) / n
        sd = 0.0 if vals[0] == vals[-1] else (sum((v - mu) ** 2 for v in vals) / (n - 1)) ** 0.5
        for i in members:
            d = s[i] - base
            out[i] = d / (sd + epsilon) if normalize and d != 0 else d
    return torch.tensor(out, dtype=torch.float64)


@register("qae", config=QAEConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK],
          reference="arXiv:2509.22611; QAE release (github junkangwu/QAE): verl compute_grpo_outcome_advantage "
                    "with the K-quantile baseline",
          per_sample=(("", BROADCAST_TIMES_MASK),),
          group_local=("",))  # statistics of the prompt group only
def qae(cfg: QAEConfig, batch: Batch) -> AdvantageResult:
    """QAE advantage: reward minus the prompt group's K-quantile, optionally over the group's std.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where mask = 0).
    Raises INVALID_ARGUMENT on ``config.quantile_k`` outside (0, 1) and ``config.epsilon`` < 0.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    group, _ = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own
    scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
    adv = qae_scalars(group, scores, cfg.quantile_k, cfg.normalize_rewards, cfg.epsilon)
    return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(rewards.dtype))
