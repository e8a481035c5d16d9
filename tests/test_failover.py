"""Issue #22 item 8 (client half): failover on full or hung replicas.

Before: with replica A full (every --max-concurrent-requests place taken) and B idle, 21 of 40 calls through
``AdvantageClient([A, B])`` failed RESOURCE_EXHAUSTED (the round_robin picker sends every other call to A), and
a call sent to a hung (SIGSTOPped) replica waited its whole deadline and failed DEADLINE_EXCEEDED. Now
(``advantage_client.client.Failover``): an admission refusal is sent again to the other replicas in turn, and
with several replicas an attempt takes at most half the deadline, one that timed out is sent once more through
the rotation under the rest. With one replica the refusal is raised as before.

Real servers: in-process ones (``make_server``) for the full replica, whose one place is held by a grpo call
that waits for the test; two ``advantage-server`` processes for the hung one. A's full report is pushed out
of reach (``full_report.after``) so that A stays SERVING in the rotation while full, the case the client must
handle itself (a balancer that has not yet seen NOT_SERVING, or a server that fills and empties quickly).
No timed assertion except lower bounds (a call that waited on the hung replica took at least its share).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from advantage_client import AdvantageClient, AsyncAdvantageClient
from advantage_client.channel import replica_count, replica_targets
from advantage_client.client import (
    FAILOVER_DEADLINE_SHARE, AdvantageServiceError, Failover, admission_refused, build_request,
)
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc

from reliability_support import start_server

RE = grpc.StatusCode.RESOURCE_EXHAUSTED
REFUSAL = ("the server is at its concurrency limit: --max-concurrent-requests=1 requests are already in progress; "
           "retry with backoff, or add replicas")
REWARDS = np.array([1.0, 0.0, 2.0], np.float32)
MASK = np.ones((3, 2), np.float32)


def _expected() -> np.ndarray:
    z = (REWARDS - REWARDS.mean()) / REWARDS.std()  # raw_reward (defaults): the whitened reward on every token
    return np.repeat(z[:, None], 2, axis=1)


@pytest.fixture
def full_and_idle(make_server, monkeypatch):
    """(A, B): A with one place, taken by a grpo call held until the test ends, kept SERVING while full; B idle."""
    from advantage_server.estimators.registry import REGISTRY
    grpo = REGISTRY["grpo"]
    release, entered = threading.Event(), threading.Event()

    def held(cfg, batch):
        entered.set()
        assert release.wait(60), "the test never released the held call"
        return grpo.fn(cfg, batch)
    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(grpo, fn=held))
    a = make_server(max_concurrent_requests=1, workers=1)
    a.full_report.after = 3600.0  # stays SERVING while full: the client has to fail over by itself
    b = make_server()
    channel = grpc.insecure_channel(a.address)
    hold = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage.future(
        build_request("grpo", None, prompt_ids=[0, 0], rewards=[1.0, 0.0], mask=[[1.0], [1.0]]), timeout=60)
    assert entered.wait(30), "the held call never started on A"
    try:
        yield a, b
    finally:
        release.set()
        hold.result(timeout=60)
        channel.close()


def _outcome(client: AdvantageClient, **kwargs) -> str:
    try:
        result = client.compute("raw_reward", None, rewards=REWARDS, mask=MASK, **kwargs)
    except AdvantageServiceError as err:
        assert err.code != RE or str(err) == REFUSAL, str(err)
        return err.code.name
    np.testing.assert_allclose(np.asarray(result.advantages), _expected(), rtol=1e-5, atol=1e-6)
    return "OK"


# ------------------------------------------------------------------ the plan (no server)
def _error(code: grpc.StatusCode, message: str = "") -> AdvantageServiceError:
    return AdvantageServiceError(code, message)


def test_admission_refusal_is_told_from_other_resource_exhausted():
    assert admission_refused(_error(RE, REFUSAL))
    assert admission_refused(_error(RE, "cut to give its place to another client: ... the server's "
                                        "--max-pending-per-peer=2; send each request in full"))
    assert admission_refused(_error(RE, "... --max-pending-per-connection=2 ..."))
    assert not admission_refused(_error(RE, "request of 300 MiB exceeds --max-message-mb=256"))
    assert not admission_refused(_error(RE, "out of memory on the server's cuda device while computing this request"))
    assert not admission_refused(_error(grpc.StatusCode.UNAVAILABLE, "--max-concurrent-requests"))


def test_the_plan_sends_refusals_to_every_replica_in_turn_within_bounds():
    targets = replica_targets("ipv4:10.0.0.1:1,10.0.0.2:1,10.0.0.3:1")
    assert targets == ["ipv4:10.0.0.1:1", "ipv4:10.0.0.2:1", "ipv4:10.0.0.3:1"]
    plan = Failover(3, 10.0, targets=targets)
    assert plan.via is None and plan.attempt_timeout() == pytest.approx(10.0 * FAILOVER_DEADLINE_SHARE, abs=0.5)
    went = []
    for _ in range(3):
        pause = plan.retry(_error(RE, REFUSAL))
        assert pause is not None and 0 < pause < 1
        went.append(plan.via)
    assert sorted(went) == targets  # each replica once: every other replica is tried whichever refused
    assert plan.retry(_error(RE, REFUSAL)) is None  # bounded
    # a resend that found its replica not serving moves on at once (and the refusal is what is raised)
    plan = Failover(2, 10.0, targets=replica_targets("ipv4:10.0.0.1:1,10.0.0.2:1"))
    assert plan.retry(_error(RE, REFUSAL)) > 0
    assert plan.retry(_error(grpc.StatusCode.UNAVAILABLE, "not serving")) == 0.0
    last = _error(grpc.StatusCode.UNAVAILABLE, "not serving")
    assert plan.retry(last) is None
    assert str(plan.error(last, "t")) == REFUSAL
    # so does one whose replica's gRPC dropped it while shutting down (CANCELLED: the resend's channel has no
    # retry policy); without a resend in progress a CANCELLED is the call's error
    plan = Failover(3, 10.0, targets=targets)
    assert plan.retry(_error(grpc.StatusCode.CANCELLED, "CANCELLED")) is None
    assert plan.retry(_error(RE, REFUSAL)) > 0
    assert plan.retry(_error(grpc.StatusCode.CANCELLED, "CANCELLED")) == 0.0
    # a size limit, bad input, or one replica: raised at once
    assert Failover(2, 10.0).retry(_error(RE, "exceeds --max-message-mb")) is None
    assert Failover(2, 10.0).retry(_error(grpc.StatusCode.INVALID_ARGUMENT, "bad")) is None
    one = Failover(1, 10.0)
    assert one.attempt_timeout() == pytest.approx(10.0, abs=0.5)
    assert one.retry(_error(RE, REFUSAL)) is None and one.retry(_error(grpc.StatusCode.DEADLINE_EXCEEDED)) is None


def test_the_plan_resends_a_timed_out_attempt_once_within_the_deadline():
    seen = []
    plan = Failover(2, 6.0, on_timeout=lambda: seen.append(1))
    assert plan.attempt_timeout() <= 3.0
    assert plan.retry(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")) == 0.0
    assert seen == [1] and plan.via is None  # through the rotation: the next replica
    assert 5.0 < plan.attempt_timeout() <= 6.0  # the rest of the deadline
    last = _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert plan.retry(last) is None  # once
    assert "timeout=6 seconds" in str(plan.error(last, "t")) and "failover" in str(plan.error(last, "t"))
    assert Failover(2, None).retry(_error(grpc.StatusCode.DEADLINE_EXCEEDED)) is None  # no deadline: no share


def test_replica_count():
    assert replica_count("ipv4:10.0.0.1:1,10.0.0.2:1") == 2
    assert replica_count("127.0.0.1:5") == 1
    assert replica_count("localhost:5") == 1  # 127.0.0.1 and ::1 are one host
    assert replica_count("unix:/tmp/x.sock") == 1
    assert replica_targets("dns:///advantage.svc:50051") == [] and replica_targets("127.0.0.1:1") == []


# ------------------------------------------------------------------ a full replica
def test_a_full_replica_is_failed_over_sync(full_and_idle):
    a, b = full_and_idle
    with AdvantageClient([a.address, b.address], timeout=20, failover=False) as before:
        codes = [_outcome(before) for _ in range(40)]
    assert 0 < codes.count("RESOURCE_EXHAUSTED") < 40 and set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    with AdvantageClient([a.address, b.address], timeout=20) as client:
        assert [_outcome(client) for _ in range(40)] == ["OK"] * 40
        with futures.ThreadPoolExecutor(8) as pool:  # concurrent: the rotation is shared, the resends steered
            assert list(pool.map(lambda _: _outcome(client), range(40))) == ["OK"] * 40


def test_a_full_replica_is_failed_over_async(full_and_idle):
    a, b = full_and_idle

    async def run() -> tuple[list[str], list[str]]:
        async def one(client) -> str:
            try:
                result = await client.compute("raw_reward", None, rewards=REWARDS, mask=MASK)
            except AdvantageServiceError as err:
                return err.code.name
            np.testing.assert_allclose(np.asarray(result.advantages), _expected(), rtol=1e-5, atol=1e-6)
            return "OK"
        async with AsyncAdvantageClient([a.address, b.address], timeout=20, failover=False) as before:
            control = list(await asyncio.gather(*(one(before) for _ in range(40))))
        async with AsyncAdvantageClient([a.address, b.address], timeout=20) as client:
            sequential = [await one(client) for _ in range(20)]
            together = list(await asyncio.gather(*(one(client) for _ in range(40))))
        return control, sequential + together
    control, codes = asyncio.run(run())
    assert "RESOURCE_EXHAUSTED" in control, control
    assert codes == ["OK"] * 60


def test_one_replica_raises_the_refusal_as_before(full_and_idle):
    a, _ = full_and_idle
    assert replica_count(a.address) == 1
    with AdvantageClient(a.address, timeout=20) as client:
        assert [_outcome(client) for _ in range(3)] == ["RESOURCE_EXHAUSTED"] * 3

    async def run() -> AdvantageServiceError:
        async with AsyncAdvantageClient(a.address, timeout=20) as client:
            with pytest.raises(AdvantageServiceError) as info:
                await client.compute("raw_reward", None, rewards=REWARDS, mask=MASK)
            return info.value
    err = asyncio.run(run())
    assert err.code == RE and str(err) == REFUSAL


# ------------------------------------------------------------------ a hung replica
@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Two ``advantage-server`` processes, shared by the hung-replica tests (each SIGCONTs what it stopped)."""
    tmp = tmp_path_factory.mktemp("failover")
    servers = []
    try:
        for i in range(2):
            servers.append(start_server(tmp, f"r{i}"))
        yield servers
    finally:
        for srv in servers:
            srv.close()


