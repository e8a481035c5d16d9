"""Every verl golden case, reproduced in-process through ``AdvantageCore().run`` with the service's names.

The mapping from verl's keyword arguments to the service's vocabulary is deliberately plain: nothing is
summed or reshaped here (``token_level_rewards`` goes as the [B, T] ``rewards``), ``index`` uid labels
become integer ids, and verl's config keys become the service config's fields. (The gRPC path and the verl
drop-in are checked against the same files by tests/test_golden_verl.py.)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from advantage_server import AdvantageCore

from conftest import assert_close_to_golden, golden_cases, load_case
from references.verl_releases import OLDER_VERL_CONFIG, changed_in_release

CASES = golden_cases("verl")

#: verl registry name -> (service estimator, fixed config)
NAMES = {
    "gae": ("gae", {"semantics": "verl"}),
    "grpo": ("grpo", {"semantics": "verl"}),
    "grpo_vectorized": ("grpo", {"semantics": "verl"}),
    "grpo_passk": ("grpo_passk", {}),
    "reinforce_plus_plus": ("reinforce_plus_plus", {"semantics": "verl"}),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", {"semantics": "verl"}),
    "remax": ("remax", {}),
    "rloo": ("rloo", {"semantics": "verl"}),
    "rloo_vectorized": ("rloo", {"semantics": "verl"}),
    "opo": ("opo", {}),
    "gpg": ("gpg", {}),
    "optimal_token_baseline": ("optimal_token_baseline", {}),
    "tir_optimal_token_baseline": ("tir_optimal_token_baseline", {}),
}
#: verl config / keyword -> service config field, per service estimator (keys verl ignores are absent)
CONFIG_KEYS = {
    "gae": {"gamma": "gae_gamma", "lam": "gae_lambda"},
    "grpo": {"norm_adv_by_std_in_grpo": "normalize_rewards", "epsilon": "epsilon"},
    "grpo_passk": {"norm_adv_by_std_in_grpo": "normalize_rewards", "epsilon": "epsilon"},
    "reinforce_plus_plus": {"gamma": "gamma"},
    "gpg": {"f_norm": "f_norm"},
    "optimal_token_baseline": {"handle_zero_tail": "handle_zero_tail", "epsilon": "epsilon"},
    "tir_optimal_token_baseline": {"handle_zero_tail": "handle_zero_tail", "epsilon": "epsilon"},
}
INPUT_NAMES = {"token_level_rewards": "rewards", "response_mask": "mask", "index": "prompt_ids", "values": "values",
               "reward_baselines": "reward_baselines", "old_log_probs": "logprobs",
               "sum_pi_squared": "sum_pi_squared", "rollout_is_weights": "rollout_is_weights"}


def group_ids(labels: list, vectorized: bool) -> np.ndarray:
    """verl ``index`` labels -> [B] int64 group ids. verl's *_vectorized estimators coerce numeric-looking
    uid strings to integers ("007" and "7" become one group); the others compare the labels as given."""
    arr = np.asarray(labels, dtype=object)
    if vectorized:
        try:
            arr = arr.astype(np.int64)
        except (TypeError, ValueError):
            pass
    return np.unique(arr.astype(str) if arr.dtype == object else arr, return_inverse=True)[1].astype(np.int64)


def service_call(case: dict) -> tuple[str, dict, dict]:
    name, fixed = NAMES[case["estimator"]]
    config = dict(fixed)
    keys = CONFIG_KEYS.get(name, {})
    inputs = dict(case["inputs"])
    hints = inputs.pop("dtype")
    for source in (case["config"], {k: v for k, v in inputs.items() if hints.get(k) == "float"}):
        for key, value in source.items():
            if key in keys:
                config[keys[key]] = value
    tensors = {}
    for key, value in inputs.items():
        if hints[key] == "float":
            continue  # gamma / lam: scalars, mapped into the config above
        if key == "index":
            tensors["prompt_ids"] = torch.from_numpy(group_ids(value, case["estimator"].endswith("_vectorized")))
        else:
            tensors[INPUT_NAMES[key]] = torch.tensor(value, dtype={"float32": torch.float32,
                                                                   "int64": torch.int64}[hints[key]])
    return name, config, tensors


def test_verl_golden_cases_present():
    assert len(CASES) >= 32, f"expected the verl golden vectors, found {len(CASES)}"
    assert {load_case(p)["estimator"] for p in CASES} <= set(NAMES)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_verl_golden_in_process(path):
    case = load_case(path)
    name, config, tensors = service_call(case)
    if changed_in_release(case):  # generated at an older verl than the pinned 0.9.1: run that verl's recursion
        config.update(OLDER_VERL_CONFIG[case["estimator"]])
    result = AdvantageCore("cpu").run(name, config, tensors)
    assert_close_to_golden(result.advantages.numpy(), case, "advantages")
    expected_returns = case["expected"]["returns"]
    if result.returns is None:
        # the service sends no returns where verl returns its advantages a second time
        assert expected_returns is None or np.array_equal(np.asarray(expected_returns, dtype=np.float64),
                                                          np.asarray(case["expected"]["advantages"], dtype=np.float64),
                                                          equal_nan=True), f"{case['id']}: verl returns differ"
    else:
        assert_close_to_golden(result.returns.numpy(), case, "returns")
    assert result.metrics == {} and case["expected"]["metrics"] == {}


def test_numstr_labels_merge_only_for_vectorized():
    labels = ["007", "7", "8", "08", "9"]
    assert group_ids(labels, vectorized=True).tolist() == [0, 0, 1, 1, 2]
    assert len(set(group_ids(labels, vectorized=False).tolist())) == 5
