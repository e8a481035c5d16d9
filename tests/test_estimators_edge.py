"""The estimators added for verl / OpenRLHF / TRL semantics: hand-computed values on one small batch that
has every edge case at once, semantics-specific behaviour, config validation, and each vectorized kernel
against its loop twin (the test oracle).

The shared batch (B = 6, T = 5):

    row  prompt  reward  mask          what it exercises
    0    7       1.0     1 1 0 1 0     interleaved group 7 (rows 0, 2, 5); a hole at t = 2
    1    3       0.5     1 1 1 1 1     group 3 (rows 1, 4): tied rewards
    2    7       0.0     0 0 0 0 0     an all-zero mask row
    3    5       2.0     0 1 1 0 0     a group of one; a prompt offset
    4    3       0.5     1 0 1 1 0     tied; a hole
    5    7       0.5     1 1 1 0 0

Group 7 has mean 0.5 and sample std 0.5; group 3 mean 0.5, std 0.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from advantage_client import AdvantageServiceError
from advantage_server import AdvantageCore
from advantage_server.errors import InvalidInput
from advantage_server.estimators.groups import group_index, verl_group_stats, verl_group_stats_loop
from advantage_server.estimators.grpo_passk import grpo_passk_loop, grpo_passk_scalars
from advantage_server.estimators.opo import opo_baseline, opo_baseline_loop
from advantage_server.estimators.optimal_token_baseline import otb_loop
from advantage_server.estimators.reinforce_plus_plus import verl_returns, verl_returns_loop
from advantage_server.estimators.reinforce_plus_plus_baseline import rppb_scalars, rppb_scalars_loop
from advantage_server.estimators.rloo import rloo_scalars, rloo_scalars_loop
from advantage_server.estimators.tir_optimal_token_baseline import tir_otb_loop

F64 = torch.float64
IDS = torch.tensor([7, 3, 7, 5, 3, 7])
R = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.5, 0.5], dtype=F64)
MASK = torch.tensor([[1, 1, 0, 1, 0],
                     [1, 1, 1, 1, 1],
                     [0, 0, 0, 0, 0],
                     [0, 1, 1, 0, 0],
                     [1, 0, 1, 1, 0],
                     [1, 1, 1, 0, 0]], dtype=F64)
LAST = [3, 4, -1, 2, 3, 2]  # last mask = 1 index per row


def run(name, config=None, **tensors):
    tensors.setdefault("mask", MASK)
    return AdvantageCore("cpu").run(name, config or {}, tensors)


def rows(values) -> torch.Tensor:
    """Per-row scalars -> [B, T] times the mask."""
    return torch.tensor(values, dtype=F64)[:, None] * MASK


def up_to_last(values) -> torch.Tensor:
    """Per-row scalars on every position up to the row's last mask = 1 position (OpenRLHF's return layout)."""
    t = torch.arange(MASK.shape[1])[None, :]
    return torch.where(t <= torch.tensor(LAST)[:, None], torch.tensor(values, dtype=F64)[:, None], 0.0)


def close(got, want, tol=1e-9):
    want = torch.as_tensor(want, dtype=F64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.to(F64), want, atol=tol, rtol=tol), f"\n{got}\n!=\n{want}"


# ------------------------------------------------------------------------------------------ grpo
# verl 0.9.1's std of a group of one is torch.tensor(1.0), float32: 1 + epsilon is rounded to float32
ONE_PLUS_EPS_F32 = float(np.float32(1.0) + np.float32(1e-6))


def test_grpo_verl():
    a = 0.5 / (0.5 + 1e-6)
    close(run("grpo", {"semantics": "verl"}, prompt_ids=IDS, rewards=R).advantages,
          rows([a, 0, -a, 2.0 / ONE_PLUS_EPS_F32, 0, 0]))  # a group of one: mean 0, std 1 (float32)
    close(run("grpo", {"semantics": "verl", "normalize_rewards": False}, prompt_ids=IDS, rewards=R).advantages,
          rows([0.5, 0, -0.5, 2.0, 0, 0]))


@pytest.mark.parametrize("value", [0.1, 0.7, 1.0, 1 / 3])
def test_grpo_verl_tied_float64_group_with_epsilon_zero_is_zero_over_grpc(client, value):
    """verl 0.9.1 divides 0 by 0 there (NaN), or, where its float64 mean misses the tied value by an ulp
    (three 0.1s), reports -0.8165 = -sqrt(2/3); the service documents 0 (README differences table). It
    used to refuse the call as a float64 overflow (the 0 / 0 NaN caught by the overflow check)."""
    got = client.compute("grpo", {"semantics": "verl", "epsilon": 0.0}, output_dtype="float64", as_numpy=True,
                         prompt_ids=np.array([0, 0, 0, 1, 1]), rewards=np.array([value] * 3 + [0.0, 2.0]),
                         mask=np.ones((5, 2))).advantages
    np.testing.assert_array_equal(got[:3], 0.0)
    # the other group is not tied: (r - 1) / sqrt(2), epsilon 0
    np.testing.assert_allclose(got[3:], [[-1 / math.sqrt(2)] * 2, [1 / math.sqrt(2)] * 2], rtol=1e-15)


def test_grpo_verl_sums_token_level_rewards_over_all_positions():
    tok = torch.zeros(6, 5, dtype=F64)
    tok[:, 4] = R  # on the last column, masked for most rows: verl still counts it
    close(run("grpo", {"semantics": "verl"}, prompt_ids=IDS, rewards=tok).advantages,
          run("grpo", {"semantics": "verl"}, prompt_ids=IDS, rewards=R).advantages)


def test_grpo_nemo_accepts_token_level_rewards():
    tok = torch.zeros(6, 5, dtype=F64)
    tok[:, 0], tok[:, 3] = R - 1.0, 1.0
    close(run("grpo", None, prompt_ids=IDS, rewards=tok).advantages, run("grpo", None, prompt_ids=IDS, rewards=R).advantages)


def test_grpo_openrlhf_group_norm_and_dr_grpo():
    """OpenRLHF group_norm: (r - mean) / (std + 1e-9) on the last valid token, cumulative return with
    gamma 1 = the value on every position up to it; a group of one and a tied group give 0."""
    a = 0.5 / (0.5 + 1e-9)
    close(run("grpo", {"semantics": "openrlhf"}, prompt_ids=IDS, rewards=R).advantages,
          up_to_last([a, 0, -a, 0, 0, 0]))
    close(run("grpo", {"semantics": "openrlhf", "normalize_rewards": False}, prompt_ids=IDS, rewards=R).advantages,
          up_to_last([0.5, 0, -0.5, 0, 0, 0]))


def test_grpo_trl_scale_rewards():
    full = torch.ones(6, 5, dtype=F64)
    group = run("grpo", {"semantics": "trl"}, prompt_ids=IDS, rewards=R).advantages
    a = 0.5 / (0.5 + 1e-4)
    close(group, torch.tensor([a, 0, -a, 0, 0, 0], dtype=F64)[:, None] * full)
    batch_std = math.sqrt(2.375 / 5)  # sample std of [1, .5, 0, 2, .5, .5]
    b = 1 / (batch_std + 1e-4)
    close(run("grpo", {"semantics": "trl", "scale_rewards": "batch"}, prompt_ids=IDS, rewards=R).advantages,
          torch.tensor([0.5 * b, 0, -0.5 * b, 0, 0, 0], dtype=F64)[:, None] * full)
    close(run("grpo", {"semantics": "trl", "scale_rewards": "none"}, prompt_ids=IDS, rewards=R).advantages,
          torch.tensor([0.5, 0, -0.5, 0, 0, 0], dtype=F64)[:, None] * full)


def test_grpo_dapo_std_rewards():
    """DAPO: the std comes from std_rewards; group 7's std_rewards are 3, 1, 0: std sqrt(7/3)."""
    s = torch.tensor([3.0, 0, 1.0, 0, 0, 0], dtype=F64)
    a = 0.5 / (math.sqrt(7 / 3) + 1e-6)
    close(run("grpo", {"semantics": "verl"}, prompt_ids=IDS, rewards=R, std_rewards=s).advantages,
          rows([a, 0, -a, 2.0 / ONE_PLUS_EPS_F32, 0, 0]))
    # nemo_rl with leave-one-out: row 0's others are rows 2, 5 with std_rewards 1, 0 -> std sqrt(0.5);
    # its baseline (mean of the others' rewards) is 0.25
    got = run("grpo", None, prompt_ids=IDS, rewards=R, std_rewards=s).advantages
    assert abs(float(got[0, 0]) - 0.75 / (math.sqrt(0.5) + 1e-6)) < 1e-9


