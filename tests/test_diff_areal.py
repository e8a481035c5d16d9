"""Differential tests: the released AReaL 1.0.4 (tests/references/requirements.txt; imported in-process by
tests/references/areal_ref.py) against the service's ``areal`` estimator over real gRPC (the ``client`` fixture).

The oracle is AReaL's own ``PPOActor._compute_advantages`` (the whole pipeline: reward bias, scaling, clip and
``reward_norm``, the KL reward, the reward placement at ``seqlen - 2``, the shifted GAE, ``adv_norm``) on the same
batch. Hypothesis generates batches per option family (``EXAMPLES`` each):

* ``gae``: critic ``values``, discount and lambda in {1, 0.99, 0.9, 0.5, 0}, KL (``kl_ctl`` 0, 0.1 or 0.7; k1, k2,
  k3; with and without ``ref_logp``; ``recompute_logprob`` / ``use_decoupled_loss``), optional ``reward_norm`` and
  ``adv_norm``, reward bias, scaling and clip, ``mask_no_eos_with_zero``;
* ``grpo``: AReaL's GRPO examples' shape: no values, discount = lambda = 1, ``reward_norm`` at group level
  (``group_size`` 1..4, also not dividing B: rows after the last block), ``adv_norm`` batch or unset;
* ``norm``: every NormConfig combination (mean and std each batch, group or none; leave-one-out; unbiased;
  eps; group_size) on both normalisations, with and without values.

Every batch: B 1..9, T 1..8; rewards outcome, binary, tied, or near ties (a few units in the last place of the
batch's dtype apart, where AReaL's float32 group buffers round the mean and a float64 mean would differ by more
than the tolerance after the division by a tiny std + eps); rows as AReaL lays them out (prompt, response, padding; ``seqlen = T``: no end token),
plus loss masks with holes, a trained first column (the circular roll brings it to column T - 1), all-zero rows
and all-zero batches, a last token with loss mask 0; attention masks that are prefixes or not (AReaL only sums
them); float32 and float64 (every float input in the batch's dtype; int64, bool or float masks).

Rule: advantages and returns are compared at every position (AReaL's outputs are defined everywhere):
``|service - AReaL| <= rtol |AReaL| + atol max(1, max |AReaL|)`` at the tolerance of AReaL's output dtype (float32:
2e-4 / 2e-5; float64: 1e-9 / 1e-9). The service reproduces AReaL's float32 steps (the KL reward, the reward
placement, group statistics of float32 rewards, ``Normalization``'s float32 result), so no batch needs a float64
oracle; AReaL neither raises nor returns NaN for these configs (eps > 0: the service refuses eps = 0, where AReaL
divides by zero: :func:`test_eps_zero_is_refused_where_areal_divides_by_zero`). Anything else fails. Counts per
family are printed in the terminal summary (tests/references/counts.py).
"""
from __future__ import annotations

import pathlib
import sys

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_client import AdvantageServiceError
from advantage_client.references import REFERENCES
from references import areal_ref
from references.counts import TRIED

ACTOR = areal_ref.load()
EXAMPLES = int(__import__("os").environ.get("AREAL_EXAMPLES", "200"))
TOL = {torch.float32: (2e-4, 2e-5), torch.float64: (1e-9, 1e-9)}
LEVELS = ["batch", "group", "none"]


