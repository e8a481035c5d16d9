"""Admission and drain: the :class:`RequestGate` every ``AdvantageService`` call passes, one per server.

* **drain**: once :meth:`RequestGate.start_draining` ran (SIGTERM), every new call is refused with
  :class:`Draining` (UNAVAILABLE: a client with the retry policy tries another replica); calls already admitted
  finish, and :meth:`RequestGate.wait_idle` tells the server when the last one did.
* **admission**: at most ``max_concurrent_requests`` ``ComputeAdvantage`` calls are in progress at once
  (receiving their body, computing, or waiting for one of the ``workers`` compute slots). The next one is
  refused at once with :class:`Overloaded`: RESOURCE_EXHAUSTED naming ``--max-concurrent-requests``, with the
  trailing metadata ``grpc-retry-pushback-ms`` (:func:`refusal_metadata`), gRPC's standard way for a server to
  say "retry after this many milliseconds"; there is no unbounded queue. Before that, a caller within its fair
  share may take a place back from a client holding more places with stalled uploads
  (:meth:`advantage_server.uploads.UploadWatch.evict_for`, :meth:`RequestGate.lend`).
* **compute slots**: at most ``workers`` calls compute at once; an admitted call waits for a slot only while
  its client is still there and its deadline has not passed.
* **light calls**: the methods outside ``--max-concurrent-requests`` (ListEstimators, the shared-memory
  registrations, reflection) share ``LIGHT_CALLS`` places of their own.

Being full is not being down: the health status stays SERVING while every place is taken (RELIABILITY.md,
"The admission model"); a full server answers each call it cannot take with a retryable refusal instead.
"""
from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Callable, Iterator

from advantage_server.errors import ResourceLimit

#: calls outside ``--max-concurrent-requests`` (ListEstimators, RegisterSharedMemory,
#: UnregisterSharedMemory, reflection streams) served at once; the next one is refused at once with
#: RESOURCE_EXHAUSTED, so silent or slow clients of these methods cannot take every thread
LIGHT_CALLS = 8
#: the ``grpc-retry-pushback-ms`` an admission refusal carries, drawn uniformly from this range of milliseconds
#: for each refusal (:func:`draw_pushback_ms`): how long the client should wait before sending the call again.
#: Drawn, not fixed, so that clients refused together do not come back together (gRPC's own retry honours a pushback as
#: given, without jitter; the project's client also multiplies it by a random factor in [1, 1.5], at most 5 times
#: per call). 50 ms is a few calls' compute time; 200 ms keeps a retried call's added latency small.
ADMISSION_PUSHBACK_MS = (50, 200)
#: gRPC's trailing-metadata key for a server's retry pushback (gRFC A6); an integer number of milliseconds
PUSHBACK_KEY = "grpc-retry-pushback-ms"


def draw_pushback_ms() -> int:
    """One admission refusal's pushback: an integer number of milliseconds, uniform in ``ADMISSION_PUSHBACK_MS``."""
    return random.randint(*ADMISSION_PUSHBACK_MS)


class Draining(Exception):
    """The server is shutting down; the call was not started (UNAVAILABLE: retry on another replica)."""


class Overloaded(ResourceLimit):
    """An admission refusal: no place for the call now (RESOURCE_EXHAUSTED naming the flag). It says nothing
    about the request: the same call may be sent again after ``pushback_ms`` milliseconds (the status carries
    them as ``grpc-retry-pushback-ms``), to this replica or another. ``pushback_ms`` None: drawn
    (:func:`draw_pushback_ms`)."""

    def __init__(self, message: str, pushback_ms: int | None = None):
        super().__init__(message)
        self.pushback_ms = draw_pushback_ms() if pushback_ms is None else int(pushback_ms)


