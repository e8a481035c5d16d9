"""transport="auto": shared memory with a server on this host (probed once, the answer remembered), else the
stream for large requests and one message for small ones; every failure of the probe falls back silently
(other host, UNIMPLEMENTED, no token, a region the server forgot), and never twice."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import torch

from advantage_client import AdvantageClient, shm
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client.client import AdvantageServiceError
from advantage_client.streaming import COMPUTE
from advantage_server import transport
from advantage_server.errors import InvalidInput


def _batch(B: int, T: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(rewards=torch.randn(B, generator=g), mask=(torch.rand(B, T, generator=g) > 0.1).float(),
                values=torch.randn(B, T, generator=g))


class _Counter:
    """Counts the registrations a client starts (RegisterSharedMemory calls without proof: the first of the
    two calls a registration takes)."""

    def __init__(self, client: AdvantageClient, monkeypatch):
        self.n = 0
        original = client._call

        def counted(method, *args, **kwargs):
            if method == "RegisterSharedMemory" and not args[0].proof:
                self.n += 1
            return original(method, *args, **kwargs)
        monkeypatch.setattr(client, "_call", counted)


def test_auto_uses_shared_memory_on_the_same_host_and_registers_once(make_server, monkeypatch):
    srv = make_server()
    tensors = _batch(8, 4096)  # 256 KiB: above shm_min_mb
    with AdvantageClient(srv.address, timeout=30.0) as c:
        count = _Counter(c, monkeypatch)
        ref = c.compute("gae", {"gae_lambda": 0.9}, transport="unary", **tensors)
        assert count.n == 0 and c.last_transport == "unary"  # an explicit transport never probes
        for _ in range(3):
            got = c.compute("gae", {"gae_lambda": 0.9}, **tensors)
            assert c.last_transport == "shm"
            assert torch.equal(got.advantages, ref.advantages) and torch.equal(got.returns, ref.returns)
        assert count.n == 1 and c._shm_works is True


def test_auto_falls_back_when_the_server_cannot_open_the_segment(make_server, monkeypatch):
    """A server on another host (or in another container) answers INVALID_ARGUMENT: cannot open the segment."""
    def remote(self, name, size, key):
        raise InvalidInput("name", f"cannot open shared-memory segment {name!r} on the server's host")
    monkeypatch.setattr(transport.Region, "__init__", remote)
    monkeypatch.setenv("ADVANTAGE_SHM_MEMFD", "0")  # one registration per try (a memfd refused is retried as POSIX)
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0, stream_threshold_mb=1) as c:
        count = _Counter(c, monkeypatch)
        small, large = _batch(2, 8), _batch(64, 4096)  # 2 MiB: above the 1 MiB stream threshold
        ref_small = c.compute("gae", None, transport="unary", **small)
        got = c.compute("gae", None, **small)
        assert c.last_transport == "unary" and torch.equal(got.advantages, ref_small.advantages)
        got = c.compute("gae", None, **large)
        assert c.last_transport == "stream"
        assert torch.equal(got.advantages, c.compute("gae", None, transport="unary", **large).advantages)
        c.compute("gae", None, **small)
        assert count.n == 1 and c._shm_works is False and c._shm is None


def _old_server(real_address: str):
    """A server that only knows ComputeAdvantage (an older release): every other method is UNIMPLEMENTED."""
    channel = grpc.insecure_channel(real_address)
    forward = channel.unary_unary(COMPUTE, request_serializer=None, response_deserializer=None)

    def compute(data, context):
        return forward(data, timeout=30)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("advantage.v1.AdvantageService", {
        "ComputeAdvantage": grpc.unary_unary_rpc_method_handler(compute)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, channel, f"127.0.0.1:{port}"


def test_auto_falls_back_on_unimplemented(make_server, monkeypatch):
    srv = make_server()
    old, channel, address = _old_server(srv.address)
    try:
        with AdvantageClient(address, timeout=30.0) as c:
            count = _Counter(c, monkeypatch)
            tensors = _batch(8, 4096)
            for _ in range(3):
                got = c.compute("gae", None, **tensors)
                assert c.last_transport == "unary" and got.advantages.shape == (8, 4096)
            assert count.n == 1 and c._shm_works is False
            with pytest.raises(AdvantageServiceError) as err:  # an explicit choice is not second-guessed
                c.compute("gae", None, transport="shm", **tensors)
            assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    finally:
        old.stop(grace=1.0)
        channel.close()


def test_auto_without_the_token_fails_like_any_call_and_does_not_retry_the_probe(make_server, monkeypatch):
    srv = make_server(auth_token="s3cret")
    with AdvantageClient(srv.address, timeout=30.0) as c:
        count = _Counter(c, monkeypatch)
        for _ in range(2):
            with pytest.raises(AdvantageServiceError) as err:
                c.compute("gae", None, **_batch(8, 4096))
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert count.n == 1 and c._shm_works is False
    with AdvantageClient(srv.address, timeout=30.0, token="s3cret") as c:
        c.compute("gae", None, **_batch(8, 4096))
        assert c.last_transport == "shm"


def test_auto_registers_a_forgotten_region_again_within_the_call(make_server):
    """The server forgot the region (as after a restart: unregistered behind the client's back): the next call
    registers the same segment again and is resent over shared memory, with the right values, as many times as
    it happens (more than MAX_SHM_FORGOTTEN). Before: the call went unary, and after MAX_SHM_FORGOTTEN times
    shared memory was off for the client's lifetime."""
    from advantage_client.client import MAX_SHM_FORGOTTEN
    srv = make_server()
    tensors = _batch(8, 4096)
    with AdvantageClient(srv.address, timeout=30.0) as c:
        ref = c.compute("gae", None, transport="unary", **tensors)
        c.compute("gae", None, **tensors)
        assert c.last_transport == "shm"
        region = c._shm
        for n in range(1, MAX_SHM_FORGOTTEN + 3):
            old = region.region_id
            c._call("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(region_id=old, key=region.key),
                    pb.UnregisterSharedMemoryResponse)
            got = c.compute("gae", None, **tensors)
            assert c.last_transport == "shm" and torch.equal(got.advantages, ref.advantages), n
            assert c._shm is region and region.reregistered == n and region.region_id != old
            assert c._shm_works is True and c.shm_region_count == 1


def test_auto_gives_up_after_regions_that_cannot_be_registered_again(make_server, monkeypatch):
    """A region the server never knew (another replica behind one address answered) whose registration again
    also fails: the call is sent again without shared memory (right values), the next call registers a new
    region, and after MAX_SHM_FORGOTTEN such answers the client stops using shared memory."""
    from advantage_client.client import MAX_SHM_FORGOTTEN
    srv = make_server()
    tensors = _batch(8, 4096)
    with AdvantageClient(srv.address, timeout=30.0) as c:
        ref = c.compute("gae", None, **tensors)
        assert c.last_transport == "shm"
        original = shm.SharedMemoryRegion._register

        def refused(region):  # the proof reaches another replica: PERMISSION_DENIED
            raise AdvantageServiceError(grpc.StatusCode.PERMISSION_DENIED, "another replica")
        for n in range(1, MAX_SHM_FORGOTTEN + 1):
            region = c._shm
            c._call("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(region_id=region.region_id,
                                                                               key=region.key),
                    pb.UnregisterSharedMemoryResponse)
            monkeypatch.setattr(shm.SharedMemoryRegion, "_register", refused)
            got = c.compute("gae", None, **tensors)
            monkeypatch.setattr(shm.SharedMemoryRegion, "_register", original)
            assert c.last_transport == "unary" and torch.equal(got.advantages, ref.advantages)
            assert c._shm is None
            if n < MAX_SHM_FORGOTTEN:
                assert c._shm_works is None
                got = c.compute("gae", None, **tensors)  # a new region
                assert c.last_transport == "shm" and torch.equal(got.advantages, ref.advantages)
        assert c._shm_works is False
        c.compute("gae", None, **tensors)
        assert c.last_transport == "unary"


