"""End-to-end transports: one row of the benchmark's ``e2e`` section each.

A transport is a way for a trainer to get a batch's advantages from a running server. Every row times
the whole trip as the trainer sees it: request encode, transfer, compute, response transfer and
decode into torch tensors. To add one (a client-streaming RPC, shared memory, ...), append a
:class:`Transport` to :data:`TRANSPORTS` (or call :func:`register` from your module and import it in
:func:`load_plugins`' list); ``advantage-bench --transports NAME,...`` selects rows by name.

``open(address)`` gets the address of the benchmark's server (a separate process on loopback) and
returns a session; ``compute(session, estimator, config, tensors)`` returns an object with
``advantages`` and ``returns`` tensors; ``close(session)`` ends it. ``skip_reason()`` returns None when
the transport can run here, else why it cannot (the row then says so instead of a time).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Transport:
    name: str
    description: str
    open: Callable[[str], Any]
    compute: Callable[[Any, str, dict, dict[str, torch.Tensor]], Any]
    close: Callable[[Any], None] = field(default=lambda session: session.close())
    skip_reason: Callable[[], str | None] = field(default=lambda: None)


def _unary_open(address: str) -> Any:
    from advantage_client import AdvantageClient
    client = AdvantageClient(address, timeout=600.0, max_message_mb=2047)
    client.wait_ready(30.0)
    return client


def _unary_compute(client: Any, estimator: str, config: dict, tensors: dict[str, torch.Tensor]) -> Any:
    return client.compute(estimator, config, **tensors)


def _stub_open(address: str) -> Any:
    import grpc
    from advantage_client.proto import advantage_pb2_grpc as pb_grpc
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1),
                                                      ("grpc.max_send_message_length", -1)])
    channel.stub = pb_grpc.AdvantageServiceStub(channel)
    return channel


def _stub_compute(channel: Any, estimator: str, config: dict, tensors: dict[str, torch.Tensor]) -> Any:
    from advantage_client.client import build_request, decode_result
    return decode_result(channel.stub.ComputeAdvantage(build_request(estimator, config, **tensors), timeout=600))


def _client_compute(transport: str) -> Callable[..., Any]:
    def compute(client: Any, estimator: str, config: dict, tensors: dict[str, torch.Tensor]) -> Any:
        return client.compute(estimator, config, transport=transport, **tensors)
    return compute


def _shm_inplace_open(address: str) -> Any:
    client = _unary_open(address)
    client.bench_region, client.bench_inputs = None, None
    return client


def _shm_inplace_compute(client: Any, estimator: str, config: dict, tensors: dict[str, torch.Tensor]) -> Any:
    """The trainer keeps its rollout tensors in the registered region (placed there once, outside the
    timing) and reads the results in place: nothing but names and offsets crosses the socket."""
    key = tuple((k, id(v)) for k, v in tensors.items())
    if client.bench_inputs is None or client.bench_inputs[0] != key:
        if client.bench_region is not None:
            client.bench_region.close()
        need = sum(v.numel() * v.element_size() + 64 for v in tensors.values())
        region = client.bench_region = client.shared_memory(need + 2 * 8 * max(v.numel() for v in tensors.values())
                                                            + (1 << 20))
        placed = {}
        for k, v in tensors.items():
            placed[k] = region.empty(tuple(v.shape), v.dtype)
            placed[k].copy_(v)
        client.bench_inputs = (key, placed)
    return client.bench_region.compute(estimator, config, copy=False, **client.bench_inputs[1])


def _shm_inplace_close(client: Any) -> None:
    client.bench_inputs = None
    if client.bench_region is not None:
        client.bench_region.close()
    client.close()


#: the transport rows, in table order
TRANSPORTS: list[Transport] = [
    Transport("grpc-auto", "AdvantageClient.compute, transport auto (shm on this host; else unary, stream >= 16 MiB)",
              _unary_open, _unary_compute),
    Transport("grpc-pb-stub", "plain generated stub: protobuf messages built and parsed client-side",
              _stub_open, _stub_compute),
    Transport("grpc-codec", "transport='unary': one ComputeAdvantage call, tensor codec both ends",
              _unary_open, _client_compute("unary")),
    Transport("grpc-stream", "transport='stream': ComputeAdvantageStream, 4 MiB chunks built lazily each way",
              _unary_open, _client_compute("stream")),
    Transport("grpc-shm", "transport='shm': inputs copied into a registered shared-memory region, results copied out",
              _unary_open, _client_compute("shm")),
    Transport("grpc-shm-inplace", "shared memory, rollout tensors kept in the region, results read in place",
              _shm_inplace_open, _shm_inplace_compute, _shm_inplace_close),
]


def register(transport: Transport) -> None:
    """Add a transport row, or replace the one of the same name."""
    for i, t in enumerate(TRANSPORTS):
        if t.name == transport.name:
            TRANSPORTS[i] = transport
            return
    TRANSPORTS.append(transport)


def load_plugins() -> None:
    """Import the modules named in ``$ADVANTAGE_BENCH_TRANSPORTS`` (comma-separated); each registers
    its transports with :func:`register` on import."""
    for name in filter(None, (m.strip() for m in os.environ.get("ADVANTAGE_BENCH_TRANSPORTS", "").split(","))):
        importlib.import_module(name)


def select(names: str | None) -> list[Transport]:
    if not names:
        return list(TRANSPORTS)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {t.name: t for t in TRANSPORTS}
    missing = [n for n in wanted if n not in known]
    if missing:
        raise SystemExit(f"unknown transport(s) {missing}; known: {sorted(known)}")
    return [known[n] for n in wanted]
