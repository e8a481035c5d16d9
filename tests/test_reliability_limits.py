"""Limits and request lifetime, on in-process servers (fast): concurrency and worker limits, batch-element
and message-size limits, deadlines and cancellation stopping the work, out-of-memory, rich
INVALID_ARGUMENT details, undecodable bytes.

Every server listens on 127.0.0.1 only; every wait is bounded.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request, decode_result
from advantage_server import create_server
from advantage_server.estimators import REGISTRY
from reliability_support import report

B, T = 4, 8
RNG = np.random.default_rng(7)
MASK = np.ones((B, T), np.float32)
TEACHER = -RNG.random((B, T)).astype(np.float32)
PREV = -RNG.random((B, T)).astype(np.float32)


def opd_request() -> pb.ComputeAdvantageRequest:
    return build_request("opd", None, mask=MASK, teacher_logprobs=TEACHER, prev_logprobs=PREV)


def assert_opd_result(reply) -> None:
    np.testing.assert_allclose(decode_result(reply, as_numpy=True).advantages, (TEACHER - PREV) * MASK, atol=1e-7)


class Blocker:
    """Wraps an estimator: each call announces itself, then waits (bounded) until the test releases it."""

    def __init__(self):
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls = self.active = self.max_active = 0

    def wrap(self, fn):
        def blocked(cfg, batch):
            with self.lock:
                self.calls += 1
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            self.entered.release()
            try:
                assert self.release.wait(30), "test never released the estimator"
                return fn(cfg, batch)
            finally:
                with self.lock:
                    self.active -= 1
        return blocked

    def wait_entered(self, n: int, timeout: float = 10.0) -> None:
        for _ in range(n):
            assert self.entered.acquire(timeout=timeout), "the request did not reach the estimator"


@pytest.fixture
def blocked_opd(monkeypatch):
    blocker = Blocker()
    monkeypatch.setitem(REGISTRY, "opd", dataclasses.replace(REGISTRY["opd"], fn=blocker.wrap(REGISTRY["opd"].fn)))
    yield blocker
    blocker.release.set()


def rpc(channel: grpc.Channel):
    return pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage


# ----------------------------------------------------------------------------- concurrency
def test_concurrency_limit_refuses_at_once_naming_the_limit(make_server, blocked_opd, capsys):
    srv = make_server(max_concurrent_requests=2, workers=2)
    with grpc.insecure_channel(srv.address) as channel:
        call = rpc(channel)
        held = [call.future(opd_request(), timeout=30) for _ in range(2)]
        blocked_opd.wait_entered(2)
        refusals = []
        for _ in range(6):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as exc:
                call(opd_request(), timeout=10)
            refusals.append(time.monotonic() - t0)
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
            assert "--max-concurrent-requests=2" in exc.value.details(), exc.value.details()
        blocked_opd.release.set()
        for f in held:
            assert_opd_result(f.result(timeout=30))
        assert_opd_result(call(opd_request(), timeout=10))  # the slots came back
    report(capsys, f"concurrency limit 2: 2 held, {len(refusals)} refused RESOURCE_EXHAUSTED in "
                   f"max {1e3 * max(refusals):.1f} ms each; held ones then completed")
    assert max(refusals) < 2.0, refusals  # refused at once, not queued behind the held calls


def test_workers_bound_the_computations_and_the_rest_wait_within_the_limit(make_server, blocked_opd):
    srv = make_server(max_concurrent_requests=4, workers=1)
    with grpc.insecure_channel(srv.address) as channel:
        call = rpc(channel)
        held = [call.future(opd_request(), timeout=30) for _ in range(4)]
        blocked_opd.wait_entered(1)
        time.sleep(0.3)
        assert blocked_opd.calls == 1, "more computations started than --workers=1"
        with pytest.raises(grpc.RpcError) as exc:  # 4 admitted (1 computing, 3 waiting): the 5th is refused
            call(opd_request(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        blocked_opd.release.set()
        for f in held:
            assert_opd_result(f.result(timeout=30))
    assert blocked_opd.max_active == 1 and blocked_opd.calls == 4


# ----------------------------------------------------------------------------- size limits
def test_max_batch_elements(make_server):
    srv = make_server(max_batch_elements=100)
    with grpc.insecure_channel(srv.address) as channel:
        call = rpc(channel)
        ok = build_request("raw_reward", None, rewards=np.ones(10, np.float32), mask=np.ones((10, 10), np.float32))
        call(ok, timeout=10)
        big = build_request("raw_reward", None, rewards=np.ones(10, np.float32), mask=np.ones((10, 11), np.float32))
        with pytest.raises(grpc.RpcError) as exc:
            call(big, timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-batch-elements=100" in exc.value.details() and "inputs['mask']" in exc.value.details()
        # checked on the declared shape, before any byte is decoded or allocated
        huge = build_request("raw_reward", None, rewards=np.ones(10, np.float32), mask=np.ones((10, 10), np.float32))
        huge.inputs["mask"].shape[:] = [10**9, 10**9]
        with pytest.raises(grpc.RpcError) as exc:
            call(huge, timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        # an empty tensor of absurd shape: no array library can lay it out, so it is refused the same way
        empty = build_request("raw_reward", None, rewards=np.ones(10, np.float32), mask=np.ones((10, 10), np.float32))
        empty.inputs["values"].CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[0, 2**62]))
        with pytest.raises(grpc.RpcError) as exc:
            call(empty, timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        call(ok, timeout=10)


def test_max_message_size(make_server):
    srv = make_server(max_message_mb=1)
    n = 2 * 1024 * 1024 // 4
    # the message limit is the unary transport's (auto would send 2 MiB through shared memory on this host)
    with AdvantageClient(srv.address, timeout=10, transport="unary") as client:
        with pytest.raises(AdvantageServiceError) as exc:
            # 2 MiB of float values (an all-ones mask alone would go as [B] lengths, a few bytes)
            client.compute("gae", None, rewards=np.ones(n // 64, np.float32), values=np.ones((n // 64, 64), np.float32),
                           mask=np.ones((n // 64, 64), np.float32))
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(1024 * 1024) in str(exc.value), str(exc.value)  # gRPC names the limit in bytes
        client.compute("raw_reward", None, rewards=np.ones(4, np.float32), mask=np.ones((4, 4), np.float32))


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="--max-concurrent-requests"):
        create_server("127.0.0.1", 0, device="cpu", max_concurrent_requests=0)
    with pytest.raises(ValueError, match="--max-batch-elements"):
        create_server("127.0.0.1", 0, device="cpu", max_batch_elements=-5)


# ----------------------------------------------------------------------------- deadlines
@pytest.fixture
def counted_opd(monkeypatch):
    calls = []
    spec = REGISTRY["opd"]
    monkeypatch.setitem(REGISTRY, "opd", dataclasses.replace(spec, fn=lambda cfg, b: calls.append(1) or spec.fn(cfg, b)))
    return calls


def _slow_prepare(monkeypatch, srv, seconds: float) -> threading.Event:
    """Make the server's input preparation (decode -> device) take ``seconds``; returns 'prepared' event."""
    original, done = srv.core.prepare, threading.Event()

    def slow(*args, **kwargs):
        time.sleep(seconds)
        try:
            return original(*args, **kwargs)
        finally:
            done.set()
    monkeypatch.setattr(srv.core, "prepare", slow)
    return done


