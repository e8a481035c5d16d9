"""Integer and bool values for float inputs (issue 21 item 1), and the message when an input's shape disagrees
with the mask's (item 9).

* rewards from a 0/1 verifier as int64, int32, uint8 or bool (and GAE's values, GDPO's reward components) give
  exactly the advantages (and returns) of the same values as float32, through the sync client (torch and
  numpy, every transport), the asyncio client, a request built by hand with the generated stubs (what a
  Node or Go client sends) and the torch-free client;
* the compute dtype stays float32 for integers float32 holds exactly (|x| <= 2^24); beyond, the service
  computes in float64 (so 2^24 + 1 is not rounded to 2^24); beyond 2^53 it refuses, naming the input;
* integer dtypes the wire has no code for (int8, int16, uint16, uint32, uint64) are widened by the client;
  what is still refused (complex, strings, uint64 beyond int64, an unknown dtype code) names the input;
* an input whose B or T disagrees with mask's: the message names both inputs, both shapes, and says mask sets
  B and T.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError, AsyncAdvantageClient, wire
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_server import core as core_mod
from advantage_server.errors import InvalidInput
from advantage_server.estimators import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, T = 6, 5
IDS = np.array([0, 0, 0, 1, 1, 1], np.int64)
VERIFIER = np.array([1, 0, 1, 1, 1, 0])          # what a 0/1 verifier returns, one per sample
MASK = np.ones((B, T), np.float32)
MASK[1, 3:] = 0
MASK[4, 2:] = 0
TOKEN_REWARDS = np.zeros((B, T), np.int64)         # the verifier's score on each row's last valid token
TOKEN_REWARDS[np.arange(B), MASK.sum(1).astype(int) - 1] = VERIFIER
VALUES = np.array([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1],
                   [1, 0, 0, 1, 0], [1, 1, 0, 0, 0], [0, 1, 0, 1, 1]], np.int64)
FORMAT = np.array([1, 1, 0, 1, 0, 1])

#: estimator -> (config, inputs as int64 numpy arrays of 0/1 values; prompt_ids and mask as they are)
CASES = {
    "grpo": (None, {"prompt_ids": IDS, "rewards": VERIFIER, "mask": MASK}),
    "rloo": (None, {"prompt_ids": IDS, "rewards": VERIFIER, "mask": MASK}),
    "gae": ({"gae_gamma": 0.9, "gae_lambda": 0.8}, {"rewards": TOKEN_REWARDS, "values": VALUES, "mask": MASK}),
    "gae_scalar": ({"gae_gamma": 0.9, "gae_lambda": 0.8}, {"rewards": VERIFIER, "values": VALUES, "mask": MASK}),
    "gdpo": (None, {"prompt_ids": IDS, "reward/correctness": VERIFIER, "reward/format": FORMAT, "mask": MASK}),
}
FLOAT_INPUTS = ("rewards", "values", "reward/correctness", "reward/format")
DTYPES = {"int64": np.int64, "int32": np.int32, "uint8": np.uint8, "bool": np.bool_}


def estimator(case: str) -> str:
    return case.split("_")[0]


def inputs(case: str, dtype=None, as_torch: bool = False) -> dict:
    """The case's inputs, its float inputs as ``dtype`` (None: float32), as numpy or torch."""
    out = {}
    for key, value in CASES[case][1].items():
        if key in FLOAT_INPUTS:
            value = value.astype(np.float32 if dtype is None else dtype)
        out[key] = torch.from_numpy(value) if as_torch else value
    return out


def assert_same(got, want) -> None:
    """Bit-identical advantages and returns."""
    for label in ("advantages", "returns"):
        g, w = getattr(got, label), getattr(want, label)
        assert (g is None) == (w is None), label
        if w is not None:
            g, w = np.asarray(g), np.asarray(w)
            assert g.dtype == w.dtype and g.shape == w.shape, (label, g.dtype, w.dtype, g.shape, w.shape)
            np.testing.assert_array_equal(g, w, err_msg=label)


@pytest.fixture(scope="module")
def reference(client):
    """Each case's answer from float32 inputs (dense, numpy)."""
    return {case: client.compute(estimator(case), CASES[case][0], as_numpy=True, **inputs(case))
            for case in CASES}


