"""Per-sample results: the declarations (``EstimatorSpec.per_sample``, listed as ``EstimatorInfo.per_sample``)
cannot lie.

* for every estimator, every semantics and every combination of its bool options (and a discount below 1
  where it has one), on batches with holes, empty rows, groups of one, ``[B]`` and ``[B, T]`` rewards:
  where a rule is declared, the dense result rebuilt from its per-sample values is the dense result, bit for
  bit, and a ``per_sample`` request gets that layout; where none is, the dense result is not one value per
  row under any layout for some batch (so the declarations are complete, not just true);
* the server never answers per-sample with values that do not rebuild the dense result (a wrong
  declaration falls back to dense), nor for the packed layout;
* through gRPC, in every output dtype: the per-sample answer, rebuilt by the client, equals the dense answer.
"""
from __future__ import annotations

import dataclasses
import itertools

import grpc
import numpy as np
import pytest
import torch

from advantage_client import layout
from advantage_client.client import build_request, decode_result
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_server import AdvantageCore
from advantage_server.core import config_from_dict
from advantage_server.errors import InvalidInput
from advantage_server.estimators import REGISTRY

B, T = 12, 9
IDS = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 4])  # groups of 3, 3, 4, and two groups of one
CORE = AdvantageCore("cpu")
CORE.verify_per_sample = True  # the declarations below hold without it; the check must not hide a bad one


