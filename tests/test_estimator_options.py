"""Options that public bug reports asked the references for (issue 10). Each is off by default, so the
references are reproduced exactly; each test here shows what it changes, on real values.

* ``exclude_empty_responses`` (every group estimator; verl PR #6452, OpenRLHF PR #1239): a row whose
  mask is all 0 is left out of its group. Oracle: the non-empty rows get exactly what the estimator gives
  them (with the option off) on the batch with the empty rows removed; the empty rows get 0 everywhere.
* ``allow_missing_rewards`` (gdpo; ms-swift issue #8123): NaN in ``reward/<name>`` = no score. Oracle: a
  numpy nanmean / nanstd formula.
* ``sum_rewards_over_mask`` (verl-semantics outcome estimators; verl PR #6310): the outcome score of a
  [B, T] reward is its sum over mask = 1 only. Oracle: the default result on ``rewards * mask``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from advantage_client import AdvantageServiceError
from advantage_server import AdvantageCore
from advantage_server.errors import InvalidInput
from advantage_server.estimators import jit
from advantage_server.estimators.groups import exclude_rows, group_baseline_and_std, group_baseline_and_std_loop

F64 = torch.float64


def run(name, config=None, **tensors):
    return AdvantageCore("cpu").run(name, config or {}, tensors)


def close(got, want, tol=1e-9):
    want = torch.as_tensor(want, dtype=F64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.to(F64), want, atol=tol, rtol=tol), f"\n{got}\n!=\n{want}"


# ------------------------------------------------------------------------ exclude_empty_responses
# B = 8, T = 4: group 0 = rows 0, 2, 5, 7 (row 2 empty, with a large reward: a reward written on padding),
# group 1 = rows 1, 3, 6 (row 6 empty), group 2 = row 4 alone and non-empty; rows interleaved.
IDS = torch.tensor([0, 1, 0, 1, 2, 0, 1, 0])
R = torch.tensor([1.0, 0.5, 9.0, 2.0, 3.0, 0.0, -4.0, 0.25], dtype=F64)
M = torch.tensor([[1, 1, 0, 1],
                  [1, 1, 1, 1],
                  [0, 0, 0, 0],
                  [0, 1, 1, 0],
                  [1, 1, 1, 0],
                  [1, 0, 1, 1],
                  [0, 0, 0, 0],
                  [1, 1, 0, 0]], dtype=F64)
KEEP = M.sum(-1) > 0
RNG = np.random.default_rng(0)
LOGP = torch.tensor(-RNG.uniform(0.05, 2.0, size=M.shape), dtype=F64)
SPS = torch.tensor(RNG.uniform(0.1, 0.9, size=M.shape), dtype=F64)
COMP_B = torch.tensor([0.0, 1.0, -7.0, 1.0, 0.5, 1.0, 8.0, 0.0], dtype=F64)

#: (estimator, config, tensors it reads besides the mask)
GROUP_CASES = [
    ("grpo", {"semantics": "nemo_rl"}, ("prompt_ids", "rewards")),
    ("grpo", {"semantics": "nemo_rl", "use_leave_one_out_baseline": False}, ("prompt_ids", "rewards")),
    ("grpo", {"semantics": "verl"}, ("prompt_ids", "rewards")),
    ("grpo", {"semantics": "openrlhf"}, ("prompt_ids", "rewards")),
    ("grpo", {"semantics": "trl"}, ("prompt_ids", "rewards")),
    ("grpo", {"semantics": "trl", "scale_rewards": "batch"}, ("prompt_ids", "rewards")),
    ("gdpo", {}, ("prompt_ids", "reward/a", "reward/b")),
    ("gdpo", {"use_leave_one_out_baseline": False}, ("prompt_ids", "reward/a", "reward/b")),
    ("gdpo", {"semantics": "verl"}, ("prompt_ids", "reward/a", "reward/b")),
    ("grpo_passk", {}, ("prompt_ids", "rewards")),
    ("rloo", {"semantics": "verl"}, ("prompt_ids", "rewards")),
    ("rloo", {"semantics": "openrlhf"}, ("prompt_ids", "rewards")),
    ("reinforce_plus_plus_baseline", {"semantics": "verl"}, ("prompt_ids", "rewards")),
    ("reinforce_plus_plus_baseline", {"semantics": "openrlhf"}, ("prompt_ids", "rewards")),
    ("reinforce_plus_plus", {"semantics": "nemo_rl"}, ("prompt_ids", "rewards")),
    ("opo", {}, ("prompt_ids", "rewards")),
    ("gpg", {}, ("prompt_ids", "rewards")),
    ("optimal_token_baseline", {"handle_zero_tail": False}, ("prompt_ids", "rewards", "logprobs", "sum_pi_squared")),
    ("optimal_token_baseline", {"handle_zero_tail": True}, ("prompt_ids", "rewards", "logprobs", "sum_pi_squared")),
]


def _tensors(names, ids=IDS, r=R, m=M, rows=None):
    full = {"prompt_ids": ids, "rewards": r, "reward/a": r, "reward/b": COMP_B, "logprobs": LOGP,
            "sum_pi_squared": SPS, "mask": m}
    out = {k: full[k] for k in (*names, "mask")}
    if rows is not None:
        out = {k: v[rows] for k, v in out.items()}
    return out


def _case_id(case):
    name, cfg, _ = case
    return name + "".join(f"-{v}" for v in cfg.values())


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("case", GROUP_CASES, ids=_case_id)
def test_exclude_empty_is_the_batch_without_the_empty_rows(case, numba):
    name, cfg, names = case
    with jit.use_numba(numba):
        on = run(name, {**cfg, "exclude_empty_responses": True}, **_tensors(names))
        reduced = run(name, cfg, **_tensors(names, rows=KEEP))
        default = run(name, cfg, **_tensors(names))
    close(on.advantages[KEEP], reduced.advantages)
    close(on.advantages[~KEEP], torch.zeros(2, M.shape[1]))
    if reduced.returns is not None:
        close(on.returns[KEEP], reduced.returns)
    # and it is a change: the default lets the empty rows (reward 9 and -4) into their groups (OTB: see below)
    if name not in ("optimal_token_baseline", "opo"):
        assert not torch.allclose(default.advantages[KEEP].to(F64), reduced.advantages.to(F64), atol=1e-6), name


def test_exclude_empty_optimal_token_baseline_group_of_one():
    """OTB's sums run over valid tokens, so an empty row adds nothing to them; what it changes is the group
    size: a row whose only peers are empty becomes a group of one (baseline 0, A = G) instead of being
    its own baseline (A ~ 0). With handle_zero_tail (the default) that row's baseline is 0 anyway."""
    ids = torch.tensor([0, 0, 1, 1])
    m = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=F64)
    r = torch.tensor([2.0, 7.0, 1.0, 0.0], dtype=F64)
    t = {"prompt_ids": ids, "rewards": r, "mask": m, "logprobs": LOGP[:4, :3], "sum_pi_squared": SPS[:4, :3]}
    on = run("optimal_token_baseline", {"exclude_empty_responses": True, "handle_zero_tail": False}, **t)
    off = run("optimal_token_baseline", {"handle_zero_tail": False}, **t)
    close(on.advantages[0], [2.0, 2.0, 2.0])
    close(off.advantages[0], [0.0, 0.0, 0.0], tol=1e-6)
    close(on.advantages[1:], off.advantages[1:])
    on = run("optimal_token_baseline", {"exclude_empty_responses": True}, **t)
    close(on.advantages, run("optimal_token_baseline", {}, **t).advantages)


