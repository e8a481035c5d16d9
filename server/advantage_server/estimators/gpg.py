"""GPG, group policy gradient (arXiv:2504.02546).

Reference: verl ``compute_gpg_outcome_advantage``.
Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions), ``mask``
[B, T]. Output: advantages [B, T]; no returns (verl returns the advantages twice), no metrics.

Math:
    alpha   = B / max(#{i : s_i != 0}, 1)     (verl recomputes it from the batch, ignoring its keyword)
    A_i     = alpha * (s_i - mean_g) / f_norm  a group of one has mean 0
    A_{i,t} = A_i * mask_{i,t}
Default f_norm = 1.0 (must be > 0). Group means in float64, exact for tied groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.common import MASK, OUTCOME_REWARDS, PROMPT_IDS, outcome_scores, verl_group_stats
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class GPGConfig(EstimatorConfig):
    f_norm: float = field(default=1.0, metadata={"doc": "Divisor of the advantage; must be > 0.", "range": (0.0, None)})

    def validate(self) -> None:
        super().validate()
        if self.f_norm <= 0:
            raise InvalidInput("config.f_norm", f"must be > 0, got {self.f_norm}")


def gpg_scalars(group: torch.Tensor, scores: torch.Tensor, f_norm: float) -> torch.Tensor:
    """Per-sample GPG advantage, float64 ``[B]``."""
    s = scores.to(torch.float64)
    alpha = s.shape[0] / (s != 0).sum().clamp(min=1).to(torch.float64)
    mean, _ = verl_group_stats(group, s)
    return alpha * (s - mean) / f_norm


@register("gpg", config=GPGConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK],
          reference="arXiv:2504.02546; verl compute_gpg_outcome_advantage")
def gpg(cfg: GPGConfig, batch: Batch) -> AdvantageResult:
    """Group-centred reward scaled by the batch's share of non-zero rewards, on the valid tokens.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where mask = 0).
    """
    rewards, mask = batch["rewards"], batch["mask"]
    adv = gpg_scalars(batch["prompt_ids"], outcome_scores(rewards), cfg.f_norm)
    return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(rewards.dtype))
