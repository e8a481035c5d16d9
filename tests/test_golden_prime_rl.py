"""Golden prime-rl cases (``semantics = prime_rl``), computed by prime-rl's own code at the commit
``advantage_client.references`` names, run through the service over gRPC on every transport.

prime-rl publishes no package, so ``tests/golden_prime_rl/generate.py`` (run by hand; its docstring has the refresh
command) built each algorithm with prime-rl's ``build_algorithm`` and awaited its ``finalize_group`` (what the
orchestrator's train sink awaits per finished cohort) on seeded episodes, and
``tests/golden_prime_rl/prime_rl_cases.json`` holds the episodes and the advantage prime-rl wrote on each trace's
sampled tokens. The cases cover the four ``[orchestrator.algo] type`` values that assign advantages without state:
``grpo`` (with and without the linear length penalty: prime-rl's default weights, single terms, zero weights, counts
of 0), ``echo`` (grpo's numbers, checked bit for bit by the generator), ``max_rl`` (groups of one, tied groups, mean
0, negative means, small means) and ``hierarchical_grpo`` (peer sets per episode for ``episode_agents``, per cohort
for the other agents); ragged cohorts (1 to 16 traces), multi-agent episodes and traces prime-rl does not score (an
error, an untrainable agent, no sampled token).

How a case is sent (what ``advantage_client.prime_rl`` sends): one request per case, one row per trace prime-rl
scores, ``prompt_ids`` = the cohort (hierarchical_grpo: the peer set), the row's tokens packed (``cu_seqlens``) with
the sampled-token mask. prime-rl casts grpo's and max_rl's rewards and counts to float32: they are sent as float32;
hierarchical_grpo keeps Python floats: float64.

Rule: ``|service - prime-rl| <= 1e-5 * |prime-rl| + 2e-6 * max(1, max |prime-rl| of the case)`` at every token
(prime-rl computes in float32, the service in float64; the worst case measured is printed by
``test_the_worst_error_is_far_below_the_tolerance``), tight enough that the server's answers scaled by 1.0001 fail
every case (tests/test_prime_rl_dropin.py).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from advantage_client.references import REFERENCES

HERE = pathlib.Path(__file__).resolve().parent / "golden_prime_rl"
GOLDEN = json.loads((HERE / "prime_rl_cases.json").read_text())
CASES = GOLDEN["cases"]
RTOL, ATOL = 1e-5, 2e-6
#: prime-rl's [orchestrator.algo] type -> the service's estimator
ESTIMATOR = {"grpo": "grpo", "echo": "grpo", "hierarchical_grpo": "grpo", "max_rl": "maxrl"}
COUNTS = ("num_output_tokens", "num_total_tokens", "num_turns")


def scored(trace: dict) -> bool:
    """prime-rl's iter_trainable_traces: no error, a trainable agent, at least one sampled token."""
    return not trace["has_error"] and trace["trainable"] and any(any(m) for m in trace["node_masks"])


def rows_of(case: dict, include_unsampled: bool = False) -> list[tuple[int, dict]]:
    """(group id, trace) per row sent. hierarchical_grpo: one group per peer set, (agent, episode) for the agents
    in episode_agents and (agent, cohort) for the others."""
    episode_agents = set(case["config"].get("episode_agents", ()))
    keys: dict = {}
    out = []
    for c, cohort in enumerate(case["cohorts"]):
        for episode in cohort:
            for t in episode["traces"]:
                unsampled = not t["has_error"] and t["trainable"] and not any(any(m) for m in t["node_masks"])
                if not (scored(t) or include_unsampled and unsampled):
                    continue
                if case["algo"] == "hierarchical_grpo":
                    key = (c, t["agent"], episode["id"] if t["agent"] in episode_agents else None)
                else:
                    key = c
                out.append((keys.setdefault(key, len(keys)), t))
    return out


def service_call(case: dict, include_unsampled: bool = False) -> tuple[str, dict, dict, list[dict]]:
    """(estimator, config, inputs with cu_seqlens, the traces sent) of ``case``."""
    name = ESTIMATOR[case["algo"]]
    config: dict = {"semantics": "prime_rl"}
    lp = case["config"].get("length_penalty")
    if lp is not None:
        config.update(length_penalty=True, **lp)
    if include_unsampled:
        config["exclude_empty_responses"] = True
    rows = rows_of(case, include_unsampled)
    dtype = np.float64 if case["algo"] == "hierarchical_grpo" else np.float32
    masks = [np.concatenate([np.asarray(m, np.float32) for m in t["node_masks"]]) for _, t in rows]
    inputs = {"prompt_ids": np.array([g for g, _ in rows], np.int64),
              "rewards": np.array([t["reward"] for _, t in rows], dtype),
              "mask": np.concatenate(masks), "cu_seqlens": np.concatenate([[0], np.cumsum([len(m) for m in masks])])}
    if lp is not None:
        for key in COUNTS:
            inputs[key] = np.array([t[key] for _, t in rows], np.float32)
    return name, config, inputs, [t for _, t in rows]