def test_exclude_empty_opo_group_of_one():
    """OPO's baseline weights rows by their length, so an empty row has no weight in it; what changes is
    the group size: a row whose only peer is empty becomes a group of one (b = 0, A = s) instead of
    being its own baseline (A = 0)."""
    ids = torch.tensor([0, 0, 1, 1])
    m = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=F64)
    r = torch.tensor([2.0, 7.0, 1.0, 0.0], dtype=F64)
    on = run("opo", {"exclude_empty_responses": True}, prompt_ids=ids, rewards=r, mask=m)
    off = run("opo", {}, prompt_ids=ids, rewards=r, mask=m)
    close(on.advantages[0], [2.0, 2.0, 2.0])
    close(off.advantages[0], [0.0, 0.0, 0.0])
    b = (2 * 1.0 + 1 * 0.0) / 3  # group 1: length-weighted mean, the same either way
    close(on.advantages[2:], [[1.0 - b, 1.0 - b, 0.0], [-b, 0.0, 0.0]])
    close(off.advantages[2:], on.advantages[2:])


def test_exclude_empty_grpo_nemo_values():
    """Group 0 = {1.0, [empty 9.0], 0.0, 0.25}; leave-one-out (the default): row 0's others are {0, 0.25}."""
    on = run("grpo", {"exclude_empty_responses": True}, **_tensors(("prompt_ids", "rewards")))
    off = run("grpo", {}, **_tensors(("prompt_ids", "rewards")))
    others = torch.tensor([0.0, 0.25], dtype=F64)
    want0 = (1.0 - others.mean()) / (others.std() + 1e-6)
    close(on.advantages[0], torch.full((4,), dtype=F64, fill_value=float(want0)))
    # default: row 0's others include the empty row's 9.0
    others = torch.tensor([9.0, 0.0, 0.25], dtype=F64)
    want0 = (1.0 - others.mean()) / (others.std() + 1e-6)
    close(off.advantages[0], torch.full((4,), dtype=F64, fill_value=float(want0)))
    # group 1 = {0.5, 2.0, [empty -4.0]}: leave-one-out over one other: A = r - other, std 0 (unscaled)
    close(on.advantages[1], torch.full((4,), dtype=F64, fill_value=-1.5))
    close(on.advantages[2], torch.zeros(4))  # the empty row: 0 at every position (default: broadcast, non-zero)
    assert (off.advantages[2] != 0).all()


