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
* **pending shares** (:class:`UploadWatch`, :meth:`RequestGate.reserve`): each client connection may have
  ``max_pending_per_connection``, and each client host ``max_pending_per_peer``, calls waiting for their
  request body (admitted, body not fully received) for sure; more only while the server has room. When every
  place is taken, a call of a client within its shares takes a place back from a client beyond one (that
  client's most stalled upload is cut with RESOURCE_EXHAUSTED naming the flag); otherwise it is refused
  as above. Calls that have their body (computing, or waiting for a compute slot) do not count.
* **full report** (:class:`FullReport`): while every ``max_concurrent_requests`` place is taken (for
  ``FULL_REPORT_AFTER`` seconds in a row), the service's health status says NOT_SERVING, so balancers and
  clients with health checking send calls elsewhere; SERVING again as soon as a place frees.
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
#: the fewest HTTP/2 streams one client connection may have open at once (``grpc.max_concurrent_streams``;
#: RFC 9113 recommends no fewer than 100); more when ``--max-concurrent-requests`` is larger (see
#: :attr:`Limits.max_streams_per_connection`). A client beyond it waits (its gRPC queues the call), it is not refused.
MIN_STREAMS_PER_CONNECTION = 100
#: seconds every ``--max-concurrent-requests`` place must stay taken before the service's health says
#: NOT_SERVING (:class:`FullReport`): a server that fills for a moment does not leave the rotation, and health
#: changes at most once per this many seconds each way
FULL_REPORT_AFTER = 2.0
#: seconds a call that cut another client's stalled upload (:meth:`UploadWatch.evict_for`) waits for the place
#: that call frees (it frees within moments: the cut ends the wait for its body at once)
EVICTION_WAIT = 2.0

# the flag defaults live in a module without imports (advantage-server parses its flags without torch)
from advantage_server.defaults import (  # noqa: E402,F401 - re-exported
    DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_MAX_SHM_REGIONS_PER_CLIENT, DEFAULT_MAX_STREAM_MB, DEFAULT_MIN_UPLOAD_RATE_KIB,
    DEFAULT_STREAM_IDLE_TIMEOUT, DEFAULT_UPLOAD_RATE_WINDOW, DEFAULT_WORKERS,
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
            if value is None and f.name.startswith("max_pending_"):  # the default share
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
        return max(self.workers, self.max_concurrent_requests) + LIGHT_CALLS + SPARE_THREADS

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

    def __init__(self, max_concurrent_requests: int, workers: int,
                 on_full: Callable[[bool], None] | None = None):
        """``on_full``: see the attribute below."""
        self.max_concurrent_requests = max_concurrent_requests
        self.workers = workers
        #: called (under the gate's lock: it must be quick and must not call the gate) with True when the last
        #: ``max_concurrent_requests`` place is taken and with False when one frees again (:class:`FullReport`)
        self.on_full = on_full
        self._cond = threading.Condition()
        self._in_flight = 0   # every admitted call of the service (ComputeAdvantage and the rest)
        self._limited = 0     # admitted ComputeAdvantage calls
        self._light = 0       # calls holding a LIGHT_CALLS place (see light())
        self._reserved: set[int] = set()  # threads holding a reserved place for their next admit (reserve())
        self._draining = False
        #: while draining, time.monotonic() since which no call was refused (the drain's start, then each refusal)
        self._quiet_since: float | None = None
        self._slots = threading.BoundedSemaphore(workers)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def full(self) -> bool:
        """Every ``max_concurrent_requests`` place is taken or reserved (the next ComputeAdvantage call is refused)."""
        return self._limited + len(self._reserved) >= self.max_concurrent_requests

    def reserve(self, timeout: float) -> bool:
        """Reserve the next ``max_concurrent_requests`` place that frees for this thread's next :meth:`admit`
        (a call that made room with :meth:`UploadWatch.evict_for`): other calls see the server full meanwhile,
        so a client reopening its cut call cannot take the place first. Waits at most ``timeout`` seconds for
        the place; True when this thread holds it (its next limited admit takes it), False (nothing held) when
        no place freed in time or the server is draining. :meth:`unreserve` gives back a reservation unused."""
        me = threading.get_ident()
        deadline = time.monotonic() + timeout
        with self._cond:
            self._reserved.add(me)
            while self._limited + len(self._reserved) > self.max_concurrent_requests and not self._draining:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._limited + len(self._reserved) > self.max_concurrent_requests or self._draining:
                self._reserved.discard(me)
                return False
            return True

    def unreserve(self) -> None:
        """Give back this thread's reservation if :meth:`admit` did not take it (a no-op otherwise)."""
        if threading.get_ident() not in self._reserved:  # the common case, without the lock
            return
        with self._cond:
            if threading.get_ident() in self._reserved:
                self._reserved.discard(threading.get_ident())
                self._cond.notify_all()

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
                self._quiet_since = time.monotonic()
                raise Draining("the server is shutting down and takes no new calls; retry on another replica")
            mine = limited and threading.get_ident() in self._reserved  # a place reserve() held for this call
            if mine:
                self._reserved.discard(threading.get_ident())
            elif limited and self._limited + len(self._reserved) >= self.max_concurrent_requests:
                raise ResourceLimit(
                    f"the server is at its concurrency limit: --max-concurrent-requests={self.max_concurrent_requests} "
                    "requests are already in progress; retry with backoff, or add replicas")
            self._in_flight += 1
            self._limited += limited
            if limited and self._limited == self.max_concurrent_requests and self.on_full is not None:
                self.on_full(True)

        def leave() -> None:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                if limited and self._limited == self.max_concurrent_requests and self.on_full is not None:
                    self.on_full(False)
                self._limited -= limited
                if limited:
                    self._cond.notify_all()  # a reserve() waiting for this place
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
            if not self._draining:
                self._quiet_since = time.monotonic()
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

    def wait_quiet(self, quiet: float, timeout: float) -> bool:
        """After :meth:`start_draining`: wait until ``quiet`` seconds have passed since the drain began and since
        the last call it refused, at most ``timeout`` seconds. True when quiet. The drain calls it before gRPC
        stops taking calls, so that clients told NOT_SERVING or UNAVAILABLE have gone elsewhere by then (see
        ``BoundServer.stop``)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            with self._cond:
                last = self._quiet_since
            now = time.monotonic()
            if last is None or now - last >= quiet:
                return True
            if now >= deadline:
                return False
            time.sleep(min(quiet - (now - last), deadline - now))


class FullReport:
    """Tells ``report(serving)`` whether the server has a free ``--max-concurrent-requests`` place: False once
    every place has stayed taken for ``after`` seconds in a row, True again as soon as one frees.

    The server wires it to the health status of ``advantage.v1.AdvantageService`` (:class:`RequestGate`'s
    ``on_full`` feeds it), so load balancers, Kubernetes readiness probes and clients with health checking
    send new calls to another replica while this one is full. Flapping is bounded: a NOT_SERVING comes only
    after ``after`` seconds full without a break, so a server at the edge of its limit changes status at most
    twice per ``after`` seconds. One daemon thread (started by :meth:`start`) makes the calls, never under the
    gate's lock; ``changes`` counts them.
    """

    def __init__(self, report: Callable[[bool], None], after: float = FULL_REPORT_AFTER):
        self._report, self.after = report, after
        self._cond = threading.Condition()
        self._full_since: float | None = None  # when the last place was taken (None: a place is free)
        self._said_full = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.changes = 0

    def __call__(self, full: bool) -> None:
        """The gate's ``on_full``: record the change (quick, called under the gate's lock)."""
        with self._cond:
            self._full_since = time.monotonic() if full else None
            self._cond.notify()

    def start(self) -> "FullReport":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="advantage-full-report", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _next_change(self) -> bool | None:
        """Wait (under ``_cond``) for the next status to report: True (full), False (a place is free), None (stop)."""
        while not self._stopped:
            since = self._full_since
            if since is not None and not self._said_full:
                left = since + self.after - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
            elif since is None and self._said_full:
                return False
            else:
                self._cond.wait()
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                full = self._next_change()
                if full is None:
                    return
                self._said_full = full
                self.changes += 1
            if full:
                log.warning("every --max-concurrent-requests place taken for %.1f s: health NOT_SERVING until one "
                            "frees", self.after)
            else:
                log.info("a --max-concurrent-requests place is free again: health SERVING")
            try:
                self._report(not full)
            except Exception:  # noqa: BLE001 - a failed report must not end the thread
                log.exception("could not report the server's fullness to its health service")


# ------------------------------------------------------------------------------ who a call comes from
def call_peer(context: Any) -> str:
    """The call's connection as gRPC names it (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``); ``unknown``
    when the context gives none (in-process tests)."""
    try:
        peer = context.peer()
    except Exception:  # noqa: BLE001 - a context without a peer
        peer = None
    return peer if isinstance(peer, str) and peer else "unknown"


def peer_host(peer: str) -> str:
    """The client host of a peer string: ``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4``, ``ipv6:[::1]:5678`` ->
    ``ipv6:[::1]``, an IPv4 client seen through an IPv6 socket (``ipv6:[::ffff:1.2.3.4]:5678``) ->
    ``ipv4:1.2.3.4``; anything else (``unix:...``, ``unknown``) unchanged (all such clients are one host).

    Every IPv4 loopback address (``127.0.0.0/8``) is this machine, so all of them are one host,
    ``ipv4:127.0.0.1``: a same-host client that binds its connections to 127.0.0.2, 127.0.0.3, ... (any
    process may) would otherwise get one share per address, enough of them to hold every place while
    "within its share" on each (IPv6 loopback, ``::1``, is a single address and stays its own host)."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return peer
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return peer
    if host.lower().startswith("ipv6:[::ffff:") and host.endswith("]") and "." in host:
        host = "ipv4:" + host[len("ipv6:[::ffff:"):-1]
    if host.startswith("ipv4:127."):
        return "ipv4:127.0.0.1"
    return host


# ------------------------------------------------------------------------------ stalled uploads
class UploadCut(ResourceLimit):
    """The call's upload stalled (``--stream-idle-timeout``) or crawled (``--min-upload-rate-kib``) and was cut."""


class _Upload:
    """One watched upload: its idle deadline, bytes received, rate samples, and whether (why) it was cut."""

    __slots__ = ("context", "idle_deadline", "cut", "min_rate", "window", "started", "received", "samples",
                 "largest", "keys")

    def __init__(self, context: Any, idle_deadline: float, min_rate: int, window: float, now: float):
        self.context, self.idle_deadline = context, idle_deadline
        self.cut: UploadCut | None = None
        self.keys: tuple[str, ...] = ()  # its connection's and host's pending counters (a counted upload)
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

    Each client's share (``per_connection``, ``per_peer``; 0: no bound): a watched upload (``counted``, the
    default) is *pending* for its connection (the peer string) and its host (:func:`peer_host`) until its block
    ends, i.e. until its body has arrived (or the call ended). While the server has room, a client may have more
    calls pending than its share (a trainer's burst of uploads); once every place is taken, a new call of a client
    that is within both its shares takes a place back (:meth:`evict_for`): the upload that has gone longest
    without bytes among those of clients beyond a share is cut with RESOURCE_EXHAUSTED naming the flag, and its
    place is reserved for the newcomer (:meth:`RequestGate.reserve`). So a client that opens calls and sends
    nothing keeps at most its share of the places whenever somebody else needs one, however fast it reopens
    them (cutting stalled calls alone did not help: one client sending nothing kept every place). Calls that have
    their body (computing, waiting for a compute slot) hold no share, so many trainer processes on one host are
    limited only by ``--max-concurrent-requests``.

    The idle timeout alone lets a client keep its place by trickling one byte per timeout. A watch with
    ``min_rate`` (bytes per second; the streaming transport passes ``--min-upload-rate-kib``) also cuts
    an upload whose bytes received over the last ``window`` seconds (a sliding window, sampled by the
    watch thread) average less than ``min_rate``; the first check comes once the upload has lasted
    ``window`` seconds (the grace period). Bytes are counted as gRPC hands whole chunk messages to the
    server, so a chunk should take well under a window to send at the minimum rate (the client's default
    4 MiB chunk takes 4 s at 1 MiB/s, inside the default 5 s window).
    """

    def __init__(self, timeout: float, per_peer: int = 0, per_connection: int = 0):
        self.timeout = timeout
        self.per_peer, self.per_connection = per_peer, per_connection
        self._lock = threading.Lock()
        self._watched: dict[int, _Upload] = {}
        self._pending: collections.Counter[str] = collections.Counter()  # connection or host -> pending calls
        self.evictions = 0  # calls cut by evict_for
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.cuts = 0       # calls cut, for either reason
        self.slow_cuts = 0  # of which for their rate

    def _over_share(self, keys: tuple[str, ...]) -> str | None:
        """The flag a connection's and host's pending counters (``keys``) are beyond (None: within both); under
        ``_lock``."""
        conn, host = keys
        if self.per_connection and self._pending[conn] > self.per_connection:
            return f"--max-pending-per-connection={self.per_connection}"
        if self.per_peer and self._pending[host] > self.per_peer:
            return f"--max-pending-per-peer={self.per_peer}"
        return None

    def evict_for(self, context: Any) -> bool:
        """The server is full and ``context``'s call is waiting for a place: when its client is within both its
        shares (fewer pending calls than ``per_connection`` on its connection and ``per_peer`` on its host), cut
        the counted upload that has gone longest without bytes among those of clients beyond a share, with
        RESOURCE_EXHAUSTED naming the flag. True when one was cut (its place frees within moments)."""
        peer = call_peer(context)
        conn, host = "conn " + peer, "host " + peer_host(peer)
        with self._lock:
            if (self.per_connection and self._pending[conn] >= self.per_connection) or \
                    (self.per_peer and self._pending[host] >= self.per_peer):
                return False  # at (or beyond) its own share: it does not take places from others
            victims = [(e.idle_deadline, flag, e) for e in self._watched.values()
                       if e.keys and e.cut is None and (flag := self._over_share(e.keys))]
            if not victims:
                return False
            _, flag, victim = min(victims, key=lambda v: v[0])
            pending = self._pending[victim.keys[0] if "connection" in flag else victim.keys[1]]
            who = "connection" if "connection" in flag else "host"
            victim.cut = UploadCut(
                f"cut to give its place to another client: the server was full and this client's {who} had "
                f"{pending} calls waiting for their request body, more than its share, the server's {flag}; send "
                "each request in full as soon as its call starts (a client within its share keeps its calls)")
            self._unpend(victim)
            self.evictions += 1
        log.warning("server full: cut a call waiting for its body from a client beyond its share (%s)", flag)
        _cancel_with_status(victim.context, victim.cut)
        return True

    def _unpend(self, entry: _Upload) -> None:
        """Stop counting ``entry`` as pending (once); under ``_lock``."""
        for key in entry.keys:
            self._pending[key] -= 1
            if self._pending[key] <= 0:
                del self._pending[key]
        entry.keys = ()

    def pending(self, peer: str) -> tuple[int, int]:
        """(calls of connection ``peer``, calls of its host) waiting for their body now; ``peer`` is a peer
        string (``ipv4:1.2.3.4:5678``)."""
        with self._lock:
            return self._pending["conn " + peer], self._pending["host " + peer_host(peer)]

    @contextlib.contextmanager
    def watch(self, context: Any, min_rate: int = 0, window: float = DEFAULT_UPLOAD_RATE_WINDOW,
              counted: bool = True) -> Iterator[Callable[..., None]]:
        """Watch ``context``'s upload for the block; yields ``touch(nbytes=0)`` (progress: restart the idle
        clock, and count ``nbytes`` received towards the rate). ``min_rate``: bytes per second the upload
        must average over each ``window`` seconds once it has lasted that long (0: no minimum). ``counted``:
        the call is pending for its client's shares for the block (see the class docstring).
        Raises :class:`UploadCut` (after the block's own error) when the watch cut the call, or
        :meth:`evict_for` did."""
        now = time.monotonic()
        entry = _Upload(context, now + self.timeout, int(min_rate), float(window), now)
        key = id(entry)
        with self._lock:
            if counted:
                peer = call_peer(context)
                entry.keys = ("conn " + peer, "host " + peer_host(peer))
                self._pending.update(entry.keys)
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
                self._unpend(entry)
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
    try:  # a bare CANCELLED, which the client's retry policy sends again (the status above is not retried)
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
