"""Golden ROLL cases (``semantics = roll``), computed by ROLL's own RLVR code at the commit
``advantage_client.references`` names, run through the service over gRPC on every transport.

ROLL publishes no package with this code, so ``tests/golden_roll/generate.py`` (run by hand; its docstring has the
refresh command) ran that commit's ``get_sample_level_mask``, ``reward_postprocess``, ``compute_token_reward`` and
``compute_advantage`` (``roll/utils/functionals.py``), in the order its RLVR pipeline calls them, on seeded ROLL-shaped
batches, and ``tests/golden_roll/roll_cases.json`` holds the inputs and ROLL's outputs. The cases cover the four RLVR
``adv_estimator`` values (``grpo``; ``reinforce`` and ``step_reinforce``, the service's ``reinforce_plus_plus``;
``gae``), every ``norm_mean_type`` / ``norm_std_type`` combination ROLL can run, ``reward_clip`` (0: off),
``advantage_clip`` (0 included), ``whiten_advantages``, ``whiten_rewards``, the token-level KL with each ``kl_penalty``
ROLL can run on [B, T] log-probs (kl, abs, mse, k3) under a fixed and an adaptive controller (its value sent as the
coefficient), gamma and lambda, response masks with holes and masked last tokens, ROLL's sample-level masks, ragged
prompt and response lengths, and float32 / float64.

Two entry points per case: the whole step from ROLL's [B] ``response_level_rewards`` (what a direct caller asks), and
``compute_advantage`` alone from ROLL's ``token_level_rewards`` [B, T] (what the ``advantage_client.roll`` drop-in
sends, ROLL's own reward_postprocess and compute_token_reward having run).

Rule: ROLL's ``compute_advantage`` computes in float32 (its ``.float()``), the service in float64; each position must
satisfy ``|service - roll| <= 1e-5 * |roll| + 2e-6 * max(1, max |roll|)`` (the slime rule), tight enough that the
server's answers scaled by 1.0001 fail every case (tests/test_roll_dropin.py).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from advantage_client.references import REFERENCES

HERE = pathlib.Path(__file__).resolve().parent / "golden_roll"
GOLDEN = json.loads((HERE / "roll_cases.json").read_text())
RTOL, ATOL = 1e-5, 2e-6
#: ROLL's RLVR adv_estimator -> the service's estimator
ESTIMATOR = {"grpo": "grpo", "reinforce": "reinforce_plus_plus", "step_reinforce": "reinforce_plus_plus",
             "gae": "gae"}
#: ROLL's kl_penalty -> the service's KL type
KL_TYPE = {"kl": "k1", "abs": "abs", "mse": "k2", "k3": "k3"}


def service_call(case: dict, whole_step: bool = True) -> tuple[str, dict, dict]:
    """(estimator, config, inputs) of ``case``: ROLL's pipeline config under the service's names. ``whole_step``:
    from the [B] rewards; else from ROLL's token_level_rewards (compute_advantage alone)."""
    rc = case["roll_config"]
    name = ESTIMATOR[case["roll_estimator"]]
    dt = np.dtype(case["dtype"])
    config: dict = {"semantics": "roll", "normalize_advantages": rc["whiten_advantages"],
                    "whiten_rewards": rc["whiten_rewards"]}
    if rc["advantage_clip"] is not None:
        config["advantage_clip"] = rc["advantage_clip"]
    if name == "gae":
        config["gae_gamma"], config["gae_lambda"] = rc["gamma"], rc["lambd"]
    else:
        config["gamma"] = rc["gamma"]
    inputs = {"mask": np.asarray(case["final_response_mask"], np.float32)}
    if name == "gae":
        inputs["values"] = np.asarray(case["values"], dt)
    B = len(case["response_level_rewards"])
    if rc["reward_clip"] is not None:  # whole step: ROLL's two clamps; token_level_rewards: clamped again, a no-op
        config["reward_clip"] = rc["reward_clip"]
    if not whole_step:
        inputs["rewards"] = np.asarray(case["token_level_rewards"], dt)
        if name == "grpo":  # required by grpo; not read from [B, T] rewards (ROLL normalised them already)
            inputs["prompt_ids"] = np.zeros(B, np.int64)
        return name, config, inputs
    inputs["rewards"] = np.asarray(case["response_level_rewards"], dt)
    inputs["attention_mask"] = np.asarray(case["attention_mask"], np.float32)
    groups = np.arange(B) // case["n_samples"]
    if name != "gae" or "group" in (rc["norm_mean_type"], rc["norm_std_type"]):
        inputs["prompt_ids"] = groups.astype(np.int64)
    if name != "grpo":
        for key in ("norm_mean_type", "norm_std_type"):
            if rc[key] is not None:
                config[key] = rc[key]
    if rc["add_token_level_kl"]:
        config["use_kl_in_reward"] = True
        config["reference_policy_kl_penalty"] = rc["kl_coef"]
        config["reference_policy_kl_type"] = KL_TYPE[rc["kl_penalty"]]
        if rc["kl_penalty"] == "k3":  # ROLL's k3 clamps the estimate to +-10
            config["kl_output_clamp_value"] = 10.0
        inputs["logprobs"] = np.asarray(case["old_log_probs"], dt)
        inputs["reference_logprobs"] = np.asarray(case["ref_log_probs"], dt)
    return name, config, inputs