def test_grpo_epsilon_defaults_per_semantics_and_override():
    got = run("grpo", {"semantics": "verl", "epsilon": 0.5}, prompt_ids=IDS, rewards=R).advantages
    assert abs(float(got[0, 0]) - 0.5) < 1e-12


# ------------------------------------------------------------------------------------ grpo_passk
def test_grpo_passk():
    close(run("grpo_passk", None, prompt_ids=IDS, rewards=R).advantages, rows([0.5 / (0.5 + 1e-6), 0, 0, 0, 0, 0]))
    close(run("grpo_passk", {"normalize_rewards": False}, prompt_ids=IDS, rewards=R).advantages,
          rows([0.5, 0, 0, 0, 0, 0]))


def test_grpo_passk_shared_maximum_gives_zero():
    r = torch.tensor([1.0, 0.5, 1.0, 2.0, 0.5, 0.0], dtype=F64)
    assert run("grpo_passk", None, prompt_ids=IDS, rewards=r).advantages.abs().sum() == 0


# ---------------------------------------------------------------------------------------- rloo
def test_rloo_verl():
    close(run("rloo", None, prompt_ids=IDS, rewards=R).advantages, rows([0.75, 0, -0.75, 2.0, 0, 0]))


def test_rloo_openrlhf():
    """Shaped [0.75, 0, -0.75, 2, 0, 0] on the last valid token; G = reverse cumsum; OpenRLHF 0.11.2 does not
    whiten rloo: advantages = G. A shaped reward beyond +-10 is clamped (OpenRLHF's default clip_range)."""
    res = run("rloo", {"semantics": "openrlhf"}, prompt_ids=IDS, rewards=R)
    G = up_to_last([0.75, 0, 0, 2.0, 0, 0])  # row 2 has no valid token: its reward is dropped
    close(res.returns, G)
    close(res.advantages, G)
    res = run("rloo", {"semantics": "openrlhf"}, prompt_ids=IDS, rewards=R * 10)
    close(res.returns, up_to_last([7.5, 0, 0, 10.0, 0, 0]))  # the group of one's 20 is clamped to 10


