"""Watching uploads: admitted calls whose request bytes stall, crawl, or never come.

An admitted call holds a ``--max-concurrent-requests`` place, a thread and what it has received of its request
until its body has arrived. :class:`UploadWatch` bounds that: it cuts an upload idle for ``--stream-idle-timeout``
or slower than ``--min-upload-rate-kib``, takes places back for newcomers by the fair shares of
:mod:`advantage_server.shares` when the server is full, and at the drain cuts uploads that never began.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
from typing import Any, Callable, Iterator

from advantage_client import codec
from advantage_server.defaults import DEFAULT_UPLOAD_RATE_WINDOW
from advantage_server.admission import Draining
from advantage_server.errors import ResourceLimit
from advantage_server.identity import call_peer, peer_host
from advantage_server.shares import CUT_MEMORY_S, HOST_STALL_MEMORY_S, STALL_S, PendingShares, stall_after

log = logging.getLogger("advantage_server")
#: seconds :meth:`UploadWatch.stalled` answers from its last count (it is asked several times per call; a count a
#: few milliseconds old is exact enough against ``STALL_S``, and a cut renews it at once)
STALLED_CACHE_S = 0.005
#: seconds between two WARNING lines about calls cut for another client (the count in between is in the line)
CUT_WARN_INTERVAL = 10.0


class UploadCut(ResourceLimit):
    """The call's upload stalled (``--stream-idle-timeout``) or crawled (``--min-upload-rate-kib``) and was cut."""


class SilentAtDrain(Draining):
    """The drain ended a call whose request had not begun to arrive (UNAVAILABLE: retry on another replica)."""


class _Upload:
    """One watched upload: its idle deadline, bytes received, rate samples, and whether (why) it was cut."""

    __slots__ = ("context", "idle_deadline", "cut", "min_rate", "window", "started", "received", "samples",
                 "largest", "keys", "lent", "touched", "stall_after")

    def __init__(self, context: Any, idle_deadline: float, min_rate: int, window: float, now: float):
        self.context, self.idle_deadline = context, idle_deadline
        self.cut: UploadCut | SilentAtDrain | None = None
        self.keys: tuple[str, ...] = ()  # (connection, host) while it is pending (a counted upload)
        self.lent = False  # cut by evict_for: its place went to a newcomer at once (RequestGate.lend)
        self.min_rate, self.window, self.started, self.received = min_rate, window, now, 0
        self.samples: collections.deque[tuple[float, int]] = collections.deque([(now, 0)])
        self.largest = 0  # the largest chunk received: bytes count only once a whole chunk has arrived
        #: when its last chunk arrived (admission before the first), and the seconds after which it counts as
        #: stalled without the next (:func:`advantage_server.shares.stall_after`)
        self.touched, self.stall_after = now, STALL_S

    def stalled(self, now: float) -> bool:
        """No chunk for ``stall_after`` seconds (its body is not arriving), and not cut already."""
        return self.cut is None and now - self.touched >= self.stall_after

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