@pytest.fixture
def hung_and_live(two_processes):
    """(hung, live): the first is SIGSTOPped when the test calls ``stop()`` (once its clients have connected to
    both), and SIGCONTed at teardown."""
    stopped = []

    def stop() -> None:
        os.kill(two_processes[0].proc.pid, signal.SIGSTOP)
        stopped.append(two_processes[0])
    try:
        yield two_processes, stop
    finally:
        for srv in stopped:
            os.kill(srv.proc.pid, signal.SIGCONT)


#: assumption: a 3-row raw_reward call on the live replica answers within half of this on a loaded 2-core host
DEADLINE_S = 6.0


def test_a_call_timed_out_on_a_hung_replica_is_sent_again_within_its_deadline(hung_and_live):
    servers, stop = hung_and_live
    addresses = [srv.address for srv in servers]
    with AdvantageClient(addresses, timeout=DEADLINE_S) as client, \
            AdvantageClient(addresses, timeout=2.0, failover=False) as before:
        for c in (client, before):
            assert [_outcome(c) for _ in range(4)] == ["OK"] * 4  # connected to both, warm
        stop()
        assert "DEADLINE_EXCEEDED" in [_outcome(before) for _ in range(2)]  # the rotation sends one to the hung one
        resent = []
        client._on_timeout = lambda: resent.append(time.monotonic())
        took = []
        for _ in range(2):
            t0 = time.monotonic()
            assert _outcome(client) == "OK"
            took.append(time.monotonic() - t0)
        # the rotation sent one or both to the hung replica first (then, resent, to the live one); it stays in the
        # rotation until gRPC's keepalive drops its connection (~40 s; the Ray client's look-up drops it sooner)
        assert 1 <= len(resent) <= 2, resent
        assert max(took) >= DEADLINE_S * FAILOVER_DEADLINE_SHARE  # it waited its share there (a lower bound)


def test_a_hung_replica_is_failed_over_async(hung_and_live):
    servers, stop = hung_and_live
    addresses = [srv.address for srv in servers]

    async def run() -> tuple[list[str], int]:
        async with AsyncAdvantageClient(addresses, timeout=DEADLINE_S) as client:
            resent = []
            client._on_timeout = lambda: resent.append(1)
            out = []
            for i in range(6):
                if i == 4:  # connected to both and warm: now one hangs
                    stop()
                result = await client.compute("raw_reward", None, rewards=REWARDS, mask=MASK)
                np.testing.assert_allclose(np.asarray(result.advantages), _expected(), rtol=1e-5, atol=1e-6)
                out.append("OK")
            return out, len(resent)
    codes, resent = asyncio.run(run())
    assert codes == ["OK"] * 6 and 1 <= resent <= 2
