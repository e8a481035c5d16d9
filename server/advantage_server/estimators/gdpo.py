"""GDPO: group reward-decoupled policy optimisation (arXiv:2601.05242).

Math: for each reward component k (inputs named ``reward/<name>``, taken in sorted name order)
    A_k = GRPO advantage of component k (per-prompt baseline, optional std normalisation)
    A   = sum_k w_k A_k                         (w = reward_weights, default all 1)
    A   = (A - mean_B(A)) / std_B(A)            (over all B rows, unbiased std; if std = 0: A - mean)
A is broadcast over every column of its row. Fewer than two components is an error.

Options (off by default, so the reference is reproduced exactly):
``allow_missing_rewards`` (ms-swift issue #8123): NaN in a ``reward/<name>`` input means "no score for
    this sample". Component k's baseline and std are over the group's samples that have a score for k
    (a group with one such sample is a group of one for k), and a sample without one contributes
    A_k = 0 to the sum; a sample missing every component gets sum 0 and still takes part in the batch
    standardisation. Off: NaN is INVALID_ARGUMENT, as every non-finite input.
``exclude_empty_responses``: a row whose mask is all 0 is left out of every component's group
    statistics and of the batch standardisation (mean and std over the non-empty rows); its advantage is 0.
Reference: NeMo RL ``GDPOAdvantageEstimator`` (which ignores ``rewards``; so do we: it is not an input).

``semantics = verl`` (verl 0.9.1 ``compute_gdpo_outcome_advantage``, verl PR #5503): one or more
components (verl's trainer passes ``algorithm.gdpo_reward_keys``; without them verl uses the summed
``token_level_rewards`` as the only component, which the verl drop-in sends as ``reward/score``):
    A_k = verl GRPO of component k: (r - mean_g) / (std_g + epsilon) (or r - mean_g when
          normalize_rewards = false); mean, sample std (torch.std) per prompt group; a group of one
          has mean 0, std 1; a tied group gives 0, also with epsilon = 0 (verl: NaN, 0 / 0)
    A   = sum_k w_k A_k * mask                  ([B, T]: 0 where mask = 0)
    A   = verl masked_whiten(A, mask) * mask    (mean and unbiased variance over the mask = 1 tokens,
                                                 so a row weighs by its length; rsqrt(var + 1e-8))
Where verl raises (fewer than two valid tokens in the batch) the whitening takes var = 0
(:func:`~advantage_server.estimators.whitening.whiten_unbiased`). ``exclude_empty_responses`` leaves the
empty rows out of each component's group statistics (they are 0 after the mask anyway, and the whitening
is over mask = 1 tokens); ``use_leave_one_out_baseline`` and ``allow_missing_rewards`` do not apply
(INVALID_ARGUMENT).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators import jit
from advantage_server.estimators.groups import (
    broadcast_rows, exclude_empty_field, exclude_rows, group_relative, groups_of, nonempty_rows, verl_group_stats,
    verl_std_plus_eps, weighted_group_relative, zero_rows,
)
from advantage_server.estimators.inputs import MASK, PROMPT_IDS
from advantage_server.estimators.whitening import whiten_unbiased
from advantage_client.layout import BROADCAST, BROADCAST_TIMES_MASK
from advantage_server.estimators.registry import (
    AdvantageResult, Batch, EstimatorConfig, InputSpec, register, semantics_field,
)

COMPONENT_PREFIX = "reward/"


@dataclass(frozen=True)
class GDPOConfig(EstimatorConfig):
    normalize_rewards: bool = field(default=True, metadata={"doc": "Normalise each component's advantage by its group std."})
    use_leave_one_out_baseline: bool | None = field(default=None, metadata={
        "doc": "Leave-one-out baseline per component (RLOO). nemo_rl only.",
        "per_semantics": {"nemo_rl": True}, "default_text": "true (nemo_rl); not applicable to verl"})
    reward_weights: tuple[float, ...] | None = field(default=None, metadata={"doc": "One weight per component in sorted name order; unset = all 1.0."})
    exclude_empty_responses: bool = exclude_empty_field(
        extra=" GDPO: also left out of the batch standardisation (mean and std over the non-empty rows).")
    allow_missing_rewards: bool | None = field(default=None, metadata={
        "doc": "NaN in a reward/<name> input means no score for that sample (ms-swift issue #8123): each "
               "component's group baseline and std are over the samples that have it, and a sample without "
               "it contributes 0 to the weighted sum (then standardised over the batch as usual). Off "
               "(default): NaN is INVALID_ARGUMENT. Infinity is always rejected. nemo_rl only.",
        "per_semantics": {"nemo_rl": False}, "default_text": "false (nemo_rl); not applicable to verl"})
    semantics: str | None = semantics_field(
        ("nemo_rl", "verl"),
        "Reference reproduced: nemo_rl (NeMo RL GDPOAdvantageEstimator), verl (compute_gdpo_outcome_advantage).")
    epsilon: float | None = field(default=None, metadata={
        "doc": "Added to each component's group std before dividing. verl only.", "range": (0.0, None),
        "per_semantics": {"verl": 1e-6}, "default_text": "1e-06 (verl); not applicable to nemo_rl"})


@jit.njit
def _moments(t):  # pragma: no cover - compiled; tested through gdpo
    """(mean, unbiased std) of ``t``, two-pass in float64 (std 0 for n = 1)."""
    n = t.shape[0]
    total = 0.0
    for i in range(n):
        total += t[i]
    mean = total / n
    m2 = 0.0
    for i in range(n):
        d = t[i] - mean
        m2 += d * d
    return mean, (np.sqrt(m2 / (n - 1)) if n > 1 else 0.0)


@jit.njit
def _standardize(t):  # pragma: no cover - compiled; tested through gdpo
    """In place: t = (t - mean) / std with :func:`_moments`, or t - mean where std = 0 or B = 1."""
    mean, sd = _moments(t)
    for i in range(t.shape[0]):
        t[i] = (t[i] - mean) / sd if sd > 0 else t[i] - mean


@jit.njit
def _standardized_rows(lo, hi, t, mean, sd, out):  # pragma: no cover - compiled; tested through gdpo
    """Rows ``lo..hi-1`` of the result: :func:`_standardize`'s value of t[b], cast to ``out``'s dtype, in
    every column (what ``_standardize`` + ``broadcast_rows`` write, without the [B] cast temporary)."""
    for b in range(lo, hi):
        x = (t[b] - mean) / sd if sd > 0 else t[b] - mean
        for j in range(out.shape[1]):
            out[b, j] = x


@register(
    "gdpo", config=GDPOConfig,
    inputs=[
        PROMPT_IDS, MASK,
        InputSpec("reward/<name>", ("[B]",), "float",
                  "One reward component per key, e.g. reward/correctness, reward/format; at least two. NaN = no "
                  "score for that sample, accepted with allow_missing_rewards = true.",
                  fix="send two or more reward components as inputs named reward/<name>, or use grpo for a single reward",
                  nan_allowed_when=(lambda cfg: cfg.allow_missing_rewards, "allow_missing_rewards = true")),
    ],
    reference="arXiv:2601.05242; NeMo RL GDPOAdvantageEstimator",
    per_sample=(("semantics = nemo_rl", BROADCAST), ("semantics = verl", BROADCAST_TIMES_MASK)),
)
def gdpo(cfg: GDPOConfig, batch: Batch) -> AdvantageResult:
    """Per-component GRPO advantages, weighted, summed and standardised over the batch.

    Inputs: prompt_ids [B], reward/<name> [B] (two or more), mask [B, T].
    Returns advantages [B, T]; no returns, no metrics.
    """
    components = batch.with_prefix(COMPONENT_PREFIX)
    names = list(components)
    if cfg.semantics == "verl":
        return _verl_gdpo(cfg, batch, components)
    if len(names) < 2:
        raise InvalidInput("inputs['reward/<name>']",
                           f"gdpo needs at least two reward components named reward/<name>; got {names or 'none'}. "
                           "Send each reward separately, or choose grpo for a single reward")
    weights = cfg.reward_weights if cfg.reward_weights is not None else (1.0,) * len(names)
    if len(weights) != len(names):
        raise InvalidInput("config.reward_weights",
                           f"has {len(weights)} entries but the batch has {len(names)} components {names}; "
                           "give one weight per component, in sorted component-name order")
    group = batch["prompt_ids"]
    dtype = components[names[0]].dtype
    if cfg.allow_missing_rewards or cfg.exclude_empty_responses:
        keep = nonempty_rows(batch["mask"]) if cfg.exclude_empty_responses else None
        return AdvantageResult(broadcast_rows(_with_absent_values(cfg, group, [components[k] for k in names],
                                                                  weights, keep), batch.B, batch.T, dtype, batch))
    fused = weighted_group_relative(group, [components[k] for k in names], tuple(weights),
                                    cfg.use_leave_one_out_baseline, cfg.normalize_rewards)
    if fused is not None:  # CPU (numba): the weighted sum in one pass over the groups, standardised in place
        t = fused.numpy()
        if dtype in (torch.float32, torch.float64):  # standardised straight into the [B, T] rows
            mean, sd = _moments(t)
            out = batch.output("advantages", dtype)
            jit.parallel_rows(_standardized_rows, batch.B, batch.T, t, mean, sd, out.numpy())
            return AdvantageResult(out)
        _standardize(t)
        return AdvantageResult(broadcast_rows(fused, batch.B, batch.T, dtype, batch))
    parts = [group_relative(group, components[k], cfg.use_leave_one_out_baseline, cfg.normalize_rewards)
             for k in names]
    total = sum(w * p for w, p in zip(weights, parts))
    centred = total - total.mean()
    std = total.std() if total.numel() > 1 else torch.zeros((), dtype=total.dtype, device=total.device)
    adv = torch.where(std > 0, centred / std, centred)
    return AdvantageResult(broadcast_rows(adv, batch.B, batch.T, dtype, batch))


def _with_absent_values(cfg: GDPOConfig, group: torch.Tensor, components: list[torch.Tensor],
                        weights: tuple[float, ...], keep: torch.Tensor | None) -> torch.Tensor:
    """GDPO's float64 ``[B]`` advantage where some values take no part: the rows where ``keep`` is false
    (empty responses; None = all rows take part) and, with ``allow_missing_rewards``, each component's NaN
    entries. Each component's group statistics run on the group index with those rows on their own
    (:func:`~advantage_server.estimators.groups.exclude_rows`, so every group kernel applies), and an
    absent value contributes 0 to the weighted sum."""
    total = None
    for w, r in zip(weights, components):
        present = keep
        if cfg.allow_missing_rewards:
            have = ~torch.isnan(r)
            present = have if present is None else present & have
        g = group if present is None else exclude_rows(group, present)
        values = r if present is None else torch.where(present, r, torch.zeros((), dtype=r.dtype, device=r.device))
        part = zero_rows(group_relative(g, values, cfg.use_leave_one_out_baseline, cfg.normalize_rewards), present)
        total = w * part if total is None else total + w * part
    rows = total if keep is None else total[keep]
    if rows.numel() == 0:
        return torch.zeros_like(total)
    centred = total - rows.mean()
    std = rows.std() if rows.numel() > 1 else torch.zeros((), dtype=total.dtype, device=total.device)
    return zero_rows(torch.where(std > 0, centred / std, centred), keep)


def _verl_gdpo(cfg: GDPOConfig, batch: Batch, components: dict[str, torch.Tensor]) -> AdvantageResult:
    """``semantics = verl`` (module docstring): per-component verl GRPO, weighted sum under the mask, then
    verl's token-level ``masked_whiten``. components: ``reward/<name>`` -> ``[B]``; advantages ``[B, T]``."""
    names = list(components)
    if not names:
        raise InvalidInput("inputs['reward/<name>']",
                           "gdpo (verl) needs at least one reward component named reward/<name> (verl's "
                           "gdpo_reward_keys, or the summed token_level_rewards as reward/score)")
    weights = cfg.reward_weights if cfg.reward_weights is not None else (1.0,) * len(names)
    if len(weights) != len(names):
        raise InvalidInput("config.reward_weights",
                           f"has {len(weights)} entries but the batch has {len(names)} components {names}; "
                           "give one weight per component, in sorted component-name order")
    group, _ = groups_of(cfg, batch)  # exclude_empty_responses: empty rows are groups of their own
    mask = batch["mask"]
    total = torch.zeros(batch.B, dtype=torch.float64, device=mask.device)
    for w, name in zip(weights, names):
        r = components[name].to(torch.float64)
        mean, std = verl_group_stats(group, r)
        a = r - mean
        if cfg.normalize_rewards:  # a tied group's 0 stays 0 with epsilon = 0 too (verl: 0 / 0)
            a = torch.where(a == 0, a, a / verl_std_plus_eps(group, std, cfg.epsilon))
        total = total + w * a
    m = mask.to(torch.float64)
    adv = whiten_unbiased(total[:, None] * m, mask) * m
    return AdvantageResult(adv.to(components[names[0]].dtype))
