"""GPG, group policy gradient (arXiv:2504.02546).

Reference: verl ``compute_gpg_outcome_advantage``.
Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions), ``mask``
[B, T]. Output: advantages [B, T]; no returns (verl returns the advantages twice), no metrics.

Math:
    alpha   = B / max(#{i : s_i != 0}, 1)     (verl recomputes it from the batch, ignoring its keyword;
                                               rounded to float32 as verl's int / int64-tensor division is)
    A_i     = alpha * (s_i - mean_g) / f_norm  a group of one has mean 0
    A_{i,t} = A_i * mask_{i,t}
Default f_norm = 1.0 (must be > 0). Group means in float64, exact for tied groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.groups import exclude_empty_field, groups_of, verl_group_stats
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.rewards import outcome_scores, sum_over_mask_field
from advantage_client.layout import BROADCAST_TIMES_MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class GPGConfig(EstimatorConfig):
    f_norm: float = field(default=1.0, metadata={"doc": "Divisor of the advantage; must be > 0.", "range": (0.0, None)})
    exclude_empty_responses: bool = exclude_empty_field(
        extra=" Also left out of alpha: B and the count of non-zero scores are over the non-empty rows.")
    sum_rewards_over_mask: bool = sum_over_mask_field()

    def validate(self) -> None:
        super().validate()
        if self.f_norm <= 0:
            raise InvalidInput("config.f_norm", f"must be > 0, got {self.f_norm}")


def gpg_scalars(group: torch.Tensor, scores: torch.Tensor, f_norm: float,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample GPG advantage, float64 ``[B]``; ``keep``: the rows alpha counts (None: all)."""
    s = scores.to(torch.float64)
    counted = s if keep is None else s[keep]
    # verl divides the int B by an int64 count tensor: torch's true division gives float32, so alpha is
    # rounded to float32 (4 / 3 -> 1.3333334) whatever the rewards' dtype
    alpha = (counted.shape[0] / (counted != 0).sum().clamp(min=1).cpu()).to(torch.float64).to(counted.device)
    mean, _ = verl_group_stats(group, s)
    return alpha * (s - mean) / f_norm


@register("gpg", config=GPGConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK],
          reference="arXiv:2504.02546; verl compute_gpg_outcome_advantage",
          per_sample=(("", BROADCAST_TIMES_MASK),))
def gpg(cfg: GPGConfig, batch: Batch) -> AdvantageResult:
    """Group-centred reward scaled by the batch's share of non-zero rewards, on the valid tokens.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where mask = 0).
    """
    rewards, mask = batch["rewards"], batch["mask"]
    group, keep = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own (A = 0 there)
    scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
    adv = gpg_scalars(group, scores, cfg.f_norm, keep)
    unscaled = gpg_scalars(group, scores, 1.0, keep) if cfg.f_norm < 1.0 and not _fits(adv, rewards.dtype) else None
    if unscaled is not None and _fits(unscaled, rewards.dtype):
        # dividing by f_norm is what overflows (a tiny f_norm such as 1e-300): name the field, not the inputs
        limit = torch.finfo(rewards.dtype).max
        need = float(unscaled.abs().max()) / limit
        raise InvalidInput("config.f_norm", f"{cfg.f_norm:g} is too small: alpha * (reward - group mean) / f_norm "
                                            f"exceeds the largest {str(rewards.dtype).replace('torch.', '')} "
                                            f"({limit:.4g}); use f_norm >= {need:.3g} (the default is 1.0)")
    return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(rewards.dtype))


def _fits(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every value finite and within ``dtype``'s range."""
    return values.numel() == 0 or (bool(torch.isfinite(values).all())
                                   and float(values.abs().max()) <= torch.finfo(dtype).max)
