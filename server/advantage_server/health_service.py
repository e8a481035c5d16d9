"""``grpc.health.v1.Health`` without the shutdown deadlock of grpcio-health-checking's servicer.

``grpc_health.v1.health.HealthServicer.set`` (and so ``enter_graceful_shutdown``) sends the new status to
every ``Watch`` stream while holding the servicer's lock, and a non-blocking send waits for gRPC's polling
thread. When a watcher's connection closes at that moment, the polling thread runs the servicer's close
callback, which needs the same lock: the two wait for each other and the server never finishes its
drain (seen here: SIGTERM right after 32 clients with client-side health checking disconnected). The
upstream fix is open (grpc/grpc#43403). This subclass keeps the statuses under one lock and sends outside
it, under a send lock the polling thread never takes, so a status change still reaches each watcher in
order and after its initial status.

Health means alive (RELIABILITY.md, "The admission model"): the service's status is NOT_SERVING while the
server warms up and from the start of its drain, SERVING in between, and never NOT_SERVING for being full (a
full server refuses calls with a retry pushback instead: :class:`advantage_server.admission.Overloaded`).

It also bounds the ``Watch`` streams, which need no token and cost the server memory while they stay open
(about 17 KiB each, measured: +402 MiB at 23,610 streams before any bound): at most ``max_watches`` in all and
``max_watches_per_peer`` per client host (:func:`~advantage_server.identity.peer_host`,
:mod:`advantage_server.shares`). A ``Watch`` beyond either is answered **UNIMPLEMENTED**, at once: gRPC's
health-checking protocol (grpc/doc/health-checking.md) has every client that gets UNIMPLEMENTED from ``Watch``
disable health checking on that connection and treat it as healthy. So the bound costs a client beyond it only
the early news of a drain (which the drain's UNAVAILABLE refusals and the retry policy cover), never its calls:
a flood of tokenless ``Watch`` streams, or a thousand client processes on one host, cannot make a token holder's
channel unhealthy (RESOURCE_EXHAUSTED, as before, made gRPC mark the connection unhealthy and fail every call
UNAVAILABLE). ``Check`` stays unlimited (it holds nothing once answered).

The health calls' request messages are read under bounds of their own (:meth:`HealthServicer.register`):
grpcio takes a pool thread for a unary call *before* its one request message has arrived and waits for it
without a time limit, so health calls whose message never came (they need no token) held the server's pool: 22
silent ``Check`` calls against a 20-thread pool made a token holder's call time out. Registered here, the health
methods run on a small pool of their own (``HEALTH_THREADS`` per server: the service's calls never wait behind
them); a health request must arrive within ``HEALTH_REQUEST_S`` of the call's start, or the call is ended
(CANCELLED at the client); and a host has at most ``HEALTH_READS_PER_HOST`` health calls waiting for their
request for up to ``HEALTH_REQUEST_S`` at once; its others wait ``HEALTH_BUSY_REQUEST_S`` and are then answered
UNIMPLEMENTED (a ``Watch`` client then treats the server as healthy, as above). A gRPC client sends the request
with the call's headers, so a legitimate call is read at once, in a burst from one host too.

Those allowances count from the call's **arrival**, not from when a health thread takes it up, and at most
``HEALTH_QUEUE`` health calls wait for a health thread at once (:class:`_HealthQueue`). gRPC counts a call queued
for a pool against its backstop (``maximum_concurrent_rpcs``) like a running one, so a flood of silent health calls
(a few hundred, from one host) used to fill the backstop, and gRPC then refused the service's own calls too
(RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!"), while every other client's health answer waited behind the
flood (drained at about 10 calls a second). Now a health call beyond the queue's limit (``HEALTH_QUEUE``, or half
the server's backstop when that is less) is answered UNIMPLEMENTED by gRPC at once ("Method not found!": the queue
is counted where gRPC looks its handler up, before any thread is taken; a ``Watch`` client then treats the server
as healthy), and a silent call that waited in the queue past its allowance holds a health thread only
``HEALTH_MIN_READ_S`` (0.1 s; then UNIMPLEMENTED, never CANCELLED): the queue drains at about 40 silent calls a
second, so an ordinary health call behind a full queue of the test's size (44) is answered within about a second.
A call gRPC refuses at its backstop after the lookup counted it is never taken up: entries drop out of the count
after ``_QUEUE_EXPIRY_S`` plus the queue's drain time.
"""
from __future__ import annotations

