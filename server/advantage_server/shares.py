"""What callers are owed: fair shares of the places, and the bounds on what anonymous callers can hold.

**Places** (``--max-concurrent-requests``). A call holds a place from admission until its computation ends.
While its request body is still arriving it is *pending* (:class:`PendingShares` counts pending calls per host
and per connection, :mod:`advantage_server.identity`); once its body has arrived it is working, and nobody can
take its place. Pending places are shared **hierarchically, max-min fair**: first between hosts, then between
the connections of one host. When every place is taken, a newcomer (a call of connection ``c`` on host ``h``)
takes a place back from the pending calls of

1. another host holding at least two more pending calls than ``h`` holds now, when ``h`` holds fewer than
   ``--max-pending-per-peer`` (the host share), else
2. another connection of ``h`` holding at least two more pending calls than ``c`` holds now, when ``c`` holds
   fewer than ``--max-pending-per-connection`` (the connection share);

the victim is the most stalled upload (longest without bytes) of the most over-served group
(:meth:`PendingShares.rank`). After the swap the victim's group still holds at least as many as the newcomer's:
the shares converge to equal, never oscillate past it. Where the two differ by just one, nothing is cut (the swap
would only trade places between equals, and cut an upload that may be in progress; measured: allowing it let a
slow-loris's own connections cut each other's calls and raced the legitimate newcomer for the freed places). So a stalled connection uses up
only its own share, a neighbour connection on the same host keeps its own, and another host keeps its own
however many connections or addresses the staller opens (all of 127/8 is one host, an IPv6 /64 is one host).
A newcomer that can take no place waits for one, at most ``ADMISSION_WAIT_S``
(:class:`advantage_server.admission.RequestGate`); each place that frees goes to the waiting call ranked first
by :func:`wait_rank`: a connection holding no *stalled* upload (no bytes for ``STALL_S``) first, longest waiting
first; then the fewest stalled uploads on its host, then on its connection, then the longest waiting. Stalled, not pending: a connection whose calls send their bodies promptly is not
charged for the calls it has in progress, while one that holds places without sending waits behind everybody
else. A call still without a place when its wait ends is refused with RESOURCE_EXHAUSTED and a retry pushback
(:class:`advantage_server.admission.Overloaded`).

**Anonymous callers.** With ``--auth-token-file`` (or mutual TLS) the only thing a caller without credentials
reaches is the health service (:mod:`advantage_server.identity`). Its ``Check`` holds nothing once answered;
its ``Watch`` streams are bounded: at most ``MAX_WATCHES_PER_HOST`` per host and ``MAX_WATCHES`` in all. A
``Watch`` beyond either bound is answered UNIMPLEMENTED (:mod:`advantage_server.health_service`), which every
gRPC client takes as "this server does not do health checking: treat it as healthy", so a flood of ``Watch``
streams bounds memory without making any token holder's channel unhealthy.
"""
from __future__ import annotations

import collections
import contextlib
import heapq
import math
import threading
import time
from typing import Callable, Container, Iterator, Mapping

#: seconds without request bytes after which a pending upload counts as *stalled* for the waiting room's order
#: (:func:`wait_rank`): long against the time a prompt client's body takes to arrive on a busy server (a few
#: milliseconds), short against what a call that holds a place without sending holds it for
STALL_S = 0.1
#: a stream upload whose last chunk arrived at ``STALL_FAST_RATE`` bytes per second or faster counts as stalled only
#: after ``STALL_PACE`` times that chunk's time without the next (at most ``STALL_MAX_S``), not after ``STALL_S``:
#: gRPC hands a chunk over only once all of it has arrived, so a 4 MiB chunk on a link slower than 40 MiB/s reads
#: as no bytes for longer than ``STALL_S`` while it is on its way (a trickle of small chunks gets no such grace)
STALL_FAST_RATE = 4 << 20
STALL_PACE = 2.0
STALL_MAX_S = 1.0


def stall_after(nbytes: int, gap: float) -> float:
    """Seconds without a chunk after which a stream upload counts as *stalled*, given its last chunk: ``nbytes``
    bytes that took ``gap`` seconds since the chunk before (or since admission). ``STALL_S``, or for a chunk that
    arrived at ``STALL_FAST_RATE`` or faster ``STALL_PACE * gap`` (between ``STALL_S`` and ``STALL_MAX_S``)."""
    if nbytes <= 0 or gap <= 0 or nbytes / gap < STALL_FAST_RATE:
        return STALL_S
    return min(STALL_MAX_S, max(STALL_S, STALL_PACE * gap))
