"""How low a Python service can go on the one-group call: ``python -m advantage_server.bench.floor``.

Issue #12's latency target is one GRPO group of 16 at T=1024, unary, one caller, at most 1.3x the p50 of a raw
grpcio echo moving the same bytes. This probe measures, in one run and interleaved (every round times each
row in turn, the printed p50 is the median of the rounds' p50s), what stands between the service and that
floor:

* ``echo``: :mod:`advantage_server.bench.echo`, the compact request's bytes in, a ``[B]`` answer's bytes out;
* ``work-only server``: a grpcio server in its own process (``--serve-work-only``) that does only the work the
  call needs and nothing a service must also do: upb parses the request, numpy computes NeMo RL's GRPO for
  the one group (default config: leave-one-out baseline and std, ``(r_i - baseline_i) / (std_i + 1e-6)`` in
  float64; the probe checks it equals the service's answer), upb writes the ``[B]`` per-sample result. No
  validation, admission gate, liveness checks, metrics or request ids;
* ``service``: the advantage server (:mod:`advantage_server.bench.serve`) on the same request bytes;
* ``work-only client + work-only server``: the client side reduced to its own necessary work (the float mask
  checked to be 0/1 and sent as one byte per token, the request written by upb, the ``[B]`` answer parsed
  and broadcast back to the dense ``[B, T]`` tensor times the mask) over a plain channel: the Python floor
  of the whole call;
* ``work-only client, bool mask given``: the same when the trainer hands over a bool mask (no 0/1 check, no
  conversion): the least client work a call can take;
* ``sync client`` and ``asyncio client``: :class:`~advantage_client.AdvantageClient` /
  :class:`~advantage_client.AsyncAdvantageClient` (``compute(...)`` as a trainer calls it) on the service.

Every request row sends the same bytes over a raw channel except the two client rows, whose channels carry
the client's service config (round robin, health checks, the retry policy). It also prints the client-side
work alone per call (no network): :func:`advantage_client.client.prepare_call` + ``finish_result`` against
the work-only client's steps. Figures go in BENCHMARKS.md (issue #12, "the floor").
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any, Callable

import numpy as np

GROUP, TOKENS, EPSILON = 16, 1024, 1e-6
METHOD = "/advantage.v1.AdvantageService/ComputeAdvantage"


# ------------------------------------------------------------------------------ the work-only server
def work_only_answer(data: bytes) -> bytes:
    """The work-only server's answer to a serialized GRPO request of one group (NeMo RL semantics, default
    config; float32 ``rewards``): the ``[B]`` per-sample ``AdvantageResult`` (layout BROADCAST, ``dense_shape``
    ``[B, T]`` from the mask, or from ``lengths`` and ``mask_columns``)."""
    from advantage_client.proto import advantage_pb2 as pb
    req = pb.ComputeAdvantageRequest.FromString(data)
    r = np.frombuffer(req.inputs["rewards"].data, dtype=np.float32)
    if "mask" in req.inputs:
        columns = req.inputs["mask"].shape[1]
    else:  # a prefix mask sent as lengths
        columns = req.mask_columns or int(np.frombuffer(req.inputs["lengths"].data, dtype=np.int64).max())
    r64 = r.astype(np.float64)
    n = len(r64)
    if n < 2:  # a group of one: 0 (as the service answers)
        a = np.zeros(n, dtype=np.float32)
    else:
        others = np.broadcast_to(r64, (n, n))[~np.eye(n, dtype=np.bool_)].reshape(n, n - 1)  # leave one out
        std = others.std(axis=1, ddof=1) if n > 2 else np.zeros(n)  # std of one value: 0 (the service's rule)
        centred = r64 - others.mean(axis=1)
        a = np.where(std > 0, centred / (std + EPSILON), centred).astype(np.float32)
    out = pb.AdvantageResult(layout=pb.RESULT_LAYOUT_BROADCAST, dense_shape=[n, columns])
    out.advantages.dtype = pb.DTYPE_FLOAT32
    out.advantages.shape.append(len(r))
    out.advantages.data = a.tobytes()
    return out.SerializeToString()


def serve_work_only() -> None:
    import grpc

    def handle(requests: Any, context: Any) -> bytes:  # request-streaming, as the service's handler is
        return work_only_answer(next(requests))

    from advantage_server.bench.echo import serve_until_stdin_closes
    serve_until_stdin_closes(grpc.method_handlers_generic_handler("advantage.v1.AdvantageService", {
        "ComputeAdvantage": grpc.stream_unary_rpc_method_handler(handle)}), threads=8)


# ------------------------------------------------------------------------------ the work-only client
def work_only_request(rewards: np.ndarray, prompt_ids: np.ndarray, mask: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The work-only client's request and its bool mask: a float mask checked to hold 0/1 only and sent as
    bool; a bool mask sent as it is (nothing to check)."""
    from advantage_client.proto import advantage_pb2 as pb
    b = mask
    if mask.dtype != np.bool_:
        b = mask.astype(np.bool_)
        if not np.array_equal(b, mask):
            raise ValueError("mask holds values other than 0 and 1")
    req = pb.ComputeAdvantageRequest(per_sample=True)
    req.grpo.SetInParent()
    for key, value, code in (("mask", b, pb.DTYPE_BOOL), ("prompt_ids", prompt_ids, pb.DTYPE_INT64),
                             ("rewards", rewards, pb.DTYPE_FLOAT32)):
        t = req.inputs[key]
        t.dtype = code
        t.shape.extend(value.shape)
        t.data = value.tobytes()
    return req.SerializeToString(), b


