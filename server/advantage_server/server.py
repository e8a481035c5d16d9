"""The gRPC layer: a thin servicer over :class:`AdvantageCore`, the error mapping, and ``create_server``.

Status codes (the one place domain errors become gRPC statuses, see :func:`_abort_for`):
    InvalidInput   -> INVALID_ARGUMENT, message names the field and the fix, plus a
                      ``google.rpc.BadRequest`` detail with one field violation per bad field
    ResourceLimit  -> RESOURCE_EXHAUSTED
    anything else  -> INTERNAL (logged with traceback)
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_server.core import AdvantageCore, list_estimators
from advantage_server.errors import InvalidInput, ResourceLimit

log = logging.getLogger("advantage_server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdvantageService"].full_name


def _abort_for(context: grpc.ServicerContext, exc: BaseException) -> None:
    """Map a domain error to its status and abort the call."""
    if isinstance(exc, InvalidInput):
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in exc.violations
        ])
        detail = any_pb2.Any()
        detail.Pack(bad)
        status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(exc), details=[detail])
        context.abort_with_status(rpc_status.to_status(status))
    if isinstance(exc, ResourceLimit):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    log.exception("internal error while computing advantages")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class AdvantageServicer(pb_grpc.AdvantageServiceServicer):
    """Decodes nothing itself: hands the message to the core and maps its errors."""

    def __init__(self, core: AdvantageCore):
        self.core = core

    def ComputeAdvantage(self, request, context):
        try:
            return self.core.compute(request)
        except Exception as exc:  # noqa: BLE001 - every error gets a deliberate status
            _abort_for(context, exc)

    def ListEstimators(self, request, context):
        return list_estimators()


class BoundServer:
    """A created (not yet started) server: ``grpc_server``, the bound ``port``, and its ``health`` servicer."""

    def __init__(self, grpc_server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 core: AdvantageCore, address: str):
        self.grpc_server = grpc_server
        self.port = port
        self.health = health_servicer
        self.core = core
        self.address = address

    def start(self) -> "BoundServer":
        self.grpc_server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, stop accepting calls, let in-flight calls finish within ``grace`` seconds."""
        self.health.enter_graceful_shutdown()
        self.grpc_server.stop(grace).wait()

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()

    def __enter__(self) -> "BoundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=1.0)


def create_server(host: str = "127.0.0.1", port: int = 50051, device: str = "auto", *,
                  max_message_mb: int = 1024, workers: int = 8) -> BoundServer:
    """Build an advantage server bound to ``host:port`` (``port=0``: an ephemeral port).

    Serves ``advantage.v1.AdvantageService``, ``grpc.health.v1.Health`` and server reflection.
    Binding a port that is already in use raises ``RuntimeError`` (SO_REUSEPORT is off, so two
    servers never silently share a port). ``max_message_mb`` caps request and response size.
    """
    core = AdvantageCore(device)
    limit = max_message_mb * 1024 * 1024
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="advantage"),
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    pb_grpc.add_AdvantageServiceServicer_to_server(AdvantageServicer(core), server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {address}: {exc} (is another server using the port?)") from None
    if bound == 0:
        raise RuntimeError(f"cannot bind {address}: the port is in use or the address is invalid")
    actual = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    return BoundServer(server, bound, health_servicer, core, actual)
