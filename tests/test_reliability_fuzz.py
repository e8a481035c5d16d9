"""Fuzzing a real `advantage-server` process with hypothesis: valid protobuf full of nonsense (shapes,
dtypes, byte lengths, NaN/inf, huge and negative dimensions, empty maps, unknown names, wild configs),
mutations of valid requests, and raw invalid bytes. Never a crash, never UNKNOWN or INTERNAL, never a
hang (every call has a deadline); after every batch of inputs a correct request still gets the correct,
bitwise identical answer; every INVALID_ARGUMENT carries google.rpc.BadRequest field violations.
Prints how many inputs it tried and what came back.

The request strategy is built from the schema's descriptors, so estimators and fields added later are
fuzzed too. Every server listens on 127.0.0.1 only.
"""
from __future__ import annotations

import collections
import math

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_client import AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_server.core import list_estimators
from reliability_support import CALLS, report, request_for, start_server, stop_server

pytestmark = pytest.mark.slow

EXAMPLES = 3400         # per strategy (10,200 requests in all)
CHECK_EVERY = 50        # a correct request after every this many inputs
ALLOWED = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
FDESC = FieldDescriptor

_REQ = pb.ComputeAdvantageRequest.DESCRIPTOR
ESTIMATOR_FIELDS = [f for f in _REQ.oneofs_by_name["estimator"].fields]
OTHER_TENSOR_FIELDS = [f for f in _REQ.fields if f.message_type is pb.Tensor.DESCRIPTOR and not f.containing_oneof]
INPUT_NAMES = sorted({i.name.replace("<name>", "x") for e in list_estimators().estimators for i in e.inputs}
                     | {"reward/a", "reward/b"})
ITEMSIZE = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT64: 8, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT16: 2,
            pb.DTYPE_INT64: 8, pb.DTYPE_INT32: 4, pb.DTYPE_BOOL: 1, pb.DTYPE_UINT8: 1}
NP = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT64: "<f8", pb.DTYPE_FLOAT16: "<f2", pb.DTYPE_INT64: "<i8",
      pb.DTYPE_INT32: "<i4", pb.DTYPE_UINT8: "u1"}
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 3.4e38, -1e308, 1.0]

small_dims = st.integers(-2, 9)
dims = st.one_of(small_dims, small_dims, small_dims, small_dims,  # 1 in 5: an extreme one
                 st.sampled_from([0, 1, 2**31, 2**62, 2**63 - 1, -2**63]))
dtypes = st.one_of(st.sampled_from(sorted(ITEMSIZE)), st.integers(-3, 40))