# -------------------------------------------------------------------------- reinforce++ baseline
def test_reinforce_plus_plus_baseline_verl():
    x = rows([0.5, 0, -0.5, 2.0, 0, 0])  # a group of one keeps its score (mean 0)
    mean = (3 * 0.5 + 2 * 2.0) / 16
    # verl masked_var: biased variance times n / (n - 1), a float32 factor in verl (int64 mask sums)
    var = ((3 * 0.5 ** 2 + 2 * 4.0) - 16 * mean ** 2) / 16 * float(np.float32(16) / np.float32(15))
    res = run("reinforce_plus_plus_baseline", None, prompt_ids=IDS, rewards=R)
    assert res.returns is None
    close(res.advantages, (x - mean) / math.sqrt(var + 1e-8) * MASK)


def test_reinforce_plus_plus_baseline_openrlhf():
    res = run("reinforce_plus_plus_baseline", {"semantics": "openrlhf"}, prompt_ids=IDS, rewards=R)
    G = up_to_last([0.5, 0, 0, 0, 0, 0])  # a group of one gets 0 in OpenRLHF
    close(res.returns, G)
    mean = 1.5 / 16
    var = 0.75 / 16 - mean ** 2
    close(res.advantages, (G - mean) / math.sqrt(var))


# ---------------------------------------------------------------------------------------- opo
def test_opo():
    """Group 7: lengths 3, 0, 3 -> b = (3 * 1 + 0 + 3 * 0.5) / 6 = 0.75; tied group 3: b = 0.5; group of one: b = 0."""
    res = run("opo", None, prompt_ids=IDS, rewards=R)
    assert res.returns is None
    close(res.advantages, rows([0.25, 0, -0.75, 2.0, 0, -0.25]))


def test_opo_group_with_no_valid_token_is_finite():
    mask = MASK.clone()
    mask[[0, 5]] = 0  # group 7 has no valid token at all: verl divides 0 by 0
    res = run("opo", None, prompt_ids=IDS, rewards=R, mask=mask)
    assert torch.isfinite(res.advantages).all() and res.advantages[[0, 2, 5]].abs().sum() == 0


# --------------------------------------------------------------------------------------- remax
def test_remax():
    b = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0, 0.25], dtype=F64)
    res = run("remax", None, rewards=R, reward_baselines=b)
    G = up_to_last(R.tolist()) * torch.tensor([1, 1, 0, 1, 1, 1], dtype=F64)[:, None]
    close(res.returns, G)
    close(res.advantages, G - b[:, None] * MASK)  # the baseline only under the mask: holes/offsets keep G
    assert float(res.advantages[3, 0]) == 2.0 and float(res.advantages[0, 2]) == 1.0


