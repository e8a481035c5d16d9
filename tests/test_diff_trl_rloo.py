"""Differential tests: the service (over gRPC, ``rloo`` with ``semantics = "trl"``) against the released TRL's
``RLOOTrainer`` (``tests/references/requirements.txt`` pins it; ``tests/references/trl_ref.py``'s
``compute_rloo`` runs ``RLOOTrainer._generate_and_score_completions`` in-process: TRL 1.16.0 computes the RLOO
advantages inline there, with no function to import).

Three option sets, at least 200 hypothesis batches each (``derandomize=True``): ``plain`` (``beta = 0``, TRL's
other defaults), ``kl`` (``beta`` from 0.001 to 1: the per-token log-probs of the policy and the reference go
through TRL's own k1 sum over the completion mask) and ``kl_normalize_clip`` (``normalize_advantages`` and a
``reward_clip_range`` as well). What TRL's API can express: ``num_generations`` n from 1 and prompt groups as
contiguous blocks of n completions; rewards binary, tied, integer, real, large and near-tied, and ``None`` (an
unscorable completion: TRL leaves it out of the leave-one-out means and of the normalisation, advantage 0);
completion lengths from 0 (TRL's ``completion_mask``; an empty completion still counts in its group);
float32 and float64. The service gets the rows shuffled with prompt ids to match (interleaved groups; integer
ids or uid strings), the unscorable rows as NaN rewards (``semantics = trl`` accepts them), and KL as the
drop-in sends it (``use_kl_in_reward`` and ``beta`` as the penalty; the trl semantics' KL defaults are TRL's, k1
unclamped): the per-sample
(``per_sample = true``) answer must equal the released code's row by row.

The rule is ``tests/test_diff_trl.py``'s: y64 is the released method run in float64 (``precise=True``); the
service computes in float64 and rounds once, so its answer must be within
    spacing(y64) / 2 + 16 u64 |y64|max + 16 s + 16 u64 |s_score|max / (std + 1e-4)
of y64 at every row, s the largest change of y64 when every float64 reward and log-prob moves by about its last bit;
the last term is the rounding noise of a leave-one-out difference of scores (clamped reward minus KL), divided by
the batch std where TRL standardises (``noise_scale``; without standardising, std + 1e-4 is taken as 1). The
released float32 run only counts the batches where it lost the answer (summary line).

Checked at x1.0001: with the server's ``advantage_server.estimators.rloo.trl_rloo`` scaled by 1.0001
(monkeypatched in the in-process server), every option set fails."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from advantage_server.estimators.rloo import trl_rloo_loop
from references import strategies, trl_ref
from references.counts import TRIED

N_EXAMPLES = 200
SETTINGS = settings(max_examples=N_EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
OPTIONS = ("plain", "kl", "kl_normalize_clip")
U64 = float(np.finfo(np.float64).eps) / 2


@st.composite
def batches(draw, option: str):
    n = draw(st.integers(1, 5))
    B = n * draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    r = draw(strategies.rewards(B, dtype))  # one kind (binary, tied, ...), as the batch's dtype holds them
    if draw(st.booleans()):
        unscorable = draw(st.lists(st.booleans(), min_size=B, max_size=B))
        r = [None if u else x for x, u in zip(r, unscorable)]
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    beta, logps, ref = 0.0, None, None
    if option != "plain":
        beta = draw(st.sampled_from([0.001, 0.05, 0.3, 1.0]))
        seed = draw(st.integers(0, 2 ** 31))
        g = np.random.default_rng(seed)
        logps = (-np.abs(g.standard_normal((B, T))) * draw(st.sampled_from([0.1, 1.0, 5.0])))
        ref = logps + g.standard_normal((B, T)) * draw(st.sampled_from([0.0, 1e-3, 0.5]))
        logps = logps.astype(np.float32 if dtype == torch.float32 else np.float64).astype(np.float64)
        ref = ref.astype(np.float32 if dtype == torch.float32 else np.float64).astype(np.float64)
    clip = None
    if option == "kl_normalize_clip" and draw(st.booleans()):
        lo = draw(st.sampled_from([-2.0, -0.5, 0.0]))
        clip = (lo, lo + draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])))  # min == max: a constant reward
        clip = draw(st.sampled_from([clip, (None, clip[1]), (clip[0], None)]))  # an open end, as torch's clamp
    order = draw(st.permutations(list(range(B)))) if draw(st.booleans()) else list(range(B))
    return dict(n=n, B=B, T=T, dtype=dtype, rewards=r, lengths=lengths, beta=beta, logps=logps,
                ref=ref, normalize=option == "kl_normalize_clip", clip=clip, order=order,
                uid_strings=draw(st.booleans()))


def completion_mask(case) -> np.ndarray:
    """TRL's ``completion_mask`` [B, T] (right padding to T)."""
    return (np.arange(case["T"])[None, :] < np.array(case["lengths"])[:, None]).astype(np.int64)


