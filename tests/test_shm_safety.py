"""Shared memory and streaming under the failure paths a reviewer found: an abandoned call must not corrupt a
later one, a shrunk segment must not crash the server, leaked regions are forgotten, the stream is observed
like the unary calls, and the stream size cap is the operator's --max-stream-mb only."""
from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_server import create_server

from test_metrics import scrape, value


def _gae(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"rewards": torch.randn(B, generator=g), "mask": (torch.rand(B, T, generator=g) < 0.8).float(),
            "values": torch.randn(B, T, generator=g)}


def _abandon(c: AdvantageClient, region, tensors) -> None:
    """Run past a 1 us deadline on ``region``: almost always the first call; one answered within it (rare) is
    right and leaves the region usable, and the next one tries again."""
    c.timeout = 1e-6
    for _ in range(50):
        try:
            region.compute("gae", None, **tensors)
        except AdvantageServiceError as err:
            assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert region.abandoned == "DEADLINE_EXCEEDED"
            return
        assert not region.abandoned
    pytest.fail("no call ran past a 1 us deadline in 50 tries")


def test_an_abandoned_shm_call_drops_the_clients_region_and_the_next_call_is_right(make_server):
    srv = make_server()
    first, second = _gae(64, 1024, 0), _gae(64, 1024, 1)
    with AdvantageClient(srv.address, timeout=30.0) as c:
        want = c.compute("gae", None, transport="unary", **second).advantages
        want_first = c.compute("gae", None, **first).advantages
        assert c.last_transport == "shm"
        c.timeout = 1e-6  # gives up before the server answers (almost always: a call that made it in time is
        for _ in range(50):  # answered right, on its region, and the next one tries again)
            region = c._shm
            try:
                got = c.compute("gae", None, **first)
            except AdvantageServiceError as exc:
                error = exc
                break
            assert not region.abandoned
            assert torch.equal(got.advantages, want_first)
        else:
            pytest.fail("no call ran past a 1 us deadline in 50 tries")
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert region.abandoned == "DEADLINE_EXCEEDED" and c._shm is None  # dropped: never written into again
        c.timeout = 30.0
        got = c.compute("gae", None, **second)
        assert c.last_transport == "shm" and c._shm is not region
        assert torch.equal(got.advantages, want)


def test_a_region_with_an_abandoned_call_refuses_further_calls(make_server):
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0) as c, c.shared_memory(4 << 20) as region:
        _abandon(c, region, _gae(8, 256))
        c.timeout = 30.0
        with pytest.raises(RuntimeError, match="abandoned"):
            region.compute("gae", None, **_gae(8, 256))


def test_a_shrunk_segment_is_invalid_argument_not_a_crash(make_server, monkeypatch):
    monkeypatch.setenv("ADVANTAGE_SHM_MEMFD", "0")  # a POSIX segment: a sealed memfd cannot shrink (test_shm_memfd.py)
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0) as c:
        region = c.shared_memory(4 << 20)
        try:
            placed = {}
            for k, v in _gae(8, 256).items():  # written before the segment shrinks: the client never touches it after
                placed[k] = region.empty(tuple(v.shape), v.dtype)
                placed[k].copy_(v)
            os.ftruncate(region.shm._fd, 4096)
            with pytest.raises(AdvantageServiceError) as err:
                region.compute("gae", None, copy=False, **placed)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "fewer than the" in str(err.value) and "registered" in str(err.value)
            os.ftruncate(region.shm._fd, region.size)
        finally:
            region.close()
        # the server is still there
        assert c.compute("gae", None, transport="unary", **_gae(4, 8)).advantages.shape == (4, 8)


