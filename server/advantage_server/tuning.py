"""Process-wide memory defaults of the server process, applied when :mod:`advantage_server` is imported.

The estimators write dense ``[B, T]`` outputs (16-256 MiB per request at the sizes trainers send), and
on a VM the page faults of freshly mapped memory cost more than writing it (~1.8 us per 4 KiB page
measured on the benchmark machine: a fresh 64 MiB output took ~30 ms to write against ~3 ms into
reused memory). Two defaults keep those faults off the request path:

* ``THP_MEM_ALLOC_ENABLE=1`` - torch then backs every CPU allocation of 2 MiB or more with transparent
  huge pages (``madvise``; the kernel's THP mode ``madvise`` or ``always`` honours it): one fault per
  2 MiB instead of per 4 KiB (the fresh 64 MiB write: ~30 ms -> ~8-10 ms). torch reads the variable
  once, at its first CPU allocation, so it is set here, before this package allocates anything.
* glibc ``malloc``: a fixed mmap threshold of 32 MiB (glibc's maximum; by default glibc maps each
  allocation above a moving threshold anew and unmaps it on free, so every request faulted its output
  in again) and a trim threshold of 256 MiB (freed heap memory is kept for the next request instead of
  being handed back at every free; each request thread's arena would otherwise hand back and fault in
  its 16 MiB output on every call). The server's :class:`~advantage_server.limits.MemoryTrimmer` still
  returns memory after a large request (``malloc_trim`` ignores the threshold).

Overrides: ``ADVANTAGE_MEMORY_DEFAULTS=0`` leaves the process as it is; an explicit
``THP_MEM_ALLOC_ENABLE`` (e.g. ``0``), ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or a
``GLIBC_TUNABLES`` entry for either threshold wins over the default. Without glibc (musl, macOS) only
the torch variable is set.
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
    if "THP_MEM_ALLOC_ENABLE" not in os.environ:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
        APPLIED["THP_MEM_ALLOC_ENABLE"] = "1"
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
    if not enabled():
        return f"{SWITCH}=0 (THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, malloc defaults)"
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    mm = APPLIED.get("malloc mmap_threshold", os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"))
    tr = APPLIED.get("malloc trim_threshold", os.environ.get("MALLOC_TRIM_THRESHOLD_", "glibc default"))
    return f"THP_MEM_ALLOC_ENABLE={thp}, malloc mmap_threshold={mm}, trim_threshold={tr}"