def batch(name: str, seed: int, token_rewards: bool = False) -> dict[str, torch.Tensor]:
    """Every declared input of ``name``: a mask with holes, an empty row (2), a full row (5), a prefix row (7)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[2] = 0
    mask[5] = 1
    mask[7] = (torch.arange(T) < 4).float()
    out: dict[str, torch.Tensor] = {}
    for spec in REGISTRY[name].inputs:
        if spec.name == "mask":
            out["mask"] = mask
        elif spec.name == "prompt_ids":
            out["prompt_ids"] = IDS
        elif spec.name == "reward/<name>":
            out["reward/a"], out["reward/b"] = torch.randn(B, generator=g), torch.randn(B, generator=g)
        elif spec.name == "rewards":
            two_d = token_rewards and "[B, T]" in spec.shapes
            out["rewards"] = torch.randn(B, T, generator=g) if two_d else torch.randn(B, generator=g)
        elif spec.name.endswith("logprobs"):
            out[spec.name] = -torch.rand(B, T, generator=g) * 2
        elif spec.name in ("sum_pi_squared", "rollout_is_weights"):
            out[spec.name] = 0.05 + 0.95 * torch.rand(B, T, generator=g)
        elif spec.kind == "mask":  # a second mask (AReaL's attention_mask): 0/1 with holes
            out[spec.name] = (torch.rand(B, T, generator=g) > 0.2).float()
        elif spec.kind == "integer":  # ids (GiGPO trajectory_ids, anchor_ids, step_index)
            out[spec.name] = torch.randint(0, 3, (B,), generator=g)
        elif spec.shapes[0] == "[B]":
            out[spec.name] = torch.randn(B, generator=g)
        else:
            out[spec.name] = torch.randn(B, T, generator=g)
    return out


def configs(name: str) -> list[dict]:
    """Every semantics x every combination of the bool options set true (those a semantics refuses are
    skipped), plus a discount below 1 where the config has ``gamma``."""
    fields = {f.name: f for f in dataclasses.fields(REGISTRY[name].config)}
    semantics = fields["semantics"].metadata["choices"] if "semantics" in fields else (None,)
    bools = [n for n, f in fields.items() if "bool" in str(f.type)]
    out = []
    for sem in semantics:
        for on in itertools.product([False, True], repeat=len(bools)):
            cfg = {n: True for n, v in zip(bools, on) if v}
            if sem is not None:
                cfg["semantics"] = sem
            for c in ([cfg, {**cfg, "gamma": 0.9}] if "gamma" in fields else [cfg]):
                try:
                    config_from_dict(REGISTRY[name], c).resolved()
                except InvalidInput as err:  # an option this semantics refuses (the error contract)
                    assert all("does not apply" in d for _, d in err.violations), err.violations
                    continue
                out.append(c)
    return out


def per_row_layouts(t: torch.Tensor, mask: torch.Tensor) -> set[int]:
    """The layouts under which the dense ``t`` is one value per row."""
    m = mask != 0
    return {code for code in layout.PER_SAMPLE_LAYOUTS
            if torch.equal(layout.rebuild(layout.row_values(t, code, m), code, m), t)}


CASES = [(name, cfg) for name in sorted(REGISTRY) for cfg in configs(name)]


@pytest.mark.parametrize("name,cfg", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_declarations_hold_and_are_complete(name, cfg):
    spec = REGISTRY[name]
    results = [(seed, tr, CORE.run(name, cfg, batch(name, seed, tr))) for seed in range(3) for tr in (False, True)]
    resolved = config_from_dict(spec, cfg).resolved()
    declared = spec.per_sample_for(resolved)
    seen_per_row = []
    for seed, token_rewards, dense in results:
        mask = batch(name, seed, token_rewards)["mask"]
        fits = per_row_layouts(dense.advantages, mask)
        if dense.returns is not None:
            fits &= per_row_layouts(dense.returns, mask)
        seen_per_row.append(fits)
        if declared:
            assert declared in fits, (f"{name} {cfg}: declared {layout.layout_name(declared)} but the dense result "
                                      f"(seed {seed}, token rewards {token_rewards}) is not")
            small = CORE.run(name, cfg, batch(name, seed, token_rewards), per_sample=True)
            assert small.layout == declared and small.advantages.shape == (B,) and small.dense_shape == (B, T)
            assert torch.equal(layout.rebuild(small.advantages, declared, mask != 0), dense.advantages)
            if dense.returns is not None:
                assert torch.equal(layout.rebuild(small.returns, declared, mask != 0), dense.returns)
    if not declared:
        assert any(not fits for fits in seen_per_row), (
            f"{name} {cfg}: one value per row on every batch tried ({seen_per_row}) but declared dense")
        small = CORE.run(name, cfg, batch(name, 0), per_sample=True)
        assert small.layout == 0 and small.advantages.shape == (B, T)


def test_every_estimator_the_issue_names_is_per_sample_under_each_semantics():
    want = {"grpo": 6, "rloo": 3, "opo": 1, "gpg": 1, "grpo_passk": 1, "gdpo": 2, "raw_reward": 1,
            "reinforce_plus_plus": 1, "reinforce_plus_plus_baseline": 2, "pkpo": 1, "qae": 1,
            "gigpo": 1, "maxrl": 1}
    assert {n: len(s.per_sample) for n, s in REGISTRY.items() if s.per_sample} == want


def test_a_wrong_declaration_answers_dense_when_verifying(monkeypatch, caplog):
    spec = REGISTRY["gae"]
    monkeypatch.setitem(REGISTRY, "gae", dataclasses.replace(spec, per_sample=(("", layout.BROADCAST),)))
    tensors = batch("gae", 0)
    core = AdvantageCore("cpu")
    core.verify_per_sample = True
    got = core.run("gae", {}, tensors, per_sample=True)
    assert got.layout == 0 and got.advantages.shape == (B, T)
    assert torch.equal(got.advantages, CORE.run("gae", {}, tensors).advantages)
    assert "does not hold" in caplog.text


def test_packed_layout_answers_dense():
    lengths = torch.tensor([3, 5, 2])
    got = CORE.run("grpo", {}, dict(prompt_ids=torch.tensor([0, 0, 0]), rewards=torch.tensor([1.0, 0.0, 2.0])),
                   cu_seqlens=torch.tensor([0, 3, 8, 10]), per_sample=True)
    assert got.layout == 0 and got.advantages.shape == (int(lengths.sum()),)


@pytest.mark.parametrize("output_dtype", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("semantics", ["nemo_rl", "verl", "openrlhf", "trl"])
def test_per_sample_over_grpc_rebuilds_the_dense_answer(client, target, semantics, output_dtype):
    tensors = batch("grpo", 1)
    config = {"semantics": semantics}
    channel = grpc.insecure_channel(target)
    try:
        stub = pb_grpc.AdvantageServiceStub(channel)
        dense_msg = stub.ComputeAdvantage(build_request("grpo", config, output_dtype, **tensors), timeout=30)
        small_msg = stub.ComputeAdvantage(build_request("grpo", config, output_dtype, per_sample=True, **tensors),
                                          timeout=30)
    finally:
        channel.close()
    assert dense_msg.layout == 0 and list(dense_msg.advantages.shape) == [B, T]
    assert small_msg.layout == REGISTRY["grpo"].per_sample_for(
        REGISTRY["grpo"].config(semantics=semantics).resolved())
    assert list(small_msg.advantages.shape) == [B] and list(small_msg.dense_shape) == [B, T]
    assert len(small_msg.SerializeToString()) < len(dense_msg.SerializeToString()) / 4
    dense = decode_result(dense_msg).advantages
    got = client.compute("grpo", config, output_dtype=output_dtype, **tensors).advantages
    assert got.dtype == dense.dtype and torch.equal(got, dense)  # equal values (a -0.0 may come back +0.0)
    raw = client.compute("grpo", config, output_dtype=output_dtype, as_numpy=True, **tensors).advantages
    want = decode_result(dense_msg, as_numpy=True).advantages
    assert raw.dtype == want.dtype and raw.shape == (B, T)
    if output_dtype == "bfloat16":  # numpy holds bfloat16 as raw uint16 bits: compare the float32 they stand for
        raw, want = ((x.astype(np.uint32) << 16).view(np.float32) for x in (raw, want))
    assert (raw == want).all()


def test_rebuild_takes_the_layout_name_a_result_carries_and_any_0_1_mask():
    """``compute(..., per_sample=True)`` returns ``layout`` as a name ("broadcast"); ``layout.rebuild`` takes it
    as it is (before: "not a per-sample layout: broadcast"), and a float 0/1 mask as well as a bool one."""
    import numpy as np
    import torch
    from advantage_client import layout
    values = torch.tensor([1.5, -2.0])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    for name, want in (("broadcast", [[1.5, 1.5, 1.5], [-2.0, -2.0, -2.0]]),
                       ("broadcast_times_mask", [[1.5, 0.0, 1.5], [0.0, -2.0, 0.0]]),
                       ("up_to_last_valid", [[1.5, 1.5, 1.5], [-2.0, -2.0, 0.0]])):
        assert layout.rebuild(values, name, mask).tolist() == want
        assert layout.rebuild(values, layout.layout_code(name), mask != 0).tolist() == want
        assert layout.rebuild(values.numpy(), name, mask.numpy()).tolist() == want
    with pytest.raises(ValueError, match="per-sample layouts are broadcast"):
        layout.rebuild(values, "broadcst", mask)
    with pytest.raises(ValueError, match="not a per-sample layout: dense"):
        layout.rebuild(values, "dense", mask)
