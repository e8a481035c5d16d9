"""Streaming without materialising the message: the chunk messages the client and the server build lazily from
the codec's pieces carry exactly ``codec.encode_request`` / ``codec.encode_result`` (and protobuf's bytes),
whatever the chunk size, with tensors straddling chunk boundaries, empty tensors and empty messages; the
reassembly buffers are numpy arrays and result tensors stay views of them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_client import codec, streaming
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client.client import build_request
from advantage_server import transport
from advantage_server.estimators import AdvantageResult


def _split(chunks: list[bytes]) -> tuple[list[int], bytes]:
    """(total_size of each chunk, concatenated data), read with protobuf's generated class."""
    msgs = [pb.ComputeAdvantageChunk.FromString(c) for c in chunks]
    return [m.total_size for m in msgs], b"".join(m.data for m in msgs)


def _check_chunks(pieces: list, want: bytes, chunk_bytes: int) -> None:
    chunks = list(codec.iter_chunks(pieces, chunk_bytes))
    totals, data = _split(chunks)
    assert data == want
    assert totals[0] == len(want) and all(t == 0 for t in totals[1:])
    assert len(chunks) == max(1, -(-len(want) // chunk_bytes))
    # the very messages encode_chunk gives over the joined bytes, sliced every chunk_bytes
    view = memoryview(want)
    assert chunks == [codec.encode_chunk(len(want) if i == 0 else 0, view[i:i + chunk_bytes])
                      for i in range(0, max(len(want), 1), chunk_bytes)]


_DTYPES = [np.float32, np.float64, np.int64, np.int32, np.bool_, np.float16, np.uint8]


@st.composite
def _tensors(draw):
    n = draw(st.integers(0, 5))
    names = draw(st.lists(st.sampled_from(["values", "mask", "rewards", "prompt_ids", "reward/a", "reward/ab", "x"]),
                          min_size=n, max_size=n, unique=True))
    out = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(_DTYPES))
        rng = np.random.default_rng(draw(st.integers(0, 1000)))
        out[name] = (rng.standard_normal(shape) * 5).astype(dtype)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=_tensors(), chunk_bytes=st.sampled_from([1, 2, 3, 7, 16, 61, 64, 257, 4096, 1 << 20]),
       cu=st.booleans(), output_dtype=st.sampled_from([0, pb.DTYPE_FLOAT64]))
def test_request_chunks_are_the_encoded_request(tensors, chunk_bytes, cu, output_dtype):
    cu_seqlens = np.array([0, 2, 5], np.int64) if cu else None
    cfg = pb.GAEConfig(gae_lambda=0.9)
    want = codec.encode_request("gae", cfg, tensors, output_dtype, cu_seqlens)
    pieces = codec.request_pieces("gae", cfg, tensors, output_dtype, cu_seqlens)
    assert b"".join(pieces) == want
    _check_chunks(pieces, want, chunk_bytes)
    request = streaming.Request(pieces)
    assert request.nbytes == len(want) and request.tobytes() == want
    assert list(request.chunks(chunk_bytes)) == list(codec.iter_chunks(pieces, chunk_bytes))


@settings(max_examples=100, deadline=None)
@given(B=st.integers(0, 6), T=st.integers(0, 9), returns=st.booleans(), metrics=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       chunk_bytes=st.sampled_from([1, 5, 8, 33, 128, 1 << 20]))
def test_result_chunks_are_the_encoded_result(B, T, returns, metrics, dtype, chunk_bytes):
    g = torch.Generator().manual_seed(B * 31 + T)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ret = torch.randn(B, T, generator=g, dtype=torch.float64) if returns else None
    m = {"b/x": 1.5, "a": -2.0, "ab": 3.25} if metrics else {}
    payload = transport.ResultPayload(AdvantageResult(adv, ret, m), dtype)
    want = codec.encode_result(adv.to(dtype), None if ret is None else ret.to(dtype), m)
    pieces = payload.pieces()
    assert b"".join(pieces) == want == payload.encode()
    _check_chunks(pieces, want, chunk_bytes)
    # protobuf reads the reassembled bytes as the same message
    msg = pb.AdvantageResult.FromString(want)
    assert list(msg.advantages.shape) == [B, T] and dict(msg.metrics) == m


