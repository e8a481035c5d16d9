"""``advantage-server``: run the advantage service.

    advantage-server --port 50051 --device auto

Logs its device and address at start. On SIGTERM or SIGINT it reports NOT_SERVING, stops accepting
calls, lets in-flight calls finish within ``--grace`` seconds and exits 0. Exits 2 when the port
cannot be bound (for example, already in use) or the device does not exist.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from advantage_server.server import create_server

log = logging.getLogger("advantage_server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="advantage-server", description="gRPC service computing RL advantages.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0; [::] for IPv6)")
    p.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 = pick a free one)")
    p.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda or cuda:N (default auto)")
    p.add_argument("--max-message-mb", type=int, default=1024, help="largest request/response in MiB (default 1024)")
    p.add_argument("--workers", type=int, default=8, help="concurrent request threads (default 8)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on shutdown (default 10)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = create_server(args.host, args.port, args.device,
                               max_message_mb=args.max_message_mb, workers=args.workers)
    except (RuntimeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    server.start()
    log.info("advantage-server listening on %s (device %s, %d workers)", server.address, server.core.device, args.workers)
    print(f"advantage-server listening on {server.address} device={server.core.device}", flush=True)
    while not stop.wait(0.5):
        pass
    log.info("shutting down: finishing in-flight calls (grace %.1fs)", args.grace)
    server.stop(args.grace)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def healthcheck_main(argv: list[str] | None = None) -> int:
    """``advantage-healthcheck [--address HOST:PORT]``: exit 0 if the server reports SERVING, else 1.

    Uses the standard ``grpc.health.v1.Health/Check`` (for a container HEALTHCHECK or a probe script).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    p = argparse.ArgumentParser(prog="advantage-healthcheck", description=healthcheck_main.__doc__.splitlines()[0])
    p.add_argument("--address", default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    p.add_argument("--service", default="", help="service name to check (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = p.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"unhealthy: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
