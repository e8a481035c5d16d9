"""Golden slime cases (``semantics = slime``), computed by slime's own code at the commit
``advantage_client.references`` names, run through the service over gRPC on every transport.

slime publishes no package, so ``tests/golden_slime/generate.py`` (run by hand; its docstring has the refresh
command) ran that commit's ``RolloutManager._post_process_rewards`` (the rollout's group normalisation) and its
trainer's ``compute_advantages_and_returns`` (KL, the estimator, and ``--normalize-advantages`` whitening) on
seeded ragged batches, and ``tests/golden_slime/slime_cases.json`` holds the inputs and slime's outputs. The cases
cover slime's six ``--advantage-estimator`` values (``grpo``, ``gspo`` and ``cispo`` share the service's ``grpo``;
``ppo`` is ``gae``), response lengths from 1 to ~700 in one batch (sent packed: ``cu_seqlens``), loss masks with
holes and masked ends, ``--kl-coef`` 0 and not, every ``--kl-loss-type``, gamma and lambda, and each
normalisation flag.

Rule: slime computes in float32 (and its whitening's variance as ``E[x^2] - mu^2``), the service in float64, and
each case is sent as float32 and compared at every position with
``|service - slime| <= 1e-5 * |slime| + 2e-6 * max(1, max |slime|)``: the worst case measured is 4.2e-7 of
``max(1, max |slime|)`` (a ppo return), and the rule is tight enough that the server's answers scaled by 1.0001 fail
every case (tests/test_slime_dropin.py), where the float32 rule of the differential tests (2e-4) could not.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from advantage_client.references import REFERENCES

HERE = pathlib.Path(__file__).resolve().parent / "golden_slime"
GOLDEN = json.loads((HERE / "slime_cases.json").read_text())
RTOL, ATOL = 1e-5, 2e-6
#: slime's --advantage-estimator -> the service's estimator
ESTIMATOR = {"grpo": "grpo", "gspo": "grpo", "cispo": "grpo", "reinforce_plus_plus": "reinforce_plus_plus",
             "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "ppo": "gae"}


def service_call(case: dict, hook: bool = False) -> tuple[str, dict, dict]:
    """(estimator, config, inputs) of ``case`` for the service: slime's flags under their service names.
    ``hook``: what slime's trainer hands ``--custom-advantage-function-path`` (rewards its rollout already
    normalised; slime whitens after the hook), as ``advantage_client.slime`` sends it."""
    args = case["slime_args"]
    name = ESTIMATOR[case["slime_estimator"]]
    config: dict = {"semantics": "slime"}
    kl_coef = float(args["kl_coef"])
    if name != "grpo":
        config["use_kl_in_reward"] = kl_coef != 0
        if kl_coef:
            kind = args["kl_loss_type"]
            config["reference_policy_kl_penalty"] = kl_coef
            config["reference_policy_kl_type"] = "k3" if kind == "low_var_kl" else kind
            if kind == "low_var_kl":
                config["kl_output_clamp_value"] = 10.0
    if name in ("grpo", "reinforce_plus_plus_baseline"):
        config["rewards_normalization"] = bool(args["rewards_normalization"]) and not hook
    if name == "grpo":
        config["normalize_rewards"] = bool(args["grpo_std_normalization"])
    if name == "reinforce_plus_plus":
        config["gamma"] = float(args["gamma"])
    if name == "gae":
        config["gae_gamma"], config["gae_lambda"] = float(args["gamma"]), float(args["lambd"])
    config["normalize_advantages"] = bool(args["normalize_advantages"]) and not hook
    B = len(case["raw_rewards"])
    n = int(args["n_samples_per_prompt"])
    # slime's grouping: n consecutive samples per prompt (the whole batch as one group when the count differs)
    groups = np.arange(B) // n if B == n * int(args["rollout_batch_size"]) else np.zeros(B, np.int64)
    rewards = case["post_processed_rewards"] if hook else case["raw_rewards"]
    inputs = {"rewards": np.asarray(rewards, np.float32), "mask": np.asarray(case["loss_mask"], np.float32),
              "cu_seqlens": np.asarray(case["cu_seqlens"], np.int64)}
    if name in ("grpo", "reinforce_plus_plus_baseline"):
        inputs["prompt_ids"] = groups.astype(np.int64)
    if config.get("use_kl_in_reward"):
        inputs["logprobs"] = np.asarray(case["log_probs"], np.float32)
        inputs["reference_logprobs"] = np.asarray(case["ref_log_probs"], np.float32)
    if name == "gae":
        inputs["values"] = np.asarray(case["values"], np.float32)
    return name, config, inputs


def assert_close(got, want, what: str) -> None:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), what
    scale = max(1.0, float(np.abs(want).max()))
    bad = np.abs(got - want) > RTOL * np.abs(want) + ATOL * scale
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} positions differ from slime, e.g. "
                           f"{got[bad][0]!r} vs {want[bad][0]!r} at {int(np.flatnonzero(bad)[0])}")


def test_cases_record_the_pinned_commit():
    src = GOLDEN["source"]
    ref = REFERENCES["slime"]
    assert ref.release == f"main@{src['commit']}"
    assert ref.code in src["paths"]
    assert "THUDM/slime" in src["repo"]
    assert src["generator"] == "tests/golden_slime/generate.py" and (HERE / "generate.py").is_file()
    estimators = {c["slime_estimator"] for c in GOLDEN["cases"]}
    assert estimators == set(ESTIMATOR), estimators  # every --advantage-estimator slime offers
    kinds = {c["slime_args"]["kl_loss_type"] for c in GOLDEN["cases"] if c["slime_args"]["kl_coef"]}
    assert kinds == {"k1", "k2", "k3", "low_var_kl"}, kinds
    lengths = np.concatenate([np.diff(c["cu_seqlens"]) for c in GOLDEN["cases"]])
    assert lengths.min() == 1 and lengths.max() > 512  # ragged: one token to several chunks of slime's scans


@pytest.mark.parametrize("transport", ["auto", "unary", "stream", "shm"])
@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_case_over_grpc(client, case, transport):
    """slime's whole advantage step (rollout normalisation, estimator, whitening), sent packed."""
    name, config, inputs = service_call(case)
    cu = inputs.pop("cu_seqlens")
    got = client.compute(name, config, as_numpy=True, transport=transport, cu_seqlens=cu, **inputs)
    assert_close(got.advantages, case["expected_advantages"], f"{case['name']} advantages")
    assert got.returns is not None
    assert_close(got.returns, case["expected_returns"], f"{case['name']} returns")


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_case_as_the_trainer_hook_sends_it(client, case):
    """What ``--custom-advantage-function-path`` gets (rewards after slime's rollout normalisation) and must give
    back (slime whitens after it): the service's answer with ``rewards_normalization`` and
    ``normalize_advantages`` off equals slime's advantages before whitening."""
    name, config, inputs = service_call(case, hook=True)
    cu = inputs.pop("cu_seqlens")
    got = client.compute(name, config, as_numpy=True, cu_seqlens=cu, **inputs)
    want = case.get("expected_advantages_unwhitened", case["expected_advantages"])
    assert_close(got.advantages, want, f"{case['name']} advantages before whitening")
    assert_close(got.returns, case["expected_returns"], f"{case['name']} returns")


