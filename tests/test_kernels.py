"""Vectorized kernels against their loop twins (the test oracles), plus numerics edge cases.

* ``gae_kernel`` (both implementations: the numba CPU kernel and the pure-torch one) vs ``gae_loop`` over dtypes, shapes (including T not a multiple of the 64-step block and
  T > 64 * 64, which takes two levels of block carries), mask patterns, gamma, lambda (scalar and per
  row) and bootstrap values; and a hypothesis property test on small random inputs.
* ``group_baseline_and_std`` vs ``group_baseline_and_std_loop`` on interleaved random groups.
* Exact zeros for tied groups through the grpo estimator over gRPC, finite values for degenerate inputs.
"""
from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_server.estimators import jit
from advantage_server.estimators.groups import group_baseline_and_std, group_baseline_and_std_loop, group_index
from advantage_server.estimators.gae import (
    discounted_reverse_cumsum, gae_kernel, gae_kernel_numba, gae_kernel_torch, gae_loop,
)

TOL = {torch.float32: 1e-4, torch.float64: 1e-10}

#: the GAE kernel's implementations; the numba one is skipped where numba is not installed
GAE_PATHS = [pytest.param("torch", id="torch"),
             pytest.param("numba", id="numba", marks=pytest.mark.skipif(jit._numba is None, reason="numba not installed"))]
_GAE_FN = {"torch": gae_kernel_torch, "numba": gae_kernel_numba}


