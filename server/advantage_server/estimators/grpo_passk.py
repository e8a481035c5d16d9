"""GRPO pass@k: only the best sample of each prompt group is rewarded (pass@k training, arXiv:2503.19595).

Reference: verl ``compute_grpo_passk_outcome_advantage`` (verl reads ``norm_adv_by_std_in_grpo`` from
its algorithm config; here it is ``normalize_rewards``).

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions),
``mask`` [B, T]. Output: advantages [B, T]; no returns (verl returns the advantages twice), no metrics.

Math, per prompt group g with rewards r (n >= 2 samples):
    r_max, r_2nd = the two largest rewards (r_2nd = r_max when the maximum is shared)
    A_i = r_max - r_2nd           for the sample holding the maximum, 0 for every other sample
    A_i = A_i / (std_g + epsilon) when normalize_rewards (std_g = sample std of the group's rewards)
    A_{i,t} = A_i * mask_{i,t}
A tie for the best gives every sample 0 (verl gives its arbitrary top-k pick r_max - r_2nd = 0 too); an
advantage of 0 is not divided, so it stays 0 with epsilon = 0 (verl: NaN, 0 / 0, in a tied group).
A group of one gets 0: verl raises ValueError there; the service answers with no signal for it.
Defaults: normalize_rewards = true, epsilon = 1e-6.

Kernel: per-group max, count at the max and second max by scatter reductions (no loop over groups);
:func:`grpo_passk_loop` is the per-group loop twin (test oracle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.estimators.groups import exclude_empty_field, group_baseline_and_std, group_sizes, groups_of
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.rewards import outcome_scores, sum_over_mask_field
from advantage_client.layout import BROADCAST_TIMES_MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class GRPOPassKConfig(EstimatorConfig):
    normalize_rewards: bool = field(default=True, metadata={
        "doc": "Divide the winner's margin by the group's sample std + epsilon (verl norm_adv_by_std_in_grpo)."})
    epsilon: float = field(default=1e-6, metadata={"doc": "Added to the std before dividing.", "range": (0.0, None)})
    exclude_empty_responses: bool = exclude_empty_field()
    sum_rewards_over_mask: bool = sum_over_mask_field()


def grpo_passk_scalars(group: torch.Tensor, scores: torch.Tensor, normalize: bool, epsilon: float) -> torch.Tensor:
    """Per-sample pass@k advantage, float64 ``[B]`` (see the module docstring)."""
    s = scores.to(torch.float64)
    B = s.shape[0]
    hi = torch.full((B,), float("-inf"), dtype=torch.float64, device=s.device).scatter_reduce_(0, group, s, "amax")
    at_max = s == hi[group]
    n_max = torch.zeros(B, dtype=torch.float64, device=s.device).index_add_(0, group, at_max.to(torch.float64))
    below = torch.where(at_max, torch.full_like(s, float("-inf")), s)
    second = torch.full_like(hi, float("-inf")).scatter_reduce_(0, group, below, "amax")
    n = group_sizes(group)
    winner = at_max & (n_max[group] == 1) & (n >= 2)
    margin = torch.where(winner, s - torch.where(winner, second[group], s), torch.zeros_like(s))
    if normalize:
        _, std = group_baseline_and_std(group, s, leave_one_out=False)
        # 0 (not the winner, a tied group, a group of one) stays 0 with epsilon = 0 too (verl: 0 / 0)
        margin = torch.where(margin == 0, margin, margin / (std + epsilon))
    return margin


def grpo_passk_loop(group: torch.Tensor, scores: torch.Tensor, normalize: bool, epsilon: float) -> torch.Tensor:
    """Loop twin of :func:`grpo_passk_scalars` (test oracle): one group at a time, as verl does."""
    s = scores.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    out = [0.0] * len(s)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        if len(members) < 2:
            continue
        vals = sorted(((s[i], i) for i in members), reverse=True)
        (r_max, i_max), (r_2nd, _) = vals[0], vals[1]
        if r_max == r_2nd:
            continue
        adv = r_max - r_2nd
        if normalize:
            mu = sum(s[i] for i in members) / len(members)
            std = (sum((s[i] - mu) ** 2 for i in members) / (len(members) - 1)) ** 0.5
            adv = adv / (std + epsilon)
        out[i_max] = adv
    return torch.tensor(out, dtype=torch.float64)


@register("grpo_passk", config=GRPOPassKConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK],
          reference="arXiv:2503.19595; verl compute_grpo_passk_outcome_advantage",
          per_sample=(("", BROADCAST_TIMES_MASK),),
          group_local=("",))  # statistics of the prompt group only
def grpo_passk(cfg: GRPOPassKConfig, batch: Batch) -> AdvantageResult:
    """Pass@k advantage: the best sample of each prompt group gets its margin over the runner-up, the others 0.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where mask = 0).
    """
    rewards, mask = batch["rewards"], batch["mask"]
    group, _ = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own (A = 0 there)
    scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
    adv = grpo_passk_scalars(group, scores, cfg.normalize_rewards, cfg.epsilon)
    return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(rewards.dtype))
