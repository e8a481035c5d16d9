"""Admission and drain: the :class:`RequestGate` every ``AdvantageService`` call passes, one per server.

* **drain**: once :meth:`RequestGate.start_draining` ran (SIGTERM), every new call is refused with
  :class:`Draining` (UNAVAILABLE: a client with the retry policy tries another replica); calls already admitted
  finish, and :meth:`RequestGate.wait_idle` tells the server when the last one did.
* **admission**: at most ``max_concurrent_requests`` ``ComputeAdvantage`` calls are in progress at once
  (receiving their body, computing, or waiting for one of the ``workers`` compute slots). A call that finds
  every place taken first takes one back by the fair shares when it may (a client holding more places with
  stalled uploads: :meth:`advantage_server.uploads.UploadWatch.evict_for`, :meth:`RequestGate.lend`), else it
  *waits* for one, at most ``ADMISSION_WAIT_S`` (and never past its deadline), in a bounded waiting room of
  ``max_waiting`` calls. A place that frees goes to the longest-waiting call of a connection that holds no
  stalled upload, else to the one whose host, then connection, has the fewest stalled uploads
  (:func:`advantage_server.shares.wait_rank`), not to whoever polls first: so a client that reopens stalled calls in a loop cannot take the places legitimate calls free,
  and it is answered at the pace of the waits, not in a storm of refusals that would cost the server its CPU.
  A full waiting room takes a newcomer that ranks before its last waiter by refusing that one. A call that
  gets no place is refused with :class:`Overloaded`: RESOURCE_EXHAUSTED naming ``--max-concurrent-requests``,
  with the trailing metadata ``grpc-retry-pushback-ms`` (:func:`refusal_metadata`), gRPC's standard way for a
  server to say "retry after this many milliseconds"; there is no unbounded queue. Waiting calls hold a
  thread each (the pool has ``max_waiting`` threads for them) and no request bytes (they are read after
  admission), so the memory bound does not change.
* **compute slots**: at most ``workers`` calls compute at once; an admitted call waits for a slot only while
  its client is still there and its deadline has not passed.
* **light calls**: the methods outside ``--max-concurrent-requests`` (ListEstimators, the shared-memory
  registrations, reflection) share ``LIGHT_CALLS`` places of their own.

Being full is not being down: the health status stays SERVING while every place is taken (RELIABILITY.md,
"The admission model"); a full server answers each call it cannot take with a retryable refusal instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import threading
import time
from typing import Callable, Iterator, Mapping

from advantage_server.errors import ResourceLimit
from advantage_server.shares import InheritedStalls, wait_rank

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
#: seconds a limited call that finds every place taken (and none it may take back) waits for one before it is
#: refused with the pushback; never past its deadline (less ``WAIT_DEADLINE_MARGIN_S``). Long against a call's
#: compute time (milliseconds), so a place frees during the wait under ordinary overload; short against a
#: client's timeout. A client that ignores pushbacks and reopens refused calls at once is slowed to one try
#: per wait per call it keeps open (measured: 700 refusals a second from a 24-call slow-loris without the wait).
ADMISSION_WAIT_S = 0.5
#: the wait of a call from a connection that holds a stalled upload (:data:`STALLED_FILL`): longer, so that a
#: client reopening stalled calls in a loop is answered 4x more slowly, and its calls cost the server 4x less
#: CPU (measured beside a 24-call slow-loris: 90 refusals a second with 0.5 s, a fifth of the server's time)
STALLED_WAIT_S = 2.0
#: a call whose deadline leaves less than this many seconds does not wait for a place: it is refused at once
WAIT_DEADLINE_MARGIN_S = 0.05
#: waiting calls per ``max_concurrent_requests`` place (:attr:`RequestGate.max_waiting`; the gRPC pool has a thread
#: for each): a call that finds the room full and ranks last is refused at once, and a client that reopens its
#: refused calls at once (ignoring the pushback) then costs the server a call per round trip. Measured beside a
#: 24-call slow-loris at 16 places: with one per place, 75 refusals a second and 11% of a core in the attacker;
#: with two, 6 a second and 2%
WAITING_PER_PLACE = 2
#: seconds between two tries of a waiting call (one whose connection holds no stalled upload) to take a place back
#: from a stalled upload (``make_room``): an upload counts as stalled only ``STALL_S`` after its last byte
EVICT_RETRY_S = 0.1
#: seconds between two looks of a waiting call at whether its client is still there
WAITER_POLL_S = 0.1
#: the share of the ``max_concurrent_requests`` places a call from a connection that holds a stalled upload
#: (:data:`advantage_server.shares.STALL_S`) may fill the server to: such a call is admitted only while fewer than
#: this fraction of the places are taken, so the other half stays free for connections that send their bodies
#: promptly. Without it a slow-loris refills every place it is cut from within milliseconds, and every
#: legitimate call has to cut a stalled upload (and the staller reopens it) to get one: measured, 33-63% of the
#: unattacked goodput on 2 cores. With it the prompt callers find a free place and cut nothing while they hold
#: fewer than half the places together; beyond that they take places back by the fair shares as before.
STALLED_FILL = 0.5
#: seconds a freed place is kept for the next call of the connection that freed it, when only callers holding
#: more stalled uploads than that connection are waiting (see :meth:`RequestGate.admit`): a client calling in a
#: loop sends its next call within milliseconds, so it keeps its place instead of racing a staller for it
PARK_S = 0.05


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who is asking for a place (:mod:`advantage_server.identity`) and whether it is still there, for the
    waiting room: ``connection`` (the gRPC peer string), ``host`` (:func:`~advantage_server.identity.peer_host`),
    ``alive()`` (False once the client cancelled or its deadline passed: ``ServicerContext.is_active``) and
    ``time_left()`` (seconds to its deadline, None without one: ``ServicerContext.time_remaining``).
    ``read_early()``: start reading the call's request body while it waits
    (:class:`advantage_server.uploads.EarlyBody`, :class:`advantage_server.uploads.EarlyStream`; None: it cannot); the
    waiting room calls it for a connection that only answers for its host's stalled uploads
    (:class:`~advantage_server.shares.InheritedStalls`), and once a unary body has arrived the connection has a record
    of its own (see :meth:`RequestGate.admit`). ``reading_for()``: seconds since that read started while the body has
    not arrived whole (a stream's: how far behind it is, :meth:`advantage_server.uploads.EarlyStream.reading_for`),
    None when it is not reading (never started, or done); the full room drops the reader furthest behind for a
    newcomer that would read early (:meth:`RequestGate._wait_for_place`). ``proven()``: the call's own body has shown
    itself while it waited (a stream that arrived whole, or its first 16 MiB:
    :class:`advantage_server.uploads.EarlyStream`): it ranks as a prompt caller's and may take a place back, for this
    call only; ``whole()``: it arrived whole, and it fills places as a prompt caller's too (a unary body read early
    gives its connection a record instead)."""

    connection: str
    host: str
    alive: Callable[[], bool] = lambda: True
    time_left: Callable[[], float | None] = lambda: None
    read_early: Callable[[], None] | None = None
    reading_for: Callable[[], float | None] = lambda: None
    proven: Callable[[], bool] = lambda: False
    whole: Callable[[], bool] = lambda: False


