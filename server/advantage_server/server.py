"""The gRPC layer: a thin servicer over :class:`AdvantageCore`, the request pipeline, and ``create_server``.

Every ``AdvantageService`` call goes through one pipeline (:meth:`AdvantageServicer.handler`):

1. bearer token (:class:`~advantage_server.auth.TokenAuthInterceptor`, when the server has one), on the
   call's metadata only;
2. the :class:`~advantage_server.limits.RequestGate`: UNAVAILABLE while draining, RESOURCE_EXHAUSTED
   beyond ``--max-concurrent-requests`` (when every place is taken, a call of a client within its share of
   calls waiting for their body, ``--max-pending-per-connection`` / ``--max-pending-per-peer``, first takes a
   place back by the fair shares: :meth:`AdvantageServicer._make_room`); a call refused by 1 or 2
   is answered before its request body is read (the handlers are request-streaming, so gRPC hands over no
   bytes until asked);
3. reading the request message (cut after ``--stream-idle-timeout`` if it does not arrive:
   :class:`~advantage_server.limits.UploadWatch`), then decoding it here rather than in gRPC, so that bytes
   that are not a valid message are an INVALID_ARGUMENT like every other malformed request (gRPC would
   answer INTERNAL);
4. the method: ``--max-batch-elements``, a compute slot (one of ``--workers``), then the core, which
   calls :func:`~advantage_server.limits.checkpoint` between its stages so a cancelled or expired call
   stops.

Status codes (the one place errors become gRPC statuses, see :func:`status_for`):
    RegionGone            -> NOT_FOUND (a shared-memory region the server does not hold: evicted or unknown),
                             with a ``google.rpc.ErrorInfo`` detail saying which (``regions.RegionGone``)
    InvalidInput          -> INVALID_ARGUMENT, message names the field and the fix, plus a
                             ``google.rpc.BadRequest`` detail with one field violation per bad field
    ResourceLimit         -> RESOURCE_EXHAUSTED, message names the limit (flag) and its value
    out of memory         -> RESOURCE_EXHAUSTED (device or host allocation failure; the server goes on)
    Draining              -> UNAVAILABLE (shutting down: retry on another replica)
    RequestExpired        -> DEADLINE_EXCEEDED or CANCELLED (the client has already gone)
    anything else         -> INTERNAL (logged with traceback)

Logs carry method, estimator, status, timing and shapes, never tensor contents or credentials.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import threading
import time
from concurrent import futures
from typing import Any, Mapping

import grpc
import torch
from google.protobuf import any_pb2, message_factory
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from advantage_client.proto import advantage_pb2 as pb
from advantage_client.proto import advantage_pb2_grpc as pb_grpc
from advantage_server.auth import Pem, TokenAuthInterceptor, server_credentials
from advantage_server.core import AdvantageCore, list_estimators
from advantage_server.errors import InvalidInput, NotPermitted, ResourceLimit
from advantage_server.regions import RegionGone
from advantage_server.health_service import HEALTH_QUEUE, HealthServicer
from advantage_server.defaults import DEFAULT_STREAM_WINDOW_MB
from advantage_server.limits import (
    DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_MESSAGE_MB, DEFAULT_MAX_STREAM_MB,
    DEFAULT_WORKERS,
    DEFAULT_MAX_SHM_REGIONS_PER_CLIENT, DEFAULT_MIN_UPLOAD_RATE_KIB, DEFAULT_STREAM_IDLE_TIMEOUT,
    DEFAULT_UPLOAD_RATE_WINDOW, LIGHT_BODY_BYTES,
    Limits, MemoryTrimmer, RequestExpired, check_batch_elements, checkpoints, grpc_liveness, is_out_of_memory,
)
from advantage_server.admission import ADMISSION_WAIT_S, Caller, Draining, Overloaded, RequestGate, refusal_metadata
from advantage_server.identity import CallsPerConnection, ListenerGate, ServerSockets, call_peer, connection_key, peer_host
from advantage_server.shares import MAX_WATCHES, UNREAD_TOTAL_BYTES, ConnectionShares, InheritedStalls, ResultLedger
from advantage_server.uploads import EarlyBody, EarlyStream, UploadCut, UploadWatch, early_stream_cap
from advantage_server import identity, transport
from advantage_server.transport import abort, tensor_fields
from advantage_server.metrics import HealthPort, ObservabilityInterceptor, ServerMetrics, estimator_fields
from advantage_server.warmup import KernelCollector, warm

log = logging.getLogger("advantage_server")
_SERVICE = pb.DESCRIPTOR.services_by_name["AdvantageService"]
SERVICE_NAME = _SERVICE.full_name
#: methods that count against ``--max-concurrent-requests``; the others (ListEstimators, (Un)RegisterSharedMemory,
#: and server reflection) share ``LIGHT_CALLS`` places of their own and take bodies of at most ``LIGHT_BODY_BYTES``
LIMITED_METHODS = frozenset({"ComputeAdvantage", "ComputeAdvantageShm"})

# Keepalive: the server pings a silent connection every 60 s and drops it when no answer comes within
# 20 s (a client that vanished, or stopped reading, does not hold its resources for hours); clients may
# ping every 1 s or more, with or without calls open, and are never sent GOAWAY for pinging (the Python
# client pings every 2 s to find a hung replica within ~4 s: advantage_client.channel.KEEPALIVE_OPTIONS).
_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]

#: a connection with no call open for this long gets GOAWAY and is closed (issue #35 item 4: a TCP connection that
#: sent the HTTP/2 preface and nothing else was kept for ever, 13-15 KiB and a descriptor each); a client channel
#: reconnects at its next call, so only an idle trainer pays one reconnection
CONNECTION_IDLE_S = 300
#: every connection is asked to go away (GOAWAY) after this long, its calls in progress given
#: ``CONNECTION_AGE_GRACE_S`` more to end (then cut): no connection, however busy, is held for ever
CONNECTION_AGE_S = 3600
CONNECTION_AGE_GRACE_S = 600
#: seconds without request bytes an upload of its own host must have been stalled before a connection that has not yet
#: had a result delivered (:meth:`ResultLedger.proven`) may cut it for its call (a proven connection, or an upload of
#: another host: ``shares.STALL_S``; :meth:`UploadWatch.evict_for`). 64
#: client processes starting at once on 2 cores had their first calls' bodies stall past STALL_S and cut each
#: other (tests/test_shm_many_processes.py); a slow-loris's calls stall for seconds. 1 s took bench
#: slow-loris-fresh from ~80% to ~66%; 0.5 s keeps the 64 processes uncut, also beside a busy loop
NEWCOMER_CUT_STALL_S = 0.5
#: client connections one server holds open at once, at most (gRPC's ``grpc.max_allowed_incoming_connections``:
#: beyond it a new connection is closed as it arrives, and its client sees UNAVAILABLE and retries; the
#: connections already open are untouched). About 15 KiB each (an idle one, measured): 16,384 hold ~240 MiB. Fewer
#: where the descriptor limit is lower (:func:`max_connections`), so connections never take the descriptors that
#: shared-memory regions, log files and the metrics port need (issue #35 item 4: 2,592 idle connections at a
#: descriptor limit of 2,600 made a token holder's call end DEADLINE_EXCEEDED)
MAX_CONNECTIONS = 16384
#: descriptors kept out of the connections' share: the process's own files and sockets (listeners, the metrics and
#: health ports, logs, libraries); the connections and the shared-memory regions share the rest half and half
RESERVED_DESCRIPTORS = 256


def max_connections(descriptors: int | None) -> int:
    """The connections a server holds open at once, at most: :data:`MAX_CONNECTIONS`, or, where the soft descriptor
    limit ``descriptors`` (after :func:`raise_descriptor_limit`; None: unknown) leaves less, half of what it leaves
    above :data:`RESERVED_DESCRIPTORS`: the shared-memory table takes at most the other half
    (:func:`advantage_server.regions.default_max_regions`); at least 64."""
    if descriptors is None:
        return MAX_CONNECTIONS
    return min(MAX_CONNECTIONS, max(64, (descriptors - RESERVED_DESCRIPTORS) // 2))


def connections_per_host(total: int, flag: int | None = None) -> int:
    """The connections one client host may hold open while others need room: ``--max-connections-per-host``
    (``flag``), by default a quarter of ``total`` (:func:`max_connections`), at least 64; never more than
    ``total``. Behind a proxy or NAT every client is one host (RELIABILITY.md): raise it there."""
    return min(total, flag if flag is not None else max(64, total // 4))


#: how often the reaper counts the process's descriptors (a directory listing, ~1 ms per 2,000) and, when they
#: are enough for a host to be over its share, reads the connections and closes what
#: :meth:`~advantage_server.shares.ConnectionShares.choose` names
REAP_INTERVAL_S = 0.25
#: seconds between two sweeps for ``REAP_FAST_FOR_S`` after a host's gate lapsed
#: (:class:`advantage_server.identity.ListenerGate`): a host that kept reopening while it was gated has connection
#: requests pending, which its kernel sends again on their own timers; a sweep soon after finds it over its share
#: again before they fill the server
REAP_FAST_S = 0.05
REAP_FAST_FOR_S = 1.0


class ConnectionReaper:
    """The thread that holds each host to its share of the open connections (issue #35 item 4; the rules:
    :class:`advantage_server.shares.ConnectionShares`). gRPC tells the service nothing of a connection that makes no
    call, so the connections are read from the process's sockets (:class:`advantage_server.identity.ServerSockets`)
    and an idle one is ended as a vanished client's would be (its client sees the connection close and reconnects
    at its next call). A host found over its share also has its new connections dropped in the kernel for a while
    (``gate``, :class:`advantage_server.identity.ListenerGate`; the rule: :meth:`ConnectionShares.gate`), so that one
    that reopens each connection closed cannot refill the server faster than a sweep closes them. ``closed``:
    connections ended so far. Off where the sockets cannot be read (not Linux, or a unix-socket listener)."""

    def __init__(self, sockets: ServerSockets, shares: ConnectionShares, interval: float = REAP_INTERVAL_S):
        self.sockets, self.shares, self.interval = sockets, shares, interval
        self.gate = ListenerGate(sockets)
        self.closed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged = self._gate_logged = -math.inf

    def start(self) -> None:
        if self.sockets.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="advantage-connection-reaper", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def _run(self) -> None:
        lapsed = -math.inf  # when a gate last lapsed
        while not self._stop.wait(REAP_FAST_S if time.monotonic() - lapsed < REAP_FAST_FOR_S else self.interval):
            try:
                gated = self.gate.hosts
                self.sweep()
                if set(gated) - set(self.gate.hosts):
                    lapsed = time.monotonic()
            except Exception:  # noqa: BLE001 - the reaper must outlive a bad read; the server serves on
                log.exception("connection reaper: a sweep failed")

    def sweep(self) -> int:
        """One look: the connections closed (0 when the descriptors are too few for anyone to be over a share)."""
        if self.sockets.descriptors() <= min(self.shares.per_host, self.shares.high_water):
            if self.gate.hosts:  # a gate lapses when its time is up, or when its host let go of what it held
                found = self.sockets.scan()
                self.gate.set(self.shares.gate(collections.Counter(peer_host(peer) for peer in found.values())))
            return 0
        found = self.sockets.scan()
        by_key = {connection_key(peer): (fd, peer) for fd, peer in found.items()}
        live = {key: peer_host(peer) for key, (_, peer) in by_key.items()}
        # the gate first: a host that reopens what is closed below finds its connection requests dropped
        before = self.gate.hosts
        self.gate.set(self.shares.gate(per_host := collections.Counter(live.values())))
        if set(self.gate.hosts) - set(before) and time.monotonic() - self._gate_logged > 10:
            self._gate_logged = time.monotonic()
            log.warning("dropping new connections from %s for 1-16 s (its clients' connection attempts time out): "
                        "over its share of connections (--max-connections-per-host %d; it holds %d; every 127.0.0.0/8 "
                        "address is one host, an IPv6 host is its /%d)", ", ".join(self.gate.hosts[:4]),
                        self.shares.per_host, per_host[self.gate.hosts[0]], identity.IPV6_HOST_PREFIX)
        n = 0
        for key in self.shares.choose(live):
            fd, peer = by_key[key]
            n += self.sockets.shut(fd, peer)
        self.closed += n
        now = time.monotonic()
        if n and now - self._logged > 10:
            self._logged = now
            log.info("closed %d idle connection(s) of hosts over their share (%d open, %d per host, at most %d in all; "
                     "%d closed so far)", n, len(found) - n, self.shares.per_host, self.shares.total, self.closed)
        return n


def memory_bound(limits: Limits, stream_window_mb: int = DEFAULT_STREAM_WINDOW_MB) -> int:
    """RELIABILITY.md's peak memory bound, in bytes: how far a server with ``limits`` may grow above its idle RSS,
    whatever its callers do. With C = ``max_concurrent_requests``, R = max(message, stream) bytes, M = message
    bytes, W = ``workers``, E = ``max_batch_elements``, F = the stream window:
    ``3 C R + 3 x 8 M + W x 64 B x E + MAX_WATCHES x 17 KiB`` (Watch streams) ``+ 2 C max(F, M + 16 MiB)``
    (waiting calls: a stream window each, or a whole body for one that reads it while it waits:
    :class:`~advantage_server.uploads.EarlyBody`; a stream read early, less than ``EARLY_STREAM_BYTES`` plus the
    message gRPC is receiving for it: :class:`~advantage_server.uploads.EarlyStream`)
    ``+ UNREAD_TOTAL_BYTES`` (results not yet delivered) ``+ MAX_CONNECTIONS x 15 KiB`` (open connections)
    ``+ 100 MiB``. The adversarial benchmark prints each attack's peak RSS growth against it."""
    c, m = limits.max_concurrent_requests, limits.max_message_bytes
    r = max(m, limits.max_stream_bytes)
    return (3 * c * r + 3 * 8 * m + limits.workers * 64 * limits.max_batch_elements + MAX_WATCHES * (17 << 10)
            + 2 * c * max(stream_window_mb << 20, m + early_stream_cap(m)) + UNREAD_TOTAL_BYTES
            + MAX_CONNECTIONS * (15 << 10) + (100 << 20))