def refusal_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for the status a call that raised ``exc`` ends with: ``grpc-retry-pushback-ms`` for an
    :class:`Overloaded` (an admission refusal), nothing for every other error (a size limit, out of memory, an
    upload cut: retrying the same request would not help)."""
    if isinstance(exc, Overloaded):
        return ((PUSHBACK_KEY, str(max(0, exc.pushback_ms))),)
    return ()


class RequestGate:
    """Admission (``max_concurrent_requests``), compute slots (``workers``) and drain for one server."""

    def __init__(self, max_concurrent_requests: int, workers: int):
        self.max_concurrent_requests = max_concurrent_requests
        self.workers = workers
        self._cond = threading.Condition()
        self._in_flight = 0   # every admitted call of the service (ComputeAdvantage and the rest)
        self._limited = 0     # admitted ComputeAdvantage calls
        self._light = 0       # calls holding a LIGHT_CALLS place (see light())
        self._reserved: set[int] = set()  # threads holding a lent place for their next admit (lend())
        self._draining = False
        #: while draining, time.monotonic() since which no call was refused (the drain's start, then each refusal)
        self._quiet_since: float | None = None
        self._slots = threading.BoundedSemaphore(workers)
        self.refusals = 0  # limited calls refused for want of a place (Overloaded)
        self._owed = 0  # places lent to newcomers by cut calls that are still unwinding (lend/repay)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def full(self) -> bool:
        """Every ``max_concurrent_requests`` place is taken or reserved (the next ComputeAdvantage call is refused)."""
        return self._limited + len(self._reserved) >= self.max_concurrent_requests + self._owed

    def lend(self) -> None:
        """Hand this thread the place of a call :meth:`UploadWatch.evict_for` has just cut, at once: its next
        limited :meth:`admit` takes it, while the cut call is still unwinding (it gives the place back through
        :meth:`repay` when its upload block ends). So a newcomer that takes a place back from a stalled client
        does not wait for that client's thread to leave (under load, several GIL switches: tens of milliseconds),
        and no other call can take the place meanwhile. For a moment the places in use may exceed
        ``max_concurrent_requests`` by the cut calls still unwinding, whose partial bodies are being freed."""
        with self._cond:
            self._owed += 1
            self._reserved.add(threading.get_ident())

    def repay(self) -> None:
        """A call cut for another (:meth:`lend`) has left its upload: the place it lent is back in the count."""
        with self._cond:
            self._owed -= 1
            self._cond.notify_all()

    def unreserve(self) -> None:
        """Give back this thread's reservation if :meth:`admit` did not take it (a no-op otherwise)."""
        if threading.get_ident() not in self._reserved:  # the common case, without the lock
            return
        with self._cond:
            if threading.get_ident() in self._reserved:
                self._reserved.discard(threading.get_ident())
                self._cond.notify_all()

    @contextlib.contextmanager
    def admit(self, limited: bool, on_termination: Callable[[Callable[[], None]], bool] | None = None,
              make_room: Callable[[], object] | None = None) -> Iterator[None]:
        """Hold one place for a call; ``limited`` calls count against ``max_concurrent_requests``.

        Raises :class:`Draining` after :meth:`start_draining`, :class:`Overloaded` when the limit is reached.
        ``make_room`` (the servicer's: take a place back by the fair shares and :meth:`lend` it): called once,
        outside the gate's lock, when a limited call finds every place taken; the call then tries once more (a
        place that freed between the two is taken too). The concurrency place is given back when the block
        ends (a client that is slow to read its response does not hold it); the call stays *in flight* for the
        drain until ``on_termination`` (``ServicerContext.add_callback``: the response was delivered, or the
        call ended otherwise) reports it, so a drain never cuts a response that is still being sent.
        """
        tried = make_room is None
        while True:
            with self._cond:
                if self._draining:
                    self._quiet_since = time.monotonic()
                    raise Draining("the server is shutting down and takes no new calls; retry on another replica")
                mine = limited and threading.get_ident() in self._reserved  # a place lend() handed this call
                if mine:
                    self._reserved.discard(threading.get_ident())
                    break
                if not (limited and self._limited + len(self._reserved) >= self.max_concurrent_requests + self._owed):
                    break
                if tried:
                    self.refusals += 1
                    raise Overloaded(
                        f"the server is at its concurrency limit: --max-concurrent-requests={self.max_concurrent_requests} "
                        "requests are already in progress; retry after the server's pushback (grpc-retry-pushback-ms: "
                        "AdvantageClient does), or add replicas")
            tried = True
            make_room()  # outside the lock: it cuts another client's stalled upload and reserves its place
        with self._cond:
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
                if limited:
                    self._cond.notify_all()  # wait_idle
            if on_termination is None or not on_termination(leave):
                leave()

    @contextlib.contextmanager
    def light(self, what: str) -> Iterator[None]:
        """Hold one of the ``LIGHT_CALLS`` places of the methods outside ``--max-concurrent-requests``
        (``what``: the method); :class:`Overloaded` at once when they are all taken."""
        with self._cond:
            if self._light >= LIGHT_CALLS:
                raise Overloaded(
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