# ------------------------------------------------------------------------------------------ batches
def _masks(draw, B: int, T: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    """(loss_mask, attention_mask) [B, T] int64 and a description."""
    kind = draw(st.sampled_from(["areal", "areal", "holes", "random"]))
    seqlen = rng.integers(0, T + 1, B)
    if draw(st.booleans()):
        seqlen[rng.random(B) < 0.4] = T  # no end token
    cols = np.arange(T)[None, :]
    attention = (cols < seqlen[:, None]).astype(np.int64)
    if kind in ("areal", "holes"):
        prompt = np.minimum(rng.integers(0, 3, B), seqlen)
        loss = ((cols >= prompt[:, None]) & (cols < seqlen[:, None])).astype(np.int64)
        if kind == "holes":
            loss &= (rng.random((B, T)) < 0.7)
        if draw(st.booleans()):  # the last token untrained: the reward lands on an lm = 0 position
            loss[np.arange(B), np.maximum(seqlen - 1, 0)] &= (rng.random(B) < 0.5)
    else:
        loss = (rng.random((B, T)) < 0.6).astype(np.int64)
        if draw(st.booleans()):
            attention = (rng.random((B, T)) < 0.8).astype(np.int64)
    if draw(st.booleans()):
        loss[:, 0] = rng.integers(0, 2, B)  # rolled to column T - 1
    if draw(st.booleans()):
        loss[rng.random(B) < 0.3] = 0  # empty rows
    if draw(st.integers(0, 9)) == 0:
        loss[:] = 0  # nothing trained: adv_norm returns its input
    return loss, attention, kind


def _norm(draw, family: str, B: int) -> dict | None:
    if family != "norm" and draw(st.booleans()):
        return None
    spec: dict = {"mean_level": draw(st.sampled_from(LEVELS)), "std_level": draw(st.sampled_from(LEVELS))}
    if draw(st.booleans()):
        spec["mean_leave1out"] = draw(st.booleans())
    if draw(st.booleans()):
        spec["std_unbiased"] = draw(st.booleans())
    if draw(st.booleans()):
        spec["eps"] = draw(st.sampled_from([1e-5, 1e-6, 1e-3, 0.1]))
    if draw(st.booleans()) or "group" in (spec["mean_level"], spec["std_level"]):
        spec["group_size"] = draw(st.integers(1, max(1, min(B + 1, 5))))
    return spec


@st.composite
def batches(draw, family: str) -> dict:
    B = draw(st.integers(1, 9))
    T = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    loss, attention, mkind = _masks(draw, B, T, rng)
    reward_kind = draw(st.sampled_from(["outcome", "binary", "tied", "near_tie"]))
    if reward_kind == "outcome":
        rewards = np.round(rng.normal(0, 2, B), 3)
    elif reward_kind == "binary":
        rewards = rng.integers(0, 2, B).astype(np.float64)
    elif reward_kind == "tied":
        rewards = np.full(B, float(rng.choice([0.0, 1.0, -2.0])))
    else:  # a few units in the last place of the batch's dtype apart: where float32 group buffers round the mean
        np_dt = np.float32 if dtype == torch.float32 else np.float64
        base = np_dt(rng.choice([0.1, 1 / 3, 0.7, 2.0]))
        rewards = np.array([base + k * np.spacing(base) for k in rng.integers(0, 3, B)], dtype=np_dt).astype(np.float64)
    cfg: dict = {}
    if family == "grpo":
        gs = draw(st.integers(1, 4))
        cfg["reward_norm"] = {"mean_level": "group", "std_level": "group", "group_size": gs}
        if draw(st.booleans()):
            cfg["reward_norm"]["mean_leave1out"] = draw(st.booleans())
        cfg["adv_norm"] = draw(st.sampled_from([None, {"mean_level": "batch", "std_level": "batch"}]))
        cfg["kl_ctl"] = draw(st.sampled_from([0.0, 0.0, 0.1]))
        cfg["reward_bias"], cfg["reward_scaling"] = draw(st.sampled_from([(0.0, 1.0), (-0.5, 10.0)]))
        with_values = False
    else:
        cfg["reward_norm"] = _norm(draw, family, B)
        cfg["adv_norm"] = _norm(draw, family, B)
        cfg["kl_ctl"] = draw(st.sampled_from([0.0, 0.1, 0.7]))
        cfg["reward_bias"] = draw(st.sampled_from([0.0, -0.5, 1.0]))
        cfg["reward_scaling"] = draw(st.sampled_from([1.0, 10.0, 0.5]))
        cfg["reward_clip"] = draw(st.sampled_from([20.0, 1.0, 5.0]))
        with_values = family == "gae" or draw(st.booleans())
        if family == "gae":
            cfg["discount"] = draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0]))
            cfg["gae_lambda"] = draw(st.sampled_from([1.0, 0.95, 0.5, 0.0]))
    cfg["kl_estimator"] = draw(st.sampled_from(["k1", "k2", "k3"]))
    cfg["mask_no_eos_with_zero"] = draw(st.booleans())
    cfg["recompute_logprob"] = draw(st.booleans())
    cfg["use_decoupled_loss"] = draw(st.booleans())
    mask_as = draw(st.sampled_from(["int64", "bool", "float"]))
    as_mask = {"int64": lambda m: torch.from_numpy(m), "bool": lambda m: torch.from_numpy(m.astype(bool)),
               "float": lambda m: torch.from_numpy(m).to(dtype)}[mask_as]
    tensors = {
        "rewards": torch.from_numpy(rewards).to(dtype),
        "mask": as_mask(loss), "attention_mask": as_mask(attention),
        "logprobs": torch.from_numpy(-rng.uniform(0.01, 4.0, (B, T))).to(dtype),
    }
    if draw(st.booleans()):
        tensors["reference_logprobs"] = torch.from_numpy(-rng.uniform(0.01, 4.0, (B, T))).to(dtype)
    if with_values:
        tensors["values"] = torch.from_numpy(np.round(rng.normal(0, 1, (B, T)), 3)).to(dtype)
    kinds = f"{family} B={B} T={T} masks={mkind}/{mask_as} rewards={reward_kind} {dtype} values={with_values}"
    return {"cfg": {k: v for k, v in cfg.items() if v is not None}, "tensors": tensors, "dtype": dtype, "kinds": kinds}


