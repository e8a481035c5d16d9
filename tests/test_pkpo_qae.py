"""PKPO (arXiv:2505.15201) and QAE (arXiv:2509.22611): the vectorised kernels against their loop twins and
against definitions computed independently here (PKPO: the k-subset enumeration and the paper's binary
closed form; QAE: ``torch.quantile`` per group), the edge cases (groups of one, ties, k = 1, k >= n, K near
0 and 1), and the config errors over gRPC. Golden cases from the references: tests/test_golden_pkpo_qae.py.
"""
from __future__ import annotations

import itertools
import math

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from advantage_client import AdvantageServiceError, wire
from advantage_server.estimators import jit
from advantage_server.estimators.pkpo import pkpo_loop, pkpo_scalars
from advantage_server.estimators.qae import group_quantile, qae_loop, qae_scalars


# ------------------------------------------------------------------------------ batches
@st.composite
def grouped(draw, integer_rewards: bool | None = None):
    """(group [B] int64 0..G-1 shuffled, rewards [B] float64): ragged groups (sizes 1..9), ties likely."""
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    group = np.repeat(np.arange(len(sizes)), sizes)
    perm = draw(st.permutations(list(range(len(group)))))
    group = group[np.asarray(perm, dtype=np.int64)]
    ints = draw(st.booleans()) if integer_rewards is None else integer_rewards
    if ints:
        values = st.integers(-2, 2).map(float)
    else:
        values = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)
    rewards = np.array(draw(st.lists(values, min_size=len(group), max_size=len(group))), dtype=np.float64)
    return torch.from_numpy(group.astype(np.int64)), torch.from_numpy(rewards)


def groups_of(group: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        out.setdefault(g, []).append(i)
    return out


# ------------------------------------------------------------------------------ PKPO
@settings(max_examples=200, deadline=None)
@given(grouped(), st.integers(1, 12))
def test_pkpo_kernel_equals_loop(batch, k):
    group, rewards = batch
    got = pkpo_scalars(group, rewards, k)
    want = pkpo_loop(group, rewards, k)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-10 * (1 + rewards.abs().max().item()))


