"""Reinforce++ (Hu et al. 2025, arXiv:2501.03262), NeMo RL flavour.

Math:
    a_i      = r_i - mean of prompt group (minus_baseline; a group of one gets 0), else r_i
    A_{i,t}  = a_i - penalty * KL_t                  (use_kl_in_reward; KL estimator k1/k2/k3)
    A        = (A - mu) / sqrt(max(var, 1e-8))       mu, var over the tokens where mask = 1
The whitening is applied at every position, masked ones included (as NeMo RL does).
With no valid token at all, mu = var = 0 (NeMo raw_reward's count floor of 1), so A = a * 1e4:
finite where the reference divides by zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from advantage_server.estimators.common import (
    KL_INPUTS, MASK, PROMPT_IDS, REWARDS, KLInRewardConfig, apply_kl, group_relative, masked_moments,
)
from advantage_server.estimators.registry import AdvantageResult, Batch, register


@dataclass(frozen=True)
class ReinforcePlusPlusConfig(KLInRewardConfig):
    minus_baseline: bool = field(default=True, metadata={"doc": "Subtract the per-prompt mean reward."})


_PROMPT_IDS = replace(PROMPT_IDS, required=False, required_when=(lambda cfg: cfg.minus_baseline, "minus_baseline = true"),
                      fix=PROMPT_IDS.fix + ", or set minus_baseline = false")


@register("reinforce_plus_plus", config=ReinforcePlusPlusConfig,
          inputs=[_PROMPT_IDS, REWARDS, MASK, *KL_INPUTS],
          reference="arXiv:2501.03262; NeMo RL ReinforcePlusPlusAdvantageEstimator")
def reinforce_plus_plus(cfg: ReinforcePlusPlusConfig, batch: Batch) -> AdvantageResult:
    """Reward minus the per-prompt mean, minus an optional token-level KL, whitened over valid tokens.

    Inputs: prompt_ids [B] (read when minus_baseline), rewards [B], mask [B, T]; logprobs and
    reference_logprobs [B, T] when use_kl_in_reward. Returns advantages [B, T]; no returns, no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    if cfg.minus_baseline:
        a = group_relative(batch["prompt_ids"], rewards, leave_one_out=False, normalize=False).to(rewards.dtype)
    else:
        a = rewards
    adv = apply_kl(a[:, None].expand(batch.B, batch.T), cfg, batch)
    mean, var = masked_moments(adv, mask, count_floor=1.0)
    return AdvantageResult((adv - mean) * torch.rsqrt(var.clamp(min=1e-8)))