import collections
import contextvars
import logging
import threading
import time
from concurrent import futures
from typing import Any, Iterator

import grpc
from grpc_health.v1 import health, health_pb2

from advantage_server.identity import call_peer, peer_host
from advantage_server.shares import MAX_WATCHES, MAX_WATCHES_PER_HOST
from advantage_server.uploads import _cancel_with_status

#: threads of the health service's own pool, per server (the main server and ``--health-port``): ``Check`` is
#: answered at once and an open ``Watch`` holds no thread, so they are busy only while a request is arriving
HEALTH_THREADS = 4
#: seconds a health call's one request message may take to arrive after the call started (a gRPC client sends it
#: with the headers); a call still without it is ended, so a silent call holds a health thread at most this long
HEALTH_REQUEST_S = 1.0
#: health calls of one client host that may wait ``HEALTH_REQUEST_S`` for their request message at once
#: (:func:`peer_host`: an IPv4 address, an IPv6 /64); the host's others wait ``HEALTH_BUSY_REQUEST_S``
HEALTH_READS_PER_HOST = 2
#: seconds a health call waits for its request message while ``HEALTH_READS_PER_HOST`` calls of its host are
#: waiting for theirs; then it is answered UNIMPLEMENTED (a ``Watch`` client then treats the server as healthy).
#: Long against a message that travels with its call's headers, short against what a silent call may hold
HEALTH_BUSY_REQUEST_S = 0.2

#: health calls (of one server) handed to the health pool and not yet taken up by one of its threads, at most; the
#: next is answered UNIMPLEMENTED at once, without a thread. The advantage server passes half its gRPC backstop
#: (``maximum_concurrent_rpcs``, which counts queued calls) when that is less: its own calls never need more than a
#: quarter of the backstop (the pool's size), so they keep their room
HEALTH_QUEUE = 256
#: seconds a health call taken up after its allowance has passed (it waited in the queue) still gets for its
#: request message: one that came with the headers is read within milliseconds, more on a swamped server (20 ms
#: ended some legitimate calls under a tokenless burst; 0.2 s none). Such a call is ended UNIMPLEMENTED (a Watch
#: client then treats the server as healthy), never CANCELLED. With ``HEALTH_THREADS``, a queue of silent calls
#: drains at about 40 a second
HEALTH_MIN_READ_S = 0.1
#: seconds a queued call's entry is counted at most: gRPC may refuse a call at its backstop *after* the handler
#: lookup counted it (its behaviour never runs, so it is never taken up); such entries drop out of the count then
_QUEUE_EXPIRY_S = 2.0

#: the old name of ``MAX_WATCHES_PER_HOST``
MAX_WATCHES_PER_PEER = MAX_WATCHES_PER_HOST
_HEALTH = "grpc.health.v1.Health"
log = logging.getLogger("advantage_server")


class _Arrival:
    """A health call's arrival time, set where gRPC looks its handler up (its polling thread) and read by the
    behaviour on a health thread: grpcio runs both in the call's own ``contextvars.Context``."""
    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = time.monotonic()


_ARRIVAL: contextvars.ContextVar[_Arrival] = contextvars.ContextVar("advantage_health_arrival")


