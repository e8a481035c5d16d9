"""ROLL's RLVR advantage step served (issue #38): ``advantage_client.roll.install()`` rebinds the
``compute_advantage`` name ROLL's ``roll/pipeline/rlvr/rlvr_pipeline.py`` imported, and the pipeline's call then goes
to the service.

ROLL's pipeline module (ray, datasets, Megatron workers) cannot be imported in CI, so a module registered under its
name holds the name as the pipeline module holds it (``from roll.utils.functionals import compute_advantage``, here a
sentinel), ``install()`` rebinds it, and the test calls it exactly as ``RLVRPipeline.run`` does (keyword arguments,
``response_mask=final_response_mask``, ``pipeline_config``) on a DataProto-shaped batch (a tensordict ``TensorDict``
with ROLL's keys and shapes: ``response_mask`` [B, T + 1], ``token_level_rewards`` / ``values`` [B, T]) made from each
golden case (tests/golden_roll: ROLL's own outputs at the pinned commit, ``token_level_rewards`` being what its
``compute_token_reward`` left). Requests are counted at the server (one per call); with the server's answers scaled
by 1.0001 every case fails.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import types

import numpy as np
import pytest

from advantage_client import roll as dropin

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

HERE = pathlib.Path(__file__).resolve().parent / "golden_roll"
CASES = json.loads((HERE / "roll_cases.json").read_text())["cases"]
RTOL, ATOL = 1e-5, 2e-6


def released_compute_advantage(*args, **kwargs):  # stands for roll.utils.functionals.compute_advantage
    raise AssertionError("ROLL's own compute_advantage ran: install() did not rebind the pipeline's name")


@pytest.fixture
def pipeline(monkeypatch):
    """The name ROLL's rlvr_pipeline module imported, in a module registered under that module's name."""
    for name in ("roll", "roll.pipeline", "roll.pipeline.rlvr"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    mod = types.ModuleType(dropin.PIPELINE_MODULE)
    mod.compute_advantage = released_compute_advantage
    monkeypatch.setitem(sys.modules, dropin.PIPELINE_MODULE, mod)
    return mod


@pytest.fixture
def counted(monkeypatch):
    """Count the estimator runs of the in-process server (one per request), optionally scaling its answers."""
    from advantage_server.estimators.registry import REGISTRY

    state = {"calls": 0, "scale": 1.0}
    for name in set(dropin.ESTIMATORS.values()):
        spec = REGISTRY[name]

        def fn(cfg, batch, _inner=spec.fn):
            state["calls"] += 1
            out = _inner(cfg, batch)
            if state["scale"] != 1.0:
                out = dataclasses.replace(out, advantages=out.advantages * state["scale"],
                                          returns=None if out.returns is None else out.returns * state["scale"])
            return out
        monkeypatch.setitem(REGISTRY, name, dataclasses.replace(spec, fn=fn))
    return state


class DataProto:
    """ROLL's DataProto as compute_advantage sees it: a TensorDict batch and a meta_info dict."""

    def __init__(self, batch):
        self.batch, self.meta_info = batch, {}


def roll_batch(case: dict) -> tuple[DataProto, torch.Tensor, types.SimpleNamespace]:
    """(data, final_response_mask, pipeline_config) of ``case`` as RLVRPipeline.run holds them."""
    dt = getattr(torch, case["dtype"])
    final = torch.tensor(case["final_response_mask"], dtype=torch.float32)
    B = final.shape[0]
    fields = {"token_level_rewards": torch.tensor(case["token_level_rewards"], dtype=dt),
              "response_mask": torch.nn.functional.pad(final, (1, 0)).long(),   # [B, T + 1]
              "final_response_mask": final}
    if "values" in case:
        fields["values"] = torch.tensor(case["values"], dtype=dt)
    rc = case["roll_config"]
    config = types.SimpleNamespace(gamma=rc["gamma"], lambd=rc["lambd"], adv_estimator=case["roll_estimator"],
                                   advantage_clip=rc["advantage_clip"], whiten_advantages=rc["whiten_advantages"],
                                   whiten_rewards=rc["whiten_rewards"], use_opd=False, is_pure_opd=False)
    return DataProto(tensordict.TensorDict(fields, batch_size=[B])), final, config


def call_as_the_pipeline(mod, case: dict, client) -> tuple[np.ndarray, np.ndarray, DataProto]:
    data, final, cfg = roll_batch(case)
    out = mod.compute_advantage(
        data=data, gamma=cfg.gamma, lambd=cfg.lambd, adv_estimator=cfg.adv_estimator,
        advantage_clip=cfg.advantage_clip, whiten_advantages=cfg.whiten_advantages,
        whiten_rewards=cfg.whiten_rewards, response_mask=final, pipeline_config=cfg, client=client)
    return out.batch["advantages"].numpy(), out.batch["returns"].numpy(), out


def close(got, want) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    return got.shape == want.shape and bool((np.abs(got - want) <= RTOL * np.abs(want) + ATOL * scale).all())


def test_install_rebinds_the_pipelines_name(pipeline):
    assert dropin.install() is released_compute_advantage
    assert pipeline.compute_advantage is dropin.compute_advantage


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_pipelines_call_gives_rolls_advantages_and_returns(pipeline, client, counted, case):
    dropin.install()
    advantages, returns, data = call_as_the_pipeline(pipeline, case, client)
    assert counted["calls"] == 1
    assert close(advantages, case["expected_advantages"])
    assert close(returns, case["expected_returns"])
    assert data.batch["advantages"].dtype == torch.float32  # ROLL's compute_advantage works in float32
    if case["roll_estimator"] != "gae":  # ROLL's raw_advantages: the returns, before whitening
        assert torch.equal(data.batch["raw_advantages"], data.batch["returns"])


def test_every_case_fails_with_the_servers_answers_scaled(pipeline, client, counted):
    dropin.install()
    counted["scale"] = 1.0001
    passed = [c["name"] for c in CASES
              if all(close(a, w) for a, w in zip(call_as_the_pipeline(pipeline, c, client)[:2],
                                                 (c["expected_advantages"], c["expected_returns"])))]
    assert not passed, passed
    assert counted["calls"] == len(CASES)


def test_opd_and_other_estimators_are_refused(pipeline, client, counted):
    dropin.install()
    data, final, cfg = roll_batch(CASES[0])
    with pytest.raises(ValueError, match="agentic"):
        pipeline.compute_advantage(data=data, gamma=1.0, lambd=0.95, adv_estimator="gigpo", response_mask=final,
                                   client=client)
    cfg.use_opd = True
    with pytest.raises(ValueError, match="use_opd"):
        pipeline.compute_advantage(data=data, gamma=1.0, lambd=0.95, adv_estimator="grpo", response_mask=final,
                                   pipeline_config=cfg, client=client)
    del data.batch["token_level_rewards"]
    with pytest.raises(ValueError, match="token_level_rewards"):
        pipeline.compute_advantage(data=data, gamma=1.0, lambd=0.95, adv_estimator="grpo", response_mask=final,
                                   client=client)
    assert counted["calls"] == 0


def test_without_a_final_mask_the_response_mask_is_used(pipeline, client, counted):
    """ROLL's default: ``response_mask[:, 1:]`` when the caller passes none."""
    dropin.install()
    case = next(c for c in CASES if c["name"] == "grpo_defaults")
    data, final, cfg = roll_batch(case)
    out = pipeline.compute_advantage(data=data, gamma=cfg.gamma, lambd=cfg.lambd, adv_estimator="grpo", client=client)
    assert close(out.batch["advantages"].numpy(), case["expected_advantages"])
