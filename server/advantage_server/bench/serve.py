"""The benchmark's server: ``python -m advantage_server.bench.serve`` starts an advantage server on an
ephemeral loopback port, prints ``{"address": ..., "pid": ...}`` as one JSON line, and serves until
its standard input closes (the benchmark holds the pipe; when the benchmark dies, the server stops)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m advantage_server.bench.serve")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-message-mb", type=int, default=2047)
    ap.add_argument("--max-batch-elements", type=int, default=None, help="default: the server's")
    ap.add_argument("--max-stream-mb", type=int, default=None, help="default: the server's")
    ap.add_argument("--max-concurrent-requests", type=int, default=None, help="default: the server's")
    ap.add_argument("--metrics", action="store_true", help="serve Prometheus metrics on a free loopback port "
                    "(printed as metrics_port): the groups section reads the bytes per call from them")
    args = ap.parse_args(argv)
    from advantage_server import create_server
    limits = {k: v for k, v in (("max_batch_elements", args.max_batch_elements),
                                ("max_stream_mb", args.max_stream_mb),
                                ("max_concurrent_requests", args.max_concurrent_requests)) if v is not None}
    if args.metrics:
        limits["metrics_port"] = 0
    server = create_server("127.0.0.1", 0, device=args.device, max_message_mb=args.max_message_mb, **limits).start()
    info = {"address": server.address, "pid": os.getpid()}
    if args.metrics:
        info["metrics_port"] = server.metrics.port
    print(json.dumps(info), flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop(grace=1.0)


if __name__ == "__main__":
    main()