def subset_credit(values: list[float], k: int) -> list[float]:
    """The paper's definition, by enumeration: credit_i = mean over all k-subsets containing i of the subset's
    max, times the chance C(n-1, k-1) / C(n, k) = k / n that a subset contains i (i.e. the sum over those
    subsets divided by C(n, k)); equal rewards then share their credit (rLLM PR #743's tie rule)."""
    n = len(values)
    credit = [0.0] * n
    for subset in itertools.combinations(range(n), k):
        best = max(values[j] for j in subset)
        for j in subset:
            credit[j] += best
    credit = [c / math.comb(n, k) for c in credit]
    return [sum(credit[j] for j in range(n) if values[j] == values[i]) / values.count(values[i]) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(grouped(), st.integers(1, 10))
def test_pkpo_is_the_subset_max_credit_minus_its_group_mean(batch, k):
    group, rewards = batch
    got = pkpo_scalars(group, rewards, k).numpy()
    for members in groups_of(group).values():
        n = len(members)
        if n == 1:
            assert got[members[0]] == 0.0
            continue
        credit = subset_credit([rewards[i].item() for i in members], min(k, n))
        want = np.array(credit) - np.mean(credit)
        np.testing.assert_allclose(got[members], want, rtol=1e-9, atol=1e-9 * (1 + float(rewards.abs().max())))


@pytest.mark.parametrize("n,c,k", [(8, 3, 2), (8, 3, 4), (8, 1, 5), (16, 4, 8), (6, 0, 3), (6, 6, 3), (10, 9, 9)])
def test_pkpo_binary_rewards_follow_theorem_2(n, c, k):
    """0/1 rewards: a correct sample's credit is k/n, an incorrect one's (k/n) rho(n-1, c, k-1), with
    rho(n, c, k) = 1 - C(n-c, k) / C(n, k) (the paper's unbiased pass@k estimate); A = credit - mean credit."""
    def rho(nn, cc, kk):
        return 1.0 - math.comb(nn - cc, kk) / math.comb(nn, kk)
    rewards = torch.tensor([1.0] * c + [0.0] * (n - c), dtype=torch.float64)
    wrong = k / n * rho(n - 1, c, k - 1) if c < n else None
    credit = np.array([k / n] * c + [wrong] * (n - c), dtype=np.float64)
    got = pkpo_scalars(torch.zeros(n, dtype=torch.int64), rewards, k).numpy()
    np.testing.assert_allclose(got, credit - credit.mean(), rtol=1e-12, atol=1e-15)
    if 0 < c < n and n - 1 - c >= k - 1:  # an incorrect sample's k-subsets can all miss the correct ones
        assert got[0] > 0 > got[-1]
    else:
        np.testing.assert_allclose(got, 0.0, atol=1e-14)


def test_pkpo_k1_is_the_mean_centred_reward_over_n_and_k_at_least_n_gives_zero():
    rewards = torch.tensor([0.3, -1.0, 2.5, 0.3, 7.0, 1.5], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    got = pkpo_scalars(group, rewards, 1).numpy()
    a, b = rewards[:4].numpy(), rewards[4:].numpy()
    np.testing.assert_allclose(got, np.r_[(a - a.mean()) / 4, (b - b.mean()) / 2], rtol=1e-14, atol=1e-15)
    # k = 2 is k >= n for the group of two (clamped: 0 there), not for the group of four
    got2 = pkpo_scalars(group, rewards, 2).numpy()
    assert (got2[4:] == 0).all() and (got2[:4] != 0).all()
    for k in (4, 5, 1000):
        assert (pkpo_scalars(group, rewards, k) == 0).all()


def test_pkpo_groups_of_one_ties_and_order():
    group = torch.tensor([2, 0, 2, 1, 2, 2])  # groups: {0} alone, {1} alone, {2} of four
    rewards = torch.tensor([1.0, 5.0, 1.0, -3.0, 0.0, -1.0], dtype=torch.float64)
    got = pkpo_scalars(group, rewards, 2).numpy()
    assert got[1] == 0 and got[3] == 0  # groups of one
    # group (1, 1, 0, -1), k = 2, by enumeration over the 6 pairs: each 1 is in 3 pairs, all with max 1:
    # credit 3/6; 0 and -1 are each in 3 pairs with maxes 1, 1, 0: credit 2/6; mean credit 5/12
    np.testing.assert_allclose(got[[0, 2, 4, 5]], np.array([6, 6, 4, 4]) / 12 - 5 / 12, rtol=1e-14)
    # rewards (1, 1, 1, 0): every sample's pairs all have max 1, so no signal at k = 2 (but at k = 1)
    flat = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    assert (pkpo_scalars(torch.zeros(4, dtype=torch.int64), flat, 2) == 0).all()
    assert (pkpo_scalars(torch.zeros(4, dtype=torch.int64), flat, 1) != 0).all()
    # the result does not depend on the order of the rows
    perm = torch.tensor([5, 3, 0, 4, 1, 2])
    np.testing.assert_array_equal(pkpo_scalars(group[perm], rewards[perm], 2).numpy(), got[perm.numpy()])


@pytest.mark.parametrize("n,k", [(256, 16), (512, 200), (1024, 3)])
def test_pkpo_large_groups_stay_accurate(n, k):
    """The log-gamma binomial ratios against exact integer binomials (math.comb) on large groups."""
    rng = np.random.default_rng(n + k)
    rewards = torch.from_numpy(rng.standard_normal(2 * n))
    group = torch.from_numpy(np.repeat([0, 1], n))
    got, want = pkpo_scalars(group, rewards, k).numpy(), pkpo_loop(group, rewards, k).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert np.abs(want).max() > 1e-6


def _per_group_error(got: np.ndarray, want: np.ndarray, n: int) -> float:
    """Largest |got - want| of a group over that group's largest |want| (groups of n back to back)."""
    return float((np.abs(got - want).reshape(-1, n).max(1) / np.abs(want).reshape(-1, n).max(1)).max())


NUMBA = [True, False] if jit._numba is not None else [False]


@pytest.mark.parametrize("numba", NUMBA)  # the group means' numba (CPU) and torch (GPU) paths
def test_pkpo_k_at_least_n_is_exactly_zero_on_a_realistic_batch(numba):
    """4096 groups of 8 float64 rewards: with k >= n every credit is the group's max, so every advantage is
    exactly 0 (the sums used to run over the whole sorted batch: up to 2e-13 left there)."""
    rng = np.random.default_rng(0)
    group = torch.from_numpy(np.repeat(np.arange(4096), 8))
    rewards = torch.from_numpy(rng.uniform(0, 1, 4096 * 8))
    for k in (8, 9, 100):
        with jit.use_numba(numba):
            got = pkpo_scalars(group, rewards, k)
        assert (got == 0).all(), (k, float(got.abs().max()))


@pytest.mark.parametrize("numba", NUMBA)
def test_pkpo_float64_precision_does_not_depend_on_the_other_groups(numba):
    """A group's suffix sums stay within the group: 4096 groups of 8 float64 rewards at k = 4 agree with
    the loop twin (exact integer binomials, one group at a time) to 1e-13 of each group's scale (one
    cumulative sum over the sorted batch gave 3e-11); a group of 0..0.7 placed after 2000 groups of
    rewards up to 1e9 gets what it gets alone (8e-4 relative error before)."""
    rng = np.random.default_rng(0)
    group = torch.from_numpy(np.repeat(np.arange(4096), 8))
    rewards = torch.from_numpy(rng.uniform(0, 1, 4096 * 8))
    with jit.use_numba(numba):
        got = pkpo_scalars(group, rewards, 4).numpy()
    assert _per_group_error(got, pkpo_loop(group, rewards, 4).numpy(), 8) < 1e-13
    big = rng.uniform(0, 1e9, 2000 * 8)
    small = np.arange(8) / 10
    group = torch.from_numpy(np.repeat(np.arange(2001), 8))
    rewards = torch.from_numpy(np.concatenate([big, small]))
    with jit.use_numba(numba):
        got = pkpo_scalars(group, rewards, 3).numpy()[-8:]
        alone = pkpo_scalars(torch.zeros(8, dtype=torch.int64), torch.from_numpy(small), 3).numpy()
    np.testing.assert_array_equal(got, alone)
    # rLLM's values for this group (k = 3, rewards 0, 0.1, ..., 0.7): credit (C(p, 2) x_p + sum_{q > p}
    # (q - 1) x_q) / C(8, 3), by exact fractions; the service's within 1e-15 of its scale
    from fractions import Fraction
    x = [Fraction(i, 10) for i in range(8)]
    credit = [(math.comb(p, 2) * x[p] + sum((q - 1) * x[q] for q in range(p + 1, 8))) / math.comb(8, 3)
              for p in range(8)]
    exact = np.array([float(c - sum(credit) / 8) for c in credit])
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-15 * np.abs(exact).max())


def test_pkpo_float32_group_after_large_groups_over_grpc(client):
    """The same batch in float32 over gRPC: the small group's advantages are its float64 answer rounded to
    float32 (8e-4 relative error before)."""
    rng = np.random.default_rng(1)
    rewards = np.concatenate([rng.uniform(0, 1e9, 2000 * 8), np.arange(8) / 10]).astype(np.float32)
    prompt_ids = np.repeat(np.arange(2001), 8)
    got = client.compute("pkpo", {"k": 3}, as_numpy=True, prompt_ids=prompt_ids, rewards=rewards,
                         mask=np.ones((len(rewards), 1), np.float32)).advantages[-8:, 0]
    want = pkpo_loop(torch.zeros(8, dtype=torch.int64), torch.from_numpy(rewards[-8:].astype(np.float64)), 3)
    np.testing.assert_allclose(got, want.numpy().astype(np.float32), rtol=0, atol=1e-7 * np.abs(want.numpy()).max())


# ------------------------------------------------------------------------------ QAE
@settings(max_examples=200, deadline=None)
@given(grouped(), st.floats(0.01, 0.99), st.booleans(), st.sampled_from([1e-6, 1e-2, 0.0]))
def test_qae_kernel_equals_loop(batch, K, normalize, eps):
    group, rewards = batch
    got = qae_scalars(group, rewards, K, normalize, eps)
    want = qae_loop(group, rewards, K, normalize, eps)
    assert torch.isfinite(got).all()  # eps = 0: a tied group (std 0) has r == q, so 0, not 0 / 0
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-9)