def connection_options(descriptors: int | None = None) -> list[tuple[str, int]]:
    """gRPC server options bounding a connection's life (:data:`CONNECTION_IDLE_S`, :data:`CONNECTION_AGE_S`,
    :data:`CONNECTION_AGE_GRACE_S`) and how many are open at once (:func:`max_connections` of the soft descriptor
    limit ``descriptors``); read when a server is created."""
    return [("grpc.max_connection_idle_ms", int(CONNECTION_IDLE_S * 1000)),
            ("grpc.max_connection_age_ms", int(CONNECTION_AGE_S * 1000)),
            ("grpc.max_connection_age_grace_ms", int(CONNECTION_AGE_GRACE_S * 1000)),
            ("grpc.max_allowed_incoming_connections", max_connections(descriptors))]


def raise_descriptor_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit on open descriptors to its hard limit (at most 2^20), so that connections
    run out long after a default soft limit of 1,024 would; (soft, hard) after, or None where it cannot be read.
    Every connection costs one descriptor, and idle ones are closed after :data:`CONNECTION_IDLE_S`."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return None


def flow_control_options(stream_window_mb: int) -> list[tuple[str, int]]:
    """gRPC server options for ``--stream-window-mb``: the HTTP/2 stream window the server announces, fixed.

    A call waiting for a place in the admission room has not asked for its body, so gRPC's core receives at most
    this window of it meanwhile (RELIABILITY.md, "Peak memory bound": the 2 x C x F term). With gRPC's BDP probe
    on (``stream_window_mb=0``) the window grows to twice the measured bandwidth-delay product, at least 4 MiB,
    bounded by no flag: measured up to ~40 MiB per waiting call on loopback. A call being read is not held to the
    window (gRPC announces the rest of the message it reads), so on a LAN an admitted upload runs as fast either
    way; at 50 ms round trip a 40 MiB call took 0.7-0.8 s against 0.3-0.55 s with the probe (BENCHMARKS.md).
    4 MiB is the least window gRPC's own BDP tuning announces; Go and Java gRPC run fixed windows too.
    """
    if stream_window_mb == 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", stream_window_mb << 20)]


