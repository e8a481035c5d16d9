"""Reinforce++-baseline (Hu et al. 2025, arXiv:2501.03262): reward minus the prompt group's mean, whitened.

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T], ``mask`` [B, T]; ``logprobs`` and
``reference_logprobs`` [B, T] when ``use_kl_in_reward`` (KL_t as in reinforce_plus_plus).

``semantics = verl`` (default; verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``). No returns
(verl returns the advantages twice).
    s_i     = r_i - penalty * sum_t KL_t mask_t     (r: [B] rewards, or [B, T] summed over all T)
    a_i     = s_i - mean_g(s)        a group of one has mean 0, so a = s
    A_{i,t} = whiten(a_i * mask_{i,t}) * mask_{i,t}, whiten = (x - mu) * rsqrt(var + 1e-8) with mu and
              the unbiased variance over the mask = 1 tokens (one valid token: var = 0; none: mu = var = 0,
              where verl divides by zero).
``semantics = openrlhf`` (OpenRLHF 0.11.2 ``reinforce_baseline``). Returns G.
    a_i     = r_i - mean_g(r)        ([B, T] rewards summed over T; a group of one gets 0)
    r_t     = clamp(a_i, +-10) on the row's last mask = 1 position (OpenRLHF's default
              ``--reward.clip_range``), minus penalty * KL_t * mask_t
    G_t     = sum_{k >= t} r_k mask_k                            (gamma 1, as OpenRLHF forces)
    A       = (G - mu) / sqrt(max(var, 1e-8)), mu and biased var over the mask = 1 tokens, every position.
``semantics = slime`` (slime's ``reinforce_plus_plus_baseline``: the rollout's ``_post_process_rewards``, then the
    trainer's ``compute_advantages_and_returns``). Returns the advantages before whitening.
    a_i     = r_i - mean_g(r)   with ``rewards_normalization`` (slime's default; a group of one gets 0), else r_i
              (rewards its rollout already centred)
    A_{i,t} = a_i - penalty * KL_t at EVERY position of the row (the KL is not masked; no KL without
              ``use_kl_in_reward``, slime's ``--kl-coef 0``), returns = A
    A       = whiten(A) over the mask = 1 tokens of the batch with ``normalize_advantages`` (slime requires
              ``--normalize-advantages`` for this estimator, so it defaults to true here;
              :func:`~advantage_server.estimators.whitening.whiten_slime`).
    KL: slime's ``compute_approx_kl``: k1 by default, no clamps (its ``low_var_kl`` is k3 with
    ``kl_output_clamp_value = 10``).

Kernel: group means by index_add (float64, tied groups exact); :func:`rppb_scalars_loop` is the
per-group loop twin (test oracle) of the per-sample baseline step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from advantage_server.estimators.groups import (
    group_baseline_and_std, exclude_empty_field, groups_of, slime_group_norm_field, verl_group_stats, zero_rows,
)
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.kl import KL_INPUTS, KLInRewardConfig, kl_clamp_field, kl_penalty, kl_total, kl_type_field
from advantage_server.estimators.rewards import (
    OpenRLHFRewardConfig, no_std_norm_field, openrlhf_outcome, outcome_scores, sum_over_mask_field,
)
from advantage_server.estimators.whitening import slime_whiten_field, whiten_slime, whiten_unbiased
from advantage_client.layout import BROADCAST, BROADCAST_TIMES_MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, register, semantics_field


@dataclass(frozen=True)
class ReinforcePlusPlusBaselineConfig(KLInRewardConfig, OpenRLHFRewardConfig):
    semantics: str | None = semantics_field(
        ("verl", "openrlhf", "slime"),
        "Reference reproduced: verl (compute_reinforce_plus_plus_baseline_outcome_advantage), openrlhf "
        "(reinforce_baseline), slime (reinforce_plus_plus_baseline: _post_process_rewards and "
        "compute_advantages_and_returns).")
    # KL in the reward: NeMo RL's defaults (k3, clamps 20 and 10), slime's compute_approx_kl under slime
    reference_policy_kl_type: str | None = kl_type_field(("verl", "openrlhf"), ("slime",))
    kl_input_clamp_value: float | None = kl_clamp_field("input", 20.0, ("verl", "openrlhf"), ("slime",))
    kl_output_clamp_value: float | None = kl_clamp_field("output", 10.0, ("verl", "openrlhf"), ("slime",))
    rewards_normalization: bool | None = slime_group_norm_field(divides=False)
    normalize_advantages: bool | None = slime_whiten_field(default=True)
    exclude_empty_responses: bool = exclude_empty_field()
    sum_rewards_over_mask: bool | None = sum_over_mask_field({"verl": False})
    no_std_norm: bool | None = no_std_norm_field()


def rppb_scalars(group: torch.Tensor, scores: torch.Tensor, semantics: str) -> torch.Tensor:
    """Per-sample ``score - group mean``, float64 ``[B]``; a group of one: verl keeps s, openrlhf gives 0."""
    if semantics == "verl":
        mean, _ = verl_group_stats(group, scores)
    else:
        mean, _ = group_baseline_and_std(group, scores, leave_one_out=False)
    return scores.to(torch.float64) - mean


def rppb_scalars_loop(group: torch.Tensor, scores: torch.Tensor, semantics: str) -> torch.Tensor:
    """Loop twin of :func:`rppb_scalars` (test oracle)."""
    s = scores.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    out = list(s)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        vals = [s[i] for i in members]
        if len(members) == 1:
            mean = 0.0 if semantics == "verl" else vals[0]
        else:
            mean = vals[0] if all(v == vals[0] for v in vals) else sum(vals) / len(vals)
        for i in members:
            out[i] = s[i] - mean
    return torch.tensor(out, dtype=torch.float64)


@register("reinforce_plus_plus_baseline", config=ReinforcePlusPlusBaselineConfig,
          inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK, *KL_INPUTS],
          reference="arXiv:2501.03262; verl compute_reinforce_plus_plus_baseline_outcome_advantage; "
                    "OpenRLHF reinforce_baseline",
          produces_returns=(lambda cfg: cfg.semantics in ("openrlhf", "slime"), "semantics = openrlhf or semantics = slime"),
          # verl: the per-row score (KL summed in) whitened by batch scalars, times mask; openrlhf whitens
          # the cumulative returns, which is not 0 after the last valid token; slime without KL broadcasts the
          # centred reward over the whole row (whitening keeps a row-constant matrix row-constant)
          per_sample=(("semantics = verl", BROADCAST_TIMES_MASK),
                      ("semantics = slime and use_kl_in_reward = false", BROADCAST)))
def reinforce_plus_plus_baseline(cfg: ReinforcePlusPlusBaselineConfig, batch: Batch) -> AdvantageResult:
    """Reward minus the per-prompt mean reward, whitened over the valid tokens of the batch.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]; logprobs and reference_logprobs [B, T] when
    use_kl_in_reward. Returns advantages [B, T]; returns [B, T] under openrlhf semantics; no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    group, keep = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own
    dtype = rewards.dtype
    if cfg.semantics == "verl":
        scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
        a = rppb_scalars(group, scores - kl_total(cfg, batch, mask), "verl")
        m = mask.to(torch.float64)
        return AdvantageResult((whiten_unbiased(a[:, None] * m, mask) * m).to(dtype))
    if cfg.semantics == "slime":
        a = outcome_scores(rewards).to(torch.float64)
        if cfg.rewards_normalization:
            a = rppb_scalars(group, a, "openrlhf")  # a group of one gets 0 (slime: r - r)
        adv = zero_rows(a, keep)[:, None].expand(batch.B, batch.T)
        if cfg.use_kl_in_reward and cfg.reference_policy_kl_penalty != 0:  # every position: slime does not mask it
            kl = kl_penalty(batch["logprobs"], batch["reference_logprobs"], cfg.reference_policy_kl_type,
                            cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
            adv = adv - cfg.reference_policy_kl_penalty * kl
        returns = adv.to(dtype)
        if cfg.normalize_advantages:
            adv = whiten_slime(adv, mask)
        return AdvantageResult(adv.to(dtype), returns=returns)
    adv, returns = openrlhf_outcome(zero_rows(rppb_scalars(group, outcome_scores(rewards), "openrlhf"), keep), mask,
                                    cfg, batch, no_std_norm=cfg.no_std_norm)
    return AdvantageResult(zero_rows(adv, keep).to(dtype), returns=returns.to(dtype))