def last_bit(i: int, pattern: int) -> float:
    return 1 + 3 * U64 if pattern == 0 else 1 + 2 * U64 * (-1.0) ** (i + pattern)


def reference(case, precise: bool, perturb: int | None = None) -> torch.Tensor:
    f = (lambda i: 1.0) if perturb is None else (lambda i: last_bit(i, perturb))
    rewards = [None if x is None else x * f(i) for i, x in enumerate(case["rewards"])]
    logps = None if case["logps"] is None else case["logps"] * np.array([f(i) for i in range(case["B"])])[:, None]
    ref = None if case["ref"] is None else case["ref"] * np.array([f(i + 1) for i in range(case["B"])])[:, None]
    return trl_ref.compute_rloo(rewards, case["n"], beta=case["beta"], logps=logps, ref_logps=ref,
                                completion_lengths=case["lengths"], normalize_advantages=case["normalize"],
                                reward_clip_range=case["clip"], precise=precise)


def config(case) -> dict:
    """What ``advantage_client.trl.RemoteRLOOTrainer`` sends for these ``RLOOConfig`` values."""
    cfg = {"semantics": "trl", "normalize_advantages": case["normalize"]}
    if case["beta"]:  # the KL type and clamps: the trl semantics' defaults (k1, unclamped), as TRL's
        cfg.update(use_kl_in_reward=True, reference_policy_kl_penalty=case["beta"])
    if case["clip"] is not None:
        cfg.update({k: v for k, v in zip(("reward_clip_min", "reward_clip_max"), case["clip"]) if v is not None})
    return cfg


def service(client, case) -> np.ndarray:
    """The service's per-sample advantages [B], in TRL's row order (sent in ``case["order"]``)."""
    order = np.array(case["order"])
    np_dtype = np.float32 if case["dtype"] == torch.float32 else np.float64
    rewards = np.array([np.nan if x is None else x for x in case["rewards"]])
    groups = (np.arange(case["B"]) // case["n"])[order]
    tensors = dict(rewards=rewards[order].astype(np_dtype), mask=completion_mask(case)[order],
                   prompt_ids=[f"uid-{g}" for g in groups] if case["uid_strings"] else groups)
    if case["beta"]:
        tensors.update(logprobs=case["logps"][order].astype(np_dtype),
                       reference_logprobs=case["ref"][order].astype(np_dtype))
    out = client.compute("rloo", config(case), output_dtype=np_dtype.__name__, as_numpy=True, per_sample=True,
                         **tensors)
    assert out.layout == "broadcast", out.layout
    adv = np.empty(case["B"], dtype=np.float64)
    adv[order] = np.asarray(out.advantages, dtype=np.float64)
    return adv


def noise_scale(case) -> float:
    """The size of float64 rounding noise in an advantage, beyond the rounding of the answer: a leave-one-out
    advantage is a difference of scores s (clamped reward minus KL), so it carries about u64 * max|s| of noise
    however small it is (a tied group's exact 0 comes out as +-1e-16 there); standardising divides that by the
    batch std (+ 1e-4). Seen on CI: a tied group of scores -1.5 beside a group of advantages about 3e-3 gave
    TRL -9.5e-13 and the service -6.3e-13 for an exact 0 (the batch mean, noise, over std 3e-3)."""
    r = np.array([np.nan if x is None else x for x in case["rewards"]])
    if case["clip"] is not None:
        lo, hi = case["clip"]
        r = np.clip(r, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    if case["beta"]:
        r = r - case["beta"] * ((case["logps"] - case["ref"]) * completion_mask(case)).sum(-1)
    smax = float(np.nanmax(np.abs(r), initial=0.0)) if not np.isnan(r).all() else 0.0
    if not case["normalize"]:
        return smax
    raw = reference(dict(case, normalize=False), precise=True).double().numpy()
    nonzero = raw[raw != 0]
    std = float(np.std(nonzero, ddof=1)) if nonzero.size > 1 else 0.0
    return smax / (std + 1e-4)


def check(client, case, option: str) -> None:
    y64 = reference(case, precise=True).double()
    assert torch.isfinite(y64).all()
    sens = torch.stack([(reference(case, precise=True, perturb=p).double() - y64).abs() for p in range(3)]).amax(0)
    got = service(client, case)
    want = y64.numpy()
    np_dtype = np.float32 if case["dtype"] == torch.float32 else np.float64
    tol = (np.spacing(np.abs(want).astype(np_dtype)).astype(np.float64) / 2
           + 16 * U64 * float(np.abs(want).max(initial=0.0)) + 16 * sens.numpy() + 16 * U64 * noise_scale(case))
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"trl rloo {option}: service != released TRL (float64 run) at rows "
                           f"{np.flatnonzero(bad)[:5]}: got {got[bad][:5]} want {want[bad][:5]}; case {case}")
    native = reference(case, precise=False).double()
    if not np.allclose(native.numpy(), want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max(initial=0)))):
        TRIED[f"trl/rloo {option} (released float32 lost the answer: float64 run)"] += 1
    TRIED[f"trl/rloo {option}"] += 1


