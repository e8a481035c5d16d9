"""Opt-in glibc ``malloc`` settings for the server process, applied when :mod:`advantage_server` is imported
with ``ADVANTAGE_MALLOC_TUNING=1`` in the environment (off by default).

The estimators write dense ``[B, T]`` outputs (16-256 MiB per request at the sizes trainers send), and
on a VM the page faults of freshly mapped memory cost more than writing it (~1.8 us per 4 KiB page on
the benchmark machine: a fresh 64 MiB output took ~30 ms to write against ~3 ms into reused memory).
With the switch on, glibc's mmap threshold is fixed at 32 MiB (its maximum) and its trim threshold at
256 MiB, so an output up to 32 MiB comes from heap memory the previous request freed.

Why it is not the default (BENCHMARKS.md): in a plain loop of GRPO calls it cut the calls that faulted
their output in from 8 of 16 to 1 of 30, but in the benchmark's rows and its 8-caller rows the effect
was within the noise of a shared 2-core machine, and with it a server that saw cancelled 192 MiB uploads
no longer returned to its resident size in time (``tests/test_reliability_faults.py``: the retained
heap defeats the server's :class:`~advantage_server.limits.MemoryTrimmer`). glibc's own dynamic
thresholds already keep outputs up to 32 MiB in reused memory after the first request of a size.

Also not a default: ``THP_MEM_ALLOC_ENABLE=1`` (torch backs CPU allocations >= 2 MiB with transparent
huge pages; it reads the variable at its first CPU allocation). Alone it cut a fresh 64 MiB write from
~30 ms to ~8-10 ms, but it slowed the 16 MiB kernel rows (a fresh huge page zeroed per call: 3.7-9x the
floor) and, together with the settings above, made 8 concurrent callers collapse (0.07-0.3x one
caller's throughput; THP ``defrag`` is ``madvise`` there, so such faults may compact memory
synchronously). Set either where outputs above 32 MiB dominate, and measure (``advantage-bench --thp``,
``ADVANTAGE_MALLOC_TUNING=1 advantage-bench``).

An explicit ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` entry for either
threshold wins over the switch. Without glibc (musl, macOS) nothing is changed.
"""
from __future__ import annotations

import ctypes
import os

SWITCH = "ADVANTAGE_MALLOC_TUNING"
MMAP_THRESHOLD = 32 << 20   # glibc's largest allowed value (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)

#: what :func:`apply` did, for logs and the benchmark's header ({} until it ran or when switched off)
APPLIED: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get(SWITCH, "0").strip().lower() in ("1", "true", "yes", "on")


def _tunable_set(name: str) -> bool:
    return f"glibc.malloc.{name}" in os.environ.get("GLIBC_TUNABLES", "")


def apply() -> dict[str, str]:
    """Apply the settings above when the switch is on (idempotent); returns what was set."""
    if not enabled() or APPLIED:
        return APPLIED
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return APPLIED
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and not _tunable_set("mmap_threshold"):
        if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
            APPLIED["malloc mmap_threshold"] = str(MMAP_THRESHOLD)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ and not _tunable_set("trim_threshold"):
        if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
            APPLIED["malloc trim_threshold"] = str(TRIM_THRESHOLD)
    return APPLIED


def describe() -> str:
    """One line for logs and the benchmark header: the settings torch and malloc run with."""
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    if not enabled():
        return f"THP_MEM_ALLOC_ENABLE={thp}, glibc malloc defaults ({SWITCH} off)"
    mm = APPLIED.get("malloc mmap_threshold", os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"))
    tr = APPLIED.get("malloc trim_threshold", os.environ.get("MALLOC_TRIM_THRESHOLD_", "glibc default"))
    return f"THP_MEM_ALLOC_ENABLE={thp}, malloc mmap_threshold={mm}, trim_threshold={tr}"