class _HealthQueue:
    """Counts the health calls handed to the health pool and not yet taken up (at most ``limit``)."""

    def __init__(self, limit: int = HEALTH_QUEUE):
        self.limit = limit
        self._lock = threading.Lock()
        self._queued: dict[int, _Arrival] = {}
        self.refused = 0  # calls answered UNIMPLEMENTED at the lookup: the queue was full
        #: False once a call was taken up without the arrival its lookup stamped (a grpcio that no longer runs the
        #: lookup and the behaviour in one contextvars.Context): the queue then stops counting (see :meth:`take`)
        self.counting = True
        self._stamped = False

    def enter(self) -> bool:
        """On gRPC's polling thread, for a health call about to be handed to the pool: False when ``limit`` calls
        wait already (gRPC then answers UNIMPLEMENTED), else its arrival is stamped into the call's context."""
        if not self.counting:
            return True
        arrival = _Arrival()
        with self._lock:
            # entries are in arrival order: drop the expired from the front (a call refused at gRPC's backstop after
            # this lookup counted it; or one queued longer, which is then only not counted)
            expiry = _QUEUE_EXPIRY_S + self.limit * HEALTH_MIN_READ_S / HEALTH_THREADS
            while self._queued:
                key, first = next(iter(self._queued.items()))
                if arrival.at - first.at <= expiry:
                    break
                del self._queued[key]
            if len(self._queued) >= self.limit:
                self.refused += 1
                return False
            self._queued[id(arrival)] = arrival
            self._stamped = True
        _ARRIVAL.set(arrival)
        return True

    def take(self) -> float:
        """On the health thread that takes the call up: its arrival time (now, for a call not stamped)."""
        arrival = _ARRIVAL.get(None)
        if arrival is None:
            with self._lock:
                if self._stamped and self.counting:
                    # the lookup stamped calls but this one's behaviour does not see its stamp: no entry would ever
                    # leave the count but by expiry, and the queue would answer most health calls UNIMPLEMENTED.
                    # Stop counting (the allowances then count from take-up, gRPC's backstop is the only bound)
                    self.counting = False
                    self._queued.clear()
                    log.warning("health queue off: grpcio ran a health call's behaviour outside the contextvars."
                                "Context of its handler lookup, so queued health calls cannot be counted (this "
                                "grpcio is newer than the ones tested); a flood of silent health calls can then "
                                "fill gRPC's backstop (RELIABILITY.md, the health queue)")
            return time.monotonic()
        with self._lock:
            self._queued.pop(id(arrival), None)
        return arrival.at

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queued)


class _HealthHandlers(grpc.GenericRpcHandler):
    """The health methods' handlers, behind :class:`_HealthQueue`: a lookup beyond its limit finds no handler."""

    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler], queue: _HealthQueue):
        self._handlers = {f"/{_HEALTH}/{name}": h for name, h in handlers.items()}
        self._queue = queue

    def service(self, handler_call_details):
        handler = self._handlers.get(handler_call_details.method)
        if handler is None or not self._queue.enter():
            return None
        return handler