class _Waiter:
    """A call in the waiting room: ``granted`` once a freed place was handed to it (already counted as taken),
    ``dropped`` when a better-ranked newcomer took its room. ``wake``: its own condition on the gate's lock,
    notified only when its own state changes (a notify_all per freed place would wake every waiting call, and
    measured, that herd cost the server more than half of its calls beside 16 waiting slow-loris calls)."""

    __slots__ = ("caller", "arrived", "granted", "dropped", "wake")

    def __init__(self, caller: Caller, lock: threading.RLock, arrived: float | None = None):
        self.caller, self.granted, self.dropped = caller, False, False
        self.arrived = time.monotonic() if arrived is None else arrived
        self.wake = threading.Condition(lock)


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

    def __init__(self, max_concurrent_requests: int, workers: int, max_waiting: int | None = None):
        self.max_concurrent_requests = max_concurrent_requests
        self.workers = workers
        #: calls that may wait for a place at once (default ``WAITING_PER_PLACE`` per place; 0: none waits)
        self.max_waiting = WAITING_PER_PLACE * max_concurrent_requests if max_waiting is None else max_waiting
        #: the places a call from a connection holding a stalled upload may fill the server to (:data:`STALLED_FILL`)
        self.stalled_cap = max(1, int(max_concurrent_requests * STALLED_FILL))
        self.held_back = 0  # admissions held below stalled_cap for a connection holding a stalled upload
        self._waiters: list[_Waiter] = []
        #: ``() -> (stalled uploads per host, per connection)``, the order of the waiting room (the servicer wires
        #: :meth:`advantage_server.uploads.UploadWatch.stalled`); None: first come, first served
        self.stalled: Callable[[], tuple[Mapping[str, int], Mapping[str, int]]] | None = None
        self.waited = 0   # calls that waited for a place and got one
        #: places kept for a connection's next call (:data:`PARK_S`): connection -> expiry times (monotonic)
        self._parked: dict[str, list[tuple[float, tuple[int, int]]]] = {}  # connection -> (expiry, its rank)
        self._parked_n = 0
        self.parked = 0   # places kept for a connection's next call
        self.unparked = 0  # of which taken by that next call
        self.dropped = 0  # waiting calls refused to make room for a better-ranked newcomer
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the drain's waits (wait_idle); waiting calls have their own
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
        """Every ``max_concurrent_requests`` place is taken or reserved (the next ComputeAdvantage call waits or
        is refused)."""
        return self._is_full()

    @property
    def waiting(self) -> int:
        """Calls in the waiting room now."""
        return len(self._waiters)

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
            self._hand_off()

    def unreserve(self) -> None:
        """Give back this thread's reservation if :meth:`admit` did not take it (a no-op otherwise)."""
        if threading.get_ident() not in self._reserved:  # the common case, without the lock
            return
        with self._cond:
            if threading.get_ident() in self._reserved:
                self._reserved.discard(threading.get_ident())
                self._hand_off()

    def _is_full(self, cap: int | None = None) -> bool:
        taken = self._limited + self._parked_n + len(self._reserved)
        return taken >= (self.max_concurrent_requests if cap is None else cap) + self._owed

    def _cap(self, caller: Caller | None, conns: Mapping[str, int] | None = None) -> int:
        """The places ``caller`` may fill the server to: ``stalled_cap`` while its connection holds a stalled upload
        (:meth:`advantage_server.uploads.UploadWatch.stalled`), else every place; under ``_cond``."""
        if caller is None or self.stalled is None or self.stalled_cap >= self.max_concurrent_requests:
            return self.max_concurrent_requests
        if caller.whole():
            return self.max_concurrent_requests
        if conns is None:
            conns = self._counts()[1]
        return self.stalled_cap if conns.get(caller.connection) else self.max_concurrent_requests

    @staticmethod
    def _rank(w: "_Waiter", hosts: Mapping[str, int], conns: Mapping[str, int]) -> tuple[int, int, int, float]:
        """``w``'s place in the waiting room's order (:func:`advantage_server.shares.wait_rank`): a call whose body
        showed itself while it waited (:attr:`Caller.proven`) ranks as a prompt connection's."""
        if w.caller.proven():
            return 0, 0, 0, w.arrived
        return wait_rank(hosts, conns, w.caller.connection, w.caller.host, w.arrived)

    def _counts(self) -> tuple[Mapping[str, int], Mapping[str, int]]:
        return self.stalled() if self.stalled is not None else ({}, {})

    def _expire_parks(self, now: float) -> None:
        """Free the kept places whose :data:`PARK_S` ran out (all of them while draining) and hand them to
        waiting calls; under ``_cond``."""
        if not self._parked_n:
            return
        for conn in list(self._parked):
            left = [p for p in self._parked[conn] if p[0] > now and not self._draining]
            self._parked_n -= len(self._parked[conn]) - len(left)
            if left:
                self._parked[conn] = left
            else:
                del self._parked[conn]
        self._hand_off()

    def _take_park(self, caller: Caller) -> bool:
        """Take a kept place for ``caller`` (then counted in ``_limited``): one its own connection freed, else, for
        a caller whose connection holds no stalled upload, one kept for a connection that now holds one. Never
        one kept for another prompt connection: that connection's next call is on its way (taking it, a caller
        from another host made a same-host neighbour of a slow-loris find the server full, measured: 63% of its
        goodput against 103% for the other host); under ``_cond``."""
        conn = caller.connection if caller.connection in self._parked else None
        if conn is None:
            conns = self._counts()[1]
            if conns.get(caller.connection):
                return False
            conn = next((c for c in self._parked if conns.get(c)), None)
            if conn is None:
                return False
        kept = self._parked[conn]
        kept.pop()
        if not kept:
            del self._parked[conn]
        self._parked_n -= 1
        self._limited += 1
        self.unparked += 1
        return True

    def _ranked(self, waiters: list[_Waiter]) -> list[_Waiter]:
        """``waiters`` best first (:func:`advantage_server.shares.wait_rank`); under ``_cond``."""
        hosts, conns = self._counts()
        return sorted(waiters, key=lambda w: self._rank(w, hosts, conns))

    def _hand_off(self, freed_by: Caller | None = None) -> None:
        """Give free places to the best-ranked waiting calls (counted as taken at once, so no call that polls
        can take them first); under ``_cond``. ``freed_by``: the caller whose call just gave back a place. While
        some upload on the server is stalled and no waiting call ranks with or before ``freed_by`` (their hosts
        or connections hold more stalled uploads), the place is kept :data:`PARK_S` instead: for that
        connection's next call, or any caller ranking with or before it (:meth:`_take_park`). A client calling
        in a loop sends its next call within milliseconds; without the keep, a staller polling for places would
        take it first, and the client would have to cut a stalled call for every call it makes."""
        if self._draining or self._is_full():
            return
        if freed_by is None and not self._waiters:
            return
        hosts, conns = self._counts()

        def rank(w: _Waiter) -> tuple:
            return self._rank(w, hosts, conns)
        if freed_by is not None and any(conns.values()) and not conns.get(freed_by.connection):
            # (never for a stalling connection: its next call would take the place past STALLED_FILL)
            mine = wait_rank(hosts, conns, freed_by.connection, freed_by.host, 0.0)[:-1]
            if not self._waiters or rank(min(self._waiters, key=rank))[:-1] > mine:
                self._parked.setdefault(freed_by.connection, []).append((time.monotonic() + PARK_S, mine))
                self._parked_n += 1
                self.parked += 1
                return
        if not self._waiters:
            return
        for w in sorted(self._waiters, key=rank):
            if self._is_full():
                break
            if self._is_full(self._cap(w.caller, conns)):
                continue  # a connection holding a stalled upload: only below stalled_cap
            self._waiters.remove(w)
            w.granted = True
            self._limited += 1
            w.wake.notify()

    def _wait_budget(self, caller: Caller) -> float:
        """Seconds ``caller`` may wait for a place: ``ADMISSION_WAIT_S`` (``STALLED_WAIT_S`` for a connection
        holding a stalled upload), never past its deadline less ``WAIT_DEADLINE_MARGIN_S``; under ``_cond``."""
        left = caller.time_left()
        wait = STALLED_WAIT_S if self._cap(caller) < self.max_concurrent_requests else ADMISSION_WAIT_S
        return wait if left is None else min(wait, left - WAIT_DEADLINE_MARGIN_S)

    def poke(self, connection: str) -> None:
        """Wake the waiting calls of ``connection`` to look at their standing again (its record changed: a body
        read early arrived, :class:`advantage_server.uploads.EarlyBody`)."""
        with self._cond:
            for w in self._waiters:
                if w.caller.connection == connection:
                    w.wake.notify()

    def _wait_for_place(self, caller: Caller, until: float, arrived: float | None = None) -> str:
        """Wait in the waiting room for a freed place until ``until`` (monotonic): ``"granted"`` (handed to this
        call and counted), ``"dropped"`` (the room was full and ranked this call last, or a better-ranked
        newcomer took its room), ``"timeout"``, ``"gone"`` (the client left), ``"draining"``, or ``"promoted"``
        (it came in held below ``stalled_cap`` for its host's stalled uploads, its connection has a record of its
        own since, its body having arrived: :attr:`Caller.read_early`, and every place is taken: it may now take
        one back as a prompt caller). ``arrived``: when the call first entered the room (a call that left it to
        cut a stalled upload and comes back keeps its place in the order of arrival); now by default. Under
        ``_cond``."""
        conns = self._counts()[1]
        stalling = self._cap(caller, conns) < self.max_concurrent_requests
        if until <= time.monotonic() or self.max_waiting <= 0:
            return "timeout"
        me = _Waiter(caller, self._lock, arrived)
        # its body tells a prompt newcomer from a staller's fresh connection (read once it has a room's place, so that
        # at most max_waiting bodies are read early: the memory bound's 2 x C x max(F, M + 16 MiB))
        reads = stalling and caller.read_early is not None and isinstance(conns, InheritedStalls) \
            and not conns.own(caller.connection)
        if len(self._waiters) >= self.max_waiting:
            last = self._ranked([*self._waiters, me])[-1]
            if last is me and reads:
                # ranked with a staller's fresh connections and after them (it came last): it takes the room of the
                # one of them whose body has been awaited longest, so a slow-loris that fills the room too cannot
                # keep its host's new clients out (their bodies arrive within milliseconds and promote them); never
                # the room of a waiter ranked before it (arrival aside), nor of one not reading
                hosts = self._counts()[0]
                mine = wait_rank(hosts, conns, caller.connection, caller.host, 0.0)[:-1]
                unsent = ((w.caller.reading_for(), w) for w in self._waiters)
                peers = [(t, w) for t, w in unsent if t is not None and self._rank(w, hosts, conns)[:-1] >= mine]
                last = max(peers, key=lambda p: p[0])[1] if peers else me
            if last is me:
                return "dropped"
            self._waiters.remove(last)  # a better-ranked newcomer takes the room of the last waiter
            last.dropped = True
            last.wake.notify()
            self.dropped += 1
        self._waiters.append(me)
        if reads:
            caller.read_early()
        deadline = until
        promoted = False
        shown = caller.proven()  # a proof already shown: not a new reason to leave the room
        try:
            while not (me.granted or me.dropped or self._draining):
                now = time.monotonic()
                self._expire_parks(now)
                if stalling and not shown and caller.proven() and self._cap(caller) < self.max_concurrent_requests:
                    # its stream's first 16 MiB came (EarlyStream): first in rank now, still held below stalled_cap;
                    # it leaves to take a place back once (admit: make_room), then looks again every EVICT_RETRY_S
                    promoted = True
                    break
                if stalling and self._cap(caller) >= self.max_concurrent_requests:
                    # this call was held below stalled_cap, and its connection has stopped stalling since (or its
                    # body arrived early): with places free, _hand_off judges each waiter's cap anew (not on every
                    # poll: a waiter still stalling would sort the room ten times a second for nothing); with every
                    # place taken, it goes back to take one back as a prompt caller (admit: make_room)
                    if not self._is_full():
                        self._hand_off()
                    elif caller.read_early is not None:
                        promoted = True
                        break
                if me.granted:
                    break
                left = deadline - now
                if left <= 0 or not caller.alive():
                    break
                # woken when granted, dropped or drained; else at the next kept place's expiry (which may free
                # a place for it) or every WAITER_POLL_S, to see whether its client is still there
                nxt = math.inf if stalling else \
                    min((kept[0][0] for kept in self._parked.values()), default=math.inf) - now
                me.wake.wait(max(0.001, min(left, WAITER_POLL_S, nxt)))
        finally:
            if not me.granted and me in self._waiters:
                self._waiters.remove(me)
        if me.granted:
            self.waited += 1
            return "granted"
        if me.dropped:
            return "dropped"
        if self._draining:
            return "draining"
        if promoted:
            return "promoted"
        return "timeout" if time.monotonic() >= deadline else "gone"

    @contextlib.contextmanager
    def admit(self, limited: bool, on_termination: Callable[[Callable[[], None]], bool] | None = None,
              make_room: Callable[[bool], object] | None = None, caller: Caller | None = None) -> Iterator[None]:
        """Hold one place for a call; ``limited`` calls count against ``max_concurrent_requests``.

        Raises :class:`Draining` after :meth:`start_draining`, :class:`Overloaded` when a limited call gets no
        place. ``make_room(held)`` (the servicer's: take a place back by the fair shares and :meth:`lend` it): called
        outside the gate's lock when a limited call finds every place taken (``held``: or every place its
        connection may fill, ``stalled_cap``, while others are free); the call then tries once more (a
        place that freed between the two is taken too). Then, with a ``caller``, it waits for a freed place in
        the waiting room (``ADMISSION_WAIT_S``, ``STALLED_WAIT_S`` for a stalling connection, never past its
        deadline; see the module docstring) before it is refused; a caller whose connection does not stall calls
        ``make_room`` again every ``EVICT_RETRY_S`` while it waits (re-entering the room with its first arrival
        time, so it keeps its rank among equals).
        The concurrency place is given back when the block ends (a client that is slow to read its response
        does not hold it) and handed to the best-ranked waiting call at once; the call stays *in flight* for
        the drain until ``on_termination`` (``ServicerContext.add_callback``: the response was delivered, or the
        call ended otherwise) reports it, so a drain never cuts a response that is still being sent.
        """
        tried = make_room is None
        wait_end: float | None = None  # when this call's wait for a place ends (ADMISSION_WAIT_S from its start)
        arrived: float | None = None  # when it first entered the waiting room (kept across its make_room retries)
        while True:
            with self._cond:
                if self._draining:
                    self._quiet_since = time.monotonic()
                    raise Draining("the server is shutting down and takes no new calls; retry on another replica")
                mine = limited and threading.get_ident() in self._reserved  # a place lend() handed this call
                if mine:
                    self._reserved.discard(threading.get_ident())
                    self._limited += 1
                    break
                if limited and self._parked_n:
                    self._expire_parks(time.monotonic())
                    if self._parked_n and caller is not None and self._take_park(caller):
                        break  # a place kept for this connection's next call, or for callers like it
                if not limited:
                    break
                cap = self._cap(caller)
                if not self._is_full(cap):
                    self._limited += 1
                    break
                held = cap < self.max_concurrent_requests and not self._is_full()
                conns = self._counts()[1]
                inherits = caller is not None and isinstance(conns, InheritedStalls) and not conns.own(caller.connection)
                if held:
                    self.held_back += 1
                    # a staller is not given other callers' places: it waits below stalled_cap. A connection that
                    # only answers for its stalling host (no stalled upload of its own: shares.InheritedStalls) may
                    # first cut a stalled upload of its host once (make_room; evict_for: NEWCOMER_CUT_STALL_S)
                    tried = tried or not inherits
                if inherits and caller.read_early is not None:
                    # ... unless it can show its body first (a unary call: read while it waits, then "promoted" below):
                    # it cuts only once its body has arrived. Else a slow-loris's fresh connections, each cutting
                    # once on arrival, churn the places they hold, and a new client whose body has arrived finds every
                    # place's upload silent for less than NEWCOMER_CUT_STALL_S (measured at C=4 beside 20 such
                    # connections: 1-5 of 20 new clients refused after a 2 s wait). A stream likewise, once it
                    # arrived whole or its first 16 MiB did (Caller.proven)
                    tried = True
                retry = False
                if tried:
                    if caller is not None:
                        now = time.monotonic()
                        if wait_end is None:
                            wait_end, arrived = now + self._wait_budget(caller), now
                        # a prompt caller looks again for a stalled upload to cut every EVICT_RETRY_S: the places'
                        # holders may not have been stalled yet when it came (a slow-loris's fresh calls)
                        retry = make_room is not None and (cap == self.max_concurrent_requests or caller.proven()) \
                            and wait_end - now > EVICT_RETRY_S
                        outcome = self._wait_for_place(caller, now + EVICT_RETRY_S if retry else wait_end, arrived)
                        if outcome == "granted":
                            break  # handed over by a leaving call: already counted in _limited
                        if outcome == "promoted":  # its body arrived while it waited: a prompt caller now
                            retry = make_room is not None and not self._draining
                            held = self._cap(caller) < self.max_concurrent_requests and not self._is_full()
                        else:
                            retry = retry and outcome == "timeout" and not self._draining
                    if not retry:  # (else: out of the lock, make_room again, then look again)
                        if self._draining:
                            self._quiet_since = time.monotonic()
                            raise Draining("the server is shutting down and takes no new calls; retry on another "
                                           "replica")
                        self.refusals += 1
                        if held:
                            raise Overloaded(
                                f"this connection holds calls that stopped sending their request bodies (or, before "
                                f"its first result, its host does), and such calls may fill only "
                                f"{self.stalled_cap} of the --max-concurrent-requests={self.max_concurrent_requests} "
                                "places; none freed while this call waited. Send each request in full as soon as "
                                "its call starts; retry after the server's pushback")
                        raise Overloaded(
                            f"the server is at its concurrency limit: --max-concurrent-requests="
                            f"{self.max_concurrent_requests} requests are already in progress and no place freed "
                            "while this call waited; retry after the server's pushback (grpc-retry-pushback-ms: "
                            "AdvantageClient does), or add replicas")
            tried = True
            make_room(held)  # outside the lock: it cuts another client's stalled upload and reserves its place
        with self._cond:
            self._in_flight += 1

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
                    self._hand_off(caller)
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
            self._expire_parks(time.monotonic())  # kept places are given up (draining: all of them)
            for w in self._waiters:
                w.wake.notify()  # waiting calls are refused with Draining
            self._cond.notify_all()

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