def test_a_tiny_case_by_hand(client):
    """slime's ppo puts the reward on the response's last token even where its loss mask is 0, and its KL is not
    masked; its reinforce_plus_plus puts it on the last mask = 1 token and masks the KL."""
    cu = np.array([0, 3])
    mask = np.array([1, 1, 0], np.float32)
    values = np.zeros(3, np.float32)
    got = client.compute("gae", {"semantics": "slime", "gae_gamma": 1.0, "gae_lambda": 1.0}, as_numpy=True,
                         cu_seqlens=cu, rewards=np.array([2.0], np.float32), mask=mask, values=values)
    np.testing.assert_array_equal(got.advantages, [2.0, 2.0, 2.0])
    got = client.compute("reinforce_plus_plus", {"semantics": "slime", "normalize_advantages": False, "gamma": 0.5},
                         as_numpy=True, cu_seqlens=cu, rewards=np.array([2.0], np.float32), mask=mask)
    np.testing.assert_array_equal(got.advantages, [1.0, 2.0, 0.0])


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if c["slime_estimator"] != "grpo"][::3],
                         ids=lambda c: c["name"])
def test_a_dense_batch_with_padding_equals_the_packed_one(client, case):
    """The same rows sent dense ([B, max T], padding holding values and log-probs that are not 0) where every row's
    mask ends with 1: the answer equals the packed one (a review found the dense ppo reading its padding's values
    and KL). Each row's last token gets mask 1 here, since a dense row's end is its last mask = 1 position."""
    name, config, inputs = service_call(case)
    cu = inputs.pop("cu_seqlens")
    lengths = np.diff(cu)
    ends = cu[1:][lengths > 0] - 1
    inputs["mask"][ends] = 1.0
    packed = client.compute(name, config, as_numpy=True, cu_seqlens=cu, **inputs)
    B, T = len(lengths), int(lengths.max())
    rows, cols = np.repeat(np.arange(B), lengths), np.arange(int(cu[-1])) - np.repeat(cu[:-1], lengths)
    dense = {}
    rng = np.random.default_rng(0)
    for key, value in inputs.items():
        if value.shape[0] == cu[-1] and key != "rewards":
            full = (rng.standard_normal((B, T)) - 3.0).astype(np.float32) if key != "mask" else np.zeros((B, T), np.float32)
            full[rows, cols] = value
            dense[key] = full
        else:
            dense[key] = value
    got = client.compute(name, config, as_numpy=True, **dense)
    for label in ("advantages", "returns"):
        np.testing.assert_allclose(getattr(got, label)[rows, cols], getattr(packed, label), rtol=1e-6, atol=1e-6,
                                   err_msg=label)


def test_a_tied_group_gets_zero(client):
    """slime's float32 mean of seven rewards of 0.7 misses 0.7 by an ulp and divides that by (a tiny std + 1e-6):
    +0.0596 each. The service gives the tie exactly 0 (documented in grpo.py)."""
    got = client.compute("grpo", {"semantics": "slime"}, as_numpy=True, per_sample=True, prompt_ids=np.zeros(7, np.int64),
                         rewards=np.full(7, 0.7, np.float32), mask=np.ones((7, 1), np.float32))
    np.testing.assert_array_equal(got.advantages, np.zeros(7))
