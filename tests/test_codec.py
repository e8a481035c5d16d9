"""The tensor codec (advantage_client.codec) writes and reads exactly the bytes protobuf does.

Property tests against the generated classes: encode == SerializeToString(deterministic=True), decode of
protobuf's bytes == the message (maps, optional fields, every dtype, empty tensors, unknown fields), and
bytes protobuf rejects are rejected (and answered INVALID_ARGUMENT by the server)."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_client import codec, wire
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
int32s = st.integers(-(2 ** 31), 2 ** 31 - 1)
int64s = st.integers(-(2 ** 63), 2 ** 63 - 1)
keys = st.text(max_size=6)


@st.composite
def tensors(draw):
    dtype = draw(st.one_of(st.sampled_from(list(range(9))), int32s))
    shape = draw(st.lists(st.one_of(st.integers(0, 5), int64s), max_size=4))
    data = draw(st.binary(max_size=40))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


@st.composite
def configs(draw):
    name = draw(st.sampled_from(sorted(codec.ONEOF_NUMBER)))
    return name, draw(messages(codec._CONFIG_CLS[name]))


@st.composite
def messages(draw, cls):
    """A ``cls`` config message with random fields set (nested config messages too: AReaL's NormConfig)."""
    msg = cls()
    for fd in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if fd.message_type is not None:
            getattr(msg, fd.name).CopyFrom(draw(messages(type(getattr(msg, fd.name)))))
        elif fd.is_repeated:
            getattr(msg, fd.name).extend(draw(st.lists(st.floats(allow_nan=False), max_size=3)))
        elif fd.enum_type is not None:
            setattr(msg, fd.name, draw(st.integers(0, 4)))
        elif fd.type == fd.TYPE_BOOL:
            setattr(msg, fd.name, draw(st.booleans()))
        elif fd.type == fd.TYPE_INT32:
            setattr(msg, fd.name, draw(st.integers(-2**31, 2**31 - 1)))
        else:
            setattr(msg, fd.name, draw(st.floats(allow_nan=False)))
    return msg


@st.composite
def requests(draw):
    msg = pb.ComputeAdvantageRequest(output_dtype=draw(st.one_of(st.just(0), int32s)))
    if draw(st.booleans()):
        name, cfg = draw(configs())
        getattr(msg, name).CopyFrom(cfg)
    for key, t in draw(st.dictionaries(keys, tensors(), max_size=4)).items():
        msg.inputs[key].CopyFrom(t)
    if draw(st.booleans()):
        msg.cu_seqlens.CopyFrom(draw(tensors()))
    msg.per_sample = draw(st.booleans())
    msg.mask_columns = draw(st.one_of(st.just(0), st.integers(-(2 ** 63), 2 ** 63 - 1)))
    return msg


@st.composite
def results(draw):
    msg = pb.AdvantageResult()
    if draw(st.booleans()):
        msg.advantages.CopyFrom(draw(tensors()))
    if draw(st.booleans()):
        msg.returns.CopyFrom(draw(tensors()))
    msg.metrics.update(draw(st.dictionaries(keys, st.floats(allow_nan=False), max_size=4)))
    msg.layout = draw(st.sampled_from(list(pb.ResultLayout.values())))
    msg.dense_shape.extend(draw(st.lists(st.integers(0, 2 ** 40), max_size=3)))
    return msg


# field numbers no request or result message uses (read from the descriptors, so a new estimator's field
# number cannot silently turn an "unknown" field into a known one)
_USED = {f.number for m in (pb.ComputeAdvantageRequest, pb.Tensor, pb.AdvantageResult) for f in m.DESCRIPTOR.fields}
_UNUSED_NUMBERS = [n for n in (15, 19, 28, 99, 100, 5000) if n not in _USED]


@st.composite
def unknown_fields(draw):
    """Serialized fields with numbers the messages do not use, of every wire type (groups included)."""
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        number = draw(st.sampled_from(_UNUSED_NUMBERS))
        kind = draw(st.sampled_from(["varint", "i64", "len", "i32", "group"]))
        if kind == "varint":
            out += codec.varint(number << 3) + codec.varint(draw(st.integers(0, 2 ** 64 - 1)))
        elif kind == "i64":
            out += codec.varint(number << 3 | 1) + draw(st.binary(min_size=8, max_size=8))
        elif kind == "i32":
            out += codec.varint(number << 3 | 5) + draw(st.binary(min_size=4, max_size=4))
        elif kind == "len":
            body = draw(st.binary(max_size=10))
            out += codec.varint(number << 3 | 2) + codec.varint(len(body)) + body
        else:
            out += codec.varint(number << 3 | 3) + codec.varint(7 << 3) + b"\x05" + codec.varint(number << 3 | 4)
    return out


# --------------------------------------------------------------------------- encode == protobuf
@SETTINGS
@given(requests())
def test_request_encode_is_byte_identical(msg):
    assert codec.request_from_message(msg) == msg.SerializeToString(deterministic=True)


@SETTINGS
@given(results())
def test_result_encode_is_byte_identical(msg):
    assert codec.result_from_message(msg) == msg.SerializeToString(deterministic=True)


@SETTINGS
@given(tensors())
def test_tensor_encode_is_byte_identical(msg):
    assert codec.encode_tensor(msg) == msg.SerializeToString()


# --------------------------------------------------------------------------- decode == protobuf
@SETTINGS
@given(requests(), st.booleans())
def test_request_decode_matches_protobuf(msg, deterministic):
    data = msg.SerializeToString(deterministic=deterministic)
    got = codec.decode_request(data)
    assert got.to_message() == msg
    assert codec.encode_request(got.estimator, got.config(), got.inputs, got.output_dtype, got.cu_seqlens,
                                per_sample=got.per_sample, mask_columns=got.mask_columns) == \
        msg.SerializeToString(deterministic=True)


@SETTINGS
@given(results())
def test_result_decode_matches_protobuf(msg):
    got = codec.decode_result(msg.SerializeToString())
    assert got.to_message() == msg


@SETTINGS
@given(requests(), unknown_fields(), unknown_fields())
def test_unknown_fields_are_skipped(msg, before, after):
    data = before + msg.SerializeToString() + after
    ref = pb.ComputeAdvantageRequest.FromString(data)
    ref.DiscardUnknownFields()
    got = codec.decode_request(data).to_message()
    got.DiscardUnknownFields()
    assert got == ref == msg


@SETTINGS
@given(requests(), requests())
def test_concatenated_messages_merge_like_protobuf(a, b):
    data = a.SerializeToString() + b.SerializeToString()
    assert codec.decode_request(data).to_message() == pb.ComputeAdvantageRequest.FromString(data)


def _pb_parse(cls, data):
    try:
        msg = cls.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError
        return None
    msg.DiscardUnknownFields()
    return msg


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=60), requests().map(lambda m: m.SerializeToString()).flatmap(
    lambda b: st.tuples(st.just(b), st.integers(0, max(len(b) - 1, 0)), st.integers(0, 255)).map(
        lambda t: t[0][:t[1]] + bytes([t[2]]) + t[0][t[1] + 1:]))))
