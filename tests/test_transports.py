"""The transports (codec unary, client streaming, shared memory) give the same results as the plain path,
on every NeMo RL golden case and on a batch of tens of MiB, and refuse what they must."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, RemoteAdvantageEstimator, codec
from advantage_client.client import AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client.streaming import COMPUTE_STREAM
from advantage_server import create_server, transport

from conftest import assert_close_to_golden, golden_cases, load_case
from test_golden_nemo import nemo_kwargs

CASES = golden_cases("nemo-rl")
TRANSPORTS = ["unary", "stream", "shm"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def tclient(request, target):
    with AdvantageClient(target, timeout=60.0, transport=request.param, chunk_mb=1) as c:
        yield c


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_nemo_golden_over_every_transport(path, tclient, target):
    case = load_case(path)
    estimator = RemoteAdvantageEstimator(target, case["estimator"], case["config"], client=tclient,
                                         result_format="advantage_result")
    result = estimator.compute_advantage(**nemo_kwargs(case))
    assert_close_to_golden(result.advantages.numpy(), case, "advantages")
    if case["expected"]["returns"] is None:
        assert result.returns is None
    else:
        assert_close_to_golden(result.returns.numpy(), case, "returns")
    for key, want in case["expected"]["metrics"].items():
        assert abs(result.metrics[key] - want) <= 1e-5 + 1e-4 * abs(want), key


def _batch(B: int, T: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.1).float()
    return dict(rewards=torch.randn(B, generator=g), mask=mask, values=torch.randn(B, T, generator=g))


def test_large_batch_is_identical_over_every_transport(target):
    tensors = _batch(256, 16384)  # 2 x 16 MiB in, 2 x 16 MiB out: many 1 MiB chunks each way
    with AdvantageClient(target, timeout=120.0, chunk_mb=1) as c:
        ref = c.compute("gae", {"gae_lambda": 0.9}, transport="unary", **tensors)
        for name in ("stream", "shm", "auto"):
            got = c.compute("gae", {"gae_lambda": 0.9}, transport=name, **tensors)
            assert torch.equal(got.advantages, ref.advantages) and torch.equal(got.returns, ref.returns), name


def test_auto_picks_stream_above_the_threshold(target, monkeypatch):
    seen = []
    with AdvantageClient(target, timeout=60.0, stream_threshold_mb=0.01, shm_max_mb=0) as c:  # no shm
        for name in ("unary", "stream"):
            original = getattr(c._calls, name)
            monkeypatch.setattr(c._calls, name, lambda data, _o=original, _n=name, **kw: seen.append(_n) or _o(data, **kw))
        c.compute("gae", None, **_batch(2, 4))
        c.compute("gae", None, **_batch(64, 256))
    assert seen == ["unary", "stream"]


def test_bad_transport_name_is_refused(target):
    with pytest.raises(ValueError):
        AdvantageClient(target, transport="carrier-pigeon")


# ----------------------------------------------------------------------------------- streaming
def _raw_stream(target, chunks):
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(COMPUTE_STREAM, request_serializer=None, response_deserializer=codec.decode_chunk)
        return list(call(iter(chunks), timeout=30))


def test_stream_total_size_cap_is_resource_exhausted(target, monkeypatch):
    monkeypatch.setattr(transport.TransportMethods, "max_stream_bytes", 1000)
    with AdvantageClient(target, timeout=30.0) as c:
        with pytest.raises(AdvantageServiceError) as err:
            c.compute("gae", None, transport="stream", **_batch(8, 64))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit" in str(err.value)


@pytest.mark.parametrize("chunks, words", [
    ([codec.encode_chunk(10, b"\x00" * 4)], "ended after 4 of the declared 10"),
    ([codec.encode_chunk(4, b"\x00" * 8)], "more than the declared"),
    ([codec.encode_chunk(3, b"\xff\xff\xff")], "not a valid"),
    ([codec.encode_chunk(4, b"ab"), codec.encode_chunk(5, b"cd")], "first chunk said"),
])
def test_malformed_streams_are_invalid_argument(target, chunks, words):
    with pytest.raises(grpc.RpcError) as err:
        _raw_stream(target, chunks)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()


def test_stream_reaches_plain_protobuf_peers(target):
    """A peer with only the generated classes can stream too: the chunks are ordinary messages."""
    from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
    from advantage_client.client import build_request, decode_result
    request = build_request("gae", None, **_batch(4, 8)).SerializeToString()
    chunks = [pb.ComputeAdvantageChunk(total_size=len(request), data=request[:50]),
              pb.ComputeAdvantageChunk(data=request[50:])]
    with grpc.insecure_channel(target) as channel:
        replies = list(pb_grpc.AdvantageServiceStub(channel).ComputeAdvantageStream(iter(chunks), timeout=30))
    data = b"".join(r.data for r in replies)
    assert replies[0].total_size == len(data)
    result = decode_result(pb.AdvantageResult.FromString(data), as_numpy=True)
    assert result.advantages.shape == (4, 8)


def test_stream_needs_the_token_like_every_call():
    srv = create_server("127.0.0.1", 0, device="cpu", auth_token="s3cret").start()
    try:
        with AdvantageClient(srv.address, timeout=30.0) as c, pytest.raises(AdvantageServiceError) as err:
            c.compute("gae", None, transport="stream", **_batch(2, 4))
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with AdvantageClient(srv.address, timeout=30.0, token="s3cret") as c:
            assert c.compute("gae", None, transport="stream", **_batch(2, 4)).advantages.shape == (2, 4)
    finally:
        srv.stop(grace=1.0)


# ----------------------------------------------------------------------------------- shared memory
def test_shm_reads_inputs_in_place_and_writes_results(client):
    tensors = _batch(16, 32)
    ref = client.compute("gae", None, transport="unary", **tensors)
    with client.shared_memory(1 << 20) as region:
        values = region.empty((16, 32), torch.float32)
        values.copy_(tensors["values"])
        got = region.compute("gae", None, rewards=tensors["rewards"], mask=tensors["mask"], values=values, copy=False)
        assert torch.equal(got.advantages, ref.advantages) and torch.equal(got.returns, ref.returns)
        base = region._buf.__array_interface__["data"][0]
        assert base <= got.advantages.data_ptr() < base + region.size  # the result lives in the region
        del got, values


def _shm_request(region, **overrides) -> pb.ComputeAdvantageShmRequest:
    req = pb.ComputeAdvantageShmRequest(key=region.key, output_region_id=region.region_id, output_offset=4096,
                                        output_byte_size=region.size - 4096)
    req.request.gae.CopyFrom(pb.GAEConfig())
    req.request.inputs["rewards"].CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=b"\x00" * 8))
    for name in ("mask", "values"):
        req.inputs[name].CopyFrom(pb.SharedMemoryTensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 4],
                                                        region_id=region.region_id, offset=0))
    for key, value in overrides.items():
        if key == "offset":
            req.inputs["values"].offset = value
        else:
            setattr(req, key, value)
    return req


def test_shm_is_bounds_checked_and_keyed(client):
    with client.shared_memory(8192) as region:
        region._buf[:32] = np.frombuffer(np.ones(8, np.float32).tobytes(), np.uint8)
        ok = client._call("ComputeAdvantageShm", _shm_request(region), pb.ComputeAdvantageShmResponse)
        assert list(ok.advantages.shape) == [2, 4] and ok.advantages.offset == 4096
        for overrides, words in [({"offset": 8192 - 16}, "outside the region"),
                                 ({"key": "not-the-key"}, "no shared-memory region"),
                                 ({"output_byte_size": 16}, "output room"),
                                 ({"output_offset": 1 << 40}, "output room")]:
            with pytest.raises(AdvantageServiceError) as err:
                client._call("ComputeAdvantageShm", _shm_request(region, **overrides), pb.ComputeAdvantageShmResponse)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, overrides
            assert words in str(err.value), (overrides, str(err.value))
        stale = _shm_request(region)
    with pytest.raises(AdvantageServiceError) as err:  # unregistered on close: its id and key are dead
        client._call("ComputeAdvantageShm", stale, pb.ComputeAdvantageShmResponse)
    assert err.value.code == grpc.StatusCode.NOT_FOUND  # a region the server does not hold (issue #27)


def test_shm_of_another_client_is_refused(target, client):
    with client.shared_memory(8192) as region, AdvantageClient(target, timeout=30.0) as other:
        request = _shm_request(region, key="")
        with pytest.raises(AdvantageServiceError) as err:
            other._call("ComputeAdvantageShm", request, pb.ComputeAdvantageShmResponse)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(AdvantageServiceError):
            other._call("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(region_id=region.region_id),
                        pb.UnregisterSharedMemoryResponse)


def test_register_needs_an_existing_segment(client):
    with pytest.raises(AdvantageServiceError) as err:
        client._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(name="advantage-no-such-segment",
                                                                            byte_size=10, proof=b"p" * 32),
                     pb.RegisterSharedMemoryResponse)
    # the answer a segment the caller cannot write gets too (tests/test_newcomer.py: nothing tells which names exist)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