class EarlyBody:
    """The request message of a unary call that waits for a place, read in a thread of its own while it waits
    (issue #35 item 2: a slow-loris that opens a fresh connection for every call it stalls).

    A connection that has not yet had a result answers for its host's stalled uploads
    (:class:`advantage_server.shares.InheritedStalls`): beside such a slow-loris a new trainer on the same host
    looked like one of its fresh connections, and measured, a new client process's first call was refused six
    times in a row (12 s). What tells them apart is the body: a client's unary request arrives with its call, a
    stalled one never does. So such a call reads its body while it waits (:meth:`start`, called by the waiting room),
    and when the message has arrived whole ``on_arrival()`` runs (the servicer remembers the connection:
    :meth:`UploadWatch.sent_early`), after which the connection is judged by its own record: a prompt caller.

    Iterating gives the message once (the call's own ``next(requests)`` after admission reads it from here), or raises
    what the read raised (``StopIteration``: no message; ``grpc.RpcError``: the call ended). Not started, it
    reads from ``requests`` as usual. The thread ends with the call at the latest. Memory: a waiting call's body,
    at most ``--max-message-mb`` for each place of the waiting room (RELIABILITY.md, the memory bound)."""

    __slots__ = ("_requests", "_on_arrival", "_done", "_value", "_error", "_thread", "_started", "_dropped")

    def __init__(self, requests: Any, on_arrival: Callable[[], None]):
        self._requests, self._on_arrival = requests, on_arrival
        self._done: threading.Event | None = None  # made by start(): most calls never read early
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._dropped = False

    def start(self) -> None:
        """Start reading the message (once; later calls do nothing)."""
        if self._thread is None and not self._dropped:
            self._started = time.monotonic()
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._read, name="advantage-early-body", daemon=True)
            self._thread.start()

    def _read(self) -> None:
        try:
            self._value = next(self._requests)
        except BaseException as err:  # noqa: BLE001 - StopIteration, or grpc.RpcError: re-raised by __next__
            err.__traceback__ = None  # its frames would hold the call's state (see AdvantageServicer._receive)
            self._error = err
        finally:
            self._done.set()
        if self._error is None and not self._dropped:  # a body that came after its call was refused proves nothing
            self._on_arrival()

    def reading_for(self) -> float | None:
        """Seconds since :meth:`start` while the read has not ended; None when it was never started, or has ended."""
        if self._done is None or self._done.is_set():
            return None
        return time.monotonic() - self._started

    def __iter__(self) -> "EarlyBody":
        return self

    def __next__(self) -> Any:
        if self._done is None:
            return next(self._requests)
        self._done.wait()
        if self._error is not None:
            raise self._error
        value, self._value = self._value, None
        if value is None:
            raise StopIteration
        return value

    def drop(self) -> None:
        """Let go of a message read but not taken (the call was refused)."""
        self._dropped = True
        self._value = None


#: bytes of a waiting stream that show it is being sent, if it has not ended by then (:class:`EarlyStream`): the
#: client's own threshold for streaming a request (smaller ones go unary), so a legitimate stream's first 16 MiB take
#: milliseconds; 16 MiB buy a staller about 16 s of a place before ``--min-upload-rate-kib`` (1 MiB/s) cuts it
EARLY_STREAM_BYTES = 16 << 20
#: bytes per second a waiting stream's early read is measured against (:meth:`EarlyStream.reading_for`): the
#: server's default ``--min-upload-rate-kib`` (1 MiB/s), the pace it asks of every upload
EARLY_STREAM_RATE = 1 << 20


def early_stream_cap(max_message_bytes: int) -> int:
    """The bytes of a waiting stream :class:`EarlyStream` reads, and that prove it: ``EARLY_STREAM_BYTES``, at most
    ``--max-message-mb`` (the transport's cap, and its term in :func:`advantage_server.server.memory_bound`)."""
    return min(EARLY_STREAM_BYTES, max_message_bytes)


def _held_size(raw: Any) -> int:
    """What a chunk message read early counts for against :class:`EarlyStream`'s limits: its bytes, and at least
    64 (a stream of empty messages would otherwise fill the queue without limit)."""
    return max(64, len(raw))


