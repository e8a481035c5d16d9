"""Differential tests: the released SkyRL (``skyrl==0.4.0``, tests/references/requirements.txt; imported in-process
by tests/references/skyrl_ref.py, which says how a Python 3.12 package runs here) against the service over gRPC
(the ``client`` fixture, ``semantics = "skyrl"``).

Every estimator of SkyRL's ``AdvantageEstimatorRegistry`` (``gae``, ``grpo``, ``rloo``, ``reinforce++``,
``maxrl``; the loop below is over the names the release registers), through the release's own
``compute_advantages_and_returns`` with the keywords SkyRL's trainer passes. Option families, at least 200
hypothesis batches each (``derandomize=True``): ``gae`` (gamma in {1, 0.99, 0.5}, lambd in {1, 0.95, 0}),
``grpo`` with ``grpo_norm_by_std`` true and false, ``rloo``, ``reinforce_plus_plus`` (gamma in {1, 0.99, 0.5,
0}), ``maxrl``. Batches: B in 1..10, T in 1..8; groups of one, one group, uneven and interleaved groups;
uids as strings (SkyRL's ``metadata["uids"]``), numeric-looking strings ("7" and "007" are two groups) and
integers; masks full, right-padded, with holes, left-and-holes, with all-zero rows (int64 or float32, as
SkyRL's trainer builds them); outcome, binary, tied, token-level rewards (also at masked positions, which
SkyRL's GAE and outcome sums read), negative means and groups tied at -epsilon (MaxRL's zero
denominator); values for GAE; float32 and float64. Compared: advantages and returns ``[B, T]`` at EVERY
position (SkyRL's GAE and REINFORCE++ returns and GAE's whitened advantages are not masked; the service
computes them the same way), and the service's output must be finite everywhere.

The rule, per batch (``check``):

1. Agreement: ``|service - skyrl| <= rtol |skyrl| + atol max(1, max |skyrl|)`` at the batch dtype's
   tolerance: float64 1e-9 / 1e-9, float32 2e-4 / 2e-5 (the service computes in float64 and rounds once).
2. Float32 cancellation: for a float32 batch SkyRL computes in float32. Where it disagrees, SkyRL is run on
   the batch cast to float64; the service must agree with that run (float32 tolerance), and SkyRL's float32
   answer must itself differ from it (the release lost the answer).
3. Documented answers (README, "Where the service and the pinned releases differ"), where SkyRL raises or
   gives NaN/inf from finite input, or divides rounding noise by about zero:
   * ``gae`` and ``reinforce_plus_plus`` with fewer than two valid tokens in the batch: SkyRL's
     ``masked_var`` raises; the service takes the variance as 0. Oracle: SkyRL's own function with
     ``masked_var`` returning 0 exactly there (the real one everywhere else).
   * ``maxrl``, a group whose rewards are all equal: 0 (SkyRL: 0/0 = NaN at mean = -epsilon, and where its
     float mean misses a tied value by an ulp with mean + epsilon of that size, noise / noise); a group whose
     mean + epsilon is exactly 0: 0 (SkyRL: +-inf). Oracle: SkyRL's output with those groups' rows set to 0.
Any other disagreement fails. The counts per family and per rule print in the terminal summary
(tests/conftest.py, tests/references/counts.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_client.references import REFERENCES
from references import skyrl_ref
from references.counts import count_rules

PPO = skyrl_ref.load()
EXAMPLES = 200
TOL = {torch.float32: (2e-4, 2e-5), torch.float64: (1e-9, 1e-9)}
EPS = 1e-6  # SkyRL's epsilon (compute_grpo_outcome_advantage / compute_maxrl_advantage defaults; never set)
#: (family id, service estimator, SkyRL keywords fixed for the family)
FAMILIES = [
    ("gae", "gae", {}),
    ("grpo", "grpo", {"grpo_norm_by_std": True}),
    ("grpo (grpo_norm_by_std=false)", "grpo", {"grpo_norm_by_std": False}),
    ("rloo", "rloo", {}),
    ("reinforce_plus_plus", "reinforce_plus_plus", {}),
    ("maxrl", "maxrl", {}),
]
WHITENED = {"gae", "reinforce_plus_plus"}  # SkyRL masked_whiten


@dataclass
class Case:
    name: str                     # the service's estimator
    rewards: torch.Tensor         # [B, T] token_level_rewards
    mask: torch.Tensor            # [B, T] response_mask (int64 or float32 0/1)
    index: list                   # [B] uids
    kw: dict[str, Any] = field(default_factory=dict)   # grpo_norm_by_std, gamma, lambd
    values: torch.Tensor | None = None
    kinds: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return self.rewards.dtype


def _labels(draw, B: int, rng: np.random.Generator) -> tuple[list, str]:
    layout = draw(st.sampled_from(["singletons", "one_group", "uneven", "interleaved"]))
    if layout == "singletons":
        ids = np.arange(B)
    elif layout == "one_group":
        ids = np.zeros(B, dtype=np.int64)
    elif layout == "uneven":
        ids = np.sort(rng.integers(0, draw(st.integers(1, B)), B))
    else:
        ids = rng.integers(0, draw(st.integers(1, B)), B)
    kind = draw(st.sampled_from(["uid", "int", "numeric_str"]))
    if kind == "int":
        return [int(g) * 7919 + 3 for g in ids], f"{layout}/int"
    if kind == "uid":  # SkyRL's metadata["uids"]: uuid strings
        return [f"{g:08x}-5f1c-4b7e-9a2d-{g * 31:012x}" for g in ids], f"{layout}/uid"
    return [("00" if g % 2 else "") + str(g // 2) for g in ids], f"{layout}/numeric_str"


def _mask(draw, B: int, T: int, rng: np.random.Generator) -> tuple[torch.Tensor, str]:
    kind = draw(st.sampled_from(["full", "right_padded", "holes", "left_and_holes"]))
    if kind == "full":
        m = np.ones((B, T), dtype=np.int64)
    elif kind == "right_padded":
        m = (np.arange(T)[None, :] < rng.integers(0, T + 1, B)[:, None]).astype(np.int64)
    elif kind == "holes":
        m = (rng.random((B, T)) < 0.7).astype(np.int64)
    else:
        start = rng.integers(0, T, B)
        m = ((np.arange(T)[None, :] >= start[:, None]) & (rng.random((B, T)) < 0.75)).astype(np.int64)
    if draw(st.booleans()):
        m[rng.random(B) < 0.3] = 0  # empty responses
    if draw(st.integers(0, 3)) == 0:
        return torch.from_numpy(m).to(torch.float32), kind + "/float32"
    return torch.from_numpy(m), kind


def _rewards(draw, name: str, index: list, m: torch.Tensor, rng: np.random.Generator,
             dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    B, T = m.shape
    kinds = ["outcome", "binary", "tied", "token", "token_everywhere"]
    if name == "maxrl":
        kinds += ["binary", "negative", "tied_minus_eps", "group_tied"]
    kind = draw(st.sampled_from(kinds))
    mk = m.numpy()
    last = np.where(mk.any(1), T - 1 - np.argmax(mk[:, ::-1], 1), T - 1)
    if kind in ("token", "token_everywhere"):
        r = np.round(rng.normal(0, 1, (B, T)), 3)
        return torch.from_numpy(r * mk if kind == "token" else r).to(dtype), kind
    if kind == "outcome":
        score = np.round(rng.normal(0, 2, B), 3)
    elif kind == "binary":
        score = rng.integers(0, 2, B).astype(np.float64)
    elif kind == "tied":
        score = np.full(B, float(rng.choice([0.0, 1.0, 0.5, -2.0, 0.1])))
    elif kind == "negative":  # negative group means: MaxRL's (mean + eps) flips the signs
        score = np.round(rng.normal(-1.0, 1.0, B), 3)
    elif kind == "tied_minus_eps":  # every reward -eps: mean + eps = 0 (SkyRL: 0 / 0)
        score = np.full(B, -EPS)
    else:  # group_tied: each group tied on its own value (0.1, 1/3: non-dyadic)
        values = {lab: float(rng.choice([0.0, 1.0, 0.1, 1 / 3, -EPS, 2.0])) for lab in index}
        score = np.array([values[lab] for lab in index])
    r = np.zeros((B, T))
    r[np.arange(B), last] = score
    return torch.from_numpy(r).to(dtype), kind


@st.composite
def cases(draw, name: str, fixed: dict[str, Any]) -> Case:
    B = draw(st.integers(1, 10))
    T = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    index, lkind = _labels(draw, B, rng)
    mask, mkind = _mask(draw, B, T, rng)
    rewards, rkind = _rewards(draw, name, index, mask, rng, dtype)
    case = Case(name, rewards, mask, index, dict(fixed), kinds=f"{lkind} mask={mkind} rewards={rkind} {dtype}")
    if name == "gae":
        case.values = torch.from_numpy(np.round(rng.normal(0, 1, (B, T)), 3)).to(dtype)
        case.kw.update(gamma=draw(st.sampled_from([1.0, 0.99, 0.5])), lambd=draw(st.sampled_from([1.0, 0.95, 0.0])))
    elif name == "reinforce_plus_plus":
        case.kw["gamma"] = draw(st.sampled_from([1.0, 0.99, 0.5, 0.0]))
    return case


# ------------------------------------------------------------------------------------------ the two sides
def skyrl(case: Case, dtype: torch.dtype | None = None):
    """SkyRL's ``compute_advantages_and_returns`` on the case (cast to ``dtype``): (adv, ret) or the exception."""
    dt = dtype or case.dtype
    try:
        return skyrl_ref.compute(case.name, case.rewards.to(dt), case.mask, case.index,
                                 values=None if case.values is None else case.values.to(dt), **case.kw)
    except Exception as exc:  # noqa: BLE001 - masked_var raises ValueError
        return exc