@settings(max_examples=150, deadline=None)
@given(grouped(), st.floats(0.0, 1.0))
def test_group_quantile_is_torch_quantile(batch, K):
    group, rewards = batch
    got = group_quantile(group, rewards, K).numpy()
    for members in groups_of(group).values():
        want = torch.quantile(rewards[members], K).item()  # linear interpolation (torch's default)
        np.testing.assert_allclose(got[members], want, rtol=1e-12, atol=1e-12)


def test_qae_two_regime_gate_and_group_of_one():
    """K = 0.4 on 0/1 rewards, n = 8: a hard query (1 success) rewards only the success, an easy one (1
    failure) penalises only the failure; a group of one gets verl's r / (1 + eps) (baseline 0, std 1)."""
    hard = [0.0] * 7 + [1.0]
    easy = [1.0] * 7 + [0.0]
    rewards = torch.tensor(hard + easy + [0.7], dtype=torch.float64)
    group = torch.tensor([0] * 8 + [1] * 8 + [2])
    got = qae_scalars(group, rewards, 0.4, True, 1e-6).numpy()
    std = np.std(hard, ddof=1)
    np.testing.assert_allclose(got[:8], [0] * 7 + [1 / (std + 1e-6)], rtol=1e-12)
    np.testing.assert_allclose(got[8:16], [0] * 7 + [-1 / (std + 1e-6)], rtol=1e-12)
    assert got[16] == pytest.approx(0.7 / float(torch.tensor(1.0) + 1e-6), rel=1e-15)
    # without std normalisation: r - q, and the group of one keeps r
    raw = qae_scalars(group, rewards, 0.4, False, 1e-6).numpy()
    np.testing.assert_allclose(raw, [0] * 7 + [1] + [0] * 7 + [-1] + [0.7])


