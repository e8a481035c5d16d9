"""Every verl golden case, through the real gRPC path, twice:

* the verl drop-in ``advantage_client.verl.get_adv_estimator_fn(name, target)(**verl_kwargs)``, called
  the way the golden generator called verl (``config`` given as a dict and as an attribute object);
* the plain ``AdvantageClient.compute(service_name, config, **tensors)`` with the service's own input
  names, so a bug in the adapter's mapping cannot hide a bug in the service (and vice versa).

Both compare advantages and returns over the whole ``[B, T]`` tensor. Where verl returns the advantages
tensor twice, the adapter does too, and the service leaves ``returns`` unset.

The golden vectors come from an older verl commit. Where the pinned release (verl 0.9.1) computes a case
differently (tests/references/verl_releases.py: REINFORCE++ at mask holes), the drop-in, which follows
the release, skips that case with the reason, and the plain client runs it with the option that
reproduces the older verl (``reset_returns_at_holes``); tests/test_diff_verl.py checks the release.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from advantage_client import wire
from advantage_client.verl import ESTIMATORS, get_adv_estimator_fn

from conftest import assert_close_to_golden, golden_cases, load_case
from references.verl_releases import OLDER_VERL_CONFIG, changed_in_release

CASES = golden_cases("verl")
IDS = [p.stem for p in CASES]

#: verl estimators whose function returns (advantages, advantages)
SAME_RETURNS = {"grpo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus_baseline", "rloo", "rloo_vectorized",
                "opo", "gpg"}


def verl_inputs(case: dict) -> dict:
    """The case's inputs as verl received them: float32/int64 tensors, ``index`` as a NumPy array."""
    inputs = dict(case["inputs"])
    hints = inputs.pop("dtype")
    out = {}
    for name, value in inputs.items():
        hint = hints[name]
        if name == "index":
            out[name] = np.array(value, dtype=object if hint == "str" else np.int64)
        elif hint == "float":
            out[name] = float(value)
        else:
            out[name] = torch.tensor(value, dtype={"float32": torch.float32, "int64": torch.int64}[hint])
    return out


class AttrConfig:
    """verl's config as an object with attributes only (no ``get``, no ``[]``)."""

    def __init__(self, mapping: dict):
        self.__dict__.update(mapping)


def verl_call_kwargs(case: dict, config_form: str) -> dict:
    """Keyword arguments for the drop-in: the inputs, ``config``, and the config values as keywords
    where verl's function takes them as keywords. Where verl reads an option from ``config`` instead
    (grpo_passk's norm flag, reinforce_plus_plus's gamma) a *contradicting* keyword is passed as a decoy:
    the result only matches the golden if the adapter reads ``config`` as verl does. An unknown keyword
    checks that extra keywords are ignored."""
    cfg = dict(case["config"])
    kwargs = verl_inputs(case)
    keywords = {k: v for k, v in cfg.items() if k != "adv_estimator"}
    est = case["estimator"]
    if est == "grpo_passk":
        keywords["norm_adv_by_std_in_grpo"] = not cfg["norm_adv_by_std_in_grpo"]
    if est == "reinforce_plus_plus":
        keywords["gamma"] = 0.5 if cfg["gamma"] != 0.5 else 0.25
    kwargs = {**keywords, **kwargs}
    kwargs["config"] = cfg if config_form == "dict" else AttrConfig(cfg)
    kwargs["some_future_kwarg"] = object()
    return kwargs


def check_case(case: dict, advantages, returns) -> None:
    assert isinstance(advantages, torch.Tensor) and isinstance(returns, torch.Tensor)
    assert advantages.dtype == torch.float32, advantages.dtype
    assert_close_to_golden(advantages.numpy(), case, "advantages")
    assert case["expected"]["returns"] is not None, "every verl estimator returns a second tensor"
    assert_close_to_golden(returns.numpy(), case, "returns")
    assert case["expected"]["metrics"] == {}