def service(client, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The service's answer (returns: SkyRL's, i.e. the advantages again, where the service has none)."""
    config: dict[str, Any] = {"semantics": "skyrl"}
    tensors: dict[str, Any] = {"rewards": case.rewards.numpy(), "mask": case.mask.numpy()}
    if case.name != "gae" and case.name != "reinforce_plus_plus":
        tensors["prompt_ids"] = np.array(case.index, dtype=object)
    if case.name == "gae":
        config.update(gae_gamma=case.kw["gamma"], gae_lambda=case.kw["lambd"])
        tensors["values"] = case.values.numpy()
    elif case.name == "reinforce_plus_plus":
        config["gamma"] = case.kw["gamma"]
    elif case.name == "grpo":
        config["normalize_rewards"] = case.kw["grpo_norm_by_std"]
    out = client.compute(case.name, config, output_dtype="float64" if case.dtype == torch.float64 else "float32",
                         as_numpy=True, **tensors)
    adv = torch.from_numpy(np.asarray(out.advantages, dtype=np.float64))
    ret = adv if out.returns is None else torch.from_numpy(np.asarray(out.returns, dtype=np.float64))
    return adv, ret


def _finite(out: Any) -> bool:
    return not isinstance(out, Exception) and all(bool(torch.isfinite(t.double()).all()) for t in out)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    rtol, atol = TOL[dtype]
    g, w = got.double().flatten(), want.double().flatten()
    if g.numel() == 0:
        return True, ""
    scale = max(1.0, float(w.abs().max()))
    bad = ~((g - w).abs() <= rtol * w.abs() + atol * scale)  # NaN in want counts as a difference
    if not bool(bad.any()):
        return True, ""
    i = int(torch.nonzero(bad)[0])
    return False, f"{int(bad.sum())} of {g.numel()} positions differ, e.g. service {float(g[i])!r} vs {float(w[i])!r}"


def _pair_close(svc, ref, dtype) -> tuple[bool, str]:
    for label, s, r in (("advantages", svc[0], ref[0]), ("returns", svc[1], ref[1])):
        ok, why = _close(s, r, dtype)
        if not ok:
            return False, f"{label}: {why}"
    return True, ""


def _variance_zero_where_skyrl_raises():
    """SkyRL's ``masked_var`` patched with the service's documented answer where it raises (fewer than two
    valid tokens: variance 0); the real ``masked_var`` everywhere else."""
    real = PPO.masked_var
    return mock.patch.object(PPO, "masked_var", lambda values, mask, unbiased=True: (
        torch.zeros((), dtype=values.dtype) if unbiased and mask.sum() <= 1 else real(values, mask, unbiased)))


def maxrl_special_rows(case: Case, dtype: torch.dtype) -> torch.Tensor:
    """[B] bool: rows of a group (of two or more) whose summed rewards are all equal, or whose mean + eps is
    exactly 0 as SkyRL computes it in ``dtype`` (``torch.mean`` of the group's scores, plus ``EPS``)."""
    scores = case.rewards.to(dtype).sum(-1)
    out = torch.zeros(len(case.index), dtype=torch.bool)
    for lab in set(case.index):
        rows = [i for i, x in enumerate(case.index) if x == lab]
        if len(rows) < 2:
            continue
        vals = scores[rows]
        if bool((vals == vals[0]).all()) or float(torch.mean(vals) + EPS) == 0.0:
            out[rows] = True
    return out


def documented(case: Case, dtype: torch.dtype):
    """The service's documented answer (rule 3) computed in ``dtype``, or None where none applies."""
    if case.name in WHITENED and float(case.mask.sum()) <= 1:
        with _variance_zero_where_skyrl_raises():
            return skyrl(case, dtype)
    if case.name == "maxrl":
        special = maxrl_special_rows(case, dtype)
        if not bool(special.any()):
            return None
        out = skyrl(case, dtype)
        if isinstance(out, Exception):
            return None
        adv = out[0].clone()
        adv[special] = 0.0
        return adv, adv
    return None


def _fail(case: Case, why: str) -> None:
    pytest.fail(f"{case.name} {case.kw}: service != SkyRL {skyrl_ref.version()}: {why} ({case.kinds})\n"
                f"rewards={case.rewards.tolist()}\nmask={case.mask.tolist()}\nindex={case.index}\n"
                f"values={None if case.values is None else case.values.tolist()}")


def check(client, case: Case) -> str:
    """Compare one batch (module docstring rules); returns the rule that settled it, or fails."""
    svc = service(client, case)
    assert all(bool(torch.isfinite(t).all()) for t in svc), f"{case.name}: non-finite service output ({case.kinds})"
    assert svc[0].shape == case.mask.shape and svc[1].shape == case.mask.shape
    dtype = case.dtype
    ref = skyrl(case)
    why = f"SkyRL gave {ref!r}" if isinstance(ref, Exception) else "SkyRL not finite"
    if _finite(ref):
        ok, why = _pair_close(svc, ref, dtype)
        if ok:
            return "agree"
    if dtype == torch.float32:  # rule 2: SkyRL computed in float32
        ref64 = skyrl(case, torch.float64)
        if _finite(ref64):
            matches, why64 = _pair_close(svc, ref64, torch.float32)
            lost = not _finite(ref) or not _pair_close(ref, ref64, torch.float32)[0]
            if matches and lost:
                return "float32 cancellation: matches SkyRL in float64"
            why += f"; SkyRL in float64: service {why64 or 'matches'}, float32 SkyRL {'lost' if lost else 'kept'} the answer"
    for dt in ((dtype,) if dtype == torch.float64 else (torch.float32, torch.float64)):
        want = documented(case, dt)
        if want is not None and _finite(want) and _pair_close(svc, want, dtype)[0]:
            return "SkyRL raised, non-finite or noise / 0: documented answer"
    _fail(case, why)


# ------------------------------------------------------------------------------------------ tests
def test_every_released_estimator_is_tested():
    """The families cover exactly the estimators SkyRL 0.4.0 registers."""
    registered = set(PPO.AdvantageEstimatorRegistry._functions)
    assert registered == set(skyrl_ref.ESTIMATORS.values()), registered
    assert {svc for _, svc, _ in FAMILIES} == set(skyrl_ref.ESTIMATORS)


@pytest.mark.parametrize("family,name,fixed", FAMILIES, ids=[f for f, _, _ in FAMILIES])
def test_service_matches_released_skyrl(family, name, fixed, client):
    rules: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(name, fixed))
    def run(case):
        rule = check(client, case)
        rules[rule] = rules.get(rule, 0) + 1

    run()
    count_rules(f"skyrl/{family}", rules, EXAMPLES)