def test_regions_whose_segment_is_gone_are_forgotten_at_the_next_registration(make_server):
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0) as c:
        leaked = c.shared_memory(1 << 20)
        leaked.shm.unlink()  # the client went away without unregistering (its resource tracker unlinks)
        with c.shared_memory(1 << 20) as fresh:
            assert fresh.compute("gae", None, **_gae(4, 8)).advantages.shape == (4, 8)
        with pytest.raises(AdvantageServiceError) as err:  # the server no longer knows the leaked region
            leaked.compute("gae", None, **_gae(4, 8))
        # NOT_FOUND (unknown region); registering the unlinked segment again fails, as it must
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "registering the segment again failed" in str(err.value)
        leaked._buf = None  # already unlinked and unknown to the server: only the mapping is left to close
        leaked.shm.close()


def test_streamed_and_shm_calls_are_counted_with_their_estimator_and_echo_a_request_id():
    srv = create_server("127.0.0.1", 0, device="cpu", metrics_port=0).start()
    try:
        with AdvantageClient(srv.address, timeout=30.0) as c:
            c.compute("gae", None, transport="stream", **_gae(4, 8))
            c.compute("gae", None, transport="shm", **_gae(4, 8))
        channel = grpc.insecure_channel(srv.address)
        try:  # an empty stream: INVALID_ARGUMENT, with the caller's request id echoed
            stream = channel.stream_stream("/advantage.v1.AdvantageService/ComputeAdvantageStream",
                                           request_serializer=None, response_deserializer=None)
            call = stream(iter([]), timeout=10.0, metadata=(("x-request-id", "abc-123"),))
            with pytest.raises(grpc.RpcError):
                list(call)
            assert call.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(call.trailing_metadata()).get("x-request-id") == "abc-123"
        finally:
            channel.close()
        m = scrape(srv.metrics.port)
        assert value(m, "advantage_requests_total", method="ComputeAdvantageStream", estimator="gae", code="OK") == 1
        assert value(m, "advantage_requests_total", method="ComputeAdvantageShm", estimator="gae", code="OK") == 1
        assert value(m, "advantage_requests_total", method="ComputeAdvantageStream", estimator="none",
                     code="INVALID_ARGUMENT") == 1
        assert value(m, "advantage_request_size_bytes_count", method="ComputeAdvantageStream", estimator="gae") == 1
        # values [4, 8] float32 + the 0/1 mask, which the client sends as one byte per token
        assert value(m, "advantage_request_size_bytes_sum", method="ComputeAdvantageStream", estimator="gae") > 4 * 8 * 5
    finally:
        srv.stop(grace=1.0)


def test_the_stream_cap_is_the_operators_max_stream_mb_only(make_server):
    """No hidden default below or above --max-stream-mb: a declared size just above it is refused naming it."""
    from advantage_client import codec
    srv = make_server(max_stream_mb=1)
    channel = grpc.insecure_channel(srv.address)
    try:
        call = channel.stream_stream("/advantage.v1.AdvantageService/ComputeAdvantageStream",
                                     request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([codec.encode_chunk((1 << 20) + 1, memoryview(b"x"))]), timeout=10.0))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-stream-mb=1 " in err.value.details()
    finally:
        channel.close()


@pytest.mark.parametrize("transport", ["unary", "stream", "shm", "auto"])
@pytest.mark.parametrize("as_numpy", [False, True])
def test_results_are_writable_whichever_transport_brought_them(client, transport, as_numpy):
    tensors = _gae(4, 8)
    r = client.compute("gae", None, transport=transport, as_numpy=as_numpy, **tensors)
    before = r.advantages.copy() if as_numpy else r.advantages.clone()
    r.advantages *= 2  # numpy raises "output array is read-only" on a view of immutable bytes
    assert (r.advantages == 2 * before).all()
    again = client.compute("gae", None, transport=transport, as_numpy=as_numpy, **tensors)
    assert (again.advantages == before).all()  # nothing shared between calls