def test_exclude_empty_group_of_only_empty_rows_and_verl_group_of_one():
    """verl GRPO: a group whose only other member is empty becomes a group of one (verl: mean 0, std 1,
    so A = r / (1 + eps)); a group of empty rows only gives 0 everywhere."""
    ids = torch.tensor([0, 0, 1, 1])
    r = torch.tensor([2.0, 5.0, 3.0, 1.0], dtype=F64)
    m = torch.tensor([[1, 1], [0, 0], [0, 0], [0, 0]], dtype=F64)
    on = run("grpo", {"semantics": "verl", "exclude_empty_responses": True}, prompt_ids=ids, rewards=r, mask=m)
    one_plus_eps = float(np.float32(1.0) + np.float32(1e-6))  # verl's group-of-one std is a float32 1.0
    close(on.advantages, [[2.0 / one_plus_eps] * 2, [0, 0], [0, 0], [0, 0]])
    off = run("grpo", {"semantics": "verl"}, prompt_ids=ids, rewards=r, mask=m)
    close(off.advantages[0], torch.full((2,), dtype=F64, fill_value=(2.0 - 3.5) / (2 ** 0.5 * 1.5 + 1e-6)))


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
def test_exclude_rows_in_every_group_kernel(numba):
    """The shared statistics with rows left out equal the loop oracle on the kept rows, on random layouts
    (interleaved, uniform in-order groups that the uniform kernel takes, groups of one)."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        B = int(rng.integers(1, 40))
        if trial % 2:
            n = int(rng.integers(1, 6))
            ids = torch.arange(B * n) // n  # in order, equal sizes
            B = B * n
        else:
            ids = torch.tensor(rng.integers(0, max(1, B // 3), size=B))
        r = torch.tensor(rng.choice([0.0, 1.0, 0.5, rng.normal()], size=B), dtype=F64)
        keep = torch.tensor(rng.random(B) < 0.7)
        for loo in (False, True):
            with jit.use_numba(numba):
                b, s = group_baseline_and_std(exclude_rows(ids, keep), r, loo)
            kb, ks = group_baseline_and_std_loop(ids[keep], r[keep], loo)
            close(b[keep], kb, tol=1e-12)
            close(s[keep], ks, tol=1e-12)
            close(b[~keep], r[~keep])  # a left-out row is a group of one: its own value, std 0
            close(s[~keep], torch.zeros(int((~keep).sum())))


def test_exclude_empty_is_off_by_default_and_listed(client):
    listing = {e.name: e for e in client.list_estimators().estimators}
    for name in ("grpo", "gdpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "opo",
                 "gpg", "optimal_token_baseline"):
        fields = {f.name: f for f in listing[name].config_fields}
        assert fields["exclude_empty_responses"].default_value.startswith("false"), name
        assert "mask is all 0" in fields["exclude_empty_responses"].description, name
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk"):
        f = next(f for f in listing[name].config_fields if f.name == "sum_rewards_over_mask")
        assert f.default_value.startswith("false") and "PR #6310" in f.description, name
    f = next(f for f in listing["gdpo"].config_fields if f.name == "allow_missing_rewards")
    assert f.default_value.startswith("false (nemo_rl)") and "NaN" in f.description
    spec = next(i for i in listing["gdpo"].inputs if i.name == "reward/<name>")
    assert "allow_missing_rewards" in spec.description


def test_allow_missing_rewards_not_applicable_to_gdpo_verl():
    with pytest.raises(InvalidInput, match="allow_missing_rewards"):
        run("gdpo", {"semantics": "verl", "allow_missing_rewards": True}, prompt_ids=IDS, mask=M,
            **{"reward/a": R, "reward/b": COMP_B})


def test_exclude_empty_not_applicable_to_reinforce_plus_plus_verl():
    with pytest.raises(InvalidInput, match="exclude_empty_responses"):
        run("reinforce_plus_plus", {"semantics": "verl", "exclude_empty_responses": True}, rewards=R, mask=M)


def test_exclude_empty_over_grpc(client):
    got = client.compute("grpo", prompt_ids=IDS, rewards=R, mask=M, config={"exclude_empty_responses": True},
                         output_dtype="float64")
    want = run("grpo", {"exclude_empty_responses": True}, **_tensors(("prompt_ids", "rewards")))
    close(torch.as_tensor(got.advantages), want.advantages)
    assert (torch.as_tensor(got.advantages)[~KEEP] == 0).all()


# ------------------------------------------------------------------------ gdpo allow_missing_rewards
GIDS = torch.tensor([0, 0, 0, 0, 1, 1, 1])
GA = torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.5, float("nan"), 2.0], dtype=F64)
GB = torch.tensor([0.0, 1.0, 1.0, float("nan"), 3.0, 1.0, 1.0], dtype=F64)
GM = torch.ones(7, 3, dtype=F64)


def _nan_oracle(ids, comps, weights, eps=1e-6):
    """ms-swift's fix, in numpy: per group nanmean and nanstd (ddof 1), NaN -> 0, weighted sum, then
    standardised over the batch (unbiased std)."""
    total = np.zeros(len(ids))
    for w, c in zip(weights, comps):
        c = c.numpy()
        a = np.zeros(len(ids))
        for g in set(ids.tolist()):
            rows = np.flatnonzero(ids.numpy() == g)
            vals = c[rows]
            have = ~np.isnan(vals)
            if have.sum() < 2:
                continue  # a group of one (for this component) gets 0
            mu = np.nanmean(vals)
            sd = np.nanstd(vals, ddof=1)
            adv = vals - mu
            if sd > 0:
                adv = adv / (sd + eps)
            a[rows] = np.nan_to_num(adv, nan=0.0)
        total += w * a
    return (total - total.mean()) / total.std(ddof=1)


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
def test_gdpo_missing_rewards_normalised_over_the_samples_that_have_them(numba):
    cfg = {"allow_missing_rewards": True, "use_leave_one_out_baseline": False, "reward_weights": [1.0, 0.5]}
    with jit.use_numba(numba):
        got = run("gdpo", cfg, prompt_ids=GIDS, mask=GM, **{"reward/a": GA, "reward/b": GB})
    want = _nan_oracle(GIDS, [GA, GB], [1.0, 0.5])
    close(got.advantages, torch.tensor(want)[:, None].expand(7, 3))
    # component a of group 0 over rows 0, 1, 3 = {1, 0, 1}: mean 2/3 (NOT 0-filled {1, 0, 0, 1}: mean 1/2)
    assert abs(want[0] - _nan_oracle(GIDS, [torch.nan_to_num(GA), GB], [1.0, 0.5])[0]) > 1e-3


def test_gdpo_missing_rewards_with_leave_one_out():
    """Default leave-one-out: component a of row 0 is compared with rows 1 and 3 (row 2 has no score)."""
    got = run("gdpo", {"allow_missing_rewards": True}, prompt_ids=GIDS, mask=GM, **{"reward/a": GA, "reward/b": GB})
    # the same batch without NaN: rows whose every component is present, computed per component by hand
    a0 = (1.0 - 0.5) / (torch.tensor([0.0, 1.0], dtype=F64).std() + 1e-6)      # others {0, 1}
    b0 = (0.0 - 1.0) / 1.0                                                     # others {1, 1}: std 0, unscaled
    a1 = (0.0 - 1.0) / 1.0                                                     # others {1, 1}
    b1 = (1.0 - 0.5) / (torch.tensor([0.0, 1.0], dtype=F64).std() + 1e-6)      # others {0, 1}
    a2, b2 = 0.0, (1.0 - 0.5) / (torch.tensor([0.0, 1.0], dtype=F64).std() + 1e-6)
    a3, b3 = (1.0 - 0.5) / (torch.tensor([0.0, 1.0], dtype=F64).std() + 1e-6), 0.0
    # group 1: a over rows 4, 6 = {0.5, 2}: one other each, std 0; b over {3, 1, 1}
    a4, a6, a5 = 0.5 - 2.0, 2.0 - 0.5, 0.0
    b4 = 3.0 - 1.0
    b5 = (1.0 - 2.0) / (torch.tensor([3.0, 1.0], dtype=F64).std() + 1e-6)
    b6 = b5
    total = torch.tensor([a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6], dtype=F64)
    want = (total - total.mean()) / total.std()
    close(got.advantages, want[:, None].expand(7, 3))
    assert int(GA.isnan().sum()) == 2 and int(GB.isnan().sum()) == 1  # the inputs were not modified in place


def test_gdpo_nan_rejected_by_default_and_infinity_always():
    with pytest.raises(InvalidInput, match="NaN or infinity"):
        run("gdpo", {}, prompt_ids=GIDS, mask=GM, **{"reward/a": GA, "reward/b": GB})
    inf = GB.clone()
    inf[0] = float("inf")
    with pytest.raises(InvalidInput, match="infinity"):
        run("gdpo", {"allow_missing_rewards": True}, prompt_ids=GIDS, mask=GM, **{"reward/a": GA, "reward/b": inf})
    # other estimators' rewards still reject NaN
    with pytest.raises(InvalidInput, match="NaN or infinity"):
        run("grpo", {}, prompt_ids=GIDS, mask=GM, rewards=GA)


def test_gdpo_missing_rewards_without_nan_is_the_default():
    a, b = torch.nan_to_num(GA, nan=0.3), torch.nan_to_num(GB, nan=-1.0)
    for numba in (True, False):
        with jit.use_numba(numba):
            on = run("gdpo", {"allow_missing_rewards": True}, prompt_ids=GIDS, mask=GM,
                     **{"reward/a": a, "reward/b": b})
            off = run("gdpo", {}, prompt_ids=GIDS, mask=GM, **{"reward/a": a, "reward/b": b})
        close(on.advantages, off.advantages, tol=1e-12)


def test_gdpo_missing_rewards_over_grpc(client):
    got = client.compute("gdpo", prompt_ids=GIDS, mask=GM, config={"allow_missing_rewards": True},
                         output_dtype="float64", **{"reward/a": GA, "reward/b": GB})
    want = run("gdpo", {"allow_missing_rewards": True}, prompt_ids=GIDS, mask=GM, **{"reward/a": GA, "reward/b": GB})
    close(torch.as_tensor(got.advantages), want.advantages)
    with pytest.raises(AdvantageServiceError):
        client.compute("gdpo", prompt_ids=GIDS, mask=GM, **{"reward/a": GA, "reward/b": GB})


# ------------------------------------------------------------------------ sum_rewards_over_mask
# verl PR #6310's case: an empty response whose reward manager wrote 10.0 at index -1 (a padded position),
# next to a peer with reward 0: verl's sum over all positions gives the peer a non-zero advantage.
TOK = torch.tensor([[0.0, 0.0, 10.0], [0.0, 0.0, 0.0], [0.0, 1.0, 5.0], [0.5, 0.0, 3.0]], dtype=F64)
TM = torch.tensor([[0, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=F64)
TIDS = torch.tensor([0, 0, 1, 1])

SUM_CASES = [
    ("grpo", {"semantics": "verl"}),
    ("rloo", {"semantics": "verl"}),
    ("reinforce_plus_plus_baseline", {"semantics": "verl"}),
    ("opo", {}),
    ("gpg", {}),
    ("grpo_passk", {}),
]


@pytest.mark.parametrize("case", SUM_CASES, ids=lambda c: c[0])
def test_sum_rewards_over_mask(case):
    name, cfg = case
    on = run(name, {**cfg, "sum_rewards_over_mask": True}, prompt_ids=TIDS, rewards=TOK, mask=TM)
    masked = run(name, cfg, prompt_ids=TIDS, rewards=TOK * TM, mask=TM)
    off = run(name, cfg, prompt_ids=TIDS, rewards=TOK, mask=TM)
    close(on.advantages, masked.advantages)
    assert not torch.allclose(on.advantages, off.advantages, atol=1e-6), name
    # [B] rewards: unchanged by the option
    r = torch.tensor([1.0, 0.0, 2.0, 0.5], dtype=F64)
    close(run(name, {**cfg, "sum_rewards_over_mask": True}, prompt_ids=TIDS, rewards=r, mask=TM).advantages,
          run(name, cfg, prompt_ids=TIDS, rewards=r, mask=TM).advantages)


def test_sum_rewards_over_mask_verl_grpo_values():
    on = run("grpo", {"semantics": "verl", "sum_rewards_over_mask": True}, prompt_ids=TIDS, rewards=TOK, mask=TM)
    off = run("grpo", {"semantics": "verl"}, prompt_ids=TIDS, rewards=TOK, mask=TM)
    # group 0 scores: default {10, 0} -> the peer gets (0 - 5) / (std 7.07 + eps); masked {0, 0} -> 0
    close(off.advantages[1], torch.full((3,), dtype=F64, fill_value=-5.0 / (50 ** 0.5 + 1e-6)))
    close(on.advantages[1], torch.zeros(3))
    # group 1 scores: default {6, 3.5} (row 2's masked position holds 5); masked {1, 3.5}
    sd = 2.5 / 2 ** 0.5
    close(off.advantages[2:], [[1.25 / (sd + 1e-6)] * 2 + [0.0], [-1.25 / (sd + 1e-6)] * 3])
    close(on.advantages[2:], [[-1.25 / (sd + 1e-6)] * 2 + [0.0], [1.25 / (sd + 1e-6)] * 3])


def test_sum_rewards_over_mask_only_under_verl():
    with pytest.raises(InvalidInput, match="sum_rewards_over_mask"):
        run("grpo", {"sum_rewards_over_mask": True}, prompt_ids=TIDS, rewards=TOK, mask=TM)  # nemo_rl
    with pytest.raises(InvalidInput, match="sum_rewards_over_mask"):
        run("rloo", {"semantics": "openrlhf", "sum_rewards_over_mask": True}, prompt_ids=TIDS, rewards=TOK, mask=TM)