def work_only_result(reply: bytes, bool_mask: np.ndarray) -> Any:
    """The dense ``[B, T]`` advantages (torch, float32) from a per-sample reply: the values broadcast over the
    columns (a view), or times the mask (layout BROADCAST_TIMES_MASK)."""
    import torch
    from advantage_client.proto import advantage_pb2 as pb
    r = pb.AdvantageResult.FromString(reply)
    values = torch.from_numpy(np.frombuffer(r.advantages.data, dtype=np.float32).copy())
    if r.layout == pb.RESULT_LAYOUT_BROADCAST:
        return values[:, None].expand(len(values), r.dense_shape[1])
    return values[:, None] * torch.from_numpy(bool_mask)


# ------------------------------------------------------------------------------ timing
def p50_us(call: Callable[[], Any], calls: int) -> float:
    for _ in range(max(10, calls // 10)):
        call()
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t)
    return statistics.median(lat) * 1e6


async def p50_us_async(call: Callable[[], Any], calls: int) -> float:
    """:func:`p50_us` of a coroutine function, timed inside the running event loop."""
    for _ in range(max(10, calls // 10)):
        await call()
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t)
    return statistics.median(lat) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m advantage_server.bench.floor", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    ap.add_argument("--calls", type=int, default=1500, help="timed calls per row and round (default 1500)")
    ap.add_argument("--serve-work-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_work_only:
        return serve_work_only()

    import grpc
    import torch
    from advantage_client import AdvantageClient, AsyncAdvantageClient
    from advantage_client import codec
    from advantage_client.client import finish_result, prepare_call
    from advantage_server.bench import echo as echo_mod
    from advantage_server.bench import workloads
    from advantage_server.bench.groups import Process

    config, tensors = workloads.inputs("grpo", GROUP, TOKENS, GROUP)
    np_in = {k: v.numpy() for k, v in tensors.items()}
    prepared = prepare_call("grpo", config, None, None, False, dict(tensors))
    request = b"".join(bytes(p) for p in prepared.request.pieces)
    mine, own_mask = work_only_request(np_in["rewards"], np_in["prompt_ids"], np_in["mask"])

    processes: list[Any] = []
    channels: list[Any] = []
    clients: list[Any] = []
    aio: Any = None
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        for module, *options in (("advantage_server.bench.serve",), ("advantage_server.bench.echo", "--threads", "8"),
                                 ("advantage_server.bench.floor", "--serve-work-only")):
            processes.append(Process(module, *options))  # each started inside the try: closed if a later one fails
        service, echo, work = processes

        def raw(address: str, method: str) -> Any:
            ch = grpc.insecure_channel(address)
            grpc.channel_ready_future(ch).result(timeout=30)
            channels.append(ch)
            return ch.unary_unary(method)

        to_echo, to_work, to_service = raw(echo.address, echo_mod.METHOD), raw(work.address, METHOD), \
            raw(service.address, METHOD)
        echo_bytes = echo_mod.request_bytes(len(request), len(work_only_answer(request)))
        sync = AdvantageClient(service.address, timeout=60.0, transport="unary")
        clients.append(sync)
        aio = AsyncAdvantageClient(service.address, timeout=60.0, transport="unary")
        sync.wait_ready(30.0)
        loop.run_until_complete(aio.wait_ready(30.0))

        # the work-only server does the service's arithmetic: same advantages (float32 rounding aside)
        dense = sync.compute("grpo", config, **tensors).advantages
        floor_dense = work_only_result(to_work(mine), own_mask)
        if not torch.allclose(floor_dense, dense, rtol=1e-5, atol=1e-6):
            raise SystemExit("the work-only server's advantages differ from the service's: the probe is broken")

        rows: dict[str, Callable[[], Any]] = {
            "echo (the same bytes, [B] answer)": lambda: to_echo(echo_bytes),
            "work-only server": lambda: to_work(request),
            "service": lambda: to_service(request),
            "work-only client + work-only server": lambda: work_only_result(
                to_work(work_only_request(np_in["rewards"], np_in["prompt_ids"], np_in["mask"])[0]), own_mask),
            "work-only client, bool mask given + work-only server": lambda: work_only_result(
                to_work(work_only_request(np_in["rewards"], np_in["prompt_ids"], own_mask)[0]), own_mask),
            "work-only client + service": lambda: work_only_result(
                to_service(work_only_request(np_in["rewards"], np_in["prompt_ids"], np_in["mask"])[0]), own_mask),
            "sync client + service": lambda: sync.compute("grpo", config, **tensors),
        }
        in_loop: dict[str, Callable[[], Any]] = {
            "asyncio client + service": lambda: aio.compute("grpo", config, **tensors),
        }
        local: dict[str, Callable[[], Any]] = {
            "client work, AdvantageClient (prepare_call + finish_result)": lambda: finish_result(
                codec.decode_result(_reply), prepare_call("grpo", config, None, None, False, dict(tensors))),
            "client work, work-only": lambda: work_only_result(
                work_only_answer(work_only_request(np_in["rewards"], np_in["prompt_ids"], np_in["mask"])[0]),
                own_mask),
            "server work, work-only (parse, GRPO in numpy, write)": lambda: work_only_answer(request),
        }
        _reply = work_only_answer(request)
        figures: dict[str, list[float]] = {name: [] for name in [*rows, *in_loop, *local]}
        for _ in range(args.rounds):
            for name, call in [*rows.items(), *local.items()]:
                figures[name].append(p50_us(call, args.calls))
            for name, call in in_loop.items():
                figures[name].append(loop.run_until_complete(p50_us_async(call, args.calls)))
    finally:
        if aio is not None:
            loop.run_until_complete(aio.close())
        for c in clients:
            c.close()
        for ch in channels:
            ch.close()
        loop.close()
        for p in processes:
            p.close()

    floor = statistics.median(figures[next(iter(rows))])
    print(f"one GRPO group of {GROUP}, T={TOKENS}, unary, one caller; {len(request):,}-byte request; "
          f"{args.rounds} interleaved rounds x {args.calls} calls, median of the rounds' p50s")
    low = min(figures[next(iter(rows))])
    print("p50: the median of the rounds' p50s; min: the quietest round's (interference only adds time)")
    print(f"{'row':62s} {'p50 us':>7s} {'x echo':>6s} {'min us':>7s} {'x echo':>6s}  rounds")
    for name in [*rows, *in_loop, *local]:
        if name == next(iter(local)):
            print("work alone, in this process (no network):")
        v, m = statistics.median(figures[name]), min(figures[name])
        rounds = " ".join(f"{x:.0f}" for x in figures[name])
        print(f"{name:62s} {v:7.0f} {v / floor:6.2f} {m:7.0f} {m / low:6.2f}  {rounds}")


if __name__ == "__main__":
    main()