def test_installed_skyrl_is_the_pinned_release():
    import pathlib
    ref = REFERENCES["skyrl"]
    assert skyrl_ref.version() == ref.release
    assert PPO.__file__.endswith(ref.code)
    reqs = (pathlib.Path(__file__).parent / "references" / "requirements.txt").read_text().splitlines()
    assert ref.pin in [line.strip() for line in reqs], f"requirements.txt must pin {ref.pin}"


def test_harness_stubs_nothing_that_computes_an_advantage():
    """Only the documented modules are stood in for, and every function the advantage code calls is SkyRL's
    released source (the installed files, not a stub)."""
    import inspect
    import pathlib
    import sys

    root = pathlib.Path(PPO.__file__).parents[3]  # .../site-packages/skyrl
    assert set(skyrl_ref.stubbed()) <= {"skyrl", "ray", "jaxtyping", "loguru"}
    for fn in (PPO.compute_advantages_and_returns, PPO.masked_whiten, PPO.masked_var, PPO.masked_mean,
               *PPO.AdvantageEstimatorRegistry._functions.values()):
        assert pathlib.Path(inspect.getsourcefile(inspect.unwrap(fn))).is_relative_to(root), fn
    for name in list(skyrl_ref.STUBS) + list(skyrl_ref.PACKAGES):  # nothing left behind for other harnesses
        module = sys.modules.get(name)
        assert module is None or "skyrl_ref.py" not in (module.__doc__ or ""), name


