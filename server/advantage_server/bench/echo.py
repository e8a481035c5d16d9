"""A raw grpcio echo server: the transport floor the ``groups`` section compares the service with.

``python -m advantage_server.bench.echo`` serves one unary method, ``/bench.Echo/Echo``, on an ephemeral
loopback port with ``--threads`` handler threads (the groups section passes the advantage server's
thread pool size) and no interceptors, serializers or
work: the request is raw bytes whose first 8 (little-endian) give the length of the answer, which is a
prebuilt ``bytes`` object of that length. It prints ``{"address": ..., "pid": ...}`` as one JSON line and
serves until its standard input closes.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from concurrent import futures

import grpc

METHOD = "/bench.Echo/Echo"


def request_bytes(request_len: int, response_len: int) -> bytes:
    """An echo request of ``request_len`` bytes (at least 8) asking for ``response_len`` bytes back."""
    return struct.pack("<Q", response_len) + bytes(max(0, request_len - 8))


def main(argv: list[str] | None = None) -> None:
    import argparse
    from advantage_server.limits import Limits
    ap = argparse.ArgumentParser(prog="python -m advantage_server.bench.echo")
    ap.add_argument("--threads", type=int, default=Limits().thread_pool_size)
    args = ap.parse_args(argv)
    answers: dict[int, bytes] = {}

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        n = struct.unpack_from("<Q", request)[0]
        out = answers.get(n)
        if out is None:
            out = answers[n] = bytes(n)
        return out

    serve_until_stdin_closes(
        grpc.method_handlers_generic_handler("bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),
        args.threads)


def serve_until_stdin_closes(handler: grpc.GenericRpcHandler, threads: int) -> None:
    """A bare grpcio server (no interceptors, no message size limits) with ``handler`` on an ephemeral loopback
    port: prints ``{"address": ..., "pid": ...}`` as one JSON line and serves until standard input closes
    (the benchmark holding the pipe ends, or dies). The bench's helper servers are started this way."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads),
                         options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", -1),
                                  ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"address": f"127.0.0.1:{port}", "pid": os.getpid()}), flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop(grace=1.0)


if __name__ == "__main__":
    main()