#: seconds a connection counts as holding a stalled upload after one of its uploads was cut (stalled past
#: ``--stream-idle-timeout``, slower than ``--min-upload-rate-kib``, or cut to give its place to another client):
#: long against a slow-loris's reopen loop, short against a trainer's occasional pause
CUT_MEMORY_S = 10.0
#: health ``Watch`` streams open at once, in all (about 17 KiB each, measured: ~17 MiB at most)
MAX_WATCHES = 1024
#: health ``Watch`` streams open at once from one client host; beyond it a ``Watch`` is answered UNIMPLEMENTED
#: (the client treats the server as healthy), so the number of client processes per host is not bounded by it
MAX_WATCHES_PER_HOST = 128


class PendingShares:
    """Calls waiting for their request body, counted per connection and per host, and whom a newcomer may take a
    place back from (see the module docstring). Not thread-safe: its owner
    (:class:`advantage_server.uploads.UploadWatch`) holds its lock around every use.

    ``per_host``, ``per_connection``: the shares (``--max-pending-per-peer``, ``--max-pending-per-connection``);
    a newcomer whose host (connection) already holds that many pending calls takes no place from another host
    (connection). 0: no bound."""

    def __init__(self, per_host: int = 0, per_connection: int = 0):
        self.per_host, self.per_connection = per_host, per_connection
        self._hosts: collections.Counter[str] = collections.Counter()
        self._connections: collections.Counter[str] = collections.Counter()

    def add(self, connection: str, host: str) -> None:
        self._connections[connection] += 1
        self._hosts[host] += 1

    def remove(self, connection: str, host: str) -> None:
        for counter, key in ((self._connections, connection), (self._hosts, host)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]

    def pending(self, connection: str, host: str) -> tuple[int, int]:
        """(pending calls of ``connection``, of ``host``)."""
        return self._connections[connection], self._hosts[host]

    def rank(self, victim: tuple[str, str], newcomer: tuple[str, str]) -> tuple[int, int, int, int] | None:
        """How strongly a pending call of ``victim`` = (connection, host) should give its place to a newcomer of
        ``newcomer`` = (connection, host): None when it must not (its group holds no more than the newcomer's, or
        the newcomer already holds its share at that level); else ``(level, gain, victim host's pending, victim
        connection's pending)``, larger first: ``level`` 1 between hosts, 0 inside a host; ``gain`` how many more
        pending calls the victim's group holds than the newcomer's (:class:`~advantage_server.uploads.UploadWatch`
        cuts only for a gain of 2 or more: at 1 the swap would only trade places between equals)."""
        vc, vh = victim
        nc, nh = newcomer
        host_v, host_n = self._hosts[vh], self._hosts[nh]
        conn_v, conn_n = self._connections[vc], self._connections[nc]
        if vh != nh:
            if (not self.per_host or host_n < self.per_host) and host_v > host_n:
                return (1, host_v - host_n, host_v, conn_v)
            return None
        if vc != nc and (not self.per_connection or conn_n < self.per_connection) and conn_v > conn_n:
            return (0, conn_v - conn_n, host_v, conn_v)
        return None


def wait_rank(stalled_hosts: Mapping[str, int], stalled_connections: Mapping[str, int], connection: str, host: str,
              arrived: float) -> tuple[int, int, int, float]:
    """The order of the waiting room (smaller first), from :meth:`advantage_server.uploads.UploadWatch.stalled`'s
    counts. A connection that sends its bodies promptly (it holds no stalled upload) comes before every connection
    that stalls, whatever its host, and among such connections first come, first served: ``(0, 0, 0, arrival)``.
    Its host's stalled uploads are another connection's doing, so a neighbour of a staller waits no longer than a
    caller from another host (it did: the same-host neighbour of a slow-loris kept 84% of its goodput where
    another host kept 92%). Connections that stall come after, the host with the fewest stalled uploads first,
    then the connection, then the longest waiting: ``(1, stalled uploads of its host, of its connection,
    arrival)``."""
    conn = stalled_connections.get(connection, 0)
    if not conn:
        return 0, 0, 0, arrived
    return 1, stalled_hosts.get(host, 0), conn, arrived


