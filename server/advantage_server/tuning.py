"""Process-wide memory defaults of the server process, applied when :mod:`advantage_server` is imported.

The estimators write dense ``[B, T]`` outputs (16-256 MiB per request at the sizes trainers send), and
on a VM the page faults of freshly mapped memory cost more than writing it (~1.8 us per 4 KiB page
measured on the benchmark machine: a fresh 64 MiB output took ~30 ms to write against ~3 ms into
reused memory). glibc's ``malloc`` maps each allocation above a moving threshold anew and unmaps it on
free, and hands freed heap memory back at every free past a trim threshold, so a request could fault
its whole output in again. The default here:

* a fixed mmap threshold of 32 MiB (glibc's maximum) and a trim threshold of 256 MiB: outputs up to
  32 MiB come from heap memory the previous request freed, already mapped. The server's
  :class:`~advantage_server.limits.MemoryTrimmer` still returns memory after a large request
  (``malloc_trim`` ignores the threshold). Measured (BENCHMARKS.md): GRPO/GDPO kernel rows at
  65536x64 and 512x8192 lose their fault-bound outliers, and 8 concurrent GRPO callers no longer
  collapse to a third of one caller's throughput.

Not a default: ``THP_MEM_ALLOC_ENABLE=1`` (torch backs CPU allocations >= 2 MiB with transparent huge
pages). Alone it cut a fresh 64 MiB write from ~30 ms to ~8-10 ms, but it slowed the 16 MiB kernel rows
(fresh huge pages zeroed per call: 3.7-9x the floor) and, together with the heap reuse above, it made
8 concurrent callers collapse (0.07-0.3x one caller's throughput; the machine's THP ``defrag`` is
``madvise``, so every such fault may compact memory synchronously). Set it in the environment where
outputs above 32 MiB dominate and measure (``advantage-bench --thp``).

Overrides: ``ADVANTAGE_MEMORY_DEFAULTS=0`` leaves the process as it is; ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` or a ``GLIBC_TUNABLES`` entry for either threshold wins over the default.
Without glibc (musl, macOS) nothing is changed.
"""
from __future__ import annotations

import ctypes
import os

SWITCH = "ADVANTAGE_MEMORY_DEFAULTS"
MMAP_THRESHOLD = 32 << 20   # glibc's largest allowed value (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)

#: what :func:`apply` did, for logs and the benchmark's header ({} until it ran or when switched off)
APPLIED: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _tunable_set(name: str) -> bool:
    return f"glibc.malloc.{name}" in os.environ.get("GLIBC_TUNABLES", "")


def apply() -> dict[str, str]:
    """Apply the defaults above (idempotent); returns what was set."""
    if not enabled() or APPLIED:
        return APPLIED
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return APPLIED
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if False:
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
        return f"{SWITCH}=0 (THP_MEM_ALLOC_ENABLE={thp}, glibc malloc defaults)"
    mm = APPLIED.get("malloc mmap_threshold", os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"))
    tr = APPLIED.get("malloc trim_threshold", os.environ.get("MALLOC_TRIM_THRESHOLD_", "glibc default"))
    return f"THP_MEM_ALLOC_ENABLE={thp}, malloc mmap_threshold={mm}, trim_threshold={tr}"
