"""Differential tests: the service (over gRPC, ``semantics = "openrlhf"``) against the released OpenRLHF
(``tests/references/requirements.txt`` pins it; ``tests/references/openrlhf_ref.py`` runs its
``RemoteExperienceMaker.compute_advantages_and_returns`` in-process).

Every ``--algo.advantage.estimator`` value the service claims to reproduce, at least 200 hypothesis batches
each (``derandomize=True``): ``reinforce`` (reinforce_plus_plus), ``rloo`` (rloo), ``reinforce_baseline``
(reinforce_plus_plus_baseline), ``group_norm`` and ``dr_grpo`` (grpo with normalize_rewards true/false). What
OpenRLHF's API can express is generated: prompt groups are contiguous blocks of ``n_samples_per_prompt`` in
rollout order (n = 1 included; uneven group sizes cannot be expressed, OpenRLHF reshapes the rewards to [-1,
n]), the experiences hold the samples in any order (``Experience.index``, OpenRLHF's dynamic-batching reorder:
interleaved groups) split into micro-batches of any sizes; prompt ids as integers or uid strings; [B] rewards
(binary, tied, integer, real, beyond the +-10 reward clip); action masks with holes and all-zero rows; the
per-token KL of ``compute_approx_kl`` (k1/k2/k3) from log-probs where the estimator folds KL into the reward;
gamma for ``reinforce``; float32 and float64.
(``flash_reinforce`` is not offered by the service; OpenRLHF has no token-level rewards.)

Compared, at the mask = 1 positions: advantages and returns.

The rule (the same for every batch):
    * y64: the released code on the batch promoted to float64, with its own float32 casts kept in float64
      (``precise=True``): the reference run in float64. The service computes in float64 and rounds once
      to the batch's dtype, so its answer must equal y64 at every compared position to
          spacing(y64) / 2 + 16 u64 |y64|max + 16 s
      spacing(y64) the gap between the batch dtype's numbers at y64 (round to nearest is off by at most
      half of it, about u |y64|, u the batch dtype's unit roundoff: per position, not relative to the
      batch's largest value), u64 |y64|max the float64 arithmetic of the two computations (a few roundings
      each, relative to the batch's scale, |y64|max over the compared positions, for ``gae`` at least the
      largest |value|, which both computations add and subtract: OpenRLHF's A + V loses a reward of 3e-21
      beside a value of 1; 16 is a margin over that count), and s, per position, the largest change of y64 when every float64 input moves by about its
      last bit (all by (1 + 3 u64), or alternately by (1 +- 2 u64)): the reference's own sensitivity to
      its inputs' last bit, large only where the answer is ill-conditioned (near-ties, returns that are
      small differences of large terms). The released code in the batch's dtype is not the comparison
      target (its float32 arithmetic, ``.float()`` in the whitening and in ``compute_approx_kl``, is off by
      about u32 times its intermediates' size, more than this rule allows the service): it is run only
      to count the batches where it lost the answer (differs from y64 by more than 1e-5 of the batch's
      scale; the count is asserted > 0 for the whitened estimators); where it does not, the service
      agrees with the released code to that accuracy.
    * Where y64 is not finite from finite inputs, the batch must be one of the documented cases and the
      service must give the documented finite answer: n = 1 with ``rloo`` (OpenRLHF divides 0 by 0; the
      service's baseline is 0: the released ``reinforce`` returns of the same batch), n = 1 with
      ``group_norm`` (std of one sample is NaN; the service gives 0: the released ``dr_grpo`` of the same
      batch), and ``reinforce`` / ``reinforce_baseline`` with every mask 0 (the whitening divides 0 by 0;
      the service's mean and variance are 0: advantages = returns * 1e4 = 0).
Any other disagreement fails.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from references import openrlhf_ref
from references.counts import TRIED

# OpenRLHF's group_norm with one sample per prompt takes torch.std of one value (a documented case below)
pytestmark = pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom:UserWarning")

N_EXAMPLES = 200
SETTINGS = settings(max_examples=N_EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

#: OpenRLHF estimator -> (service estimator, fixed config)
SERVICE = {
    "gae": ("gae", {}),
    "reinforce": ("reinforce_plus_plus", {}),
    "rloo": ("rloo", {}),
    "reinforce_baseline": ("reinforce_plus_plus_baseline", {}),
    "group_norm": ("grpo", {"normalize_rewards": True}),
    "dr_grpo": ("grpo", {"normalize_rewards": False}),
}
KL_ESTIMATORS = tuple(SERVICE)  # the service folds KL in for every one (OpenRLHF's compute_reward)
WHITENED = ("gae", "reinforce", "reinforce_baseline")  # OpenRLHF's batch whitening (no_std_norm: the mean only)
#: --reward.clip_range values drawn: the default, narrower, wider, and lopsided
CLIP_RANGES = ((-10.0, 10.0), (-10.0, 10.0), (-2.5, 2.5), (-20.0, 20.0), (-1.0, 4.0))
U64 = float(np.finfo(np.float64).eps) / 2
FLOAT32_LOST: dict[str, int] = {}


@st.composite
def batches(draw, estimator: str):
    n = draw(st.integers(1, 5))
    groups = draw(st.integers(1, 4))
    B = n * groups
    T = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    kind = draw(st.sampled_from(["binary", "tied", "integer", "real", "large", "near_tie"]))
    if kind == "binary":
        r = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=B, max_size=B))
    elif kind == "tied":
        r = [draw(st.floats(-5, 5, allow_nan=False, width=32))] * B
    elif kind == "integer":
        r = draw(st.lists(st.integers(-3, 3).map(float), min_size=B, max_size=B))
    elif kind == "large":
        r = draw(st.lists(st.floats(-40, 40, allow_nan=False, width=32), min_size=B, max_size=B))
    elif kind == "near_tie":
        base = draw(st.floats(-100, 100, allow_nan=False, width=32))
        r = [base + k * 1e-5 for k in draw(st.lists(st.integers(-2, 2), min_size=B, max_size=B))]
    else:
        r = draw(st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=B, max_size=B))
    mask_kind = draw(st.sampled_from(["holes"] * 3 + ["right_padded"] * 2 + ["with_empty"] * 2 + ["all_empty", "full"]))
    if mask_kind == "full":
        mask = np.ones((B, T), dtype=np.int64)
    elif mask_kind == "all_empty":
        mask = np.zeros((B, T), dtype=np.int64)
    elif mask_kind == "right_padded":
        lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
        mask = (np.arange(T)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    else:
        mask = np.array(draw(st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T),
                                      min_size=B, max_size=B)), dtype=np.int64)
        if mask_kind == "with_empty":
            mask[draw(st.integers(0, B - 1))] = 0
    order = draw(st.permutations(list(range(B)))) if draw(st.booleans()) else list(range(B))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(B - 1, 1)), max_size=3)))) if B > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, B])]
    case = dict(n=n, B=B, T=T, dtype=dtype, kind=kind, mask_kind=mask_kind,
                rewards=torch.tensor(r, dtype=dtype)[torch.tensor(order)], mask=torch.from_numpy(mask),
                index=list(order), sizes=sizes, kl=None, gamma=1.0, uid_strings=draw(st.booleans()))
    if estimator in KL_ESTIMATORS and draw(st.booleans()):
        lp = draw(st.lists(st.floats(-12, 0, allow_nan=False, width=32), min_size=2 * B * T, max_size=2 * B * T))
        lp = torch.tensor(lp, dtype=dtype).reshape(2, B, T)
        case["kl"] = dict(logprobs=lp[0], reference_logprobs=lp[1],
                          estimator=draw(st.sampled_from(["k1", "k2", "k3"])),
                          coef=draw(st.sampled_from([0.01, 0.1, 1.0])))
    if estimator in ("reinforce", "gae"):
        case["gamma"] = draw(st.sampled_from([1.0, 0.99, 0.5, 0.0]))
    case["clip_range"] = draw(st.sampled_from(CLIP_RANGES))
    case["no_std_norm"] = estimator in WHITENED and draw(st.booleans())
    case["values"], case["lambd"] = None, 1.0
    if estimator == "gae":
        v = draw(st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=B * T, max_size=B * T))
        case["values"] = torch.tensor(v, dtype=dtype).reshape(B, T)
        case["lambd"] = draw(st.sampled_from([1.0, 0.95, 0.5, 0.0]))
    return case


def last_bit(shape, pattern: int) -> torch.Tensor:
    """float64 factors that move each input by about its last bit: pattern 0 all by (1 + 3 u64) (ties stay
    ties), 1 and 2 by (1 +- 2 u64) alternating along the flattened inputs (opposite signs)."""
    n = int(np.prod(shape))
    if pattern == 0:
        return torch.full(shape, 1 + 3 * U64, dtype=torch.float64)
    sign = torch.tensor([(-1.0) ** (i + pattern) for i in range(n)], dtype=torch.float64).reshape(shape)
    return 1 + 2 * U64 * sign


def reference(estimator: str, case: dict, precise: bool, perturb: int | None = None, name: str | None = None):
    """The released code on ``case`` (float64 inputs moved by :func:`last_bit` ``perturb`` when precise)."""
    rewards, kl, coef, values = case["rewards"], None, 0.0, case["values"]
    if precise:
        rewards = rewards.to(torch.float64)
        values = None if values is None else values.to(torch.float64)
        if perturb is not None:
            rewards = rewards * last_bit(rewards.shape, perturb)
            values = None if values is None else values * last_bit(values.shape, 2 - perturb if perturb else 0)
    if case["kl"] is not None:
        lp, ref = case["kl"]["logprobs"], case["kl"]["reference_logprobs"]
        if precise:
            lp, ref = lp.to(torch.float64), ref.to(torch.float64)
            if perturb is not None:
                lp, ref = lp * last_bit(lp.shape, perturb), ref * last_bit(ref.shape, 3 - perturb if perturb else 0)
        kl = openrlhf_ref.approx_kl(lp, ref, case["kl"]["estimator"], precise=precise)
        coef = case["kl"]["coef"]
    return openrlhf_ref.compute(name or estimator, rewards, case["mask"], case["n"], case["index"], case["sizes"],
                                kl=kl, kl_coef=coef, gamma=case["gamma"], clip_range=case["clip_range"],
                                no_std_norm=case["no_std_norm"], values=values, lambd=case["lambd"],
                                precise=precise)


def service(client, estimator: str, case: dict):
    name, fixed = SERVICE[estimator]
    config = {"semantics": "openrlhf", **fixed}
    groups = np.array(case["index"], dtype=np.int64) // case["n"]
    prompt_ids = [f"uid-{g}" for g in groups] if case["uid_strings"] else groups
    tensors = dict(rewards=case["rewards"].numpy(), mask=case["mask"].numpy(), prompt_ids=prompt_ids)
    config.update(reward_clip_min=case["clip_range"][0], reward_clip_max=case["clip_range"][1])
    if estimator in WHITENED:
        config["no_std_norm"] = case["no_std_norm"]
    if estimator == "reinforce":
        config["gamma"] = case["gamma"]
    if estimator == "gae":  # no prompt groups: the critic's values, gamma and lambda
        del tensors["prompt_ids"]
        tensors["values"] = case["values"].numpy()
        config.update(gae_gamma=case["gamma"], gae_lambda=case["lambd"])
    if case["kl"] is not None:
        config.update(use_kl_in_reward=True, reference_policy_kl_penalty=case["kl"]["coef"],
                      reference_policy_kl_type=case["kl"]["estimator"])
        tensors.update(logprobs=case["kl"]["logprobs"].numpy(),
                       reference_logprobs=case["kl"]["reference_logprobs"].numpy())
    dtype = "float64" if case["dtype"] == torch.float64 else "float32"
    out = client.compute(name, config, output_dtype=dtype, as_numpy=True, **tensors)
    return np.asarray(out.advantages, dtype=np.float64), (
        None if out.returns is None else np.asarray(out.returns, dtype=np.float64))


def documented(estimator: str, case: dict, y64):
    """The service's documented finite answer where the float64 reference is not finite (see the module
    docstring); fails for any other non-finite reference output."""
    all_empty = not case["mask"].any()
    if estimator == "rloo" and case["n"] == 1:
        _, g = reference(estimator, case, precise=True, name="reinforce")
        return g, g
    if estimator == "group_norm" and case["n"] == 1:
        return reference(estimator, case, precise=True, name="dr_grpo")
    if estimator in WHITENED and all_empty:
        _, g = y64
        assert torch.isfinite(g).all()
        return g * 1e4, g
    raise AssertionError(f"{estimator}: the released OpenRLHF gives a non-finite result on finite input "
                         f"outside the documented cases: {case}")


def check(client, estimator: str, case: dict) -> None:
    y64 = [t.double() for t in reference(estimator, case, precise=True)]
    finite = all(bool(torch.isfinite(t).all()) for t in y64)
    sens = [torch.zeros_like(t) for t in y64]  # per position: the reference's own last-bit sensitivity
    if not finite:
        y64 = [t.double() for t in documented(estimator, case, y64)]
        TRIED[f"openrlhf/{estimator} (reference not finite: documented answer)"] += 1
    else:
        for pattern in range(3):
            yp = reference(estimator, case, precise=True, perturb=pattern)
            sens = [torch.maximum(sd, (a.double() - b).abs()) for sd, a, b in zip(sens, yp, y64)]
    adv, ret = service(client, estimator, case)
    m = case["mask"].bool().numpy()
    np_dtype = np.float32 if case["dtype"] == torch.float32 else np.float64
    for label, got, want, sd in (("advantages", adv, y64[0].numpy(), sens[0].numpy()),
                                 ("returns", ret, y64[1].numpy(), sens[1].numpy())):
        assert got is not None and got.shape == want.shape, (label, None if got is None else got.shape)
        assert np.isfinite(got).all(), f"{label}: non-finite service output"
        g, w = got[m], want[m]
        scale = float(np.abs(w).max()) if w.size else 0.0
        if case["values"] is not None:  # gae: both computations add and subtract the values (y = A + V, A = ... - V)
            scale = max(scale, float(case["values"].abs().max()))
        # per position (module docstring): one rounding to the batch's dtype (half its spacing at y64),
        # float64 arithmetic relative to the batch's scale, and the reference's own last-bit sensitivity
        tol = np.spacing(np.abs(w).astype(np_dtype)).astype(np.float64) / 2 + 16 * U64 * scale + 16 * sd[m]
        bad = np.abs(g - w) > tol
        assert not bad.any(), (f"{estimator} {label}: service != released OpenRLHF (float64 run) at "
                               f"{int(bad.sum())} positions: got {g[bad][:5]} want {w[bad][:5]} error {np.abs(g - w)[bad][:5]} "
                               f"tol {tol[bad][:5]}; "
                               f"case {case}")
    if finite:
        native = reference(estimator, case, precise=False)
        for got_native, want in zip(native, y64):
            gn, w = got_native.double().numpy()[m], want.numpy()[m]
            if gn.size and not np.allclose(gn, w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max()))):
                FLOAT32_LOST[estimator] = FLOAT32_LOST.get(estimator, 0) + 1
                TRIED[f"openrlhf/{estimator} (released float32 lost the answer: float64 run)"] += 1
                break
    TRIED[f"openrlhf/{estimator}"] += 1


@pytest.mark.parametrize("estimator", list(SERVICE))
def test_service_matches_released_openrlhf(client, estimator):
    TRIED[f"openrlhf/{estimator}"] += 0

    @SETTINGS
    @given(case=batches(estimator))
    def run(case):
        check(client, estimator, case)

    before = TRIED[f"openrlhf/{estimator}"]
    run()
    assert TRIED[f"openrlhf/{estimator}"] - before >= N_EXAMPLES


def test_float32_losses_are_exercised():
    """The float32 rule is not vacuous: the released whitening (``.float()``) loses the answer on some
    generated batches (near-ties with KL), where the service matched the float64 run instead."""
    if not all(TRIED.get(f"openrlhf/{e}", 0) for e in WHITENED):
        pytest.skip("run with the differential tests above")
    assert sum(FLOAT32_LOST.get(e, 0) for e in SERVICE) > 0, FLOAT32_LOST


def test_released_code_is_the_pinned_release():
    from advantage_client.references import REFERENCES
    assert openrlhf_ref.version() == REFERENCES["openrlhf"].release
    em = openrlhf_ref.load()
    assert em.__file__.endswith(REFERENCES["openrlhf"].code)
    assert not hasattr(em.RemoteExperienceMaker.compute_advantages_and_returns, "__stub__")


def test_known_values():
    """A hand-checked batch: two prompts of two samples, rewards [1, 0 | 1, 1], masks with a hole and an
    empty row; group_norm gives +-1/sqrt(2) on the first prompt up to each row's last valid token, 0 on
    the tied prompt; rloo gives +-1 (no whitening in OpenRLHF 0.11.2)."""
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 0], [1, 1, 1]])
    adv, ret = openrlhf_ref.compute("group_norm", r, mask, 2, [0, 1, 2, 3], [4])
    s = 2 ** -0.5
    torch.testing.assert_close(adv, torch.tensor([[s, s, s], [-s, -s, 0], [0, 0, 0], [0, 0, 0.0]]))
    adv, ret = openrlhf_ref.compute("rloo", r, mask, 2, [0, 1, 2, 3], [4])
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1, 1], [-1, -1, 0], [0, 0, 0], [0, 0, 0]]))