def test_straddling_and_empty_tensors_byte_for_byte():
    tensors = {"a": np.arange(10, dtype=np.float32), "b": np.zeros((0, 3), np.float32),
               "c": np.arange(7, dtype=np.int64), "d": np.zeros(0, np.bool_)}
    want = build_request("gae", None, **tensors).SerializeToString(deterministic=True)
    pieces = streaming.build_request_pieces("gae", None, **tensors)
    assert b"".join(pieces) == want
    for chunk_bytes in range(1, len(want) + 2):  # every boundary position, tensors cut anywhere
        _check_chunks(pieces, want, chunk_bytes)


def test_empty_message_is_one_empty_chunk():
    assert list(codec.iter_chunks([], 4)) == [b""]
    assert list(codec.iter_chunks([b"", memoryview(b"")], 4)) == [b""]
    assert _split([b""]) == ([0], b"")


def test_pieces_that_disagree_with_the_total_are_refused():
    with pytest.raises(ValueError):
        list(codec.iter_chunks([b"abc"], 2, total=5))
    with pytest.raises(ValueError):
        list(codec.iter_chunks([b"abcdef"], 2, total=3))
    with pytest.raises(ValueError):
        list(codec.iter_chunks([b"abc"], 0))


def test_non_contiguous_and_torch_inputs_chunk_like_the_joined_bytes():
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = {"values": base[:, ::2], "mask": base.t(), "rewards": base[:, 0].to(torch.bfloat16),
               "prompt_ids": ["u1", "u2", "u1", "u3", "u2", "u1"]}
    want = streaming.build_request_bytes("gae", {"gae_lambda": 0.5}, "float64", None, **tensors)
    pieces = streaming.build_request_pieces("gae", {"gae_lambda": 0.5}, "float64", None, **tensors)
    assert want == build_request("gae", {"gae_lambda": 0.5}, "float64", None, **tensors).SerializeToString(
        deterministic=True)
    for chunk_bytes in (1, 13, 100, 4 << 20):
        _check_chunks(pieces, want, chunk_bytes)


def test_reassemble_into_numpy_and_results_are_views():
    adv = np.arange(24, dtype=np.float32).reshape(4, 6)
    want = codec.encode_result(adv, adv * 2, {"m": 1.0})
    chunks = [codec.decode_chunk(c) for c in codec.iter_chunks(codec.result_pieces(adv, adv * 2, {"m": 1.0}), 17)]
    seen = []
    buf = streaming.reassemble(iter(chunks), seen.append)
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.tobytes() == want
    assert sum(seen) == len(want) and len(seen) == len(chunks)
    res = codec.decode_result(memoryview(buf))
    out = res.advantages.numpy("advantages")
    assert np.array_equal(out, adv) and np.shares_memory(out, buf)
    with pytest.raises(codec.CodecError):
        streaming.reassemble(iter(chunks[:-1]))
    with pytest.raises(codec.CodecError):
        streaming.reassemble(iter(chunks + chunks[-1:]))
    with pytest.raises(codec.CodecError):
        streaming.reassemble(iter([]))


def test_server_reassembles_into_numpy():
    class Limits:
        max_stream_bytes = 1 << 30

    methods = transport.TransportMethods()
    methods.limits = Limits()
    data = bytes(range(256)) * 40
    chunks = [codec.decode_chunk(c) for c in codec.iter_chunks([data], 999)]
    buf = methods._reassemble(iter(chunks), lambda *_: None)
    assert isinstance(buf, np.ndarray) and buf.tobytes() == data
    assert methods._reassemble(iter([codec.decode_chunk(b"")]), lambda *_: None).size == 0


def test_parse_timing():
    assert streaming.parse_timing("recv=0.5;compute=0.25") == {"recv": 0.5, "compute": 0.25}
    assert streaming.parse_timing("junk;x=;y=1") == {"y": 1.0}
    assert streaming.parse_timing(None) == {}