# ------------------------------------------------------------------------------------------ compare
def reference(case: dict) -> dict:
    t = case["tensors"]
    return areal_ref.compute(rewards=t["rewards"], loss_mask=t["mask"], attention_mask=t["attention_mask"],
                             logprobs=t["logprobs"], ref_logp=t.get("reference_logprobs"), values=t.get("values"),
                             **case["cfg"])


def _close(got: np.ndarray, want: torch.Tensor) -> tuple[bool, str]:
    rtol, atol = TOL[want.dtype]
    w = want.double().numpy()
    g = np.asarray(got, dtype=np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    scale = max(1.0, float(np.abs(w).max(initial=0.0)))
    bad = np.abs(g - w) > rtol * np.abs(w) + atol * scale
    if not bad.any():
        return True, ""
    i = tuple(np.argwhere(bad)[0])
    return False, f"{int(bad.sum())} of {g.size} positions differ, e.g. at {i} service {g[i]!r} vs AReaL {w[i]!r}"


def check(client, case: dict) -> None:
    ref = reference(case)
    for label in ("advantages", "returns"):
        assert bool(torch.isfinite(ref[label]).all()), f"AReaL gave non-finite {label} ({case['kinds']})"
    out = client.compute("areal", case["cfg"], as_numpy=True,
                         output_dtype="float64" if case["dtype"] == torch.float64 else "float32", **case["tensors"])
    for label in ("advantages", "returns"):
        ok, why = _close(getattr(out, label), ref[label])
        if not ok:
            pytest.fail(f"areal {label}: service != AReaL 1.0.4: {why} ({case['kinds']})\ncfg={case['cfg']}\n"
                        + "\n".join(f"{k}={v.tolist()}" for k, v in case["tensors"].items()))


@pytest.mark.parametrize("family", ["gae", "grpo", "norm"])
def test_service_matches_released_areal(client, family):
    tried = []

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batches(family))
    def run(case):
        check(client, case)
        tried.append(1)

    run()
    TRIED[f"areal/{family}"] += len(tried)
    assert len(tried) >= EXAMPLES, f"{family}: only {len(tried)} batches tried"


# ------------------------------------------------------------------------------------------ facts
def _one(client, cfg: dict, **tensors):
    out = client.compute("areal", cfg, as_numpy=True, output_dtype="float64", **tensors)
    ref = areal_ref.compute(rewards=tensors["rewards"], loss_mask=tensors["mask"],
                            attention_mask=tensors["attention_mask"], logprobs=tensors["logprobs"],
                            values=tensors.get("values"), **cfg)
    return out, ref


def test_reward_is_lost_when_the_last_token_is_untrained(client):
    """The issue's fact: the reward sits at seqlen - 2 of the shifted mask, so loss_mask 0 on the last token drops it."""
    lp = torch.zeros(2, 5)
    loss = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    out, ref = _one(client, {"kl_ctl": 0.0}, rewards=torch.tensor([1.0, 1.0]), mask=loss, attention_mask=attention,
                    logprobs=lp)
    assert ref["advantages"].tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    np.testing.assert_array_equal(out.advantages, ref["advantages"].numpy())