@pytest.fixture(scope="module")
def stub(target):
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.AdvantageServiceStub(channel)


def test_the_float32_answers_are_not_trivial(reference):
    for case, res in reference.items():
        assert np.abs(res.advantages).max() > 0.1, case  # a test of equality against all zeros proves little
    # GRPO on [1, 0, 1] / [1, 1, 0] (std-normalised, leave-one-out baseline): the 0 sample is the lowest
    adv = reference["grpo"].advantages[:, 0]
    assert adv[1] < 0 < adv[0] and adv[0] == adv[2] and adv[5] < 0 < adv[3]


# ------------------------------------------------------------------------------ the Python clients
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("as_torch", [True, False], ids=["torch", "numpy"])
def test_sync_client_integer_inputs_equal_float32(client, reference, case, dtype, as_torch):
    got = client.compute(estimator(case), CASES[case][0], as_numpy=True, **inputs(case, DTYPES[dtype], as_torch))
    assert_same(got, reference[case])


@pytest.mark.parametrize("transport", ["unary", "stream", "shm"])
@pytest.mark.parametrize("case", ["grpo", "gae"])
def test_every_transport_takes_integer_inputs(client, reference, case, transport):
    got = client.compute(estimator(case), CASES[case][0], as_numpy=True, transport=transport,
                         **inputs(case, np.int64))
    assert_same(got, reference[case])


@pytest.mark.parametrize("case", ["grpo", "gdpo"])
def test_per_sample_answer_from_integer_rewards(client, reference, case):
    got = client.compute(estimator(case), CASES[case][0], as_numpy=True, per_sample=True,
                         **inputs(case, np.bool_))
    want = client.compute(estimator(case), CASES[case][0], as_numpy=True, per_sample=True, **inputs(case))
    assert got.layout == want.layout != "dense"
    np.testing.assert_array_equal(got.advantages, want.advantages)


def test_asyncio_client_integer_inputs_equal_float32(target, reference):
    async def main():
        async with AsyncAdvantageClient(target, timeout=30.0) as aio:
            return {(case, dtype, as_torch): await aio.compute(estimator(case), CASES[case][0], as_numpy=True,
                                                                **inputs(case, DTYPES[dtype], as_torch))
                    for case in CASES for dtype in DTYPES for as_torch in (True, False)}
    results = asyncio.run(main())
    assert len(results) == len(CASES) * len(DTYPES) * 2
    for (case, _, _), got in results.items():
        assert_same(got, reference[case])


def test_narrow_and_unsigned_integers_are_widened_by_the_client(client, reference):
    """The wire has int32/int64/uint8/bool; int8, int16, uint16 go as int32, uint32 and uint64 as int64."""
    for dtype, code in ((np.int8, pb.DTYPE_INT32), (np.int16, pb.DTYPE_INT32), (np.uint16, pb.DTYPE_INT32),
                        (np.uint32, pb.DTYPE_INT64), (np.uint64, pb.DTYPE_INT64)):
        sent = wire.encode_tensor(VERIFIER.astype(dtype), "inputs['rewards']")
        assert sent.dtype == code and wire.decode_numpy(sent).tolist() == VERIFIER.tolist(), dtype
        for as_torch in (False, True):
            got = client.compute("grpo", None, as_numpy=True, **inputs("grpo", dtype, as_torch))
            assert_same(got, reference["grpo"])
    negative = np.array([-128, 127, -1], np.int8)
    assert wire.decode_numpy(wire.encode_tensor(torch.from_numpy(negative))).tolist() == [-128, 127, -1]


# ------------------------------------------------------------------------------ any client: the raw wire
def raw_tensor(value: np.ndarray, code: int) -> pb.Tensor:
    """A Tensor message as a client in another language writes it: code, shape, little-endian bytes."""
    return pb.Tensor(dtype=code, shape=list(value.shape), data=np.ascontiguousarray(value).tobytes())


RAW_CODES = {"int64": (pb.DTYPE_INT64, "<i8"), "int32": (pb.DTYPE_INT32, "<i4"), "uint8": (pb.DTYPE_UINT8, "u1"),
             "bool": (pb.DTYPE_BOOL, "?"), "float32": (pb.DTYPE_FLOAT32, "<f4")}


