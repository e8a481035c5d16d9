"""Golden GiGPO cases from the references that publish no package, run through the service over gRPC:
verl-agent's ``gigpo/core_gigpo.py`` (``semantics = verl_agent``) and ROLL's ``roll/pipeline/agentic/utils.py``
(``semantics = roll``), each at the commit ``advantage_client.references`` names.

Their code cannot be installed as a test oracle, so a throwaway script outside this repository ran each
reference's own functions at that commit on seeded multi-turn batches (verl-agent:
``compute_step_discounted_returns`` and ``compute_gigpo_outcome_advantage``; ROLL:
``compute_discounted_returns`` and ``compute_response_level_rewards``), and
``tests/golden_gigpo/verl_agent_cases.json`` and ``tests/golden_gigpo/roll_cases.json`` hold only the inputs
and the references' outputs (their ``source`` and ``how`` fields record the repository, path, commit and
procedure). The cases cover uneven trajectory lengths, anchor states shared by 1..n trajectories (and the
same anchor in two prompt groups, which verl-agent keeps apart and ROLL merges), groups of one trajectory
and of one row, masks with holes and all-zero rows, both modes, gamma 0 to 1, step_advantage_weight 0 to 2,
rows permuted (order carried by step_index) and step_index omitted (batch order).

Rule: both references compute in float32, so each case is sent as float32 and compared at every position
with ``|service - reference| <= 2e-4 * |reference| + 2e-5 * max(1, max |reference|)`` (tests/test_diff_verl.py's
float32 rule).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from advantage_client.references import REFERENCES

HERE = pathlib.Path(__file__).resolve().parent / "golden_gigpo"
GOLDEN = json.loads((HERE / "verl_agent_cases.json").read_text())
ROLL = json.loads((HERE / "roll_cases.json").read_text())
RTOL, ATOL = 2e-4, 2e-5


@pytest.mark.parametrize("semantics, golden, repo", [("verl_agent", GOLDEN, "langfengQ/verl-agent"),
                                                     ("roll", ROLL, "alibaba/ROLL")])
def test_cases_record_the_pinned_commit(semantics, golden, repo):
    src = golden["source"]
    assert REFERENCES[semantics].release == f"main@{src['commit']}"
    assert src["path"] == REFERENCES[semantics].code
    assert repo in src["repo"]
    assert len(golden["cases"]) >= 10
    assert all(c["config"]["semantics"] == semantics for c in golden["cases"])


@pytest.mark.parametrize("case", GOLDEN["cases"] + ROLL["cases"],
                         ids=lambda c: f"{c['config']['semantics']}-{c['name']}")
def test_golden_case_over_grpc(client, case):
    inputs = {k: np.asarray(v, dtype=np.float32 if k in ("rewards", "mask") else np.int64)
              for k, v in case["inputs"].items()}
    got = np.asarray(client.compute("gigpo", case["config"], as_numpy=True, **inputs).advantages, dtype=np.float64)
    want = np.asarray(case["expected_advantages"], dtype=np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    scale = max(1.0, float(np.abs(want).max()))
    bad = np.abs(got - want) > RTOL * np.abs(want) + ATOL * scale
    assert not bad.any(), (f"{case['name']}: {int(bad.sum())} positions differ from verl-agent, e.g. "
                           f"{got[bad][0]!r} vs {want[bad][0]!r}")


def test_default_config_is_the_verl_agent_scripts():
    """The cases that use gamma 0.95, weight 1, mean_norm and epsilon 1e-6 give the same answer with no config."""
    case = next(c for c in GOLDEN["cases"] if c["name"] == "uneven_lengths_mean_norm")
    assert case["config"] == {"semantics": "verl_agent", "gamma": 0.95, "step_advantage_weight": 1.0,
                              "mode": "mean_norm", "epsilon": 1e-6}
    assert case["reference_call"]["gamma"] == 0.95


@pytest.fixture(scope="module")
def default_case():
    return next(c for c in GOLDEN["cases"] if c["name"] == "uneven_lengths_mean_norm")


def test_unset_config_reproduces_the_default_case(client, default_case):
    inputs = {k: np.asarray(v, dtype=np.float32 if k in ("rewards", "mask") else np.int64)
              for k, v in default_case["inputs"].items()}
    got = client.compute("gigpo", None, as_numpy=True, **inputs).advantages
    want = np.asarray(default_case["expected_advantages"])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(want).max())))
