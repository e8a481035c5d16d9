"""Rewards: outcome scores from [B] or [B, T] rewards, token placement, reverse cumulative sums, and
OpenRLHF's path from a shaped reward to (advantages, returns)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from advantage_server.estimators import jit
from advantage_server.errors import InvalidInput
from advantage_server.estimators.kl import apply_kl
from advantage_server.estimators.registry import EstimatorConfig
from advantage_server.estimators.whitening import whiten_openrlhf

def outcome_scores(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B]`` rewards, or ``[B, T]`` token-level rewards summed over all T positions -> float64 ``[B]``.

    With ``mask`` a ``[B, T]`` input is summed over the mask = 1 positions only (``sum_rewards_over_mask``,
    verl PR #6310); a ``[B]`` input is unchanged.
    """
    if mask is not None and rewards.dim() == 2:
        return (rewards.to(torch.float64) * mask.to(torch.float64)).sum(-1)
    if jit.applies(rewards):
        a = rewards.detach().numpy()
        return torch.from_numpy(a.sum(-1, dtype=np.float64) if a.ndim == 2 else a.astype(np.float64))
    r = rewards.to(torch.float64)
    return r.sum(-1) if r.dim() == 2 else r


def sum_over_mask_field(per_semantics: dict[str, bool] | None = None) -> Any:
    """The ``sum_rewards_over_mask`` config field (off by default: verl sums every position)."""
    meta: dict[str, Any] = {
        "doc": "Token-level rewards [B, T]: the outcome score of a row is the sum over its mask = 1 positions "
               "only, so a reward written on a padded or masked position (e.g. at index -1 of an empty "
               "response) is ignored (verl PR #6310). Off (default): the sum over all T positions, as verl "
               "computes it. [B] rewards are unaffected."}
    if per_semantics is None:
        return field(default=False, metadata=meta)
    which = ", ".join(per_semantics)
    return field(default=None, metadata={**meta, "per_semantics": per_semantics,
                                         "default_text": f"false ({which}); not applicable otherwise"})


def place_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards ``[B, T]``: a ``[B, T]`` input as it is (masked positions included), a ``[B]``
    reward on the last mask = 1 position of its row (rows with no valid position get none)."""
    if rewards.dim() == 2:
        return rewards
    B, T = mask.shape
    valid = mask.bool()
    last = T - 1 - valid.flip(1).int().argmax(1)                              # last valid index per row
    out = torch.zeros(B, T, dtype=rewards.dtype, device=rewards.device)
    out.scatter_(1, last[:, None], torch.where(valid.any(1), rewards, 0)[:, None])
    return out


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of the last mask = 1 position of each row; -1 for a row with none."""
    T = mask.shape[1]
    valid = mask.bool()
    last = T - 1 - valid.flip(1).int().argmax(1)
    return torch.where(valid.any(1), last, torch.full_like(last, -1))


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``out_t = sum_{k >= t} x_k`` along the last axis."""
    return x.flip(-1).cumsum(-1).flip(-1)


#: OpenRLHF's ``--reward.clip_range`` default (-10, 10): ``compute_reward`` clamps each shaped reward to it
OPENRLHF_REWARD_CLIP = 10.0


@dataclass(frozen=True)
class OpenRLHFRewardConfig(EstimatorConfig):
    """OpenRLHF's ``--reward.clip_range`` as two fields (``semantics = openrlhf`` only, as the per-semantics
    default says): ``compute_reward`` clamps the shaped reward to ``[reward_clip_min, reward_clip_max]`` before it
    puts it on the row's last action token. Mixed into the configs of the estimators with an openrlhf semantics."""

    reward_clip_min: float | None = field(default=None, metadata={
        "doc": "OpenRLHF --reward.clip_range, low end: the shaped reward is clamped to it. openrlhf only.",
        "per_semantics": {"openrlhf": -OPENRLHF_REWARD_CLIP}, "default_text": "-10.0 (openrlhf); not applicable otherwise"})
    reward_clip_max: float | None = field(default=None, metadata={
        "doc": "OpenRLHF --reward.clip_range, high end. openrlhf only.",
        "per_semantics": {"openrlhf": OPENRLHF_REWARD_CLIP}, "default_text": "10.0 (openrlhf); not applicable otherwise"})

    def validate(self) -> None:
        super().validate()
        lo, hi = self.reward_clip_min, self.reward_clip_max
        if lo is None and hi is None:
            return
        # one end set: the other is OpenRLHF's default (the semantics-dependent default is filled in after validate)
        lo = -OPENRLHF_REWARD_CLIP if lo is None else lo
        hi = OPENRLHF_REWARD_CLIP if hi is None else hi
        if not lo < hi:
            raise InvalidInput("config.reward_clip_min", f"must be below reward_clip_max (OpenRLHF asserts "
                                                         f"clip_range[0] < clip_range[1]), got {lo} and {hi} (an unset "
                                                         "end is OpenRLHF's default, -10 or 10): set both")

    def clip(self, rewards: torch.Tensor) -> torch.Tensor:
        """``rewards`` in float64, clamped to the clip range."""
        return rewards.to(torch.float64).clamp(self.reward_clip_min, self.reward_clip_max)


def no_std_norm_field() -> Any:
    """OpenRLHF's ``--algo.advantage.no_std_norm`` (``semantics = openrlhf`` only)."""
    return field(default=None, metadata={
        "doc": "OpenRLHF --algo.advantage.no_std_norm: the batch whitening subtracts the mean over the mask = 1 "
               "tokens and does not divide by the std. openrlhf only.",
        "per_semantics": {"openrlhf": False}, "default_text": "false (openrlhf); not applicable otherwise"})


def openrlhf_outcome(shaped: torch.Tensor, mask: torch.Tensor, cfg, batch, whiten: bool = True,
                     no_std_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's path from a shaped scalar reward ``[B]`` to (advantages, returns), float64 ``[B, T]`` each.

    The shaped reward, clamped to ``[cfg.reward_clip_min, cfg.reward_clip_max]`` (``compute_reward`` with
    ``--reward.clip_range``, default +-10), sits on the row's last mask = 1 position, minus the masked KL
    penalty when the config folds KL into the reward; returns G = reverse cumulative sum of the token rewards
    times mask (``get_cumulative_returns`` with gamma 1, forced by OpenRLHF for the group estimators);
    advantages = G whitened over the mask = 1 tokens (biased variance, ``max(var, 1e-8)``; only the mean
    subtracted with ``no_std_norm``), at every position (``reinforce_baseline``), or G itself with
    ``whiten=False`` (``rloo``, ``group_norm``, ``dr_grpo``: OpenRLHF 0.11.2 whitens only ``gae``,
    ``reinforce`` and ``reinforce_baseline``).
    """
    tokens = apply_kl(place_rewards(cfg.clip(shaped), mask), cfg, batch, mask=mask)
    returns = reverse_cumsum(tokens * mask.to(torch.float64))
    if not whiten:
        return returns, returns
    return whiten_openrlhf(returns, mask, no_std_norm), returns
