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


def test_an_abandoned_shm_call_drops_the_clients_region_and_the_next_call_is_right(make_server):
    srv = make_server()
    first, second = _gae(64, 1024, 0), _gae(64, 1024, 1)
    with AdvantageClient(srv.address, timeout=30.0) as c:
        want = c.compute("gae", None, transport="unary", **second).advantages
        c.compute("gae", None, **first)
        assert c.last_transport == "shm"
        region = c._shm
        c.timeout = 1e-6  # gives up before the server answers
        with pytest.raises(AdvantageServiceError) as err:
            c.compute("gae", None, **first)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert region.abandoned == "DEADLINE_EXCEEDED" and c._shm is None  # dropped: never written into again
        c.timeout = 30.0
        got = c.compute("gae", None, **second)
        assert c.last_transport == "shm" and c._shm is not region
        assert torch.equal(got.advantages, want)


def test_a_region_with_an_abandoned_call_refuses_further_calls(make_server):
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0) as c, c.shared_memory(4 << 20) as region:
        c.timeout = 1e-6
        with pytest.raises(AdvantageServiceError):
            region.compute("gae", None, **_gae(8, 256))
        c.timeout = 30.0
        with pytest.raises(RuntimeError, match="abandoned"):
            region.compute("gae", None, **_gae(8, 256))


def test_a_shrunk_segment_is_invalid_argument_not_a_crash(make_server):
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
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no shared-memory region" in str(err.value)
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
        assert value(m, "advantage_request_size_bytes_sum", method="ComputeAdvantageStream", estimator="gae") > 4 * 8 * 8
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


def test_registering_a_segment_needs_the_proof_written_into_it(make_server):
    """Nobody can register another client's segment (or any other object the server's user may open): the
    registration must carry the random bytes the registering process has just written at offset 0."""
    srv = make_server()
    with AdvantageClient(srv.address, timeout=30.0) as victim, AdvantageClient(srv.address, timeout=30.0) as other, \
            victim.shared_memory(1 << 20) as region:
        name = region.shm.name.lstrip("/")
        for proof, code in ((b"", grpc.StatusCode.INVALID_ARGUMENT), (b"x" * 65, grpc.StatusCode.INVALID_ARGUMENT),
                            (b"\0" * 32, grpc.StatusCode.PERMISSION_DENIED),
                            (bytes(region._buf[:31]) + b"?", grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(AdvantageServiceError) as err:
                other._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(name=name, byte_size=1 << 20,
                                                                                   proof=proof),
                            pb.RegisterSharedMemoryResponse)
            assert err.value.code == code, proof
        # the owner's proof (still at offset 0, nothing computed yet) works: the check is the bytes, not the caller
        reply = other._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
            name=name, byte_size=1 << 20, proof=bytes(region._buf[:32])), pb.RegisterSharedMemoryResponse)
        assert reply.region_id
        assert region.compute("gae", None, **_gae(4, 8)).advantages.shape == (4, 8)