# ----------------------------------------------------------------------------------------- gpg
def test_gpg():
    """alpha = B / #nonzero = 6 / 5 (float32 in verl: 1.2000000477); group means 0.5, 0.5 and 0 for the
    group of one."""
    alpha = float(np.float32(6) / np.float32(5))
    close(run("gpg", None, prompt_ids=IDS, rewards=R).advantages, rows([alpha * x for x in (0.5, 0, -0.5, 2, 0, 0)]))
    close(run("gpg", {"f_norm": 2.0}, prompt_ids=IDS, rewards=R).advantages,
          rows([alpha * x / 2 for x in (0.5, 0, -0.5, 2, 0, 0)]))


# ---------------------------------------------------------------------------- reinforce++ returns
def test_reinforce_plus_plus_verl_carries_the_return_across_holes():
    """verl 0.9.1 (PR #7300): the hole at t = 2 keeps the running return as it is (its reward 3 is
    dropped) and gets return 0: G3 = 4, G1 = 2 + .5 * 4 = 4, G0 = 1 + .5 * 4 = 3."""
    tok = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1]], dtype=F64)
    res = run("reinforce_plus_plus", {"semantics": "verl", "gamma": 0.5}, rewards=tok, mask=mask)
    close(res.returns, [[3.0, 4.0, 0.0, 4.0]])
    valid = torch.tensor([3.0, 4.0, 4.0], dtype=F64)
    var = valid.var(unbiased=False) * float(np.float32(3) / np.float32(2))  # verl's float32 Bessel factor
    close(res.advantages, (res.returns - valid.mean()) / torch.sqrt(var + 1e-8) * mask)


def test_reinforce_plus_plus_verl_08_holes_reset_the_return():
    """reset_returns_at_holes: verl 0.8 and earlier, where the hole cuts the return and keeps its own."""
    tok = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1]], dtype=F64)
    res = run("reinforce_plus_plus", {"semantics": "verl", "gamma": 0.5, "reset_returns_at_holes": True},
              rewards=tok, mask=mask)
    close(res.returns, [[2.0, 2.0, 5.0, 4.0]])  # G2 = 3 + .5 * 4; G1 = 2 (t = 2 is a hole); G0 = 1 + .5 * 2
    valid = torch.tensor([2.0, 2.0, 4.0], dtype=F64)
    var = valid.var(unbiased=False) * float(np.float32(3) / np.float32(2))
    close(res.advantages, (res.returns - valid.mean()) / torch.sqrt(var + 1e-8) * mask)
    with pytest.raises(InvalidInput, match="reset_returns_at_holes"):
        run("reinforce_plus_plus", {"semantics": "openrlhf", "reset_returns_at_holes": True}, rewards=tok, mask=mask)


def test_reinforce_plus_plus_openrlhf():
    tok = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1]], dtype=F64)
    res = run("reinforce_plus_plus", {"semantics": "openrlhf", "gamma": 0.5}, rewards=tok, mask=mask)
    close(res.returns, [[2.5, 3.0, 2.0, 4.0]])  # masked reward dropped, the return runs on through the hole
    valid = torch.tensor([2.5, 3.0, 4.0], dtype=F64)
    close(res.advantages, (res.returns - valid.mean()) / valid.std(unbiased=False))


def test_reinforce_plus_plus_openrlhf_kl_in_reward():
    """k1 KL = logprobs - reference_logprobs = 1 on every token, counted under the mask only."""
    tok = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1]], dtype=F64)
    lp, ref = -torch.ones(1, 4, dtype=F64), -2 * torch.ones(1, 4, dtype=F64)
    res = run("reinforce_plus_plus", {"semantics": "openrlhf", "use_kl_in_reward": True,
                                      "reference_policy_kl_type": "k1", "reference_policy_kl_penalty": 0.1},
              rewards=tok, mask=mask, logprobs=lp, reference_logprobs=ref)
    close(res.returns, [[0.7, 0.8, 0.9, 0.9]])


