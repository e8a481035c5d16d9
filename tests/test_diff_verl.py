"""Differential tests: the released verl (tests/references/requirements.txt; imported in-process by
tests/references/verl_ref.py) against the service, through the public verl drop-in
``advantage_client.verl.get_adv_estimator_fn(name, target)`` over real gRPC (the ``server`` fixture).

For every name in the pinned verl's ``ADV_ESTIMATOR_REGISTRY`` (read from verl at collection time),
hypothesis generates batches (B, T >= 1; groups of one, uneven and interleaved groups; uid strings as a
NumPy object array, numeric-looking strings and integer ids; masks with holes and all-zero rows; tied,
binary, outcome and token-level rewards; float32 and float64). Each batch is given to verl's function
with the keywords verl's trainer passes (``ray_trainer.compute_advantage``) and to the drop-in with the
same keywords; advantages and returns ``[B, T]`` are compared where ``response_mask`` = 1, and the
service's output must be finite everywhere.

The comparison rule, per batch:

1. Agreement: ``|service - oracle| <= rtol * |oracle| + atol * scale`` (``scale`` = max(1, max |oracle|))
   at the tolerance of the batch's dtype: float64 (rtol = atol = 1e-9) or float32 (rtol = 2e-4,
   atol = 2e-5). The oracle is verl's function on the batch where verl computes in the batch's dtype.
   Two cases compute in float32 whatever the input:
   * ``grpo_vectorized`` (``group_mean_std`` casts to float32): for a float64 batch the oracle is verl's
     float64 path of the same formula (``reference_f64``: ``compute_grpo_outcome_advantage`` on
     ``as_torch_index``'s labels), at float64 tolerance, since the service computes in float64; verl's
     released float32 answer is compared with that oracle only to count the batches where it lost the
     answer (rule 2). A float32 batch takes the general rule.
   * ``gdpo`` with reward components (verl reads them and the weights as float32, whatever the batch's
     dtype, and returns float32): the oracle y64 is the composition of verl's
     ``compute_grpo_outcome_advantage`` and ``masked_whiten`` that ``compute_gdpo_outcome_advantage``
     runs, in float64 on the components and weights rounded to float32 as verl reads them
     (``gdpo_oracle``, with rule 3's variance 0 where verl raises). The service computes in float64 from
     the same float32 values and rounds once to float32, so at each position
     ``|service - y64| <= spacing32(y64) / 2 + 16 u64 max(1, max |y64|) + 16 s`` (``check_gdpo_components``:
     one rounding, float64 arithmetic, s the oracle's own sensitivity to the last bit of its inputs).
     verl's released answer is compared with y64 only to count the batches where it lost the answer.
2. Float32 cancellation: where verl computed in float32 (a float32 batch) and its answer differs from the
   service's, the reference is run in float64 (the same function on the batch cast to float64;
   ``reference_f64`` for ``grpo_vectorized``). The service must then agree with that float64 answer
   (float32 tolerance), and the float32 reference must itself disagree with it: the reference lost the
   answer. Otherwise the test fails.
3. Reference raises, or returns NaN/inf from finite input: the service must be finite and give its
   documented answer: verl's ``masked_var`` raises with fewer than two valid tokens in the batch, where
   the service takes the variance as 0 (``whitening.whiten_unbiased``), so the oracle is verl's own
   function with ``masked_var`` returning 0 exactly there (and the real one otherwise); verl's pass@k
   raises for a group of one, which the service gives 0 (the oracle: 0 for those rows, verl on the others);
   verl's OPO divides 0 by 0 for a group whose rows all have an empty mask, where the service gives 0
   (the oracle: verl's output with those rows set to 0; NaN anywhere else fails).

Anything else is a failure. Per-estimator batch counts (and how many took rules 2 and 3) are printed in
the terminal summary (tests/conftest.py, tests/references/counts.py).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_client import verl as dropin
from advantage_client.references import REFERENCES
from references import verl_ref
from references.counts import count_rules

CORE = verl_ref.load()
REGISTRY = verl_ref.registry()  # the pinned verl's names: the loop below is over these
import verl.utils.torch_functional as verl_F  # noqa: E402  (real module, loaded by verl_ref)
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.utils import as_torch_index  # noqa: E402

EXAMPLES = 300
F32_INTERNAL = {"grpo_vectorized"}  # verl computes it in float32 whatever the input (gdpo with components too)
TOL = {torch.float32: (2e-4, 2e-5), torch.float64: (1e-9, 1e-9)}
U64 = float(np.finfo(np.float64).eps) / 2
GROUP_ESTIMATORS = {"grpo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus_baseline", "rloo",
                    "rloo_vectorized", "opo", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"}
WHITENED = {"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo"}  # verl masked_whiten


# ------------------------------------------------------------------------------------------ batches
@dataclass
class Case:
    name: str
    rewards: torch.Tensor                 # [B, T] token_level_rewards
    mask: torch.Tensor                    # [B, T] response_mask (int64 0/1, or float)
    index: np.ndarray                     # [B] uid labels (object array of str, or int64)
    extra: dict[str, Any] = field(default_factory=dict)   # verl keywords besides the three above
    components: dict[str, np.ndarray] | None = None       # gdpo: non_tensor_batch reward components
    kinds: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return self.rewards.dtype

    def kwargs(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The keywords verl's trainer passes this estimator (ray_trainer.compute_advantage), as fresh
        tensors (verl writes into some of its arguments) in ``dtype`` (default: the case's)."""
        dt = dtype or self.dtype

        def cast(v: Any) -> Any:
            return v.clone().to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        kw: dict[str, Any] = {"token_level_rewards": cast(self.rewards), "response_mask": self.mask.clone()}
        if self.name != "gae":
            kw["index"] = self.index.copy()
        for key, value in self.extra.items():
            kw[key] = cast(value)
        if self.components is not None:
            B, T = self.mask.shape
            kw["non_tensor_batch"] = {"uid": self.index.copy(), **{k: v.copy() for k, v in self.components.items()}}
            kw["batch"] = {"prompts": torch.zeros(B, 2, dtype=torch.long),
                           "attention_mask": torch.cat([torch.ones(B, 2, dtype=torch.long), self.mask.long()], 1)}
        return kw


