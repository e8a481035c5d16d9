"""Issue #27 item 3 (client side): an admission refusal carrying the server's retry pushback is sent again.

A full server answers RESOURCE_EXHAUSTED with trailing metadata ``grpc-retry-pushback-ms`` (gRPC's retry
pushback key, integer milliseconds) on admission refusals only. Before: ``AdvantageClient`` with one replica
raised the refusal at once (the per-host share a full server keeps for newcomers went unused), on every
transport. Now (``advantage_client.client.Failover``): the sync and asyncio clients wait out the pushback
(jittered, never sooner) and send the call again, on every transport path (unary, stream, shared memory,
coalesced), at most ``PUSHBACK_MAX_RETRIES`` times within the call's deadline, to the same replica when there is
one and to another when there are several; past those bounds the refusal is raised. A RESOURCE_EXHAUSTED
without pushback (a size limit, out of memory, an upload cut) is raised at once.

The servers: a stub (``_Gate``) in front of a real in-process server: it refuses the calls it is told to
(with or without a pushback), counts every compute attempt, and forwards the others byte for byte (shared-memory
registrations included: the stub and the server are on this host). Values are checked exactly against the
real server's answer to the same call sent straight to it.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from advantage_client import AdvantageClient, AsyncAdvantageClient
from advantage_client.client import PUSHBACK_MAX_RETRIES, AdvantageServiceError
from advantage_client.errors import PUSHBACK_KEY

RE = grpc.StatusCode.RESOURCE_EXHAUSTED
REFUSAL = ("the server is at its concurrency limit: --max-concurrent-requests=1 requests are already in progress; "
           "retry with backoff, or add replicas")
COMPUTE = ("/advantage.v1.AdvantageService/ComputeAdvantage", "/advantage.v1.AdvantageService/ComputeAdvantageStream",
           "/advantage.v1.AdvantageService/ComputeAdvantageShm")
STREAMED = "/advantage.v1.AdvantageService/ComputeAdvantageStream"

PROMPTS = np.array([0, 0, 1, 1], np.int64)
REWARDS = np.array([1.0, 0.0, 2.0, 5.0], np.float32)
MASK = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)


class _Gate:
    """A gRPC server in front of ``upstream``: the first ``refuse`` compute attempts (-1: all) are answered
    RESOURCE_EXHAUSTED ``message`` with the trailing metadata ``grpc-retry-pushback-ms: pushback_ms`` (None:
    without it); every other call is forwarded as bytes. ``attempts``: compute attempts seen."""

    def __init__(self, upstream: str, refuse: int, pushback_ms: int | None = 50, message: str = REFUSAL):
        self.refuse, self.pushback_ms, self.message = refuse, pushback_ms, message
        self.attempts = 0
        self._lock = threading.Lock()
        self._up = grpc.insecure_channel(upstream, options=[("grpc.max_receive_message_length", 1 << 30),
                                                             ("grpc.max_send_message_length", 1 << 30)])
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=[
            ("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)])
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _refused(self, method: str, context: grpc.ServicerContext) -> bool:
        if method not in COMPUTE:
            return False
        with self._lock:
            self.attempts += 1
            if self.refuse == 0:
                return False
            self.refuse -= self.refuse > 0
        if self.pushback_ms is not None:
            context.set_trailing_metadata(((PUSHBACK_KEY, str(self.pushback_ms)),))
        context.abort(RE, self.message)
        return True

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        if not method.startswith("/advantage.v1.AdvantageService/"):
            return None  # health and reflection: UNIMPLEMENTED (the client's health check then trusts the server)
        metadata = tuple(details.invocation_metadata)
        if method == STREAMED:
            def stream(requests, context):
                self._refused(method, context)
                return self._up.stream_stream(method)(requests, metadata=metadata)
            return grpc.stream_stream_rpc_method_handler(stream)

        def unary(request, context):
            self._refused(method, context)
            return self._up.unary_unary(method)(request, metadata=metadata)
        return grpc.unary_unary_rpc_method_handler(unary)

    def close(self) -> None:
        self.server.stop(None)
        self._up.close()


@pytest.fixture
def gates(make_server):
    """``gate(refuse, pushback_ms=50, message=REFUSAL)`` -> a new :class:`_Gate` in front of one real server."""
    real = make_server()
    made = []

    def gate(refuse: int, pushback_ms: int | None = 50, message: str = REFUSAL) -> _Gate:
        made.append(_Gate(real.address, refuse, pushback_ms, message))
        return made[-1]
    gate.real = real
    yield gate
    for g in made:
        g.close()


def _reference(address: str) -> np.ndarray:
    with AdvantageClient(address, timeout=30, failover=False, transport="unary") as client:
        return np.asarray(client.compute("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS, mask=MASK).advantages)


def _sync(gate: _Gate, transport: str, **kwargs) -> np.ndarray:
    with AdvantageClient(gate.address, timeout=30, transport=transport, **kwargs) as client:
        return np.asarray(client.compute("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS, mask=MASK).advantages)


async def _async(gate: _Gate, transport: str, coalesce_ms: float = 0.0, calls: int = 1) -> list[np.ndarray]:
    async with AsyncAdvantageClient(gate.address, timeout=30, transport=transport, coalesce_ms=coalesce_ms) as client:
        results = await asyncio.gather(*(client.compute("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS, mask=MASK)
                                         for _ in range(calls)))
    return [np.asarray(r.advantages) for r in results]


@pytest.mark.parametrize("transport", ["unary", "stream", "shm"])
def test_sync_client_waits_out_the_pushback_on_one_replica(gates, transport):
    want = _reference(gates.real.address)
    gate = gates(refuse=2)
    np.testing.assert_array_equal(_sync(gate, transport), want)
    assert gate.attempts == 3  # refused twice, sent again to the same (only) replica, answered


@pytest.mark.parametrize("transport,coalesce_ms,calls", [("unary", 0, 1), ("stream", 0, 1), ("auto", 20, 3)])
def test_async_client_waits_out_the_pushback_on_one_replica(gates, transport, coalesce_ms, calls):
    want = _reference(gates.real.address)
    gate = gates(refuse=2)
    got = asyncio.run(_async(gate, transport, coalesce_ms, calls))
    for advantages in got:
        np.testing.assert_array_equal(advantages, want)
    # coalesced: the three calls went as one request, refused twice and sent again as one (plus nothing else)
    assert gate.attempts == 3


def test_the_refusal_is_raised_past_the_bound(gates):
    gate = gates(refuse=-1)
    with pytest.raises(AdvantageServiceError) as info:
        _sync(gate, "unary")
    assert info.value.code == RE and str(info.value) == REFUSAL and info.value.pushback_s == 0.05
    assert gate.attempts == 1 + PUSHBACK_MAX_RETRIES

    async def run() -> AdvantageServiceError:
        with pytest.raises(AdvantageServiceError) as caught:
            await _async(gate, "unary")
        return caught.value
    err = asyncio.run(run())
    assert err.code == RE and str(err) == REFUSAL
    assert gate.attempts == 2 * (1 + PUSHBACK_MAX_RETRIES)


def test_a_pushback_longer_than_the_deadline_left_is_not_waited_for(gates):
    gate = gates(refuse=-1, pushback_ms=60_000)
    with AdvantageClient(gate.address, timeout=5, transport="unary") as client:
        with pytest.raises(AdvantageServiceError) as info:
            client.compute("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS, mask=MASK)
    assert info.value.code == RE and gate.attempts == 1


@pytest.mark.parametrize("message", [REFUSAL, "request of 300 MiB exceeds --max-message-mb=256",
                                     "out of memory on the server's cpu device while computing this request"])
def test_resource_exhausted_without_pushback_is_never_retried(gates, message):
    gate = gates(refuse=-1, pushback_ms=None, message=message)
    with pytest.raises(AdvantageServiceError) as info:
        _sync(gate, "unary")
    assert info.value.code == RE and str(info.value) == message and info.value.pushback_s is None
    assert gate.attempts == 1

    async def run() -> AdvantageServiceError:
        with pytest.raises(AdvantageServiceError) as info:
            await _async(gate, "stream")
        return info.value
    error = asyncio.run(run())
    assert error.code == RE and str(error) == message
    # never for its own sake; but an attempt whose status grpc.aio lost (its INTERNAL "Internal error from Core",
    # about 1 in 10 one-chunk calls: test_async_stream_refused_while_sending_is_sent_again) is sent again
    assert 2 <= gate.attempts <= 2 + PUSHBACK_MAX_RETRIES


def test_several_replicas_send_the_refused_call_to_another(gates):
    want = _reference(gates.real.address)
    full, free = gates(refuse=-1), gates(refuse=0)
    with AdvantageClient([full.address, free.address], timeout=30, transport="unary") as client:
        for _ in range(6):
            before = full.attempts
            advantages = client.compute("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS, mask=MASK).advantages
            np.testing.assert_array_equal(np.asarray(advantages), want)
            # What the client guarantees, not how grpcio's round_robin and the call's random order fall: a call
            # reaches the full replica at most twice, its first attempt through the rotation and its own order's
            # turn there, which may come first (the client does not know which replica refused). A total of
            # `<= 6` over the six calls, asserted before, failed on CI with 8.
            assert full.attempts - before <= 2
    assert free.attempts == 6  # every call answered there, once; those sent to the full one were resent

    async def run() -> list[np.ndarray]:
        async with AsyncAdvantageClient([full.address, free.address], timeout=30, transport="unary") as client:
            return [np.asarray((await client.compute("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS,
                                                     mask=MASK)).advantages) for _ in range(6)]
    for advantages in asyncio.run(run()):
        np.testing.assert_array_equal(advantages, want)
    assert free.attempts == 12


def test_the_pushback_survives_pickling():
    import pickle
    err = AdvantageServiceError(RE, REFUSAL, pushback_s=0.25)
    again = pickle.loads(pickle.dumps(err))
    assert again.pushback_s == 0.25 and again.code == RE and str(again) == REFUSAL


def test_async_stream_refused_while_sending_is_sent_again(gates):
    """A refusal that ends a streamed call before its body is read races grpc.aio's request writer: when the
    writer's next send fails first, grpc.aio ends the call with its own INTERNAL "Internal error from Core" and
    the server's RESOURCE_EXHAUSTED and pushback are lost (seen on CI with a one-chunk body). Before: 2 of 20
    one-chunk calls and 5 of 10 sixteen-chunk calls failed INTERNAL against a server refusing twice. Now the lost
    status is sent again as a refusal is (``advantage_client.aio.status_lost``, ``Failover``): every call is
    answered, equal to the server's own answer."""
    B, T = 4096, 64  # a 1 MiB mask and the rest: 16 chunks of 64 KiB and more
    rng = np.random.default_rng(0)
    prompts, rewards = np.repeat(np.arange(B // 4), 4).astype(np.int64), rng.standard_normal(B).astype(np.float32)
    mask = np.ones((B, T), np.float32)
    with AdvantageClient(gates.real.address, timeout=30, failover=False, transport="unary") as client:
        want = np.asarray(client.compute("grpo", None, prompt_ids=prompts, rewards=rewards, mask=mask).advantages)

    async def one(gate: _Gate) -> np.ndarray:
        async with AsyncAdvantageClient(gate.address, timeout=30, transport="stream", chunk_mb=1 / 16) as client:
            return np.asarray((await client.compute("grpo", None, prompt_ids=prompts, rewards=rewards,
                                                    mask=mask)).advantages)
    for _ in range(10):
        gate = gates(refuse=2)
        np.testing.assert_array_equal(asyncio.run(one(gate)), want)
        assert gate.attempts == 3