def test_auto_is_not_tried_when_the_server_is_unreachable_and_tries_later(make_server):
    srv = make_server()
    address = srv.address
    srv.stop(grace=0.5)
    with AdvantageClient(address, timeout=5.0, retry=False) as c:
        with pytest.raises(AdvantageServiceError) as err:
            c.compute("gae", None, **_batch(8, 4096))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert c._shm_works is None  # transient: not remembered


def test_auto_size_limits_and_busy_region(make_server, monkeypatch):
    srv = make_server()
    small, large = _batch(2, 8), _batch(64, 4096)  # ~0.0 MiB and 2 MiB
    with AdvantageClient(srv.address, timeout=30.0, shm_min_mb=0.5, shm_max_mb=1, stream_threshold_mb=1) as c:
        c.compute("gae", None, **small)
        assert c.last_transport == "unary"  # below shm_min_mb
        c.compute("gae", None, **large)
        assert c.last_transport == "stream"  # above shm_max_mb
        assert c._shm_works is None  # never needed
    with AdvantageClient(srv.address, timeout=30.0) as c:
        c.compute("gae", None, **small)
        assert c.last_transport == "unary" and c._shm_works is None  # below the default shm_min_mb: no probe
        mid = _batch(8, 4096)
        c.compute("gae", None, **mid)
        assert c.last_transport == "shm"
        c.shm_regions = 1  # a pool of one region, which another thread is using: this call does not wait for it
        held = c._shm_take(0)
        try:
            c.compute("gae", None, **mid)
            assert c.last_transport == "unary"
        finally:
            c._shm_give(held)
        monkeypatch.setattr(shm, "room_for", lambda nbytes, path="/dev/shm": False)
        if shm.memfd_supported():  # a sealed memfd does not live in /dev/shm: its room does not bound it
            c.compute("gae", None, **large)
            assert c.last_transport == "shm"
            monkeypatch.setattr(shm, "memfd_supported", lambda: False)  # POSIX segments from here on
            large = _batch(128, 4096)  # larger than the region just made
        c.compute("gae", None, **large)  # the region must grow, /dev/shm has no room: not this time
        assert c.last_transport == "unary" and c._shm_works is True