def raw_request(case: str, dtype: str) -> pb.ComputeAdvantageRequest:
    config, values = CASES[case]
    name = estimator(case)
    request = pb.ComputeAdvantageRequest()
    getattr(request, name).SetInParent()
    if config:
        for key, v in config.items():
            setattr(getattr(request, name), key, v)
    for key, value in values.items():
        if key in FLOAT_INPUTS:
            code, np_dtype = RAW_CODES[dtype]
        else:
            code, np_dtype = {"prompt_ids": RAW_CODES["int64"], "mask": RAW_CODES["float32"]}[key]
        request.inputs[key].CopyFrom(raw_tensor(value.astype(np_dtype), code))
    return request


@pytest.mark.parametrize("case", CASES)
def test_raw_stub_request_with_integer_inputs(stub, case):
    want = stub.ComputeAdvantage(raw_request(case, "float32"), timeout=30)
    assert want.advantages.dtype == pb.DTYPE_FLOAT32 and len(want.advantages.data) == 4 * B * T
    for dtype in DTYPES:
        got = stub.ComputeAdvantage(raw_request(case, dtype), timeout=30)
        assert got == want, (case, dtype)


# ------------------------------------------------------------------------------ the torch-free client
NO_TORCH = r"""
import json, sys
sys.modules["torch"] = None          # `import torch` raises ImportError
import numpy as np
from advantage_client import AdvantageClient
target, cases = sys.argv[1], json.loads(sys.argv[2])
out = {}
with AdvantageClient(target, timeout=60) as client:
    for name, dtype, config, tensors in cases:
        tensors = {k: np.array(v, dtype=np.float32 if dtype is None and k in ("rewards", "values") else
                               (dtype if k in ("rewards", "values") else None)) for k, v in tensors.items()}
        tensors["mask"] = tensors["mask"].astype(np.float32)
        r = client.compute(name, config, **tensors)
        assert type(r.advantages) is np.ndarray
        out[f"{name}/{dtype}"] = [r.advantages.tolist(), None if r.returns is None else r.returns.tolist()]
print(json.dumps(out))
"""


def test_torch_free_client_sends_integer_inputs(target):
    cases = [[estimator(case), dtype, CASES[case][0], {k: v.tolist() for k, v in CASES[case][1].items()}]
             for case in ("grpo", "gae") for dtype in (None, "int64", "int32", "uint8", "bool")]
    out = subprocess.run([sys.executable, "-c", NO_TORCH, target, json.dumps(cases)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "client")})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert len(got) == 10
    for name in ("grpo", "gae"):
        for dtype in ("int64", "int32", "uint8", "bool"):
            assert got[f"{name}/{dtype}"] == got[f"{name}/None"], (name, dtype)
    assert any(v != 0 for row in got["grpo/None"][0] for v in row)


# ------------------------------------------------------------------------------ the compute dtype
def prepared(name: str, tensors: dict) -> dict:
    spec = REGISTRY[name]
    cfg = core_mod.config_from_dict(spec, {}).resolved()
    return core_mod.AdvantageCore("cpu").prepare(spec, cfg, {k: torch.as_tensor(v) for k, v in tensors.items()})


def test_integer_inputs_keep_float32_compute():
    for dtype in DTYPES.values():
        batch = prepared("gae", inputs("gae", dtype))
        assert batch["rewards"].dtype == batch["values"].dtype == batch["mask"].dtype == torch.float32
        assert batch["rewards"].tolist() == TOKEN_REWARDS.tolist()
    # 2^24 still exact in float32; an int32 of 2^24 + 1 (not a float32) computes in float64
    top = 2 ** 24
    assert prepared("grpo", {"prompt_ids": IDS, "rewards": np.full(B, -top, np.int32), "mask": MASK}
                    )["rewards"].dtype == torch.float32
    batch = prepared("grpo", {"prompt_ids": IDS, "rewards": np.full(B, top + 1, np.int32), "mask": MASK})
    assert batch["rewards"].dtype == batch["mask"].dtype == torch.float64
    assert batch["rewards"].tolist() == [top + 1.0] * B


