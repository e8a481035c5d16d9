"""The client's errors: :class:`AdvantageServiceError` for every failed call, :class:`InvalidArgumentError`
(also a ``ValueError``) for INVALID_ARGUMENT. Importable from ``advantage_client`` (and, as before, from
``advantage_client.client``); defined here so that every transport module raises the same classes without
importing the client.
"""
from __future__ import annotations

from typing import Any

import grpc
from grpc_status import rpc_status

try:
    from google.rpc import error_details_pb2
except ImportError:  # pragma: no cover
    error_details_pb2 = None


class AdvantageServiceError(Exception):
    """A call to the service failed.

    code:             the ``grpc.StatusCode`` (INVALID_ARGUMENT for bad input, UNAVAILABLE when no server
                      answers, DEADLINE_EXCEEDED after ``timeout``, ...).
    field_violations: ``[(field, description), ...]`` from the ``google.rpc.BadRequest`` detail, if any.
    pushback_s:       seconds the server asked the client to wait before sending the call again (its trailing
                      metadata ``grpc-retry-pushback-ms``, gRPC's retry pushback: an admission refusal of a full
                      server); None when it sent none, or a value that is not a whole number >= 0 (gRPC's
                      meaning: do not retry).
    ``str(error)`` is the server's message.

    An error whose code is INVALID_ARGUMENT is created as :class:`InvalidArgumentError`, which is also a
    ``ValueError`` (``AdvantageServiceError(grpc.StatusCode.INVALID_ARGUMENT, ...)`` gives one too), so a
    trainer's ``except ValueError`` catches bad input sent to the service as it catches it from an
    in-process estimator (NeMo RL's and verl's raise ``ValueError``). Every other code stays a plain
    ``AdvantageServiceError``, not a ``ValueError``.
    """

    def __new__(cls, code: Any = None, *args: Any, **kwargs: Any) -> "AdvantageServiceError":
        if cls is AdvantageServiceError and code == grpc.StatusCode.INVALID_ARGUMENT:
            cls = InvalidArgumentError
        return super().__new__(cls, code, *args, **kwargs)

    def __init__(self, code: grpc.StatusCode, message: str, field_violations: list[tuple[str, str]] | None = None,
                 pushback_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.field_violations = field_violations or []
        self.pushback_s = pushback_s

    def __reduce__(self) -> tuple:
        # pickled (e.g. raised in a Ray worker) with its code, violations and pushback, unpickled as the same type
        return AdvantageServiceError, (self.code, str(self), self.field_violations, self.pushback_s)

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, target: str | None = None,
                       timeout: float | None = None, channel: Any = None) -> "AdvantageServiceError":
        """The ``grpc.RpcError`` of a failed call -> :class:`AdvantageServiceError` with its code, message and
        ``BadRequest`` field violations: an :class:`InvalidArgumentError` (also a ``ValueError``) for
        INVALID_ARGUMENT, a plain ``AdvantageServiceError`` for every other code. ``target`` and ``timeout``
        (the client's): UNAVAILABLE and DEADLINE_EXCEEDED messages say what to check (:func:`hint`).
        ``channel`` (the call's, sync or ``grpc.aio``): for DEADLINE_EXCEEDED, whether it is connected tells a
        slow call from one that no server ever answered (``wait_for_ready=True`` waits for a server until the
        deadline; a target that drops packets does too): :func:`connected`."""
        violations = []
        try:
            status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
        except ValueError:  # a status detail that disagrees with the call's code (e.g. cut by a proxy)
            status = None
        if status is not None and error_details_pb2 is not None:
            for detail in status.details:
                bad = error_details_pb2.BadRequest()
                if detail.Unpack(bad):
                    violations += [(v.field, v.description) for v in bad.field_violations]
        code = err.code()
        reached = connected(channel) if code == grpc.StatusCode.DEADLINE_EXCEEDED and channel is not None else None
        return AdvantageServiceError(code, hint(code, err.details() or "", target, timeout, reached), violations,
                                     pushback_s(err))


def connected(channel: Any) -> bool | None:
    """Whether ``channel`` is connected to a server now, from its connectivity state read without waiting and
    without asking it to connect: True when READY, False in TRANSIENT_FAILURE (its connection attempts
    fail), None otherwise (IDLE, CONNECTING, SHUTDOWN) or when the state cannot be read. A ``grpc.aio``
    channel's ``get_state``; a sync ``grpc.Channel`` has no public read without a polling thread
    (``subscribe``/``channel_ready_future``: that thread raises "Channel closed!" when the client is closed
    right after, as on the way out of a ``with`` block), so its core channel's state is read, and any change
    there in gRPC gives None: the DEADLINE_EXCEEDED hint of a slow call."""
    try:
        if hasattr(channel, "get_state"):  # grpc.aio.Channel
            state = channel.get_state(try_to_connect=False)
        else:
            from grpc import _common  # the sync channel's state: gRPC's own table of its core's values
            state = _common.CYGRPC_CONNECTIVITY_STATE_TO_CHANNEL_CONNECTIVITY[
                channel._channel.check_connectivity_state(False)]
    except Exception:  # noqa: BLE001 - a channel of another kind (a test's fake), another gRPC: no claim
        return None
    if state == grpc.ChannelConnectivity.READY:
        return True
    return False if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE else None


#: gRPC's trailing-metadata key for retry pushback (gRFC A6): milliseconds to wait before retrying
PUSHBACK_KEY = "grpc-retry-pushback-ms"