def test_reinforce_plus_plus_nemo_has_no_returns_and_rejects_gamma():
    assert run("reinforce_plus_plus", None, prompt_ids=IDS, rewards=R).returns is None
    with pytest.raises(InvalidInput, match="config.gamma"):
        run("reinforce_plus_plus", {"gamma": 0.9}, prompt_ids=IDS, rewards=R)


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.5, 0.0])
@pytest.mark.parametrize("T", [1, 7, 64, 200])
def test_verl_returns_kernel_matches_loop(gamma, T):
    gen = torch.Generator().manual_seed(T)
    r = torch.randn(5, T, generator=gen, dtype=F64)
    m = (torch.rand(5, T, generator=gen) < 0.7).to(F64)
    m[0] = 0
    m[1] = 1
    for reset in (False, True):  # verl 0.9.1 (carry across holes) and verl 0.8 (reset)
        close(verl_returns(r, m, gamma, reset), verl_returns_loop(r, m, gamma, reset), tol=1e-10)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_verl_returns_reset_keeps_a_small_segment_next_to_a_huge_reward(gamma):
    """verl 0.8 / skyrl: the segment before a hole holds -0.1 per token (a KL penalty) and the reward 1e19 comes
    after the hole. Its returns are exact (the difference of two cumulative sums gave 0 there)."""
    r = torch.tensor([[-0.1, -0.1, -0.1, 0.0, 1e19]], dtype=F64)
    m = torch.tensor([[1, 1, 1, 0, 1]], dtype=F64)
    want = verl_returns_loop(r, m, gamma, reset_at_holes=True)
    assert want[0, 0] == pytest.approx(-0.1 * (1 + gamma + gamma ** 2))
    torch.testing.assert_close(verl_returns(r, m, gamma, reset_at_holes=True), want, rtol=1e-15, atol=0)


# ---------------------------------------------------------------------------------- gae (verl)
def test_gae_verl_keeps_masked_positions_and_nemo_zeroes_them():
    vals = torch.linspace(-1, 1, 30, dtype=F64).reshape(6, 5)
    tok = torch.zeros(6, 5, dtype=F64)
    tok[torch.arange(6), torch.tensor(LAST).clamp(min=0)] = R
    verl = run("gae", {"semantics": "verl", "gae_lambda": 0.95}, rewards=tok, values=vals)
    nemo = run("gae", {"gae_lambda": 0.95}, rewards=tok, values=vals)
    close(verl.returns, nemo.returns)
    # verl's Bessel factor n / (n - 1) is float32 (its int64 mask sums); NeMo's is exact
    close(verl.advantages * MASK, nemo.advantages, tol=1e-7)
    assert (verl.advantages * (1 - MASK)).abs().sum() > 0  # whitened carry at masked positions


def test_gae_verl_lambda_default_and_nemo_only_fields():
    vals = torch.zeros(6, 5, dtype=F64)
    close(run("gae", {"semantics": "verl"}, rewards=R, values=vals).returns,
          run("gae", {"gae_lambda": 1.0}, rewards=R, values=vals).returns)
    for field, value in [("gae_lambda_value", 0.9), ("gae_lambda_policy", 0.9), ("length_adaptive_alpha", 0.1)]:
        with pytest.raises(InvalidInput, match=f"config.{field}"):
            run("gae", {"semantics": "verl", field: value}, rewards=R, values=vals)


# --------------------------------------------------------------------------------- OTB and TIR
def otb_batch(seed: int, B: int = 9, T: int = 12, isw: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=gen) < 0.75).to(F64)
    mask[2] = 0
    tensors = dict(prompt_ids=torch.tensor([4, 1, 4, 9, 1, 4, 1, 2, 2])[:B], mask=mask,
                   rewards=torch.randn(B, T, generator=gen, dtype=F64) * (torch.rand(B, T, generator=gen) < 0.3),
                   logprobs=-torch.rand(B, T, generator=gen, dtype=F64) * 3,
                   sum_pi_squared=torch.rand(B, T, generator=gen, dtype=F64))
    if isw:
        tensors["rollout_is_weights"] = 0.5 + torch.rand(B, T, generator=gen, dtype=F64)
    return tensors


@pytest.mark.parametrize("name,loop", [("optimal_token_baseline", otb_loop), ("tir_optimal_token_baseline", tir_otb_loop)])
@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_otb_kernels_match_their_loops(name, loop, zero_tail, seed):
    t = otb_batch(seed, isw=seed % 2 == 0)
    res = run(name, {"handle_zero_tail": zero_tail}, **t)
    adv, ret = loop(group_index(t["prompt_ids"]), t["rewards"], t["mask"], t["logprobs"], t["sum_pi_squared"],
                    t.get("rollout_is_weights"), zero_tail, 1e-8)
    close(res.advantages, adv, tol=1e-9)
    close(res.returns, ret, tol=1e-9)