def assert_close(got, want, what: str) -> None:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), what
    scale = max(1.0, float(np.abs(want).max()))
    bad = np.abs(got - want) > RTOL * np.abs(want) + ATOL * scale
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} positions differ from ROLL, e.g. "
                           f"{got[bad][0]!r} vs {want[bad][0]!r} at {int(np.flatnonzero(bad)[0])}")


def test_cases_record_the_pinned_commit():
    src = GOLDEN["source"]
    ref = REFERENCES["roll"]
    assert ref.release == f"main@{src['commit']}"
    assert "roll/utils/functionals.py" in src["paths"]
    assert "alibaba/ROLL" in src["repo"]
    assert src["generator"] == "tests/golden_roll/generate.py" and (HERE / "generate.py").is_file()
    cases = GOLDEN["cases"]
    assert {c["roll_estimator"] for c in cases} == set(ESTIMATOR)  # every RLVR adv_estimator but gigpo (served)
    kls = {c["roll_config"]["kl_penalty"] for c in cases if c["roll_config"]["add_token_level_kl"]}
    assert kls == set(KL_TYPE), kls
    assert {c["roll_config"]["kl_ctrl"] for c in cases if c["roll_config"]["add_token_level_kl"]} == \
        {"fixed", "adaptive"}
    norms = {(c["roll_config"]["norm_mean_type"], c["roll_config"]["norm_std_type"]) for c in cases
             if c["roll_estimator"] != "grpo"}
    assert {(None, None), ("batch", "batch"), ("group", None), ("group", "batch"), (None, "batch"),
            ("batch", None), ("group", "group")} <= norms, norms
    assert {c["dtype"] for c in cases} == {"float32", "float64"}
    assert 30 <= len(cases) <= 50


@pytest.mark.parametrize("transport", ["auto", "unary", "stream", "shm"])
@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_case_over_grpc(client, case, transport):
    """ROLL's whole RLVR advantage step, from its [B] response-level rewards."""
    name, config, inputs = service_call(case)
    got = client.compute(name, config, as_numpy=True, transport=transport, output_dtype=case["dtype"], **inputs)
    assert_close(got.advantages, case["expected_advantages"], f"{case['name']} advantages")
    assert got.returns is not None
    assert_close(got.returns, case["expected_returns"], f"{case['name']} returns")


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_case_from_token_level_rewards(client, case):
    """ROLL's compute_advantage alone, from the token_level_rewards its compute_token_reward left (the drop-in's
    request)."""
    name, config, inputs = service_call(case, whole_step=False)
    got = client.compute(name, config, as_numpy=True, output_dtype=case["dtype"], **inputs)
    assert_close(got.advantages, case["expected_advantages"], f"{case['name']} advantages")
    assert_close(got.returns, case["expected_returns"], f"{case['name']} returns")