@st.composite
def tensors(draw):
    dtype = draw(dtypes)
    shape = draw(st.lists(dims, max_size=4))
    n = math.prod(shape) if all(d >= 0 for d in shape) else -1
    size = n * ITEMSIZE.get(dtype, 4)
    if 0 <= size <= 2048 and draw(st.booleans()):
        if dtype in NP and draw(st.booleans()):
            values = draw(st.lists(st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(-1e6, 1e6)),
                                   min_size=n, max_size=n))
            kind = np.dtype(NP[dtype]).kind
            arr = np.array(values, np.float64)
            if kind != "f":
                arr = np.nan_to_num(arr, posinf=2**40, neginf=-2**40).clip(-2**40, 2**40)
            with np.errstate(all="ignore"):
                data = arr.astype(NP[dtype]).tobytes()
        else:
            data = draw(st.binary(min_size=size, max_size=size))
    else:
        data = draw(st.binary(max_size=256))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def field_values(fd):
    if fd.type == FDESC.TYPE_DOUBLE or fd.type == FDESC.TYPE_FLOAT:
        return st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
    if fd.type == FDESC.TYPE_BOOL:
        return st.booleans()
    if fd.type == FDESC.TYPE_ENUM:
        return st.integers(-3, 12)
    if fd.type in (FDESC.TYPE_INT32, FDESC.TYPE_SINT32, FDESC.TYPE_SFIXED32):
        return st.integers(-2**31, 2**31 - 1)
    if fd.type in (FDESC.TYPE_INT64, FDESC.TYPE_SINT64, FDESC.TYPE_SFIXED64):
        return st.integers(-2**63, 2**63 - 1)
    if fd.type in (FDESC.TYPE_UINT32, FDESC.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if fd.type in (FDESC.TYPE_UINT64, FDESC.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if fd.type == FDESC.TYPE_STRING:
        return st.text(max_size=16)
    if fd.type == FDESC.TYPE_BYTES:
        return st.binary(max_size=16)
    return None


@st.composite
def configs(draw, descriptor):
    """Any message of ``descriptor``'s type with random values in random fields (scalars and repeated)."""
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(descriptor)()
    for fd in descriptor.fields:
        values = field_values(fd)
        if values is None or not draw(st.booleans()):
            continue
        if fd.is_repeated:
            getattr(msg, fd.name).extend(draw(st.lists(values, max_size=5)))
        else:
            setattr(msg, fd.name, draw(values))
    return msg


@st.composite
def structured_requests(draw):
    request = pb.ComputeAdvantageRequest()
    field = draw(st.sampled_from([None, *ESTIMATOR_FIELDS]))
    if field is not None:
        getattr(request, field.name).CopyFrom(draw(configs(field.message_type)))
    names = draw(st.lists(st.one_of(st.sampled_from(INPUT_NAMES), st.text(max_size=12)), max_size=6, unique=True))
    for name in names:
        request.inputs[name].CopyFrom(draw(tensors()))
    for fd in OTHER_TENSOR_FIELDS:
        if draw(st.booleans()):
            getattr(request, fd.name).CopyFrom(draw(tensors()))
    request.output_dtype = draw(st.integers(-3, 12))
    return request


@st.composite
def mutated_requests(draw):
    """A valid request with one to three things broken: deep validation paths, not just the first check."""
    name = draw(st.sampled_from(sorted(CALLS)))
    request = request_for(name, seed=draw(st.integers(0, 3)), B=draw(st.sampled_from([2, 4, 8])),
                          T=draw(st.integers(1, 6)), groups=2)
    for _ in range(draw(st.integers(1, 3))):
        keys = sorted(request.inputs)
        key = draw(st.sampled_from(keys)) if keys else None
        action = draw(st.sampled_from(["dtype", "shape", "data", "values", "drop", "add", "config", "output",
                                       "estimator", "extra_tensor"]))
        t = request.inputs[key] if key is not None else None
        if action == "dtype" and t is not None:
            t.dtype = draw(dtypes)
        elif action == "shape" and t is not None:
            t.shape[:] = draw(st.lists(dims, max_size=4))
        elif action == "data" and t is not None:
            cut = draw(st.integers(0, len(t.data)))
            t.data = t.data[:cut] + draw(st.binary(max_size=8))
        elif action == "values" and t is not None and t.data:
            item = ITEMSIZE.get(t.dtype, 1)
            count = len(t.data) // item
            pos = draw(st.integers(0, max(count - 1, 0)))
            if t.dtype in NP and np.dtype(NP[t.dtype]).kind == "f":
                with np.errstate(all="ignore"):
                    new = np.array([draw(st.sampled_from(SPECIAL_FLOATS))], NP[t.dtype]).tobytes()
            else:
                new = draw(st.binary(min_size=item, max_size=item))
            t.data = t.data[:pos * item] + new + t.data[(pos + 1) * item:]
        elif action == "drop" and key is not None:
            del request.inputs[key]
        elif action == "add":
            request.inputs[draw(st.sampled_from(INPUT_NAMES))].CopyFrom(draw(tensors()))
        elif action == "config":
            field = request.WhichOneof("estimator")
            getattr(request, field).CopyFrom(draw(configs(getattr(request, field).DESCRIPTOR)))
        elif action == "output":
            request.output_dtype = draw(st.integers(-3, 12))
        elif action == "estimator":
            other = draw(st.sampled_from(ESTIMATOR_FIELDS))
            getattr(request, other.name).SetInParent()
        elif action == "extra_tensor" and OTHER_TENSOR_FIELDS:
            getattr(request, draw(st.sampled_from(OTHER_TENSOR_FIELDS)).name).CopyFrom(draw(tensors()))
    return request


@st.composite
def raw_payloads(draw):
    if draw(st.booleans()):
        return draw(st.binary(max_size=512))
    data = bytearray(request_for(draw(st.sampled_from(sorted(CALLS))), seed=0, B=4, T=3, groups=2).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[pos:]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("fuzz"), "fuzz", "--max-batch-elements", "100000")
    try:
        yield srv
        assert srv.proc.poll() is None, f"the server died:\n{srv.stderr}"
        assert stop_server(srv) == 0
        assert "Traceback" not in srv.stderr, srv.stderr
    finally:
        srv.close()


class Fuzzer:
    """Sends inputs, tallies status codes, and checks a correct request every CHECK_EVERY inputs."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.AdvantageServiceStub(self.channel)
        self.raw = self.channel.unary_unary("/advantage.v1.AdvantageService/ComputeAdvantage")
        self.good = request_for("gae", seed=5)
        self.expected = self.stub.ComputeAdvantage(self.good, timeout=30).SerializeToString(deterministic=True)
        self.codes: collections.Counter[str] = collections.Counter()
        self.checks = 0
        self.bad: list[str] = []

    def send(self, payload: bytes) -> None:
        try:
            reply = pb.AdvantageResult.FromString(self.raw(payload, timeout=20))
            code = "OK"
            adv = reply.advantages
            if adv.dtype == pb.DTYPE_FLOAT32 and adv.data:
                assert np.isfinite(np.frombuffer(adv.data, "<f4")).all(), "non-finite advantages"
        except grpc.RpcError as err:
            code = err.code().name
            if code not in ALLOWED:
                self.bad.append(f"{code}: {err.details()} <- {payload[:200]!r}")
            elif code == "INVALID_ARGUMENT" and not AdvantageServiceError.from_rpc_error(err).field_violations:
                self.bad.append(f"INVALID_ARGUMENT without google.rpc.BadRequest details: {err.details()}")
        self.codes[code] += 1
        if sum(self.codes.values()) % CHECK_EVERY == 0:
            self.check()

    def check(self) -> None:
        got = self.stub.ComputeAdvantage(self.good, timeout=30).SerializeToString(deterministic=True)
        assert got == self.expected, "a correct request got a different answer after fuzzing"
        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        self.checks += 1

    def summary(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.codes.most_common())


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("kind", ["structured", "mutated", "raw-bytes"])
def test_fuzz(fuzz_server, kind, capsys):
    fuzzer = Fuzzer(fuzz_server.address)
    strategy = {"structured": structured_requests().map(lambda r: r.SerializeToString()),
                "mutated": mutated_requests().map(lambda r: r.SerializeToString()),
                "raw-bytes": raw_payloads()}[kind]

    @FUZZ_SETTINGS
    @given(payload=strategy)
    def run(payload):
        fuzzer.send(payload)
        assert not fuzzer.bad, fuzzer.bad[-1]

    try:
        run()
        fuzzer.check()
        assert fuzz_server.proc.poll() is None, f"the server died:\n{fuzz_server.stderr}"
    finally:
        fuzzer.channel.close()
    tried = sum(fuzzer.codes.values())
    report(capsys, f"fuzz {kind}: {tried} inputs -> {fuzzer.summary()}; correct request served correctly "
                   f"{fuzzer.checks} times in between; no crash, no UNKNOWN/INTERNAL, no hang")
    assert not fuzzer.bad
    assert tried >= EXAMPLES // 2