class _RequestReads:
    """The health calls of one server that wait for their request message. Up to ``per_host`` of a client host
    wait at most ``limit`` seconds each (then ended: CANCELLED); the others of that host at most ``busy_limit``
    (then answered UNIMPLEMENTED), so a host whose calls do not send their message holds the health pool only
    briefly per call, while a burst of ordinary calls from one host (each message on its way with its headers)
    is served. One thread ends each call when its allowance ends."""

    def __init__(self, limit: float = HEALTH_REQUEST_S, per_host: int = HEALTH_READS_PER_HOST,
                 busy_limit: float = HEALTH_BUSY_REQUEST_S, pool: futures.ThreadPoolExecutor | None = None,
                 queue_limit: int = HEALTH_QUEUE):
        self.limit, self.per_host, self.busy_limit = limit, per_host, busy_limit
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        #: id -> (when it is ended, its context, whether it was beyond per_host)
        self._waiting: dict[int, tuple[float, Any, bool]] = {}
        self._hosts: collections.Counter[str] = collections.Counter()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.pool = pool  # the health methods' thread pool (HealthServicer.register's); shut down by close()
        self.queue = _HealthQueue(queue_limit)
        self.refused = 0  # calls beyond per_host whose message did not come within busy_limit (UNIMPLEMENTED)
        self.ended = 0    # calls within per_host whose message did not come within limit (CANCELLED)

    def read(self, requests: Iterator[Any], context: grpc.ServicerContext, reraise: bool = False) -> Any:
        """The call's one request message; None when the call ended before it arrived (the client left, or it
        was ended here: see the class docstring), or with ``reraise`` gRPC's own error for that end, which a
        unary handler raises so that gRPC ends the call quietly (a None returned would be logged as "Exception
        serializing message!" with a traceback, once per call of a flood). Aborts INVALID_ARGUMENT when the call
        has no message. The allowance counts from the call's arrival (:class:`_HealthQueue`), at least
        ``HEALTH_MIN_READ_S`` from now."""
        host, key = peer_host(call_peer(context)), id(context)
        arrived = self.queue.take()
        with self._lock:
            busy = self._hosts[host] >= self.per_host
            if not busy:
                self._hosts[host] += 1
            own = arrived + (self.busy_limit if busy else self.limit)
            floor = time.monotonic() + HEALTH_MIN_READ_S
            # a call taken up past its allowance (it waited in the queue) is ended as a busy one: UNIMPLEMENTED
            self._waiting[key] = (max(own, floor), context, busy or floor > own)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="advantage-health-reads", daemon=True)
                self._thread.start()
            self._wake.notify()
        try:
            try:
                return next(requests)
            except grpc.RpcError:  # ended: the client left, or _run ended it
                if reraise:
                    raise
                return None
        except StopIteration:
            if not context.is_active():  # ended here meanwhile (its status is sent already)
                return None
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{_HEALTH} calls take exactly one request message")
        finally:
            with self._lock:
                self._waiting.pop(key, None)
                if not busy:
                    self._hosts[host] -= 1
                    if self._hosts[host] <= 0:
                        del self._hosts[host]

    def close(self) -> None:
        """Once the server has stopped: end the reaper thread and shut the health pool down (its threads exit once
        idle). Calls still waiting for their request message are ended by the server's stop, not here."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def _run(self) -> None:
        while True:
            with self._lock:  # sleep until the first allowance ends (a new call, maybe with an earlier end, wakes it)
                while True:
                    if self._closed:
                        self._thread = None
                        return
                    now = time.monotonic()
                    first = min((end for end, _, _ in self._waiting.values()), default=None)
                    if first is not None and first <= now:
                        break
                    self._wake.wait(None if first is None else first - now)
                late = [k for k, (end, _, _) in self._waiting.items() if end <= now]
                ended = [self._waiting.pop(k)[1:] for k in late]
                self.refused += sum(busy for _, busy in ended)
                self.ended += sum(not busy for _, busy in ended)
            for context, busy in ended:
                if busy:
                    _cancel_with_status(context, TimeoutError(
                        "health is not offered to this call: its request message did not arrive in time, while "
                        f"{self.per_host} health calls from its host were waiting for theirs "
                        "(HEALTH_READS_PER_HOST), or after the call waited in the health queue behind others; treat "
                        "the server as healthy (gRPC clients do so on UNIMPLEMENTED)"), "unimplemented")
                else:
                    _cancel_with_status(context, TimeoutError(
                        f"the health request did not arrive within {self.limit:g} s of the call (HEALTH_REQUEST_S)"),
                        "cancelled")


class HealthServicer(health.HealthServicer):
    """Drop-in for ``grpc_health.v1.health.HealthServicer`` (same API) that cannot deadlock on shutdown."""

    def __init__(self, experimental_non_blocking: bool = True, experimental_thread_pool=None,
                 max_watches: int = MAX_WATCHES, max_watches_per_peer: int = MAX_WATCHES_PER_HOST):
        super().__init__(experimental_non_blocking, experimental_thread_pool)
        self._send_lock = threading.RLock()  # orders the sends; never taken by gRPC's polling thread
        self.max_watches, self.max_watches_per_peer = max_watches, max_watches_per_peer
        self._watchers: collections.Counter[str] = collections.Counter()  # client host -> open Watch streams
        self.watch_refusals = 0

    @property
    def watches(self) -> int:
        """``Watch`` streams open now (non-blocking servers)."""
        with self._lock:
            return sum(self._watchers.values())

    def _refuse_watch(self, host: str) -> str | None:
        """Why one more ``Watch`` stream from ``host`` is refused (None: count it); under ``_lock``."""
        if self._watchers[host] >= self.max_watches_per_peer:
            return (f"health Watch is not offered to this connection: {self.max_watches_per_peer} Watch streams from "
                    f"its host ({host}) are open already, the most the server keeps per host (MAX_WATCHES_PER_HOST); "
                    "treat the server as healthy (gRPC clients do so on UNIMPLEMENTED), or use Health/Check")
        if sum(self._watchers.values()) >= self.max_watches:
            return (f"health Watch is not offered to this connection: {self.max_watches} Watch streams are open on "
                    "this server already, the most it keeps (MAX_WATCHES); treat the server as healthy (gRPC clients "
                    "do so on UNIMPLEMENTED), or use Health/Check")
        self._watchers[host] += 1
        return None

    def _release_watch(self, host: str) -> None:
        with self._lock:
            self._watchers[host] -= 1
            if self._watchers[host] <= 0:
                del self._watchers[host]

    def Watch(self, request, context, send_response_callback=None):
        """The service's status now, then each change, until the client closes the stream. UNIMPLEMENTED at once
        beyond ``max_watches`` open streams, or ``max_watches_per_peer`` from the caller's host (the client then
        treats the server as healthy: see the module docstring)."""
        if send_response_callback is None:  # a server without non-blocking streams: the blocking watcher
            return super().Watch(request, context, send_response_callback)
        service = request.service
        host = peer_host(call_peer(context))
        with self._send_lock:
            with self._lock:
                refusal = self._refuse_watch(host)
                self.watch_refusals += refusal is not None
                if refusal is None:
                    status = self._server_status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    self._send_response_callbacks.setdefault(service, set()).add(send_response_callback)
                    registered = context.add_callback(
                        self._on_close_callback(send_response_callback, service, host))
            if refusal is not None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, refusal)
            if not registered:  # the call already ended
                with self._lock:
                    self._send_response_callbacks[service].discard(send_response_callback)
                self._release_watch(host)
                return None
            send_response_callback(health_pb2.HealthCheckResponse(status=status))
        return None

    def register(self, server: grpc.Server, threads: int = HEALTH_THREADS,
                 queue_limit: int = HEALTH_QUEUE) -> _RequestReads:
        """Serve ``grpc.health.v1.Health`` on ``server`` (in place of ``health_pb2_grpc.add_HealthServicer_to_server``)
        with its own pool of ``threads`` and bounded request reads (:class:`_RequestReads`; see the module
        docstring), at most ``queue_limit`` calls waiting for a thread (:class:`_HealthQueue`). Returns the reads'
        bookkeeping (its ``refused`` and ``ended`` counts, its ``queue``); :meth:`_RequestReads.close` it once
        ``server`` has stopped (its pool and reaper thread end)."""
        pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="advantage-health")
        reads = _RequestReads(pool=pool, queue_limit=queue_limit)

        def check(requests, context):
            request = reads.read(requests, context, reraise=True)
            if request is None:  # ended here meanwhile (its status is sent already): end the handler quietly
                context.abort(grpc.StatusCode.CANCELLED, "the call ended before its request message came")
            return self.Check(request, context)

        def watch(requests, context, send_response_callback=None):
            request = reads.read(requests, context)
            if request is None:
                if send_response_callback is not None:
                    send_response_callback(None)
                return None
            return self.Watch(request, context, send_response_callback)

        for behavior in (check, watch):
            behavior.experimental_thread_pool = pool  # grpcio runs the call on this pool
        watch.experimental_non_blocking = True  # an open Watch holds no thread (send_response_callback)
        handlers = {
            "Check": grpc.stream_unary_rpc_method_handler(
                check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
            "Watch": grpc.stream_stream_rpc_method_handler(
                watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((_HealthHandlers(handlers, reads.queue),))
        return reads

    def _on_close_callback(self, send_response_callback, service, host=None):
        def callback():
            with self._lock:
                self._send_response_callbacks.get(service, set()).discard(send_response_callback)
            if host is not None:
                self._release_watch(host)
            send_response_callback(None)
        return callback

    def set(self, service, status):
        with self._send_lock:
            with self._lock:
                if self._gracefully_shutting_down:
                    return
                self._server_status[service] = status
                callbacks = list(self._send_response_callbacks.get(service, ()))
            response = health_pb2.HealthCheckResponse(status=status)
            for callback in callbacks:
                callback(response)

    def enter_graceful_shutdown(self):
        with self._send_lock:
            with self._lock:
                if self._gracefully_shutting_down:
                    return
                services = list(self._server_status)
            for service in services:
                self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            with self._lock:
                self._gracefully_shutting_down = True
