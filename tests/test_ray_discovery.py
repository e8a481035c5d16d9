"""The Ray-following clients' decisions, without a Ray cluster: the look-up (``replica_infos``) is scripted, the
inner client is a fake whose calls fail UNAVAILABLE as a replica that was killed does. The real-cluster
twins of these scenarios are in test_ray.py."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from advantage_client import ray_discovery
from advantage_client.errors import AdvantageServiceError

ADDRESS = "10.0.0.1:50051"


def info(pid: int, address: str = ADDRESS, started_at: float = 0.0) -> dict:
    return {"index": 0, "address": address, "pid": pid, "node_id": "n1", "started_at": started_at,
            "serving": True, "state": "ALIVE"}


class Script:
    """``replica_infos`` answering each look-up from a list (the last answer repeats)."""

    def __init__(self, *answers: list[dict]):
        self.answers, self.calls = list(answers), 0

    def __call__(self, *args, **kwargs) -> list[dict]:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class FakeClient:
    """An inner client: ``compute`` fails UNAVAILABLE while ``down`` holds its addresses, else answers them."""

    down: set[str] = set()
    built: list["FakeClient"] = []

    def __init__(self, addresses: list[str], **kwargs):
        self.addresses, self.timeout, self.closed = list(addresses), kwargs.get("timeout", 5.0), False
        self.channel_options = kwargs.get("channel_options")
        FakeClient.built.append(self)

    def _answer(self) -> list[str]:
        if set(self.addresses) & FakeClient.down:
            raise AdvantageServiceError(grpc.StatusCode.UNAVAILABLE, "connections to all backends failing")
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


@pytest.fixture(autouse=True)
def fresh():
    FakeClient.down, FakeClient.built = set(), []


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