def test_otb_hand_computed_with_zero_tail():
    """pi = 0.5, sum pi^2 = 0.5 -> w = 0.5. Rows share a prompt; row 1 is one token shorter. B_t = 0.5 where
    both rows are valid; with handle_zero_tail row 0's baseline is 0 from t = 2 (the second-longest length)."""
    t = dict(prompt_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0], dtype=F64),
             mask=torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64),
             logprobs=torch.full((2, 3), math.log(0.5), dtype=F64), sum_pi_squared=torch.full((2, 3), 0.5, dtype=F64))
    res = run("optimal_token_baseline", {"handle_zero_tail": True, "epsilon": 0.0}, **t)
    close(res.returns, [[1, 1, 1], [0, 0, 0]])
    close(res.advantages, [[0.5, 0.5, 1.0], [-0.5, -0.5, 0.0]])
    close(run("optimal_token_baseline", {"epsilon": 0.0}, **t).advantages, res.advantages)  # true by default (verl)
    res = run("optimal_token_baseline", {"handle_zero_tail": False, "epsilon": 0.0}, **t)
    close(res.advantages, [[0.5, 0.5, 0.0], [-0.5, -0.5, 0.0]])  # at t = 2 only row 0 is valid: B = G


def test_otb_group_of_one_tied_and_empty_rows():
    t = otb_batch(7, isw=False)
    t["rewards"] = torch.zeros(9, 12, dtype=F64)
    t["rewards"][:, -1] = 1.0  # every row the same reward
    t["mask"][[0, 5]] = t["mask"][1].clone()  # the valid rows of group 4 (rows 0, 5; row 2 is empty) share their mask
    res = run("optimal_token_baseline", None, **t)
    m = t["mask"]
    G = torch.flip(torch.cumsum(torch.flip(t["rewards"] * m, [1]), 1), [1])
    close(res.advantages[3], G[3] * m[3])  # prompt 9 is a group of one: baseline 0
    assert res.advantages[2].abs().sum() == 0  # the empty row
    close(res.advantages[[0, 5]], torch.zeros(2, 12), tol=1e-6)  # tied rows with the same mask: A ~ 0


def test_tir_equals_otb_on_the_compacted_batch():
    """TIR aligns the k-th valid token: on a batch without empty rows it equals OTB run on the same rows
    with their valid tokens moved to the left."""
    t = otb_batch(3)
    t["mask"][2, :3] = 1
    m = t["mask"].bool()
    tir = run("tir_optimal_token_baseline", {"handle_zero_tail": True}, **t)
    compact = {k: torch.zeros_like(v) for k, v in t.items() if v.dim() == 2}
    for i in range(m.shape[0]):
        n = int(m[i].sum())
        for k in compact:
            compact[k][i, :n] = (t[k][i] if k != "mask" else torch.ones_like(t[k][i]))[m[i]]
    otb = run("optimal_token_baseline", {"handle_zero_tail": True}, prompt_ids=t["prompt_ids"], **compact)
    for i in range(m.shape[0]):
        n = int(m[i].sum())
        close(tir.advantages[i][m[i]], otb.advantages[i, :n], tol=1e-9)


# ------------------------------------------------------------------------------- loop twins
@pytest.mark.parametrize("seed", range(6))
def test_group_kernels_match_their_loops(seed):
    gen = torch.Generator().manual_seed(seed)
    B = 40
    group = group_index(torch.randint(0, 9, (B,), generator=gen))
    s = torch.randint(0, 4, (B,), generator=gen).to(F64) * 0.7  # ties within groups, non-dyadic values
    lengths = torch.randint(0, 5, (B,), generator=gen).to(F64)
    for got, want in [
        (verl_group_stats(group, s), verl_group_stats_loop(group, s)),
        ((rloo_scalars(group, s),), (rloo_scalars_loop(group, s),)),
        ((rppb_scalars(group, s, "verl"),), (rppb_scalars_loop(group, s, "verl"),)),
        ((rppb_scalars(group, s, "openrlhf"),), (rppb_scalars_loop(group, s, "openrlhf"),)),
        ((opo_baseline(group, s, lengths),), (opo_baseline_loop(group, s, lengths),)),
        ((grpo_passk_scalars(group, s, True, 1e-6),), (grpo_passk_loop(group, s, True, 1e-6),)),
        ((grpo_passk_scalars(group, s, False, 1e-6),), (grpo_passk_loop(group, s, False, 1e-6),)),
    ]:
        for g, w in zip(got, want):
            close(g, w, tol=1e-12)