@pytest.mark.parametrize("option", OPTIONS)
def test_service_matches_released_trl_rloo(client, option):
    key = f"trl/rloo {option}"
    before = TRIED[key]

    @SETTINGS
    @given(case=batches(option))
    def run(case):
        check(client, case, option)

    run()
    assert TRIED[key] - before >= N_EXAMPLES


def test_known_values():
    """Hand-checked, against the released code and the loop twin: two prompts of three completions, rewards
    [1, 0, 2 | 3, None, None]. Group 0: 1 - (0 + 2) / 2 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5; group 1 has one
    scorable completion (TRL: 0 / 0, then 0) and two unscorable ones (0)."""
    rewards = [1.0, 0.0, 2.0, 3.0, None, None]
    out = trl_ref.compute_rloo(rewards, 3, precise=True)
    torch.testing.assert_close(out, torch.tensor([0.0, -1.5, 1.5, 0.0, 0.0, 0.0], dtype=torch.float64))
    loop = trl_rloo_loop([0, 0, 0, 1, 1, 1], [np.nan if r is None else r for r in rewards])
    assert loop == [0.0, -1.5, 1.5, 0.0, 0.0, 0.0]


def test_rloo_trl_is_refused_where_trl_has_no_such_setting(client):
    """INVALID_ARGUMENT naming the field and the fix: a clip range with min > max; ``exclude_empty_responses``
    (TRL scores an all-0 mask row); a NaN reward or ``normalize_advantages`` under another semantics. An open clip
    end clamps one side only, as torch's clamp."""
    from advantage_client import InvalidArgumentError
    kw = dict(prompt_ids=[0, 0], rewards=np.array([1.0, np.nan]), mask=np.ones((2, 1)))
    with pytest.raises(InvalidArgumentError, match=r"config.reward_clip_min: must be at most reward_clip_max"):
        client.compute("rloo", {"semantics": "trl", "reward_clip_min": 1.0, "reward_clip_max": -1.0}, **kw)
    with pytest.raises(InvalidArgumentError,
                       match=r"config.exclude_empty_responses: does not apply with semantics = trl"):  # TRL scores it
        client.compute("rloo", {"semantics": "trl", "exclude_empty_responses": True}, **kw)
    one_end = client.compute("rloo", {"semantics": "trl", "reward_clip_max": 0.5}, as_numpy=True, per_sample=True,
                             prompt_ids=[0, 0, 0], rewards=np.array([1.0, 0.0, np.nan]), mask=np.ones((3, 1)))
    np.testing.assert_array_equal(one_end.advantages, [0.5, -0.5, 0.0])  # 1 clamped to 0.5; the NaN row left out
    with pytest.raises(InvalidArgumentError, match=r"inputs\['rewards'\].*NaN.*semantics = trl"):
        client.compute("rloo", {"semantics": "verl"}, **kw)
    with pytest.raises(InvalidArgumentError,
                       match=r"config.normalize_advantages: does not apply with semantics = verl; it applies with trl"):
        client.compute("rloo", {"semantics": "verl", "normalize_advantages": True}, **kw)