def test_known_values(client):
    """Hand-checked: SkyRL's rules the service reproduces. Two prompts "a" (rewards 1, 0) and "b" (a group of
    one, reward 0.5), masks with a hole: GRPO gives +-0.5 / (sqrt(0.5) + eps) and b's 0.5 / (1 + eps);
    RLOO gives +-1 and 0 for the group of one; MaxRL gives (1 - 0.5) / (0.5 + eps), its negative, and b's
    raw 0.5."""
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.5, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 0]])
    index = ["a", "a", "b"]
    case = Case("maxrl", r, m, index)
    adv, _ = service(client, case)
    want = torch.tensor([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.5], dtype=torch.float64)[:, None] * m
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(skyrl(case)[0], want, rtol=1e-12, atol=0)
    adv, _ = service(client, Case("rloo", r, m, index))
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)[:, None] * m)
    adv, _ = service(client, Case("grpo", r, m, index, {"grpo_norm_by_std": True}))
    s = 0.5 / (2 ** -0.5 + EPS)  # (1 - 0.5) / (sample std sqrt(0.5) + eps)
    b = 0.5 / float(torch.tensor(1.0) + EPS)  # SkyRL's std of a group of one: torch.tensor(1.0) (float32) + eps
    torch.testing.assert_close(adv, torch.tensor([s, -s, b], dtype=torch.float64)[:, None] * m, rtol=1e-12, atol=0)