def test_expired_deadline_stops_the_work(make_server, counted_opd, monkeypatch, caplog):
    srv = make_server()
    prepared = _slow_prepare(monkeypatch, srv, 0.6)
    with caplog.at_level(logging.DEBUG, logger="advantage_server"), grpc.insecure_channel(srv.address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            rpc(channel)(opd_request(), timeout=0.2)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert prepared.wait(5)
        time.sleep(0.3)
    assert counted_opd == [], "the estimator ran for a request whose deadline had passed"
    # the first check inside prepare (issue 11) sees it, before the estimator's "before computing"
    assert "deadline expired while checking the inputs" in caplog.text, caplog.text
    monkeypatch.undo()
    with grpc.insecure_channel(srv.address) as channel:
        assert_opd_result(rpc(channel)(opd_request(), timeout=10))


def test_cancelled_call_stops_the_work(make_server, counted_opd, monkeypatch, caplog):
    srv = make_server()
    prepared = _slow_prepare(monkeypatch, srv, 0.6)
    with caplog.at_level(logging.DEBUG, logger="advantage_server"), grpc.insecure_channel(srv.address) as channel:
        future = rpc(channel).future(opd_request(), timeout=30)
        time.sleep(0.15)
        assert future.cancel()
        assert prepared.wait(5)
        time.sleep(0.3)
    assert counted_opd == [], "the estimator ran for a cancelled call"
    assert "client cancelled the call while checking the inputs" in caplog.text, caplog.text


def test_deadline_passing_while_waiting_for_a_worker(make_server, blocked_opd):
    srv = make_server(max_concurrent_requests=4, workers=1)
    with grpc.insecure_channel(srv.address) as channel:
        call = rpc(channel)
        first = call.future(opd_request(), timeout=30)
        blocked_opd.wait_entered(1)
        with pytest.raises(grpc.RpcError) as exc:
            call(opd_request(), timeout=0.3)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.2)
        blocked_opd.release.set()
        assert_opd_result(first.result(timeout=30))
        time.sleep(0.2)
    assert blocked_opd.calls == 1, "the expired request still reached the estimator"


