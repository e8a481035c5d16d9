"""The Ray-following clients' decisions, without a Ray cluster: the look-up (``replica_infos``, and
``replica_token``) is scripted, the inner client is a fake whose calls fail UNAVAILABLE as a replica that was
killed does, or DEADLINE_EXCEEDED as one that hangs does. The real-cluster twins of these scenarios are in
test_ray.py."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from advantage_client import ray_discovery
from advantage_client.errors import AdvantageServiceError

ADDRESS = "10.0.0.1:50051"
OTHER = "10.0.0.2:50051"


def info(pid: int, address: str = ADDRESS, started_at: float = 0.0) -> dict:
    return {"index": 0, "address": address, "pid": pid, "node_id": "n1", "started_at": started_at,
            "serving": True, "state": "ALIVE"}


def pending(index: int = 1) -> dict:
    return {"index": index, "state": "PENDING"}


class Script:
    """``replica_infos`` answering each look-up from a list (the last answer repeats)."""

    def __init__(self, *answers: list[dict]):
        self.answers, self.calls = list(answers), 0

    def __call__(self, *args, **kwargs) -> list[dict]:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class FakeClient:
    """An inner client: ``compute`` fails UNAVAILABLE while ``down`` holds its addresses, DEADLINE_EXCEEDED while
    ``hung`` does (round_robin would send it a share of the calls), else answers them."""

    down: set[str] = set()
    hung: set[str] = set()
    built: list["FakeClient"] = []

    def __init__(self, addresses: list[str], **kwargs):
        self.addresses, self.timeout, self.closed = list(addresses), kwargs.get("timeout", 5.0), False
        self.channel_options = kwargs.get("channel_options")
        self.token, self.token_file = kwargs.get("token"), kwargs.get("token_file")
        FakeClient.built.append(self)

    def _answer(self) -> list[str]:
        if set(self.addresses) & FakeClient.down:
            raise AdvantageServiceError(grpc.StatusCode.UNAVAILABLE, "connections to all backends failing")
        if set(self.addresses) & FakeClient.hung:
            raise AdvantageServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return self.addresses

    def compute(self, *args, **kwargs):
        return self._answer()

    def close(self) -> None:
        self.closed = True


class AsyncFakeClient(FakeClient):
    async def compute(self, *args, **kwargs):
        return self._answer()

    async def close(self) -> None:
        self.closed = True


class TokenScript:
    """``replica_token``: what the replicas hand out (None: no generated token), counting the asks."""

    def __init__(self, token: str | None):
        self.token, self.calls = token, 0

    def __call__(self, *args, **kwargs) -> str | None:
        self.calls += 1
        return self.token


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    FakeClient.down, FakeClient.hung, FakeClient.built = set(), set(), []
    monkeypatch.setattr(ray_discovery, "replica_token", TokenScript(None))


def until(predicate, timeout: float, what: str) -> None:
    """``predicate`` true within ``timeout`` seconds (generous: a background look-up on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.01)


def test_replica_restarted_on_its_fixed_port_gets_the_failed_call_resent(monkeypatch):
    """The replica's process died and Ray restarted it on the same --port before the client's first look-up:
    same address, new pid. Before, the look-up found "the same replicas alive" and the UNAVAILABLE stood; now
    the client is rebuilt (a fresh channel) and the call goes once more, to the restarted process."""
    script = Script([info(pid=100)], [info(pid=200, started_at=5.0)])
    monkeypatch.setattr(ray_discovery, "replica_infos", script)
    client = ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0)
    try:
        first = FakeClient.built[0]
        FakeClient.down = {ADDRESS}  # the old process's channel: the call fails as gRPC's retries run out
        # the new client built after the look-up reaches the restarted process
        original = FakeClient._answer

        def answer(self):
            if self is first:
                return original(self)
            return self.addresses
        monkeypatch.setattr(FakeClient, "_answer", answer)
        assert client.compute("grpo") == [ADDRESS]
        assert len(FakeClient.built) == 2 and first.closed, "a new client on the same address, the old closed"
        assert client.addresses == [ADDRESS]
        # each client gets connections of its own: with gRPC's process-wide pool the new client would reuse the
        # old one's connection to the address, still in its reconnect backoff
        for built in FakeClient.built:
            assert ("grpc.use_local_subchannel_pool", 1) in built.channel_options
    finally:
        client.close()


def test_same_process_answering_unavailable_itself_is_not_resent(monkeypatch):
    """The same replica process at the same address (it is draining, say) answered UNAVAILABLE: no new client
    and no second try (it would answer the same)."""
    monkeypatch.setattr(ray_discovery, "replica_infos", Script([info(pid=100)]))
    client = ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0)
    try:
        FakeClient.down = {ADDRESS}
        with pytest.raises(AdvantageServiceError) as err:
            client.compute("grpo")
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(FakeClient.built) == 1
    finally:
        client.close()


def test_periodic_refresh_follows_a_restart_on_the_same_address(monkeypatch):
    script = Script([info(pid=100)], [info(pid=100)], [info(pid=300, started_at=9.0)])
    monkeypatch.setattr(ray_discovery, "replica_infos", script)
    client = ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0,
                                     channel_options=[("grpc.keepalive_time_ms", 20_000)])
    try:
        assert FakeClient.built[0].channel_options == (("grpc.keepalive_time_ms", 20_000),
                                                      ("grpc.use_local_subchannel_pool", 1))  # the caller's kept
        assert client.refresh() is False  # the same process: nothing to do
        assert client.refresh() is True   # restarted in place: a fresh client
        assert len(FakeClient.built) == 2 and FakeClient.built[0].closed and client.addresses == [ADDRESS]
    finally:
        client.close()


