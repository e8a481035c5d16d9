"""The ``groups`` section of ``advantage-bench``: per-group traffic, as asynchronous trainers send it.

One GRPO group (NeMo RL semantics): ``prompt_ids``, ``rewards`` ``[16]`` and a float32 ``mask`` ``[16, T]``,
sent by 1, 4, 16 and 64 concurrent callers that share one client (threads for the sync client, tasks in one
event loop for the asyncio one). Side by side in one run:

* the estimator in-process (``AdvantageCore.prepare`` + the estimator, validation included, dense output),
  called from as many threads;
* the service over unary, stream and shared memory with the sync client, and over unary and stream with
  :class:`~advantage_client.AsyncAdvantageClient`, each with per-sample results and compact masks on (the
  clients' default, ``compact=True``) and off (``compact=False``: float mask in, dense ``[B, T]`` out);
* the asyncio client with client-side coalescing (``coalesce_ms = 1``, compact on; issue #12): the callers'
  concurrent calls go as fewer, larger requests; its rows count logical calls (one awaited ``compute`` of
  one group), as every other row does, and bytes per logical call;
* a raw grpcio echo server (``advantage_server.bench.echo``, its own process, no interceptors) moving the
  dense call's bytes each way, the dense request with a ``[B]`` response, and the compact call's bytes.

The advantage server runs in its own process (``advantage_server.bench.serve``) with
``--max-concurrent-requests`` raised to the largest caller count (the default, 32, would refuse the 33rd
concurrent call), and the echo server with as many handler threads as that server's pool.

Each row prints the p50 and p99 latency of single calls, calls/s over the run, and the bytes each way per call
(the server's ``advantage_request_size_bytes`` / ``advantage_response_size_bytes``, i.e. the serialized
messages; for the echo, the message sizes it was asked to move). ``x echo`` divides the row's p50 by the p50
of the echo moving the same bytes (dense rows and in-process: the dense echo; compact rows: the compact echo)
at the same number of callers, and its calls/s by the echo's.
"""
from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, Awaitable, Callable

import torch

from advantage_server.bench import echo as echo_mod
from advantage_server.bench import workloads

GROUP = 16
from advantage_server.bench.options import (  # noqa: E402,F401 - re-exported (the flags' help names them)
    DEFAULT_CALLERS, DEFAULT_TOKENS, QUICK_CALLERS, QUICK_TOKENS,
)


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"bad list {text!r}: write integers separated by commas, e.g. 1,4,16") from None
    if not out or min(out) < 1:
        raise SystemExit(f"bad list {text!r}: every number must be at least 1")
    return out


class Measured:
    def __init__(self, latencies: list[float], wall: float):
        lat = sorted(latencies)
        self.n = len(lat)
        self.p50_ms = statistics.median(lat) * 1e3
        self.p99_ms = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))] * 1e3
        self.calls_s = len(lat) / wall


def _per_caller(single_s: float, callers: int, seconds: float) -> int:
    """Calls per caller so that a run lasts about ``seconds`` (at least 3 each, and 100 in all when that fits)."""
    total = max(100, int(seconds / max(single_s, 1e-5)))
    return max(3, min(5000, total // callers))


def run_threads(call: Callable[[], Any], callers: int, seconds: float) -> Measured:
    for _ in range(3):
        call()
    t0 = time.perf_counter()
    for _ in range(5):
        call()
    n = _per_caller((time.perf_counter() - t0) / 5, callers, seconds)
    barrier = threading.Barrier(callers + 1)
    lats: list[list[float]] = [[] for _ in range(callers)]
    errors: list[BaseException] = []

    def worker(out: list[float]) -> None:
        barrier.wait()
        try:
            for _ in range(n):
                s = time.perf_counter()
                call()
                out.append(time.perf_counter() - s)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(lats[i],), daemon=True) for i in range(callers)]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return Measured([x for lst in lats for x in lst], wall)