def test_integers_beyond_float32_are_computed_in_float64(client):
    """2^24 + 1 and 2^24 (one group) differ by 1: their mean-centred advantages are +-0.5. As float32 both
    would be 2^24 and the advantages 0."""
    cfg = {"normalize_rewards": False, "use_leave_one_out_baseline": False}
    ids, mask = np.array([0, 0, 1, 1]), np.ones((4, 3), np.float32)
    big = np.array([2 ** 24 + 1, 2 ** 24, 3, 1], np.int64)
    for output in (None, "float64"):
        res = client.compute("grpo", cfg, output_dtype=output, as_numpy=True, prompt_ids=ids, rewards=big, mask=mask)
        assert res.advantages.dtype == (np.float64 if output else np.float32)
        np.testing.assert_array_equal(res.advantages[:, 0], [0.5, -0.5, 1.0, -1.0])
    as_float32 = client.compute("grpo", cfg, as_numpy=True, prompt_ids=ids, rewards=big.astype(np.float32), mask=mask)
    np.testing.assert_array_equal(as_float32.advantages[:, 0], [0.0, 0.0, 1.0, -1.0])  # what exactness avoids
    # up to 2^53 exact in float64: 2^53 - 1 and 2^53 - 3
    near = np.array([2 ** 53 - 1, 2 ** 53 - 3, -(2 ** 53), -(2 ** 53) + 2], np.int64)
    res = client.compute("grpo", cfg, output_dtype="float64", as_numpy=True, prompt_ids=ids, rewards=near, mask=mask)
    np.testing.assert_array_equal(res.advantages[:, 0], [1.0, -1.0, -1.0, 1.0])


def test_output_float64_keeps_the_float64_answer_of_integer_inputs(client):
    """Integers beyond 2^24 are computed in float64; with output_dtype="float64" the answer must not be rounded
    to float32 on the way (it was: 2^25 + 3 and 0 centred gave +-16777218.0, float32's rounding of 16777217.5,
    while float64 rewards of the same values gave +-16777217.5)."""
    cfg = {"normalize_rewards": False, "use_leave_one_out_baseline": False}
    ids, mask = np.array([0, 0, 1, 1]), np.ones((4, 3), np.float32)
    big = np.array([2 ** 25 + 3, 0, 3, 1], np.int64)
    want = [16777217.5, -16777217.5, 1.0, -1.0]
    for rewards in (big, big.astype(np.float64)):
        res = client.compute("grpo", cfg, output_dtype="float64", as_numpy=True, prompt_ids=ids, rewards=rewards,
                             mask=mask)
        assert res.advantages.dtype == np.float64
        np.testing.assert_array_equal(res.advantages[:, 0], want, err_msg=str(rewards.dtype))
    res = client.compute("grpo", cfg, as_numpy=True, prompt_ids=ids, rewards=big, mask=mask)  # float32 asked for
    np.testing.assert_array_equal(res.advantages[:, 0], np.float32(want))
    for transport in ("stream", "shm"):
        res = client.compute("grpo", cfg, output_dtype="float64", as_numpy=True, prompt_ids=ids, rewards=big,
                             mask=mask, transport=transport)
        np.testing.assert_array_equal(res.advantages[:, 0], want, err_msg=transport)


def expect_invalid(call, field: str, *words: str) -> AdvantageServiceError:
    with pytest.raises(AdvantageServiceError) as exc:
        call()
    err = exc.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code}: {err}"
    fields = [f for f, _ in err.field_violations]
    assert any(f.startswith(field) for f in fields), (fields, str(err))
    for word in words:
        assert word in str(err), (word, str(err))
    return err


