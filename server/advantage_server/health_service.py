"""``grpc.health.v1.Health`` without the shutdown deadlock of grpcio-health-checking's servicer.

``grpc_health.v1.health.HealthServicer.set`` (and so ``enter_graceful_shutdown``) sends the new status to
every ``Watch`` stream while holding the servicer's lock, and a non-blocking send waits for gRPC's polling
thread. When a watcher's connection closes at that moment, the polling thread runs the servicer's close
callback, which needs the same lock: the two wait for each other and the server never finishes its
drain (seen here: SIGTERM right after 32 clients with client-side health checking disconnected). The
upstream fix is open (grpc/grpc#43403). This subclass keeps the statuses under one lock and sends outside
it, under a send lock the polling thread never takes, so a status change still reaches each watcher in
order and after its initial status.

It also caps the ``Watch`` streams, which need no token and cost the server memory while they stay open
(about 17 KiB each, measured: +402 MiB at 23,610 streams before the cap): at most ``max_watches`` in all and
``max_watches_per_peer`` per client host (:func:`~advantage_server.limits.peer_host`); the next one is
refused at once with RESOURCE_EXHAUSTED. ``Check`` stays unlimited (it holds nothing once answered).
"""
from __future__ import annotations

import collections
import threading

import grpc
from grpc_health.v1 import health, health_pb2

from advantage_server.limits import call_peer, peer_host

#: health ``Watch`` streams open at once, in all (x ~17 KiB: ~17 MiB at most)
MAX_WATCHES = 1024
#: health ``Watch`` streams open at once from one client host (a client with health checking opens one per
#: connection: 128 trainer processes on one host, each with its own channel, still fit)
MAX_WATCHES_PER_PEER = 128


class HealthServicer(health.HealthServicer):
    """Drop-in for ``grpc_health.v1.health.HealthServicer`` (same API) that cannot deadlock on shutdown."""

    def __init__(self, experimental_non_blocking: bool = True, experimental_thread_pool=None,
                 max_watches: int = MAX_WATCHES, max_watches_per_peer: int = MAX_WATCHES_PER_PEER):
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
            return (f"{self.max_watches_per_peer} health Watch streams from this client's host ({host}) are open "
                    "already, the most the server allows per host (MAX_WATCHES_PER_PEER); close some, or use "
                    "Health/Check")
        if sum(self._watchers.values()) >= self.max_watches:
            return (f"{self.max_watches} health Watch streams are open on this server already, the most it allows "
                    "(MAX_WATCHES); retry later, or use Health/Check")
        self._watchers[host] += 1
        return None

    def _release_watch(self, host: str) -> None:
        with self._lock:
            self._watchers[host] -= 1
            if self._watchers[host] <= 0:
                del self._watchers[host]

    def Watch(self, request, context, send_response_callback=None):
        """The service's status now, then each change, until the client closes the stream. RESOURCE_EXHAUSTED
        at once beyond ``max_watches`` open streams, or ``max_watches_per_peer`` from the caller's host."""
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
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
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