def test_maxrl_zero_denominators_are_finite(client):
    """MaxRL's documented answers where SkyRL divides by zero: a group tied at -eps (SkyRL: NaN) and an untied
    group whose mean + eps is exactly 0 (rewards -2e-6 and 0: SkyRL +-inf) give 0; the other group is SkyRL's."""
    r = torch.tensor([-EPS, -EPS, -2 * EPS, 0.0, 1.0, 0.0], dtype=torch.float64)[:, None]
    m = torch.ones(6, 1, dtype=torch.int64)
    case = Case("maxrl", r, m, ["t", "t", "z", "z", "ok", "ok"])
    ref = skyrl(case)[0][:, 0]
    assert torch.isnan(ref[:2]).all() and torch.isinf(ref[2:4]).all()  # what the release gives
    adv, _ = service(client, case)
    torch.testing.assert_close(adv[:, 0], torch.cat([torch.zeros(4, dtype=torch.float64), ref[4:]]), rtol=1e-12, atol=0)


def test_skyrl_gae_ignores_the_mask(client):
    """SkyRL's GAE recursion runs over every position: a value at a hole reaches the valid position before it
    (gamma = lambda = 0.5), unlike verl's carry-forward recursion; the masked positions are not zeroed."""
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1]])
    values = torch.tensor([[0.0, 4.0, 0.0]], dtype=torch.float64)
    case = Case("gae", r, m, ["a"], {"gamma": 0.5, "lambd": 0.5}, values=values)
    adv, ret = service(client, case)
    want_adv, want_ret = skyrl(case)
    torch.testing.assert_close(adv, want_adv.double(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, want_ret.double(), rtol=1e-12, atol=1e-12)
    # by hand: delta = [0 + 0.5*4 - 0, 0 + 0.5*0 - 4, 1] = [2, -4, 1]; A = [2 + 0.25*(-3.75), -4 + 0.25*1, 1]
    # = [1.0625, -3.75, 1]; returns = A + V
    torch.testing.assert_close(ret, torch.tensor([[1.0625, 0.25, 1.0]], dtype=torch.float64))
    verl = client.compute("gae", {"semantics": "verl", "gae_gamma": 0.5, "gae_lambda": 0.5}, rewards=r.numpy(),
                          mask=m.numpy(), values=values.numpy(), output_dtype="float64", as_numpy=True)
    assert not np.allclose(verl.returns, ret.numpy())  # the carry-forward recursion skips the hole's value


def test_skyrl_gae_bootstrap_values_is_the_value_after_the_last_column(client):
    """SkyRL has no bootstrap (V after column T is 0); the service's optional bootstrap_values stands there:
    gamma = lambda = 1, rewards 0, values 0, bootstrap 2 gives returns 2 at every column (the mask, with
    padding, does not cut it), and without it SkyRL's 0."""
    kw = dict(rewards=np.zeros((1, 3)), mask=np.array([[1, 1, 0]]), values=np.zeros((1, 3)), output_dtype="float64",
              as_numpy=True)
    cfg = {"semantics": "skyrl", "normalize_advantages": False}
    np.testing.assert_array_equal(client.compute("gae", cfg, bootstrap_values=np.array([2.0]), **kw).returns, [[2.0] * 3])
    np.testing.assert_array_equal(client.compute("gae", cfg, **kw).returns, [[0.0] * 3])


def test_lm_demo_accepts_maxrl(client):
    """``advantage-demo lm --estimator maxrl``: the demo's config check accepts it, and one group's call gives
    MaxRL's advantages (rewards 1, 0, 0, 0: mean 0.25, so (1 - 0.25) / (0.25 + eps) and -1 / (1 + 4 eps))."""
    from advantage_server.demo import lm
    from test_demo_lm import MASK, make_group

    lm.check_config(lm.LMConfig(estimator="maxrl"))
    group = make_group([1.0, 0.0, 0.0, 0.0], MASK)
    adv = lm.advantages_for_group(client, "maxrl", lm.estimator_config(lm.LMConfig(estimator="maxrl")), group)
    want = np.array([0.75 / (0.25 + EPS), -0.25 / (0.25 + EPS), -0.25 / (0.25 + EPS), -0.25 / (0.25 + EPS)])
    np.testing.assert_allclose(adv, want[:, None] * group.mask.numpy(), rtol=1e-6)


def test_maxrl_kernel_matches_its_loop_twin():
    """maxrl_scalars (vectorised) equals its per-group loop twin on groups of one, tied groups, zero
    denominators, negative and zero means."""
    from advantage_server.estimators.maxrl import maxrl_scalars, maxrl_scalars_loop
    group = torch.tensor([0, 0, 1, 2, 2, 3, 3, 3, 4, 4])
    scores = torch.tensor([1.0, 0.0, 0.7, -EPS, -EPS, -3.0, -1.0, 0.5, 1.0, -1.0], dtype=torch.float64)
    got = maxrl_scalars(group, scores, EPS)
    torch.testing.assert_close(got, maxrl_scalars_loop(group, scores, EPS), rtol=1e-15, atol=0)
    assert got[2] == 0.7 and got[3] == got[4] == 0.0 and got[8] == 1.0 / EPS  # one; tied at -eps; mean 0