def assert_close_scaled(got: torch.Tensor, ref: torch.Tensor, rtol: float, what: str = "") -> None:
    """|got - ref| <= rtol * max(1, max|ref|) everywhere ("relative-ish": relative to the tensor's scale)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    got64, ref64 = got.to(torch.float64), ref.to(torch.float64)
    assert bool(torch.isfinite(got64).all()), f"{what}: non-finite output"
    scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
    err = (got64 - ref64).abs()
    worst = float(err.max()) if err.numel() else 0.0
    assert worst <= rtol * scale, (
        f"{what}: max |kernel - loop| = {worst:.3e} > {rtol:.0e} * {scale:.3g}; "
        f"first bad index {np.argwhere((err > rtol * scale).numpy())[:3].tolist()}")


# ------------------------------------------------------------------------------------------ GAE
SHAPES = [(1, 1), (3, 7), (5, 64), (4, 65), (2, 300), (3, 4097)]
MASKS = ["all_ones", "right_padded", "prompt_offset_holes", "zero_rows", "random"]
GAMMAS = [1.0, 0.99, 0.0]
LAMBDAS = [1.0, 0.95, 0.0, "per_row"]


def make_mask(pattern: str, B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "all_ones":
        return torch.ones(B, T)
    if pattern == "right_padded":
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0] = T  # one full row
        return (torch.arange(T)[None, :] < lengths[:, None]).float()
    if pattern == "prompt_offset_holes":
        m = torch.zeros(B, T)
        for b in range(B):
            start = int(torch.randint(0, max(1, T // 3), (1,), generator=gen))
            end = int(torch.randint(start + 1, T + 1, (1,), generator=gen))
            m[b, start:end] = 1.0
            holes = torch.rand(end - start, generator=gen) < 0.2  # tool-output holes inside the response
            m[b, start:end][holes] = 0.0
        return m
    if pattern == "zero_rows":
        m = (torch.rand(B, T, generator=gen) < 0.7).float()
        m[::2] = 0.0  # rows 0, 2, ... are entirely masked (for B = 1: the whole batch)
        return m
    if pattern == "random":
        return (torch.rand(B, T, generator=gen) < 0.5).float()
    raise AssertionError(pattern)


def _gae_cases():
    for shape in SHAPES:
        for dtype, mask, gamma, lam, boot in itertools.product(
                [torch.float32, torch.float64], MASKS, GAMMAS, LAMBDAS, [False, True]):
            if shape[1] > 1000:
                # the loop twin costs ~0.1 s at T = 4097: a representative subset keeps the suite fast
                if (gamma, lam) not in [(1.0, 1.0), (0.99, 0.95), (0.99, "per_row")] or not boot:
                    continue
            elif shape[1] >= 64 and not boot and gamma != 0.99:
                continue  # without bootstrap: one gamma suffices for the longer rows
            yield pytest.param(dtype, shape, mask, gamma, lam, boot,
                               id=f"{str(dtype)[6:]}-{shape[0]}x{shape[1]}-{mask}-g{gamma}-l{lam}-{'boot' if boot else 'noboot'}")


@pytest.mark.parametrize("path", GAE_PATHS)
@pytest.mark.parametrize("dtype,shape,mask_pattern,gamma,lam,bootstrap", list(_gae_cases()))
def test_gae_kernel_matches_loop(dtype, shape, mask_pattern, gamma, lam, bootstrap, path):
    B, T = shape
    gen = torch.Generator().manual_seed(zlib.crc32(f"{B}x{T}-{mask_pattern}".encode()))
    mask = make_mask(mask_pattern, B, T, gen).to(dtype)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64).to(dtype)
    boot = torch.randn(B, generator=gen, dtype=torch.float64).to(dtype) if bootstrap else None
    if lam == "per_row":
        lam_arg = torch.rand(B, generator=gen, dtype=torch.float64)
        lam_arg[0] = 1.0
        if B > 1:
            lam_arg[1] = 0.0
        lam_arg = lam_arg.to(dtype)
    else:
        lam_arg = lam
    got = _GAE_FN[path](rewards, values, mask, gamma, lam_arg, boot)
    assert got.dtype == dtype
    # oracle: the loop twin on the same values, in float64
    ref = gae_loop(rewards.double(), values.double(), mask.double(), gamma,
                   lam_arg.double() if isinstance(lam_arg, torch.Tensor) else lam_arg,
                   None if boot is None else boot.double())
    assert_close_scaled(got, ref, TOL[dtype], "gae_kernel")
    if mask_pattern == "zero_rows":
        assert bool((got[::2] == 0).all()), "an all-zero mask row must get advantage 0"


def test_gae_loop_matches_hand_computed_values():
    """Pins the oracle itself: one row with a prompt token, a hole and padding, bootstrap 2."""
    r = torch.tensor([[9.0, 1.0, 9.0, 2.0, 9.0]], dtype=torch.float64)
    v = torch.tensor([[9.0, 0.5, 9.0, 1.0, 9.0]], dtype=torch.float64)
    m = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    g, lam, boot = 0.9, 0.5, torch.tensor([2.0], dtype=torch.float64)
    d3 = 2.0 + g * 2.0 - 1.0          # last valid step: bootstraps
    d1 = 1.0 + g * 1.0 - 0.5          # skips the hole at t = 2
    a3, a1 = d3, d1 + g * lam * d3
    want = torch.tensor([[a1, a1, a3, a3, 0.0]], dtype=torch.float64)
    for fn in (gae_loop, gae_kernel, gae_kernel_torch) + ((gae_kernel_numba,) if jit._numba is not None else ()):
        torch.testing.assert_close(fn(r, v, m, g, lam, boot), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("N", [1, 63, 64, 65, 64 * 64, 64 * 64 + 1])
def test_discounted_reverse_cumsum_block_edges(N):
    gen = torch.Generator().manual_seed(N)
    d = torch.randn(2, N, generator=gen, dtype=torch.float64)
    g = torch.tensor([0.999, 0.5], dtype=torch.float64)
    want = torch.zeros_like(d)
    acc = torch.zeros(2, dtype=torch.float64)
    for j in reversed(range(N)):
        acc = d[:, j] + g * acc
        want[:, j] = acc
    assert_close_scaled(discounted_reverse_cumsum(d, g), want, 1e-10, f"N={N}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 4), T=st.integers(1, 140), seed=st.integers(0, 2**31 - 1),
    gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0), per_row=st.booleans(), boot=st.booleans(),
    density=st.floats(0.0, 1.0), path=st.sampled_from(["torch", "numba"] if jit._numba is not None else ["torch"]),
)
def test_gae_kernel_matches_loop_property(B, T, seed, gamma, lam, per_row, boot, density, path):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=gen) < density).double()
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    lam_arg = torch.rand(B, generator=gen, dtype=torch.float64) if per_row else lam
    bootstrap = torch.randn(B, generator=gen, dtype=torch.float64) if boot else None
    got = _GAE_FN[path](rewards, values, mask, gamma, lam_arg, bootstrap)
    ref = gae_loop(rewards, values, mask, gamma, lam_arg, bootstrap)
    assert_close_scaled(got, ref, 1e-10, "gae property")


# ------------------------------------------------------------------- GAE estimator: both CPU paths
_GAE_CONFIGS = [
    {}, {"semantics": "verl"}, {"normalize_advantages": False}, {"semantics": "verl", "normalize_advantages": False},
    {"gae_lambda_policy": 0.9, "gae_lambda_value": 1.0, "gae_gamma": 0.99}, {"length_adaptive_alpha": 0.05},
    {"length_adaptive_alpha": 0.5, "gae_lambda_value": 1.0},
    {"use_kl_in_reward": True, "reference_policy_kl_type": "k1", "gae_gamma": 0.99},
]


@pytest.mark.skipif(jit._numba is None, reason="numba not installed")
@pytest.mark.parametrize("config", _GAE_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "defaults")
@pytest.mark.parametrize("mask_pattern", MASKS)
@pytest.mark.parametrize("per_step,bootstrap", [(False, False), (True, True)], ids=["terminal", "per_step-boot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_gae_estimator_numba_path_matches_torch_path(config, mask_pattern, per_step, bootstrap, dtype):
    """The fused numba estimator (one pass + in-place whitening) against the pure-torch estimator in
    float64, over semantics, whitening, decoupled and length-adaptive lambda, KL, bootstrap, masks."""
    from advantage_server.core import AdvantageCore
    B, T = 6, 150
    gen = torch.Generator().manual_seed(zlib.crc32(f"{mask_pattern}{per_step}{sorted(config.items())}".encode()))
    mask = make_mask(mask_pattern, B, T, gen)
    inputs = {"mask": mask, "values": torch.randn(B, T, generator=gen, dtype=torch.float64),
              "rewards": torch.randn(*((B, T) if per_step else (B,)), generator=gen, dtype=torch.float64)}
    if bootstrap:
        inputs["bootstrap_values"] = torch.randn(B, generator=gen, dtype=torch.float64)
    if config.get("use_kl_in_reward"):
        inputs["logprobs"] = -torch.rand(B, T, generator=gen, dtype=torch.float64)
        inputs["reference_logprobs"] = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    core = AdvantageCore("cpu")
    with jit.use_numba(False):
        ref = core.run("gae", dict(config), inputs)
    with jit.use_numba(True):
        got = core.run("gae", dict(config), {k: v.to(dtype) for k, v in inputs.items()})
    assert got.advantages.dtype == dtype and got.returns.dtype == dtype
    assert_close_scaled(got.advantages, ref.advantages, TOL[dtype], "advantages")
    assert_close_scaled(got.returns, ref.returns, TOL[dtype], "returns")
    if config.get("semantics") != "verl":
        assert bool((got.advantages[mask == 0] == 0).all()), "advantages are exactly 0 where mask = 0"


# --------------------------------------------- group and token estimators: numba path == torch path
_PARITY_CASES = [
    ("grpo", {}), ("grpo", {"use_leave_one_out_baseline": False}), ("grpo", {"normalize_rewards": False}),
    ("grpo", {"semantics": "verl"}), ("grpo", {"semantics": "openrlhf"}), ("grpo", {"semantics": "trl"}),
    ("grpo", {"semantics": "trl", "scale_rewards": "batch"}), ("grpo", {"std_rewards": True}),
    ("gdpo", {}), ("gdpo", {"use_leave_one_out_baseline": False, "reward_weights": [0.3, 2.0, 1.0]}),
    ("reinforce_plus_plus", {}), ("reinforce_plus_plus", {"minus_baseline": False}),
    ("reinforce_plus_plus", {"use_kl_in_reward": True}), ("raw_reward", {}),
    ("raw_reward", {"normalize_advantages": False}), ("opd", {}),
]


def _parity_inputs(name: str, config: dict, mask: torch.Tensor, gen: torch.Generator, per_token: bool) -> dict:
    B, T = mask.shape
    ids = torch.randint(0, max(1, B // 3), (B,), generator=gen)
    levels = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)  # ties, tied groups and tied "others"
    rewards = levels[torch.randint(0, 3, (B,), generator=gen)] + (torch.rand(B, generator=gen, dtype=torch.float64)
                                                                  < 0.5) * torch.randn(B, generator=gen, dtype=torch.float64)
    if name == "opd":
        return {"mask": mask, "teacher_logprobs": -torch.rand(B, T, generator=gen, dtype=torch.float64),
                "prev_logprobs": -torch.rand(B, T, generator=gen, dtype=torch.float64)}
    if name == "gdpo":
        return {"mask": mask, "prompt_ids": ids, "reward/a": rewards, "reward/b": torch.randn(B, generator=gen, dtype=torch.float64),
                "reward/c": (torch.rand(B, generator=gen) < 0.5).double()}
    inputs = {"mask": mask, "rewards": rewards}
    if per_token and name != "raw_reward":
        inputs["rewards"] = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.1
    if name != "raw_reward" and not (name == "reinforce_plus_plus" and config.get("minus_baseline") is False):
        inputs["prompt_ids"] = ids
    if config.pop("std_rewards", False):
        inputs["std_rewards"] = torch.rand(B, generator=gen, dtype=torch.float64)
    if config.get("use_kl_in_reward"):
        inputs["logprobs"] = -torch.rand(B, T, generator=gen, dtype=torch.float64)
        inputs["reference_logprobs"] = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    return inputs


@pytest.mark.skipif(jit._numba is None, reason="numba not installed")
@pytest.mark.parametrize("name,config", _PARITY_CASES,
                         ids=[f"{n}-" + ("-".join(f"{k}={v}" for k, v in c.items()) or "defaults") for n, c in _PARITY_CASES])
@pytest.mark.parametrize("mask_pattern", ["all_ones", "prompt_offset_holes", "zero_rows"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "token_rewards"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_estimator_numba_path_matches_torch_path(name, config, mask_pattern, per_token, dtype):
    """Each CPU fast path (numba group statistics, per-row whitening, dense broadcast, fused OPD) gives
    the pure-torch (GPU) path's results, metrics included; tied groups stay exactly 0 in both."""
    from advantage_server.core import AdvantageCore
    config = dict(config)
    B, T = 40, 33
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{sorted(config.items())}{mask_pattern}{per_token}".encode()))
    mask = make_mask(mask_pattern, B, T, gen)
    inputs = _parity_inputs(name, config, mask, gen, per_token)
    snapshot = {k: v.clone() for k, v in inputs.items()}
    core = AdvantageCore("cpu")
    with jit.use_numba(False):
        ref = core.run(name, dict(config), inputs)
    with jit.use_numba(True):
        got = core.run(name, dict(config), {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()})
    for k, v in inputs.items():  # float64 inputs reach the kernels as views: they must stay untouched
        assert torch.equal(v, snapshot[k]), f"{name} modified its input {k}"
    assert got.advantages.dtype == dtype and got.advantages.shape == (B, T)
    assert_close_scaled(got.advantages, ref.advantages, 10 * TOL[dtype], f"{name} advantages")
    assert (got.returns is None) == (ref.returns is None)
    if got.returns is not None:
        assert_close_scaled(got.returns, ref.returns, 10 * TOL[dtype], f"{name} returns")
    assert got.metrics.keys() == ref.metrics.keys()
    for k in ref.metrics:
        assert got.metrics[k] == pytest.approx(ref.metrics[k], rel=10 * TOL[dtype], abs=10 * TOL[dtype]), k
    if dtype == torch.float64 and name == "grpo" and config.get("semantics") in (None, "verl") and not per_token:
        assert bool(((got.advantages == 0) == (ref.advantages == 0)).all()), "exact zeros (tied groups) must agree"


