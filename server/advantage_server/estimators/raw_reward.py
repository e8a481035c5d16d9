"""Raw reward as the advantage: no baseline, no value model (NeMo RL ``RawRewardAdvantageEstimator``).

Math: A_{i,t} = r_i, optionally whitened: (A - mu) / sqrt(max(var, 1e-8)) with mu, var over the tokens
where mask = 1 (count floored at 1, so an all-zero mask gives mu = var = 0 and A = r * 1e4, as NeMo does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from advantage_server.estimators import jit
from advantage_server.estimators.groups import broadcast_rows
from advantage_server.estimators.inputs import MASK, REWARDS
from advantage_server.estimators.whitening import masked_moments
from advantage_client.layout import BROADCAST
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class RawRewardConfig(EstimatorConfig):
    normalize_advantages: bool = field(default=True, metadata={"doc": "Whiten over the tokens where mask = 1."})


@register("raw_reward", config=RawRewardConfig, inputs=[REWARDS, MASK],
          reference="NeMo RL RawRewardAdvantageEstimator", per_sample=(("", BROADCAST),))
def raw_reward(cfg: RawRewardConfig, batch: Batch) -> AdvantageResult:
    """The sample's reward at every token, optionally whitened over the valid tokens.

    Inputs: rewards [B], mask [B, T]. Returns advantages [B, T]; no returns, no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    if jit.applies(rewards, mask):
        # CPU: the whitening of a row-constant matrix needs only per-row valid counts
        a = jit.numpy_as(rewards, torch.float64)
        if cfg.normalize_advantages:
            counts = jit.row_counts(mask)
            dt = jit.np_dtype(rewards.dtype)  # the scalar arithmetic of the torch path, in the compute dtype
            denom = max(float(counts.sum()), 1.0)
            mean = (a * counts).sum() / denom
            var = dt((counts * (a - mean) ** 2).sum() / denom)
            a = (jit.numpy_as(rewards, rewards.dtype) - dt(mean)) * (dt(1.0) / np.sqrt(max(var, dt(1e-8))))
        return AdvantageResult(broadcast_rows(torch.from_numpy(np.asarray(a)), batch.B, batch.T, rewards.dtype, batch))
    adv = batch["rewards"][:, None].expand(batch.B, batch.T)
    if cfg.normalize_advantages:
        mean, var = masked_moments(adv, batch["mask"], count_floor=1.0)
        adv = (adv - mean) * torch.rsqrt(var.clamp(min=1e-8))
    return AdvantageResult(adv)