def test_asyncio_twin_resends_after_a_restart_on_the_same_address(monkeypatch):
    monkeypatch.setattr(ray_discovery, "replica_infos", Script([info(pid=100)], [info(pid=200, started_at=5.0)]))

    async def main():
        client = await ray_discovery.AsyncRayClient.create(AsyncFakeClient, refresh_s=None, timeout=5.0)
        first = FakeClient.built[0]
        FakeClient.down = {ADDRESS}
        original = FakeClient._answer
        monkeypatch.setattr(FakeClient, "_answer", lambda self: original(self) if self is first else self.addresses)
        try:
            assert await client.compute("grpo") == [ADDRESS]
            assert len(FakeClient.built) == 2 and first.closed
        finally:
            await client.close()

    asyncio.run(main())


def test_deadline_exceeded_starts_a_look_up_that_drops_the_hung_replica(monkeypatch):
    """Replica OTHER hangs (SIGSTOPped): its calls fail DEADLINE_EXCEEDED and its ``info()`` no longer answers
    (PENDING). No periodic look-up here (refresh_s=None): only the failed call can start the look-up that drops
    it. The error itself is raised as it is (not retried), and the next call goes to the replica left."""
    script = Script([info(pid=100), {**info(pid=200, address=OTHER), "index": 1}], [info(pid=100), pending()])
    monkeypatch.setattr(ray_discovery, "replica_infos", script)
    client = ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0)
    try:
        assert client.addresses == [ADDRESS, OTHER]
        FakeClient.hung = {OTHER}
        with pytest.raises(AdvantageServiceError) as err:
            client.compute("grpo")
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        until(lambda: client.addresses == [ADDRESS], 10, "the look-up the timed-out call started drops OTHER")
        assert script.calls == 2 and FakeClient.built[0].closed
        assert client.compute("grpo") == [ADDRESS]
    finally:
        client.close()


def test_a_look_up_after_deadline_exceeded_runs_one_at_a_time(monkeypatch):
    """Many calls timing out together start one look-up, not one each (the look-up waits on Ray)."""
    gate = threading.Event()

    class Slow(Script):
        def __call__(self, *args, **kwargs):
            if self.calls:
                gate.wait(10)
            return super().__call__(*args, **kwargs)

    script = Slow([info(pid=100), {**info(pid=200, address=OTHER), "index": 1}], [info(pid=100), pending()])
    monkeypatch.setattr(ray_discovery, "replica_infos", script)
    client = ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0)
    try:
        FakeClient.hung = {OTHER}
        for _ in range(5):
            with pytest.raises(AdvantageServiceError):
                client.compute("grpo")
        gate.set()
        until(lambda: client.addresses == [ADDRESS], 10, "the hung replica dropped")
        assert script.calls == 2  # the first look-up, then one for the five timed-out calls
    finally:
        gate.set()
        client.close()


def test_asyncio_twin_drops_the_hung_replica_after_deadline_exceeded(monkeypatch):
    script = Script([info(pid=100), {**info(pid=200, address=OTHER), "index": 1}], [info(pid=100), pending()])
    monkeypatch.setattr(ray_discovery, "replica_infos", script)

    async def main():
        client = await ray_discovery.AsyncRayClient.create(AsyncFakeClient, refresh_s=None, timeout=5.0)
        try:
            FakeClient.hung = {OTHER}
            with pytest.raises(AdvantageServiceError) as err:
                await client.compute("grpo")
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 10
            while client.addresses != [ADDRESS]:
                assert time.monotonic() < deadline, "the hung replica was not dropped"
                await asyncio.sleep(0.01)
            assert await client.compute("grpo") == [ADDRESS]
        finally:
            await client.close()

    asyncio.run(main())


def test_the_generated_token_is_read_from_the_replicas_when_none_is_given(monkeypatch):
    """``advantage-ray up`` without --auth-token-file: the client built by from_ray carries the token the
    replicas hand out (and every client rebuilt after a look-up too); a token or token file given wins."""
    monkeypatch.setattr(ray_discovery, "replica_infos", Script([info(pid=100)], [info(pid=200, started_at=1.0)]))
    tokens = TokenScript("generated-token")
    monkeypatch.setattr(ray_discovery, "replica_token", tokens)
    with ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0) as client:
        assert FakeClient.built[0].token == "generated-token"
        assert client.refresh() is True and FakeClient.built[1].token == "generated-token"
    for given in ({"token": "mine"}, {"token_file": "/etc/advantage/token"}):
        with ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0, **given):
            assert (FakeClient.built[-1].token, FakeClient.built[-1].token_file) == (
                given.get("token"), given.get("token_file"))
    assert tokens.calls == 1  # asked only when no token was given


def test_no_generated_token_leaves_the_client_without_one(monkeypatch):
    monkeypatch.setattr(ray_discovery, "replica_infos", Script([info(pid=100)]))
    with ray_discovery.RayClient(FakeClient, refresh_s=None, timeout=5.0):
        assert FakeClient.built[0].token is None
