"""Server limits and request lifetime: size and element caps, admission, deadlines, out-of-memory, drain.

One :class:`RequestGate` per server decides, for every ``AdvantageService`` call:

* **drain**: once :meth:`RequestGate.start_draining` ran (SIGTERM), every new call is refused with
  UNAVAILABLE (a client with the retry policy tries another replica); calls already admitted finish,
  and :meth:`RequestGate.wait_idle` tells the server when the last one did.
* **admission**: at most ``max_concurrent_requests`` ``ComputeAdvantage`` calls are in progress at once
  (computing, or waiting for one of the ``workers`` compute slots). The next one is refused at once with
  RESOURCE_EXHAUSTED naming ``--max-concurrent-requests`` and its value: there is no unbounded queue.
* **compute slots**: at most ``workers`` calls compute at once; an admitted call waits for a slot only
  while its client is still there and its deadline has not passed.

:func:`checkpoint` is the hook the core calls between its stages (decoded, prepared, computed): it
raises :class:`RequestExpired` when the call was cancelled or its deadline passed, so an expired request
stops instead of keeping the device busy. :func:`is_out_of_memory` recognises device and host
allocation failures, which the servicer answers with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Iterator

from advantage_server.errors import ResourceLimit

log = logging.getLogger("advantage_server")

#: calls outside ``--max-concurrent-requests`` (ListEstimators, RegisterSharedMemory,
#: UnregisterSharedMemory, reflection streams) served at once; the next one is refused at once with
#: RESOURCE_EXHAUSTED, so silent or slow clients of these methods cannot take every thread
LIGHT_CALLS = 8
#: the largest request body of ListEstimators / RegisterSharedMemory / UnregisterSharedMemory (all a few
#: bytes); a larger one is INVALID_ARGUMENT before it is parsed
LIGHT_BODY_BYTES = 64 << 10
#: threads beyond ``max(workers, max_concurrent_requests) + LIGHT_CALLS`` for health checks and
#: refusals, so these never wait behind computations or the calls above.
SPARE_THREADS = 8
#: gRPC's own cap on calls of any kind inside the server (``maximum_concurrent_rpcs``) is this many
#: times the thread pool: a hard bound on what can queue for a thread even under a flood.
BACKSTOP_FACTOR = 4

DEFAULT_MAX_MESSAGE_MB = 1024
DEFAULT_MAX_STREAM_MB = 8192  # largest request through the streaming RPC
DEFAULT_MAX_BATCH_ELEMENTS = 1 << 27
DEFAULT_MAX_CONCURRENT_REQUESTS = 32
DEFAULT_WORKERS = 8
DEFAULT_STREAM_IDLE_TIMEOUT = 30.0  # seconds an admitted upload may go without receiving request bytes


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

    def __post_init__(self) -> None:
        timeout = self.stream_idle_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"--stream-idle-timeout must be a positive number of seconds, got {timeout!r}")
        for f in dataclasses.fields(self):
            if f.name == "stream_idle_timeout":
                continue
            value = getattr(self, f.name)
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
    def thread_pool_size(self) -> int:
        return max(self.workers, self.max_concurrent_requests) + LIGHT_CALLS + SPARE_THREADS

    @property
    def grpc_max_concurrent_rpcs(self) -> int:
        return self.thread_pool_size * BACKSTOP_FACTOR


class Draining(Exception):
    """The server is shutting down; the call was not started (UNAVAILABLE: retry on another replica)."""


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


def grpc_liveness(context: Any) -> Callable[[str], None]:
    """A checkpoint for a ``grpc.ServicerContext``: raises when the call was cancelled or expired."""
    def check(stage: str) -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestExpired(stage, deadline=True)
        if not context.is_active():
            raise RequestExpired(stage, deadline=False)
    return check


# ------------------------------------------------------------------------------ the gate
class RequestGate:
    """Admission (``max_concurrent_requests``), compute slots (``workers``) and drain for one server."""

    def __init__(self, max_concurrent_requests: int, workers: int):
        self.max_concurrent_requests = max_concurrent_requests
        self.workers = workers
        self._cond = threading.Condition()
        self._in_flight = 0   # every admitted call of the service (ComputeAdvantage and the rest)
        self._limited = 0     # admitted ComputeAdvantage calls
        self._light = 0       # calls holding a LIGHT_CALLS place (see light())
        self._draining = False
        self._slots = threading.BoundedSemaphore(workers)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    @contextlib.contextmanager
    def admit(self, limited: bool, on_termination: Callable[[Callable[[], None]], bool] | None = None
              ) -> Iterator[None]:
        """Hold one place for a call; ``limited`` calls count against ``max_concurrent_requests``.

        Raises :class:`Draining` after :meth:`start_draining`, ``ResourceLimit`` when the limit is reached.
        The concurrency place is given back when the block ends (a client that is slow to read its
        response does not hold it); the call stays *in flight* for the drain until ``on_termination``
        (``ServicerContext.add_callback``: the response was delivered, or the call ended otherwise)
        reports it, so a drain never cuts a response that is still being sent.
        """
        with self._cond:
            if self._draining:
                raise Draining("the server is shutting down and takes no new calls; retry on another replica")
            if limited and self._limited >= self.max_concurrent_requests:
                raise ResourceLimit(
                    f"the server is at its concurrency limit: --max-concurrent-requests={self.max_concurrent_requests} "
                    "requests are already in progress; retry with backoff, or add replicas")
            self._in_flight += 1
            self._limited += limited

        def leave() -> None:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._limited -= limited
            if on_termination is None or not on_termination(leave):
                leave()

    @contextlib.contextmanager
    def light(self, what: str) -> Iterator[None]:
        """Hold one of the ``LIGHT_CALLS`` places of the methods outside ``--max-concurrent-requests``
        (``what``: the method); ``ResourceLimit`` at once when they are all taken."""
        with self._cond:
            if self._light >= LIGHT_CALLS:
                raise ResourceLimit(
                    f"the server is busy: {LIGHT_CALLS} calls of ListEstimators, RegisterSharedMemory, "
                    f"UnregisterSharedMemory and server reflection are already in progress (the most at once), "
                    f"so this {what} call was refused; retry with backoff")
            self._light += 1
        try:
            yield
        finally:
            with self._cond:
                self._light -= 1

    @contextlib.contextmanager
    def compute_slot(self, check: Callable[[str], None], poll: float = 0.05) -> Iterator[None]:
        """Wait for one of the ``workers`` compute slots while ``check`` passes (the call is alive)."""
        check("while waiting for a compute slot")
        while not self._slots.acquire(timeout=poll):
            check("while waiting for a compute slot")
        try:
            yield
        finally:
            self._slots.release()

    def start_draining(self) -> None:
        with self._cond:
            self._draining = True

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no admitted call is left (``timeout`` None: no limit). True when idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True


# ------------------------------------------------------------------------------ stalled uploads
class UploadCut(ResourceLimit):
    """The call's upload made no progress for ``--stream-idle-timeout`` seconds and was cut."""