async def run_tasks(call: Callable[[], Awaitable[Any]], callers: int, seconds: float) -> Measured:
    for _ in range(3):
        await call()
    t0 = time.perf_counter()
    for _ in range(5):
        await call()
    n = _per_caller((time.perf_counter() - t0) / 5, callers, seconds)
    lats: list[float] = []

    async def worker() -> None:
        for _ in range(n):
            s = time.perf_counter()
            await call()
            lats.append(time.perf_counter() - s)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(callers)))
    return Measured(lats, time.perf_counter() - t0)


class Process:
    """A helper server in its own process that prints one JSON line and serves until stdin closes."""

    def __init__(self, module: str, *options: str):
        self.proc = subprocess.Popen([sys.executable, "-m", module, *options], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{module} did not start")
        self.info = json.loads(line)
        self.address = self.info["address"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except Exception:  # pragma: no cover
            self.proc.kill()


_SAMPLE = re.compile(r'^(advantage_(?:request|response)_size_bytes)_(sum|count)\{([^}]*)\}\s+(\S+)$')


def wire_bytes(metrics_port: int) -> dict[str, float]:
    """Totals of the server's request / response size histograms over the ComputeAdvantage* methods."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out = {"request_sum": 0.0, "request_count": 0.0, "response_sum": 0.0, "response_count": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and "ComputeAdvantage" in m.group(3):
            kind = "request" if "request" in m.group(1) else "response"
            out[f"{kind}_{m.group(2)}"] += float(m.group(4))
    return out


def per_call(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float | None]:
    def one(kind: str) -> float | None:
        n = after[f"{kind}_count"] - before[f"{kind}_count"]
        return (after[f"{kind}_sum"] - before[f"{kind}_sum"]) / n if n > 0 else None
    return one("request"), one("response")


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.to(torch.float64), ref.to(torch.float64)
    if g.shape != r.shape:
        return float("inf")
    return float((g - r).abs().max()) / max(1.0, float(r.abs().max()))


def groups_section(report: Any, Row: type, tokens: tuple[int, ...], callers_list: tuple[int, ...],
                   seconds: float) -> None:
    """Adds one Row per (T, implementation, callers): see the module docstring."""
    from advantage_client import AdvantageClient, AsyncAdvantageClient
    from advantage_server.core import AdvantageCore, config_from_dict
    from advantage_server.estimators import REGISTRY, Batch

    from advantage_server.limits import Limits
    # admit every caller (the default --max-concurrent-requests, 32, refuses the 33rd concurrent call); the echo
    # server gets as many handler threads as the advantage server's pool then has
    admitted = max(max(callers_list), Limits().max_concurrent_requests)
    server = Process("advantage_server.bench.serve", "--metrics", "--max-concurrent-requests", str(admitted))
    echo = Process("advantage_server.bench.echo", "--threads",
                   str(Limits(max_concurrent_requests=admitted).thread_pool_size))
    metrics_port = server.info["metrics_port"]
    estimator = "grpo"
    spec = REGISTRY[estimator]
    core = AdvantageCore("cpu")
    try:
        for T in tokens:
            label = f"{GROUP}x{T}x{GROUP}"
            config, tensors = workloads.inputs(estimator, GROUP, T, GROUP)
            cfg = config_from_dict(spec, config).resolved()

            def in_process() -> torch.Tensor:
                out = spec.fn(cfg, Batch(core.prepare(spec, cfg, tensors)))
                return out.advantages.contiguous()

            ref = in_process()

            def add(impl: str, compact: str, callers: int, m: Measured, b_in: float | None, b_out: float | None,
                    err: float | None, note: str = "") -> None:
                report.add(Row("groups", estimator, label, impl, m.p50_ms, err=err, note=note, callers=callers,
                               p99_ms=m.p99_ms, calls_s=m.calls_s, bytes_in=b_in, bytes_out=b_out, compact=compact))

            for callers in callers_list:
                add("estimator in-process", "", callers, run_threads(in_process, callers, seconds), None, None, 0.0,
                    "prepare (validation) + estimator, dense [B, T] out; callers are threads")

            measured_bytes: dict[str, tuple[float | None, float | None]] = {}
            for compact in (True, False):
                tag = "on" if compact else "off"
                for transport in ("unary", "stream", "shm"):
                    if transport == "shm" and not compact:
                        continue  # shared memory sends the tensors as given and answers dense either way
                    client = AdvantageClient(server.address, timeout=120.0, transport=transport, compact=compact)
                    try:
                        client.wait_ready(30.0)
                        call = lambda c=client: c.compute(estimator, config, **tensors)  # noqa: E731
                        err = _err(call().advantages, ref)
                        for callers in callers_list:
                            before = wire_bytes(metrics_port)
                            m = run_threads(call, callers, seconds)
                            b_in, b_out = per_call(before, wire_bytes(metrics_port))
                            measured_bytes.setdefault(f"{transport}/{tag}", (b_in, b_out))
                            add(f"service {transport}, sync client", "n/a" if transport == "shm" else tag, callers,
                                m, b_in, b_out, err, "shm: names and offsets on the socket, tensors in the region"
                                if transport == "shm" else "")
                    finally:
                        client.close()
                for transport in ("unary", "stream"):
                    async def run_aio(transport: str = transport, compact: bool = compact) -> None:
                        async with AsyncAdvantageClient(server.address, timeout=120.0, transport=transport,
                                                        compact=compact) as client:
                            await client.wait_ready(30.0)
                            call = lambda: client.compute(estimator, config, **tensors)  # noqa: E731
                            err = _err((await call()).advantages, ref)
                            for callers in callers_list:
                                before = wire_bytes(metrics_port)
                                m = await run_tasks(call, callers, seconds)
                                b_in, b_out = per_call(before, wire_bytes(metrics_port))
                                add(f"service {transport}, asyncio client", tag, callers, m, b_in, b_out, err,
                                    "callers are tasks in one event loop")
                    asyncio.run(run_aio())
                if compact:
                    asyncio.run(_coalesced_rows(AsyncAdvantageClient, server.address, estimator, config, tensors, ref,
                                                callers_list, seconds, metrics_port, add))

            # the echo, moving the bytes the unary calls moved (dense: compact off; compact: on)
            import grpc
            dense_in, dense_out = measured_bytes.get("unary/off", (None, None))
            small_in, small_out = measured_bytes.get("unary/on", (None, None))
            dense_in = int(dense_in or workloads.payload_bytes(tensors))
            dense_out = int(dense_out or GROUP * T * 4)
            cases = [("echo, dense bytes each way", "off", dense_in, dense_out),
                     ("echo, dense request, [B] response", "off", dense_in, GROUP * 4 + 16),
                     ("echo, the compact call's bytes", "on", int(small_in or 1024), int(small_out or 128))]
            options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
            channel = grpc.insecure_channel(echo.address, options=options)
            try:
                grpc.channel_ready_future(channel).result(timeout=30)
                fn = channel.unary_unary(echo_mod.METHOD)
                for impl, tag, n_in, n_out in cases:
                    data = echo_mod.request_bytes(n_in, n_out)
                    for callers in callers_list:
                        add(impl + ", sync", tag, callers, run_threads(lambda: fn(data), callers, seconds), n_in, n_out,
                            None, "raw grpcio unary, bytes in and out, no interceptors: the transport floor")
            finally:
                channel.close()

            async def run_echo_aio() -> None:
                async with grpc.aio.insecure_channel(echo.address, options=options) as ach:
                    afn = ach.unary_unary(echo_mod.METHOD)
                    for impl, tag, n_in, n_out in (cases[0], cases[2]):
                        data = echo_mod.request_bytes(n_in, n_out)
                        for callers in callers_list:
                            add(impl + ", asyncio", tag, callers, await run_tasks(lambda: afn(data), callers, seconds),
                                n_in, n_out, None, "grpc.aio channel, callers are tasks")
            asyncio.run(run_echo_aio())
    finally:
        server.close()
        echo.close()
    _ratios(report)


#: the window of the coalesced rows (``AsyncAdvantageClient(coalesce_ms=...)``)
COALESCE_MS = 1.0


async def _coalesced_rows(client_cls: type, address: str, estimator: str, config: Any, tensors: Any, ref: Any,
                          callers_list: tuple[int, ...], seconds: float, metrics_port: int, add: Callable) -> None:
    """Rows "service unary, asyncio client, coalesced": the asyncio client with ``coalesce_ms`` (compact on), each
    caller a task awaiting one group per call. Latencies and calls/s count LOGICAL calls (one per awaited
    ``compute``, as the other rows), whatever number of requests they went in; bytes are per logical call (the
    server's request/response byte totals over the logical calls made, warm-up included)."""
    async with client_cls(address, timeout=120.0, transport="unary", coalesce_ms=COALESCE_MS) as client:
        await client.wait_ready(30.0)
        call = lambda: client.compute(estimator, config, **tensors)  # noqa: E731
        err = _err((await call()).advantages, ref)
        for callers in callers_list:
            before = wire_bytes(metrics_port)
            m = await run_tasks(call, callers, seconds)
            after = wire_bytes(metrics_port)
            logical = m.n + 8  # run_tasks' 8 warm-up calls are counted by the server too
            requests = after["request_count"] - before["request_count"]
            add("service unary, asyncio client, coalesced", "on", callers, m,
                (after["request_sum"] - before["request_sum"]) / logical,
                (after["response_sum"] - before["response_sum"]) / logical, err,
                f"coalesce_ms={COALESCE_MS:g}; calls/s, p50, p99 and bytes per LOGICAL call (one awaited compute "
                f"of one group); {requests / logical:.3f} requests per logical call at {callers} callers")


def _ratios(report: Any) -> None:
    """``vs_ours`` of each groups row = its p50 / the matching echo's p50 (same T, callers, bytes: dense echo for
    compact off and in-process, compact echo for compact on); ``vs_floor`` = its calls/s / the echo's."""
    rows = [r for r in report.rows if r.section == "groups"]
    echo = {}
    for r in rows:
        if r.impl == "echo, dense bytes each way, sync":
            echo[(r.size, r.callers, "off")] = r
        elif r.impl == "echo, the compact call's bytes, sync":
            echo[(r.size, r.callers, "on")] = r
    for r in rows:
        key = "on" if r.compact == "on" else "off"
        e = echo.get((r.size, r.callers, key))
        if e is not None and e.ms and r.ms:
            r.vs_ours = r.ms / e.ms
            r.vs_floor = r.calls_s / e.calls_s if e.calls_s else None


def render(rows: list[Any]) -> list[str]:
    """The groups rows as their own table."""
    if not rows:
        return []
    header = ["BxTxG", "implementation", "compact", "callers", "p50 ms", "p99 ms", "calls/s", "p50 x echo",
              "calls/s x echo", "bytes in", "bytes out", "err"]

    def f(v: Any, spec: str) -> str:
        return "" if v is None else format(v, spec)

    table = [[r.size, r.impl, r.compact or "", str(r.callers), f(r.ms, ".3f"), f(r.p99_ms, ".3f"), f(r.calls_s, ".0f"),
              f(r.vs_ours, ".2f"), f(r.vs_floor, ".2f"), f(r.bytes_in, ".0f"), f(r.bytes_out, ".0f"), f(r.err, ".1e")]
             for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    numeric = set(range(3, len(header)))

    def line(cells: list[str]) -> str:
        return " | ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    notes = sorted({f"  {r.impl}: {r.note}" for r in rows if r.note})
    return ["", "groups: one GRPO group (nemo_rl) per call; compact = per-sample results and compact masks "
            "(on: the clients' default; off: float mask in, dense [B, T] out); x echo = p50 / the echo's p50 and "
            "calls/s / the echo's calls/s at the same callers (dense echo for off and in-process rows, compact "
            "echo for on rows); bytes = serialized messages per call",
            line(header), "-+-".join("-" * w for w in widths), *(line(r) for r in table), *notes]
