"""GDPO: group reward-decoupled policy optimisation (arXiv:2601.05242).

Math: for each reward component k (inputs named ``reward/<name>``, taken in sorted name order)
    A_k = GRPO advantage of component k (per-prompt baseline, optional std normalisation)
    A   = sum_k w_k A_k                         (w = reward_weights, default all 1)
    A   = (A - mean_B(A)) / std_B(A)            (over all B rows, unbiased std; if std = 0: A - mean)
A is broadcast over every column of its row. Fewer than two components is an error.
Reference: NeMo RL ``GDPOAdvantageEstimator`` (which ignores ``rewards``; so do we: it is not an input).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators import jit
from advantage_server.estimators.common import (
    MASK, PROMPT_IDS, broadcast_rows, group_relative, weighted_group_relative,
)
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, InputSpec, register

COMPONENT_PREFIX = "reward/"


@dataclass(frozen=True)
class GDPOConfig(EstimatorConfig):
    normalize_rewards: bool = field(default=True, metadata={"doc": "Normalise each component's advantage by its group std."})
    use_leave_one_out_baseline: bool = field(default=True, metadata={"doc": "Leave-one-out baseline per component (RLOO)."})
    reward_weights: tuple[float, ...] | None = field(default=None, metadata={"doc": "One weight per component in sorted name order; unset = all 1.0."})


@jit.njit
def _moments(t):  # pragma: no cover - compiled; tested through gdpo
    """(mean, unbiased std) of ``t``, two-pass in float64 (std 0 for n = 1)."""
    n = t.shape[0]
    total = 0.0
    for i in range(n):
        total += t[i]
    mean = total / n
    m2 = 0.0
    for i in range(n):
        d = t[i] - mean
        m2 += d * d
    return mean, (np.sqrt(m2 / (n - 1)) if n > 1 else 0.0)


@jit.njit
def _standardize(t):  # pragma: no cover - compiled; tested through gdpo
    """In place: t = (t - mean) / std with :func:`_moments`, or t - mean where std = 0 or B = 1."""
    mean, sd = _moments(t)
    for i in range(t.shape[0]):
        t[i] = (t[i] - mean) / sd if sd > 0 else t[i] - mean


@jit.njit
def _standardized_rows(lo, hi, t, mean, sd, out):  # pragma: no cover - compiled; tested through gdpo
    """Rows ``lo..hi-1`` of the result: :func:`_standardize`'s value of t[b], cast to ``out``'s dtype, in
    every column (what ``_standardize`` + ``broadcast_rows`` write, without the [B] cast temporary)."""
    for b in range(lo, hi):
        x = (t[b] - mean) / sd if sd > 0 else t[b] - mean
        for j in range(out.shape[1]):
            out[b, j] = x


@register(
    "gdpo", config=GDPOConfig,
    inputs=[
        PROMPT_IDS, MASK,
        InputSpec("reward/<name>", ("[B]",), "float",
                  "One reward component per key, e.g. reward/correctness, reward/format; at least two.",
                  fix="send two or more reward components as inputs named reward/<name>, or use grpo for a single reward"),
    ],
    reference="arXiv:2601.05242; NeMo RL GDPOAdvantageEstimator",
)
def gdpo(cfg: GDPOConfig, batch: Batch) -> AdvantageResult:
    """Per-component GRPO advantages, weighted, summed and standardised over the batch.

    Inputs: prompt_ids [B], reward/<name> [B] (two or more), mask [B, T].
    Returns advantages [B, T]; no returns, no metrics.
    """
    components = batch.with_prefix(COMPONENT_PREFIX)
    names = list(components)
    if len(names) < 2:
        raise InvalidInput("inputs['reward/<name>']",
                           f"gdpo needs at least two reward components named reward/<name>; got {names or 'none'}. "
                           "Send each reward separately, or choose grpo for a single reward")
    weights = cfg.reward_weights if cfg.reward_weights is not None else (1.0,) * len(names)
    if len(weights) != len(names):
        raise InvalidInput("config.reward_weights",
                           f"has {len(weights)} entries but the batch has {len(names)} components {names}; "
                           "give one weight per component, in sorted component-name order")
    group = batch["prompt_ids"]
    dtype = components[names[0]].dtype
    fused = weighted_group_relative(group, [components[k] for k in names], tuple(weights),
                                    cfg.use_leave_one_out_baseline, cfg.normalize_rewards)
    if fused is not None:  # CPU (numba): the weighted sum in one pass over the groups, standardised in place
        t = fused.numpy()
        if dtype in (torch.float32, torch.float64):  # standardised straight into the [B, T] rows
            mean, sd = _moments(t)
            out = batch.output("advantages", dtype)
            jit.parallel_rows(_standardized_rows, batch.B, batch.T, t, mean, sd, out.numpy())
            return AdvantageResult(out)
        _standardize(t)
        return AdvantageResult(broadcast_rows(fused, batch.B, batch.T, dtype, batch))
    parts = [group_relative(group, components[k], cfg.use_leave_one_out_baseline, cfg.normalize_rewards)
             for k in names]
    total = sum(w * p for w, p in zip(weights, parts))
    centred = total - total.mean()
    std = total.std() if total.numel() > 1 else torch.zeros((), dtype=total.dtype, device=total.device)
    adv = torch.where(std > 0, centred / std, centred)
    return AdvantageResult(broadcast_rows(adv, batch.B, batch.T, dtype, batch))