def test_golden_cases_present():
    assert len(CASES) >= 32, f"expected the verl golden vectors, found {len(CASES)}"
    assert {load_case(p)["estimator"] for p in CASES} <= set(ESTIMATORS)


@pytest.mark.parametrize("config_form", ["dict", "object"])
@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_verl_golden_via_drop_in(path, config_form, target):
    case = load_case(path)
    changed = changed_in_release(case)
    if changed:
        pytest.skip(changed)
    fn = get_adv_estimator_fn(case["estimator"], target)
    advantages, returns = fn(**verl_call_kwargs(case, config_form))
    check_case(case, advantages, returns)
    if case["estimator"] in SAME_RETURNS:
        assert returns is advantages, "verl returns the same tensor twice; so does the drop-in"


# ------------------------------------------------------------------------- plain client path
def _vectorized_group_ids(index: np.ndarray) -> np.ndarray:
    """verl's ``as_torch_index`` (used by grpo_vectorized): labels that all parse as integers become
    those integers, so "007" and "7" are one group; otherwise the labels themselves."""
    try:
        return index.astype(np.int64)
    except (TypeError, ValueError):
        return index


def service_call(case: dict) -> tuple[str, dict, dict]:
    """(service estimator name, config dict with service key names, tensors with service input names)."""
    est, cfg, kw = case["estimator"], case["config"], verl_inputs(case)
    service = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}.get(est, est)
    config: dict = {}
    if "semantics" in wire.ESTIMATOR_FIELDS[service][1].DESCRIPTOR.fields_by_name:
        config["semantics"] = "verl"
    if est == "gae":
        config.update(gae_gamma=kw.pop("gamma"), gae_lambda=kw.pop("lam"))
    elif est in ("grpo", "grpo_vectorized", "grpo_passk"):
        config.update(normalize_rewards=cfg["norm_adv_by_std_in_grpo"], epsilon=cfg["epsilon"])
    elif est == "reinforce_plus_plus":
        config.update(gamma=cfg["gamma"])
    elif est == "gpg":
        config.update(f_norm=cfg["f_norm"])
    elif est in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        config.update(handle_zero_tail=cfg["handle_zero_tail"], epsilon=cfg["epsilon"])
    names = {"token_level_rewards": "rewards", "response_mask": "mask", "index": "prompt_ids",
             "old_log_probs": "logprobs"}
    tensors = {names.get(k, k): v for k, v in kw.items()}
    if est == "grpo_vectorized" and "prompt_ids" in tensors:
        tensors["prompt_ids"] = _vectorized_group_ids(tensors["prompt_ids"])
    return service, config, tensors


@pytest.mark.parametrize("transport", ["auto", "unary", "stream", "shm"])
@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_verl_golden_via_client_compute(path, transport, client):
    """Every verl golden case through AdvantageClient.compute, on every transport (the same bytes back)."""
    case = load_case(path)
    service, config, tensors = service_call(case)
    if changed_in_release(case):  # the golden is the older verl's answer: ask for that verl's recursion
        config.update(OLDER_VERL_CONFIG[case["estimator"]])
    result = client.compute(service, config, transport=transport, **tensors)
    if case["estimator"] in SAME_RETURNS:
        assert result.returns is None, f"{service} (verl) has no genuine returns; the service leaves them unset"
        check_case(case, result.advantages, result.advantages)
    else:
        assert result.returns is not None, f"{service} (verl) computes returns"
        check_case(case, result.advantages, result.returns)
    assert result.metrics == {}


# ------------------------------------------------------------------------- drop-in behaviour
def _case(stem: str) -> dict:
    return load_case(next(p for p in CASES if p.stem == stem))


def test_drop_in_positional_arguments_follow_verls_order(target):
    case = _case("verl-gae-g1.0-l0.95-edge")
    kw = verl_inputs(case)
    fn = get_adv_estimator_fn("gae", target)
    # verl: compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)
    advantages, returns = fn(kw["token_level_rewards"], kw["values"], kw["response_mask"], kw["gamma"], kw["lam"])
    check_case(case, advantages, returns)


