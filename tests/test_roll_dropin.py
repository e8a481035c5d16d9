"""ROLL's RLVR advantage step served (issue #38): ``advantage_client.roll.install()`` rebinds the
``compute_advantage`` name ROLL's ``roll/pipeline/rlvr/rlvr_pipeline.py`` imported, and the pipeline's call then goes
to the service.

Two proofs, one recorded and one run here:

* With ROLL's own code (run by hand, recorded): ``tests/golden_roll/generate.py --check-dropin`` imports ROLL's real
  pipeline module from the pinned source, calls ``install()``, and runs the statements of ``RLVRPipeline.run`` from
  the domain grouping through ``DataProto.concat`` (ROLL's get_sample_level_mask, reward_postprocess,
  compute_token_reward and the rebound compute_advantage, on ROLL's real DataProto) on every golden case, against an
  in-process server counting requests, and with the server's answers scaled by 1.0001. Its outcome is in the cases'
  ``source.dropin_check``; :func:`test_the_check_in_rolls_own_pipeline_is_recorded_for_these_cases` requires that
  record to exist, to be for exactly these cases (their hash) and to have passed. CI has neither ROLL's source nor
  its dependencies, so it cannot run that check itself.
* Here, in CI: a module registered under the pipeline module's name (a stand-in for ROLL's, which CI cannot import)
  holds the name as ROLL's holds it (``from roll.utils.functionals import compute_advantage``, here a sentinel),
  ``install()`` rebinds it, and the test calls it as ``RLVRPipeline.run`` does, with exactly the keyword arguments
  ROLL's call site passes (read from ROLL's file by the check and recorded: ``pipeline.call_keywords``) on a
  DataProto-shaped batch (a tensordict ``TensorDict`` with ROLL's keys and shapes: ``response_mask`` [B, T + 1],
  ``token_level_rewards`` / ``values`` [B, T]) made from each golden case (tests/golden_roll: ROLL's own outputs at
  the pinned commit, ``token_level_rewards`` being what its ``compute_token_reward`` left). Requests are counted at
  the server (one per call); with the server's answers scaled by 1.0001 every case fails.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
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
GOLDEN = json.loads((HERE / "roll_cases.json").read_text())
CASES = GOLDEN["cases"]
#: the outcome of generate.py --check-dropin (ROLL's own pipeline code), None when it was never recorded
CHECK = GOLDEN["source"].get("dropin_check")
#: the keyword arguments RLVRPipeline.run passes to compute_advantage (read from ROLL's file by the check)
ROLL_CALL_KEYWORDS = tuple((CHECK or {}).get("pipeline", {}).get("call_keywords", ()))
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


def count_estimators(monkeypatch, names) -> dict:
    """Count the runs of estimators ``names`` in the in-process server (one per request), their answers scaled by
    ``state["scale"]`` (1.0: untouched); returns that state."""
    from advantage_server.estimators.registry import REGISTRY

    state = {"calls": 0, "scale": 1.0}
    for name in set(names):
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


@pytest.fixture
def counted(monkeypatch):
    """Count the estimator runs of the in-process server (one per request), optionally scaling its answers."""
    return count_estimators(monkeypatch, dropin.ESTIMATORS.values())


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


def call_as_the_pipeline(mod, case: dict) -> tuple[np.ndarray, np.ndarray, DataProto]:
    """``mod.compute_advantage`` called with exactly ROLL's keywords (ROLL_CALL_KEYWORDS), valued as
    RLVRPipeline.run values them; the client is the one the drop-in holds (the ``served`` fixture)."""
    data, final, cfg = roll_batch(case)
    values = {"data": data, "gamma": cfg.gamma, "lambd": cfg.lambd, "adv_estimator": cfg.adv_estimator,
              "advantage_clip": cfg.advantage_clip, "whiten_advantages": cfg.whiten_advantages,
              "whiten_rewards": cfg.whiten_rewards, "response_mask": final, "pipeline_config": cfg}
    assert ROLL_CALL_KEYWORDS, "no recorded ROLL call site: run tests/golden_roll/generate.py --check-dropin"
    missing = set(ROLL_CALL_KEYWORDS) - set(values)
    assert not missing, f"ROLL's call passes {sorted(missing)}, which this test does not know how to value"
    out = mod.compute_advantage(**{k: values[k] for k in ROLL_CALL_KEYWORDS})
    return out.batch["advantages"].numpy(), out.batch["returns"].numpy(), out


def close(got, want) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    return got.shape == want.shape and bool((np.abs(got - want) <= RTOL * np.abs(want) + ATOL * scale).all())


@pytest.fixture
def served(monkeypatch, client):
    """The drop-in's per-process client is the test server's (ROLL's call passes no client)."""
    monkeypatch.setattr(dropin, "_client", client)
    return client


def cases_sha256(cases) -> str:  # as tests/golden_roll/generate.py hashes them
    text = json.dumps(cases, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_check_in_rolls_own_pipeline_is_recorded_for_these_cases():
    """generate.py --check-dropin ran ROLL's own RLVRPipeline.run statements with install() on exactly these cases
    (recorded hash), every case passed (one request per domain), and every case failed at x1.0001."""
    assert CHECK is not None, "no source.dropin_check: run tests/golden_roll/generate.py --check-dropin"
    n = len(CASES)
    assert CHECK["cases"] == n and CHECK["cases_sha256"] == cases_sha256(CASES), \
        "the cases changed since the check ran: run tests/golden_roll/generate.py --check-dropin again"
    assert CHECK["roll_run_matches_goldens"] == n   # ROLL's statements, not installed, give the goldens
    per_estimator = collections.Counter(dropin.ESTIMATORS[c["roll_estimator"]] for c in CASES)
    assert set(CHECK["domains"]) == {"math", "math+code"}
    for layout, rec in CHECK["domains"].items():
        domains = len(layout.split("+"))
        assert rec["passed"] == n, (layout, rec)
        assert rec["fail_at_x1.0001"] == n, (layout, rec)
        assert rec["requests"] == {**{k: v * domains for k, v in per_estimator.items()}, "total": n * domains}, rec
    pipe = CHECK["pipeline"]
    assert pipe["path"] == "roll/pipeline/rlvr/rlvr_pipeline.py" and "compute_advantage" in pipe["globals"]
    assert GOLDEN["source"]["commit"] in CHECK["command"]
    assert dropin.PIPELINE_MODULE in CHECK["roll_modules_run_from_source"]
    assert not set(CHECK["stubs"]) & {"roll.utils.functionals", "roll.utils.kl_controller",
                                      "roll.distributed.scheduler.protocol", dropin.PIPELINE_MODULE}


def test_rolls_call_binds_to_the_dropin():
    """Every keyword ROLL's call site passes is a parameter of the drop-in's compute_advantage."""
    assert ROLL_CALL_KEYWORDS
    inspect.signature(dropin.compute_advantage).bind(**dict.fromkeys(ROLL_CALL_KEYWORDS))


def test_install_rebinds_the_pipelines_name(pipeline):
    assert dropin.install() is released_compute_advantage
    assert pipeline.compute_advantage is dropin.compute_advantage


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_pipelines_call_gives_rolls_advantages_and_returns(pipeline, served, counted, case):
    dropin.install()
    advantages, returns, data = call_as_the_pipeline(pipeline, case)
    assert counted["calls"] == 1
    assert close(advantages, case["expected_advantages"])
    assert close(returns, case["expected_returns"])
    assert data.batch["advantages"].dtype == torch.float32  # ROLL's compute_advantage works in float32
    if case["roll_estimator"] != "gae":  # ROLL's raw_advantages: the returns, before whitening
        assert torch.equal(data.batch["raw_advantages"], data.batch["returns"])


def test_every_case_fails_with_the_servers_answers_scaled(pipeline, served, counted):
    dropin.install()
    counted["scale"] = 1.0001
    passed = [c["name"] for c in CASES
              if all(close(a, w) for a, w in zip(call_as_the_pipeline(pipeline, c)[:2],
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