def test_invalid_bytes_are_rejected_like_protobuf(data):
    ref = _pb_parse(pb.ComputeAdvantageRequest, data)
    try:
        got = codec.decode_request(data)
    except codec.CodecError:
        assert ref is None, f"protobuf accepts {data!r}"
        return
    assert ref is not None, f"protobuf rejects {data!r}"
    msg = got.to_message()
    msg.DiscardUnknownFields()
    assert msg == ref


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60))
def test_invalid_result_bytes_are_rejected_like_protobuf(data):
    ref = _pb_parse(pb.AdvantageResult, data)
    try:
        got = codec.decode_result(data)
    except codec.CodecError:
        assert ref is None
        return
    assert ref is not None
    msg = got.to_message()
    msg.DiscardUnknownFields()
    assert msg == ref


# --------------------------------------------------------------------------- real tensors
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
          torch.uint8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3), (4, 1, 5)])
def test_every_dtype_round_trips_zero_copy(dtype, shape):
    t = (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 2).to(dtype)
    data = codec.encode_tensor(t)
    assert data == wire.encode_tensor(t).SerializeToString()
    req = codec.encode_request("gae", None, {"x": t, "y": t.numpy() if dtype != torch.bfloat16 else t})
    assert req == pb.ComputeAdvantageRequest(gae=pb.GAEConfig(), inputs={
        "x": wire.encode_tensor(t), "y": wire.encode_tensor(t)}).SerializeToString(deterministic=True)
    view = codec.decode_request(req).inputs["x"]
    back = view.torch("x")
    assert back.dtype == dtype and tuple(back.shape) == shape and torch.equal(back, t)
    if t.numel():  # a view into the received bytes, not a copy
        arr = view.numpy("x")
        assert np.shares_memory(arr, np.frombuffer(req, dtype=np.uint8))


def test_non_contiguous_and_list_inputs():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert codec.encode_tensor(t) == wire.encode_tensor(t).SerializeToString()
    assert codec.encode_tensor([[1.0, 2.0]]) == wire.encode_tensor([[1.0, 2.0]]).SerializeToString()
    with pytest.raises(wire.WireError):
        codec.encode_tensor(np.zeros(2, np.complex64))


# --------------------------------------------------------------------------- the server
def test_garbage_bytes_are_invalid_argument(target):
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/advantage.v1.AdvantageService/ComputeAdvantage")
        for data in (b"\x52\xff\xff\xff\xff\x0f", b"\x0a\x05ab", b"\xff"):
            with pytest.raises(grpc.RpcError) as err:
                call(data, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_plain_stub_and_codec_agree(target, client):
    from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
    from advantage_client.client import build_request
    rng = np.random.default_rng(0)
    tensors = dict(rewards=rng.normal(size=(4,)).astype(np.float32), mask=np.ones((4, 6), np.float32),
                   values=rng.normal(size=(4, 6)).astype(np.float32))
    request = build_request("gae", {"gae_lambda": 0.9}, **tensors)
    with grpc.insecure_channel(target) as channel:
        reply = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage(request, timeout=30)
    got = client.compute("gae", {"gae_lambda": 0.9}, **tensors, transport="unary")
    np.testing.assert_array_equal(np.frombuffer(reply.advantages.data, np.float32).reshape(4, 6),
                                  got.advantages.numpy())
