"""Huge but finite inputs (issue 11 item 7): never a silent 0 or a wrong answer.

float32 rewards at 1e19..1e20 and float64 ones at 1e160 used to come back OK with every advantage 0
(a variance overflowed to infinity, and x / inf = 0). Now float32 (and float16/bfloat16) inputs beyond
2^40 are computed in float64 (``core.FLOAT32_PROMOTE_MAGNITUDE``), and inputs beyond 2^150
(``core.MAX_INPUT_MAGNITUDE``, only float64 can get there) are INVALID_ARGUMENT naming the input.

For every estimator and semantics (default config, its normalisation flag flipped, the KL penalty on),
every float input is scaled by a huge factor ``big``. The answer must be INVALID_ARGUMENT naming a
scaled input, or the answer at a safe ``mid`` scale carried over by the estimator's homogeneity there:
degree 0 (A(2x) = A(x): normalised, or clipped as OpenRLHF's +-10) or degree 1 (A(2x) = 2 A(x)),
found by doubling the inputs at ``mid`` (a power of two: exact). Where the same homogeneity holds at
scale 1, the ``mid`` answer is also checked against the scale-1 answer. An output that mixes the two degrees
by a documented rule (``_mixed``: SkyRL's REINFORCE++ returns with the KL penalty, where a hole resets the
return) is checked element by element instead.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from advantage_server import core as core_mod
from advantage_server.core import AdvantageCore
from advantage_server.errors import InvalidInput
from advantage_server.estimators import REGISTRY, Batch, jit

B, T, G = 8, 6, 2
_rng = np.random.default_rng(0)
MASK = (_rng.random((B, T)) < 0.8).astype(np.float32)
MASK[:, 0] = 1
BASE = {
    "rewards": _rng.standard_normal(B), "reward/a": _rng.standard_normal(B), "reward/b": _rng.standard_normal(B),
    "values": _rng.standard_normal((B, T)), "bootstrap_values": _rng.standard_normal(B),
    "logprobs": -_rng.random((B, T)), "reference_logprobs": -_rng.random((B, T)),
    "teacher_logprobs": -_rng.random((B, T)), "prev_logprobs": -_rng.random((B, T)),
    "sum_pi_squared": _rng.random((B, T)), "rollout_is_weights": _rng.random((B, T)) + 0.5,
    "reward_baselines": _rng.standard_normal(B), "std_rewards": _rng.random(B) + 0.5,
}
PROMPTS = np.repeat(np.arange(G), B // G)


def _configs():
    """Each estimator under each semantics: as is, with its normalisation flipped, and with KL in the reward, where
    the semantics takes the option. OpenRLHF's reward clip (+-10 by default) is opened for these scale tests: it
    makes a clipped reward beside unclipped values neither scale-invariant nor linear, by design."""
    def accepted(name: str, cfg: dict) -> bool:
        try:
            config = REGISTRY[name].config(**cfg)
            config.validate()
            config.resolved()
            return True
        except InvalidInput:  # an option this semantics does not take
            return False

    for name, spec in sorted(REGISTRY.items()):
        fields = {f.name: f for f in dataclasses.fields(spec.config)}
        sems = fields["semantics"].metadata["choices"] if "semantics" in fields else (None,)
        for sem in sems:
            base = {"semantics": sem} if sem else {}
            if sem == "openrlhf" and "reward_clip_min" in fields:
                base.update(reward_clip_min=-1e300, reward_clip_max=1e300)
            variants = [base]
            for flag in ("normalize_rewards", "normalize_advantages"):
                if flag in fields and isinstance(fields[flag].default, bool):
                    variants.append(dict(base, **{flag: not fields[flag].default}))
            if "use_kl_in_reward" in fields:
                variants.append(dict(base, use_kl_in_reward=True))
            yield from ((name, cfg) for cfg in variants if accepted(name, cfg))


CONFIGS = list(_configs())
#: (dtype, big, mid): mid is a scale the arithmetic handles in that dtype
SCALES = [(np.float32, 1e20, 1e10), (np.float32, 1e19, 1e9), (np.float32, 1e38, 1e10),
          (np.float64, 1e160, 1e40), (np.float64, 1e44, 1e30)]
_core = AdvantageCore("cpu")


def _inputs(name: str, cfg: dict, dtype, scale: float) -> dict[str, torch.Tensor]:
    spec = REGISTRY[name]
    resolved = spec.config(**cfg).resolved()
    out = {"mask": torch.from_numpy(MASK)}
    for s in spec.inputs:
        if s.kind == "integer":
            out[s.name] = torch.from_numpy(PROMPTS)
        elif s.kind == "mask" and s.name != "mask":  # a second mask (AReaL's attention_mask)
            out[s.name] = torch.from_numpy(MASK)
        elif s.kind == "float" and s.needed(resolved):
            for key in (["reward/a", "reward/b"] if s.is_pattern else [s.name]):
                out[key] = torch.from_numpy((BASE[key] * scale).astype(dtype))
    return out


def _run(name: str, cfg: dict, dtype, scale: float):
    """(advantages, returns) as float64 numpy arrays, or the InvalidInput raised."""
    try:
        res = _core.run(name, dict(cfg), _inputs(name, cfg, dtype, scale))
    except InvalidInput as err:
        return err
    assert res.advantages.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype, "results in the inputs' dtype"
    return [t.double().cpu().numpy() for t in (res.advantages, res.returns) if t is not None]


def _degree(x, x2, rtol):
    """0 when doubling the inputs left the output alone, 1 when it doubled it, else None."""
    if np.allclose(x2, x, rtol=rtol, atol=0):
        return 0
    if np.allclose(x2, 2 * x, rtol=rtol, atol=0):
        return 1
    return None


def _mixed(name: str, cfg: dict, output: int) -> bool:
    """Outputs whose elements have different degrees by a documented rule, checked element by element.

    reinforce_plus_plus under skyrl (SkyRL 0.4.0, verl 0.8's rule: a hole resets the return, README and the
    estimator's docstring) with use_kl_in_reward: the returns of a segment before a hole hold only that
    segment's KL penalty, which the k3 clamp (10, as SkyRL's compute_approx_kl) makes independent of the scale
    (degree 0), while the segments holding the reward scale with it (degree 1).
    """
    return (name == "reinforce_plus_plus" and cfg.get("semantics") == "skyrl" and bool(cfg.get("use_kl_in_reward"))
            and output == 1)


def _degree_each(x, x2, rtol):
    """Per element: 0 where doubling the inputs left it alone, 1 where it doubled it; None if any did neither."""
    same = np.isclose(x2, x, rtol=rtol, atol=0)
    double = np.isclose(x2, 2 * x, rtol=rtol, atol=0)
    return np.where(same, 0, 1) if (same | double).all() else None


@pytest.mark.parametrize("dtype,big,mid", SCALES, ids=lambda v: np.dtype(v).name if isinstance(v, type) else f"{v:g}")
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in c.items())}" for n, c in CONFIGS])
def test_huge_inputs_are_computed_right_or_refused(name, cfg, dtype, big, mid):
    got = _run(name, cfg, dtype, big)
    scaled = {f"inputs[{k!r}]" for k in _inputs(name, cfg, dtype, 1.0) if k not in ("mask", "prompt_ids")}
    if isinstance(got, InvalidInput):
        assert all(f in scaled for f, _ in got.violations), f"refused without naming a scaled input: {got}"
        return
    rtol = 1e-5 if dtype == np.float32 else 1e-9
    at_mid, at_mid2 = _run(name, cfg, dtype, mid), _run(name, cfg, dtype, 2 * mid)
    assert not isinstance(at_mid, InvalidInput) and not isinstance(at_mid2, InvalidInput), (at_mid, at_mid2)
    sane, sane2 = _run(name, cfg, dtype, 1.0), _run(name, cfg, dtype, 2.0)
    for i, (x, x2, y) in enumerate(zip(at_mid, at_mid2, got)):  # advantages, then returns
        d = _degree(x, x2, rtol)
        if d is None and _mixed(name, cfg, i):
            d = _degree_each(x, x2, rtol)  # an array of 0s and 1s
        assert d is not None, f"output {i}: neither scale-invariant nor linear at the mid scale"
        assert np.isfinite(y).all()
        assert (y != 0).any() or not (x != 0).any(), "silent zeros"
        np.testing.assert_allclose(y, x * (big / mid) ** d, rtol=20 * rtol, atol=0)
        if cfg.get("semantics") != "openrlhf" and np.ndim(d) == 0 and (  # OpenRLHF clips to +-10 from 1 to mid
                _degree(sane[i], sane2[i], 1e-6 if dtype == np.float32 else 1e-12) == d):  # same math at scale 1
            np.testing.assert_allclose(x, sane[i] * mid ** d, rtol=1e-4, atol=1e-6 * mid ** d)


def test_float32_at_1e20_is_the_sane_answer_over_grpc(client):
    """The reported cases, end to end: raw_reward at 1e20 and gae at 1e19 (float32) come back right."""
    rewards = BASE["rewards"].astype(np.float32)
    sane = client.compute("raw_reward", None, rewards=rewards, mask=MASK, as_numpy=True).advantages
    big = client.compute("raw_reward", None, rewards=rewards * np.float32(1e20), mask=MASK, as_numpy=True).advantages
    assert (sane != 0).any()
    np.testing.assert_allclose(big, sane, rtol=1e-5, atol=1e-6)
    values = BASE["values"].astype(np.float32)
    sane = client.compute("gae", None, rewards=rewards, values=values, mask=MASK, as_numpy=True)
    big = client.compute("gae", None, rewards=rewards * np.float32(1e19), values=values * np.float32(1e19),
                         mask=MASK, as_numpy=True)
    np.testing.assert_allclose(big.advantages, sane.advantages, rtol=1e-4, atol=1e-5)  # whitened
    np.testing.assert_allclose(big.returns, sane.returns.astype(np.float64) * 1e19, rtol=1e-4)


@pytest.mark.parametrize("name", ["raw_reward", "reinforce_plus_plus", "grpo_passk", "gdpo"])
def test_float64_at_1e160_is_invalid_argument_naming_the_input(client, name):
    from advantage_client.client import InvalidArgumentError

    inputs = {k: v.numpy() for k, v in _inputs(name, {}, np.float64, 1e160).items()}
    with pytest.raises(InvalidArgumentError) as info:
        client.compute(name, None, **inputs)
    assert "inputs['re" in str(info.value) and "2^150" in str(info.value), info.value


@pytest.mark.parametrize("name,cfg", [c for c in CONFIGS if c[0] in ("raw_reward", "gae", "gdpo", "grpo")],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_huge_inputs_without_numba(name, cfg):
    """The torch paths (GPU, no numba) get the same treatment."""
    with jit.use_numba(False):
        for dtype, big, mid in (SCALES[0], SCALES[3]):
            test_huge_inputs_are_computed_right_or_refused(name, cfg, dtype, big, mid)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name,cfg", [c for c in CONFIGS if c[0] in ("raw_reward", "gae", "gdpo", "grpo")],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_huge_inputs_on_cuda(monkeypatch, name, cfg):
    monkeypatch.setitem(globals(), "_core", AdvantageCore("cuda"))
    for dtype, big, mid in (SCALES[0], SCALES[1], SCALES[3]):
        test_huge_inputs_are_computed_right_or_refused(name, cfg, dtype, big, mid)


def test_magnitude_limits_leave_sane_inputs_alone():
    """Below the thresholds nothing changes: float32 stays float32, bit for bit."""
    r = torch.from_numpy(BASE["rewards"].astype(np.float32) * np.float32(1e6))
    mask = torch.from_numpy(MASK)
    res = _core.run("raw_reward", None, {"rewards": r, "mask": mask})
    assert res.advantages.dtype == torch.float32
    spec = REGISTRY["raw_reward"]
    cfg = spec.config().resolved()
    torch.testing.assert_close(res.advantages, spec.fn(cfg, Batch({"rewards": r, "mask": mask})).advantages,
                               rtol=0, atol=0)


@pytest.mark.parametrize("numba", [True, False])
def test_max_abs_over(numba):
    with jit.use_numba(numba):
        limit = core_mod.FLOAT32_PROMOTE_MAGNITUDE
        r = torch.from_numpy(BASE["values"].astype(np.float32))
        assert core_mod.validate.max_abs_over(r * 1e6, limit) is None
        assert core_mod.validate.max_abs_over(r * 1e13, limit) == pytest.approx(float((r * 1e13).abs().max()))
        nan = torch.tensor([float("nan"), 3e20, -5e20, 1.0], dtype=torch.float64)
        assert core_mod.validate.max_abs_over(nan, 1e20) == 5e20
        assert core_mod.validate.max_abs_over(torch.tensor([[float("nan")]]), 1.0) is None
        assert core_mod.validate.max_abs_over(torch.tensor([-3e30], dtype=torch.bfloat16), 1e20) > 1e30
        assert core_mod.validate.max_abs_over(torch.arange(5), 1.0) is None  # integer: not looked at
