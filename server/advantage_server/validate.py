"""Input and output checks at memory speed: "every value finite", "the mask holds only 0 and 1".

The core checks every float input for NaN/infinity, every non-bool mask for values other than 0 and 1,
and every result for overflow. With torch these are several ``[B, T]`` passes with ``[B, T]`` bool
temporaries each (``torch.isfinite(t).all()``, ``((m == 0) | (m == 1)).all()``), and they run on
torch's intra-op threads, which stall when another process holds a core (see
:mod:`advantage_server.estimators.jit`). On the CPU with numba the checks here are one read-only pass
per tensor, rows split over the cores by :func:`~advantage_server.estimators.jit.parallel_rows` with the
GIL released, and no temporaries. On a GPU, without numba, and for dtypes numba has no kernel for
(float16, bfloat16) the torch expressions run as before; both give the same answers.

:func:`cast` moves a CPU tensor to another dtype with numpy (single pass, off torch's thread pool), and
returns the tensor itself when it already has the dtype. :func:`max_abs_int_over` finds an integer input too
large for float32 (or float64) to hold exactly, before the core casts it to the compute dtype.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from advantage_server.estimators import jit

_NUMBA_FLOAT = (torch.float32, torch.float64)
_NUMBA_MASK = (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.int8, torch.int16)
_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.int64: np.int64,
       torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
       torch.bool: np.bool_}


# ----------------------------------------------------------------------------------------- kernels
@jit.njit(reassoc=True)
def _finite_rows(lo, hi, a, ok):  # pragma: no cover - compiled; tested through all_finite
    """ok[b] = every value of row b is finite. ``x - x`` is 0 for a finite x and NaN otherwise; the
    sum of those runs on SIMD lanes (reassoc) and stays 0 exactly when the whole row is finite."""
    C = a.shape[1]
    for b in range(lo, hi):
        acc = a[b, 0] - a[b, 0]
        for t in range(1, C):
            acc += a[b, t] - a[b, t]
        ok[b] = acc == 0


@jit.njit
def _binary_rows(lo, hi, m, ok):  # pragma: no cover - compiled; tested through is_binary
    """ok[b] = every value of row b is 0 or 1 (NaN is neither). Counts the offenders branch-free so
    the loop vectorises; a NaN compares unequal to both."""
    C = m.shape[1]
    for b in range(lo, hi):
        bad = 0
        for t in range(C):
            x = m[b, t]
            bad += (x != 0) & (x != 1)
        ok[b] = bad == 0


@jit.njit(reassoc=True)
def _abs_sum_rows(lo, hi, a, out):  # pragma: no cover - compiled; tested through max_abs_over
    """out[b] = sum of |x| over row b in float64 (NaN when the row holds a NaN): an upper bound of the
    row's largest magnitude that runs on SIMD lanes, unlike a max (which numba does not vectorise)."""
    C = a.shape[1]
    for b in range(lo, hi):
        acc = 0.0
        for t in range(C):
            acc += abs(a[b, t])
        out[b] = acc


@jit.njit
def _abs_max_rows(lo, hi, a, out):  # pragma: no cover - compiled; tested through max_abs_over
    """out[b] = the largest |x| of row b, NaN values skipped (0 for a row of NaN)."""
    C = a.shape[1]
    for b in range(lo, hi):
        m = 0.0
        for t in range(C):
            x = abs(a[b, t])
            if x > m:
                m = x
        out[b] = m


