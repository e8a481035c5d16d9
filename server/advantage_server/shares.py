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
from typing import Mapping

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
