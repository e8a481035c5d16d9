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
* **uploads** (:class:`UploadWatch`): an admitted call whose request bytes stop arriving for
  ``--stream-idle-timeout`` seconds, or a streamed upload slower than ``--min-upload-rate-kib`` over each
  ``--upload-rate-window``, is cut with RESOURCE_EXHAUSTED naming the flag.

:func:`checkpoint` is the hook the core calls between its stages (decoded, prepared, computed): it
raises :class:`RequestExpired` when the call was cancelled or its deadline passed, so an expired request
stops instead of keeping the device busy. :func:`is_out_of_memory` recognises device and host
allocation failures, which the servicer answers with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import collections
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
DEFAULT_MIN_UPLOAD_RATE_KIB = 1024  # KiB/s a streamed upload must keep up (over the window below); 0: no check
DEFAULT_UPLOAD_RATE_WINDOW = 5.0  # seconds the upload rate is measured over (also the grace before the first check)
DEFAULT_MAX_SHM_REGIONS_PER_CLIENT = 64  # shared-memory regions one client (connection) may hold registered


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
    """The call's upload stalled (``--stream-idle-timeout``) or crawled (``--min-upload-rate-kib``) and was cut."""


class _Upload:
    """One watched upload: its idle deadline, bytes received, rate samples, and whether (why) it was cut."""

    __slots__ = ("context", "idle_deadline", "cut", "min_rate", "window", "started", "received", "samples",
                 "largest")

    def __init__(self, context: Any, idle_deadline: float, min_rate: int, window: float, now: float):
        self.context, self.idle_deadline = context, idle_deadline
        self.cut: UploadCut | None = None
        self.min_rate, self.window, self.started, self.received = min_rate, window, now, 0
        self.samples: collections.deque[tuple[float, int]] = collections.deque([(now, 0)])
        self.largest = 0  # the largest chunk received: bytes count only once a whole chunk has arrived

    def span(self) -> float:
        """The window the rate is averaged over: ``window``, widened to two chunks' time at the minimum rate
        for a client that sends large chunks (gRPC hands a message over only when all of it has arrived, so
        a 128 MiB chunk on a 10 MiB/s link reads as 0 bytes for 12 s). An upload arriving at 1.5x the
        minimum or faster is then never cut, whatever its chunk size."""
        return max(self.window, 2.0 * self.largest / self.min_rate) if self.min_rate else self.window

    def rate_below(self, now: float) -> float | None:
        """Bytes per second received over the last :meth:`span` seconds when below ``min_rate`` (else None);
        None too before the first chunk has arrived (``--stream-idle-timeout`` bounds that wait), before the
        upload has lasted a span (the grace: a call's first bytes may wait for a connection, TLS,
        flow-control windows) or without a minimum rate. Takes a sample of ``received`` (called by the watch
        thread, a few times per window)."""
        if not self.min_rate or not self.largest:  # before the first chunk: --stream-idle-timeout bounds it
            return None
        self.samples.append((now, self.received))
        span = self.span()
        # keep the newest sample at or before now - span (the start of the window) and all after it
        while len(self.samples) > 1 and self.samples[1][0] <= now - span:
            self.samples.popleft()
        t0, n0 = self.samples[0]
        if t0 > now - span or now <= t0:
            return None
        rate = (self.received - n0) / (now - t0)
        return rate if rate < self.min_rate else None