def test_roll_reinforce_and_step_reinforce_are_one_computation():
    """ROLL's RLVR compute_advantage treats reinforce and step_reinforce alike: both map to reinforce_plus_plus."""
    by = {}
    for c in GOLDEN["cases"]:
        if c["name"].endswith("_defaults") and c["roll_estimator"] in ("reinforce", "step_reinforce"):
            by[c["roll_estimator"]] = c
    assert by["reinforce"]["response_level_rewards"] == by["step_reinforce"]["response_level_rewards"]
    assert by["reinforce"]["expected_advantages"] == by["step_reinforce"]["expected_advantages"]
    assert by["reinforce"]["expected_returns"] == by["step_reinforce"]["expected_returns"]


def test_a_tiny_case_by_hand(client):
    """ROLL's grpo: group-normalised rewards (unbiased std + 1e-6) on the last attended token, discounted through a
    mask hole; the returns keep the hole's value, the advantages are 0 there."""
    rewards = np.array([1.0, 0.0], np.float32)            # group (1, 0): mean 0.5, std sqrt(0.5)
    mask = np.array([[1, 0, 1], [1, 1, 1]], np.float32)
    got = client.compute("grpo", {"semantics": "roll", "gamma": 0.5}, as_numpy=True, output_dtype="float64",
                         rewards=rewards, mask=mask, prompt_ids=np.zeros(2, np.int64))
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(got.returns, [[a / 4, a / 2, a], [-a / 4, -a / 2, -a]], rtol=1e-6)
    np.testing.assert_allclose(got.advantages, [[a / 4, 0, a], [-a / 4, -a / 2, -a]], rtol=1e-6)
    # the attention mask moves the reward to the last attended token, here masked: the reward is lost
    att = np.array([[1, 1, 1], [1, 1, 1]], np.float32)
    got = client.compute("grpo", {"semantics": "roll"}, as_numpy=True, rewards=rewards, attention_mask=att,
                         mask=np.array([[1, 1, 0], [1, 1, 1]], np.float32), prompt_ids=np.zeros(2, np.int64))
    np.testing.assert_allclose(got.advantages[0], [0, 0, 0], atol=0)


def test_roll_only_fields_are_named_when_misused(client):
    from advantage_client.errors import InvalidArgumentError
    B = np.zeros(2, np.int64)
    mask = np.ones((2, 3), np.float32)
    with pytest.raises(InvalidArgumentError, match="config.reward_clip"):
        client.compute("grpo", {"semantics": "verl", "reward_clip": 1.0}, rewards=np.ones(2, np.float32), mask=mask,
                       prompt_ids=B)
    with pytest.raises(InvalidArgumentError, match="config.reference_policy_kl_type"):
        client.compute("reinforce_plus_plus", {"semantics": "verl", "use_kl_in_reward": True,
                                               "reference_policy_kl_type": "abs"},
                       rewards=np.ones(2, np.float32), mask=mask, logprobs=mask, reference_logprobs=mask)
    with pytest.raises(InvalidArgumentError, match="config.norm_std_type"):
        client.compute("reinforce_plus_plus", {"semantics": "roll", "norm_std_type": "group"},
                       rewards=np.ones(2, np.float32), mask=mask, prompt_ids=B)
    with pytest.raises(InvalidArgumentError, match="prompt_ids"):
        client.compute("gae", {"semantics": "roll", "norm_mean_type": "group"}, rewards=np.ones(2, np.float32),
                       mask=mask, values=mask)
    with pytest.raises(InvalidArgumentError, match="config.norm_mean_type"):
        client.compute("reinforce_plus_plus", {"semantics": "roll", "norm_mean_type": "batch"},
                       rewards=np.ones((2, 3), np.float32), mask=mask)
    with pytest.raises(InvalidArgumentError, match="config.normalize_rewards"):
        client.compute("grpo", {"semantics": "roll", "normalize_rewards": False}, rewards=np.ones(2, np.float32),
                       mask=mask, prompt_ids=B)