def out_dtype(case: dict) -> str:
    """The output dtype prime-rl's numbers have: float32 tensors (grpo, echo, max_rl), Python floats
    (hierarchical_grpo)."""
    return "float64" if case["algo"] == "hierarchical_grpo" else "float32"


def expected_tokens(inputs: dict, traces: list[dict]) -> np.ndarray:
    """prime-rl's advantage on every sampled token, 0 elsewhere (prime-rl assigns none there)."""
    per_row = np.array([t["expected_advantage"] or 0.0 for t in traces], np.float64)
    lengths = np.diff(inputs["cu_seqlens"])
    return np.repeat(per_row, lengths) * inputs["mask"]


def tolerance(want: np.ndarray) -> np.ndarray:
    return RTOL * np.abs(want) + ATOL * max(1.0, float(np.abs(want).max(initial=0.0)))


def assert_close(got, want, what: str) -> float:
    """Asserts the rule; returns max |got - want| / tolerance."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), what
    tol = tolerance(want)
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} positions differ from prime-rl, e.g. "
                           f"{got[bad][0]!r} vs {want[bad][0]!r} at {int(np.flatnonzero(bad)[0])}")
    return float((np.abs(got - want) / tol).max(initial=0.0))


def test_cases_record_the_pinned_commit_and_cover_prime_rls_algorithms():
    src = GOLDEN["source"]
    ref = REFERENCES["prime_rl"]
    assert ref.release == f"main@{src['commit']}" and ref.package is None
    assert ref.code in src["paths"]
    assert "PrimeIntellect-ai/prime-rl" in src["repo"]
    assert src["generator"] == "tests/golden_prime_rl/generate.py" and (HERE / "generate.py").is_file()
    assert src["length_penalty_defaults"] == {"num_output_tokens_weight": 0.25, "num_input_tokens_weight": 0.1,
                                              "num_turns_weight": 0.1}
    assert {c["algo"] for c in CASES} == set(ESTIMATOR)  # every stateless algorithm that assigns advantages
    lps = [c["config"].get("length_penalty") for c in CASES if c["algo"] in ("grpo", "echo")]
    assert None in lps and src["length_penalty_defaults"] in lps
    assert any(lp and lp["num_output_tokens_weight"] == 0 and lp["num_turns_weight"] > 0 for lp in lps)
    sizes = {len(rows) for c in CASES for rows in [rows_of(c)]}
    cohort_sizes = {sum(scored(t) for e in cohort for t in e["traces"]) for c in CASES for cohort in c["cohorts"]}
    assert 1 in cohort_sizes and max(cohort_sizes) >= 16 and len(sizes) > 10  # ragged
    assert any(not scored(t) for c in CASES for cohort in c["cohorts"] for e in cohort for t in e["traces"])
    maxrl_means = [np.mean([t["reward"] for e in cohort for t in e["traces"] if scored(t)])
                   for c in CASES if c["algo"] == "max_rl" for cohort in c["cohorts"]]
    assert min(maxrl_means) < 0 and 0.0 in maxrl_means and 0 < min(m for m in maxrl_means if m > 0) < 1e-3


@pytest.mark.parametrize("transport", ["auto", "unary", "stream", "shm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_golden_case_over_grpc(client, case, transport):
    """Every trace prime-rl scores, its tokens packed; the advantage on the sampled tokens, 0 elsewhere."""
    name, config, inputs, traces = service_call(case)
    cu = inputs.pop("cu_seqlens")
    got = client.compute(name, config, output_dtype=out_dtype(case), as_numpy=True, transport=transport, cu_seqlens=cu, **inputs)
    assert got.returns is None
    assert got.advantages.dtype == inputs["rewards"].dtype
    assert_close(got.advantages, expected_tokens({**inputs, "cu_seqlens": cu}, traces), f"{case['name']}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_golden_case_per_sample(client, case):
    """What the drop-in asks for: one value per trace (prime-rl's scalar, broadcast to the sampled tokens)."""
    name, config, inputs, traces = service_call(case)
    inputs.pop("cu_seqlens")
    inputs["mask"] = np.ones((len(traces), 1), np.float32)
    got = client.compute(name, config, output_dtype=out_dtype(case), as_numpy=True, per_sample=True, **inputs)
    assert got.layout == "broadcast_times_mask"
    assert_close(got.advantages, [t["expected_advantage"] for t in traces], case["name"])


@pytest.mark.parametrize("case", [c for c in CASES if any(
    not t["has_error"] and t["trainable"] and not any(any(m) for m in t["node_masks"])
    for cohort in c["cohorts"] for e in cohort for t in e["traces"])], ids=lambda c: c["name"])
def test_traces_without_a_sampled_token_sent_as_empty_rows(client, case):
    """A caller that sends prime-rl's unsampled traces as all-zero mask rows gets prime-rl's numbers with
    exclude_empty_responses (prime-rl's iter_trainable_traces leaves them out of the cohort), and 0 for them."""
    name, config, inputs, traces = service_call(case, include_unsampled=True)
    cu = inputs.pop("cu_seqlens")
    got = client.compute(name, config, output_dtype=out_dtype(case), as_numpy=True, cu_seqlens=cu, **inputs)
    assert_close(got.advantages, expected_tokens({**inputs, "cu_seqlens": cu}, traces), case["name"])


def test_the_worst_error_is_far_below_the_tolerance(client):
    worst = 0.0
    for case in CASES:
        name, config, inputs, traces = service_call(case)
        inputs.pop("cu_seqlens")
        inputs["mask"] = np.ones((len(traces), 1), np.float32)
        got = client.compute(name, config, output_dtype=out_dtype(case), as_numpy=True, per_sample=True, **inputs)
        worst = max(worst, assert_close(got.advantages, [t["expected_advantage"] for t in traces], case["name"]))
    print(f"worst |service - prime-rl| / tolerance over {len(CASES)} cases: {worst:.3g}")
    assert worst < 0.2


def test_skyrls_maxrl_is_not_prime_rls(client):
    """prime-rl's max_rl is a new semantics, not SkyRL's maxrl: no epsilon, 0 for a group of one, 0 for a group
    whose mean is <= 0. Under semantics = skyrl the golden cases with such groups fail."""
    differ = []
    for case in [c for c in CASES if c["algo"] == "max_rl"]:
        _, _, inputs, traces = service_call(case)
        inputs.pop("cu_seqlens")
        inputs["mask"] = np.ones((len(traces), 1), np.float32)
        want = np.array([t["expected_advantage"] for t in traces])
        got = client.compute("maxrl", {"semantics": "skyrl"}, output_dtype="float32", as_numpy=True, per_sample=True, **inputs).advantages
        if np.any(np.abs(got - want) > tolerance(want)):
            differ.append(case["name"])
    assert {"maxrl-small-mean", "maxrl-zero-and-negative-means", "maxrl-ties-and-single"} <= set(differ), differ


def test_a_length_penalty_by_hand(client):
    """Two traces, rewards 1 and 0 (mean 0.5), output tokens 100 and 50, total 300 and 250 (input 200 and 200),
    turns 2 and 1, prime-rl's default weights: f = 0.25 * (1, 0.5) + 0.1 * (1, 1) + 0.1 * (1, 0.5)
    = (0.45, 0.275); shaped = (1 - 0.225, 0 - 0.1375); advantages = shaped - their mean = +-0.45625."""
    got = client.compute("grpo", {"semantics": "prime_rl", "length_penalty": True}, output_dtype="float64", as_numpy=True,
                         per_sample=True,
                         prompt_ids=np.zeros(2, np.int64), rewards=np.array([1.0, 0.0]), mask=np.ones((2, 1)),
                         num_output_tokens=np.array([100, 50]), num_total_tokens=np.array([300, 250]),
                         num_turns=np.array([2, 1]))
    np.testing.assert_allclose(got.advantages, [0.45625, -0.45625], rtol=1e-12)


def test_a_missing_count_names_the_field(client):
    from advantage_client.errors import AdvantageServiceError

    with pytest.raises(AdvantageServiceError, match=r"num_turns.*length_penalty = true"):
        client.compute("grpo", {"semantics": "prime_rl", "length_penalty": True}, prompt_ids=np.zeros(2, np.int64),
                       rewards=np.array([1.0, 0.0]), mask=np.ones((2, 1)), num_output_tokens=np.array([1, 2]),
                       num_total_tokens=np.array([3, 4]))
    with pytest.raises(AdvantageServiceError, match=r"config\.num_turns_weight.*does not apply with semantics = verl"):
        client.compute("grpo", {"semantics": "verl", "num_turns_weight": 0.1}, prompt_ids=np.zeros(2, np.int64),
                       rewards=np.array([1.0, 0.0]), mask=np.ones((2, 1)))
    with pytest.raises(AdvantageServiceError, match=r"config\.epsilon.*does not apply with semantics = prime_rl"):
        client.compute("maxrl", {"semantics": "prime_rl", "epsilon": 1e-6}, prompt_ids=np.zeros(2, np.int64),
                       rewards=np.array([1.0, 0.0]), mask=np.ones((2, 1)))


def test_list_estimators_reports_prime_rl(client):
    listing = client.list_estimators()
    refs = {r.semantics: r for r in listing.references}
    assert refs["prime_rl"].release == "main@559b44772e471d1538537b8805cc77f3824a5e64"
    for est in listing.estimators:
        if est.name in ("grpo", "maxrl"):
            semantics = next(f for f in est.config_fields if f.name == "semantics")
            assert "prime_rl" in semantics.allowed_values, est.name
