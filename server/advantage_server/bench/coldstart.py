"""The benchmark's ``cold-start`` section: how long a fresh ``advantage-server`` takes to report SERVING, and
each estimator's first call after that, with an empty numba cache, with the cache it filled, and (for
comparison) with an empty cache and ``--no-warmup`` (the first calls then compile).

Each case is a new server process on free loopback ports; SERVING is polled with grpc.health.v1 every 20 ms;
a first call is one ``AdvantageClient.compute`` of the inputs its default config needs (B=64, T=72, float32, its
default config, see :func:`advantage_server.warmup.batch`), timed at the client.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

#: (label, server flags, cache: "empty" = a new directory, "filled" = the one the previous case filled)
CASES = (("empty cache", (), "empty"), ("filled cache", (), "filled"),
         ("empty cache, --no-warmup", ("--no-warmup",), "empty"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(address: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"advantage-server exited with {proc.returncode} before SERVING")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise RuntimeError(f"advantage-server not SERVING after {timeout:.0f} s")


def measure(flags: tuple[str, ...], cache_dir: str, estimators: list[str]) -> dict[str, Any]:
    """One fresh server: ``{"serving_s", "warmup", "first_ms": {estimator: ms}}``."""
    from advantage_client import AdvantageClient
    from advantage_server.estimators import REGISTRY
    from advantage_server.warmup import batch

    port = _free_port()
    log = tempfile.TemporaryFile()
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "advantage_server.cli", "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", *flags], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            env={**os.environ, "NUMBA_CACHE_DIR": cache_dir})
    try:
        _wait_serving(f"127.0.0.1:{port}", proc)
        serving_s = time.perf_counter() - started
        first: dict[str, float] = {}
        rng = np.random.default_rng(0)
        with AdvantageClient(f"127.0.0.1:{port}") as client:
            for name in estimators:
                spec = REGISTRY[name]
                needed = [s for s in spec.inputs if s.needed(spec.config().resolved())]
                tensors = {k: v.numpy() for k, v in batch(spec, np.float32, rng).items()
                           if any(s.matches(k) for s in needed)}
                t0 = time.perf_counter()
                client.compute(name, None, **tensors)
                first[name] = 1e3 * (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log.seek(0)
    warm = next((line.split("warmed ", 1)[1] for line in log.read().decode(errors="replace").splitlines()
                 if "warmed " in line and "kernel signatures" in line), "")
    return {"serving_s": serving_s, "warmup": f"warmed {warm}" if warm else "no warm-up", "first_ms": first}


def cold_start_section(report: Any, row: Callable[..., Any], estimators: list[str] | None = None) -> None:
    """Add the section's rows to ``report`` (``row`` is the benchmark's ``Row``): per case one ``(server)``
    row (ms = spawn to SERVING, note = the warm-up log line) and one row per estimator (ms = its first call)."""
    from advantage_server.estimators import REGISTRY

    names = estimators or [n for n in REGISTRY if not n.startswith("_")]
    with tempfile.TemporaryDirectory(prefix="advantage-bench-numba-") as root:
        filled = os.path.join(root, "filled")
        for label, flags, cache in CASES:
            cache_dir = filled if cache == "filled" else tempfile.mkdtemp(dir=root)
            if cache == "empty" and not flags:
                filled = cache_dir  # the next "filled cache" case reuses what this one compiled
            result = measure(flags, cache_dir, names)
            report.add(row("cold-start", "(server)", "-", label, ms=1e3 * result["serving_s"],
                           note=f"spawn to SERVING; {result['warmup']}"))
            for name, ms in result["first_ms"].items():
                report.add(row("cold-start", name, "64x72", label, ms=ms, note="first call after SERVING"))