class InheritedStalls(dict):
    """Stalled uploads per connection (:meth:`advantage_server.uploads.UploadWatch.stalled`'s second count), in
    which a connection with no record of its own answers for its host. ``get(connection)`` is the connection's own
    count when it has one, or when ``proven(connection)`` (it has had a result delivered: :meth:`ResultLedger.proven`);
    else 1 while its host (``host_of(connection)``) holds a stalled upload, or is in ``recent`` (it held one in the
    last ``HOST_STALL_MEMORY_S``: :meth:`advantage_server.uploads.UploadWatch.recently_stalled`), the least a staller
    holds. ``own()`` is the connection's own count; iteration and ``values()`` are the own counts.

    Issue #35 item 2, stalling judged per host: a slow-loris that opens a fresh connection for every stalled call had
    each call judged by a clean record, and its calls filled every place (9% of unattacked goodput on the same host,
    10% on another). Its fresh connections now count as stalling, so together they fill at most ``STALLED_FILL`` of
    the places (:attr:`advantage_server.admission.RequestGate.stalled_cap`) and wait behind every prompt caller. A
    neighbour whose connection has had a result keeps its own record. A new neighbour ranks with the fresh
    connections, ahead of the host's connections holding more than one stalled upload, and, holding nothing, may cut
    one stalled upload of its host to get its first call in (:meth:`advantage_server.uploads.UploadWatch.evict_for`):
    a unary call only once its body has arrived while it waited (:class:`advantage_server.uploads.EarlyBody`), so
    that the fresh connections of a slow-loris, whose bodies never come, do not churn the places they hold."""

    def __init__(self, connections: Mapping[str, int], hosts: Mapping[str, int], proven: Callable[[str], bool],
                 host_of: Callable[[str], str], recent: Container[str] = ()):
        super().__init__(connections)
        self._hosts, self._proven, self._host_of, self._recent = hosts, proven, host_of, recent

    def own(self, connection: str) -> int:
        """The connection's own count (0 when it only answers for its host)."""
        return dict.get(self, connection, 0)

    def get(self, connection: str, default: int = 0) -> int:  # type: ignore[override]
        own = dict.get(self, connection, 0)
        if own or not (self._hosts or self._recent) or self._proven(connection):
            return own or default
        host = self._host_of(connection)
        return 1 if self._hosts.get(host) or host in self._recent else default


#: seconds a host counts as stalling for its connections without a record of their own (:class:`InheritedStalls`)
#: after it last held a stalled upload: a slow-loris whose calls trickle in step (one chunk a second each) holds no
#: upload silent for ``STALL_S`` just after each step, and without the memory its fresh connections then ranked as
#: prompt callers', and a new client of its host, arriving last among equals, was refused at once (10 of 10, in a
#: burst just after a step)
HOST_STALL_MEMORY_S = 1.0


# ---------------------------------------------------------------------------------------------------------------
# The ledger of what a caller holds beyond its places (issue #35): result bytes computed but not yet delivered.

#: result bytes computed but not yet delivered that one host may hold before its connections without standing (see
#: :class:`ResultLedger`) wait for a place to deliver into; also what one connection may hold before its own new
#: calls wait
UNREAD_HOST_BYTES = 256 << 20
#: result bytes not yet delivered that one host's connections *without standing* may hold before the host counts as
#: crowded for them: each such byte was computed for a caller that has never shown it reads (measured: a fresh
#: connection per call filling 256 MiB had the server computing 32 results of 8 MiB every window, a third of its
#: CPU); a reader's connection has standing after its first result and is not held to it
UNPROVEN_HOST_BYTES = 32 << 20
#: the same, summed over every host: past it, only connections with standing are admitted
UNREAD_TOTAL_BYTES = 1 << 30
#: a result leaves at this rate or faster (bytes/s) from a client that reads it (the same 1 MiB/s that
#: ``--min-upload-rate-kib`` asks of an upload, on the client's own receive path)
DELIVERY_RATE = 1 << 20
#: seconds a result may take beyond its bytes at ``DELIVERY_RATE`` before it counts as *overdue* (not being read)
DELIVERY_GRACE_S = 1.0
#: a result of a connection without standing may be cut to make room for another connection of its host once it
#: is older than ``ROOM_GRACE_S`` + its bytes at ``ROOM_RATE`` (a reader on the same host takes it far faster)
ROOM_RATE = 64 << 20
ROOM_GRACE_S = 0.25
#: connections whose last delivery the ledger remembers (the oldest forgotten first)
STANDING_MEMORY = 16384
#: calls per second of connections without standing that a crowded host may still have admitted (its *probes*):
#: enough for a new reader on that host to get its first result (and standing) within a second or so, too few for
#: a caller that opens a fresh connection per call to keep the server computing results nobody reads
PROBE_RATE = 4.0
#: seconds for which the largest *unread* result of a host's connections without standing (held past ``ROOM_GRACE_S``
#: + its bytes at ``ROOM_RATE``, which a reader would have taken by then) stands for the size of each such call of the
#: host being computed (:meth:`ResultLedger.running`). Not the last result's size: one small call on a fresh
#: connection reset that before a burst of large ones; and not delivered results': a new trainer's own burst of first
#: calls (48 connections, 8 MiB results) then crowded its host for itself, 27 of 48 served (a fresh-eyes review)
TYPICAL_S = 10.0


class _Unread:
    __slots__ = ("connection", "host", "nbytes", "since", "cancel", "cancelled")

    def __init__(self, connection: str, host: str, nbytes: int, since: float, cancel: Callable[[], object]):
        self.connection, self.host, self.nbytes, self.since = connection, host, nbytes, since
        self.cancel, self.cancelled = cancel, False