def pushback_s(err: Any) -> float | None:
    """The retry pushback of a failed call's ``grpc.RpcError`` (sync or ``grpc.aio``) in seconds: its trailing
    metadata ``grpc-retry-pushback-ms`` as a whole number of milliseconds >= 0; None when absent or not such a
    number (gRFC A6: a malformed pushback means do not retry)."""
    try:
        trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - a call object without metadata
        return None
    for key, value in trailing or ():
        if key == PUSHBACK_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            return int(text) / 1000.0 if text.isdigit() else None
    return None


class InvalidArgumentError(AdvantageServiceError, ValueError):
    """INVALID_ARGUMENT from the service (bad input or config: see ``field_violations``): an
    :class:`AdvantageServiceError` and a ``ValueError`` at once, whichever transport (unary, stream, shared
    memory) carried the call. ``code`` is always ``grpc.StatusCode.INVALID_ARGUMENT``."""


#: gRPC's words for "the target's host name resolves to no address" (c-ares: "Domain name not found"; the
#: system resolver: "Name or service not known", "nodename nor servname")
_NO_SUCH_NAME = ("domain name not found", "name or service not known", "nodename nor servname",
                 "no address associated with hostname")
#: gRPC's words for "nothing listens there / no such host" (then what to do leads the message)
_NOBODY_THERE = ("connection refused", "failed to connect", "resolv", "lookup", "no route to host",
                 "network is unreachable", "connection timed out")


def hint(code: grpc.StatusCode, message: str, target: str | None, timeout: float | None,
         reached: bool | None = None) -> str:
    """``message`` plus what to do, for the errors a newcomer meets first: UNAVAILABLE (when nothing listens at
    the target: what to do first, then gRPC's own text, which names the resolved address, e.g.
    ``ipv6:%5B::1%5D:50999``, not the target; a failed TLS handshake or a dropped connection: gRPC's text
    first, then the hint) and DEADLINE_EXCEEDED (``reached``: whether the client's channel connects to a
    server, :func:`connected`; False: no server answered at the target within the deadline, what to check
    first; otherwise the call was slower than its timeout)."""
    if code == grpc.StatusCode.UNAVAILABLE and target and "shutting down" not in message:
        low = message.lower()
        if "handshake" in low or "ssl" in low:  # something answered, but not in this client's TLS (or plaintext)
            return (f"{message} (the TLS handshake with {target} failed: a client with tls=True or tls_ca against "
                    "a plaintext server fails so, as does a certificate the client does not trust or whose name "
                    "is not the target's; match the client's TLS options to the server's --tls-cert, or pass "
                    "tls_server_name)")
        if "failed to parse" in low:  # "localhost:abc", "host:50051/": not a target at all
            return (f"the target {target!r} is not a host:port address ({message}); give it as host:port, e.g. "
                    "'localhost:50051', or a gRPC target such as 'dns:///advantage.svc:50051'")
        # a TCP peer answered (so not 'nobody there') but not in plaintext gRPC
        if "socket closed" in low or "http/2" in low or "settings frame" in low:
            return (f"{message} (something at {target} closed the connection or does not speak plaintext gRPC: a "
                    "server started with --tls-cert needs tls_ca=... (or tls=True) in the client; otherwise check "
                    "that the port is advantage-server's gRPC port, not its metrics or another service's)")
        if "connection timed out" in low:  # nothing answered the connection request (a dropped SYN)
            return (f"no advantage service answered at {target}: the connection attempt timed out, nothing answered "
                    "it. A firewall or a host that is down drops it so; so does an advantage-server that refuses new "
                    "connections from this client's address for a while, because that address holds more than its "
                    "share of connections (--max-connections-per-host: its log says 'dropping new connections from "
                    "...'; the gate lasts 1-16 s): retry later, or check that the server is running and reachable "
                    f"from here (gRPC: {message})")
        if any(k in low for k in _NO_SUCH_NAME):  # the host name resolves to no address: nothing to start there
            host = target.rpartition(":")[0] or target
            return (f"the host name in {target!r} resolves to no address ({host!r}: DNS found no such name): check "
                    "its spelling, or give an IP address or a name this machine resolves (e.g. 'localhost:50051'; "
                    f"in Kubernetes, the Service's DNS name from inside the cluster) (gRPC: {message})")
        if any(k in low for k in _NOBODY_THERE):
            # our hint first: gRPC's own text begins with its internal status ("... last error: UNKNOWN: ipv4:...")
            return (f"no advantage service answered at {target}: start advantage-server there, or check the "
                    f"address and port and that the server is running and reachable (gRPC: {message})")
        if "unhealthy" in low:  # health checking: the server answers but reports NOT_SERVING
            # our hint first (a newcomer's first call during the warm-up read gRPC's jargon before it)
            return (f"the advantage service at {target} is up but reports NOT_SERVING: it is warming up after its "
                    "start (its log says so; 20-40 s on 2 cores with an empty kernel cache, about 2 s with a filled "
                    "one) or draining (a full server stays SERVING and refuses with RESOURCE_EXHAUSTED instead): "
                    f"wait, or pass wait_for_ready=True to the client to wait for it (gRPC: {message})")
        return (f"{message} (the advantage service at {target} went away or cannot be reached: check that "
                "advantage-server is running there and reachable)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None and reached is False and target:
        return (f"no advantage service answered at {target} within the call's timeout={timeout:g} seconds (the "
                "client never connected; with wait_for_ready=True a call waits for a server until its deadline "
                "instead of failing at once): start advantage-server there, or check the address and port and "
                "that the server is running and reachable from here; pass a larger timeout= to wait longer for a "
                f"server that is starting (gRPC: {message})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        return (f"{message} (the call took longer than its timeout={timeout:g} seconds: pass a larger "
                "timeout= to the client, or to compute() for this call alone, or timeout=None for no deadline)")
    return message