#: the drain (BoundServer.stop): refuse calls until none came for DRAIN_QUIET_S (at most DRAIN_QUIET_MAX_S)
#: before gRPC stops taking calls; DRAIN_SETTLE_S for the last statuses to go out before open streams end
DRAIN_QUIET_S, DRAIN_QUIET_MAX_S, DRAIN_SETTLE_S = 0.1, 1.0, 0.1
#: seconds stop() waits, after gRPC cancelled what was left, for those calls' handlers to unwind
STOP_UNWIND_S = 5.0
#: the drain cuts an upload that has received no request bytes once it is this old (then checks again as often):
#: a unary request arrives as one message, so one still arriving counts as silent; a streamed one counts chunks
DRAIN_SILENT_UPLOAD_S = 0.25
MAX_VIOLATIONS = 10  # field violations sent per INVALID_ARGUMENT (the message says how many more)
MAX_TEXT = 2000      # characters of the status message


def status_for(exc: BaseException) -> status_pb2.Status:
    """The ``google.rpc.Status`` a call that raised ``exc`` ends with (see the module docstring)."""
    if isinstance(exc, RegionGone):  # NOT_FOUND with an ErrorInfo: the client registers again and resends
        return exc.status()
    if isinstance(exc, InvalidInput):
        # The status travels in the trailers, which clients cap (8-16 KiB): keep it well under that.
        shown = exc.violations[:MAX_VIOLATIONS]
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f[:200], description=d[:MAX_TEXT // MAX_VIOLATIONS])
            for f, d in shown
        ])
        detail = any_pb2.Any()
        detail.Pack(bad)
        message = "; ".join(f"{f}: {d}" for f, d in shown)
        if len(message) > MAX_TEXT:
            message = message[:MAX_TEXT] + " ..."
        if len(exc.violations) > len(shown):
            message += f"; and {len(exc.violations) - len(shown)} more"
        return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=message, details=[detail])
    for kind, code in ((ResourceLimit, code_pb2.RESOURCE_EXHAUSTED), (Draining, code_pb2.UNAVAILABLE),
                       (NotPermitted, code_pb2.PERMISSION_DENIED),
                       (NotImplementedError, code_pb2.UNIMPLEMENTED)):
        if isinstance(exc, kind):
            return status_pb2.Status(code=code, message=str(exc) or "method not implemented by this server")
    if isinstance(exc, RequestExpired):
        return status_pb2.Status(code=code_pb2.DEADLINE_EXCEEDED if exc.deadline else code_pb2.CANCELLED,
                                 message=str(exc))
    log.error("internal error while serving a call", exc_info=(type(exc), exc, exc.__traceback__))
    return status_pb2.Status(code=code_pb2.INTERNAL, message=f"internal error: {type(exc).__name__}: {exc}")