def test_auto_sends_one_message_when_the_server_refuses_the_stream(make_server):
    srv = make_server(max_stream_mb=1)
    tensors = _gae(64, 8192)  # 4 MiB: above the stream threshold set below
    with AdvantageClient(srv.address, timeout=30.0, stream_threshold_mb=2, shm_max_mb=0) as c:
        got = c.compute("gae", None, **tensors)
        assert c.last_transport == "unary"
        with pytest.raises(AdvantageServiceError) as err:  # an explicit choice is not second-guessed
            c.compute("gae", None, transport="stream", **tensors)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert torch.equal(got.advantages, c.compute("gae", None, transport="unary", **tensors).advantages)


def test_registering_a_segment_needs_the_servers_challenge_written_into_it(make_server):
    """Nobody can register a segment they cannot write (another client's, or any other object the server's
    user may open): registration hands out a challenge, and only a segment holding that challenge at offset 0
    gets a region. Guessable bytes (zeros, whatever the segment held) do not pass."""
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0) as victim, AdvantageClient(srv.address, timeout=30.0) as other, \
            victim.shared_memory(1 << 20) as region:
        name = region.shm.name.lstrip("/")

        def register(proof: bytes = b"") -> pb.RegisterSharedMemoryResponse:
            return other._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(name=name, byte_size=1 << 20,
                                                                                      proof=proof),
                               pb.RegisterSharedMemoryResponse)

        first = register()
        assert len(first.challenge) == 32 and not first.region_id and not first.key
        for proof in (first.challenge, b"\0" * 32, bytes(region._buf[:32])):  # challenge not written / guessed
            with pytest.raises(AdvantageServiceError) as err:
                register(proof)
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, proof
        again = register()
        region._buf[:32] = np.frombuffer(again.challenge, np.uint8)  # written by someone who can write it
        with pytest.raises(AdvantageServiceError):  # a used-up challenge does not count twice
            register(first.challenge)
        assert register(again.challenge).region_id
        with pytest.raises(AdvantageServiceError) as err:
            register(again.challenge)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert region.compute("gae", None, **_gae(4, 8)).advantages.shape == (4, 8)

def test_closing_an_abandoned_region_makes_no_call(make_server, monkeypatch):
    """The server may be gone when a call was abandoned: cleanup must not wait for it."""
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0) as c:
        region = c.shared_memory(1 << 20)
        _abandon(c, region, _gae(4, 8))
        calls = []
        monkeypatch.setattr(c, "_call", lambda method, *a, **k: calls.append(method))
        region.close()
        assert calls == [] and region._buf is None


def test_a_float_max_message_mb_is_accepted(target):
    with AdvantageClient(target, timeout=30.0, max_message_mb=64.5) as c:
        assert c.max_message_bytes == int(64.5 * (1 << 20))
        assert c.compute("gae", None, transport="unary", **_gae(4, 8)).advantages.shape == (4, 8)


def test_a_stream_cut_by_the_clients_deadline_is_counted_as_such():
    import time as _time
    from advantage_client import codec
    srv = create_server("127.0.0.1", 0, device="cpu", metrics_port=0).start()
    channel = grpc.insecure_channel(srv.address)
    try:
        stream = channel.stream_stream("/advantage.v1.AdvantageService/ComputeAdvantageStream",
                                       request_serializer=None, response_deserializer=None)

        def slow():
            yield codec.encode_chunk(1 << 20, memoryview(b"x" * 1000))
            _time.sleep(2.0)

        with pytest.raises(grpc.RpcError) as err:
            list(stream(slow(), timeout=0.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = _time.monotonic() + 10
        while _time.monotonic() < deadline:  # the server notices when its handler returns
            m = scrape(srv.metrics.port)
            counted = {dict(k)["code"]: v for k, v in m.get("advantage_requests_total", {}).items()
                       if dict(k).get("method") == "ComputeAdvantageStream"}
            if counted:
                break
            _time.sleep(0.1)
        assert counted == {"DEADLINE_EXCEEDED": 1.0}
    finally:
        channel.close()
        srv.stop(grace=1.0)