def test_the_kl_defaults_under_trl_are_trls(client):
    """Under trl the KL fields default to TRL's k1 (the policy's log-prob minus the reference's), unclamped, not
    to NeMo RL's k3 with clamps 20 and 10, which gave this batch advantages of the opposite sign (a review found
    it): a caller who sets only ``use_kl_in_reward`` and the penalty gets TRL's numbers, from the released code."""
    logps = np.array([[-1.0, -30.0], [-0.5, -0.2], [-3.0, -1.0], [-2.0, -2.0]])
    out = client.compute("rloo", {"semantics": "trl", "use_kl_in_reward": True, "reference_policy_kl_penalty": 0.05},
                         as_numpy=True, per_sample=True, output_dtype="float64", prompt_ids=[0, 0, 1, 1],
                         rewards=np.array([1.0, 2.0, 0.0, 1.0]), mask=np.ones((4, 2)), logprobs=logps,
                         reference_logprobs=np.zeros((4, 2)))
    want = trl_ref.compute_rloo([1.0, 2.0, 0.0, 1.0], 2, beta=0.05, logps=logps, ref_logps=np.zeros((4, 2)),
                                precise=True).numpy()
    np.testing.assert_allclose(out.advantages, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(want, [0.515, -0.515, -1.0, 1.0], rtol=0, atol=1e-12)  # k3 clamped: -1.527, 1.527, ...


def test_infinite_rewards_that_trls_clip_range_clamps_are_accepted(client):
    """An infinite reward that TRL's ``reward_clip_range`` clamps is a finite score in TRL (a review found the
    service refused it, so the drop-in failed where TRL trains on): accepted on the side a clip end is set, equal to
    the released code; refused where no end clamps it, and under other semantics, naming the fix."""
    from advantage_client import InvalidArgumentError
    rewards = [np.inf, 0.0, -np.inf, 1.0, 2.0, None]
    want = trl_ref.compute_rloo(rewards, 3, reward_clip_range=(-1.0, 1.5), precise=True).numpy()
    assert np.isfinite(want).all()
    out = client.compute("rloo", {"semantics": "trl", "reward_clip_min": -1.0, "reward_clip_max": 1.5},
                         as_numpy=True, per_sample=True, output_dtype="float64", prompt_ids=[0, 0, 0, 1, 1, 1],
                         rewards=np.array([np.nan if r is None else r for r in rewards]), mask=np.ones((6, 1)))
    np.testing.assert_allclose(out.advantages, want, rtol=1e-12, atol=1e-12)
    # inf -> 1.5, -inf -> -1: 1.5 - (0 - 1) / 2, 0 - (1.5 - 1) / 2, -1 - (1.5 + 0) / 2
    np.testing.assert_allclose(want[:3], [2.0, -0.25, -1.75], atol=1e-12)
    one_side = dict(prompt_ids=[0, 0], rewards=np.array([np.inf, 0.0]), mask=np.ones((2, 1)))
    got = client.compute("rloo", {"semantics": "trl", "reward_clip_max": 1.0}, as_numpy=True, per_sample=True,
                         **one_side)
    np.testing.assert_array_equal(got.advantages, [1.0, -1.0])
    with pytest.raises(InvalidArgumentError, match=r"inputs\['rewards'\]: contains infinity.*reward_clip_max"):
        client.compute("rloo", {"semantics": "trl", "reward_clip_min": -1.0}, **one_side)  # +inf, no max: refused
    with pytest.raises(InvalidArgumentError, match=r"inputs\['rewards'\]: contains NaN or infinity"):
        client.compute("rloo", {"semantics": "openrlhf"}, **one_side)  # OpenRLHF's clamp is not TRL's: refused