@pytest.mark.parametrize("name,config,extra", [
    ("grpo", {"semantics": "verl"}, {}), ("grpo", {"semantics": "openrlhf"}, {}), ("grpo", {"semantics": "trl"}, {}),
    ("grpo_passk", {}, {}), ("rloo", {}, {}), ("rloo", {"semantics": "openrlhf"}, {}),
    ("reinforce_plus_plus_baseline", {}, {}), ("reinforce_plus_plus_baseline", {"semantics": "openrlhf"}, {}),
    ("opo", {}, {}), ("gpg", {}, {}),
])
def test_tied_groups_give_exactly_zero(name, config, extra):
    """Non-dyadic tied rewards (0.7 is not exact in binary): float64 group statistics give exactly 0."""
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    r = torch.tensor([0.7, 0.7, 0.7, 1000.1, 1000.1, 1000.1], dtype=torch.float32)
    res = run(name, config, prompt_ids=ids, rewards=r, mask=torch.ones(6, 4))
    if name in ("reinforce_plus_plus_baseline", "rloo") and config.get("semantics") == "openrlhf":
        assert res.returns.abs().sum() == 0
    else:
        assert res.advantages.abs().sum() == 0


@pytest.mark.parametrize("name,config", [
    ("grpo", {"semantics": "verl"}), ("grpo", {"semantics": "openrlhf"}), ("grpo", {"semantics": "trl"}),
    ("grpo", {"semantics": "nemo_rl"}), ("grpo_passk", {}), ("qae", {}), ("gdpo", {"semantics": "verl"}),
])
def test_tied_groups_with_epsilon_zero_give_zero_not_nan(name, config):
    """epsilon = 0: a tied group's advantage (exactly 0) is not divided by its std of 0, where the references
    give NaN (0 / 0); the untied group is divided by its std alone. These calls used to fail as a float64
    overflow (INVALID_ARGUMENT "... overflowed float64 arithmetic")."""
    ids = torch.tensor([0, 0, 0, 1, 1])
    r = torch.tensor([0.1, 0.1, 0.1, 0.0, 2.0], dtype=F64)
    inputs = {"reward/a": r} if name == "gdpo" else {"rewards": r}
    res = run(name, {**config, "epsilon": 0.0}, prompt_ids=ids, mask=torch.ones(5, 2, dtype=F64), **inputs)
    a = res.advantages[:, 0]
    assert (a[:3] == 0).all(), a
    if name == "grpo_passk":  # the winner's margin 2 over the group's std sqrt(2)
        want = [0.0, math.sqrt(2)]
    elif name == "qae":  # baseline: the 0.4-quantile 0.8 of {0, 2}; std sqrt(2)
        want = [-0.8 / math.sqrt(2), 1.2 / math.sqrt(2)]
    elif name == "gdpo":  # -+1/sqrt(2) and three 0s, whitened over the 10 tokens: mean 0, unbiased var 2/9
        want = [-1 / math.sqrt(2) / math.sqrt(2 / 9), 1 / math.sqrt(2) / math.sqrt(2 / 9)]
    elif config["semantics"] == "nemo_rl":  # leave-one-out: baseline the other sample, std of one: 0 (none)
        want = [-2.0, 2.0]
    else:
        want = [-1 / math.sqrt(2), 1 / math.sqrt(2)]
    torch.testing.assert_close(a[3:], torch.tensor(want, dtype=F64), rtol=1e-7, atol=0)


# ---------------------------------------------------------------------------- config contract
@pytest.mark.parametrize("name,config,field", [
    ("rloo", {"semantics": "nemo_rl"}, "config.semantics"),
    ("reinforce_plus_plus_baseline", {"semantics": "trl"}, "config.semantics"),
    ("gae", {"semantics": "trl"}, "config.semantics"),
    ("rloo", {"semantics": "openrlhf", "reward_clip_min": 20.0}, "config.reward_clip_min"),  # max: default 10
    ("grpo", {"semantics": "openrlhf", "reward_clip_min": 1.0, "reward_clip_max": 1.0}, "config.reward_clip_min"),
    ("grpo", {"semantics": "verl", "use_leave_one_out_baseline": False}, "config.use_leave_one_out_baseline"),
    ("grpo", {"semantics": "verl", "scale_rewards": "batch"}, "config.scale_rewards"),
    ("grpo", {"epsilon": -1.0}, "config.epsilon"),
    ("reinforce_plus_plus", {"semantics": "verl", "minus_baseline": True}, "config.minus_baseline"),
    ("reinforce_plus_plus", {"semantics": "verl", "gamma": 1.5}, "config.gamma"),
    ("gpg", {"f_norm": 0.0}, "config.f_norm"),
    ("optimal_token_baseline", {"epsilon": -1e-8}, "config.epsilon"),
])
def test_bad_config_values_name_the_field(name, config, field):
    with pytest.raises(InvalidInput) as exc:
        run(name, config, prompt_ids=IDS, rewards=R, values=torch.zeros(6, 5))
    assert any(f == field for f, _ in exc.value.violations), exc.value.violations