class UploadWatch:
    """Cuts admitted calls whose request bytes stop arriving (``--stream-idle-timeout``), or arrive slower
    than a minimum rate (``--min-upload-rate-kib``, for the calls watched with one).

    An admitted call holds a ``--max-concurrent-requests`` place, a thread and the part of its request
    received so far; a client that opens a call and then sends nothing (or stops half-way) would hold
    them for ever: keepalive does not help, since a live client answers pings. Each upload is watched
    from admission until its last byte arrived (:meth:`watch`; a stream calls ``touch(nbytes)`` on each
    chunk, so the idle limit is on the time *between* chunks; a unary request arrives as one message, so
    it must arrive in full within the timeout). One daemon thread checks a few times per timeout (and per
    rate window) and ends an idle or too slow call with RESOURCE_EXHAUSTED naming the flag (the reader
    blocked on it then raises at once, so the place, the thread and the buffer come back).

    The idle timeout alone lets a client keep its place by trickling one byte per timeout. A watch with
    ``min_rate`` (bytes per second; the streaming transport passes ``--min-upload-rate-kib``) also cuts
    an upload whose bytes received over the last ``window`` seconds (a sliding window, sampled by the
    watch thread) average less than ``min_rate``; the first check comes once the upload has lasted
    ``window`` seconds (the grace period). Bytes are counted as gRPC hands whole chunk messages to the
    server, so a chunk should take well under a window to send at the minimum rate (the client's default
    4 MiB chunk takes 4 s at 1 MiB/s, inside the default 5 s window).
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._watched: dict[int, _Upload] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.cuts = 0       # calls cut, for either reason
        self.slow_cuts = 0  # of which for their rate

    @contextlib.contextmanager
    def watch(self, context: Any, min_rate: int = 0, window: float = DEFAULT_UPLOAD_RATE_WINDOW
              ) -> Iterator[Callable[..., None]]:
        """Watch ``context``'s upload for the block; yields ``touch(nbytes=0)`` (progress: restart the idle
        clock, and count ``nbytes`` received towards the rate). ``min_rate``: bytes per second the upload
        must average over each ``window`` seconds once it has lasted that long (0: no minimum).
        Raises :class:`UploadCut` (after the block's own error) when the watch cut the call."""
        now = time.monotonic()
        entry = _Upload(context, now + self.timeout, int(min_rate), float(window), now)
        key = id(entry)
        with self._lock:
            self._watched[key] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="advantage-upload-watch", daemon=True)
                self._thread.start()

        def touch(nbytes: int = 0) -> None:
            entry.idle_deadline = time.monotonic() + self.timeout
            entry.received += nbytes
            entry.largest = max(entry.largest, nbytes)

        try:
            yield touch
        except Exception:
            if entry.cut is not None:
                raise entry.cut from None
            raise
        finally:
            with self._lock:
                self._watched.pop(key, None)
        if entry.cut is not None:
            raise entry.cut

    def error(self) -> UploadCut:
        return UploadCut(f"no request bytes arrived for {self.timeout:g} s, so the server cut the call: an upload "
                         f"must not stall for longer than the server's --stream-idle-timeout={self.timeout:g} "
                         "(a unary request must arrive in full within it); send the request without pauses")

    @staticmethod
    def slow_error(rate: float, entry: _Upload) -> UploadCut:
        return UploadCut(f"the upload arrived at {rate / 1024:.1f} KiB/s over the last {entry.span():g} s, below the "
                         f"server's --min-upload-rate-kib={entry.min_rate // 1024} (KiB per second, averaged over "
                         f"--upload-rate-window={entry.window:g} s), so the server cut the call; send the request at "
                         "full speed (or ask the operator to lower the minimum; 0 turns it off)")

    def stop(self) -> None:
        self._stop.set()

    def _period(self) -> float:
        with self._lock:
            windows = [e.window for e in self._watched.values() if e.min_rate]
        return min(1.0, self.timeout / 4, *(w / 4 for w in windows))

    def _run(self) -> None:
        while not self._stop.wait(self._period()):
            now = time.monotonic()
            cut: list[_Upload] = []
            with self._lock:
                for e in self._watched.values():
                    if e.cut is not None:
                        continue
                    if e.idle_deadline <= now:
                        e.cut = self.error()
                    else:
                        rate = e.rate_below(now)
                        if rate is None:
                            continue
                        e.cut = self.slow_error(rate, e)
                        self.slow_cuts += 1
                    cut.append(e)
            for e in cut:
                self.cuts += 1
                why = (f"stalled for {self.timeout:g} s (--stream-idle-timeout)" if e.idle_deadline <= now else
                       f"arrived slower than --min-upload-rate-kib={e.min_rate // 1024}")
                log.warning("cut a call whose upload %s", why)
                _cancel_with_status(e.context, e.cut)


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
    """Resident bytes the heap trim can act on: resident minus resident shared pages (``/proc/self/statm``
    fields 2 - 3). Shared pages are files and shared memory (libraries, and the clients' memfd regions the
    server maps: touched, they count as resident, but no trim gives them back); None without /proc."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryTrimmer:
    """Hands freed heap memory back to the OS when resident memory grew by more than ``step`` bytes.

    A large request (or a large upload its client cancelled) leaves gRPC's many small receive buffers
    freed but still resident in glibc's heap; without trimming, a server that saw a few 200 MB requests
    keeps gigabytes resident (measured: 8 cancelled 192 MiB uploads took a server from 233 MiB to 3 GiB
    resident; with this, it comes back to ~240 MiB). Checks every ``interval`` seconds (one read of
    /proc/self/statm); a no-op where glibc's ``malloc_trim`` or /proc is missing. When a trim leaves resident
    memory high, it runs a full garbage collection and trims again (cyclic garbage can hold a request's
    bytes), then retries after 1, 2, 4 ... 30 s for as long as memory stays high.
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
            if after > floor + self.step:  # held: perhaps by garbage in a reference cycle (a failed call's
                gc.collect()  # traceback and the buffers its frames hold), which only a full collection frees
                self._trim(0)
                after = _resident_bytes() or rss
            log.debug("memory trimmed: resident %d MiB -> %d MiB", rss >> 20, after >> 20)
            if after <= floor + self.step:
                wait = 0.0
            else:  # in use (a request in progress) or a working set that really grew: try again later, less
                # often (1, 2, 4, ... 30 s), never giving up, so memory freed after a burst comes back too
                wait = min(max(2 * wait, self.interval), 30.0)
            next_try = now + wait