def _rows(a: np.ndarray) -> np.ndarray:
    """A C-contiguous 2-D view: ``[B, ...]`` as ``[B, rest]``; a 1-D or 0-D array as one row, cut into
    rows when large so the check still splits over the cores."""
    a = np.ascontiguousarray(a)
    if a.ndim >= 2 and a.shape[0] > 1:
        return a.reshape(a.shape[0], -1)
    n = a.size
    for rows in (256, 64, 16, 4):
        if n >= rows * 4096 and n % rows == 0:
            return a.reshape(rows, n // rows)
    return a.reshape(1, n)


def _run(kernel, a: np.ndarray) -> bool:
    r = _rows(a)
    if r.size == 0:
        return True
    ok = np.empty(r.shape[0], dtype=np.bool_)
    jit.parallel_rows(kernel, r.shape[0], r.shape[1], r, ok)
    return bool(ok.all())


def _numba_ok(t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    return jit.enabled() and t.device.type == "cpu" and not t.requires_grad and t.dtype in dtypes


#: float CPU tensors of at most this many elements (a group's rewards, a per-sample result) are checked with one
#: numpy call: the kernels' row split and dispatch cost more than the pass itself there (a few us per check)
SMALL_ELEMENTS = 4096


def _small_numpy(t: torch.Tensor) -> np.ndarray | None:
    """``t`` as a numpy array when it is a small float32/float64 CPU tensor (see :data:`SMALL_ELEMENTS`)."""
    if t.dtype in _NUMBA_FLOAT and t.device.type == "cpu" and t.numel() <= SMALL_ELEMENTS and not t.requires_grad:
        return t.detach().numpy()
    return None


# ----------------------------------------------------------------------------------------- checks
def all_finite(t: torch.Tensor) -> bool:
    """Every value of the float tensor ``t`` is finite (no NaN, no infinity). Integer tensors: True."""
    if not t.is_floating_point():
        return True
    small = _small_numpy(t)
    if small is not None:
        return bool(np.isfinite(small).all())
    if _numba_ok(t, _NUMBA_FLOAT):
        return _run(_finite_rows, t.detach().numpy())
    return bool(torch.isfinite(t).all())


def max_abs_over(t: torch.Tensor, limit: float) -> float | None:
    """The largest magnitude ``max |x|`` of the float tensor ``t`` (NaN values ignored) when it exceeds
    ``limit``, else None (also for an empty or integer tensor).

    On the CPU with numba: one vectorised pass of row sums of ``|x|`` (each an upper bound of its row's
    maximum), and only when a sum exceeds ``limit`` (rare: huge values, or long rows of large ones) a
    second, slower pass for the exact maximum. Elsewhere one torch reduction.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return None
    small = _small_numpy(t)
    if small is not None:
        magnitudes = np.abs(small)
        magnitudes = magnitudes[~np.isnan(magnitudes)]  # NaN values ignored, as below
        biggest = float(magnitudes.max()) if magnitudes.size else 0.0
        return biggest if biggest > limit else None
    if _numba_ok(t, _NUMBA_FLOAT):
        r = _rows(t.detach().numpy())
        sums = np.empty(r.shape[0])
        jit.parallel_rows(_abs_sum_rows, r.shape[0], r.shape[1], r, sums)
        if (sums <= limit).all():  # a NaN sum (a NaN in the row) is looked at below
            return None
        jit.parallel_rows(_abs_max_rows, r.shape[0], r.shape[1], r, sums)
        biggest = float(sums.max())
    else:  # one fused reduction (no [B, T] temporary); NaN (a missing reward) -> again without the NaNs
        a = t.detach()
        biggest = float(torch.linalg.vector_norm(a, ord=float("inf")))
        if math.isnan(biggest):
            biggest = float(torch.nan_to_num(a, nan=0.0).abs().amax())
    return biggest if biggest > limit else None


def max_abs_int_over(t: torch.Tensor, limit: int) -> int | None:
    """The largest magnitude ``max |x|`` of the integer (or bool) tensor ``t``, as an exact Python int, when it
    exceeds ``limit``, else None (also for an empty tensor, and without a pass when the dtype's whole range
    lies within ``limit``: bool, uint8, int8, int16 for any limit >= 2^15). ``t`` must not be floating point.

    One ``min`` and one ``max`` pass (numpy on the CPU, off torch's intra-op threads); no ``abs``, which
    overflows at int64's -2^63."""
    if t.dtype == torch.bool or t.numel() == 0:
        return None
    info = torch.iinfo(t.dtype)
    if max(-info.min, info.max) <= limit:
        return None
    if t.device.type == "cpu" and t.dtype in _NP and not t.requires_grad:
        a = t.detach().numpy()
        low, high = int(a.min()), int(a.max())
    else:
        low, high = (int(v) for v in torch.aminmax(t.detach()))
    biggest = max(-low, high)
    return biggest if biggest > limit else None


def is_binary(t: torch.Tensor) -> bool:
    """Every value of ``t`` is 0 or 1 (a bool tensor always is)."""
    if t.dtype == torch.bool:
        return True
    if _numba_ok(t, _NUMBA_MASK):
        return _run(_binary_rows, t.detach().numpy())
    return bool(((t == 0) | (t == 1)).all())


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as ``dtype``: ``t`` itself when it has it already; a CPU cast between numpy dtypes runs in
    numpy (one pass, no torch intra-op threads); anything else ``Tensor.to``."""
    if t.dtype == dtype:
        return t
    # not to float16: torch rounds float64 -> float16 through float32, numpy directly (the two can differ
    # in the last bit); such casts stay with torch
    if t.device.type == "cpu" and t.dtype in _NP and dtype in _NP and dtype != torch.float16 and not t.requires_grad:
        # an overflow to inf is the caller's to find (run() checks the results are finite and names the input):
        # not a RuntimeWarning on the server's stderr for each such request
        with np.errstate(over="ignore"):
            return torch.from_numpy(t.detach().numpy().astype(_NP[dtype]))
    return t.to(dtype)