# ------------------------------------------------------------------------------ group statistics
def _interleaved_groups(gen: torch.Generator, n_groups: int) -> torch.Tensor:
    sizes = torch.randint(1, 10, (n_groups,), generator=gen)
    sizes[0] = 1  # always one singleton group
    group = torch.repeat_interleave(torch.arange(n_groups), sizes)
    return group[torch.randperm(group.numel(), generator=gen)]


@pytest.mark.parametrize("path", GAE_PATHS)
@pytest.mark.parametrize("layout", ["interleaved", "contiguous"])
@pytest.mark.parametrize("leave_one_out", [False, True], ids=["mean", "loo"])
@pytest.mark.parametrize("reward_kind", ["continuous", "binary", "few_levels", "large_offset"])
@pytest.mark.parametrize("seed", range(4))
def test_group_baseline_and_std_matches_loop(seed, reward_kind, leave_one_out, layout, path):
    gen = torch.Generator().manual_seed(seed * 101 + len(reward_kind))
    group = _interleaved_groups(gen, n_groups=12)
    if layout == "contiguous":  # each prompt's samples back to back, as trainers send them
        group = group.sort().values
    B = group.numel()
    if reward_kind == "continuous":
        rewards = torch.randn(B, generator=gen)
    elif reward_kind == "binary":
        rewards = (torch.rand(B, generator=gen) < 0.5).float()  # many tied groups and tied "others"
    elif reward_kind == "few_levels":
        rewards = torch.tensor([0.7, 1.0, -0.3])[torch.randint(0, 3, (B,), generator=gen)]
    else:
        rewards = 1000.1 + torch.randint(0, 3, (B,), generator=gen).float() * 0.5
    with jit.use_numba(path == "numba"):
        baseline, std = group_baseline_and_std(group, rewards, leave_one_out)
    want_b, want_s = group_baseline_and_std_loop(group, rewards, leave_one_out)
    assert baseline.dtype == torch.float64 and std.dtype == torch.float64
    scale = max(1.0, float(rewards.abs().max()))
    torch.testing.assert_close(baseline, want_b, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(std, want_s, rtol=0, atol=1e-7 * scale)
    # exactness where it matters: a tied pool gives baseline == reward bits and std exactly 0
    assert bool(((std == 0) == (want_s == 0)).all()), "std must be exactly 0 exactly where the pool is tied"
    r64 = rewards.double()
    singles = torch.bincount(group)[group] == 1
    assert bool((baseline[singles] == r64[singles]).all()) and bool((std[singles] == 0).all())


@pytest.mark.parametrize("ids", [
    [3, 3, 1, 7, 1, 3], [0], [-5, 2, -5, 10**12, 2], list(range(20, 0, -1)), [4] * 9,
], ids=["small", "one", "wide-range", "distinct", "all-equal"])
def test_group_index_counting_rank_matches_sort_rank(ids):
    """The CPU counting rank (numba) gives the same dense ids as the sort-and-rank torch path."""
    t = torch.tensor(ids, dtype=torch.int64)
    with jit.use_numba(False):
        want = group_index(t)
    with jit.use_numba(True):
        got = group_index(t)
        got32 = group_index(t.to(torch.int32)) if max(map(abs, ids)) < 2**31 else got
    assert got.dtype == torch.int64 and torch.equal(got, want) and torch.equal(got32, want)
    assert torch.equal(want, torch.unique(t, return_inverse=True)[1])


@pytest.mark.skipif(jit._numba is None, reason="numba not installed")
@pytest.mark.parametrize("layout", ["interleaved", "contiguous"])
@pytest.mark.parametrize("leave_one_out,normalize", [(True, True), (False, True), (True, False)])
def test_weighted_group_relative_matches_sum_of_group_relative(layout, leave_one_out, normalize):
    """GDPO's fused CPU path (one layout, weighted sum accumulated per group) == the torch path's sum."""
    from advantage_server.estimators.groups import group_relative, weighted_group_relative
    gen = torch.Generator().manual_seed(7 + leave_one_out + 2 * normalize)
    group = _interleaved_groups(gen, n_groups=15)
    if layout == "contiguous":
        group = group.sort().values
    B = group.numel()
    comps = [torch.randn(B, generator=gen, dtype=torch.float64), (torch.rand(B, generator=gen) < 0.5).double(),
             torch.tensor([0.7, 1.0, -0.3], dtype=torch.float64)[torch.randint(0, 3, (B,), generator=gen)]]
    weights = (0.5, 2.0, -1.0)
    with jit.use_numba(True):
        got = weighted_group_relative(group, comps, weights, leave_one_out, normalize)
    with jit.use_numba(False):
        want = sum(w * group_relative(group, c, leave_one_out, normalize) for w, c in zip(weights, comps))
        assert weighted_group_relative(group, comps, weights, leave_one_out, normalize) is None
    assert got is not None and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", GAE_PATHS)
def test_group_stats_leave_one_out_hand_values(path):
    group = torch.tensor([0, 1, 0, 1, 0, 2])
    rewards = torch.tensor([1.0, 5.0, 2.0, 7.0, 6.0, 3.0], dtype=torch.float64)
    with jit.use_numba(path == "numba"):
        baseline, std = group_baseline_and_std(group, rewards, leave_one_out=True)
    torch.testing.assert_close(baseline, torch.tensor([4.0, 7.0, 3.5, 5.0, 1.5, 3.0], dtype=torch.float64))
    s = math.sqrt
    torch.testing.assert_close(std, torch.tensor([s(8.0), 0.0, s(12.5), 0.0, s(0.5), 0.0], dtype=torch.float64))


# --------------------------------------------------------------------- exactness through gRPC
def test_tied_groups_give_exactly_zero_advantages_over_grpc(client):
    ids = np.array([0, 0, 0, 1, 1, 1, 2, 2, 0, 2], dtype=np.int64)
    rewards = np.array([0.7, 0.7, 0.7, 1000.1, 1000.1, 1000.1, -3.3, -3.3, 0.7, -3.3], dtype=np.float32)
    mask = np.ones((10, 3), dtype=np.float32)
    for loo in (True, False):
        for norm in (True, False):
            res = client.compute("grpo", {"use_leave_one_out_baseline": loo, "normalize_rewards": norm},
                                 prompt_ids=ids, rewards=rewards, mask=mask, as_numpy=True)
            assert res.advantages.shape == (10, 3)
            assert (res.advantages == 0.0).all(), (loo, norm, res.advantages[:, 0])


@pytest.mark.parametrize("n", [3, 5, 7])
def test_tied_float64_groups_give_exactly_zero_over_grpc(client, n):
    """0.1 in float64: n * 0.1 / n != 0.1, so only the tied-group handling makes these exact zeros."""
    ids = np.repeat(np.arange(3), n).astype(np.int64)
    rewards = np.repeat(np.array([0.1, 1.1, 1e-3], np.float64), n)
    for loo in (True, False):
        res = client.compute("grpo", {"use_leave_one_out_baseline": loo}, prompt_ids=ids, rewards=rewards,
                             mask=np.ones((3 * n, 2), np.float32), output_dtype="float64", as_numpy=True)
        assert res.advantages.dtype == np.float64
        assert (res.advantages == 0.0).all(), (loo, res.advantages[:, 0])


def test_almost_tied_group_has_no_blow_up_over_grpc(client):
    ids = np.array([4, 4, 4, 4], dtype=np.int64)
    rewards = np.array([0.7, 0.7, 0.7, 1.0], dtype=np.float32)
    mask = np.ones((4, 2), dtype=np.float32)
    res = client.compute("grpo", {"use_leave_one_out_baseline": True, "normalize_rewards": True},
                         prompt_ids=ids, rewards=rewards, mask=mask, as_numpy=True)
    adv = res.advantages[:, 0].astype(np.float64)
    assert np.isfinite(res.advantages).all()
    # seen from 1.0 the others are tied at 0.7: baseline 0.7, std 0 -> unscaled 0.3 (not 0.3 / 1e-6)
    assert abs(adv[3] - 0.3) < 1e-6, adv
    # seen from a 0.7: others {0.7, 0.7, 1.0}: mean 0.8, sample std sqrt(0.03)
    assert np.allclose(adv[:3], -0.1 / (math.sqrt(0.03) + 1e-6), rtol=1e-5), adv
    res = client.compute("grpo", {"use_leave_one_out_baseline": False, "normalize_rewards": True},
                         prompt_ids=ids, rewards=rewards, mask=mask, as_numpy=True)
    # mean 0.775, sample std 0.15
    assert np.allclose(res.advantages[:, 0], [-0.5, -0.5, -0.5, 1.5], rtol=1e-4), res.advantages
    assert (res.advantages == res.advantages[:, :1]).all(), "grpo broadcasts one value per row"


@pytest.mark.parametrize("low,high,n_low", [(0.1, 1.0, 2), (0.1, 0.9, 5), (0.1, 0.0, 8), (0.3, 1.0, 6)])
def test_others_tied_leave_one_out_has_no_blow_up_over_grpc(client, low, high, n_low):
    """Seen from the odd one out, the others are tied: std must be exactly 0 (advantage high - low,
    unscaled), not float noise divided into a 1e5..1e6 advantage."""
    rewards = np.array([low] * n_low + [high], np.float32)
    ids = np.zeros(n_low + 1, np.int64)
    res = client.compute("grpo", None, prompt_ids=ids, rewards=rewards, mask=np.ones((n_low + 1, 1), np.float32),
                         as_numpy=True)
    adv = res.advantages[:, 0].astype(np.float64)
    r = rewards.astype(np.float64)
    assert abs(adv[-1] - (r[-1] - r[0])) < 1e-6, adv
    # the others of a `low` sample: n_low - 1 lows and the high one
    pool = np.array([r[0]] * (n_low - 1) + [r[-1]])
    want = (r[0] - pool.mean()) / (pool.std(ddof=1) + 1e-6) if len(pool) > 1 else 0.0
    np.testing.assert_allclose(adv[:-1], want, rtol=1e-5, atol=1e-6)
    assert np.abs(adv).max() < 10


# ------------------------------------------------------------------------ degenerate inputs
B, T = 4, 5
_rng = np.random.default_rng(0)
_DEGENERATE_INPUTS = {
    "grpo": dict(prompt_ids=np.array([0, 0, 1, 1]), rewards=np.array([1.0, 0.0, 0.5, 0.5], np.float32)),
    "gdpo": {"prompt_ids": np.array([0, 0, 1, 1]), "reward/a": np.array([1.0, 0.0, 1.0, 1.0], np.float32),
             "reward/b": np.array([0.2, 0.1, 0.0, 0.3], np.float32)},
    "reinforce_plus_plus": dict(prompt_ids=np.array([0, 0, 1, 1]), rewards=np.array([1.0, 0.0, 0.5, 2.0], np.float32)),
    "raw_reward": dict(rewards=np.array([1.0, 0.0, 0.5, 2.0], np.float32)),
    "gae": dict(rewards=np.array([1.0, 0.0, 0.5, 2.0], np.float32),
                values=_rng.standard_normal((B, T)).astype(np.float32)),
    "opd": dict(teacher_logprobs=-_rng.random((B, T)).astype(np.float32),
                prev_logprobs=-_rng.random((B, T)).astype(np.float32)),
}


@pytest.mark.parametrize("name", sorted(_DEGENERATE_INPUTS))
def test_all_zero_mask_gives_finite_outputs_over_grpc(client, name):
    res = client.compute(name, None, mask=np.zeros((B, T), np.float32), as_numpy=True, **_DEGENERATE_INPUTS[name])
    assert res.advantages.shape == (B, T)
    assert np.isfinite(res.advantages).all(), res.advantages
    if res.returns is not None:
        assert np.isfinite(res.returns).all()
    if name in ("gae", "opd"):
        assert (res.advantages == 0).all(), "advantages are 0 where mask = 0"
    if name == "gae":
        # no valid step: returns = un-whitened advantages (0) + values
        np.testing.assert_allclose(res.returns, _DEGENERATE_INPUTS["gae"]["values"], rtol=0, atol=1e-6)
    if name == "opd":
        assert res.metrics and all(v == 0.0 for v in res.metrics.values()), res.metrics


def test_gae_single_valid_token_with_whitening_is_finite(client):
    mask = np.zeros((2, 6), np.float32)
    mask[1, 3] = 1.0
    values = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
    res = client.compute("gae", {"normalize_advantages": True}, rewards=np.array([5.0, 2.0], np.float32),
                         mask=mask, values=values, as_numpy=True)
    assert np.isfinite(res.advantages).all() and np.isfinite(res.returns).all()
    assert (res.advantages == 0).all(), "one token: centred advantage 0, variance taken as 0, no NaN"
    # un-whitened A at the single step = r - V = 2 - values[1, 3]; returns = A + V = 2 there
    assert abs(res.returns[1, 3] - 2.0) < 1e-6


def test_gdpo_single_row_is_finite(client):
    res = client.compute("gdpo", None, prompt_ids=np.array([7]), mask=np.ones((1, 3), np.float32),
                         **{"reward/a": np.array([1.0], np.float32), "reward/b": np.array([0.5], np.float32)},
                         as_numpy=True)
    assert res.advantages.shape == (1, 3)
    assert np.isfinite(res.advantages).all() and (res.advantages == 0).all()


@pytest.mark.parametrize("path", GAE_PATHS)
@pytest.mark.parametrize("big", [1e4, 1e5, 1e6, 1e7, -1e9])
def test_leave_one_out_std_seen_from_a_dominant_member_is_exact(big, path):
    """Seen from a member that dominates the group's spread, the others' std must not be lost to
    cancellation ({big, 0, 1e-3}: the others' sample std is 1e-3 / sqrt(2) whatever `big` is)."""
    group = torch.tensor([0, 0, 0])
    rewards = torch.tensor([big, 0.0, 1e-3], dtype=torch.float64)
    with jit.use_numba(path == "numba"):
        baseline, std = group_baseline_and_std(group, rewards, leave_one_out=True)
    assert std[0].item() == pytest.approx(1e-3 / math.sqrt(2), rel=1e-9)
    assert baseline[0].item() == pytest.approx(5e-4, rel=1e-9)
    ref_b, ref_s = group_baseline_and_std_loop(group, rewards, leave_one_out=True)
    torch.testing.assert_close(std, ref_s, rtol=1e-9, atol=0)
