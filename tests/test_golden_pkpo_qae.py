"""Golden cases for ``pkpo`` and ``qae`` over gRPC, computed by the references outside this repository.

* tests/golden_passk/rllm_pkpo_cases.json: rLLM PR #743 (rllm-org/rllm, commit 6b3b2da5d57f..., function
  ``calculate_pkpo_advantages_per_group`` in ``rllm/trainer/algorithms/rl_algo.py``), called once per prompt
  group in float64; the file stores the per-sample results (the service answers them times the mask).
* tests/golden_passk/qae_verl_quantile_cases.json: verl 0.9.1's ``compute_grpo_outcome_advantage`` run with
  the QAE release's one-line change (the group baseline ``torch.quantile(scores, quantile_k)`` instead of
  ``torch.mean``), float32 as verl computes it; the file stores verl's ``[B, T]`` result.

Each file's ``source`` records where its numbers come from; only inputs and outputs are stored here.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent / "golden_passk"
PKPO = json.loads((HERE / "rllm_pkpo_cases.json").read_text())
QAE = json.loads((HERE / "qae_verl_quantile_cases.json").read_text())


def test_sources_are_recorded():
    assert PKPO["source"]["commit"] == "6b3b2da5d57f9b0a941f518568df8d889d8d8e21"
    assert PKPO["source"]["pull_request"] == 743
    assert "junkangwu/QAE" in QAE["source"]["repository"] and "verl 0.9.1" in QAE["source"]["function"]
    assert len(PKPO["cases"]) >= 20 and len(QAE["cases"]) >= 10


@pytest.mark.parametrize("case", PKPO["cases"], ids=[c["name"] for c in PKPO["cases"]])
def test_pkpo_matches_rllm(client, case):
    inputs = {k: np.asarray(v, dtype=np.int64 if k == "prompt_ids" else np.float64) for k, v in case["inputs"].items()}
    per = np.asarray(case["expected"]["advantages_per_sample"])
    got = client.compute("pkpo", case["config"], output_dtype="float64", as_numpy=True, **inputs).advantages
    np.testing.assert_allclose(got, per[:, None] * inputs["mask"], rtol=1e-9, atol=1e-12)
    if case["config"]["k"] < len(per) and np.ptp(per) > 0:
        assert np.abs(got).max() > 0  # a case that could fail: some signal is compared


@pytest.mark.parametrize("case", QAE["cases"], ids=[c["name"] for c in QAE["cases"]])
def test_qae_matches_verl_with_the_quantile_baseline(client, case):
    inputs = {k: np.asarray(v, dtype=np.int64 if k == "prompt_ids" else np.float32) for k, v in case["inputs"].items()}
    want = np.asarray(case["expected"]["advantages"], dtype=np.float64)
    got = client.compute("qae", case["config"], as_numpy=True, **inputs).advantages
    assert got.shape == want.shape
    # verl computes in float32, the service in float64 rounded to float32: a few float32 ulps
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
