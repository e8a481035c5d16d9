"""Compiled CPU kernels: the optional numba JIT, and a row-parallel runner for it.

The estimators have one pure-torch implementation (used on a GPU, and on the CPU when numba is
absent) and, for the CPU, numba kernels that make one pass over memory with the GIL released. This
module holds what those CPU kernels share:

* :data:`NUMBA` - whether numba is importable and enabled. ``ADVANTAGE_NUMBA=0`` in the environment
  turns the numba paths off (the torch paths then run everywhere); tests switch it per call with
  :func:`use_numba`.
* :func:`njit` - ``numba.njit(nogil=True, cache=True)``: compiled on first use, once per argument
  signature, and cached on disk (next to this package, else in numba's user cache directory; set
  ``NUMBA_CACHE_DIR`` for a read-only install), so a new server process loads the machine code instead
  of compiling it again (~0.5 s per kernel variant the first time). Without numba it returns the
  Python function unchanged (never called on the hot path then). Every kernel it makes is listed in
  :data:`KERNELS`; the server compiles (or loads) each signature it can be asked for before it reports
  SERVING (:mod:`advantage_server.warmup`), and tests/test_warmup.py fails for a kernel the warm-up misses.
* A read-only ``NUMBA_CACHE_DIR`` (the Docker image's cache, filled at build time, under Kubernetes'
  read-only root filesystem) is copied once, at import, into a writable directory (see
  :func:`cache_location`): numba only uses a cache directory it can write to.
* :func:`parallel_rows` - runs ``kernel(lo, hi, *args)`` on row ranges that split ``[0, B)``, on a
  small process-wide thread pool plus the calling thread. The kernels release the GIL, so the chunks
  and concurrent requests run on all cores. A fixed pool (instead of numba's own ``parallel=True``
  threading layers) is safe to call from many request threads at once and after ``fork``.

Why not torch's intra-op threads: under CPU contention (another process on one of the two cores)
OpenMP's barrier waits for the descheduled thread, and one torch call can take 10x its uncontended
time (measured here: a 64 Ki-element ``Tensor.to`` from 0.01 ms to 8 ms). The chunks here are
claimed one at a time by whichever thread is running, so a descheduled thread delays at most the
chunk it holds. The same reason keeps the CPU paths' small ``[B]`` arithmetic in numpy.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np
import torch

try:  # numba is a dependency, but the torch paths must keep working without it
    import numba as _numba
except Exception:  # pragma: no cover - exercised by installs without numba
    _numba = None

#: numba importable and not disabled by ``ADVANTAGE_NUMBA=0``
NUMBA: bool = _numba is not None and os.environ.get("ADVANTAGE_NUMBA", "1") not in ("0", "false", "no", "off")

_local = threading.local()

#: every kernel :func:`njit` compiled, in definition order (numba dispatchers; empty without numba)
KERNELS: list[Any] = []


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _use_cache_dir() -> str:
    """Where numba's cache lives for this process (called once, at import, before any kernel is made).

    ``NUMBA_CACHE_DIR`` writable: it. Set but read-only (an image's cache, filled at build time): a copy in
    ``$TMPDIR/advantage-numba-cache-<uid>`` (a few MB; numba refuses a cache directory it cannot write to and
    would compile everything again), used instead. Unset: numba's default (``__pycache__`` beside the
    kernels' modules, else the user's cache directory)."""
    configured = _numba.config.CACHE_DIR if _numba is not None else ""
    if not configured:
        return "__pycache__ beside the kernels (or numba's user cache; NUMBA_CACHE_DIR unset)"
    if _writable(configured):
        return configured
    copy = os.path.join(tempfile.gettempdir(), f"advantage-numba-cache-{os.getuid() if hasattr(os, 'getuid') else 0}")
    try:
        if os.path.isdir(configured):
            shutil.copytree(configured, copy, dirs_exist_ok=True)
        if not _writable(copy):
            raise OSError(f"{copy} is not writable")
    except OSError as err:
        return f"{configured} (read-only, and no writable copy: {err}; kernels compile in each process)"
    _numba.config.CACHE_DIR = copy
    return f"{copy} (a copy of read-only {configured})"


_CACHE_LOCATION = _use_cache_dir() if _numba is not None else "none (numba is not installed)"


def cache_location() -> str:
    """numba's cache directory for this process, in words (the server's start-up log prints it)."""
    return _CACHE_LOCATION


def compiled_signatures() -> int:
    """Machine-code variants the kernels hold in this process (compiled or loaded from the cache), summed
    over :data:`KERNELS`. Grows when a call needs a variant the warm-up did not make."""
    return sum(len(kernel.signatures) for kernel in KERNELS)

#: below this many elements a kernel runs on the calling thread alone (a hand-off costs ~20 us)
PARALLEL_MIN_ELEMENTS = 1 << 17


def njit(fn: Callable | None = None, *, contract: bool = False, reassoc: bool = False) -> Callable:
    """``numba.njit(nogil=True, cache=True)`` when numba is installed, else ``fn`` itself.

    ``contract=True`` lets LLVM fuse a multiply and an add into one FMA (one rounding instead of two:
    as accurate or more, and half the latency on a recurrence's critical path). ``reassoc=True`` lets
    it reorder the additions of a sum so the loop runs on SIMD lanes (float64 sums of float32 data:
    the order changes the last bits only; still deterministic for a given build). Nothing else of
    fast-math (no NaN/inf assumptions).
    """
    flags = ({"contract"} if contract else set()) | ({"reassoc"} if reassoc else set())

    def wrap(f: Callable) -> Callable:
        if _numba is None:
            return f
        options = dict(nogil=True, fastmath=flags or False, error_model="numpy")
        try:
            kernel = _numba.njit(cache=True, **options)(f)
        except RuntimeError:  # no writable cache location (read-only install, no $HOME): compile per process
            kernel = _numba.njit(cache=False, **options)(f)
        KERNELS.append(kernel)
        return kernel

    return wrap if fn is None else wrap(fn)


def enabled() -> bool:
    """Whether the numba CPU kernels are used for the current thread (see :func:`use_numba`)."""
    flag = getattr(_local, "flag", None)
    return NUMBA if flag is None else (flag and _numba is not None)


@contextlib.contextmanager
def use_numba(flag: bool) -> Iterator[None]:
    """Force the numba kernels on or off in this thread (tests run both paths against the loop twins)."""
    old = getattr(_local, "flag", None)
    _local.flag = flag
    try:
        yield
    finally:
        _local.flag = old


def applies(*tensors: torch.Tensor | None) -> bool:
    """True when the numba kernels should run on these tensors: numba on, every tensor on the CPU,
    float32/float64 data (masks may also be bool/uint8), no autograd history."""
    if not enabled():
        return False
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or t.requires_grad:
            return False
        if t.dtype not in (torch.float32, torch.float64, torch.bool, torch.uint8, torch.int64, torch.int32):
            return False
    return True


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of a CPU tensor (a copy only when ``t`` is not contiguous)."""
    return t.detach().contiguous().numpy()


# ------------------------------------------------------------------------------------ the pool
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads one kernel call splits its rows over: ``$ADVANTAGE_KERNEL_THREADS`` when set (e.g. a
    container's CPU quota), else the cores this process may run on."""
    env = os.environ.get("ADVANTAGE_KERNEL_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, workers() - 1), thread_name_prefix="advantage-kernel")
        return _pool


def _reset_after_fork() -> None:  # the parent's pool threads do not exist in a forked child
    global _pool, _pool_lock, _in_flight, _in_flight_lock
    _pool, _pool_lock = None, threading.Lock()
    _in_flight, _in_flight_lock = 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


_row_parallel = True
_in_flight = 0  # parallel_rows calls running now, in any thread
_in_flight_lock = threading.Lock()


def set_row_parallel(flag: bool) -> bool:
    """Split a kernel's rows over the cores (default) or run each call on its calling thread alone
    (the benchmark's concurrency section measures both). Returns the previous setting."""
    global _row_parallel
    old, _row_parallel = _row_parallel, bool(flag)
    return old


class _Chunks:
    """Row chunks handed out one at a time to whichever thread asks first (the caller and the pool)."""

    def __init__(self, kernel: Callable[..., Any], bounds: list[int], args: tuple):
        self.kernel, self.bounds, self.args = kernel, bounds, args
        self.lock = threading.Lock()
        self.claimed = 0
        self.finished = 0
        self.all_done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        n = len(self.bounds) - 1
        while True:
            with self.lock:
                i = self.claimed
                if i >= n:
                    return
                self.claimed = i + 1
            try:
                self.kernel(self.bounds[i], self.bounds[i + 1], *self.args)
            except BaseException as err:  # pragma: no cover - a kernel bug; re-raised in the caller
                self.error = err
            with self.lock:
                self.finished += 1
                if self.finished == n:
                    self.all_done.set()


def parallel_rows(kernel: Callable[..., Any], B: int, T: int, *args: Any) -> None:
    """Run ``kernel(lo, hi, *args)`` over row ranges covering ``[0, B)``, in parallel when worthwhile.

    The kernel must release the GIL (``njit`` above does) and write only rows ``lo..hi-1`` of its
    outputs. While another call is splitting its rows (concurrent requests), this one runs on its
    calling thread alone. Otherwise the rows are cut into a few chunks per core, claimed one by one by the calling thread and
    the pool: when another process holds a core (or the pool is busy with other requests), the caller
    simply does more of the chunks itself instead of waiting for a descheduled thread. The call returns
    when every chunk is done; a pool task that starts later finds none left.
    """
    global _in_flight
    if B < 2 or B * T < PARALLEL_MIN_ELEMENTS or not _row_parallel:  # small calls first: workers() reads the
        kernel(0, B, *args)                                           # environment and the CPU affinity
        return
    n = workers()
    if n <= 1:
        kernel(0, B, *args)
        return
    with _in_flight_lock:
        busy = _in_flight > 0
        _in_flight += 1
    try:
        if busy:
            # other requests are computing: they already keep the cores busy, and splitting every call
            # over the pool only adds hand-offs (measured: 8 concurrent callers lost a third of their
            # throughput). Each call then runs on its own thread, GIL released.
            kernel(0, B, *args)
            return
        parts = max(2, min(B, 4 * n, B * T // (PARALLEL_MIN_ELEMENTS // 4)))
        chunks = _Chunks(kernel, [B * i // parts for i in range(parts + 1)], args)
        pool = _get_pool()
        for _ in range(min(n - 1, parts - 1)):
            pool.submit(chunks.work)
        chunks.work()
        chunks.all_done.wait()
        if chunks.error is not None:
            raise chunks.error
    finally:
        with _in_flight_lock:
            _in_flight -= 1


# ------------------------------------------------------------------------- shared small kernels
_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32}


def np_dtype(dtype: torch.dtype) -> type:
    """The numpy scalar type of a torch dtype (float32, float64, int64, int32)."""
    return _NP_DTYPE[dtype]


def numpy_as(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A CPU tensor's values as a numpy array of ``dtype`` (a view when it already has it). Casting with
    numpy instead of ``Tensor.to`` keeps small casts off torch's intra-op thread pool (see above)."""
    a = t.detach().numpy()
    want = _NP_DTYPE[dtype]
    return a if a.dtype == want else a.astype(want)


@njit
def _fill_rows(lo, hi, vals, out):  # pragma: no cover - compiled
    for b in range(lo, hi):
        x = vals[b]
        for t in range(out.shape[1]):
            out[b, t] = x


def broadcast_rows(vals: np.ndarray, T: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B]`` values -> a dense ``[B, T]`` tensor of ``dtype`` (row b filled with ``vals[b]``), written
    in parallel. The dense result is what the response carries; writing it here is the one write."""
    B = vals.shape[0]
    out = torch.empty((B, T), dtype=dtype)
    parallel_rows(_fill_rows, B, T, np.ascontiguousarray(vals), out.numpy())
    return out


@njit
def _count_rows(lo, hi, mask, out):  # pragma: no cover - compiled
    for b in range(lo, hi):
        c = 0
        for t in range(mask.shape[1]):
            if mask[b, t] != 0:
                c += 1
        out[b] = c


def row_counts(mask: torch.Tensor) -> np.ndarray:
    """``[B]`` float64: the number of mask != 0 positions of each row of a CPU ``[B, T]`` mask."""
    m = as_numpy(mask)
    out = np.zeros(m.shape[0], dtype=np.float64)
    parallel_rows(_count_rows, m.shape[0], m.shape[1], m, out)
    return out
