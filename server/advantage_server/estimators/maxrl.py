"""MaxRL: Maximum Likelihood Reinforcement Learning (Tajwar et al. 2026, arXiv:2602.02710), the group-relative
advantage normalised by the group's mean reward instead of its std.

References: SkyRL 0.4.0 ``compute_maxrl_advantage`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``; SkyRL's
``algorithm.advantage_estimator = "maxrl"``; ``semantics = skyrl``, the default) and prime-rl main@559b447
``MaxRLAlgorithm.score_group`` (``src/prime_rl/orchestrator/algo/max_rl.py``; prime-rl's
``[orchestrator.algo] type = "max_rl"``; ``semantics = prime_rl``).

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (token-level rewards summed over all T
positions, masked ones included, as SkyRL does), ``mask`` [B, T]. Output: advantages [B, T]; no returns
(SkyRL returns the advantages twice), no metrics.

Math, per prompt group g of n samples, s = the summed reward, eps = ``epsilon``:

``semantics = skyrl``
    n >= 2:  A_i = (s_i - mean_g) / (mean_g + eps)
    n == 1:  A_i = s_i                          (SkyRL: the group's mean is taken as 0 and not divided)
    A_{i,t} = A_i * mask_{i,t}
``semantics = prime_rl`` (``epsilon`` does not apply: prime-rl adds nothing)
    mean_g > 0:   A_i = (s_i - mean_g) / mean_g  (a group of one: 0)
    mean_g <= 0:  A_i = 0 for the whole group    (prime-rl: "carries no signal")
    A_{i,t} = A_i * mask_{i,t} (prime-rl puts the value on the sampled tokens only)
    This is not SkyRL's number: no epsilon (a relative difference of eps / mean_g), 0 rather than s for a group of
    one, and 0 rather than a sign-flipped quotient for a group mean <= 0. prime-rl computes in float32 (it casts
    the rewards to float32): send float32 rewards for its numbers; the service's mean is float64, so a group whose
    float32 mean rounds to 0 or below while its float64 mean is positive (or the reverse) is decided by the
    float64 mean.
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
        ("skyrl", "prime_rl"), "Reference reproduced: skyrl (compute_maxrl_advantage), prime_rl (max_rl: "
                               "MaxRLAlgorithm.score_group).")
    epsilon: float | None = field(default=None, metadata={
        "doc": "Added to the group mean before dividing (SkyRL's epsilon, 1e-6). skyrl only.", "range": (0.0, None),
        "per_semantics": {"skyrl": 1e-6}, "default_text": "1e-06 (skyrl); not applicable otherwise"})


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


def prime_rl_maxrl_scalars(group: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """prime-rl's per-sample MaxRL advantage, float64 ``[B]``: ``(s - mean) / mean`` per group, 0 for a group whose
    mean is <= 0 (and so 0 for a group of one and a tied group). group: ``[B]`` int64 group index; scores: ``[B]``.
    Source: prime-rl main@559b447 ``src/prime_rl/orchestrator/algo/max_rl.py``."""
    s = scores.to(torch.float64)
    mean, _ = group_baseline_and_std(group, s, leave_one_out=False)
    positive = mean > 0
    num = torch.where(positive, s - mean, torch.zeros_like(s))
    return num / torch.where(positive, mean, torch.ones_like(mean))


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
          reference="arXiv:2602.02710; SkyRL compute_maxrl_advantage; prime-rl MaxRLAlgorithm",
          per_sample=(("", BROADCAST_TIMES_MASK),),
          group_local=("",))  # the group's own mean only
def maxrl(cfg: MaxRLConfig, batch: Batch) -> AdvantageResult:
    """Maximum-likelihood RL: reward minus the group mean, over the group mean plus epsilon.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where
    mask = 0); no returns, no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    if cfg.semantics == "prime_rl":
        a = prime_rl_maxrl_scalars(batch["prompt_ids"], outcome_scores(rewards))
    else:
        a = maxrl_scalars(batch["prompt_ids"], outcome_scores(rewards), cfg.epsilon)
    return AdvantageResult((a[:, None] * mask.to(torch.float64)).to(rewards.dtype))
