"""Operator endpoints: Prometheus metrics, request ids, and a plaintext health port for kubelet probes.

:class:`ObservabilityInterceptor` (the outermost interceptor of every server, see ``create_server``)
wraps each unary ``advantage.v1.AdvantageService`` call:

* request id: the caller's ``x-request-id`` metadata (at most 128 printable characters), or a new
  random one, echoed back in the call's trailing metadata (also on errors) and attached to every log
  record written while the call is served (:mod:`advantage_server.logs`);
* metrics, recorded in a per-server :class:`ServerMetrics` registry and served over HTTP on
  ``--metrics-port`` (``GET /metrics``, Prometheus text format):

  ====================================================  ===========  ===============================
  name                                                  type         labels
  ====================================================  ===========  ===============================
  ``advantage_requests_total``                          counter      method, estimator, code
  ``advantage_request_duration_seconds``                histogram    method, estimator
  ``advantage_request_size_bytes``                      histogram    method, estimator
  ``advantage_response_size_bytes``                     histogram    method, estimator (OK calls)
  ``advantage_requests_in_flight``                      gauge        method
  ``advantage_device_memory_bytes``                     gauge        device, kind
  ``process_*``, ``python_*``                           (prometheus-client's process/GC/platform)
  ====================================================  ===========  ===============================

  ``code`` is the gRPC status name (``OK``, ``INVALID_ARGUMENT``, ...); ``estimator`` the request's
  estimator field (``grpo``, ``gae``, ...), ``none`` when the request names none (or for
  ``ListEstimators``), ``invalid`` when its bytes are not a protobuf message. Sizes are the serialized
  message bytes; the duration runs from the request bytes to the serialized response. Device memory:
  ``kind="allocated"`` and ``"reserved"`` (PyTorch's caching allocator) on a CUDA device; on the CPU
  ``kind="resident"``, the server's own resident memory (heap, tensors, libraries: ``RssAnon + RssFile`` of
  ``/proc/self/status``), and ``kind="shared_memory"``, the touched pages of the shared memory it has mapped
  (``RssShmem``: the clients' registered regions, which the clients own and free; counted apart so that a
  client's large region does not read as the server's memory growing).

:class:`HealthPort` serves only ``grpc.health.v1.Health``, in plaintext, on a second port (``--health-port``),
sharing the main server's health states (NOT_SERVING while draining): the kubelet's native gRPC probes
speak neither TLS nor bearer tokens, so they cannot check a TLS main port.
"""
from __future__ import annotations

import itertools
import re
import threading
import time
import uuid
from concurrent import futures
from typing import Any, Callable, Iterable