def test_qae_interpolates_between_order_statistics():
    rewards = torch.tensor([4.0, 1.0, 3.0, 2.0, 10.0], dtype=torch.float64)  # sorted 1 2 3 4 10
    group = torch.zeros(5, dtype=torch.int64)
    # h = 0.4 * 4 = 1.6: 2 + 0.6 * (3 - 2) = 2.6; h = 0.9 * 4 = 3.6: 4 + 0.6 * 6 = 7.6
    np.testing.assert_allclose(group_quantile(group, rewards, 0.4).numpy(), 2.6)
    np.testing.assert_allclose(group_quantile(group, rewards, 0.9).numpy(), 7.6)
    np.testing.assert_allclose(qae_scalars(group, rewards, 0.4, False, 1e-6).numpy(), rewards.numpy() - 2.6)


# ------------------------------------------------------------------------------ over gRPC
def _batch(B=6, T=4, seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    return {"prompt_ids": np.array([0, 1, 0, 1, 0, 2], np.int64)[:B],
            "rewards": rng.integers(0, 2, B).astype(np.float64), "mask": mask}  # float64: computed in float64


@pytest.mark.parametrize("estimator,config,field", [
    ("pkpo", {"k": 0}, "config.k"),
    ("pkpo", {"k": -3}, "config.k"),
    ("qae", {"quantile_k": 0.0}, "config.quantile_k"),
    ("qae", {"quantile_k": 1.0}, "config.quantile_k"),
    ("qae", {"quantile_k": 1.5}, "config.quantile_k"),
    ("qae", {"quantile_k": -0.2}, "config.quantile_k"),
    ("qae", {"epsilon": -1.0}, "config.epsilon"),
])
def test_bad_config_is_invalid_argument_naming_the_field(client, estimator, config, field):
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute(estimator, config, **_batch())
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert any(f == field for f, _ in exc.value.field_violations), exc.value.field_violations


@pytest.mark.parametrize("k", [-0.1, 0.0, 1.0, 1.5])
def test_quantile_k_messages_state_the_open_interval(client, k):
    """Every refused quantile_k gets the same statement of the range: the open interval (0, 1) (-0.1 used
    to be told "[0.0, 1.0]", and then 0.0 and 1.0 were refused as "strictly between 0 and 1")."""
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("qae", {"quantile_k": k}, **_batch())
    text = dict(exc.value.field_violations)["config.quantile_k"]
    assert text.startswith(f"must be in the open interval (0.0, 1.0) (the bounds excluded), got {k}"), text
    assert "grpo" in text  # the way to the mean baseline


def test_registry_range_metadata_open_interval():
    """``"open": True`` excludes the ``range`` bounds; without it they are included."""
    from dataclasses import dataclass, field

    from advantage_server.errors import InvalidInput
    from advantage_server.estimators.registry import EstimatorConfig

    @dataclass(frozen=True)
    class Cfg(EstimatorConfig):
        closed: float = field(default=0.5, metadata={"range": (0.0, 1.0)})
        opened: float = field(default=0.5, metadata={"range": (0.0, 1.0), "open": True})
        lower: float = field(default=1.0, metadata={"range": (0.0, None), "open": True})

    for ok in (Cfg(), Cfg(closed=0.0), Cfg(closed=1.0), Cfg(opened=1e-9), Cfg(lower=1e300)):
        ok.validate()
    for bad, name, text in [(Cfg(closed=1.5), "closed", "must be in [0.0, 1.0], got 1.5"),
                            (Cfg(opened=0.0), "opened", "must be in the open interval (0.0, 1.0)"),
                            (Cfg(opened=1.0), "opened", "must be in the open interval (0.0, 1.0)"),
                            (Cfg(lower=0.0), "lower", "must be in the open interval (0.0, None)")]:
        with pytest.raises(InvalidInput) as exc:
            bad.validate()
        assert exc.value.violations[0][0] == f"config.{name}" and text in exc.value.violations[0][1]


def test_non_integer_k_is_refused_by_the_client():
    with pytest.raises(wire.WireError, match="config.k"):
        wire.config_message("pkpo", {"k": 2.5})
    assert wire.config_message("pkpo", {"k": 3.0}).k == 3  # an integral float is accepted
    assert wire.config_message("pkpo", {"k": np.int64(4)}).k == 4


def test_missing_rewards_names_the_field(client):
    tensors = _batch()
    del tensors["rewards"]
    for name in ("pkpo", "qae"):
        with pytest.raises(AdvantageServiceError) as exc:
            client.compute(name, None, **tensors)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "rewards" in str(exc.value)


@pytest.mark.parametrize("estimator,config", [("pkpo", {"k": 2}), ("pkpo", {}), ("qae", {}),
                                              ("qae", {"quantile_k": 0.8, "normalize_rewards": False})])
def test_over_grpc_equals_the_kernel_times_mask(client, estimator, config):
    t = _batch(B=6, T=5, seed=3)
    got = client.compute(estimator, config, output_dtype="float64", as_numpy=True, **t).advantages
    group = torch.from_numpy(t["prompt_ids"])
    r = torch.from_numpy(t["rewards"]).to(torch.float64)
    if estimator == "pkpo":
        per = pkpo_loop(group, r, config.get("k", 1))
    else:
        per = qae_loop(group, r, config.get("quantile_k", 0.4), config.get("normalize_rewards", True), 1e-6)
    np.testing.assert_allclose(got, per.numpy()[:, None] * t["mask"], rtol=1e-12, atol=1e-12)
    small = client.compute(estimator, config, output_dtype="float64", as_numpy=True, per_sample=True, **t)
    assert small.advantages.shape == (6,)
    np.testing.assert_allclose(small.advantages, per.numpy(), rtol=1e-12, atol=1e-12)


def test_listing_documents_the_fields(client):
    infos = {e.name: e for e in client.list_estimators().estimators}
    pk = {f.name: f for f in infos["pkpo"].config_fields}
    assert pk["k"].type == "int32" and pk["k"].default_value == "1"
    qa = {f.name: f for f in infos["qae"].config_fields}
    assert qa["quantile_k"].type == "double" and float(qa["quantile_k"].default_value) == 0.4
    assert "2505.15201" in infos["pkpo"].reference and "2509.22611" in infos["qae"].reference


def test_a_one_sided_range_reads_as_a_bound(client):
    """k = 0: "must be >= 1", not "must be in [1, None]"."""
    with pytest.raises(AdvantageServiceError) as err:
        client.compute("pkpo", {"k": 0}, prompt_ids=np.array([0, 0]), rewards=np.array([1.0, 0.0]),
                       mask=np.ones((2, 2)))
    assert "config.k: must be >= 1, got 0" in str(err.value) and "None" not in str(err.value)