class ResultLedger:
    """Result bytes a caller holds: computed and handed to gRPC, not yet delivered (the call has not ended).

    gRPC sends a response only as fast as the client opens its HTTP/2 receive window, and keeps what it has not
    sent; a client that never opens it leaves each result in the server for good, after its place was given back.
    Each result is entered here from the handler's return (:meth:`hold`) to the call's end (:meth:`release`, gRPC's
    termination callback: the response and status have been written, or the call was cancelled), counted per
    connection, per host and in all. Three rules bound them:

    * **expiry**: a result not delivered within ``send_timeout + nbytes / DELIVERY_RATE`` seconds (the server's
      ``--stream-idle-timeout``, as for an upload that stops) is cancelled (the client sees CANCELLED);
    * **overdue**: one not delivered within ``DELIVERY_GRACE_S + nbytes / DELIVERY_RATE`` is not being read; while
      its host holds ``per_host`` bytes or more, or the server ``total`` or more, overdue results are cancelled,
      oldest first, to make room;
    * **admission** (:meth:`refusal`, before a call takes a place): a connection holding ``per_host`` bytes or more
      (or any while the server holds ``total``) waits for its own results to leave. While its host is *crowded*
      (leaving out its one connection holding the most, it holds ``per_host`` or more, or its connections without
      standing hold ``UNPROVEN_HOST_BYTES``; or it holds any while the server holds ``total``), a connection
      *without standing*
      waits for the host's *probe*: ``PROBE_RATE`` calls a second, never to a connection's first call, each going
      to the waiting connection of that host that has asked most often, and each cutting the host's oldest result of a connection without standing
      that a reader would have taken by now (older than ``ROOM_GRACE_S`` + its bytes at ``ROOM_RATE``). Standing:
      the connection has had a result delivered in full, and holds no overdue one. So a reader's connection (every
      client channel that reads its results) is admitted whatever its neighbours leave unread; a new reader on
      the same host, which retries on its connection, gets its first call in through a probe and has standing
      from then on; and a caller opening a fresh connection per call gains nothing by it: it has no standing, its
      host's results are counted together, and it gets a probe's few calls a second computed.

    Memory: at most ``total`` bytes plus what connections with standing add before their results turn overdue,
    plus the calls in progress (RELIABILITY.md, "The ledger"). Thread-safe."""

    def __init__(self, per_host: int = UNREAD_HOST_BYTES, total: int = UNREAD_TOTAL_BYTES,
                 send_timeout: float = 30.0, rate: int = DELIVERY_RATE, clock: Callable[[], float] | None = None):
        self.per_host, self.total, self.send_timeout, self.rate = per_host, total, send_timeout, max(1, rate)
        self.unproven = min(UNPROVEN_HOST_BYTES, per_host)
        self._clock = clock or time.monotonic
        self._cond = threading.Condition()
        self._entries: dict[int, _Unread] = {}
        self._next = 0
        self._hosts: collections.Counter[str] = collections.Counter()
        self._connections: collections.Counter[str] = collections.Counter()
        self.held = 0
        self._standing: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._tries: collections.OrderedDict[str, int] = collections.OrderedDict()  # calls asked per connection
        self._probes: dict[str, float] = {}  # host -> when its last probe was taken
        self._waiting: dict[str, tuple[str, int]] = {}  # connection -> (host, tries) of the calls in wait_room
        # calls of connections without standing being computed (admitted, their result not yet held): per host and
        # per connection, and the host's largest unread result of such a connection lately (``running``, TYPICAL_S)
        self._running_hosts: collections.Counter[str] = collections.Counter()
        self._running_conns: collections.Counter[str] = collections.Counter()
        self._typical: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()  # (bytes, when)
        self.cancelled = self.expired = self.refused = 0
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()

    def proven(self, connection: str) -> bool:
        """Whether ``connection`` has had a result delivered (and had none cut since): it reads what it asks for.
        Lock-free (a dict lookup); :class:`InheritedStalls` asks it for each waiting call it ranks."""
        return connection in self._standing

    # -------------------------------------------------------------- entries
    @contextlib.contextmanager
    def running(self, connection: str, host: str) -> Iterator[None]:
        """Count a call of ``connection`` on ``host`` from its body's arrival (after :meth:`refusal` let it in) until
        its result is held (the block ends), when the connection has no standing: :meth:`refusal` counts such calls of the host's *other*
        connections at the size of the host's largest unread result for a connection without standing in the last
        ``TYPICAL_S`` seconds, as if already held (none while the host's results are read).
        Without it, calls of a fresh connection each that passed the look together, or waited for a place after it,
        were all computed: 17 results of 8 MiB held half a second into an attack window, against 5 that the host's
        budget allows. Bench ``unread-results`` (6 rounds beside the control only): legitimate goodput 69% / 72% ->
        93% / 94%, the server's RSS peak +1,140 -> +509 MiB."""
        with self._cond:
            counted = connection not in self._standing
            if counted:
                self._running_hosts[host] += 1
                self._running_conns[connection] += 1
        try:
            yield
        finally:
            if counted:
                with self._cond:
                    for counter, key in ((self._running_hosts, host), (self._running_conns, connection)):
                        counter[key] -= 1
                        if counter[key] <= 0:
                            del counter[key]

    def hold(self, connection: str, host: str, nbytes: int, cancel: Callable[[], object]) -> int:
        """Enter a result of ``nbytes`` bytes handed to gRPC for ``connection`` on ``host``; ``cancel()`` ends its
        call (``ServicerContext.cancel``). Returns the key for :meth:`release`."""
        with self._cond:
            self._next += 1
            self._entries[self._next] = _Unread(connection, host, nbytes, self._clock(), cancel)
            self._hosts[host] += nbytes
            self._connections[connection] += nbytes
            self.held += nbytes
            self._start_reaper()
            return self._next

    def release(self, key: int, delivered: bool = True) -> None:
        """The call of ``key`` ended: ``delivered`` (its response and status reached the client) or not (cancelled by
        either side, or its connection closed). Only a delivery gives the connection standing."""
        with self._cond:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            if not entry.cancelled:  # a cancelled entry stopped counting when it was cancelled
                self._drop(entry)
            if not delivered:  # a connection that does not read its results has no standing (as when one is cut)
                self._standing.pop(entry.connection, None)
            elif not entry.cancelled:
                self._standing[entry.connection] = self._clock()
                self._standing.move_to_end(entry.connection)
                while len(self._standing) > STANDING_MEMORY:
                    self._standing.popitem(last=False)
            self._cond.notify_all()

    def _drop(self, entry: _Unread) -> None:
        for counter, key in ((self._hosts, entry.host), (self._connections, entry.connection)):
            counter[key] -= entry.nbytes
            if counter[key] <= 0:
                del counter[key]
        self.held -= entry.nbytes

    def holding(self, connection: str, host: str) -> tuple[int, int]:
        """(bytes undelivered of ``connection``, of ``host``)."""
        with self._cond:
            return self._connections[connection], self._hosts[host]

    # -------------------------------------------------------------- rules
    def _due(self, entry: _Unread, grace: float) -> float:
        return entry.since + grace + entry.nbytes / self.rate

    def _cancel(self, entry: _Unread) -> None:
        """Under the lock: end ``entry``'s call; its bytes stop counting now (gRPC frees them as it resets it)."""
        if entry.cancelled:
            return
        entry.cancelled = True
        self._drop(entry)
        self._standing.pop(entry.connection, None)  # a connection whose result was cut has no standing
        try:
            entry.cancel()
        except Exception:  # noqa: BLE001 - the call already ended
            pass

    def _evict_overdue(self, host: str | None) -> None:
        """Under the lock: cancel overdue results (of ``host``, or of every host for None), oldest first."""
        now = self._clock()
        for entry in list(self._entries.values()):
            if (host is None or entry.host == host) and not entry.cancelled and now > self._due(entry, DELIVERY_GRACE_S):
                self._cancel(entry)
                self.cancelled += 1

    def _has_standing(self, connection: str) -> bool:
        if connection not in self._standing:
            return False
        now = self._clock()
        return not any(e.connection == connection and now > self._due(e, DELIVERY_GRACE_S)
                       for e in self._entries.values())

    def _crowded(self, host: str, connection: str) -> bool:
        """Under the lock: whether ``host`` holds too much unread for its connections without standing. Not counting
        its one connection holding the most (that connection is held to its own budget, and a newcomer of the host
        is not charged for one stuck reader): it holds ``per_host`` bytes or more, or its connections without
        standing hold ``unproven`` or more, counting the calls of such connections other than ``connection`` that
        are being computed at the size of the host's largest unread such result lately (:meth:`running`); or it holds any
        while the server holds ``total``."""
        held = self._hosts[host]
        running = self._running_hosts[host] - self._running_conns[connection]
        if not held and not running:
            return False
        if self.held >= self.total:
            return True
        by_conn: collections.Counter[str] = collections.Counter()
        unproven: collections.Counter[str] = collections.Counter()
        now, stale = self._clock(), 0
        for e in self._entries.values():
            if e.host == host and not e.cancelled:
                by_conn[e.connection] += e.nbytes
                if e.connection not in self._standing:
                    unproven[e.connection] += e.nbytes
                    if now > e.since + ROOM_GRACE_S + e.nbytes / ROOM_RATE:  # a reader would have taken it by now
                        stale = max(stale, e.nbytes)
        top = max(by_conn.values(), default=0)
        top_unproven = max(unproven.values(), default=0)
        projected = sum(unproven.values()) - top_unproven + running * self._typical_size(host, stale, now)
        return held - top >= self.per_host or projected >= self.unproven

    def _typical_size(self, host: str, stale: int, now: float) -> int:
        """Under the lock: the size at which ``host``'s calls being computed count (:meth:`running`): the largest
        unread result of its connections without standing in the last ``TYPICAL_S`` seconds, ``stale`` (the largest
        unread now, 0 for none) taken in first; 0 when none was seen that recently."""
        size, since = self._typical.get(host, (0, -math.inf))
        if stale:
            if stale >= size or now - since > TYPICAL_S:
                size, since = self._typical[host] = (stale, now)
            self._typical.move_to_end(host)
            while len(self._typical) > STANDING_MEMORY:
                self._typical.popitem(last=False)
        return size if now - since <= TYPICAL_S else 0

    def _cut_one(self, host: str) -> None:
        """Under the lock: cancel the oldest result of ``host``'s connections without standing that a reader would
        have taken by now (older than ``ROOM_GRACE_S`` + its bytes at ``ROOM_RATE``), if there is one."""
        now = self._clock()
        stale = [e for e in self._entries.values()
                 if e.host == host and not e.cancelled and e.connection not in self._standing
                 and now > e.since + ROOM_GRACE_S + e.nbytes / ROOM_RATE]
        if stale:
            self._cancel(min(stale, key=lambda e: e.since))
            self.cancelled += 1

    def _probe(self, host: str) -> bool:
        """Under the lock: take ``host``'s probe (one call of a connection without standing per ``1 / PROBE_RATE``
        seconds while the host is crowded); False when it was taken less than that ago."""
        now = self._clock()
        if now - self._probes.get(host, -1e9) < 1.0 / PROBE_RATE:
            return False
        self._probes[host] = now
        if len(self._probes) > STANDING_MEMORY:
            self._probes.pop(next(iter(self._probes)))
        return True

    def refusal(self, connection: str, host: str) -> str | None:
        """Why a new call of ``connection`` on ``host`` must wait now (see the class docstring), or None. Takes the
        host's probe when that is what lets the call in."""
        with self._cond:
            return self._refusal(connection, host, first=True)

    def _refusal(self, connection: str, host: str, first: bool = False) -> str | None:
        own = self._connections[connection]
        if own >= self.per_host or (own and self.held >= self.total):
            self._evict_overdue(host)
            own = self._connections[connection]
            if own >= self.per_host or (own and self.held >= self.total):
                return (f"this connection holds {own} bytes of results the server computed and could not yet send "
                        f"({self.per_host} at most, none while the server holds {self.total}): read the results of "
                        "your calls (the client's HTTP/2 receive window) before sending more")
        if not self._crowded(host, connection) or self._has_standing(connection):
            return None
        if self._hosts[host] >= self.per_host or self.held >= self.total:  # only then are overdue results cut
            self._evict_overdue(host)
            if not self._crowded(host, connection):
                return None
        # a connection without standing on a crowded host: one such call per probe period, the connection that
        # has waited most often first (a client that retries on its connection, as a reader does, not a caller
        # that opens a fresh one for every call)
        tries = self._tries.get(connection, 0) + (1 if first else 0)  # this connection's asks, this one included
        if first:
            self._tries[connection] = tries
            self._tries.move_to_end(connection)
            while len(self._tries) > STANDING_MEMORY:
                self._tries.popitem(last=False)
        best = max((t for c, (h, t) in self._waiting.items() if h == host and c != connection), default=-1)
        # never on a connection's first ask: a caller with a fresh connection per call gets nothing computed
        if tries >= 2 and tries >= best and self._probe(host):
            self._cut_one(host)
            return None
        return (f"results computed for this client host ({self._hosts[host]} bytes; {self.held} for all hosts) "
                "are waiting to be read: calls on connections that read their results go first")

    def wait_room(self, connection: str, host: str, seconds: float) -> str | None:
        """Wait up to ``seconds`` for :meth:`refusal` to clear; the refusal left at the end, or None. A connection
        on its first call (one :meth:`refusal` asked) is answered at once, without waiting: a caller that opens a
        fresh connection per call then holds no thread of the server's pool for its refusals, and a reader, which
        sends its call again on the same connection after the pushback, waits from its second ask on, ranked
        before every first-time asker."""
        deadline = self._clock() + max(0.0, seconds)
        with self._cond:
            own = self._connections[connection]
            over_own = own >= self.per_host or (own and self.held >= self.total)
            if self._tries.get(connection, 0) <= 1 and not over_own:
                why = self._refusal(connection, host)
                if why is not None:
                    self.refused += 1
                return why
            self._waiting[connection] = (host, self._tries.get(connection, 0))
            try:
                while True:
                    why = self._refusal(connection, host)
                    left = deadline - self._clock()
                    if why is None or left <= 0:
                        if why is not None:
                            self.refused += 1
                        return why
                    self._cond.wait(min(left, 0.05))
            finally:
                self._waiting.pop(connection, None)

    # -------------------------------------------------------------- expiry
    def _start_reaper(self) -> None:
        if self._reaper is None and not self._stop.is_set():
            self._reaper = threading.Thread(target=self._reap, name="advantage-result-ledger", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        while not self._stop.wait(0.25):
            self.expire()

    def expire(self) -> int:
        """Cancel every result past its expiry (see the class docstring); how many."""
        now = self._clock()
        n = 0
        with self._cond:
            for entry in list(self._entries.values()):
                if not entry.cancelled and now > self._due(entry, self.send_timeout):
                    self._cancel(entry)
                    n += 1
            self.expired += n
        return n

    def close(self) -> None:
        self._stop.set()
        reaper = self._reaper
        if reaper is not None:
            reaper.join(2)


# ------------------------------------------------------------------------------------------ open connections
#: a connection with no call open counts as idle (and may be closed to make room, below) once it has had none for
#: this long: a client channel sends its first call within milliseconds of connecting (so a new client is not cut
#: before its first call), and a trainer's connection between two calls is closed only when its host or the server
#: is over its share, and after the idle connections of the host holding the most (it reconnects at its next call).
#: Short, because an attacker that reopens what is closed holds, besides its share, what it opens in this time
CONNECTION_IDLE_MIN_S = 0.5
#: the same for a host over its share: a client sends its first call within milliseconds of connecting, and an
#: attacker that reopens every connection closed keeps what it reopened in this time
CONNECTION_OVER_SHARE_IDLE_S = 0.05
#: call-end times kept for connections no longer seen, at most (older ones are forgotten first)
CONNECTION_MEMORY = 16384
#: seconds a host found over its share has its new connections dropped in the kernel
#: (:class:`advantage_server.identity.ListenerGate`) the first time; each time it is found over its share again after
#: its gate lapsed, twice as long, at most ``CONNECTION_GATE_MAX_S``
CONNECTION_GATE_S = 1.0
CONNECTION_GATE_MAX_S = 16.0
#: a host not found over its share for this many seconds starts again from ``CONNECTION_GATE_S``
CONNECTION_GATE_FORGIVE_S = 60.0


class ConnectionShares:
    """Open connections a caller holds: the ledger's connections entry (issue #35 item 4).

    gRPC holds at most ``total`` connections (``grpc.max_allowed_incoming_connections``, below the descriptor
    limit) and closes each one beyond it as it arrives, whoever opens it: one host holding them all would lock every
    new client out. So connections are shared like places, per host, and only *idle* ones are ever taken back: a
    connection with no call open (health ``Watch`` streams and calls waiting for a place count as open) for
    ``CONNECTION_IDLE_MIN_S`` or more. :meth:`choose` names the connections to close, longest idle first:

    * **per host**: a host holding more than ``per_host`` connections loses its idle ones (none for
      ``CONNECTION_OVER_SHARE_IDLE_S``) down to half of ``per_host``: an attacker that opens a new connection for
      each one closed must open that many again, each sweep, to fill the server;
    * **gate**: a host over its share also has its new connections dropped in the kernel (:meth:`gate`; dropped
      SYNs: its clients' kernels send them again, and their connection attempts time out) for
      ``CONNECTION_GATE_S``, twice as long each time it is found over again after a gate lapsed (at most ``CONNECTION_GATE_MAX_S``), and no longer once it holds a quarter
      of its share or less (it left). A host that reopens every connection closed (~20,000 a second from one CPU)
      otherwise refills the server faster than a sweep can close them, and gRPC then closes every other host's new
      connections as they arrive. The gate cannot tell two clients of one address apart: a gated host's *new*
      connections are dropped, whoever opens them; connections already open are untouched;
    * **in all**: while more than ``total - headroom`` are open, the host holding the most loses its longest idle
      one, again and again, down to ``total - 2 headroom`` (``headroom``: a sixteenth of ``total``, at least 8), so
      that a new client's connection is accepted and a host holding few is never the one that pays.

    The server's reaper (:class:`advantage_server.server.ConnectionReaper`) feeds it what the process's sockets
    say (:class:`advantage_server.identity.ServerSockets`) and shuts what it names; every call of every service
    marks its connection busy from its start to its end (:meth:`call_started`, :meth:`call_ended`). Thread-safe."""

    def __init__(self, total: int, per_host: int, clock: Callable[[], float] | None = None):
        if total < 1 or per_host < 1:
            raise ValueError(f"connection shares need total >= 1 and per_host >= 1, got {total}, {per_host}")
        self.total, self.per_host = total, per_host
        self.headroom = max(8, total // 16)
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._open: collections.Counter[str] = collections.Counter()  # connection key -> calls open now
        self._busy: collections.OrderedDict[str, float] = collections.OrderedDict()  # key -> its last call's end
        self._seen: dict[str, float] = {}  # key -> when choose() first saw it
        self._strikes: dict[str, tuple[int, float]] = {}  # host -> (gates in a row, when last over its share)
        self._gated: dict[str, float] = {}  # host -> until when its new connections are dropped
        self._counts: collections.Counter[str] = collections.Counter()  # host -> connections at the last sweep

    @property
    def high_water(self) -> int:
        """Open connections above which the host holding the most loses idle ones."""
        return max(1, self.total - self.headroom)

    def call_started(self, key: str) -> None:
        with self._lock:
            self._open[key] += 1

    def call_ended(self, key: str) -> None:
        with self._lock:
            left = self._open[key] - 1
            if left > 0:
                self._open[key] = left
            else:
                self._open.pop(key, None)
            self._busy[key] = self._clock()
            self._busy.move_to_end(key)
            while len(self._busy) > CONNECTION_MEMORY:
                self._busy.popitem(last=False)

    def gate(self, per_host: Mapping[str, int] | None = None) -> list[str]:
        """The hosts whose new connections are to be dropped now (see the class docstring), the one holding the most
        first. ``per_host``: the connections each host holds, as a sweep just counted them (a host over its share
        is gated, longer each time it is found so again after its gate lapsed); None: only the gates' time."""
        now = self._clock()
        with self._lock:
            if per_host is not None:  # a gated host that let go of what it held (it left) is let in again
                for host in [h for h in self._gated if per_host.get(h, 0) <= max(1, self.per_host // 4)]:
                    del self._gated[host]
            for host, n in (per_host or {}).items():
                if n <= self.per_host:
                    continue
                strikes, last = self._strikes.get(host, (0, -math.inf))
                if self._gated.get(host, -math.inf) <= now:  # a new offence: a longer gate than the last one
                    strikes = 1 if now - last > CONNECTION_GATE_FORGIVE_S else strikes + 1
                    self._gated[host] = now + min(CONNECTION_GATE_MAX_S, CONNECTION_GATE_S * 2 ** (strikes - 1))
                self._strikes[host] = (strikes, now)
            if per_host is not None:
                self._counts = collections.Counter(per_host)
            self._gated = {host: until for host, until in self._gated.items() if until > now}
            if len(self._strikes) > CONNECTION_MEMORY:
                self._strikes = {h: v for h, v in self._strikes.items() if now - v[1] <= CONNECTION_GATE_FORGIVE_S}
            return sorted(self._gated, key=lambda host: -self._counts[host])

    def choose(self, live: Mapping[str, str]) -> list[str]:
        """The connections to close now, from ``live`` (every open connection: key -> its host), longest idle first
        within each rule (see the class docstring); none while nobody is over a share."""
        now = self._clock()
        with self._lock:
            self._seen = {key: self._seen.get(key, now) for key in live}
            per_host: collections.Counter[str] = collections.Counter(live.values())
            over = {host for host, n in per_host.items() if n > self.per_host}
            idle: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
            for key, host in live.items():
                if self._open.get(key):
                    continue
                since = max(self._busy.get(key, -math.inf), self._seen[key])
                if now - since >= (CONNECTION_OVER_SHARE_IDLE_S if host in over else CONNECTION_IDLE_MIN_S):
                    idle[host].append((since, key))
        for candidates in idle.values():
            candidates.sort(reverse=True)  # the longest idle last: pop() takes it
        chosen: list[str] = []

        def take(host: str) -> None:
            chosen.append(idle[host].pop()[1])
            per_host[host] -= 1

        for host in over:
            while per_host[host] > self.per_host // 2 and idle[host]:
                take(host)
        open_now = len(live) - len(chosen)
        if open_now > self.high_water:
            floor = max(0, self.total - 2 * self.headroom)
            # the host holding the most first (then the one idle the longest): a heap, each host pushed back after
            # it gave one up
            heap = [(-per_host[h], idle[h][-1][0], h) for h in idle if idle[h]]
            heapq.heapify(heap)
            while open_now > floor and heap:
                _, _, host = heapq.heappop(heap)
                take(host)
                open_now -= 1
                if idle[host]:
                    heapq.heappush(heap, (-per_host[host], idle[host][-1][0], host))
        return chosen