def test_integers_beyond_2_53_are_refused_naming_the_input(client, stub):
    ids, mask = np.array([0, 0]), np.ones((2, 3), np.float32)
    for value in (2 ** 53 + 1, -(2 ** 63)):
        rewards = np.array([value, 0], np.int64)
        expect_invalid(lambda: client.compute("grpo", None, prompt_ids=ids, rewards=rewards, mask=mask),
                       "inputs['rewards']", "2^53", str(abs(value)), "float64", "Rescale")
    # uint64 within int64 but beyond 2^53: sent as int64 by the client, refused by the server
    rewards = np.array([2 ** 60, 0], np.uint64)
    expect_invalid(lambda: client.compute("grpo", None, prompt_ids=ids, rewards=rewards, mask=mask),
                   "inputs['rewards']", "2^53")
    # the same from a raw request: a [B, T] int64 value of another estimator
    request = raw_request("gae", "int64")
    big = np.array(VALUES, np.int64)
    big[2, 3] = 2 ** 62
    request.inputs["values"].CopyFrom(raw_tensor(big, pb.DTYPE_INT64))
    with pytest.raises(grpc.RpcError) as exc:
        stub.ComputeAdvantage(request, timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs['values']" in exc.value.details() and str(2 ** 62) in exc.value.details()


def test_refused_dtypes_still_name_the_input(client, stub):
    ids, mask = np.array([0, 0]), np.ones((2, 3), np.float32)
    # the client cannot encode them: a WireError (ValueError) naming the input, nothing sent
    for bad, word in ((np.array([1 + 2j, 0], np.complex64), "complex64"), (np.array(["1", "0"]), "<U1"),
                      (torch.tensor([1 + 2j, 0]), "complex"), (np.array([2 ** 64 - 1, 0], np.uint64), "int64")):
        with pytest.raises(wire.WireError) as exc:
            client.compute("grpo", None, prompt_ids=ids, rewards=bad, mask=mask)
        assert exc.value.field == "inputs['rewards']" and word in str(exc.value), str(exc.value)
    # a dtype code the schema does not have, from a raw request: INVALID_ARGUMENT naming it
    request = raw_request("grpo", "int64")
    request.inputs["rewards"].dtype = 42
    with pytest.raises(grpc.RpcError) as exc:
        stub.ComputeAdvantage(request, timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs['rewards'].dtype" in exc.value.details(), exc.value.details()
    # in-process callers may pass any torch dtype: a complex one is refused with the accepted list
    with pytest.raises(InvalidInput) as exc2:
        core_mod.AdvantageCore("cpu").run("grpo", None, {"prompt_ids": torch.tensor([0, 0]),
                                                          "rewards": torch.tensor([1 + 2j, 0]), "mask": torch.ones(2, 3)})
    text = str(exc2.value)
    assert "inputs['rewards']" in text and "complex64 is not accepted for float input 'rewards'" in text, text
    assert "int64" in text and "bool" in text and "float32" in text, text
    # integer inputs stay integer: a float prompt_ids is still refused
    expect_invalid(lambda: client.compute("grpo", None, prompt_ids=ids.astype(np.float32),
                                          rewards=np.array([1, 0]), mask=mask), "inputs['prompt_ids']", "int")


# ------------------------------------------------------------------------------ item 9: shapes vs the mask
def test_shape_disagreeing_with_the_mask_names_both(client):
    mask = np.ones((4, 5), np.float32)
    values = np.zeros((4, 6), np.float32)
    err = expect_invalid(lambda: client.compute("gae", None, rewards=np.ones(4, np.float32), values=values, mask=mask),
                         "inputs['values']")
    (field, text), = err.field_violations
    assert field == "inputs['values']"
    assert text.startswith("values has shape [4, 6] but mask has [4, 5]"), text
    assert "must match mask, which sets B and T" in text and "[B, T] = [4, 5]" in text, text
    # B disagreeing on a [B] / [B, T] input: named with both accepted shapes
    err = expect_invalid(lambda: client.compute("grpo", None, prompt_ids=np.zeros(3, np.int64),
                                                rewards=np.ones(3, np.float32), mask=mask), "inputs['rewards']")
    texts = dict(err.field_violations)
    assert texts["inputs['rewards']"].startswith("rewards has shape [3] but mask has [4, 5]"), texts
    assert "[B] or [B, T] = [4] or [4, 5]" in texts["inputs['rewards']"], texts
    assert texts["inputs['prompt_ids']"].startswith("prompt_ids has shape [3] but mask has [4, 5]"), texts
    # a wrong number of dimensions is not a disagreement with the mask: the shape it must have
    err = expect_invalid(lambda: client.compute("gae", None, rewards=np.ones(4, np.float32),
                                                values=np.zeros((4, 5, 1), np.float32), mask=mask), "inputs['values']")
    (field, text), = err.field_violations
    assert text == "has shape [4, 5, 1] but must be [B, T] = [4, 5] (B and T come from `mask` [4, 5])", text
