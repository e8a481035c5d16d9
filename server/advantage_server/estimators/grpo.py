"""GRPO: group-relative advantages (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

Math, per sample i of prompt group g (n samples):
    baseline_i = mean of the group's rewards            (leave-one-out: mean of the others, RLOO)
    std_i      = sample std of the same set             (0 for a set of fewer than 2)
    A_i        = r_i - baseline_i,  then  A_i / (std_i + 1e-6) where std_i > 0 (normalize_rewards)
A group of one gets A = 0. A_i is broadcast over every column of row i, masked columns included.
Reference: NeMo RL ``GRPOAdvantageEstimator``; the statistics kernel is
:func:`~advantage_server.estimators.common.group_baseline_and_std` (loop twin beside it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from advantage_server.estimators.common import MASK, PROMPT_IDS, REWARDS, group_relative
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class GRPOConfig(EstimatorConfig):
    normalize_rewards: bool = field(default=True, metadata={"doc": "Divide by the group std + 1e-6 (groups with std 0 stay unscaled)."})
    use_leave_one_out_baseline: bool = field(default=True, metadata={"doc": "Baseline and std over the other samples of the prompt (RLOO)."})


@register("grpo", config=GRPOConfig, inputs=[PROMPT_IDS, REWARDS, MASK],
          reference="arXiv:2402.03300; NeMo RL GRPOAdvantageEstimator")
def grpo(cfg: GRPOConfig, batch: Batch) -> AdvantageResult:
    """Group-relative advantage: reward minus the per-prompt baseline, optionally over the per-prompt std.

    Inputs: prompt_ids [B], rewards [B], mask [B, T]. Returns advantages [B, T]; no returns, no metrics.
    """
    rewards = batch["rewards"]
    adv = group_relative(batch["prompt_ids"], rewards, cfg.use_leave_one_out_baseline, cfg.normalize_rewards)
    return AdvantageResult(adv.to(rewards.dtype)[:, None].expand(batch.B, batch.T))