# ----------------------------------------------------------------------------- out of memory
@pytest.mark.parametrize("error", [
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    lambda: MemoryError(),
    lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),
], ids=["cuda-oom", "MemoryError", "cpu-allocator"])
def test_out_of_memory_is_resource_exhausted_and_the_server_goes_on(make_server, monkeypatch, error):
    srv = make_server()
    spec = REGISTRY["opd"]

    def fail(cfg, b):
        raise error()
    monkeypatch.setitem(REGISTRY, "opd", dataclasses.replace(spec, fn=fail))
    with grpc.insecure_channel(srv.address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            rpc(channel)(opd_request(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        assert "out of memory" in exc.value.details()
        monkeypatch.setitem(REGISTRY, "opd", spec)
        assert_opd_result(rpc(channel)(opd_request(), timeout=10))


# ----------------------------------------------------------------------------- rich errors
def test_every_bad_field_is_its_own_violation(client, target):
    request = build_request("gae", None, rewards=np.ones(B, np.float32), mask=MASK, values=np.zeros((B, T), np.float32))
    request.inputs["rewards"].data = request.inputs["rewards"].data[:-1]  # byte length
    request.inputs["mask"].shape[:] = [-B, T]                               # negative dimension
    request.inputs["values"].dtype = 99                                     # unknown dtype
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as raw:
            rpc(channel)(request, timeout=10)
    err = AdvantageServiceError.from_rpc_error(raw.value)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    fields = sorted(f for f, _ in err.field_violations)
    assert fields == ["inputs['mask'].shape", "inputs['rewards'].data", "inputs['values'].dtype"], err.field_violations
    # and through the client: an input the estimator does not read plus a missing one
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("gae", None, rewards=np.ones(B, np.float32), mask=MASK, teacher_logprobs=TEACHER)
    fields = {f for f, _ in exc.value.field_violations}
    assert {"inputs['teacher_logprobs']", "inputs['values']"} <= fields, exc.value.field_violations
    assert len(exc.value.field_violations) >= 2


@pytest.mark.parametrize("method,payload", [
    ("ComputeAdvantage", b"\xff\xff\xff"),
    ("ComputeAdvantage", b"\x0a\xff\xff\xff\xff\x0f"),
    ("ComputeAdvantage", b"\x52\x07\x0a\x03abc"),  # inputs map entry cut short
    ("ListEstimators", b"\x0a\xff"),
], ids=["ff", "bad-length", "truncated-map", "list-estimators"])
def test_undecodable_bytes_are_invalid_argument(client, target, method, payload):
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/advantage.v1.AdvantageService/{method}")
        with pytest.raises(grpc.RpcError) as exc:
            call(payload, timeout=10)
    err = AdvantageServiceError.from_rpc_error(exc.value)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (err.code, str(err))
    assert [f for f, _ in err.field_violations] == ["request"], err.field_violations
    res = client.compute("opd", None, mask=MASK, teacher_logprobs=TEACHER, prev_logprobs=PREV, as_numpy=True)
    np.testing.assert_allclose(res.advantages, (TEACHER - PREV) * MASK, atol=1e-7)


def test_health_answers_while_every_slot_is_busy(make_server, blocked_opd):
    """Health checks and ListEstimators have threads of their own: a saturated server still answers them."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = make_server(max_concurrent_requests=3, workers=3)
    with grpc.insecure_channel(srv.address) as channel:
        held = [rpc(channel).future(opd_request(), timeout=30) for _ in range(3)]
        blocked_opd.wait_entered(3)
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        pb_grpc.AdvantageServiceStub(channel).ListEstimators(pb.ListEstimatorsRequest(), timeout=2)
        blocked_opd.release.set()
        for f in held:
            f.result(timeout=30)


def test_checkpoint_is_a_no_op_in_process():
    """The core's checkpoint hook does nothing outside a gRPC call (in-process use is unaffected)."""
    from advantage_server import AdvantageCore

    res = AdvantageCore("cpu").run("opd", None, {"mask": MASK, "teacher_logprobs": TEACHER, "prev_logprobs": PREV})
    np.testing.assert_allclose(res.advantages.numpy(), (TEACHER - PREV) * MASK, atol=1e-7)


def test_refusals_under_a_burst_all_name_the_limit(make_server, blocked_opd, capsys):
    """32 simultaneous calls against --max-concurrent-requests 2: two run, thirty are refused, every refusal
    says which limit; none waits for the held ones."""
    srv = make_server(max_concurrent_requests=2, workers=2)
    outcomes: list[tuple[str, str, float]] = []
    lock = threading.Lock()

    def one(_):
        with grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            t0 = time.monotonic()
            try:
                rpc(channel)(opd_request(), timeout=30)
                out = ("OK", "")
            except grpc.RpcError as err:
                out = (err.code().name, err.details())
            with lock:
                outcomes.append((*out, time.monotonic() - t0))
                if len([o for o in outcomes if o[0] != "OK"]) == 30:
                    blocked_opd.release.set()
    with futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(32)))
    codes = [o[0] for o in outcomes]
    assert codes.count("OK") == 2 and codes.count("RESOURCE_EXHAUSTED") == 30, codes
    assert all("--max-concurrent-requests=2" in d for c, d, _ in outcomes if c != "OK")
    slowest = max(t for c, _, t in outcomes if c != "OK")
    report(capsys, f"burst of 32 against limit 2: 2 OK, 30 RESOURCE_EXHAUSTED naming the limit, slowest refusal "
                   f"{1e3 * slowest:.0f} ms")


def test_readme_lists_every_server_flag():
    """The "Server flags" table (docs/server-flags.md, the README's until issue #29) names exactly the flags
    `advantage-server` accepts."""
    import pathlib
    import re

    from advantage_server.cli import build_parser

    section = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "server-flags.md").read_text()
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `--"))
    first_cells = [line.split("|")[1] for line in table.splitlines()]
    documented = {flag for cell in first_cells for flag in re.findall(r"`(--[a-z0-9-]+)`", cell)}
    accepted = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    assert documented == accepted, (sorted(accepted - documented), sorted(documented - accepted))


def test_the_memory_trimmer_keeps_trying_and_collects_garbage(monkeypatch):
    """Resident memory stays high (a burst's buffers still in use): the trimmer used to adopt that level after
    5 fruitless trims and never trim again, so memory freed later stayed resident. Now it keeps trying, less
    often (1, 2, 4 ... 30 intervals), runs a full garbage collection when a trim frees nothing, and comes
    back down once the memory is freed."""
    from advantage_server import limits
    mib = 1 << 20
    level = [100 * mib]
    monkeypatch.setattr(limits, "_resident_bytes", lambda: level[0])
    collections = []
    monkeypatch.setattr(limits.gc, "collect", lambda *a: collections.append(1) or 0)
    monkeypatch.setattr(limits, "GC_INTERVAL_S", 0.0)  # a collection at every attempt (below: the default)
    trimmer = limits.MemoryTrimmer(interval=0.01, step=64 * mib)
    trims = []
    trimmer._trim = lambda pad: trims.append(level[0])
    trimmer.start()
    try:
        time.sleep(0.05)
        level[0] = 900 * mib  # held: no trim brings it down
        deadline = time.monotonic() + 10
        # attempts: the old trimmer stopped after 5; the 7th attempt's second trim follows its collection, so
        # wait for both counts (the trimmer's thread may be between the two when the collection is seen)
        while (len(collections) < 7 or len(trims) < 14) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(collections) >= 7 and len(trims) >= 14  # each attempt: trim, collect, trim again
        level[0] = 120 * mib  # freed: back under floor + step, no more trims
        time.sleep(0.5)
        settled = len(trims)
        time.sleep(0.3)
        assert len(trims) == settled
    finally:
        trimmer.stop()
    # at the default, one full collection per GC_INTERVAL_S (10 s) however many attempts: each holds the GIL
    # (~0.1 s in a server without cli's gc.freeze), and under bench unread-results attempts came about once a second
    monkeypatch.setattr(limits, "GC_INTERVAL_S", 10.0)
    # gc.collect is patched process-wide: count the calls of this trimmer's thread only (a server another test left
    # in this worker has a trimmer of its own)
    monkeypatch.setattr(limits.gc, "collect", lambda *a: collections.append(threading.get_ident()) or 0)
    collections.clear()
    trims.clear()
    level[0] = 100 * mib
    trimmer = limits.MemoryTrimmer(interval=0.01, step=64 * mib)
    trimmer._trim = lambda pad: trims.append(level[0])
    trimmer.start()
    try:
        time.sleep(0.05)
        level[0] = 900 * mib
        deadline = time.monotonic() + 10
        while len(trims) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(trims) >= 8 and collections.count(trimmer._thread.ident) == 1
    finally:
        trimmer.stop()


class _FakeContext:
    """What ``grpc_liveness`` reads of a ``grpc.ServicerContext``, with a count of the locked asks."""

    def __init__(self, remaining):
        self.remaining, self.active, self.asks = remaining, True, 0

    def time_remaining(self):
        return self.remaining

    def is_active(self):
        self.asks += 1
        return self.active


def test_liveness_asks_grpc_at_most_once_a_period_and_sees_the_deadline_at_every_check(monkeypatch):
    from advantage_server import limits
    clock = [100.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: clock[0])
    context = _FakeContext(remaining=0.5)
    check = limits.grpc_liveness(context)
    for _ in range(12):  # a small call's stages, microseconds apart: one ask
        check("stage")
    assert context.asks == 1
    clock[0] += limits.LIVENESS_PERIOD
    context.active = False  # the client cancelled
    with pytest.raises(limits.RequestExpired) as exc:
        check("later")
    assert context.asks == 2 and not exc.value.deadline and "cancelled" in str(exc.value)
    context.active = True
    clock[0] += 0.5  # the deadline (read once, at 0.5 s) has passed: refused without asking gRPC
    with pytest.raises(limits.RequestExpired) as exc:
        check("at the deadline")
    assert exc.value.deadline and context.asks == 2
    no_deadline = _FakeContext(remaining=None)
    check = limits.grpc_liveness(no_deadline)
    clock[0] += 1e6
    check("no deadline")
    assert no_deadline.asks == 1