class UploadWatch:
    """Cuts admitted calls whose request bytes stop arriving (``--stream-idle-timeout``).

    An admitted call holds a ``--max-concurrent-requests`` place, a thread and the part of its request
    received so far; a client that opens a call and then sends nothing (or stops half-way) would hold
    them for ever: keepalive does not help, since a live client answers pings. Each upload is watched
    from admission until its last byte arrived (:meth:`watch`; a stream calls ``touch`` on each chunk, so
    the limit is on the time *between* chunks; a unary request arrives as one message, so it must arrive
    in full within the timeout). One daemon thread checks a few times per timeout and ends an idle call
    with RESOURCE_EXHAUSTED naming the flag (the reader blocked on it then raises at once, so the place,
    the thread and the buffer come back).
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._watched: dict[int, list] = {}  # id -> [idle deadline, context, cut flag]
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.cuts = 0

    @contextlib.contextmanager
    def watch(self, context: Any) -> Iterator[Callable[[], None]]:
        """Watch ``context``'s upload for the block; yields ``touch()`` (progress: restart the idle clock).
        Raises :class:`UploadCut` (after the block's own error) when the watch cut the call."""
        entry = [time.monotonic() + self.timeout, context, False]
        key = id(entry)
        with self._lock:
            self._watched[key] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="advantage-upload-watch", daemon=True)
                self._thread.start()

        def touch() -> None:
            entry[0] = time.monotonic() + self.timeout

        try:
            yield touch
        except Exception:
            if entry[2]:
                raise self.error() from None
            raise
        finally:
            with self._lock:
                self._watched.pop(key, None)
        if entry[2]:
            raise self.error()

    def error(self) -> UploadCut:
        return UploadCut(f"no request bytes arrived for {self.timeout:g} s, so the server cut the call: an upload "
                         f"must not stall for longer than the server's --stream-idle-timeout={self.timeout:g} "
                         "(a unary request must arrive in full within it); send the request without pauses")

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                idle = [e for e in self._watched.values() if e[0] <= now and not e[2]]
                for e in idle:
                    e[2] = True
            for e in idle:
                self.cuts += 1
                log.warning("cut a call whose upload stalled for %g s (--stream-idle-timeout)", self.timeout)
                _cancel_with_status(e[1], self.error())


def _cancel_with_status(context: Any, exc: ResourceLimit) -> None:
    """End a call from another thread with RESOURCE_EXHAUSTED and ``exc``'s message. gRPC's public
    ``ServicerContext.cancel()`` cannot carry a status (the client would see a bare CANCELLED); the core
    call underneath can, so use it when it is there."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            from grpc._cython import cygrpc
            call.cancel(cygrpc.StatusCode.resource_exhausted, str(exc))
            return
        except Exception:  # noqa: BLE001 - an internal API that moved: fall back to the public one
            pass
    try:
        context.cancel()
    except Exception:  # noqa: BLE001 - already over
        pass


# ------------------------------------------------------------------------------ memory
def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryTrimmer:
    """Hands freed heap memory back to the OS when resident memory grew by more than ``step`` bytes.

    A large request (or a large upload its client cancelled) leaves gRPC's many small receive buffers
    freed but still resident in glibc's heap; without trimming, a server that saw a few 200 MB requests
    keeps gigabytes resident (measured: 8 cancelled 192 MiB uploads took a server from 233 MiB to 3 GiB
    resident; with this, it comes back to ~240 MiB). Checks every ``interval`` seconds (one read of
    /proc/self/statm); a no-op where glibc's ``malloc_trim`` or /proc is missing.
    """

    def __init__(self, interval: float = 1.0, step: int = 64 << 20):
        self.interval, self.step = interval, step
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
        misses = 0
        while not self._stop.wait(self.interval):
            rss = _resident_bytes() or 0
            if rss <= floor + self.step:
                floor = min(floor, rss)
                continue
            self._trim(0)
            self.trims += 1
            after = _resident_bytes() or rss
            log.debug("memory trimmed: resident %d MiB -> %d MiB", rss >> 20, after >> 20)
            if after <= floor + self.step:
                misses = 0
            else:  # in use: a request in progress, or a working set that really grew (then adopt it)
                misses += 1
                if misses >= 5:
                    floor, misses = after, 0
