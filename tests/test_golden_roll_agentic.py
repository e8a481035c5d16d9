"""ROLL's agentic advantage step (``semantics = roll``): golden cases computed by ROLL's own agentic pipeline code at
the commit ``advantage_client.references`` names, run through the service over gRPC on every transport, and the
``advantage_client.roll`` drop-in bound where ROLL's ``AgenticPipeline.run`` calls ``agentic_compute_advantage``.

``tests/golden_roll/generate_agentic.py`` (run by hand; its docstring has the refresh command) ran ROLL's
``compute_discounted_returns``, ``get_agentic_response_level_mask``, ``compute_response_level_rewards``,
``compute_token_reward`` and ``agentic_compute_advantage`` (``roll/pipeline/agentic/utils.py``) on its real
``DataProto``, in the pipeline's order, on seeded agentic batches: every ``adv_estimator`` the function offers (gae,
reinforce, grpo, gigpo, step_reinforce, agentic_reinforce), gamma, lambda, ``whiten_advantages``, ``whiten_rewards``,
``advantage_clip`` (0 included), ``reward_clip``, the token-level KL (kl, abs, mse, k3; fixed and adaptive controller),
the reward normalisation's groupings (traj_group_id, tag, batch) and mean / std types, GiGPO's episode and step
weights, ``step_reward_gamma``, multi-turn response masks (observation tokens between turns, masked last tokens, a
single valid token), ragged lengths, float32 / float64.

What ``agentic_compute_advantage`` computes equals ROLL's RLVR ``compute_advantage`` (the same lines, the same
functions under them) for gae, reinforce, grpo, step_reinforce and gigpo: the service's ``reinforce_plus_plus`` /
``grpo`` / ``gae`` under ``semantics = roll`` from ROLL's token-level rewards; ``agentic_reinforce`` is
``reinforce_plus_plus`` with ``segment_returns`` (ROLL's ``compute_agentic_reinforce_return``). Two entry points
per case: from ROLL's ``token_level_rewards`` (the drop-in's request), and from the ``[B]`` response-level rewards
that ROLL's ``compute_response_level_rewards`` left (the service places them, applies the KL and the reward clip).
Same rule as tests/test_golden_roll.py.
"""
from __future__ import annotations

import collections
import hashlib
import inspect
import json
import pathlib
import sys
import types

import numpy as np
import pytest

from advantage_client import roll as dropin
from advantage_client.references import REFERENCES

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

HERE = pathlib.Path(__file__).resolve().parent / "golden_roll"
GOLDEN = json.loads((HERE / "roll_agentic_cases.json").read_text())
CASES = GOLDEN["cases"]
CHECK = GOLDEN["source"].get("dropin_check")
ROLL_CALL_KEYWORDS = tuple((CHECK or {}).get("pipeline", {}).get("call_keywords", ()))
RTOL, ATOL = 1e-5, 2e-6
KL_TYPE = {"kl": "k1", "abs": "abs", "mse": "k2", "k3": "k3"}


def service_call(case: dict, whole_step: bool) -> tuple[str, dict, dict]:
    """(estimator, config, inputs): from ROLL's token_level_rewards (the drop-in's request) or, ``whole_step``, from
    its response_level_rewards (placement, KL and reward clip by the service)."""
    rc = case["roll_config"]
    est = case["roll_estimator"]
    name, config = dropin.service_config(est, rc["gamma"], rc["lambd"], rc["advantage_clip"], rc["whiten_advantages"],
                                         rc["whiten_rewards"], agentic=True)
    dt = np.dtype(case["dtype"])
    inputs = {"mask": np.asarray(case["response_mask"], np.float32)}
    if name == "gae":
        inputs["values"] = np.asarray(case["values"], dt)
    B = len(case["response_level_rewards"])
    if not whole_step:
        inputs["rewards"] = np.asarray(case["token_level_rewards"], dt)
        if name == "grpo":
            inputs["prompt_ids"] = np.zeros(B, np.int64)
        return name, config, inputs
    if name == "grpo":  # ROLL's agentic grpo normalised upstream (agentic_reward_norm): reinforce's returns here
        name = "reinforce_plus_plus"
    inputs["rewards"] = np.asarray(case["response_level_rewards"], np.dtype(case["response_level_rewards_dtype"]))
    inputs["attention_mask"] = np.asarray(case["attention_mask"], np.float32)
    if rc["reward_clip"] is not None:
        config["reward_clip"] = rc["reward_clip"]
    if rc["add_token_level_kl"]:
        config.update(use_kl_in_reward=True, reference_policy_kl_penalty=rc["kl_coef"],
                      reference_policy_kl_type=KL_TYPE[rc["kl_penalty"]])
        if rc["kl_penalty"] == "k3":
            config["kl_output_clamp_value"] = 10.0
        inputs["logprobs"] = np.asarray(case["old_log_probs"], dt)
        inputs["reference_logprobs"] = np.asarray(case["ref_log_probs"], dt)
    return name, config, inputs


