"""RLOO, REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions), ``mask``
[B, T]; ``logprobs`` and ``reference_logprobs`` [B, T] when ``use_kl_in_reward`` (KL_t as in
reinforce_plus_plus).

Math, per sample i of a prompt group of n samples:
    a_i = s_i - (sum_{j != i} s_j) / (n - 1)  =  (s_i - mean_g) * n / (n - 1)

``semantics = verl`` (default; verl ``compute_rloo_outcome_advantage``). No returns (verl returns the
advantages twice).
    s_i = r_i - penalty * sum_t KL_t mask_t; a group of one keeps a = s (baseline 0);
    A_{i,t} = a_i * mask_{i,t}.
    verl's ``rloo_vectorized`` computes the same numbers except for a group of one, which it gives 0.
``semantics = openrlhf`` (OpenRLHF 0.11.2 ``rloo``). Returns G.
    s_i = r_i; a group of one keeps a = s (baseline 0; OpenRLHF divides by n - 1 = 0 there);
    a_i clamped to [reward_clip_min, reward_clip_max] (OpenRLHF's ``--reward.clip_range``, default +-10) on the row's last mask = 1 position
    minus penalty * KL_t * mask_t, G = reverse cumulative sum (gamma 1), A = G (OpenRLHF 0.11.2 does not
    whiten rloo advantages; releases that did are not reproduced).
``semantics = skyrl`` (SkyRL 0.4.0 ``compute_rloo_outcome_advantage``). No returns.
    verl's rule (s = sum over all T of the token rewards, minus penalty * sum_t KL_t mask_t with
    use_kl_in_reward: SkyRL's trainer subtracts the masked KL from the rewards in ``apply_reward_kl_penalty``
    before the estimator; not part of the differential tests), except that a group of one gets
    0 (SkyRL logs a warning and sets it to 0); SkyRL's (s_i - mean) * n / (n - 1) is the same number.

Numerics: the leave-one-out mean is computed in float64 by removal from the group mean
(:func:`~advantage_server.estimators.groups.group_baseline_and_std`), exact when the others are tied.
:func:`rloo_scalars_loop` is the per-group loop twin (test oracle).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from advantage_server.estimators.groups import (
    group_baseline_and_std, group_sizes, exclude_empty_field, groups_of, zero_rows,
)
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.kl import KL_INPUTS, KLInRewardConfig, kl_total
from advantage_server.estimators.rewards import (
    OpenRLHFRewardConfig, openrlhf_outcome, outcome_scores, sum_over_mask_field,
)
from advantage_client.layout import BROADCAST_TIMES_MASK, UP_TO_LAST_VALID
from advantage_server.estimators.registry import AdvantageResult, Batch, register, semantics_field


@dataclass(frozen=True)
class RLOOConfig(KLInRewardConfig, OpenRLHFRewardConfig):
    semantics: str | None = semantics_field(
        ("verl", "openrlhf", "skyrl"),
        "Reference reproduced: verl (compute_rloo_outcome_advantage), openrlhf (rloo), skyrl (compute_rloo_outcome_advantage).")
    exclude_empty_responses: bool = exclude_empty_field()
    sum_rewards_over_mask: bool | None = sum_over_mask_field({"verl": False})


def rloo_scalars(group: torch.Tensor, scores: torch.Tensor, single: str = "keep") -> torch.Tensor:
    """Per-sample ``s_i - mean of the others``, float64 ``[B]``; a group of one keeps ``s``
    (``single = "keep"``) or gets 0 (``single = "zero"``, SkyRL's rule)."""
    s = scores.to(torch.float64)
    baseline, _ = group_baseline_and_std(group, s, leave_one_out=True)
    return torch.where(group_sizes(group) > 1, s - baseline, s if single == "keep" else torch.zeros_like(s))


def rloo_scalars_loop(group: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Loop twin of :func:`rloo_scalars` (test oracle)."""
    s = scores.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    out = list(s)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        if len(members) == 1:
            continue
        for i in members:
            others = [s[j] for j in members if j != i]
            base = others[0] if all(v == others[0] for v in others) else sum(others) / len(others)
            out[i] = s[i] - base
    return torch.tensor(out, dtype=torch.float64)


@register("rloo", config=RLOOConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK, *KL_INPUTS],
          reference="arXiv:2402.14740; verl compute_rloo_outcome_advantage; OpenRLHF rloo",
          produces_returns=(lambda cfg: cfg.semantics == "openrlhf", "semantics = openrlhf"),
          # openrlhf: a on the last valid token, reverse cumsum (returns = advantages); KL makes it per token
          per_sample=(("semantics = verl or semantics = skyrl", BROADCAST_TIMES_MASK),
                      ("semantics = openrlhf and use_kl_in_reward = false", UP_TO_LAST_VALID)),
          group_local=("",))  # leave-one-out means within the group; KL and returns per row
def rloo(cfg: RLOOConfig, batch: Batch) -> AdvantageResult:
    """Reward minus the mean reward of the other samples of the same prompt.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]; logprobs and reference_logprobs [B, T] when
    use_kl_in_reward. Returns advantages [B, T]; returns [B, T] under openrlhf semantics; no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    group, keep = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own
    dtype = rewards.dtype
    if cfg.semantics in ("verl", "skyrl"):
        scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
        a = rloo_scalars(group, scores - kl_total(cfg, batch, mask), "keep" if cfg.semantics == "verl" else "zero")
        return AdvantageResult((a[:, None] * mask.to(torch.float64)).to(dtype))
    adv, returns = openrlhf_outcome(zero_rows(rloo_scalars(group, outcome_scores(rewards)), keep), mask, cfg, batch,
                                    whiten=False)
    return AdvantageResult(zero_rows(adv, keep).to(dtype), returns=returns.to(dtype))