def ended_cancelled(context: Any) -> bool:
    """Whether ``context``'s call ended cancelled (the client reset it, its connection closed, its deadline passed)
    rather than by its status reaching the client after its response; asked in a termination callback
    (``ServicerContext.add_callback``). gRPC Python keeps this only in the call's private state (grpcio's
    ``_server._RPCState.client``, "cancelled"); False where that is absent. ``tests/test_ledger.py`` fails if the
    installed grpcio stops keeping it. Used for *standing* (:meth:`advantage_server.shares.ResultLedger.release`,
    "has had a result delivered"): a caller that opens a connection, never reads, and closes it ends its call too,
    and was given standing for it (a later connection given the same client port by the kernel would have been
    admitted as a reader; not seen in the bench, 0 of 1,974 first calls)."""
    return getattr(getattr(context, "_state", None), "client", None) == "cancelled"


def _decode(cls: type, data: bytes) -> Any:
    try:
        return cls.FromString(data)
    except DecodeError as err:
        name = cls.DESCRIPTOR.full_name
        raise InvalidInput("request", f"the {len(data)} request bytes are not a valid {name} message ({err}); "
                                      "serialize the request with the advantage.v1 schema") from None


def _summary(method: str, request: Any) -> str:
    """What a log line may say about a call: the estimator and the input shapes, never values."""
    if method != "ComputeAdvantage":
        return method
    shapes = " ".join(f"{k}={list(t.shape)}" for k, t in tensor_fields(request).items())
    return f"{method} {request.WhichOneof('estimator')} {shapes}"


class _Summary:
    """:func:`_summary`, written only when a log line needs it (``%s``): most calls log nothing."""

    __slots__ = ("method", "request")

    def __init__(self, method: str, request: Any):
        self.method, self.request = method, request

    def __str__(self) -> str:
        return _summary(self.method, self.request)


