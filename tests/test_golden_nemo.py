"""Every NeMo RL golden case, through the real gRPC path (client -> server -> client)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from advantage_client import RemoteAdvantageEstimator

from conftest import assert_close_to_golden, golden_cases, load_case

CASES = golden_cases("nemo-rl")


def _tensor(value, hint):
    dtype = {"float32": torch.float32, "int64": torch.int64}[hint]
    return torch.tensor(value, dtype=dtype)


def nemo_kwargs(case: dict) -> dict:
    inputs = dict(case["inputs"])
    hints = inputs.pop("dtype")
    kwargs = {}
    for name, value in inputs.items():
        if name == "repeated_batch":
            kwargs[name] = {k: _tensor(v, hints[name]) for k, v in value.items()}
        else:
            kwargs[name] = _tensor(value, hints[name])
    return kwargs


def test_golden_cases_present():
    assert len(CASES) >= 29, f"expected the NeMo RL golden vectors, found {len(CASES)}"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_nemo_golden_over_grpc(path, target):
    case = load_case(path)
    estimator = RemoteAdvantageEstimator(target, case["estimator"], case["config"], result_format="advantage_result")
    result = estimator.compute_advantage(**nemo_kwargs(case))
    assert_close_to_golden(result.advantages.numpy(), case, "advantages")
    if case["expected"]["returns"] is None:
        assert result.returns is None
    else:
        assert_close_to_golden(result.returns.numpy(), case, "returns")
    expected_metrics = case["expected"]["metrics"]
    assert set(result.metrics) == set(expected_metrics)
    for key, want in expected_metrics.items():
        assert abs(result.metrics[key] - want) <= 1e-5 + 1e-4 * abs(want), (key, result.metrics[key], want)
