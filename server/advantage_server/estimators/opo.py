"""OPO, on-policy RL with an optimal reward baseline (arXiv:2505.23585).

Reference: verl ``compute_opo_outcome_advantage``.
Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions), ``mask``
[B, T]. Output: advantages [B, T]; no returns (verl returns the advantages twice), no metrics. No config.

Math, per prompt group g, with len_i = sum_t mask_{i,t} (the response length):
    b_g     = sum_{j in g} len_j s_j / sum_{j in g} len_j      (length-weighted mean reward)
    A_{i,t} = (s_i - b_g) * mask_{i,t}
A group of one has b = 0 (A = s on its valid tokens). A group whose rows all have no valid token
(sum len = 0, where verl divides by zero) gets the unweighted mean as b; its advantages are 0 anyway,
every row being fully masked. Tied groups get b = their common reward exactly.
:func:`opo_baseline_loop` is the per-group loop twin (test oracle).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from advantage_server.estimators.groups import (
    exclude_empty_field, group_baseline_and_std, group_sizes, group_sum, groups_of,
)
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.rewards import outcome_scores, sum_over_mask_field
from advantage_client.layout import BROADCAST_TIMES_MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class OPOConfig(EstimatorConfig):
    exclude_empty_responses: bool = exclude_empty_field()
    sum_rewards_over_mask: bool = sum_over_mask_field()


def opo_baseline(group: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-sample length-weighted group mean, float64 ``[B]`` (0 for a group of one)."""
    s = scores.to(torch.float64)
    L = lengths.to(torch.float64)
    num, den = group_sum(group, L * s), group_sum(group, L)
    plain, _ = group_baseline_and_std(group, s, leave_one_out=False)       # exact for tied groups
    lo = torch.full_like(s, float("inf")).scatter_reduce_(0, group, s, "amin")[group]
    hi = torch.full_like(s, float("-inf")).scatter_reduce_(0, group, s, "amax")[group]
    b = torch.where((den > 0) & (lo != hi), num / den.clamp(min=1), plain)
    return torch.where(group_sizes(group) > 1, b, torch.zeros_like(b))


def opo_baseline_loop(group: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Loop twin of :func:`opo_baseline` (test oracle)."""
    s = scores.to(torch.float64).cpu().tolist()
    L = lengths.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    out = [0.0] * len(s)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        if len(members) == 1:
            continue
        den = sum(L[i] for i in members)
        vals = [s[i] for i in members]
        if all(v == vals[0] for v in vals):
            b = vals[0]
        elif den > 0:
            b = sum(L[i] * s[i] for i in members) / den
        else:
            b = sum(vals) / len(vals)
        for i in members:
            out[i] = b
    return torch.tensor(out, dtype=torch.float64)


@register("opo", config=OPOConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK],
          reference="arXiv:2505.23585; verl compute_opo_outcome_advantage",
          per_sample=(("", BROADCAST_TIMES_MASK),),
          group_local=("",))  # statistics of the prompt group only
def opo(cfg: OPOConfig, batch: Batch) -> AdvantageResult:
    """Reward minus the length-weighted mean reward of the prompt group, on the valid tokens.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where mask = 0).
    """
    rewards, mask = batch["rewards"], batch["mask"]
    m = mask.to(torch.float64)
    scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
    group, _ = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own (A = 0 there)
    adv = scores - opo_baseline(group, scores, m.sum(-1))
    return AdvantageResult((adv[:, None] * m).to(rewards.dtype))
