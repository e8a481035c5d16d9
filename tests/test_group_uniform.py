"""The uniform-group-size CPU kernels (every prompt with the same number of samples, as trainers send
them) against the generic ones they replace (bit for bit) and the loop twins, and the compiled
reductions that replaced numpy temporaries in OPD and Reinforce++ (issue #3, the fixed cost per call)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from advantage_server.estimators import groups, jit, opd, whitening
from advantage_server.estimators.rewards import outcome_scores

pytestmark = pytest.mark.skipif(not jit.NUMBA, reason="numba kernels disabled or absent")

KINDS = ("normal", "binary", "tied", "dominant", "mixed")


def rewards(kind: str, G: int, n: int, rng: np.random.Generator) -> np.ndarray:
    B = G * n
    if kind == "normal":
        return rng.standard_normal(B)
    if kind == "binary":
        return (rng.random(B) < 0.5).astype(np.float64)
    if kind == "tied":
        return np.repeat(rng.standard_normal(G), n)
    if kind == "dominant":  # one member far from the rest: the leave-one-out removal would cancel
        r = rng.standard_normal(B) * 1e-3
        r[::n] = 1e6
        return r
    r = np.round(rng.standard_normal(B), 1)  # ties inside groups, some groups tied but for one member
    r[::7] = 3.0
    return r


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 33, 64])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_uniform_kernel_equals_generic_bit_for_bit(n, kind, leave_one_out):
    rng = np.random.default_rng(n)
    G = 300  # more than one block of groups, and a partial one
    r = rewards(kind, G, n, rng)
    start = np.arange(G + 1, dtype=np.int64) * n
    assert groups._uniform_size(start) == n
    b1, s1, b2, s2 = (np.full(G * n, np.nan) for _ in range(4))
    groups._group_stats_chunk(0, G, start, r, leave_one_out, b1, s1)
    groups._group_stats_uniform(0, 5, n, r, leave_one_out, b2, s2)  # chunk bounds as parallel_rows cuts them
    groups._group_stats_uniform(5, G, n, r, leave_one_out, b2, s2)
    np.testing.assert_array_equal(b1, b2)
    np.testing.assert_array_equal(s1, s2)


def test_uniform_size_detects_ragged_layouts():
    assert groups._uniform_size(np.array([0, 4, 8, 12])) == 4
    assert groups._uniform_size(np.array([0, 4, 8, 13])) == 0
    assert groups._uniform_size(np.array([0, 3, 8, 12])) == 0


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("shuffled", [False, True])
def test_group_baseline_and_std_uniform_matches_loop(leave_one_out, shuffled):
    rng = np.random.default_rng(7)
    G, n = 50, 8
    group = torch.arange(G * n) // n
    if shuffled:  # still uniform after the counting sort
        group = group[torch.from_numpy(rng.permutation(G * n))]
    r = torch.from_numpy(rewards("mixed", G, n, rng)).float()
    got_b, got_s = groups.group_baseline_and_std(group, r, leave_one_out)
    want_b, want_s = groups.group_baseline_and_std_loop(group, r, leave_one_out)
    torch.testing.assert_close(got_b, want_b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_s, want_s, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_weighted_group_relative_uniform_equals_generic(monkeypatch, leave_one_out, normalize):
    rng = np.random.default_rng(3)
    G, n = 400, 8
    group = torch.arange(G * n) // n
    comps = [torch.from_numpy(rewards(k, G, n, rng)).float() for k in ("binary", "normal", "dominant")]
    weights = (1.0, 0.5, 2.0)
    fast = groups.weighted_group_relative(group, comps, weights, leave_one_out, normalize)
    monkeypatch.setattr(groups, "_UNIFORM_MAX", 0)  # the generic kernel
    slow = groups.weighted_group_relative(group, comps, weights, leave_one_out, normalize)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0)
    want = sum(w * groups.group_relative(group, c, leave_one_out, normalize) for w, c in zip(weights, comps))
    torch.testing.assert_close(fast, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weighted_group_relative_compiles_once_for_every_component_count(monkeypatch, dtype):
    """Issue 11 item 3: the components used to reach the kernel as a tuple, one numba type (and one
    compilation of ~1 s CPU, kept for good) per component count. Now one [C, B] array: the number of
    compiled variants stays put from K = 2 to 12, and the totals equal the generic kernel and the loop."""
    rng = np.random.default_rng(11)
    G, n = 40, 4
    group = torch.arange(G * n) // n
    comps = [torch.from_numpy(rewards(KINDS[k % len(KINDS)], G, n, rng)).to(dtype) for k in range(12)]
    kernels = (groups._weighted_relative_rows_uniform, groups._weighted_relative_uniform,
               groups._weighted_relative_chunk)
    counts = None
    for K in range(2, 13):
        weights = tuple(0.5 + 0.25 * k for k in range(K))
        fast = groups.weighted_group_relative(group, comps[:K], weights, True, True)
        now = [len(k.signatures) for k in kernels]
        counts = counts or now
        assert now == counts, f"K = {K}: a new compiled variant ({counts} -> {now})"
        want = sum(w * groups.group_relative(group, c, True, True) for w, c in zip(weights, comps[:K]))
        torch.testing.assert_close(fast, want, rtol=1e-12, atol=1e-12)
        with monkeypatch.context() as m:
            m.setattr(groups, "_UNIFORM_MAX", 0)  # the generic kernel, bit for bit
            torch.testing.assert_close(fast, groups.weighted_group_relative(group, comps[:K], weights, True, True),
                                       rtol=0, atol=0)


def test_opd_combine_rows_matches_two_pass():
    rng = np.random.default_rng(5)
    B, T = 300, 17
    teacher, prev = rng.standard_normal((B, T)).astype(np.float32), rng.standard_normal((B, T)).astype(np.float32)
    mask = (rng.random((B, T)) < 0.6).astype(np.float32)
    mask[:10] = 0  # rows with no valid token
    adv = np.empty_like(teacher)
    stats = np.zeros((B, 3))
    opd._opd_rows(0, B, teacher, prev, mask, adv, stats)
    n, total, m2 = opd._combine_rows(stats)
    valid = (teacher - prev)[mask > 0].astype(np.float64)
    assert n == valid.size
    assert math.isclose(total, valid.sum(), rel_tol=1e-12)
    assert math.isclose(m2, ((valid - valid.mean()) ** 2).sum(), rel_tol=1e-10)


def test_whiten_rows_clamped_matches_torch_whitening():
    rng = np.random.default_rng(9)
    B, T = 200, 13
    a = rng.standard_normal(B)
    mask = torch.from_numpy((rng.random((B, T)) < 0.5).astype(np.float32))
    got = whitening.whiten_rows_clamped(a, mask)
    want = whitening.whiten_clamped(torch.from_numpy(a)[:, None].expand(B, T), mask)[:, 0]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
    # no valid token at all: mean = var = 0 (count floor 1), so a * 1e4
    np.testing.assert_allclose(whitening.whiten_rows_clamped(a, torch.zeros(B, T)), a * 1e4, rtol=1e-12)


def test_in_order_size():
    f = groups._in_order_size
    assert f(np.array([0, 0, 1, 1, 2, 2])) == 2
    assert f(np.array([0, 1, 2])) == 1
    assert f(np.array([0, 0, 1, 1, 1])) == 0          # ragged
    assert f(np.array([0, 0, 2, 2])) == 0             # a gap
    assert f(np.array([1, 1, 0, 0])) == 0             # out of order
    assert f(np.array([0, 0, 0, 1, 1, 0])) == 0


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 5])
def test_group_relative_rows_equals_general_path(leave_one_out, normalize, dtype, T):
    rng = np.random.default_rng(11)
    G, n = 1500, 8  # more than one slice of 1024 groups
    group = torch.arange(G * n) // n
    r = torch.from_numpy(rewards("mixed", G, n, rng)).to(dtype)
    got = groups.group_relative_rows(group, r, leave_one_out, normalize, 1e-6, T, dtype)
    adv = groups.group_relative(group, outcome_scores(r), leave_one_out, normalize, 1e-6)
    want = groups.broadcast_rows(adv, G * n, T, dtype)
    assert got is not None and got.shape == (G * n, T) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # layouts it leaves to the general path
    assert groups.group_relative_rows(group.flip(0), r, leave_one_out, normalize, 1e-6, T, dtype) is None
    assert groups.group_relative_rows(torch.arange(G * n) // 100, r, leave_one_out, normalize, 1e-6, T, dtype) is None


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["in_order", "shuffled", "ragged"])
def test_gdpo_fused_rows_equal_the_unfused_path(monkeypatch, T, dtype, layout):
    """GDPO's fused CPU paths (straight from the components; standardised straight into the rows) write
    exactly what the weighted sum + ``_standardize`` + ``broadcast_rows`` wrote before."""
    from advantage_server.estimators import gdpo as gdpo_mod
    from advantage_server.estimators.registry import Batch
    rng = np.random.default_rng(13)
    G, n = 700, 4
    group = torch.arange(G * n) // n
    if layout == "shuffled":
        group = group[torch.from_numpy(rng.permutation(G * n))]
    elif layout == "ragged":
        group = torch.from_numpy(np.sort(rng.integers(0, G, G * n)))
    comps = {"reward/a": torch.from_numpy(rewards("binary", G, n, rng)).to(dtype),
             "reward/b": torch.from_numpy(rewards("normal", G, n, rng)).to(dtype)}
    batch = Batch({"prompt_ids": group, "mask": torch.ones(G * n, T, dtype=dtype), **comps})
    cfg = gdpo_mod.GDPOConfig().resolved() if hasattr(gdpo_mod.GDPOConfig(), "resolved") else gdpo_mod.GDPOConfig()
    got = gdpo_mod.gdpo(cfg, batch).advantages
    total = groups.weighted_group_relative(group, [comps["reward/a"], comps["reward/b"]], (1.0, 1.0), True, True)
    monkeypatch.setattr(groups, "_UNIFORM_MAX", 0)
    slow = groups.weighted_group_relative(group, [comps["reward/a"], comps["reward/b"]], (1.0, 1.0), True, True)
    torch.testing.assert_close(total, slow, rtol=0, atol=0)
    t = slow.numpy().copy()
    gdpo_mod._standardize(t)
    want = groups.broadcast_rows(torch.from_numpy(t), G * n, T, dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