def errors_over_tol(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    tol = RTOL * np.abs(want) + ATOL * max(1.0, float(np.abs(want).max()))
    return float((np.abs(got - want) / tol).max())


def close(got, want) -> bool:
    return np.asarray(got).shape == np.asarray(want).shape and errors_over_tol(got, want) <= 1.0


def test_cases_record_the_pinned_commit_and_cover_every_estimator():
    src = GOLDEN["source"]
    assert REFERENCES["roll"].release == f"main@{src['commit']}"
    assert {"roll/pipeline/agentic/utils.py", "roll/pipeline/agentic/agentic_pipeline.py"} <= set(src["paths"])
    assert src["generator"] == "tests/golden_roll/generate_agentic.py" and (HERE / "generate_agentic.py").is_file()
    assert {c["roll_estimator"] for c in CASES} == set(dropin.AGENTIC_ESTIMATORS)
    rcs = [c["roll_config"] for c in CASES]
    assert {r["kl_penalty"] for r in rcs if r["add_token_level_kl"]} == set(KL_TYPE)
    assert {r["kl_ctrl"] for r in rcs if r["add_token_level_kl"]} == {"fixed", "adaptive"}
    assert {r["reward_normalization"]["grouping"] for r in rcs} == {"traj_group_id", "tag", "batch"}
    assert {c["dtype"] for c in CASES} == {"float32", "float64"}
    assert any(r["whiten_advantages"] for r in rcs) and any(r["whiten_rewards"] for r in rcs)
    assert any(r["advantage_clip"] == 0.0 for r in rcs) and any(r["reward_clip"] for r in rcs)
    # multi-turn masks: some row has several runs of mask = 1
    assert any(max(int((np.diff(np.r_[0, row]) == 1).sum()) for row in c["response_mask"]) > 1 for c in CASES)


@pytest.mark.parametrize("transport", ["auto", "unary", "stream", "shm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_golden_case_over_grpc(client, case, transport):
    """agentic_compute_advantage, from the token_level_rewards ROLL's compute_token_reward left."""
    name, config, inputs = service_call(case, whole_step=False)
    got = client.compute(name, config, as_numpy=True, transport=transport, output_dtype=case["dtype"], **inputs)
    assert close(got.advantages, case["expected_advantages"]), errors_over_tol(got.advantages,
                                                                                case["expected_advantages"])
    assert close(got.returns, case["expected_returns"]), errors_over_tol(got.returns, case["expected_returns"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_golden_case_from_response_level_rewards(client, case):
    """compute_token_reward (placement, token-level KL, reward clip) and agentic_compute_advantage, from the [B]
    rewards ROLL's compute_response_level_rewards left."""
    name, config, inputs = service_call(case, whole_step=True)
    got = client.compute(name, config, as_numpy=True, output_dtype=case["dtype"], **inputs)
    assert close(got.advantages, case["expected_advantages"]), errors_over_tol(got.advantages,
                                                                                case["expected_advantages"])
    assert close(got.returns, case["expected_returns"]), errors_over_tol(got.returns, case["expected_returns"])


def test_agentic_reinforce_by_hand(client):
    """One return per turn: the turn's last token reward plus gamma times the next turn's return; 0 between turns."""
    rewards = np.array([[0.5, 1.0, 9.0, 0.0, 2.0, 0.0]], np.float32)   # 9.0 sits on an observation token
    mask = np.array([[1, 1, 0, 1, 1, 0]], np.float32)
    got = client.compute("reinforce_plus_plus", {"semantics": "roll", "gamma": 0.5, "segment_returns": True},
                         as_numpy=True, output_dtype="float64", rewards=rewards, mask=mask)
    np.testing.assert_allclose(got.returns, [[2.0, 2.0, 0.0, 2.0, 2.0, 0.0]])
    np.testing.assert_allclose(got.advantages, got.returns)


# ---------------------------------------------------------------------------------------------------------------
# the drop-in at ROLL's agentic call site
# ---------------------------------------------------------------------------------------------------------------

def released_agentic_compute_advantage(*args, **kwargs):  # stands for roll.pipeline.agentic.utils'
    raise AssertionError("ROLL's own agentic_compute_advantage ran: install() did not rebind the pipeline's name")


@pytest.fixture
def pipeline(monkeypatch):
    """The name ROLL's agentic_pipeline module imported, in a module registered under that module's name (and the
    RLVR module's, which install() rebinds as well)."""
    for name in ("roll", "roll.pipeline", "roll.pipeline.rlvr", "roll.pipeline.agentic"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    rlvr_mod = types.ModuleType(dropin.PIPELINE_MODULE)
    rlvr_mod.compute_advantage = None
    monkeypatch.setitem(sys.modules, dropin.PIPELINE_MODULE, rlvr_mod)
    mod = types.ModuleType(dropin.AGENTIC_PIPELINE_MODULE)
    mod.agentic_compute_advantage = released_agentic_compute_advantage
    monkeypatch.setitem(sys.modules, dropin.AGENTIC_PIPELINE_MODULE, mod)
    return mod


@pytest.fixture
def counted(monkeypatch):
    from test_roll_dropin import count_estimators

    return count_estimators(monkeypatch, dropin.AGENTIC_ESTIMATORS.values())


@pytest.fixture
def served(monkeypatch, client):
    monkeypatch.setattr(dropin, "_client", client)
    return client


class DataProto:
    def __init__(self, batch):
        self.batch, self.meta_info = batch, {}


def call_as_the_pipeline(mod, case: dict):
    """``mod.agentic_compute_advantage`` called with exactly the keywords AgenticPipeline.run passes (recorded)."""
    dt = getattr(torch, case["dtype"])
    mask = torch.tensor(case["response_mask"], dtype=torch.int64)
    fields = {"token_level_rewards": torch.tensor(case["token_level_rewards"], dtype=dt),
              "response_mask": torch.nn.functional.pad(mask, (1, 0))}
    if "values" in case:
        fields["values"] = torch.tensor(case["values"], dtype=dt)
    data = DataProto(tensordict.TensorDict(fields, batch_size=[mask.shape[0]]))
    rc = case["roll_config"]
    cfg = types.SimpleNamespace(gamma=rc["gamma"], lambd=rc["lambd"], adv_estimator=case["roll_estimator"],
                                advantage_clip=rc["advantage_clip"], whiten_advantages=rc["whiten_advantages"],
                                whiten_rewards=rc["whiten_rewards"], use_opd=False, is_pure_opd=False)
    values = {"data": data, "gamma": cfg.gamma, "lambd": cfg.lambd, "adv_estimator": cfg.adv_estimator,
              "advantage_clip": cfg.advantage_clip, "whiten_advantages": cfg.whiten_advantages,
              "whiten_rewards": cfg.whiten_rewards, "pipeline_config": cfg}
    assert ROLL_CALL_KEYWORDS, "no recorded call site: run tests/golden_roll/generate_agentic.py --check-dropin"
    assert not set(ROLL_CALL_KEYWORDS) - set(values), ROLL_CALL_KEYWORDS
    out = mod.agentic_compute_advantage(**{k: values[k] for k in ROLL_CALL_KEYWORDS})
    return out.batch["advantages"].numpy(), out.batch["returns"].numpy(), out


def cases_sha256(cases) -> str:  # as generate.py hashes them
    return hashlib.sha256(json.dumps(cases, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def test_the_check_in_rolls_own_agentic_pipeline_is_recorded_for_these_cases():
    """generate_agentic.py --check-dropin ran ROLL's own AgenticPipeline.run statements (compute_discounted_returns
    through the compute_advantage block) with install() on exactly these cases: every case passed with one request,
    and every case failed at x1.0001."""
    assert CHECK is not None, "no source.dropin_check: run tests/golden_roll/generate_agentic.py --check-dropin"
    n = len(CASES)
    assert CHECK["cases"] == n and CHECK["cases_sha256"] == cases_sha256(CASES), \
        "the cases changed since the check ran: run generate_agentic.py --check-dropin again"
    assert CHECK["roll_run_matches_goldens"] == n and CHECK["passed"] == n and CHECK["fail_at_x1.0001"] == n
    per_estimator = collections.Counter(dropin.AGENTIC_ESTIMATORS[c["roll_estimator"]] for c in CASES)
    assert CHECK["requests"] == {**per_estimator, "total": n}, CHECK["requests"]
    assert CHECK["worst_err_over_tol"] <= 1.0
    pipe = CHECK["pipeline"]
    assert pipe["path"] == "roll/pipeline/agentic/agentic_pipeline.py"
    assert {"agentic_compute_advantage", "compute_response_level_rewards", "compute_token_reward",
            "compute_discounted_returns", "get_agentic_response_level_mask"} <= set(pipe["globals"])
    assert dropin.AGENTIC_PIPELINE_MODULE in CHECK["roll_modules_run_from_source"]
    assert "roll.pipeline.agentic.utils" in CHECK["roll_modules_run_from_source"]
    assert not set(CHECK["stubs"]) & {"roll.utils.functionals", "roll.pipeline.agentic.utils",
                                      "roll.distributed.scheduler.protocol", dropin.AGENTIC_PIPELINE_MODULE}
    assert GOLDEN["source"]["commit"] in CHECK["command"]


def test_rolls_call_binds_to_the_dropin():
    assert ROLL_CALL_KEYWORDS and "response_mask" not in ROLL_CALL_KEYWORDS
    inspect.signature(dropin.agentic_compute_advantage).bind(**dict.fromkeys(ROLL_CALL_KEYWORDS))


def test_install_rebinds_both_pipelines_names(pipeline):
    assert dropin.install() is None  # the RLVR stand-in's name was None
    assert pipeline.agentic_compute_advantage is dropin.agentic_compute_advantage
    assert sys.modules[dropin.PIPELINE_MODULE].compute_advantage is dropin.compute_advantage
    assert dropin.INSTALLED[dropin.AGENTIC_PIPELINE_MODULE] is released_agentic_compute_advantage


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_pipelines_call_gives_rolls_advantages_and_returns(pipeline, served, counted, case):
    dropin.install()
    advantages, returns, data = call_as_the_pipeline(pipeline, case)
    assert counted["calls"] == 1
    assert close(advantages, case["expected_advantages"])
    assert close(returns, case["expected_returns"])
    assert data.batch["advantages"].dtype == torch.float32
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


def test_opd_and_unknown_estimators_are_refused(pipeline, client, counted):
    dropin.install()
    batch = DataProto(tensordict.TensorDict({"token_level_rewards": torch.zeros(2, 3),
                                             "response_mask": torch.ones(2, 4, dtype=torch.int64)}, batch_size=[2]))
    with pytest.raises(ValueError, match="agentic_compute_advantage"):
        pipeline.agentic_compute_advantage(data=batch, gamma=1.0, lambd=0.95, adv_estimator="ppo", client=client)
    with pytest.raises(ValueError, match="use_opd"):
        pipeline.agentic_compute_advantage(data=batch, gamma=1.0, lambd=0.95, adv_estimator="agentic_reinforce",
                                           pipeline_config=types.SimpleNamespace(use_opd=True), client=client)
    assert counted["calls"] == 0


def test_segment_returns_equal_their_loop_twin():
    """The scan (any device, no per-step loop) equals the per-turn loop on random masks, holes at both ends."""
    from advantage_server.estimators.reinforce_plus_plus import segment_returns, segment_returns_loop
    g = torch.Generator().manual_seed(7)
    for gamma in (0.0, 0.5, 0.97, 1.0):
        r = torch.randn(6, 33, generator=g, dtype=torch.float64)
        m = (torch.rand(6, 33, generator=g) < 0.6).double()
        m[0] = 0
        m[1] = 1
        torch.testing.assert_close(segment_returns(r * m, m, gamma), segment_returns_loop(r * m, m, gamma),
                                   rtol=1e-12, atol=1e-12)