import grpc
import torch
from prometheus_client import (
    CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector, ProcessCollector, start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from advantage_server import logs

REQUEST_ID_KEY = "x-request-id"
_REQUEST_ID_OK = re.compile(r"[\x21-\x7e]{1,128}")
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = tuple(float(256 * 4 ** i) for i in range(13))  # 256 B .. 4 GiB


class DeviceMemoryCollector:
    """``advantage_device_memory_bytes{device, kind}``, read at scrape time."""

    def __init__(self, device: torch.device):
        self.device = device

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("advantage_device_memory_bytes",
                                   "Memory in use on the server's compute device: allocated and reserved by "
                                   "PyTorch's CUDA caching allocator; on the CPU the process's resident set "
                                   "without shared memory (resident) and the clients' shared-memory regions it "
                                   "has mapped and touched (shared_memory)",
                                   labels=["device", "kind"])
        name = str(self.device)
        if self.device.type == "cuda":
            if torch.cuda.is_initialized():
                family.add_metric([name, "allocated"], float(torch.cuda.memory_allocated(self.device)))
                family.add_metric([name, "reserved"], float(torch.cuda.memory_reserved(self.device)))
        else:
            for kind, value in resident_memory().items():
                family.add_metric([name, kind], float(value))
        yield family


def resident_memory() -> dict[str, int]:
    """``{"resident": bytes, "shared_memory": bytes}`` of this process (see the module docstring): the
    resident set without shared memory, and the resident shared memory (``/proc/self/status`` ``RssAnon +
    RssFile`` and ``RssShmem``, Linux 4.5+); ``{"resident": VmRSS}`` where the split is missing; ``{}``
    without /proc."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"VmRSS", b"RssAnon", b"RssFile", b"RssShmem"):
                    fields[key.decode()] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return {}
    if {"RssAnon", "RssFile", "RssShmem"} <= fields.keys():
        return {"resident": fields["RssAnon"] + fields["RssFile"], "shared_memory": fields["RssShmem"]}
    return {"resident": fields["VmRSS"]} if "VmRSS" in fields else {}


class ServerMetrics:
    """The Prometheus collectors of one server (their own registry, so several servers can share a
    process), and the HTTP endpoint that serves them (:meth:`serve`)."""

    def __init__(self, device: torch.device):
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.requests = Counter("advantage_requests", "Calls finished, by method, estimator and gRPC status code",
                                ["method", "estimator", "code"], registry=self.registry)
        self.duration = Histogram("advantage_request_duration_seconds",
                                  "Time from the request bytes to the serialized response",
                                  ["method", "estimator"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_bytes = Histogram("advantage_request_size_bytes", "Serialized request size",
                                       ["method", "estimator"], buckets=SIZE_BUCKETS, registry=self.registry)
        self.response_bytes = Histogram("advantage_response_size_bytes", "Serialized response size of OK calls",
                                        ["method", "estimator"], buckets=SIZE_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("advantage_requests_in_flight", "Calls being served now", ["method"],
                               registry=self.registry)
        self.registry.register(DeviceMemoryCollector(device))
        self._http: Any = None
        self.port: int | None = None

    def serve(self, host: str, port: int) -> int:
        """Serve ``GET /metrics`` on ``host:port`` (0 = any free port) in a daemon thread; returns the port.
        A port in use raises ``RuntimeError``."""
        try:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RuntimeError(f"cannot bind the metrics port {host}:{port}: {exc}") from None
        self.port = int(self._http.server_port)
        return self.port

    def start(self) -> None:  # serving started in serve(); part of the side-endpoint protocol
        pass

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


#: HTTP/2 streams one connection to the health port may have open at once (``grpc.max_concurrent_streams``)
HEALTH_STREAMS_PER_CONNECTION = 100
#: the largest message the health port receives (``grpc.max_receive_message_length``): a health request is a service
#: name. gRPC opens a call's window for the whole message a pending read waits for, up to this limit, and health
#: calls need no token: with the main port's ``--max-message-mb`` a tokenless caller made the server take in 200 MiB
#: per health call (+769 MiB for four); beyond this the call ends RESOURCE_EXHAUSTED before its body is kept
HEALTH_MAX_MESSAGE_BYTES = 64 << 10


class HealthPort:
    """A plaintext gRPC server with only the health service (``health_servicer``, shared with the main
    server) on ``host:port``. Bound at construction (a port in use raises ``RuntimeError``)."""

    def __init__(self, health_servicer: Any, host: str, port: int):
        # health calls only: Check is answered at once, a Watch holds no thread (and is capped by the servicer)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health-port"),
                                   options=[("grpc.so_reuseport", 0),
                                            ("grpc.max_concurrent_streams", HEALTH_STREAMS_PER_CONNECTION),
                                            ("grpc.max_receive_message_length", HEALTH_MAX_MESSAGE_BYTES)])
        # its own pool; a request that does not arrive is not waited for
        self._reads = health_servicer.register(self._server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind the health port {address}: {exc}") from None
        if self.port == 0:
            raise RuntimeError(f"cannot bind the health port {address}: the port is in use or the address is invalid")

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0).wait()
        self._reads.close()


# ------------------------------------------------------------------------------------------ interceptor
def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def oneof_field_number(data: bytes, numbers: frozenset[int]) -> int | None:
    """Which of the field ``numbers`` (one oneof) the serialized message ``data`` sets, by walking its
    top-level fields (skipping every value, so a request of any size costs a few tag reads). The last
    one wins, as when protobuf parses it. Raises ``ValueError`` when ``data`` is not a message."""
    view, pos, found = memoryview(data), 0, None
    try:
        while pos < len(view):
            key, pos = _varint(view, pos)
            number, wire_type = key >> 3, key & 7
            if number in numbers:
                found = number
            if wire_type == 0:
                _, pos = _varint(view, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 2:
                length, pos = _varint(view, pos)
                pos += length
            elif wire_type == 5:
                pos += 4
            else:
                raise ValueError(f"unsupported wire type {wire_type}")
    except IndexError:
        raise ValueError("truncated message") from None
    if pos != len(view):
        raise ValueError("truncated message")
    return found


def request_id_of(metadata: Any) -> str:
    """The caller's ``x-request-id`` when it is 1-128 printable ASCII characters, else a new random id."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            value = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            if _REQUEST_ID_OK.fullmatch(value):
                return value
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


#: new request ids: a random per-process prefix and a counter (32 hex digits, as a uuid4's; 4 us less per call)
_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def _child(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, kept on the metric by label values: ``labels()`` validates and locks on every
    call (~2 us each, five per call), and a child never changes once made."""
    cache = getattr(metric, "_advantage_children", None)
    if cache is None:
        cache = metric._advantage_children = {}
    child = cache.get(values)
    if child is None:
        child = cache[values] = metric.labels(*values)
    return child


def _failed(context: grpc.ServicerContext, echo: tuple) -> str:
    """A call's behaviour raised (an abort, or a bug): its status code name for the metrics, and the request
    id kept in the trailing metadata next to what the abort set there."""
    status = context.code()
    trailing = tuple(context.trailing_metadata() or ())
    if not any(k == REQUEST_ID_KEY for k, _ in trailing):
        context.set_trailing_metadata(trailing + echo)
    if status not in (None, grpc.StatusCode.OK):
        return status.name
    return _gone(context) or "UNKNOWN"


def _gone(context: grpc.ServicerContext) -> str | None:
    """DEADLINE_EXCEEDED / CANCELLED when the client is no longer there (its deadline passed or it
    cancelled), else None."""
    try:
        if context.is_active():
            return None
        remaining = context.time_remaining()
    except Exception:  # noqa: BLE001 - a context without these (tests' fakes)
        return None
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


class ObservabilityInterceptor(grpc.ServerInterceptor):
    """Request ids, log context and metrics for the unary methods and the client-and-server streaming
    method (``ComputeAdvantageStream``) of ``service`` (see the module docstring).

    ``estimators``: the service's request messages by method name, each with its estimator oneof as
    ``{field number: field name}`` (empty for a method without one). The interceptor never reads a request
    body (it runs before authentication and admission, which must cost nothing for a refused call): each
    method sets ``logs.CALL.get()["estimator"]`` once it has decoded its request, and the metrics take the
    label from there, so a call refused before its body was read counts as ``estimator="none"``. Calls of
    other services (health, reflection) pass through.
    """

    def __init__(self, service: str, estimators: dict[str, dict[int, str]], metrics: ServerMetrics):
        self.prefix = f"/{service}/"
        self.estimators = estimators
        self.metrics = metrics

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or not full.startswith(self.prefix):
            return handler
        method = full[len(self.prefix):]
        request_id = request_id_of(handler_call_details.invocation_metadata)
        if getattr(handler.stream_stream, "experimental_non_blocking", False):  # a refusal (auth.AnonymousRefusals)
            return grpc.stream_stream_rpc_method_handler(self._observed_refusal(method, request_id, handler))
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._observed_stream(method, request_id, handler), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:  # the service's unary methods (see AdvantageServicer.handler)
            return grpc.stream_unary_rpc_method_handler(
                self._observed(method, request_id, handler), request_deserializer=handler.request_deserializer,
                response_serializer=None)
        if handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._observed(method, request_id, handler), request_deserializer=None, response_serializer=None)

    def _observed(self, method: str, request_id: str, handler: grpc.RpcMethodHandler) -> Callable:
        """Wraps a unary-response handler. The request body is never looked at here (it may not even have
        been read: a call refused for its token or for admission is answered without reading it); the
        handler labels the estimator once it has decoded the request (``logs.CALL``), and the request size
        is counted as its bytes are read."""
        streaming = handler.stream_unary is not None
        behavior = handler.stream_unary if streaming else handler.unary_unary
        deserialize = None if streaming else handler.request_deserializer
        serialize = handler.response_serializer
        m = self.metrics

        def observed(data: Any, context: grpc.ServicerContext) -> bytes:
            started = time.perf_counter()
            echo = ((REQUEST_ID_KEY, request_id),)
            context.set_trailing_metadata(echo)
            call = {"request_id": request_id, "method": method, "estimator": "none"}
            token = logs.CALL.set(call)
            in_flight = _child(m.in_flight, method)
            in_flight.inc()
            size = [len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0]

            def counted(requests: Any) -> Any:
                for item in requests:
                    size[0] += len(item) if isinstance(item, (bytes, bytearray, memoryview)) else 0
                    yield item

            code = "OK"
            try:
                argument = counted(data) if streaming else (deserialize(data) if deserialize else data)
                response = behavior(argument, context)
                out = serialize(response) if serialize else response
                if context.code() not in (None, grpc.StatusCode.OK):
                    code = context.code().name
                else:
                    _child(m.response_bytes, method, call["estimator"]).observe(len(out))
                return out
            except BaseException:
                code = _failed(context, echo)
                raise
            finally:
                in_flight.dec()
                logs.CALL.reset(token)
                estimator = call["estimator"]
                _child(m.requests, method, estimator, code).inc()
                _child(m.duration, method, estimator).observe(time.perf_counter() - started)
                _child(m.request_bytes, method, estimator).observe(size[0])

        return observed

    def _observed_refusal(self, method: str, request_id: str, handler: grpc.RpcMethodHandler) -> Callable:
        """Wraps a non-blocking refusal (``auth.TokenAuthInterceptor``'s: its status may be sent later, from
        another thread, and no thread waits for it): counted with the code it set (estimator "none", no request
        bytes, duration 0: the time it is held is the server's choice, not the call's work), the request id
        echoed; still non-blocking."""
        behavior = handler.stream_stream
        m = self.metrics

        def observed(request_iterator: Any, context: grpc.ServicerContext, send: Callable[[Any], None]) -> None:
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
            once = threading.Lock()

            def count() -> None:  # once per call, before its status can reach the client (a client that reads
                if once.acquire(blocking=False):  # the metrics right after its refusal finds it counted)
                    code = context.code()
                    name = code.name if code not in (None, grpc.StatusCode.OK) else "OK"
                    _child(m.requests, method, "none", name).inc()
                    _child(m.duration, method, "none").observe(0.0)
                    _child(m.request_bytes, method, "none").observe(0)

            def counted_send(response: Any) -> None:  # at once, or later from the releasing thread
                count()
                send(response)
            try:
                behavior(request_iterator, context, counted_send)
            finally:
                count()  # a held refusal is counted when it is held
        observed.experimental_non_blocking = True  # type: ignore[attr-defined]
        return observed

    def _observed_stream(self, method: str, request_id: str, handler: grpc.RpcMethodHandler) -> Callable:
        """The streaming twin of :meth:`_observed`: request bytes are the serialized chunks as they arrive,
        response bytes the chunks sent; the estimator label comes from the handler once it has decoded."""
        behavior = handler.stream_stream
        m = self.metrics

        def nbytes(item: Any) -> int:
            data = item[-1] if isinstance(item, tuple) else item
            try:
                return memoryview(data).nbytes
            except TypeError:
                return 0

        def observed(request_iterator: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            echo = ((REQUEST_ID_KEY, request_id),)
            context.set_trailing_metadata(echo)
            call = {"request_id": request_id, "method": method, "estimator": "none"}
            sent = [0, 0]  # request bytes, response bytes

            def counted() -> Any:
                for item in request_iterator:
                    sent[0] += nbytes(item)
                    yield item

            in_flight = _child(m.in_flight, method)
            in_flight.inc()
            code = "OK"
            token = logs.CALL.set(call)
            try:
                for out in behavior(counted(), context):
                    sent[1] += nbytes(out)
                    yield out
                if context.code() not in (None, grpc.StatusCode.OK):
                    code = context.code().name
                else:
                    code = _gone(context) or "OK"  # the handler stops quietly when the client has gone
            except BaseException:
                code = _failed(context, echo)
                raise
            finally:
                in_flight.dec()
                try:
                    logs.CALL.reset(token)
                except ValueError:  # resumed in another context: nothing of ours to restore there
                    pass
                estimator = call["estimator"]
                _child(m.requests, method, estimator, code).inc()
                _child(m.duration, method, estimator).observe(time.perf_counter() - started)
                _child(m.request_bytes, method, estimator).observe(sent[0])
                if code == "OK":
                    _child(m.response_bytes, method, estimator).observe(sent[1])

        return observed


def estimator_fields(service_descriptor: Any) -> dict[str, dict[int, str]]:
    """``{method: {field number: name}}`` of the ``estimator`` oneof of each method's request message."""
    out: dict[str, dict[int, str]] = {}
    for method in service_descriptor.methods:
        oneof = method.input_type.oneofs_by_name.get("estimator")
        out[method.name] = {f.number: f.name for f in oneof.fields} if oneof is not None else {}
    return out

