"""Measuring: medians after warm-up, copy bandwidth (the memory floor's yardstick), peak RSS, the machine."""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch


@dataclass
class Timing:
    median_s: float
    runs: list[float]
    result: Any = None  # what the last run returned

    @property
    def ms(self) -> float:
        return self.median_s * 1e3


def timeit(fn: Callable[[], Any], repeats: int, warmup: int = 1, budget_s: float | None = None) -> Timing:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs. With ``budget_s``, stops
    early (after at least one timed run) once the timed runs have taken that long: the slow
    references get fewer runs than the kernels, never zero."""
    for _ in range(warmup):
        fn()
    runs: list[float] = []
    spent = 0.0
    result = None
    for _ in range(max(1, repeats)):
        result = None
        t0 = time.perf_counter()
        result = fn()
        runs.append(time.perf_counter() - t0)
        spent += runs[-1]
        if budget_s is not None and spent >= budget_s:
            break
    return Timing(statistics.median(runs), runs, result)


@dataclass
class Bandwidth:
    """Copy bandwidth: (bytes read + bytes written) per second of a large memcpy."""

    numpy_gbps: float   # np.copyto, one thread
    torch_gbps: float   # Tensor.copy_, torch's intra-op threads
    size_mib: int

    @property
    def best_gbps(self) -> float:
        """The floor uses the faster of the two: the stricter yardstick."""
        return max(self.numpy_gbps, self.torch_gbps)


def copy_bandwidth(size_mib: int = 256, repeats: int = 7) -> Bandwidth:
    n = size_mib * (1 << 20) // 4
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    dst[:] = 0  # touch the pages before timing
    t_np = timeit(lambda: np.copyto(dst, src), repeats)
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    t_torch = timeit(lambda: td.copy_(ts), repeats)
    moved = 2 * n * 4
    return Bandwidth(moved / t_np.median_s / 1e9, moved / t_torch.median_s / 1e9, size_mib)


class CopyProbe:
    """A large memcpy (numpy, one thread) timed between the runs of a kernel: the floor of that row is
    measured under the same load as the kernel itself (other work on a shared machine comes and goes)."""

    def __init__(self, size_mib: int = 64):
        n = size_mib * (1 << 20) // 4
        self.src = np.ones(n, dtype=np.float32)
        self.dst = np.zeros(n, dtype=np.float32)
        self.moved = 2 * n * 4

    def once(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0


def timeit_with_floor(fn: Callable[[], Any], repeats: int, probe: CopyProbe, warmup: int = 1) -> tuple[Timing, float]:
    """(timing of ``fn``, copy bandwidth in GB/s), the two measured alternately: run, copy, run, copy, ..."""
    for _ in range(warmup):
        fn()
        probe.once()
    runs, copies = [], []
    result = None
    for _ in range(max(1, repeats)):
        result = None
        t0 = time.perf_counter()
        result = fn()
        runs.append(time.perf_counter() - t0)
        copies.append(probe.once())
    return Timing(statistics.median(runs), runs, result), probe.moved / statistics.median(copies) / 1e9


def cuda_timeit_with_floor(fn: Callable[[], Any], repeats: int, floor_bytes: int, device: torch.device,
                           warmup: int = 2) -> tuple[Timing, float, int]:
    """On a CUDA device: (timing of ``fn``, median time of a device-to-device copy of ``floor_bytes / 2``
    bytes (as many read + written as the floor), peak device bytes of one run above those allocated
    before it). Each run and each copy is timed between two ``torch.cuda.synchronize`` calls; run and
    copy alternate, as on the CPU."""
    src = torch.ones(max(1, floor_bytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def sync() -> None:
        torch.cuda.synchronize(device)

    def timed(f: Callable[[], Any]) -> tuple[float, Any]:
        sync()
        t0 = time.perf_counter()
        out = f()
        sync()
        return time.perf_counter() - t0, out

    for _ in range(warmup):
        fn()
        dst.copy_(src)
    runs, copies = [], []
    result = None
    for _ in range(max(1, repeats)):
        result = None
        dt, result = timed(fn)
        runs.append(dt)
        copies.append(timed(lambda: dst.copy_(src))[0])
    src = dst = None  # the floor's buffers are not part of the kernel's peak
    sync()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _, extra = timed(fn)
    peak = max(0, torch.cuda.max_memory_allocated(device) - before)
    del extra
    return Timing(statistics.median(runs), runs, result), statistics.median(copies), peak


def cuda_copy_bandwidth(device: torch.device, size_mib: int = 256, repeats: int = 9) -> float:
    """(bytes read + written) per second of a large device-to-device copy, GB/s."""
    src = torch.ones(size_mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    runs = []
    for i in range(repeats + 2):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        if i >= 2:
            runs.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(runs) / 1e9


def settle_heap() -> None:
    """Hand the heap's free memory back (glibc ``malloc_trim(0)``, as the server's ``MemoryTrimmer`` does
    after large requests) before a row is timed. Building a row's batch frees large temporaries; left at
    the top of the heap they made glibc trim, and so fault in again, the whole output of every call of
    the first row of a run (4096 faults per 16 MiB output, 4-7 ms a call); after a trim the output's
    memory is reused from the second call on. A no-op without glibc."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


# ------------------------------------------------------------------------------------ memory
def _status_kib(key: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int | str = "self") -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of a process (Linux ``clear_refs`` 5)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes(pid: int | str = "self") -> int:
    return _status_kib("VmRSS", pid) * 1024


def peak_bytes(pid: int | str = "self") -> int:
    return _status_kib("VmHWM", pid) * 1024


def peak_extra_rss(fn: Callable[[], Any]) -> int | None:
    """Peak RSS above the RSS before ``fn()`` while it runs, in bytes (None where the peak cannot be reset)."""
    try:
        before = rss_bytes()
        if not reset_peak():
            return None
        result = fn()
        extra = peak_bytes() - before
        del result
        return max(0, extra)
    except (OSError, KeyError):
        return None


# ----------------------------------------------------------------------------------- machine
def machine(device: str = "cpu") -> dict[str, str]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    except (ValueError, OSError):
        mem = "?"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    from advantage_server.estimators import jit
    versions = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"numpy {np.__version__}"]
    if jit._numba is not None:
        versions.append(f"numba {jit._numba.__version__}" + ("" if jit.NUMBA else " (disabled)"))
    else:
        versions.append("numba absent (torch kernels)")
    try:
        import torchrl
        versions.append(f"torchrl {torchrl.__version__}")
    except Exception:
        versions.append("torchrl absent")
    info = {"cpu": cpu, "cores": str(cores), "memory": mem, "torch_threads": str(torch.get_num_threads()),
            "versions": ", ".join(versions)}
    if device != "cpu":
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        info["device"] = (f"{dev}: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} "
                          f"SMs; CUDA {torch.version.cuda}; device-to-device copy (256 MiB, read+write) "
                          f"{cuda_copy_bandwidth(dev):.0f} GB/s")
    return info


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"
