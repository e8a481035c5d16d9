"""MaxRL: Maximum Likelihood Reinforcement Learning (Tajwar et al. 2026, arXiv:2602.02710), the group-relative
advantage normalised by the group's mean reward instead of its std.

Reference: SkyRL 0.4.0 ``compute_maxrl_advantage`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``; SkyRL's
``algorithm.advantage_estimator = "maxrl"``), the only released implementation.

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (token-level rewards summed over all T
positions, masked ones included, as SkyRL does), ``mask`` [B, T]. Output: advantages [B, T]; no returns
(SkyRL returns the advantages twice), no metrics.

Math, per prompt group g of n samples, s = the summed reward, eps = ``epsilon``:
    n >= 2:  A_i = (s_i - mean_g) / (mean_g + eps)
    n == 1:  A_i = s_i                          (SkyRL: the group's mean is taken as 0 and not divided)
    A_{i,t} = A_i * mask_{i,t}
With binary rewards (MaxRL's setting) mean_g is the group's pass rate p and A_i = (s_i - p) / p: rarely solved
prompts weigh more, the pass@k-weighted objective of the paper. The (mean + eps) denominator is kept as SkyRL
has it: for a group mean below -eps it is negative (the advantages' signs flip) and near -eps it is small
(the advantages grow without bound). Where SkyRL divides by zero the service stays finite:

* a tied group (every s_i equal: s_i - mean = 0 exactly, the mean of equal values being exact here) gives 0,
  also where mean + eps = 0 (SkyRL: 0 / 0 = NaN);
* an untied group whose mean + eps is exactly 0 (in float64) gives 0 (SkyRL: +-inf);
* a quotient beyond the compute dtype's range is the core's usual INVALID_ARGUMENT (overflow), never inf.

Numerics: the group mean in float64 (two-pass, exact for ties: :func:`~advantage_server.estimators.groups.
group_baseline_and_std`); SkyRL computes in the rewards' dtype, so for float32 rewards the service matches
SkyRL run in float64. :func:`maxrl_scalars_loop` is the per-group loop twin (test oracle).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from advantage_client.layout import BROADCAST_TIMES_MASK
from advantage_server.estimators.groups import group_baseline_and_std, group_sizes, verl_group_stats_loop
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register, semantics_field
from advantage_server.estimators.rewards import outcome_scores


@dataclass(frozen=True)
class MaxRLConfig(EstimatorConfig):
    semantics: str | None = semantics_field(
        ("skyrl",), "Reference reproduced: skyrl (compute_maxrl_advantage).")
    epsilon: float = field(default=1e-6, metadata={
        "doc": "Added to the group mean before dividing (SkyRL's epsilon, 1e-6).", "range": (0.0, None)})


def maxrl_scalars(group: torch.Tensor, scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Per-sample MaxRL advantage, float64 ``[B]`` (module docstring).

    group: ``[B]`` int64 group index; scores: ``[B]`` float. A group of one keeps its score; a tied group,
    and an untied group whose ``mean + epsilon`` is exactly 0, give 0.
    """
    s = scores.to(torch.float64)
    mean, _ = group_baseline_and_std(group, s, leave_one_out=False)
    num = s - mean
    den = mean + epsilon
    zero = (num == 0) | (den == 0)
    a = torch.where(zero, torch.zeros_like(num), num / torch.where(den == 0, torch.ones_like(den), den))
    return torch.where(group_sizes(group) > 1, a, s)


def maxrl_scalars_loop(group: torch.Tensor, scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Loop twin of :func:`maxrl_scalars` (test oracle), one sample at a time on the loop twin's group means."""
    mean, _ = verl_group_stats_loop(group, scores)  # a group of one: mean 0
    sizes = Counter(group.cpu().tolist())
    out = []
    for g, s, mu in zip(group.cpu().tolist(), scores.to(torch.float64).cpu().tolist(), mean.tolist()):
        num, den = s - mu, mu + epsilon
        out.append(s if sizes[g] == 1 else 0.0 if num == 0 or den == 0 else num / den)
    return torch.tensor(out, dtype=torch.float64)


@register("maxrl", config=MaxRLConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK],
          reference="arXiv:2602.02710; SkyRL compute_maxrl_advantage",
          per_sample=(("", BROADCAST_TIMES_MASK),),
          group_local=("",))  # the group's own mean only
def maxrl(cfg: MaxRLConfig, batch: Batch) -> AdvantageResult:
    """Maximum-likelihood RL: reward minus the group mean, over the group mean plus epsilon.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where
    mask = 0); no returns, no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    a = maxrl_scalars(batch["prompt_ids"], outcome_scores(rewards), cfg.epsilon)
    return AdvantageResult((a[:, None] * mask.to(torch.float64)).to(rewards.dtype))
