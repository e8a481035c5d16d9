"""``grpc.health.v1.Health`` without the shutdown deadlock of grpcio-health-checking's servicer.

``grpc_health.v1.health.HealthServicer.set`` (and so ``enter_graceful_shutdown``) sends the new status to
every ``Watch`` stream while holding the servicer's lock, and a non-blocking send waits for gRPC's polling
thread. When a watcher's connection closes at that moment, the polling thread runs the servicer's close
callback, which needs the same lock: the two wait for each other and the server never finishes its
drain (seen here: SIGTERM right after 32 clients with client-side health checking disconnected). The
upstream fix is open (grpc/grpc#43403). This subclass keeps the statuses under one lock and sends outside
it, under a send lock the polling thread never takes, so a status change still reaches each watcher in
order and after its initial status.
"""
from __future__ import annotations

import threading

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.HealthServicer):
    """Drop-in for ``grpc_health.v1.health.HealthServicer`` (same API) that cannot deadlock on shutdown."""

    def __init__(self, experimental_non_blocking: bool = True, experimental_thread_pool=None):
        super().__init__(experimental_non_blocking, experimental_thread_pool)
        self._send_lock = threading.RLock()  # orders the sends; never taken by gRPC's polling thread

    def Watch(self, request, context, send_response_callback=None):
        if send_response_callback is None:  # a server without non-blocking streams: the blocking watcher
            return super().Watch(request, context, send_response_callback)
        service = request.service
        with self._send_lock:
            with self._lock:
                status = self._server_status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                self._send_response_callbacks.setdefault(service, set()).add(send_response_callback)
                registered = context.add_callback(self._on_close_callback(send_response_callback, service))
            if not registered:  # the call already ended
                with self._lock:
                    self._send_response_callbacks[service].discard(send_response_callback)
                return None
            send_response_callback(health_pb2.HealthCheckResponse(status=status))
        return None

    def _on_close_callback(self, send_response_callback, service):
        def callback():
            with self._lock:
                self._send_response_callbacks.get(service, set()).discard(send_response_callback)
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
