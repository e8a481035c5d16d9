"""Compact inputs: bool/uint8 masks and ``lengths`` [B] in place of ``mask`` for every estimator, the
client's automatic mask compaction, and the byte sizes of one group of 16 on the wire (deterministic).

* every estimator computes the same numbers from a float mask, a bool mask, a uint8 mask and (for a
  prefix mask) ``lengths`` + ``mask_columns``;
* malformed ``lengths`` / ``mask_columns`` are INVALID_ARGUMENT naming them; a ``lengths`` that stands for
  more elements than the server allows is RESOURCE_EXHAUSTED before anything is allocated;
* the client sends a float 0/1 mask as lengths (prefix) or one byte per token, and everything else as given;
* one group of 16: the per-sample response is at most 1 KiB for any T; a request with a bool or lengths mask
  is at most 1 KiB + T * B bytes.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError, InvalidArgumentError, codec
from advantage_client.client import prepare_call
from advantage_client.masks import compact_mask
from advantage_client.streaming import COMPUTE
from advantage_server import AdvantageCore
from advantage_server.errors import InvalidInput, ResourceLimit
from advantage_server.estimators import REGISTRY

from test_per_sample import B, T, batch, configs

CORE = AdvantageCore("cpu")


def _prefix_batch(name: str, seed: int = 0) -> tuple[dict, torch.Tensor]:
    tensors = batch(name, seed, token_rewards=True)
    lengths = torch.tensor([T, 3, 0, 7, 1, T, 5, 4, 2, 6, 8, 1], dtype=torch.int32)
    tensors["mask"] = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return tensors, lengths


CASES = [(name, cfg) for name in sorted(REGISTRY) for cfg in configs(name)]


@pytest.mark.parametrize("name,cfg", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_every_estimator_takes_bool_uint8_and_lengths_masks(name, cfg):
    tensors, lengths = _prefix_batch(name)
    want = CORE.run(name, cfg, tensors)
    for form, swap in (("bool", {"mask": tensors["mask"] != 0}), ("uint8", {"mask": tensors["mask"].to(torch.uint8)})):
        got = CORE.run(name, cfg, {**tensors, **swap})
        assert torch.equal(got.advantages, want.advantages), form
        assert (got.returns is None) == (want.returns is None) and (got.returns is None or torch.equal(got.returns, want.returns))
    no_mask = {k: v for k, v in tensors.items() if k != "mask"}
    for n in (lengths, lengths.to(torch.int64), lengths.to(torch.uint8)):
        got = CORE.run(name, cfg, {**no_mask, "lengths": n}, mask_columns=T)
        assert torch.equal(got.advantages, want.advantages), n.dtype
        assert got.returns is None or torch.equal(got.returns, want.returns)
    holes = batch(name, 1)  # a mask with holes, as bool: the same numbers as the float mask
    assert torch.equal(CORE.run(name, cfg, {**holes, "mask": holes["mask"].bool()}).advantages,
                       CORE.run(name, cfg, holes).advantages)


def test_lengths_without_mask_columns_is_as_wide_as_the_longest_row():
    got = CORE.run("raw_reward", {"normalize_advantages": False}, {"rewards": torch.tensor([1.0, 2.0]),
                                                                   "lengths": torch.tensor([2, 4])})
    assert torch.equal(got.advantages, torch.tensor([[1.0] * 4, [2.0] * 4]))


@pytest.mark.parametrize("tensors,columns,field,text", [
    ({"mask": torch.ones(2, 3), "lengths": torch.tensor([1, 2])}, 0, "inputs['lengths']", "not both"),
    ({"lengths": torch.tensor([1, -1])}, 3, "inputs['lengths']", "lengths[1] = -1"),
    ({"lengths": torch.tensor([1, 4])}, 3, "inputs['lengths']", "lengths[1] = 4"),
    ({"lengths": torch.tensor([1.0, 2.0])}, 3, "inputs['lengths']", "integers"),
    ({"lengths": torch.tensor([[1, 2]])}, 3, "inputs['lengths']", "integers"),
    ({"lengths": torch.tensor([1, 2])}, -3, "mask_columns", ">= 0"),
    ({"mask": torch.ones(2, 3)}, 3, "mask_columns", "only read with"),
    ({"lengths": torch.tensor([0, 0])}, 0, "inputs['mask']", "non-empty"),
])
def test_malformed_lengths_are_invalid_argument(tensors, columns, field, text):
    with pytest.raises(InvalidInput) as err:
        CORE.run("raw_reward", None, {"rewards": torch.tensor([1.0, 2.0]), **tensors}, mask_columns=columns)
    assert err.value.violations[0][0] == field and text in err.value.violations[0][1], err.value.violations


def test_lengths_do_not_go_with_cu_seqlens():
    with pytest.raises(InvalidInput, match="cu_seqlens"):
        CORE.run("raw_reward", None, {"rewards": torch.tensor([1.0]), "lengths": torch.tensor([2])},
                 cu_seqlens=torch.tensor([0, 2]))


def test_a_huge_mask_columns_is_refused_before_allocating(make_server):
    with pytest.raises(ResourceLimit, match="--max-batch-elements=1000"):
        AdvantageCore("cpu", max_batch_elements=1000).run(
            "raw_reward", None, {"rewards": torch.ones(2), "lengths": torch.tensor([1, 2])}, mask_columns=501)
    srv = make_server(max_batch_elements=1000)
    with AdvantageClient(srv.address, timeout=10.0) as c:
        with pytest.raises(AdvantageServiceError) as err:
            c.compute("raw_reward", None, rewards=np.ones(2, np.float32), lengths=np.array([1, 2]),
                      mask_columns=1 << 40)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(InvalidArgumentError) as bad:
            c.compute("raw_reward", None, rewards=np.ones(2, np.float32), lengths=np.array([1, 9]), mask_columns=3)
        assert bad.value.field_violations[0][0] == "inputs['lengths']"


# ------------------------------------------------------------------------------- client compaction
def _sent(tensors: dict, cu_seqlens=None) -> codec.DecodedRequest:
    prepared = prepare_call("grpo", None, None, cu_seqlens, False, tensors)
    return codec.decode_request(prepared.request.tobytes())


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_client_sends_a_float_mask_compact(kind):
    conv = (lambda a: a) if kind == "numpy" else torch.from_numpy
    rewards, ids = conv(np.ones(4, np.float32)), conv(np.zeros(4, np.int64))
    prefix_np = (np.arange(6)[None, :] < np.array([6, 2, 0, 3])[:, None]).astype(np.float32)
    prefix = conv(prefix_np)
    req = _sent(dict(prompt_ids=ids, rewards=rewards, mask=prefix))
    assert "mask" not in req.inputs and req.mask_columns == 6 and req.per_sample
    assert req.inputs["lengths"].numpy().tolist() == [6, 2, 0, 3] and req.inputs["lengths"].numpy().dtype == np.int32
    holes = prefix_np.copy()
    holes[0, 1] = 0
    req = _sent(dict(prompt_ids=ids, rewards=rewards, mask=conv(holes)))
    assert req.inputs["mask"].numpy().dtype == np.bool_ and (req.inputs["mask"].numpy() == (holes != 0)).all()
    assert req.mask_columns == 0
    for as_is in (holes * 0.5, np.where(holes == 0, np.nan, holes).astype(np.float32)):  # not 0/1: as given
        req = _sent(dict(prompt_ids=ids, rewards=rewards, mask=conv(as_is.astype(np.float32))))
        assert req.inputs["mask"].numpy().dtype == np.float32
    f64 = holes.astype(np.float64)  # float64 mask, float32 rewards: compute dtype depends on it, sent as given
    assert _sent(dict(prompt_ids=ids, rewards=rewards, mask=conv(f64))).inputs["mask"].numpy().dtype == np.float64
    both = _sent(dict(prompt_ids=ids, rewards=conv(np.ones(4, np.float64)), mask=conv(f64)))
    assert both.inputs["mask"].numpy().dtype == np.bool_
    flat = _sent(dict(prompt_ids=ids[:2], rewards=rewards[:2], mask=conv(np.ones(5, np.float32))),
                 cu_seqlens=np.array([0, 2, 5]))
    assert flat.inputs["mask"].numpy().dtype == np.bool_ and not flat.per_sample  # packed: bytes, never lengths


def test_client_compaction_gives_the_same_results_and_errors(client):
    tensors, _ = _prefix_batch("grpo")
    for cfg in ({}, {"semantics": "verl"}, {"semantics": "openrlhf"}):
        dense = client.compute("grpo", cfg, transport="unary", **{**tensors, "mask": tensors["mask"].numpy().tolist()})
        got = client.compute("grpo", cfg, transport="unary", **tensors)  # a float prefix mask: sent as lengths
        assert torch.equal(got.advantages, dense.advantages), cfg
    bad = tensors["mask"].clone()
    bad[0, 0] = 2.0
    with pytest.raises(InvalidArgumentError) as err:
        client.compute("grpo", {}, **{**tensors, "mask": bad})
    assert err.value.field_violations[0][0] == "inputs['mask']" and "other than 0 and 1" in str(err.value)


def test_compact_mask_decisions():
    assert compact_mask(np.ones((2, 3), np.bool_)) is None  # already one byte
    assert compact_mask(np.ones((2, 3), np.uint8)) is None
    assert compact_mask([[1.0, 0.0]]) is None  # lists: encoded as they are
    got = compact_mask(torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    assert got.lengths.tolist() == [2, 3] and got.columns == 3 and got.bool_mask.dtype == torch.bool
    got = compact_mask(np.array([[0, 1, 1]], np.int64))
    assert got.lengths is None and got.bool_mask.tolist() == [[False, True, True]]


# ------------------------------------------------------------------------------- bytes on the wire
@pytest.mark.parametrize("T_", [1, 1024, 8192, 65536])
def test_one_group_of_16_fits_the_byte_budget(target, T_):
    """Per-sample response <= 1 KiB for any T; request with a bool or lengths mask <= 1 KiB + T * B bytes.
    Sizes are of the serialized messages (gRPC adds a 5-byte frame header and HTTP/2 framing)."""
    B_ = 16
    rng = np.random.default_rng(T_)
    lengths = rng.integers(1, T_ + 1, B_)
    prefix = (np.arange(T_)[None, :] < lengths[:, None]).astype(np.float32)
    holes = prefix.copy()
    holes[:, 0] = 0  # not a prefix mask: one byte per token
    call = grpc.insecure_channel(target)
    try:
        raw = call.unary_unary(COMPUTE, request_serializer=None, response_deserializer=None)
        sizes = {}
        for form, mask in (("lengths", prefix), ("bool", holes)):
            for semantics in ("nemo_rl", "verl", "openrlhf", "trl"):
                prepared = prepare_call("grpo", {"semantics": semantics}, None, None, False,
                                        dict(prompt_ids=np.zeros(B_, np.int64), rewards=rng.standard_normal(B_).astype(np.float32),
                                             mask=mask))
                request = prepared.request.tobytes()
                reply = raw(request, timeout=30)
                decoded = codec.decode_result(reply)
                assert decoded.layout != 0 and decoded.dense_shape == [B_, T_]
                sizes[(form, semantics)] = (len(request), len(reply))
                assert len(reply) <= 1024, (form, semantics, len(reply))
                assert len(request) <= 1024 + T_ * B_, (form, semantics, len(request))
                if form == "lengths":
                    assert len(request) <= 1024  # no per-token bytes at all
    finally:
        call.close()
    print(f"T={T_}: (request, response) bytes {sizes}")


def test_a_server_that_predates_lengths_gets_the_mask_as_bytes(make_server, monkeypatch):
    """An older server does not read `lengths` (INVALID_ARGUMENT "does not read"): the client sends that call
    again with a bool mask and sends bytes from then on; the results are the same."""
    import asyncio

    from advantage_client import AsyncAdvantageClient
    from advantage_server import core as core_module

    srv = make_server()
    tensors, _ = _prefix_batch("grpo")
    with AdvantageClient(srv.address, timeout=10.0) as c:
        want = c.compute("grpo", {"semantics": "verl"}, transport="unary", **tensors).advantages
        monkeypatch.setattr(core_module, "lengths_to_mask", lambda t, columns, limit: dict(t))  # as before lengths
        with pytest.raises(InvalidArgumentError, match="does not read 'lengths'"):  # what such a server answers
            c.compute("raw_reward", None, rewards=np.ones(2, np.float32), lengths=np.array([1, 2]))
        assert torch.equal(c.compute("grpo", {"semantics": "verl"}, transport="unary", **tensors).advantages, want)
        assert c._lengths_ok is False
        assert torch.equal(c.compute("grpo", {"semantics": "verl"}, transport="stream", **tensors).advantages, want)

    async def main():
        async with AsyncAdvantageClient(srv.address, timeout=10.0) as client:
            first = await client.compute("grpo", {"semantics": "verl"}, **tensors)
            return first, client._lengths_ok

    got, ok = asyncio.run(main())
    assert torch.equal(got.advantages, want) and ok is False
