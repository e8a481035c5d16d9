"""Masked whitening over the valid tokens of a batch: NeMo RL's clamped (biased) form, verl's
``masked_whiten`` (unbiased, its float32 scalars), slime's ``distributed_masked_whiten`` (unbiased, one
process), and the per-row form for row-constant advantages."""
from __future__ import annotations

import math
from dataclasses import field
from typing import Any

import numpy as np
import torch

from advantage_server.estimators import jit

def masked_moments(x: torch.Tensor, mask: torch.Tensor, count_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of ``x`` over positions where ``mask`` is 1, accumulated in float64.

    ``count_floor`` keeps the division finite when the mask is empty (mean 0, variance 0 then).
    Returns two 0-d tensors in ``x.dtype``.
    """
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    count = m.sum()
    denom = torch.clamp(count, min=count_floor)
    mean = (xd * m).sum() / denom
    var = ((xd - mean).square() * m).sum() / denom
    return mean.to(x.dtype), var.to(x.dtype)


def whiten_unbiased(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl ``masked_whiten``: ``(x - mu) * rsqrt(var + 1e-8)`` at every position (float64 sums), with
    verl's own scalars over the n positions where mask = 1: ``mu = sum(x m) / (n + 1e-8)`` (``masked_mean``)
    and ``var = sum((x - mu)^2 m) / (n + 1e-8) * (n / (n - 1))`` (``masked_var``, unbiased), each scalar in
    the dtype torch gives verl for its int64 response mask (``compute_response_mask``): ``n + 1e-8`` and
    ``n / (n - 1)`` are float32, so ``n + 1e-8`` is n and the Bessel factor is rounded to float32 (the
    server sees masks as floats, so this is applied whatever dtype the caller's mask had; verl with a
    float64 mask would divide by n + 1e-8 in float64, a relative difference of 1e-8 / n).

    Where verl raises (``masked_var``: n = 0 or 1) the result stays finite: var = 0, so with no valid
    position mu = 0, and with one the valid position's advantage is 0.
    """
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    msum = m.sum().round().to(torch.int64)             # verl's int64 mask.sum()
    n = msum.to(torch.float64)
    denom = (msum + 1e-8).to(torch.float64)            # verl's masked_mean denominator (float32: n)
    mean = (xd * m).sum() / denom.clamp(min=1.0) if bool(n < 1) else (xd * m).sum() / denom
    bessel = (msum / (msum - 1)).to(torch.float64) if bool(n > 1) else torch.ones((), dtype=torch.float64)
    var = ((xd - mean).square() * m).sum() / denom * bessel
    var = torch.where(n > 1, var, torch.zeros_like(var))
    if bool(n == 1):  # the one valid position gets exactly 0
        mean = (xd * m).sum()
    return ((xd - mean) * torch.rsqrt(var + 1e-8)).to(x.dtype)


def whiten_clamped(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NeMo RL / OpenRLHF whitening: ``(x - mu) * rsqrt(max(var, 1e-8))`` at every position, mu and the
    biased variance over the positions where mask = 1 (float64; no valid position: mu = var = 0)."""
    mean, var = masked_moments(x.to(torch.float64), mask, count_floor=1.0)
    return ((x.to(torch.float64) - mean) * torch.rsqrt(var.clamp(min=1e-8))).to(x.dtype)


def whiten_slime(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """slime's ``distributed_masked_whiten`` (``slime/utils/distributed_utils.py`` at the ``slime`` reference's
    commit, ``shift_mean=True``, epsilon 1e-8) over one process's batch: ``(x - mu) * rsqrt(var + 1e-8)`` at every
    position, mu the mean and var the unbiased variance (times n / (n - 1) from n = 2 on) over the n positions
    where mask = 1.

    x, mask: ``[B, T]``; returns float64 ``[B, T]``. slime sums ``x`` and ``x^2`` in float32 and takes
    ``E[x^2] - mu^2``, which cancels when the mean is large against the spread (and can go negative: NaN); here
    the variance is the two-pass float64 sum, the value slime's formula approximates. With one valid position
    var = 0 (as slime); with none slime raises, and here mu = var = 0 (finite)."""
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    n = m.sum()
    mean = (xd * m).sum() / n.clamp(min=1.0)
    var = ((xd - mean).square() * m).sum() / n.clamp(min=1.0)
    var = torch.where(n >= 2, var * n / (n - 1).clamp(min=1.0), var)
    return (xd - mean) * torch.rsqrt(var + 1e-8)


def whiten_openrlhf(x: torch.Tensor, mask: torch.Tensor, no_std_norm: bool = False) -> torch.Tensor:
    """OpenRLHF 0.11.2's batch whitening (the end of ``compute_advantages_and_returns``), ``[B, T]``:
    :func:`whiten_clamped`, or with ``no_std_norm`` (``--algo.advantage.no_std_norm``) only ``x - mu``, mu the
    mean over the mask = 1 positions (float64; no valid position: mu = 0), at every position."""
    if not no_std_norm:
        return whiten_clamped(x, mask)
    mean, _ = masked_moments(x.to(torch.float64), mask, count_floor=1.0)
    return (x.to(torch.float64) - mean).to(x.dtype)


def whiten_rows_clamped(a: np.ndarray, mask: torch.Tensor) -> np.ndarray:
    """:func:`whiten_clamped` of the row-constant ``[B, T]`` matrix ``a[:, None]``, as its ``[B]`` rows.

    CPU (numba) path: the masked moments of a row-constant matrix need only the valid count of each
    row, so the ``[B, T]`` float64 temporaries of the general function are never built. ``a`` float64.
    """
    out = np.empty_like(a)
    _whiten_const_rows(a, jit.row_counts(mask), out)
    return out


@jit.njit(reassoc=True)
def _whiten_const_rows(a, counts, out):  # pragma: no cover - compiled; tested through reinforce_plus_plus
    """out = (a - mean) / sqrt(max(var, 1e-8)), mean and biased var of a weighted by counts (float64,
    two passes): compiled, because at small T numpy's temporaries cost more than the rest of the call."""
    n = 0.0
    total = 0.0
    for b in range(a.shape[0]):
        n += counts[b]
        total += a[b] * counts[b]
    denom = max(n, 1.0)
    mean = total / denom
    m2 = 0.0
    for b in range(a.shape[0]):
        d = a[b] - mean
        m2 += counts[b] * d * d
    scale = 1.0 / math.sqrt(max(m2 / denom, 1e-8))
    for b in range(a.shape[0]):
        out[b] = (a[b] - mean) * scale


def slime_whiten_field(default: bool, roll: bool = False) -> Any:
    """``normalize_advantages`` under slime: its ``--normalize-advantages`` (:func:`whiten_slime`). ``default``:
    true where slime requires the flag for the estimator (reinforce_plus_plus, reinforce_plus_plus_baseline), false
    where it is slime's off-by-default option (grpo). ``roll``: also under roll, ROLL's ``whiten_advantages``
    (default false; :func:`whiten_unbiased`, see :mod:`~advantage_server.estimators.roll`)."""
    required = " (which slime requires for this estimator)" if default else ""
    per = {"slime": default, **({"roll": False} if roll else {})}
    also = "; roll: ROLL's whiten_advantages (masked_whiten, unbiased)" if roll else ""
    return field(default=None, metadata={
        "doc": f"slime --normalize-advantages{required}: whiten the advantages over the mask = 1 tokens of the batch "
               f"(distributed_masked_whiten on one process; the returns stay unwhitened){also}. "
               f"{'slime and roll' if roll else 'slime'} only.",
        "per_semantics": per,
        "default_text": f"{str(default).lower()} (slime){'; false (roll)' if roll else ''}; not applicable otherwise"})