def test_bad_config_over_grpc_is_invalid_argument(client):
    import grpc
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("rloo", {"semantics": "nemo_rl"}, prompt_ids=IDS.numpy(), rewards=R.numpy().astype(np.float32),
                       mask=MASK.numpy().astype(np.float32))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "config.semantics" in str(exc.value)


def test_unknown_semantics_enum_value_over_grpc(stub_request):
    import grpc
    request, call = stub_request
    request.grpo.semantics = 99
    with pytest.raises(grpc.RpcError) as exc:
        call(request)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.semantics" in exc.value.details()


@pytest.fixture
def stub_request(target):
    import grpc
    from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
    from advantage_client.client import build_request
    request = build_request("grpo", None, prompt_ids=IDS.numpy(), rewards=R.numpy().astype(np.float32),
                            mask=MASK.numpy().astype(np.float32))
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        yield request, lambda req: stub.ComputeAdvantage(req, timeout=30)


def test_config_dict_takes_enum_short_names(client):
    res = client.compute("grpo", {"semantics": "openrlhf", "normalize_rewards": False}, as_numpy=True,
                         prompt_ids=IDS.numpy(), rewards=R.numpy().astype(np.float32), mask=MASK.numpy().astype(np.float32))
    np.testing.assert_allclose(res.advantages, up_to_last([0.5, 0, -0.5, 0, 0, 0]).numpy(), atol=1e-7)
    with pytest.raises(ValueError, match="config.scale_rewards"):
        client.compute("grpo", {"semantics": "trl", "scale_rewards": "per_token"}, prompt_ids=IDS.numpy(),
                       rewards=R.numpy().astype(np.float32), mask=MASK.numpy().astype(np.float32))


# ---------------------------------------------------------------------------------- gdpo (verl)
def test_gdpo_verl_hand_computed():
    """verl 0.9.1 compute_gdpo_outcome_advantage: per-component verl GRPO (a group of one: mean 0 and std 1,
    1 + epsilon in float32), summed, times the mask, then whitened over the 5 valid tokens (row 0 counts
    twice, row 3 is empty) with verl's float32 Bessel factor 5 / 4."""
    ids = torch.tensor([0, 0, 1, 2])
    a = torch.tensor([1.0, 0.0, 2.0, 3.0], dtype=F64)
    b = torch.tensor([1.0, 1.0, 0.0, 5.0], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]], dtype=F64)
    one = float(np.float32(1.0) + np.float32(1e-6))
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    total = torch.tensor([s + 0.0, -s + 0.0, 2.0 / one + 0.0, 3.0 / one + 5.0 / one], dtype=F64)
    x = total[:, None] * mask
    n = 5
    mean = float(x.sum()) / n
    var = float(((x - mean) ** 2 * mask).sum()) / n * float(np.float32(5) / np.float32(4))
    want = (x - mean) / math.sqrt(var + 1e-8) * mask
    res = run("gdpo", {"semantics": "verl"}, prompt_ids=ids, mask=mask, **{"reward/a": a, "reward/b": b})
    close(res.advantages, want)
    assert res.returns is None
    # one component is enough under verl (its fallback: the summed token_level_rewards); nemo_rl needs two
    one_comp = run("gdpo", {"semantics": "verl", "normalize_rewards": False}, prompt_ids=ids, mask=mask,
                   **{"reward/score": a})
    x1 = (a - torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=F64))[:, None] * mask
    m1 = float(x1.sum()) / n
    v1 = float(((x1 - m1) ** 2 * mask).sum()) / n * float(np.float32(5) / np.float32(4))
    close(one_comp.advantages, (x1 - m1) / math.sqrt(v1 + 1e-8) * mask)
    with pytest.raises(InvalidInput, match="reward"):
        run("gdpo", None, prompt_ids=ids, mask=mask, **{"reward/score": a})
    with pytest.raises(InvalidInput, match="use_leave_one_out_baseline"):
        run("gdpo", {"semantics": "verl", "use_leave_one_out_baseline": True}, prompt_ids=ids, mask=mask,
            **{"reward/a": a, "reward/b": b})