class EarlyStream:
    """The request chunks of a ``ComputeAdvantageStream`` call that waits for a place, read in a thread of its own
    while it waits: :class:`EarlyBody` for the streaming transport (issue #35 item 2, a slow-loris of streams that
    trickle, each on a fresh connection).

    The proof (:attr:`proven`, then ``on_proof()`` once) is the *whole* stream (:attr:`whole`): the client half-closed
    it after chunks whose data add up to the ``total_size`` (more than 0) its first chunk declared, a complete request.
    A stream too large to wait whole is proven by its first ``cap`` bytes (``EARLY_STREAM_BYTES``, at most
    ``--max-message-mb``), for its rank only: it still fills no more than its stalling host may (a fresh-eyes review:
    16 MiB and then silence let a slow-loris's calls hold 3-4 of 4 places, and another host's client fell to a tenth of
    its calls). A chunk that does not fit the declared size (or does not parse) stops the read: it proves nothing,
    and that waiter is the first the full room drops. The proof is the call's alone
    (:attr:`advantage_server.admission.Caller.proven`, ``Caller.whole``), never a record for its connection: a first chunk proves nothing about the rest of a stream, and an attacker that
    sent one cheaply and trickled after it was let in for good (tried and reverted in the tenth session:
    RELIABILITY.md). A stream that stops, or only trickles, is never proven, and the full waiting room drops the
    waiter whose read is furthest behind for a newcomer (:meth:`reading_for`).

    Memory: while the call waits, the thread stops reading once ``cap`` bytes of chunk messages are held, so a waiter
    holds less than ``cap`` plus the one message gRPC is receiving for it (at most ``--max-message-mb``): the memory
    bound's waiting-room term. Once the handler takes its first chunk (after admission) the thread reads at most
    one chunk ahead of it.

    Iterating gives the chunk messages in order, then ends as the stream ended (``StopIteration``) or raises what
    the read raised (``grpc.RpcError``: the call ended). Not started, it reads from ``requests`` as usual; started,
    its thread is the only reader of ``requests``. The thread ends with the stream, or with the call at the
    latest."""

    __slots__ = ("_requests", "_on_proof", "_cap", "_rate", "_bytes", "_queue_seen", "_cond", "_queue", "_queued",
                 "_limit", "_waiting", "_done", "_error", "_thread", "_started", "_dropped", "_last", "_bad", "proven",
                 "whole")

    def __init__(self, requests: Any, on_proof: Callable[[], None], cap: int = EARLY_STREAM_BYTES,
                 rate: int = EARLY_STREAM_RATE):
        self._requests, self._on_proof, self._cap = requests, on_proof, max(1, int(cap))
        self._rate = max(1, int(rate))  # bytes/s: the pace :meth:`reading_for` measures the read against
        self._bytes = 0  # chunk bytes read while the call waited, after its first chunk
        self._queue_seen = False  # the first chunk has been read
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[Any] = collections.deque()
        self._queued = 0  # bytes in _queue
        self._limit = self._cap  # bytes the thread may hold unread: cap while the call waits, then one chunk
        self._waiting = True  # the call waits for a place (until the handler takes its first chunk: __next__)
        self._done = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._dropped = False
        self._last = 0.0  # when the read last got a chunk (its start before the first)
        self._bad = False  # a chunk did not fit the declared total (or did not parse): the read stops there
        #: the stream showed itself while the call waited: whole, or its first ``cap`` bytes (see the class docstring)
        self.proven = False
        #: ... whole: only then may the call fill the places its host's stalls hold it below (``_cap``)
        self.whole = False

    def start(self) -> None:
        """Start reading the stream (once; later calls do nothing)."""
        with self._cond:
            if self._thread is not None or self._dropped:
                return
            self._started = self._last = time.monotonic()
            self._thread = threading.Thread(target=self._read, name="advantage-early-stream", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        declared, received, first, consistent = 0, 0, True, True
        try:
            for raw in self._requests:
                if consistent:  # the chunk's declared total and data length (the proof), not its content
                    try:
                        total, data = codec.decode_chunk(raw)
                    except Exception:  # noqa: BLE001 - a malformed chunk is the handler's INVALID_ARGUMENT later
                        consistent = False
                    else:
                        declared, first = (total if first else declared), False
                        received += data.nbytes
                        consistent = received <= declared
                        del data  # a view of the chunk: not kept while the next one is awaited
                with self._cond:
                    if self._dropped:
                        return
                    self._queue.append(raw)
                    self._queued += _held_size(raw)
                    if self._waiting:
                        if self._queue_seen:
                            self._bytes += len(raw)  # a first chunk is not credited: it is what a slow-loris sends
                        self._last = time.monotonic()
                        self._bad = not consistent  # read no further while it waits: it proves nothing
                    self._queue_seen = True
                    del raw  # the queue holds it; drop() lets it go while this thread waits for the next
                    self._cond.notify_all()
                    # too large to wait for whole: its first cap bytes came while it waited
                    report = (not self.proven and consistent and self._waiting
                              and self._queued >= self._cap)
                    if report:
                        self.proven = True
                if report:
                    self._on_proof()
                with self._cond:
                    while (self._queued >= self._limit or (self._bad and self._waiting)) and not self._dropped:
                        self._cond.wait()
                    if self._dropped:
                        return
        except BaseException as err:  # noqa: BLE001 - grpc.RpcError (the call ended): re-raised by __next__
            err.__traceback__ = None  # its frames would hold the call's state (see AdvantageServicer._receive)
            with self._cond:
                self._error = err
        finally:
            with self._cond:
                self._done = True
                whole = (self._error is None and not first and consistent and 0 < received == declared
                         and not self._dropped and self._waiting and not self.proven)
                if whole:
                    self.proven = self.whole = True
                self._cond.notify_all()
        if whole:
            self._on_proof()

    def reading_for(self) -> float | None:
        """Seconds the read is behind: how far it is behind ``rate`` (since :meth:`start`, less the time its bytes
        after the first chunk take at ``rate``; never less than 0) plus the seconds since its last chunk; infinite
        for a stream whose chunks do not fit its declared size; None when it was never started, has ended, or is
        proven. The full waiting room drops the waiter furthest behind for a newcomer: a stream arriving at full speed
        is not that one, a trickle soon is. By time since start alone, a slow-loris arriving every few milliseconds
        kept every waiter's read under 20 ms old, and a newcomer's 512 KiB stream was dropped before it had arrived
        (10 of 10). Its first chunk earns nothing: a slow-loris sending 64 KiB first chunks was ahead of a newcomer
        whose read had just begun (8 of 10 refused). And credit does not last through silence: one 1 MiB burst then
        nothing kept a waiter ahead for a second, and new 16 MiB streams were dropped (1 of 10 served; a fresh-eyes
        review)."""
        if self._thread is None or self._done or self.proven:
            return None
        if self._bad:
            return math.inf  # a stream that does not fit its own declared size: dropped first
        now = time.monotonic()
        return max(0.0, now - self._started - self._bytes / self._rate) + (now - self._last)

    def __iter__(self) -> "EarlyStream":
        return self

    def __next__(self) -> Any:
        if self._thread is None:
            with self._cond:
                started = self._thread is not None
                if not started:
                    self._dropped = True  # read by the handler itself: no early read starts now
            if not started:
                return next(self._requests)
        with self._cond:
            self._limit, self._waiting = 1, False  # the handler reads now: the thread holds one chunk ahead of it
            while not self._queue and not self._done:
                self._cond.wait()
            if self._queue:
                raw = self._queue.popleft()
                self._queued -= _held_size(raw)
                self._cond.notify_all()
                return raw
            if self._error is not None:
                raise self._error
            raise StopIteration

    def drop(self) -> None:
        """Let go of the chunks read but not taken (the call was refused or ended); the thread stops reading."""
        with self._cond:
            self._dropped = True
            self._queue.clear()
            self._queued = 0
            self._cond.notify_all()


#: connections remembered by :meth:`UploadWatch.sent_early` (the least recently seen are forgotten first)
EARLY_SENDERS = 16384


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

    Fair shares (:class:`~advantage_server.shares.PendingShares`: ``per_peer`` is the host share,
    ``per_connection`` the connection share; 0: no bound): a watched upload (``counted``, the default) is
    *pending* for its connection and its host (:mod:`advantage_server.identity`) until its block ends, i.e. until
    its body has arrived (or the call ended). While the server has room, a client may have any number of calls
    pending (a trainer's burst of uploads); once every place is taken, a newcomer takes a place back
    (:meth:`evict_for`) from the most over-served group, max-min fair between hosts and then between the
    connections of one host: the most stalled upload of that group is cut with RESOURCE_EXHAUSTED saying why, and
    its place goes to the newcomer at once (:meth:`advantage_server.admission.RequestGate.lend`). So a client
    that opens calls and sends nothing keeps at most an equal share of the places whenever somebody else needs
    one, however fast it reopens them and however many connections it opens. Calls that have their body
    (computing, waiting for a compute slot) are never cut for a newcomer.

    Drain: :meth:`cut_silent` ends every upload that has received no request bytes with UNAVAILABLE (its call
    has not started; the client sends it to another replica), so a silent upload does not hold the drain for
    ``--grace``.

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
        self.shares = PendingShares(per_host=per_peer, per_connection=per_connection)  # under _lock
        self.evictions = 0  # calls cut by evict_for
        #: (connection, host) -> when an upload of it was last cut for stalling, crawling or another client (under
        #: _lock): counted as stalled for CUT_MEMORY_S (:meth:`stalled`)
        self._cut_at: dict[tuple[str, ...], float] = {}
        self._stalled_cache: tuple[float, tuple[collections.Counter[str], collections.Counter[str]]] = (
            -math.inf, (collections.Counter(), collections.Counter()))
        self._host_stalled: dict[str, float] = {}  # host -> when stalled() last counted a stalled upload of it
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.cuts = 0       # calls cut, for either reason
        self.slow_cuts = 0  # of which for their rate
        self.silent_cuts = 0  # calls cut by cut_silent (drain)
        self._cuts_unlogged, self._next_cut_warning = 0, 0.0  # _warn_cut's rate limit
        #: connections whose request body arrived whole while their call waited for a place (:class:`EarlyBody`)
        self._early: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: called in a call's thread when an upload cut by :meth:`evict_for` leaves its block (the servicer wires
        #: :meth:`advantage_server.admission.RequestGate.repay`: the place it lent to the newcomer is accounted)
        self.on_lent_exit: Callable[[], None] | None = None

    def evict_for(self, context: Any, min_stall: float = 0.0, held: bool = False) -> bool:
        """The server is full and ``context``'s call is waiting for a place: cut the pending upload the fair
        shares pick (:meth:`PendingShares.rank`: a group holding more pending calls than the caller's, between
        hosts first, then between the connections of the caller's host; the most stalled of its uploads), with
        RESOURCE_EXHAUSTED saying why. ``min_stall``: an upload of the caller's own host is cut only when it has had
        no bytes for at least this many seconds (besides being stalled); one of another host only needs to be
        stalled, since the shares between hosts already pick a host holding two more pending calls than the
        caller's (a fresh trainer on another host, held to ``min_stall``, waited up to that long for its first
        call beside a slow-loris whose calls had all come at once). ``held``: the server has free places and the caller is held below
        ``stalled_cap`` (its host holds stalled uploads): the cut's message says so. True when one was cut (its place
        frees within moments)."""
        peer = call_peer(context)
        newcomer = (peer, peer_host(peer))
        now = time.monotonic()
        # a newcomer whose connection holds nothing may cut a stalled upload of another connection of its own host
        # that holds just one pending call (issue #35 item 2: a slow-loris opening a fresh connection per call holds
        # one pending call on each, so a same-host neighbour, holding none, could never cut one); between hosts,
        # and inside one for a newcomer that holds pending calls, two more than the newcomer's
        with self._lock:
            holds_nothing = self.shares.pending(*newcomer)[0] == 0
            best: tuple[Any, ...] | None = None
            for e in self._watched.values():
                if not e.keys or not e.stalled(now) or (e.keys[1] == newcomer[1] and now - e.touched < min_stall):
                    continue  # only a stalled upload is cut: a body that is arriving promptly never is
                rank = self.shares.rank(e.keys, newcomer)
                if rank is None or rank[1] < (1 if holds_nothing and rank[0] == 0 else 2):
                    continue  # one apart, a swap would only trade places between equals
                if best is None or (rank, -e.idle_deadline) > best[:2]:
                    best = (rank, -e.idle_deadline, e)
            if best is None:
                return False
            rank, _, victim = best
            conn_n, host_n = self.shares.pending(*newcomer)
            conn_v, host_v = self.shares.pending(*victim.keys)
            if held:
                why = (f"this call had sent no request bytes for {now - victim.touched:.1f} s while a call of another "
                       "connection of its host waited (the calls of a host holding stalled uploads may fill only half "
                       "the places)")
            elif rank[0]:
                why = (f"this client's host had {host_v} calls waiting for their request body and the caller's host "
                       f"{host_n} (places are shared fairly between hosts; --max-pending-per-peer={self.per_peer})")
            else:
                why = (f"this connection had {conn_v} calls waiting for their request body and the caller's "
                       f"connection on the same host {conn_n} (places are shared fairly between the connections of "
                       f"a host; --max-pending-per-connection={self.per_connection})")
            victim.lent = True
            self._cut_at[victim.keys] = time.monotonic()
            self._stalled_cache = (-math.inf, self._stalled_cache[1])
            victim.cut = UploadCut(
                f"cut to give its place to another client: {'' if held else 'the server was full and '}{why}; "
                "send each request in full as soon as its call starts (a call whose body has arrived is never cut for "
                "another)")
            self._unpend(victim)
            self.evictions += 1
        self._warn_cut("between hosts" if rank[0] else "inside a host")
        _cancel_with_status(victim.context, victim.cut)
        return True

    def _warn_cut(self, where: str) -> None:
        """One WARNING per ``CUT_WARN_INTERVAL`` seconds for the cuts of :meth:`evict_for`, saying how many there
        were since the last one: under a slow-loris every legitimate call cuts one, and a line per cut (hundreds a
        second) would cost the server the CPU the attack is after."""
        now = time.monotonic()
        with self._lock:
            self._cuts_unlogged += 1
            if now < self._next_cut_warning:
                return
            count, self._cuts_unlogged, self._next_cut_warning = self._cuts_unlogged, 0, now + CUT_WARN_INTERVAL
        log.warning("server full: cut %d stalled call(s) waiting for their body to give their places to other clients "
                    "(fair shares, the last one %s) since the last such warning", count, where)

    def cut_silent(self, min_age: float = 0.0) -> int:
        """The drain: end every watched upload that has received no request bytes and began at least ``min_age``
        seconds ago with UNAVAILABLE (its call has not started: the client sends it to another replica). A stream
        counts its chunks; a unary request arrives as one message, so one still arriving counts as silent. Returns
        how many were cut."""
        now = time.monotonic()
        cut: list[_Upload] = []
        with self._lock:
            for e in self._watched.values():
                if e.cut is None and e.received == 0 and now - e.started >= min_age:
                    e.cut = SilentAtDrain("the server is shutting down and this call's request had not begun to "
                                          "arrive; retry on another replica")
                    self._unpend(e)
                    cut.append(e)
            self.silent_cuts += len(cut)
        for e in cut:
            _cancel_with_status(e.context, e.cut, "unavailable")
        if cut:
            log.info("draining: cut %d call(s) whose request had not begun to arrive", len(cut))
        return len(cut)

    def _unpend(self, entry: _Upload) -> None:
        """Stop counting ``entry`` as pending (once); under ``_lock``."""
        if entry.keys:
            self.shares.remove(*entry.keys)
        entry.keys = ()

    def stalled(self) -> tuple[collections.Counter[str], collections.Counter[str]]:
        """(per host, per connection) the pending uploads that have received no bytes for ``STALL_S`` seconds
        (since admission or their last chunk; longer after a chunk that arrived fast: ``shares.stall_after``), plus one for each connection an upload of which was cut (stalled,
        too slow, or cut for another client) in the last ``CUT_MEMORY_S`` seconds: the waiting room's order
        (:func:`advantage_server.shares.wait_rank`) and who may fill the server only to
        :attr:`advantage_server.admission.RequestGate.stalled_cap`. The memory matters: a slow-loris whose calls
        are cut as fast as they come never holds one for ``STALL_S``."""
        now = time.monotonic()
        if now - self._stalled_cache[0] < STALLED_CACHE_S:
            hosts, conns = self._stalled_cache[1]  # asked several times per call: a count 5 ms old is exact enough
            return collections.Counter(hosts), collections.Counter(conns)  # copies: the cache stays as counted
        hosts: collections.Counter[str] = collections.Counter()
        conns: collections.Counter[str] = collections.Counter()
        with self._lock:
            if self._cut_at:
                for keys, at in list(self._cut_at.items()):
                    if now - at > CUT_MEMORY_S:
                        del self._cut_at[keys]
                    else:
                        conns[keys[0]] += 1
                        hosts[keys[1]] += 1
            for e in self._watched.values():
                if e.keys and e.stalled(now):
                    conns[e.keys[0]] += 1
                    hosts[e.keys[1]] += 1
            self._stalled_cache = (now, (hosts, conns))
            for host in hosts:
                self._host_stalled[host] = now
            if self._host_stalled and now - min(self._host_stalled.values()) > HOST_STALL_MEMORY_S:
                self._host_stalled = {h: t for h, t in self._host_stalled.items() if now - t <= HOST_STALL_MEMORY_S}
        return hosts, conns

    def recently_stalled(self) -> frozenset[str]:
        """The hosts that held a stalled upload (or had one cut) in the last ``HOST_STALL_MEMORY_S`` seconds, as the
        last :meth:`stalled` counted (:class:`advantage_server.shares.InheritedStalls`)."""
        now = time.monotonic()
        with self._lock:
            return frozenset(h for h, t in self._host_stalled.items() if now - t <= HOST_STALL_MEMORY_S)

    def pending(self, peer: str) -> tuple[int, int]:
        """(calls of connection ``peer``, calls of its host) waiting for their body now; ``peer`` is a peer
        string (``ipv4:1.2.3.4:5678``)."""
        with self._lock:
            return self.shares.pending(peer, peer_host(peer))

    def mark_sent_early(self, connection: str) -> None:
        """Remember that a call of ``connection`` had its whole request body arrive while it waited for a place
        (:class:`EarlyBody`): the connection sends what it asks with, whatever its host's other connections do."""
        with self._lock:
            self._early[connection] = None
            self._early.move_to_end(connection)
            while len(self._early) > EARLY_SENDERS:
                self._early.popitem(last=False)

    def sent_early(self, connection: str) -> bool:
        """Whether :meth:`mark_sent_early` remembers ``connection`` (lock-free: the waiting room asks it per call)."""
        return connection in self._early

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
                entry.keys = (peer, peer_host(peer))
                self.shares.add(*entry.keys)
            self._watched[key] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="advantage-upload-watch", daemon=True)
                self._thread.start()

        def touch(nbytes: int = 0) -> None:
            t = time.monotonic()
            # touched first: a reader in between sees the new chunk with the old (longer or equal) grace, never
            # the old time with a new short grace
            entry.touched, entry.stall_after = t, stall_after(nbytes, t - entry.touched)
            entry.idle_deadline = t + self.timeout
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
            if entry.lent and self.on_lent_exit is not None:
                self.on_lent_exit()  # the place this cut call lent to a newcomer is no longer also held here
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
                    if e.keys:
                        self._cut_at[e.keys] = now
                        self._stalled_cache = (-math.inf, self._stalled_cache[1])
                    cut.append(e)
            for e in cut:
                self.cuts += 1
                why = (f"stalled for {self.timeout:g} s (--stream-idle-timeout)" if e.idle_deadline <= now else
                       f"arrived slower than --min-upload-rate-kib={e.min_rate // 1024}")
                log.warning("cut a call whose upload %s", why)
                _cancel_with_status(e.context, e.cut)


def _cancel_with_status(context: Any, exc: Exception, code: str = "resource_exhausted") -> None:
    """End a call from another thread with ``code`` (a ``cygrpc.StatusCode`` attribute name: RESOURCE_EXHAUSTED
    by default) and ``exc``'s message. gRPC's public
    ``ServicerContext.cancel()`` cannot carry a status (the client would see a bare CANCELLED); the core
    call underneath can, so use it when it is there."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            from grpc._cython import cygrpc
            call.cancel(getattr(cygrpc.StatusCode, code), str(exc))
            return
        except Exception:  # noqa: BLE001 - an internal API that moved: fall back to the public one
            pass
    try:  # a bare CANCELLED, which the client's retry policy sends again (the status above is not retried)
        context.cancel()
    except Exception:  # noqa: BLE001 - already over
        pass


