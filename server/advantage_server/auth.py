"""Transport security and caller authentication.

* TLS: :func:`server_credentials` builds gRPC server credentials from a PEM certificate chain and key;
  with a client CA it is mutual TLS and a client certificate signed by that CA is required.
* Bearer token: :class:`TokenAuthInterceptor` checks ``authorization: Bearer <token>`` on every call
  except ``grpc.health.v1.Health`` (probes carry no credentials), comparing in constant time
  (:func:`hmac.compare_digest`). A call without the right token is refused with UNAUTHENTICATED
  before its request is decoded. Neither the expected nor the presented token is ever logged.
"""
from __future__ import annotations

import hmac
import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable

import grpc

log = logging.getLogger("advantage_server")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
Pem = bytes | str | os.PathLike


def read_pem(value: Pem | None, what: str) -> bytes | None:
    """PEM bytes as given, or read from a path. ``None`` stays ``None``."""
    if value is None or isinstance(value, bytes):
        return value
    path = pathlib.Path(value)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None


def load_token(path: str | os.PathLike) -> str:
    """The bearer token in ``path`` (surrounding whitespace removed). Raises ``ValueError`` when the file
    cannot be read or holds no token; the message never contains the token."""
    try:
        token = pathlib.Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--auth-token-file {path}: cannot read it ({type(exc).__name__})") from None
    if not token:
        raise ValueError(f"--auth-token-file {path}: the file is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"--auth-token-file {path}: the token must be one line of printable characters without spaces")
    return token


def server_credentials(cert: Pem | None, key: Pem | None, client_ca: Pem | None = None
                       ) -> grpc.ServerCredentials | None:
    """TLS server credentials, or ``None`` for a plaintext server (no cert, no key, no client CA)."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    chain, private_key = read_pem(cert, "--tls-cert"), read_pem(key, "--tls-key")
    ca = read_pem(client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials([(private_key, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers ``code`` without reading the request.

    It is request-streaming whatever ``handler`` is: gRPC Python reads a unary handler's whole request
    message into Python bytes before calling it (a 256 MiB body would be buffered just to be refused);
    a request-streaming handler that never iterates its requests reads none of it."""
    def refuse(_requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    return kinds[(True, handler.response_streaming)](refuse)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health checks unless it carries ``authorization: Bearer <token>``.

    A refusal with UNAUTHENTICATED and its message takes a thread of the server's pool (gRPC Python runs every
    handler there). Those are budgeted: ``REFUSALS_PER_S`` a second (bursts of as many), enough for every
    misconfigured client to read why; past the budget a tokenless call is answered UNIMPLEMENTED by gRPC itself in
    its serve thread, with no pool thread and no handler (issue #35 item 3: about 1,000 outstanding tokenless
    calls, each sent again as soon as it was refused, left token holders 5% of their goodput, pinned; gRPC Python
    gives an interceptor no peer, so the budget is the server's, not a host's)."""

    #: at most one WARNING per this many seconds for refused calls (the next one says how many were not logged)
    WARN_INTERVAL = 10.0
    #: UNAUTHENTICATED refusals answered a second through the pool (a token bucket of as many)
    REFUSALS_PER_S = 50.0

    def __init__(self, token: str):
        if not token:
            raise ValueError("empty bearer token")
        self._expected = f"Bearer {token}".encode()
        self._warn_lock = threading.Lock()
        self._next_warning = 0.0
        self._unlogged = 0
        self.refused = 0
        self.dropped = 0  # tokenless calls past the budget, answered UNIMPLEMENTED by gRPC
        self._tokens, self._filled = self.REFUSALS_PER_S, time.monotonic()

    def _take(self) -> bool:
        """One refusal from the budget (under the warning lock); False when it is spent."""
        now = time.monotonic()
        with self._warn_lock:
            self._tokens = min(self.REFUSALS_PER_S, self._tokens + (now - self._filled) * self.REFUSALS_PER_S)
            self._filled = now
            if self._tokens < 1:
                self.dropped += 1
                return False
            self._tokens -= 1
            return True

    def _warn(self, method: str) -> None:
        """A WARNING for a refused call, rate-limited: a flood of tokenless calls is not a flood of log lines."""
        now = time.monotonic()
        with self._warn_lock:
            self.refused += 1
            if now < self._next_warning:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._next_warning = self._unlogged, 0, now + self.WARN_INTERVAL
        more = f" ({unlogged} more refused since the last such warning)" if unlogged else ""
        log.warning("refused %s: missing or wrong bearer token%s", method, more)

    def _authorized(self, metadata: Any) -> bool:
        presented = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(presented) != 1:
            return False
        value = presented[0]
        value = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        return hmac.compare_digest(value, self._expected)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        if not self._take():  # past the budget: gRPC answers UNIMPLEMENTED in its serve thread, no pool thread
            return None
        self._warn(handler_call_details.method)
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token: send metadata 'authorization: Bearer <token>' "
                        "(AdvantageClient(token=...) or token_file=...)")