def test_auto_from_many_threads(make_server):
    srv = make_server()
    tensors = [_batch(8, 2048 * (1 + seed % 3), seed) for seed in range(8)]  # 128-384 KiB: shm, growing
    with AdvantageClient(srv.address, timeout=60.0) as c:
        refs = [c.compute("gae", None, transport="unary", **t) for t in tensors]
        errors = []

        def work(i):
            try:
                for _ in range(5):
                    got = c.compute("gae", None, **tensors[i])
                    assert torch.equal(got.advantages, refs[i].advantages)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors


def test_several_replicas_never_use_shared_memory(make_server):
    a, b = make_server(), make_server()
    with AdvantageClient([a.address, b.address], timeout=30.0) as c:
        c.compute("gae", None, **_batch(2, 4))
        assert c.last_transport == "unary" and c._shm_works is False


def test_auto_region_fits_results_larger_than_the_inputs(make_server):
    """A bool mask's float64 result is 8x its bytes: the region is sized from the outputs, not the inputs."""
    srv = make_server()
    B, T = 256, 4096
    g = torch.Generator().manual_seed(3)
    tensors = dict(prompt_ids=torch.arange(B) // 4, rewards=torch.randn(B, generator=g),
                   mask=torch.rand(B, T, generator=g) > 0.2)
    with AdvantageClient(srv.address, timeout=60.0) as c:
        ref = c.compute("grpo", None, transport="stream", output_dtype="float64", **tensors)
        got = c.compute("grpo", None, output_dtype="float64", **tensors)
        assert c.last_transport == "shm" and torch.equal(got.advantages, ref.advantages)
        got = c.compute("grpo", None, transport="shm", **tensors)  # explicit shm sizes its region the same way
        assert torch.equal(got.advantages, ref.advantages.float())


def test_auto_result_that_does_not_fit_is_sent_again(make_server, monkeypatch):
    srv = make_server()
    tensors = _batch(8, 4096)
    with AdvantageClient(srv.address, timeout=30.0) as c:
        ref = c.compute("gae", None, transport="unary", **tensors)
        monkeypatch.setattr(AdvantageClient, "_shm_need", staticmethod(lambda kwargs: 300 << 10))  # inputs fit, results not
        got = c.compute("gae", None, **tensors)
        assert c.last_transport == "unary" and torch.equal(got.advantages, ref.advantages)
