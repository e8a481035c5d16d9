"""Server limits and request lifetime: the flags' values, size and element caps, deadlines, out-of-memory.

The admission model has a room per question (RELIABILITY.md, "The admission model"):

* who is calling: :mod:`advantage_server.identity` (connection, host: IPv4 address, 127/8 one host, IPv6 /64);
* what they are owed: :mod:`advantage_server.shares` (max-min fair shares of the places between hosts, then
  connections; the bounds on health ``Watch`` streams), enforced by :mod:`advantage_server.admission`
  (:class:`RequestGate`: places, compute slots, drain, refusals with a retry pushback) and
  :mod:`advantage_server.uploads` (:class:`UploadWatch`: stalled, slow and silent uploads);
* whether the replica is alive: :mod:`advantage_server.health_service` (SERVING from the end of warm-up until
  the drain; being full is not being down).

This module keeps :class:`Limits` (the flags), :func:`check_batch_elements`, the reliability hook
:func:`checkpoint` the core calls between its stages (decoded, prepared, computed: it raises
:class:`RequestExpired` when the call was cancelled or its deadline passed, so an expired request stops instead
of keeping the device busy), :func:`is_out_of_memory` (device and host allocation failures, answered with
RESOURCE_EXHAUSTED) and :class:`MemoryTrimmer`; it re-exports the names that moved to the modules above.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import gc
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Iterator

from advantage_server.errors import ResourceLimit

log = logging.getLogger("advantage_server")

#: the largest request body of ListEstimators / RegisterSharedMemory / UnregisterSharedMemory (all a few
#: bytes); a larger one is INVALID_ARGUMENT before it is parsed
LIGHT_BODY_BYTES = 64 << 10
#: threads beyond ``max(workers, max_concurrent_requests) + LIGHT_CALLS`` for health checks and
#: refusals, so these never wait behind computations or the calls above.
SPARE_THREADS = 8
#: gRPC's own cap on calls of any kind inside the server (``maximum_concurrent_rpcs``) is this many
#: times the thread pool: a hard bound on what can queue for a thread even under a flood. Open health ``Watch``
#: streams never fill it: the health servicer is non-blocking (its ``Watch`` returns at once and sends from
#: gRPC's polling thread), and gRPC counts a call against ``maximum_concurrent_rpcs`` only while its handler runs
#: on the pool (``grpc._server``: ``active_rpc_count`` falls when the handler's future completes); measured in
#: tests/test_health_alive.py: 128 open ``Watch`` streams beside a backstop of 68, compute calls still served.
BACKSTOP_FACTOR = 4
#: the fewest HTTP/2 streams one client connection may have open at once (``grpc.max_concurrent_streams``;
#: RFC 9113 recommends no fewer than 100); more when ``--max-concurrent-requests`` is larger (see
#: :attr:`Limits.max_streams_per_connection`). A client beyond it waits (its gRPC queues the call), it is not refused.
MIN_STREAMS_PER_CONNECTION = 100

# the flag defaults live in a module without imports (advantage-server parses its flags without torch)
from advantage_server.defaults import (  # noqa: E402,F401 - re-exported
    DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_MAX_SHM_REGIONS_PER_CLIENT, DEFAULT_MAX_STREAM_MB, DEFAULT_MIN_UPLOAD_RATE_KIB,
    DEFAULT_STREAM_IDLE_TIMEOUT, DEFAULT_UPLOAD_RATE_WINDOW, DEFAULT_WORKERS,
)
# the rooms of the admission model (see the module docstring), re-exported under their old names
from advantage_server.admission import (  # noqa: E402,F401 - re-exported
    ADMISSION_PUSHBACK_MS, LIGHT_CALLS, WAITING_PER_PLACE, Draining, Overloaded, RequestGate, refusal_metadata,
)
from advantage_server.identity import call_peer, peer_host  # noqa: E402,F401 - re-exported
from advantage_server.shares import MAX_WATCHES, MAX_WATCHES_PER_HOST, PendingShares  # noqa: E402,F401
from advantage_server.uploads import (  # noqa: E402,F401 - re-exported
    SilentAtDrain, UploadCut, UploadWatch, _cancel_with_status, _Upload,
)


MAX_MESSAGE_MB_LIMIT = 2047  # gRPC message lengths are signed 32-bit byte counts


@dataclasses.dataclass(frozen=True)
class Limits:
    """The server's limits (each one a CLI flag of the same name)."""

    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB
    max_stream_mb: int = DEFAULT_MAX_STREAM_MB
    max_batch_elements: int = DEFAULT_MAX_BATCH_ELEMENTS
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    workers: int = DEFAULT_WORKERS
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT
    min_upload_rate_kib: int = DEFAULT_MIN_UPLOAD_RATE_KIB
    upload_rate_window: float = DEFAULT_UPLOAD_RATE_WINDOW
    max_shm_regions_per_client: int = DEFAULT_MAX_SHM_REGIONS_PER_CLIENT
    #: calls of one client host waiting for their request body at once (None: :attr:`pending_per_peer`'s default)
    max_pending_per_peer: int | None = None
    #: calls of one client connection waiting for their request body at once (None: the per-peer share)
    max_pending_per_connection: int | None = None
    #: connections one client host may hold open while others need room (None: a quarter of the server's
    #: connection limit, at least 64: :func:`advantage_server.server.connections_per_host`)
    max_connections_per_host: int | None = None

    def __post_init__(self) -> None:
        for name in ("stream_idle_timeout", "upload_rate_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}")
        rate = self.min_upload_rate_kib
        if not isinstance(rate, int) or isinstance(rate, bool) or rate < 0:
            raise ValueError(f"--min-upload-rate-kib must be a whole number of KiB per second, 0 or more (0 turns "
                             f"the check off), got {rate!r}")
        for f in dataclasses.fields(self):
            if f.name in ("stream_idle_timeout", "upload_rate_window", "min_upload_rate_kib"):
                continue
            value = getattr(self, f.name)
            if value is None and f.name.startswith(("max_pending_", "max_connections_")):  # the default share
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{f.name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_message_mb > MAX_MESSAGE_MB_LIMIT:
            raise ValueError(f"--max-message-mb must be at most {MAX_MESSAGE_MB_LIMIT} (gRPC's message size is a "
                             f"32-bit byte count), got {self.max_message_mb}; larger batches go through streaming")

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024

    @property
    def max_stream_bytes(self) -> int:
        return self.max_stream_mb * 1024 * 1024

    @property
    def min_upload_rate_bytes(self) -> int:
        """``--min-upload-rate-kib`` in bytes per second (0: no minimum)."""
        return self.min_upload_rate_kib * 1024

    @property
    def thread_pool_size(self) -> int:
        # + the waiting room (RequestGate.max_waiting: WAITING_PER_PLACE waiting calls per place)
        return max(self.workers, self.max_concurrent_requests) + WAITING_PER_PLACE * self.max_concurrent_requests \
            + LIGHT_CALLS + SPARE_THREADS

    @property
    def grpc_max_concurrent_rpcs(self) -> int:
        return self.thread_pool_size * BACKSTOP_FACTOR

    @property
    def pending_per_peer(self) -> int:
        """``--max-pending-per-peer``, by default a quarter of ``--max-concurrent-requests`` (at least 1)."""
        if self.max_pending_per_peer is not None:
            return self.max_pending_per_peer
        return max(1, self.max_concurrent_requests // 4)

    @property
    def pending_per_connection(self) -> int:
        """``--max-pending-per-connection``, by default the per-peer share."""
        if self.max_pending_per_connection is not None:
            return self.max_pending_per_connection
        return self.pending_per_peer

    @property
    def max_streams_per_connection(self) -> int:
        """``grpc.max_concurrent_streams``: HTTP/2 streams (calls of any kind, health ``Watch`` streams
        included) one client connection may have open at once."""
        return max(MIN_STREAMS_PER_CONNECTION, self.max_concurrent_requests + LIGHT_CALLS + SPARE_THREADS)


class RequestExpired(Exception):
    """The client cancelled the call or its deadline passed; the work stopped at ``stage``."""

    def __init__(self, stage: str, deadline: bool):
        self.stage = stage
        self.deadline = deadline
        what = "deadline expired" if deadline else "client cancelled the call"
        super().__init__(f"{what} {stage}; the request was not finished")


def check_batch_elements(inputs: dict[str, Any], limit: int) -> None:
    """``ResourceLimit`` when a tensor message in ``inputs`` (name -> ``advantage.v1.Tensor``) declares more
    than ``limit`` elements. Runs on the declared shape, before any byte is decoded. Empty dimensions
    count as 1 here, so ``[0, 2**62]`` is refused too (no array library can lay that shape out); shapes
    with a negative dimension are left to the decoder (INVALID_ARGUMENT)."""
    for name, tensor in inputs.items():
        shape = list(tensor.shape)
        if any(d < 0 for d in shape):
            continue
        n = math.prod(max(d, 1) for d in shape)
        if n > limit:
            size = f"{math.prod(shape)} elements" if 0 not in shape else f"dimensions whose product is {n}"
            raise ResourceLimit(f"{name} has shape {shape} = {size}, more than the server's "
                                f"--max-batch-elements={limit}; split the batch into smaller requests")


def is_out_of_memory(exc: BaseException) -> bool:
    """A device (CUDA) or host allocation failure, as torch, numpy and Python report them."""
    if isinstance(exc, MemoryError):
        return True
    oom = getattr(__import__("torch"), "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# ------------------------------------------------------------------------------ checkpoints
_CHECKPOINT: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "advantage_checkpoint", default=None)


def checkpoint(stage: str) -> None:
    """Called by the core between stages; raises :class:`RequestExpired` when the current call is over.

    A no-op outside a gRPC call (in-process use of the core)."""
    check = _CHECKPOINT.get()
    if check is not None:
        check(stage)


@contextlib.contextmanager
def checkpoints(check: Callable[[str], None]) -> Iterator[None]:
    """Install ``check`` as the current call's checkpoint for the duration of the block."""
    token = _CHECKPOINT.set(check)
    try:
        yield
    finally:
        _CHECKPOINT.reset(token)


#: seconds between two asks of gRPC whether a call is still active (each takes the call's lock); checks closer
#: together than this (a small call's dozen stages, microseconds apart) see the call's deadline only
LIVENESS_PERIOD = 0.001


def grpc_liveness(context: Any) -> Callable[[str], None]:
    """A checkpoint for a ``grpc.ServicerContext``: raises when the call was cancelled or expired.

    The deadline is read once and compared with the clock at every check; whether the client cancelled is
    asked of gRPC at the first check and then at most every :data:`LIVENESS_PERIOD` seconds."""
    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    asked = [-math.inf]

    def check(stage: str) -> None:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise RequestExpired(stage, deadline=True)
        if now - asked[0] < LIVENESS_PERIOD:
            return
        asked[0] = now
        if not context.is_active():
            left = context.time_remaining()
            raise RequestExpired(stage, deadline=left is not None and left <= 0)
    return check


# ------------------------------------------------------------------------------ memory
def _resident_bytes() -> int | None:
    """Resident bytes the heap trim can act on: resident minus resident shared pages (``/proc/self/statm``
    fields 2 - 3). Shared pages are files and shared memory (libraries, and the clients' memfd regions the
    server maps: touched, they count as resident, but no trim gives them back); None without /proc."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


#: seconds between two full garbage collections of the memory trimmer, at least
GC_INTERVAL_S = 10.0


class MemoryTrimmer:
    """Hands freed heap memory back to the OS when resident memory grew by more than ``step`` bytes.

    A large request (or a large upload its client cancelled) leaves gRPC's many small receive buffers
    freed but still resident in glibc's heap; without trimming, a server that saw a few 200 MB requests
    keeps gigabytes resident (measured: 8 cancelled 192 MiB uploads took a server from 233 MiB to 3 GiB
    resident; with this, it comes back to ~240 MiB). Checks every ``interval`` seconds (one read of
    /proc/self/statm); a no-op where glibc's ``malloc_trim`` or /proc is missing. When a trim leaves resident
    memory high, it runs a full garbage collection and trims again (cyclic garbage can hold a request's
    bytes; at most once per ``GC_INTERVAL_S``), then retries after 1, 2, 4 ... 30 s for as long as memory stays high.
    """

    def __init__(self, interval: float = 1.0, step: int = 64 << 20):
        self.interval, self.step = interval, step
        self._collected = -math.inf  # when the last full collection ran
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            self._trim = None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None and _resident_bytes() is not None

    def start(self) -> "MemoryTrimmer":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="advantage-memory-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        floor = _resident_bytes() or 0  # the settled resident size to come back to
        wait = 0.0  # seconds before the next trim while resident memory stays above floor + step
        next_try = 0.0
        while not self._stop.wait(self.interval):
            rss = _resident_bytes() or 0
            if rss <= floor + self.step:
                floor, wait = min(floor, rss), 0.0
                continue
            now = time.monotonic()
            if now < next_try:
                continue
            self._trim(0)
            self.trims += 1
            after = _resident_bytes() or rss
            # held: perhaps by garbage in a reference cycle (a failed call's traceback and the buffers its frames
            # hold), which only a full collection frees; at most once per GC_INTERVAL_S (it holds the GIL: ~0.1 s
            # in a server that has not frozen its startup objects, cli's gc.freeze)
            if after > floor + self.step and now - self._collected >= GC_INTERVAL_S:
                self._collected = now
                gc.collect()
                self._trim(0)
                after = _resident_bytes() or rss
            log.debug("memory trimmed: resident %d MiB -> %d MiB", rss >> 20, after >> 20)
            if after <= floor + self.step:
                wait = 0.0
            else:  # in use (a request in progress) or a working set that really grew: try again later, less
                # often (1, 2, 4, ... 30 s), never giving up, so memory freed after a burst comes back too
                wait = min(max(2 * wait, self.interval), 30.0)
            next_try = now + wait

