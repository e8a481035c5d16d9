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
"""
from __future__ import annotations

import collections
import threading

import grpc
from grpc_health.v1 import health, health_pb2

from advantage_server.identity import call_peer, peer_host
from advantage_server.shares import MAX_WATCHES, MAX_WATCHES_PER_HOST

#: the old name of ``MAX_WATCHES_PER_HOST``
MAX_WATCHES_PER_PEER = MAX_WATCHES_PER_HOST


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
