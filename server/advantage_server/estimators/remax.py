"""ReMax (Li et al. 2023, arXiv:2310.10505): REINFORCE with the greedy rollout's reward as the baseline.

Reference: verl ``compute_remax_outcome_advantage``.
Inputs: ``rewards`` [B] (placed on the row's last mask = 1 position) or [B, T] token-level rewards,
``mask`` [B, T], ``reward_baselines`` [B] (the reward of each prompt's greedy rollout). No config.
Output: advantages [B, T] and returns [B, T]; no metrics.

Math:
    G_{i,t} = sum_{k >= t} r_{i,k} mask_{i,k}               (undiscounted reward-to-go; returns)
    A_{i,t} = G_{i,t} - b_i * mask_{i,t}
At mask = 0 positions inside holes and in prompt offsets A = G (the baseline is subtracted only under
the mask), after the last valid position both are 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from advantage_server.estimators.inputs import MASK, TOKEN_REWARDS
from advantage_server.estimators.rewards import place_rewards, reverse_cumsum
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, InputSpec, register


@dataclass(frozen=True)
class ReMaxConfig(EstimatorConfig):
    pass


@register("remax", config=ReMaxConfig,
          inputs=[TOKEN_REWARDS, MASK,
                  InputSpec("reward_baselines", ("[B]",), "float",
                            "Reward of each prompt's greedy (argmax) rollout, the ReMax baseline.",
                            fix="generate one greedy rollout per prompt, score it, and send its reward per sample")],
          reference="arXiv:2310.10505; verl compute_remax_outcome_advantage", produces_returns=True)
def remax(cfg: ReMaxConfig, batch: Batch) -> AdvantageResult:
    """Reward-to-go minus the greedy rollout's reward on the valid tokens.

    Inputs: rewards [B] or [B, T], mask [B, T], reward_baselines [B]. Returns advantages and returns [B, T].
    """
    rewards, mask = batch["rewards"], batch["mask"]
    m = mask.to(torch.float64)
    returns = reverse_cumsum(place_rewards(rewards, mask).to(torch.float64) * m)
    adv = returns - batch["reward_baselines"].to(torch.float64)[:, None] * m
    return AdvantageResult(adv.to(rewards.dtype), returns=returns.to(rewards.dtype))
