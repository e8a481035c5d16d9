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


#: the transport rows, in table order
TRANSPORTS: list[Transport] = [
    Transport("grpc-unary", "AdvantageClient.compute: one unary ComputeAdvantage call (protobuf messages)",
              _unary_open, _unary_compute),
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