def _labels(draw, B: int, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    layout = draw(st.sampled_from(["singletons", "one_group", "uneven", "interleaved"]))
    if layout == "singletons":
        ids = np.arange(B)
    elif layout == "one_group":
        ids = np.zeros(B, dtype=np.int64)
    elif layout == "uneven":
        k = draw(st.integers(1, B))
        ids = np.sort(rng.integers(0, k, B))
    else:
        k = draw(st.integers(1, B))
        ids = rng.integers(0, k, B)
    kind = draw(st.sampled_from(["uid", "int", "numeric_str"]))
    if kind == "int":
        return (ids * 7919 + 3).astype(np.int64), f"{layout}/int"
    if kind == "uid":  # verl's non_tensor_batch["uid"]: uuid4 strings in an object array
        return np.array([f"{g:08x}-5f1c-4b7e-9a2d-{g * 31:012x}" for g in ids], dtype=object), f"{layout}/uid"
    # numeric-looking strings; "7" and "007" are two groups in verl's dict loops, one in as_torch_index
    return np.array([("00" if g % 2 else "") + str(g // 2) for g in ids], dtype=object), f"{layout}/numeric_str"


def _mask(draw, B: int, T: int, rng: np.random.Generator) -> tuple[torch.Tensor, str]:
    kind = draw(st.sampled_from(["full", "right_padded", "holes", "left_and_holes"]))
    if kind == "full":
        m = np.ones((B, T), dtype=np.int64)
    elif kind == "right_padded":
        lengths = rng.integers(0, T + 1, B)
        m = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    elif kind == "holes":
        m = (rng.random((B, T)) < 0.7).astype(np.int64)
    else:
        start = rng.integers(0, T, B)
        m = ((np.arange(T)[None, :] >= start[:, None]) & (rng.random((B, T)) < 0.75)).astype(np.int64)
    if draw(st.booleans()):
        m[rng.random(B) < 0.3] = 0  # empty responses
    if draw(st.integers(0, 3)) == 0:  # verl's response_mask is int64 (attention_mask); sometimes a float one
        return torch.from_numpy(m).to(torch.float32), kind + "/float32"
    return torch.from_numpy(m), kind


def _rewards(draw, m: torch.Tensor, rng: np.random.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    B, T = m.shape
    kind = draw(st.sampled_from(["outcome", "binary", "tied", "token", "token_everywhere"]))
    last = np.where(m.numpy().any(1), T - 1 - np.argmax(m.numpy()[:, ::-1], 1), T - 1)  # verl: index -1 if empty
    if kind in ("outcome", "binary", "tied"):
        if kind == "outcome":
            score = np.round(rng.normal(0, 2, B), 3)
        elif kind == "binary":
            score = rng.integers(0, 2, B).astype(np.float64)
        else:
            score = np.full(B, float(rng.choice([0.0, 1.0, 0.5, -2.0])))
        r = np.zeros((B, T))
        r[np.arange(B), last] = score
    elif kind == "token":
        r = np.round(rng.normal(0, 1, (B, T)), 3) * m.numpy()
    else:
        r = np.round(rng.normal(0, 1, (B, T)), 3)
    return torch.from_numpy(r).to(dtype), kind


def _component(draw, index: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One gdpo reward component [B] (float64, as a reward function returns it): scores from a few values,
    or near-ties: each group's rows at base + k * 1e-9 (k = 0, 1, 2), far below float32's spacing at
    these bases (e.g. acc = [0.1, 0.1 + 1e-9, ...] per group), so verl's float32 reading of the
    components ties the group: leaving that rounding out gives the group's rows about +-5e-4 instead of
    0 (a spread of 1e-9 against epsilon 1e-6), which moves the whitened advantages by about 3e-4."""
    B = len(index)
    if draw(st.sampled_from(["scores", "scores", "near_tie"])) == "scores":
        return np.round(rng.choice([0.0, 1.0, 0.5, rng.normal()], B), 3), "scores"
    labels = index.tolist()
    base = {lab: float(rng.choice([0.1, 0.7, 1 / 3, 1.0, np.round(rng.normal(), 3)])) for lab in labels}
    return np.array([base[lab] + 1e-9 * int(rng.integers(0, 3)) for lab in labels]), "near_tie"


@st.composite
def cases(draw, name: str) -> Case:
    B = draw(st.integers(1, 10))
    T = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    index, lkind = _labels(draw, B, rng)
    mask, mkind = _mask(draw, B, T, rng)
    rewards, rkind = _rewards(draw, mask, rng, dtype)
    case = Case(name, rewards, mask, index, kinds=f"{lkind} mask={mkind} rewards={rkind} {dtype}")
    if name == "gae":
        case.extra = {"values": torch.from_numpy(np.round(rng.normal(0, 1, (B, T)), 3)).to(dtype),
                      "gamma": draw(st.sampled_from([1.0, 0.99, 0.5])), "lam": draw(st.sampled_from([1.0, 0.95, 0.0]))}
    elif name == "grpo":  # the trainer's direct call
        case.extra = {"norm_adv_by_std_in_grpo": draw(st.booleans())}
    else:
        case.extra = {"config": AlgoConfig(gamma=draw(st.sampled_from([1.0, 0.99, 0.5, 0.0])),
                                           norm_adv_by_std_in_grpo=draw(st.booleans()))}
    if name in ("grpo_vectorized", "gdpo") and draw(st.booleans()):  # a direct call with the keyword
        case.extra["norm_adv_by_std_in_grpo"] = draw(st.booleans())
    if name == "remax":
        case.extra["reward_baselines"] = torch.from_numpy(np.round(rng.normal(0, 1, B), 3)).to(dtype)
    if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        pi = rng.uniform(0.01, 1.0, (B, T))
        case.extra["old_log_probs"] = torch.from_numpy(np.log(pi)).to(dtype)
        case.extra["sum_pi_squared"] = torch.from_numpy(pi**2 + rng.uniform(0, 1, (B, T)) * (1 - pi) ** 2).to(dtype)
        case.extra["rollout_is_weights"] = (torch.from_numpy(rng.uniform(0.2, 2.0, (B, T))).to(dtype)
                                            if draw(st.booleans()) else None)
    if name == "gdpo" and draw(st.booleans()):  # per-component rewards, as verl's trainer passes them
        keys = [f"k{i}_reward" for i in range(draw(st.integers(1, 3)))]
        drawn = {k: _component(draw, index, rng) for k in keys}
        case.components = {k: v for k, (v, _) in drawn.items()}
        case.kinds += " components=" + ",".join(kind for _, kind in drawn.values())
        weights = draw(st.sampled_from([None, "random"]))
        case.extra["config"] = AlgoConfig(
            gdpo_reward_keys=keys,
            gdpo_reward_weights=None if weights is None else [float(w) for w in np.round(rng.uniform(0.1, 2, len(keys)), 2)])
    return case


# ------------------------------------------------------------------------------------------ oracles
def _run(fn, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | Exception:
    try:
        with torch.no_grad():
            adv, ret = fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - verl raises ValueError/AssertionError/ZeroDivisionError
        return exc
    return adv, ret


def _finite(out: Any) -> bool:
    return not isinstance(out, Exception) and all(bool(torch.isfinite(t.double()).all()) for t in out)


def reference(case: Case, dtype: torch.dtype | None = None):
    """verl's registered function on the case (in ``dtype``): (advantages, returns), or the exception."""
    return _run(REGISTRY[case.name], case.kwargs(dtype))


def reference_f64(case: Case):
    """verl's answer computed in float64 (rule 2 of the module docstring)."""
    kw = case.kwargs(torch.float64)
    if case.name == "grpo_vectorized":  # group_mean_std is float32-only: verl's loop grpo is the same formula
        kw["index"] = as_torch_index(kw["index"]).numpy()
        kw = {k: v for k, v in kw.items() if k != "config"}
        return _run(CORE.compute_grpo_outcome_advantage, kw)
    return _run(REGISTRY[case.name], kw)


def last_bit(n: int, pattern: int) -> torch.Tensor:
    """[n] float64 factors moving each value by about its last bit: pattern 0 all by (1 + 3 u64) (ties stay
    ties), 1 and 2 by (1 +- 2 u64) alternating (opposite signs)."""
    if pattern == 0:
        return torch.full((n,), 1 + 3 * U64, dtype=torch.float64)
    return 1 + 2 * U64 * torch.tensor([(-1.0) ** (i + pattern) for i in range(n)], dtype=torch.float64)


def _gdpo_f64(token_level_rewards, response_mask, index, config, non_tensor_batch, batch,
              norm_adv_by_std_in_grpo=True, perturb: int | None = None, **_):
    """verl's gdpo body in float64, on the components and weights rounded to float32 as verl reads them
    (components moved by :func:`last_bit` ``perturb``, for the sensitivity of rule 1)."""
    keys = config.get("gdpo_reward_keys")
    weights = config.get("gdpo_reward_weights") or [1.0] * len(keys)
    total = None
    for key, w in zip(keys, weights):
        comp = torch.zeros(response_mask.shape, dtype=torch.float64)
        comp[:, -1] = torch.tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), dtype=torch.float64)
        if perturb is not None:
            comp[:, -1] *= last_bit(comp.shape[0], perturb)
        part, _ = CORE.compute_grpo_outcome_advantage(token_level_rewards=comp, response_mask=response_mask,
                                                      index=index, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        w = float(np.float32(w))
        total = w * part if total is None else total + w * part
    adv = verl_F.masked_whiten(total, response_mask) * response_mask
    return adv, adv


@contextlib.contextmanager
def _variance_zero_where_verl_raises():
    """verl's ``masked_var`` with the service's documented answer where it raises (fewer than two valid
    tokens: variance 0); the real ``masked_var`` everywhere else."""
    real = verl_F.masked_var

    def masked_var(values, mask, unbiased=True):
        if unbiased and mask.sum() <= 1:
            return torch.zeros((), dtype=values.dtype)
        return real(values, mask, unbiased)

    verl_F.masked_var = masked_var
    try:
        yield
    finally:
        verl_F.masked_var = real


def documented(case: Case, dtype: torch.dtype):
    """The service's documented finite answer where verl raises (rule 3), or None where none applies."""
    if case.name in WHITENED and int(case.mask.sum()) <= 1:
        with _variance_zero_where_verl_raises():
            return reference(case, dtype)  # (gdpo with components: gdpo_oracle)
    if case.name == "opo":  # a group whose rows are all empty: verl's 0/0; documented: b = mean, A = 0 there
        out = reference(case, dtype)
        if isinstance(out, Exception):
            return out
        labels = list(case.index)
        lengths = case.mask.sum(1).tolist()
        empty_group = torch.tensor([sum(n for x, n in zip(labels, lengths) if x == lab) == 0 for lab in labels])
        adv = out[0].clone()
        if not bool(torch.isfinite(adv[~empty_group]).all()):
            return None  # NaN elsewhere: no documented answer
        adv[empty_group] = 0.0
        return adv, adv
    if case.name == "grpo_passk":
        labels = list(case.index)
        single = np.array([labels.count(x) == 1 for x in labels])
        if not single.any():
            return None
        B, T = case.mask.shape
        adv = torch.zeros(B, T, dtype=dtype)
        keep = np.flatnonzero(~single)
        if keep.size:
            kw = case.kwargs(dtype)
            kw.update(token_level_rewards=kw["token_level_rewards"][keep], response_mask=kw["response_mask"][keep],
                      index=kw["index"][keep])
            out = _run(REGISTRY["grpo_passk"], kw)
            if isinstance(out, Exception):
                return out
            adv[keep] = out[0].to(dtype)
        return adv, adv
    return None


# ------------------------------------------------------------------------------------------ compare
def _close(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    rtol, atol = TOL[dtype]
    sel = mask.bool()
    g, w = got.double()[sel], want.double()[sel]
    if g.numel() == 0:
        return True, ""
    scale = max(1.0, float(w.abs().max()))
    bad = (g - w).abs() > rtol * w.abs() + atol * scale
    if not bool(bad.any()):
        return True, ""
    i = int(torch.nonzero(bad)[0])
    return False, f"{int(bad.sum())} of {g.numel()} masked positions differ, e.g. service {float(g[i])!r} vs {float(w[i])!r}"


def _pair_close(svc, ref, mask, dtype) -> tuple[bool, str]:
    for label, s, r in (("advantages", svc[0], ref[0]), ("returns", svc[1], ref[1])):
        ok, why = _close(s, r, mask, dtype)
        if not ok:
            return False, f"{label}: {why}"
    return True, ""


def gdpo_oracle(case: Case, perturb: int | None = None):
    """gdpo with components (rule 1): verl's float64 path (:func:`_gdpo_f64`), with the service's documented
    variance 0 where verl's ``masked_var`` raises (rule 3; the real ``masked_var`` everywhere else)."""
    with _variance_zero_where_verl_raises():
        return _run(functools.partial(_gdpo_f64, perturb=perturb), case.kwargs(torch.float64))


def check_gdpo_components(case: Case, svc, ref) -> str:
    """gdpo with reward components (rule 1). Whatever the batch's dtype, verl reads the components (and
    weights) as float32 and returns float32; the service computes in float64 from the same float32 values
    and rounds once to float32 (the components' dtype; the drop-in then gives it in token_level_rewards'
    dtype). So at each compared position (advantages; verl's returns are the same tensor)
        |service - y64| <= spacing32(y64) / 2 + 16 u64 max(1, max |y64|) + 16 s
    y64 the float64 oracle (:func:`gdpo_oracle`): the first term is the one rounding to float32 (round to
    nearest: at most half the float32 spacing at y64), the second the float64 arithmetic of the two
    computations (a few operations, each off by u64 relative to the whitened batch's scale), and s the
    oracle's own sensitivity to the last bit of its float64 inputs (the largest change of y64 when every
    component moves by :func:`last_bit`): large only where the answer is ill-conditioned (a group's
    spread below epsilon, a whitened batch whose variance is below verl's 1e-8)."""
    want = gdpo_oracle(case)
    assert _finite(want), f"gdpo: verl's float64 path gave {want!r} ({case.kinds})"
    sens = torch.stack([(gdpo_oracle(case, p)[0].double() - want[0].double()).abs() for p in range(3)]).amax(0)
    sel = case.mask.bool()
    for label, got, y in (("advantages", svc[0], want[0]), ("returns", svc[1], want[1])):
        g, w, sd = got.double()[sel].numpy(), y.double()[sel].numpy(), sens[sel].numpy()
        if not g.size:
            continue
        tol = np.spacing(np.abs(w).astype(np.float32)).astype(np.float64) / 2 \
            + 16 * U64 * max(1.0, float(np.abs(w).max())) + 16 * sd
        bad = np.abs(g - w) > tol
        if bad.any():
            _fail(case, f"{label} vs verl's float64 path (one rounding to float32): {int(bad.sum())} of {g.size} "
                        f"positions differ, e.g. service {g[bad][:3]} vs {w[bad][:3]} (tol {tol[bad][:3]})")
    if not _finite(ref):
        return "reference raised or non-finite: documented answer"
    agrees, _ = _pair_close(ref, want, case.mask, torch.float32)
    return "agree" if agrees else "float32 cancellation: matches verl in float64"


def _fail(case: Case, why: str) -> None:
    pytest.fail(f"{case.name}: service != verl 0.9.1: {why} ({case.kinds})\n"
                f"rewards={case.rewards.tolist()}\nmask={case.mask.tolist()}\nindex={case.index.tolist()}\n"
                f"extra={ {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in case.extra.items()} }\n"
                f"components={case.components}")


def check(case: Case, fn) -> str:
    """Compare one batch (module docstring rules); returns the rule that accepted it, or fails. The
    tolerance is the batch's dtype's (``TOL``): the service computes in float64 and rounds once to it."""
    svc = fn(**case.kwargs())
    assert all(bool(torch.isfinite(t.double()).all()) for t in svc), f"{case.name}: non-finite service output ({case.kinds})"
    assert svc[0].shape == case.mask.shape and svc[1].shape == case.mask.shape
    dtype = case.dtype
    ref = reference(case)
    if case.name == "gdpo" and case.components is not None:
        return check_gdpo_components(case, svc, ref)
    if not _finite(ref):
        want = documented(case, case.dtype)
        assert want is not None and _finite(want), (
            f"{case.name}: verl gave {ref!r} from finite input and no documented service answer applies ({case.kinds})")
        ok, why = _pair_close(svc, want, case.mask, dtype)
        assert ok, f"{case.name}: verl raised/NaN ({ref!r}); service differs from its documented answer: {why} ({case.kinds})"
        return "reference raised or non-finite: documented answer"
    if dtype == torch.float64 and case.name in F32_INTERNAL:
        # rule 1 for a float64 batch verl computes in float32: the oracle is verl's float64 path, at float64
        # tolerance; verl's float32 answer is checked against that oracle only to classify the batch
        ref64 = reference_f64(case)
        assert _finite(ref64), f"{case.name}: verl's float64 path gave {ref64!r} ({case.kinds})"
        ok, why = _pair_close(svc, ref64, case.mask, torch.float64)
        if not ok:
            _fail(case, f"vs verl's float64 path (float64 tolerance): {why}")
        agrees, _ = _pair_close(ref, ref64, case.mask, torch.float32)
        return "agree" if agrees else "float32 cancellation: matches verl in float64"
    ok, why = _pair_close(svc, ref, case.mask, dtype)
    if ok:
        return "agree"
    if dtype == torch.float32:  # verl computed in float32 (rule 2)
        ref64 = reference_f64(case)
        if _finite(ref64):
            lost, _ = _pair_close(ref, ref64, case.mask, torch.float32)
            matches, why64 = _pair_close(svc, ref64, case.mask, torch.float32)
            if not lost and matches:
                return "float32 cancellation: matches verl in float64"
            why += f"; float64 verl: reference {'lost the answer' if not lost else 'agrees with itself'}, service: {why64 or 'matches'}"
    _fail(case, why)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_service_matches_released_verl(name, server):
    assert name in dropin.ESTIMATORS, f"verl {verl_ref.version()} registers {name!r}; advantage_client.verl lacks it"
    fn = dropin.get_adv_estimator_fn(name, server.address)
    rules: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases(name))
    def run(case):
        rule = check(case, fn)
        rules[rule] = rules.get(rule, 0) + 1

    run()
    count_rules(f"verl/{name}", rules, EXAMPLES)


def test_dropin_covers_the_pinned_verl_registry():
    """Every name in the pinned verl's registry has a drop-in, and every drop-in name is verl's."""
    assert set(REGISTRY) - set(dropin.ESTIMATORS) == set(), \
        f"advantage_client.verl lacks {sorted(set(REGISTRY) - set(dropin.ESTIMATORS))}"
    assert set(dropin.ESTIMATORS) <= set(REGISTRY), sorted(set(dropin.ESTIMATORS) - set(REGISTRY))


def test_installed_verl_is_the_pinned_release():
    import pathlib
    release = REFERENCES["verl"].release
    assert verl_ref.version() == release
    reqs = (pathlib.Path(__file__).parent / "references" / "requirements.txt").read_text().splitlines()
    assert REFERENCES["verl"].pin in [line.strip() for line in reqs], f"requirements.txt must pin verl=={release}"


def test_reinforce_plus_plus_carries_the_return_across_holes(server):
    """The issue's example, verl 0.9.1 (PR #7300): returns [[1, 0, 1]]; in float64 the advantage is the
    whitening of the constant returns [1, 1] (about 5e-5 each: verl's mean divides by n + 1e-8)."""
    fn = dropin.get_adv_estimator_fn("reinforce_plus_plus", server.address)
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1]])
    adv, ret = fn(token_level_rewards=r, response_mask=m, config=AlgoConfig(gamma=1.0))
    assert ret.tolist() == [[1.0, 0.0, 1.0]]
    want_adv, want_ret = REGISTRY["reinforce_plus_plus"](token_level_rewards=r, response_mask=m, config=AlgoConfig(gamma=1.0))
    assert want_ret.tolist() == [[1.0, 0.0, 1.0]]
    torch.testing.assert_close(adv, want_adv, rtol=1e-12, atol=1e-15)
    assert float(adv.abs().max()) < 1e-4


def test_harness_stubs_nothing_that_computes_an_advantage():
    """Only the documented third-party modules are stubbed, and every function the advantage code calls
    is verl's released source (from the installed package, not a stub)."""
    import inspect
    import pathlib
    import sys

    import verl

    assert set(verl_ref.stubbed()) <= set(name.split(".")[0] for name in verl_ref.STUBS)
    root = pathlib.Path(verl.__file__).parent
    for fn in (CORE.compute_gae_advantage_return, verl_F.masked_whiten, verl_F.masked_var, verl_F.masked_mean,
               CORE.as_torch_index, CORE.group_mean_std, *REGISTRY.values()):
        assert pathlib.Path(inspect.getsourcefile(inspect.unwrap(fn))).is_relative_to(root), fn
    for stub in verl_ref.STUBS:  # none of this harness's stubs is left in sys.modules for other harnesses
        module = sys.modules.get(stub)
        assert module is None or "verl_ref.py" not in (module.__doc__ or ""), stub


def test_gdpo_dropin_raises_value_error_where_verl_asserts(server):
    """verl asserts that config.gdpo_reward_keys is set and that each key is in non_tensor_batch; the
    drop-in raises ValueError there (and computes nothing)."""
    fn = dropin.get_adv_estimator_fn("gdpo", server.address)
    kw = dict(token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3, dtype=torch.long),
              index=np.array(["a", "a"], dtype=object),
              batch={"prompts": torch.zeros(2, 1), "attention_mask": torch.ones(2, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        fn(**kw, config=AlgoConfig(), non_tensor_batch={"acc": np.zeros(2)})
    with pytest.raises(ValueError, match="'fmt' not found"):
        fn(**kw, config=AlgoConfig(gdpo_reward_keys=["acc", "fmt"]), non_tensor_batch={"acc": np.zeros(2)})
    with pytest.raises(AssertionError):  # what verl itself does
        REGISTRY["gdpo"](**kw, config=AlgoConfig(), non_tensor_batch={"acc": np.zeros(2)})