def test_a_full_width_row_bootstraps_and_mask_no_eos_drops_its_reward(client):
    """seqlen = T counts as no end token: bootstrapped from values[T - 1]; mask_no_eos_with_zero drops its reward."""
    loss = torch.tensor([[0, 1, 1, 1]])
    attention = torch.ones(1, 4, dtype=torch.long)
    values = torch.tensor([[0.0, 0.0, 0.0, 5.0]], dtype=torch.float64)
    for drop, want in ((False, [[7.0, 7.0, 7.0, 0.0]]), (True, [[5.0, 5.0, 5.0, 0.0]])):
        out, ref = _one(client, {"kl_ctl": 0.0, "mask_no_eos_with_zero": drop}, rewards=torch.tensor([2.0]),
                        mask=loss, attention_mask=attention, logprobs=torch.zeros(1, 4), values=values)
        assert ref["advantages"].tolist() == want, ref["advantages"]
        np.testing.assert_array_equal(out.advantages, ref["advantages"].numpy())


def test_group_blocks_leave_trailing_rows_divided_by_eps(client):
    """group_size 2 over 3 rows: the third row is outside every block: x / eps."""
    cfg = {"kl_ctl": 0.0, "reward_norm": {"mean_level": "group", "std_level": "group", "group_size": 2, "eps": 0.5}}
    out, ref = _one(client, cfg, rewards=torch.tensor([1.0, 0.0, 3.0]), mask=torch.tensor([[1, 1]] * 3),
                    attention_mask=torch.tensor([[1, 0]] * 3), logprobs=torch.zeros(3, 2))
    assert ref["advantages"][2, 0].item() == 6.0
    np.testing.assert_allclose(out.advantages, ref["advantages"].numpy(), rtol=1e-6)


def test_eps_zero_is_refused_where_areal_divides_by_zero(client):
    """AReaL with eps = 0 on a tied group divides 0 by 0 (NaN); the service refuses eps = 0 naming the field."""
    cfg = {"kl_ctl": 0.0, "reward_norm": {"mean_level": "group", "std_level": "group", "group_size": 2, "eps": 0.0}}
    tensors = dict(rewards=torch.tensor([1.0, 1.0]), mask=torch.tensor([[1, 1]] * 2),
                   attention_mask=torch.tensor([[1, 0]] * 2), logprobs=torch.zeros(2, 2))
    ref = areal_ref.compute(rewards=tensors["rewards"], loss_mask=tensors["mask"],
                            attention_mask=tensors["attention_mask"], logprobs=tensors["logprobs"], **cfg)
    assert torch.isnan(ref["advantages"]).any()
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("areal", cfg, **tensors)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.reward_norm.eps" in str(exc.value)


def test_installed_areal_is_the_pinned_release():
    release = REFERENCES["areal"].release
    assert areal_ref.version() == release
    reqs = (pathlib.Path(__file__).parent / "references" / "requirements.txt").read_text().splitlines()
    assert REFERENCES["areal"].pin in [line.strip() for line in reqs], f"requirements.txt must pin areal=={release}"


def test_harness_stubs_nothing_that_computes_an_advantage():
    """The advantage code is AReaL's released source, and none of this harness's stubs is left in sys.modules."""
    import importlib.util
    import inspect

    root = pathlib.Path(importlib.util.find_spec("areal").submodule_search_locations[0])
    data = sys.modules[ACTOR.Normalization.__module__] if ACTOR.Normalization.__module__ in sys.modules else None
    for fn in (ACTOR.PPOActor._compute_advantages, ACTOR.Normalization.__call__, ACTOR.Normalization._compute_mean,
               ACTOR.Normalization._compute_std, ACTOR.KLEstimator._compute_approx_kl):
        assert pathlib.Path(inspect.getsourcefile(inspect.unwrap(fn))).is_relative_to(root), fn
    assert data is None  # areal_ref restores sys.modules: nothing of areal stays imported by name
    norm = areal_ref.norm_config({"mean_level": "group", "group_size": 2})
    assert pathlib.Path(type(norm).__post_init__.__code__.co_filename).is_relative_to(root)  # the released class
    assert set(areal_ref.stubbed()) <= set(areal_ref.STUBS)
    for name in areal_ref.STUBS:
        module = sys.modules.get(name)
        assert module is None or "areal_ref.py" not in (module.__doc__ or ""), name