class AdvantageServicer(transport.TransportMethods, pb_grpc.AdvantageServiceServicer):
    """The service methods (on decoded messages) plus the pipeline around them (:meth:`handler`)."""

    def __init__(self, core: AdvantageCore, limits: Limits | None = None):
        self.core = core
        self.limits = limits or Limits()
        self.gate = RequestGate(self.limits.max_concurrent_requests, self.limits.workers)
        self.uploads = UploadWatch(self.limits.stream_idle_timeout, per_peer=self.limits.pending_per_peer,
                                   per_connection=self.limits.pending_per_connection)
        self.uploads.on_lent_exit = self.gate.repay
        #: result bytes computed but not yet delivered, per connection and host (issue #35: the ledger)
        self.results = ResultLedger(send_timeout=self.limits.stream_idle_timeout)
        self.gate.stalled = self._stalled  # the waiting room's order (shares.wait_rank) and who fills to stalled_cap

    def _stalled(self) -> tuple[Mapping[str, int], Mapping[str, int]]:
        """Stalled uploads per host and per connection (:meth:`UploadWatch.stalled`), a connection that has not had a
        result delivered answering for its host (:class:`~advantage_server.shares.InheritedStalls`)."""
        hosts, conns = self.uploads.stalled()
        return hosts, InheritedStalls(conns, hosts, self._has_record, peer_host, self.uploads.recently_stalled())

    def _has_record(self, connection: str) -> bool:
        """Whether ``connection`` is judged by its own stalls rather than its host's: it has had a result delivered
        (:meth:`ResultLedger.proven`), or a request body of it arrived whole while its call waited for a place
        (:meth:`UploadWatch.sent_early`)."""
        return self.results.proven(connection) or self.uploads.sent_early(connection)

    # ------------------------------------------------------------------ methods
    def ComputeAdvantage(self, request, context):
        check_batch_elements(tensor_fields(request), self.limits.max_batch_elements)
        alive = grpc_liveness(context)
        with self.gate.compute_slot(alive), checkpoints(alive):  # the result is encoded by the codec
            # a result one response message cannot carry is refused before computing (--max-message-mb)
            return transport.ResultPayload(*self.core.compute_result(
                request, max_result_bytes=self.limits.max_message_bytes))

    def ListEstimators(self, request, context):
        return list_estimators()

    # ------------------------------------------------------------------ pipeline
    def handler(self, method: Any) -> grpc.RpcMethodHandler:
        """The gRPC handler of one service method: gate, decoding, the method, error mapping, a log line."""
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(self, method.name)
        if method.name in transport.CUSTOM_HANDLERS:  # ComputeAdvantageStream
            return self._with_room(self.custom_handler(method))
        if method.client_streaming or method.server_streaming:  # none today; no gate, gRPC decodes
            kind = {(False, True): grpc.unary_stream_rpc_method_handler,
                    (True, False): grpc.stream_unary_rpc_method_handler,
                    (True, True): grpc.stream_stream_rpc_method_handler}
            return kind[(method.client_streaming, method.server_streaming)](
                behavior, request_deserializer=request_cls.FromString,
                response_serializer=response_cls.SerializeToString)
        limited = method.name in LIMITED_METHODS
        codec_decoded = method.name == "ComputeAdvantage"

        # A request-streaming handler for a unary method: gRPC reads a unary handler's request message into
        # Python bytes before calling it, so a call refused for its token or for admission would cost its
        # whole body first. Here the body is read (next(requests)) only once the call is admitted.
        def handle(requests: Any, context: grpc.ServicerContext):
            started = time.monotonic()
            what, status, pushback = method.name, None, ()
            early = EarlyBody(requests, lambda: self._sent_early(context)) if limited else None
            running = contextlib.ExitStack()
            peer = call_peer(context)  # now: once the call has ended, gRPC names no peer
            try:
                # the caller's unread results first (shares.ResultLedger); counted as running once its body is here
                counting = self._wait_results(context, peer) if limited else contextlib.nullcontext()
                with self.gate.admit(limited, context.add_callback,
                                     (lambda held: self._make_room(context, held)) if limited else None,
                                     self._caller(context, early) if limited else None), \
                        (contextlib.nullcontext() if limited else self.gate.light(method.name)):
                    data = self._receive(early or requests, context, counted=limited)
                    running.enter_context(counting)
                    if not limited and len(data) > LIGHT_BODY_BYTES:  # refused before parsing
                        raise InvalidInput("request", f"the {len(data)}-byte request is larger than {method.name} "
                                                      f"takes ({LIGHT_BODY_BYTES} bytes at most); send only the "
                                                      f"fields of {request_cls.DESCRIPTOR.full_name}")
                    grpc_liveness(context)("before decoding")  # the client may have gone during the upload
                    try:
                        request = transport.decode_request(data) if codec_decoded else _decode(request_cls, data)
                    except InvalidInput:
                        if codec_decoded:
                            transport._label_call("invalid")
                        raise
                    del data
                    if codec_decoded:
                        transport._label_call(request.estimator)
                    what = _Summary(method.name, request)
                    response = behavior(request, context)
                    if isinstance(response, transport.ResultPayload):
                        self._hold_result(context, response.nbytes(), peer)
                    return response
            except Exception as exc:  # noqa: BLE001 - every error gets a deliberate status
                # Keep only the status: a live exception (its traceback, its frames) would hold the
                # request bytes in a reference cycle until the garbage collector happens to run.
                status, pushback = self._status(exc, what), refusal_metadata(exc)
            finally:
                running.close()
                if limited:
                    self.gate.unreserve()  # a reservation the admission did not take (draining)
                    early.drop()  # a body read while the call waited, when it got no place
                if log.isEnabledFor(logging.DEBUG):
                    outcome = "OK" if status is None else code_pb2.Code.Name(status.code)
                    log.debug("%s -> %s in %.1f ms (peer %s)", what, outcome, 1e3 * (time.monotonic() - started),
                              context.peer())
            abort(context, status, pushback)

        return grpc.stream_unary_rpc_method_handler(handle, request_deserializer=None,
                                                    response_serializer=transport.response_serializer(response_cls))

    def _make_room(self, context: grpc.ServicerContext, held: bool = False) -> None:
        """A limited call found every ``--max-concurrent-requests`` place taken (:meth:`RequestGate.admit` calls
        this once, outside its lock): take a place back by the fair shares (:meth:`UploadWatch.evict_for`: the
        most stalled upload of a host, or a connection of the caller's host, holding more calls waiting for their
        body than the caller's) and take over its place at once (:meth:`RequestGate.lend`: the cut call gives it
        back, :meth:`RequestGate.repay`, as its upload block ends); the admission, next in this thread, takes it. Never while draining: the call
        is refused anyway, and the uploads in progress keep their places to finish."""
        # a connection that has not had a result yet (a newcomer, or a slow-loris's fresh connection) cuts only an
        # upload stalled for NEWCOMER_CUT_STALL_S: a prompt client's body slowed by a loaded server is not one
        # ``held``: places are free and this caller is held below stalled_cap (the cut's message says so)
        stall = 0.0 if self.results.proven(call_peer(context)) else NEWCOMER_CUT_STALL_S
        if not self.gate.draining and self.uploads.evict_for(context, min_stall=stall, held=held):
            self.gate.lend()  # the cut call's place, at once: the admission next in this thread takes it

    def _wait_results(self, context: grpc.ServicerContext, peer: str) -> contextlib.AbstractContextManager:
        """Before a limited call takes a place: wait (at most ``ADMISSION_WAIT_S``, never past its deadline) while
        its connection ``peer``, or its host for a connection without standing, holds too many result bytes not yet
        read (:class:`~advantage_server.shares.ResultLedger`); then refuse it with RESOURCE_EXHAUSTED and a retry
        pushback (:class:`~advantage_server.admission.Overloaded`). Let in, the call is counted from its body's
        arrival until its result is held (:meth:`~advantage_server.shares.ResultLedger.running`): enter what this
        returns then (a call whose body never comes is never counted)."""
        host = peer_host(peer)
        if self.results.refusal(peer, host) is not None:
            left = context.time_remaining()
            why = self.results.wait_room(peer, host,
                                         ADMISSION_WAIT_S if left is None else min(ADMISSION_WAIT_S, left))
            if why is not None:
                raise Overloaded(why)
        return self.results.running(peer, host)

    def _hold_result(self, context: grpc.ServicerContext, nbytes: int, peer: str) -> None:
        """Enter a result of ``nbytes`` handed to gRPC for connection ``peer`` in the ledger until its call ends
        (delivered or cancelled)."""
        key = self.results.hold(peer, peer_host(peer), nbytes, context.cancel)
        if not context.add_callback(lambda: self.results.release(key, delivered=not ended_cancelled(context))):
            self.results.release(key, delivered=False)  # the call has already ended, before its result was sent

    @staticmethod
    def _caller(context: grpc.ServicerContext, early: EarlyBody | EarlyStream | None = None) -> Caller:
        """The :class:`~advantage_server.admission.Caller` of ``context``'s call, for the waiting room; ``early``: its
        unary request body, or its request stream, which it may read while it waits."""
        peer = call_peer(context)
        if early is None:
            return Caller(peer, peer_host(peer), context.is_active, context.time_remaining)
        if isinstance(early, EarlyStream):
            return Caller(peer, peer_host(peer), context.is_active, context.time_remaining, early.start,
                          early.reading_for, lambda: early.proven, lambda: early.whole)
        return Caller(peer, peer_host(peer), context.is_active, context.time_remaining, early.start, early.reading_for)

    def _sent_early(self, context: grpc.ServicerContext) -> None:
        """A waiting call's body arrived whole (:class:`EarlyBody`, :class:`EarlyStream`): its connection has a record
        of its own now."""
        peer = call_peer(context)
        self.uploads.mark_sent_early(peer)
        self.gate.poke(peer)

    def _with_room(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` (the streaming transport's, which admits the call itself with :meth:`_make_room`) with the
        reservation it may leave unused given back."""
        stream = handler.stream_stream

        def with_room(request_iterator: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from stream(request_iterator, context)  # its first step is the admission
            finally:
                self.gate.unreserve()  # a reservation the admission did not take (draining, an early error)
        return grpc.stream_stream_rpc_method_handler(with_room, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)

    def _receive(self, requests: Any, context: grpc.ServicerContext, counted: bool = True) -> bytes:
        """The one request message of a unary call (its raw bytes), read after admission; a client whose
        message does not arrive within ``--stream-idle-timeout`` is cut (:class:`UploadWatch`). ``counted``:
        the call holds one of its client's pending places while its message arrives."""
        with self.uploads.watch(context, counted=counted):
            try:
                return next(requests)
            except StopIteration:
                ended = False
            except grpc.RpcError as err:  # the call ended while its request was arriving (cancel, deadline, cut)
                # gRPC keeps this error in the call's state (_RPCState.rpc_errors), and its traceback's frames
                # hold the request iterator, so the state, and the request bytes it had received (a 200 MiB
                # body, say), in a cycle through gRPC's compiled objects that the garbage collector does not
                # free: measured, one such body stayed resident for good. Drop the traceback to break it.
                err.__traceback__ = None
                ended = True
                # and when the body had arrived whole as the call ended, gRPC (1.85) leaves it in the call's state,
                # which stays referenced after the call (one 192-240 MiB body resident for good, 1 time in 4 in
                # tests/test_reliability_faults.py): let the bytes go, whatever keeps the state
                state = getattr(context, "_state", None)
                if state is not None and getattr(state, "request", None) is not None:
                    state.request = None
            # raised here, not in the except blocks, so that the new exception does not keep the RpcError (and
            # its frames) as its __context__
            if not ended:
                raise InvalidInput("request", "the call ended without a request message; send exactly one")
            grpc_liveness(context)("while receiving the request")
            raise RequestExpired("while receiving the request", deadline=False)

    def _status(self, exc: Exception, what: str) -> status_pb2.Status:
        if is_out_of_memory(exc):
            log.warning("out of memory on %s serving %s (%s); answered RESOURCE_EXHAUSTED", self.core.device,
                        what, type(exc).__name__)
            exc.__traceback__ = None  # let the tensors of the failed attempt go before emptying the cache
            if self.core.device.type == "cuda":
                torch.cuda.empty_cache()
            return status_pb2.Status(
                code=code_pb2.RESOURCE_EXHAUSTED,
                message=f"out of memory on the server's {self.core.device.type} device while computing this "
                        f"request ({type(exc).__name__}); send a smaller batch, or run the server with more memory")
        if isinstance(exc, RequestExpired):
            log.debug("stopped %s: %s", what, exc)
        return status_for(exc)

    def register(self, server: grpc.Server) -> None:
        handlers = {m.name: self.handler(m) for m in _SERVICE.methods}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GatedReflection(reflection.ReflectionServicer):
    """Server reflection whose streams hold one of the gate's ``LIGHT_CALLS`` places (refused at once with
    RESOURCE_EXHAUSTED when they are all taken) and are cut, like uploads, when no request message arrives
    for ``--stream-idle-timeout`` seconds: a silent reflection stream does not hold a thread for ever."""

    def __init__(self, service_names: Any, gate: RequestGate, uploads: UploadWatch):
        super().__init__(service_names)
        self._gate, self._uploads = gate, uploads

    def ServerReflectionInfo(self, request_iterator, context):  # noqa: N802
        try:
            with self._gate.light("ServerReflectionInfo"), self._uploads.watch(context, counted=False) as touch:
                for request in request_iterator:
                    touch()
                    yield from super().ServerReflectionInfo(iter((request,)), context)
                    touch()  # the idle clock runs while the stream waits for the client's next request
        except UploadCut:  # already ended with RESOURCE_EXHAUSTED by the watch
            return
        except ResourceLimit as exc:  # no light place: an admission refusal, with its retry pushback
            context.set_trailing_metadata(refusal_metadata(exc))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except grpc.RpcError:  # the client went away, or the server is stopping
            return


class BoundServer:
    """A created (not yet started) server: ``grpc_server``, the bound ``port``, its ``health`` servicer and
    request ``gate``."""

    def __init__(self, grpc_server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 core: AdvantageCore, address: str, gate: RequestGate | None = None, *, tls: bool = False,
                 auth: bool = False, limits: Limits | None = None):
        self.grpc_server = grpc_server
        self.port = port
        self.health = health_servicer
        self.core = core
        self.address = address
        self.gate = gate or RequestGate(1 << 30, 1 << 30)
        self.tls = tls
        self.auth = auth
        self.limits = limits or Limits()
        self.memory = MemoryTrimmer()
        self.metrics: ServerMetrics | None = None  # its collectors; served when endpoints include it
        self.endpoints: list[Any] = []  # side endpoints (metrics HTTP, --health-port): started/stopped with it
        self.uploads: UploadWatch | None = None  # the servicer's stalled-upload watch (stopped with the server)
        self.results: ResultLedger | None = None  # the servicer's ledger of unread results (closed with the server)
        self.health_reads: Any = None  # health_service._RequestReads: the health pool (closed with the server)
        self.connections: ConnectionReaper | None = None  # holds each host to its share of the connections
        #: tokenless calls held before their refusal (auth.AnonymousRefusals; answered when the drain begins)
        self.refusals: Any = None
        #: compile every kernel signature in start(), health NOT_SERVING meanwhile (create_server's warmup)
        self.warmup = False
        self.warmup_report: Any = None  # advantage_server.warmup.WarmupReport once warmed
        #: set (a signal handler may) to end the warm-up at its next call: start() then returns without SERVING
        self.stop_warmup = threading.Event()

    def start(self) -> "BoundServer":
        self.grpc_server.start()
        self.memory.start()
        if self.connections is not None:
            self.connections.start()
        for endpoint in self.endpoints:
            endpoint.start()
        if self.warmup:  # health is NOT_SERVING (set in create_server) until every kernel is compiled or loaded
            log.info("warming up on %s: loading the CPU kernels from numba's cache, or compiling them; health says "
                     "NOT_SERVING until done (0.5-0.9 s with a filled cache, 20-40 s with an empty one on 2 cores; "
                     "--no-warmup skips it)", self.address)
            self.warmup_report = warm(self.core, self.stop_warmup)
            if self.warmup_report.stopped:  # SIGTERM during the warm-up: stay NOT_SERVING, the caller stops us
                log.info("warm-up stopped after %d calls (%.1f s): the server is shutting down",
                         self.warmup_report.calls, self.warmup_report.seconds)
                return self
            log.info("%s", self.warmup_report.line())
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = 5.0) -> None:
        """Graceful drain, in this order:

        1. health reports NOT_SERVING (watchers, load balancers and probes see it first), and the service refuses
           new calls with UNAVAILABLE (retryable on another replica) while gRPC still takes them, until no call
           has come for ``DRAIN_QUIET_S`` (at most ``DRAIN_QUIET_MAX_S``, and within ``grace``): a client that
           watches health drops this replica, and the calls already on their way are answered;
        2. gRPC stops taking calls (GOAWAY: clients connect elsewhere) and every admitted call keeps running. A
           call that reached gRPC but not yet the service at that moment is ended by gRPC with CANCELLED
           without having run (its server drops the calls it has queued when it shuts down); step 1 keeps that
           to clients that went on sending through it, and the client's retry policy
           (``advantage_client.channel.RETRY_POLICY``) sends such a call again;
        3. wait until the last admitted call finished (at most what is left of ``grace``), cutting with UNAVAILABLE
           the calls whose request has not begun to arrive after ``DRAIN_SILENT_UPLOAD_S`` (:meth:`_wait_idle`);
        4. after ``DRAIN_SETTLE_S`` (the last refusals' statuses go out), end what is left (open health
           watches, reflection streams, calls still running when ``grace`` ran out) and return.

        ``grace`` 0 or None (gRPC's ``Server.stop`` meaning): no drain, every call is cancelled at once.
        """
        if grace is None:
            grace = 0.0
        end = time.monotonic() + grace

        def left(cap: float = math.inf) -> float:
            return min(cap, max(0.0, end - time.monotonic()))
        self.health.enter_graceful_shutdown()
        self.gate.start_draining()
        if self.refusals is not None:  # held tokenless calls are answered now, not at the end of the grace
            self.refusals.close()
        in_flight = self.gate.in_flight  # counted when the drain begins: a short call may end during step 1
        if in_flight:
            log.info("draining: waiting for %d call(s) in progress", in_flight)
        self.gate.wait_quiet(DRAIN_QUIET_S, left(DRAIN_QUIET_MAX_S))
        done = self.grpc_server.stop(left())
        if not self._wait_idle(left):
            log.warning("grace period of %.1fs over with %d call(s) still running; cancelling them", grace,
                        self.gate.in_flight)
        done.wait(left(DRAIN_SETTLE_S))
        self.grpc_server.stop(0)
        done.wait()
        # the handlers of cancelled calls unwind at their next checkpoint: let them, so that none is still running
        # (and submitting kernel work) when the interpreter shuts down after this returns (with --grace 0 one
        # logged "internal error ... cannot schedule new futures after shutdown" in ~1/3 of stops: the
        # interpreter's exit woke the kernel pool's idle workers, which mark their pool shut down)
        if not self.gate.wait_idle(STOP_UNWIND_S):
            log.warning("%d cancelled call(s) still running %.0f s after the stop", self.gate.in_flight, STOP_UNWIND_S)
        self.memory.stop()
        if self.connections is not None:
            self.connections.stop()
        if self.uploads is not None:
            self.uploads.stop()
        if self.results is not None:
            self.results.close()
        for endpoint in self.endpoints:
            endpoint.stop()
        if self.health_reads is not None:  # the health pool and its reaper thread
            self.health_reads.close()

    def _wait_idle(self, left: Any) -> bool:
        """The drain's wait for the admitted calls (``left()``: seconds of grace left), cutting every
        ``DRAIN_SILENT_UPLOAD_S`` seconds the uploads that have received nothing and began at least that long ago
        (:meth:`UploadWatch.cut_silent`: UNAVAILABLE, the client retries elsewhere), so that a call whose request
        never comes does not hold the drain for the whole grace. True when no call is left."""
        while True:
            if self.uploads is not None:
                self.uploads.cut_silent(DRAIN_SILENT_UPLOAD_S)
            if self.gate.wait_idle(left(DRAIN_SILENT_UPLOAD_S)):
                return True
            if left() <= 0:
                return False

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()

    def __enter__(self) -> "BoundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=1.0)


def _deterministic(device: torch.device) -> None:
    """Bitwise-reproducible results on a GPU: deterministic kernels (``index_add_`` without atomics)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def create_server(host: str = "127.0.0.1", port: int = 50051, device: str = "auto", *,
                  max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, max_stream_mb: int = DEFAULT_MAX_STREAM_MB,
                  workers: int = DEFAULT_WORKERS,
                  max_batch_elements: int = DEFAULT_MAX_BATCH_ELEMENTS,
                  max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
                  tls_cert: Pem | None = None, tls_key: Pem | None = None, tls_client_ca: Pem | None = None,
                  auth_token: str | None = None, metrics_port: int | None = None,
                  metrics_host: str = "127.0.0.1", health_port: int | None = None,
                  stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
                  min_upload_rate_kib: int = DEFAULT_MIN_UPLOAD_RATE_KIB,
                  upload_rate_window: float = DEFAULT_UPLOAD_RATE_WINDOW,
                  max_shm_regions_per_client: int = DEFAULT_MAX_SHM_REGIONS_PER_CLIENT,
                  max_pending_per_peer: int | None = None,
                  max_pending_per_connection: int | None = None, max_connections_per_host: int | None = None,
                  stream_window_mb: int = DEFAULT_STREAM_WINDOW_MB,
                  warmup: bool = False) -> BoundServer:
    """Build an advantage server bound to ``host:port`` (``port=0``: an ephemeral port).

    Serves ``advantage.v1.AdvantageService``, ``grpc.health.v1.Health`` and server reflection.
    Binding a port that is already in use raises ``RuntimeError`` (SO_REUSEPORT is off, so two
    servers never silently share a port); a bad limit or unreadable TLS file raises ``ValueError``.

    Limits: ``max_message_mb`` caps request and response size, ``max_stream_mb`` a streamed request, ``max_batch_elements`` the elements of
    any one input tensor, ``max_concurrent_requests`` the ComputeAdvantage calls in progress, ``workers``
    those computing at once, ``stream_idle_timeout`` the seconds an admitted call's upload may go without
    receiving bytes (then it is cut), ``min_upload_rate_kib`` the KiB/s a streamed upload must average over
    each ``upload_rate_window`` seconds (0: no minimum), ``max_shm_regions_per_client`` the shared-memory
    regions one client connection may hold registered, ``max_pending_per_peer`` / ``max_pending_per_connection``
    the shares of the places for calls waiting for their request body (None: a quarter of
    ``max_concurrent_requests``, at least 1): when the server is full, a caller whose host (connection) holds
    fewer pending calls than that takes a place back from a host (a connection of its host) holding more, max-min
    fair (:mod:`advantage_server.shares`; RELIABILITY.md, "The admission model"); ``max_connections_per_host`` the
    connections one client host may hold while others need room (None: :func:`connections_per_host`; past it, or
    near the server's limit for the host holding the most, connections without a call for 2 s are closed:
    :class:`ConnectionReaper`); a call that gets no place is
    refused with RESOURCE_EXHAUSTED and ``grpc-retry-pushback-ms``; ``stream_window_mb`` the HTTP/2 stream window
    announced, fixed (0: gRPC's BDP tuning; :func:`flow_control_options`). Health means alive: NOT_SERVING while warming
    up and draining, SERVING otherwise, full or not; health ``Watch`` streams beyond their bounds in total and per
    client host are answered UNIMPLEMENTED (``HealthServicer``: the client then treats the server as healthy).
    Security: ``tls_cert`` + ``tls_key`` (PEM bytes or paths) serve TLS;
    ``tls_client_ca`` adds mutual TLS (client certificates required); ``auth_token`` requires
    ``authorization: Bearer <token>`` on every call but health checks.

    Operations (:mod:`advantage_server.metrics`): every call gets a request id (``x-request-id``, echoed
    in trailing metadata) and is counted in ``BoundServer.metrics``; ``metrics_port`` serves them over
    HTTP (Prometheus) on ``metrics_host`` (loopback by default: it has neither TLS nor a token),
    ``health_port`` serves the health service in plaintext on ``host`` (for kubelet gRPC probes)
    (0 = any free port; the ports are ``.metrics.port`` and ``.endpoints``).

    ``warmup``: :meth:`BoundServer.start` loads from numba's cache (or compiles) every CPU kernel signature
    a request can need before health reports SERVING (NOT_SERVING meanwhile; :mod:`advantage_server.warmup`:
    0.5-0.9 s with a filled cache and its signature list, ~24 s of CPU with an empty cache), and logs how long
    it took.
    Off by default here (tests build many servers in one process); ``advantage-server`` and the Ray replicas
    warm unless ``--no-warmup``.
    """
    if not 0 <= stream_window_mb <= 1024:
        raise ValueError(f"stream_window_mb={stream_window_mb}: give 0 (gRPC's BDP tuning) to 1024 MiB")
    limits = Limits(max_message_mb=max_message_mb, max_stream_mb=max_stream_mb, max_batch_elements=max_batch_elements,
                    max_concurrent_requests=max_concurrent_requests, workers=workers,
                    stream_idle_timeout=stream_idle_timeout, min_upload_rate_kib=min_upload_rate_kib,
                    upload_rate_window=upload_rate_window, max_shm_regions_per_client=max_shm_regions_per_client,
                    max_pending_per_peer=max_pending_per_peer, max_pending_per_connection=max_pending_per_connection,
                    max_connections_per_host=max_connections_per_host)
    credentials = server_credentials(tls_cert, tls_key, tls_client_ca)
    core = AdvantageCore(device, max_batch_elements=limits.max_batch_elements)
    _deterministic(core.device)
    metrics = ServerMetrics(core.device)
    observer = ObservabilityInterceptor(SERVICE_NAME, estimator_fields(_SERVICE), metrics)
    descriptors = raise_descriptor_limit()
    total_connections = max_connections(descriptors[0] if descriptors else None)
    connections = ConnectionShares(total_connections,
                                   connections_per_host(total_connections, limits.max_connections_per_host))
    if limits.max_connections_per_host is not None and limits.max_connections_per_host > total_connections:
        log.warning("--max-connections-per-host %d is more than the server holds open in all (%d, from its "
                    "descriptor limit %s): one host may hold all %d", limits.max_connections_per_host,
                    total_connections, descriptors[0] if descriptors else "unknown", total_connections)
    auth = TokenAuthInterceptor(auth_token) if auth_token else None
    pool = futures.ThreadPoolExecutor(max_workers=limits.thread_pool_size, thread_name_prefix="advantage")
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        # calls of any kind one client connection may have open at once (health Watch streams included)
        ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
        *_KEEPALIVE_OPTIONS,
        *connection_options(descriptors[0] if descriptors else None),
        *flow_control_options(stream_window_mb),
    ]
    servicer = AdvantageServicer(core, limits)
    calls = CallsPerConnection(connections.call_started, connections.call_ended)
    server = grpc.server(pool, interceptors=[calls, observer, *([auth] if auth else [])], options=options,
                         maximum_concurrent_rpcs=limits.grpc_max_concurrent_rpcs)
    servicer.register(server)
    health_servicer = HealthServicer(experimental_non_blocking=True)  # grpc_health's, minus its shutdown deadlock
    # its own pool; a request that does not arrive is not waited for, and queued health calls keep under half of
    # gRPC's backstop (which counts them), so a flood of silent ones cannot make gRPC refuse the service's calls
    health_reads = health_servicer.register(server, queue_limit=min(HEALTH_QUEUE, limits.grpc_max_concurrent_rpcs // 2))
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(GatedReflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        servicer.gate, servicer.uploads), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {address}: {exc} (is another server using the port?)") from None
    if bound == 0:
        raise RuntimeError(f"cannot bind {address}: the port is in use or the address is invalid")
    actual = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    result = BoundServer(server, bound, health_servicer, core, actual, servicer.gate, tls=credentials is not None,
                         auth=bool(auth_token), limits=limits)
    result.metrics = metrics
    result.refusals = auth.refusals if auth else None
    result.uploads = servicer.uploads
    result.results = servicer.results
    result.connections = ConnectionReaper(ServerSockets(0 if host.startswith("unix") else bound), connections)
    result.warmup = warmup
    metrics.registry.register(KernelCollector())  # advantage_kernel_signatures: grows if a call compiles
    try:
        if health_port is not None:
            result.endpoints.append(HealthPort(health_servicer, host, health_port))
        if metrics_port is not None:
            metrics.serve(metrics_host, metrics_port)
            result.endpoints.append(metrics)
    except RuntimeError:
        for endpoint in result.endpoints:
            endpoint.stop()
        server.stop(None)
        raise
    result.health_reads = health_reads  # the health calls' request reads and queue (health_service._RequestReads)
    return result