def test_drop_in_accepts_verls_enum_and_uid_lists(target):
    import enum

    class AdvantageEstimator(str, enum.Enum):  # verl's enum is a str Enum with these values
        RLOO = "rloo"

    case = _case("verl-rloo-edge")
    kw = verl_inputs(case)
    kw["index"] = list(kw["index"])  # a plain list of uid strings
    advantages, returns = get_adv_estimator_fn(AdvantageEstimator.RLOO, target)(**kw)
    check_case(case, advantages, returns)


def test_drop_in_numeric_string_quirk_only_for_grpo_vectorized(target):
    """verl's grpo_vectorized merges "007" and "7" (as_torch_index parses them); verl's grpo keeps them
    apart. The golden case is grpo_vectorized's; plain grpo on the same inputs must differ exactly there."""
    case = _case("verl-grpo_vectorized-norm1-numstr")
    kw = verl_inputs(case)
    labels = list(kw["index"])
    assert "007" in labels and "7" in labels
    vec, _ = get_adv_estimator_fn("grpo_vectorized", target)(**kw, norm_adv_by_std_in_grpo=True, epsilon=1e-6)
    assert_close_to_golden(vec.numpy(), case, "advantages")
    plain, _ = get_adv_estimator_fn("grpo", target)(**kw, norm_adv_by_std_in_grpo=True, epsilon=1e-6)
    merged = np.isin(np.array(labels), ["007", "7", "8", "08"])
    assert not np.allclose(plain.numpy()[merged], vec.numpy()[merged])


def test_drop_in_unknown_name_is_a_value_error(target):
    with pytest.raises(ValueError, match="no_such_estimator"):
        get_adv_estimator_fn("no_such_estimator", target)


def test_drop_in_returns_float64_for_float64_rewards(client):
    """float64 rewards give float64 results (as verl's would); ``target`` may be an AdvantageClient."""
    case = _case("verl-rloo-uneven")
    kw = verl_inputs(case)
    kw["token_level_rewards"] = kw["token_level_rewards"].double()
    fn = get_adv_estimator_fn("rloo", client)
    assert fn.client is client
    advantages, _ = fn(**kw)
    assert advantages.dtype == torch.float64
    assert_close_to_golden(advantages.numpy(), case, "advantages")


def test_drop_in_rloo_vectorized_gives_a_group_of_one_zero(target):
    """verl's rloo_vectorized multiplies by (group size > 1); its loop twin rloo keeps a lone sample's score.
    On the uneven case (a group of one among sizes 2..9, given a non-zero score here) they agree
    everywhere else."""
    case = _case("verl-rloo-uneven")
    kw = verl_inputs(case)
    labels, counts = np.unique(kw["index"], return_counts=True)
    lone = np.isin(kw["index"], labels[counts == 1])
    assert lone.any()
    kw["response_mask"][lone, :3] = 1
    kw["token_level_rewards"][lone, 2] = 0.75
    loop, _ = get_adv_estimator_fn("rloo", target)(**kw)
    vec, vec_returns = get_adv_estimator_fn("rloo_vectorized", target)(**kw)
    assert vec_returns is vec
    assert np.abs(loop.numpy()[lone]).sum() > 0, "the loop rloo keeps a lone sample's score"
    np.testing.assert_array_equal(vec.numpy()[lone], 0.0)
    np.testing.assert_allclose(vec.numpy()[~lone], loop.numpy()[~lone], rtol=1e-6, atol=1e-7)


def test_drop_in_one_argument_call_uses_the_environment(target, monkeypatch):
    """verl calls get_adv_estimator_fn(name) with one argument: the server then comes from the environment."""
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", target)
    case = _case("verl-grpo-norm1-b2t1")
    advantages, _ = get_adv_estimator_fn("grpo")(**verl_inputs(case), norm_adv_by_std_in_grpo=True, epsilon=1e-6)
    assert_close_to_golden(advantages.numpy(), case, "advantages")
