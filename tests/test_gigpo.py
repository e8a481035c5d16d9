"""GiGPO (server/advantage_server/estimators/gigpo.py): hand-computed cases per semantics, the vectorised kernel
against its loop twin, the segmented discounted scan, the input conventions (step order, token-level rewards,
trajectory ids per prompt group), packed and per-sample layouts, errors and the ListEstimators entry.

The released references are checked elsewhere: Trinity-RFT in tests/test_diff_gigpo.py (in-process,
hypothesis batches), verl-agent by golden cases in tests/test_golden_gigpo.py.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from advantage_client import AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_server.estimators import jit
from advantage_server.estimators.gigpo import gigpo_loop, gigpo_scalars, segmented_discounted_returns

# One hand-sized batch (batch order):
#   row 0: prompt 0, trajectory 0, step 0, anchor 1, r = 0
#   row 1: prompt 0, trajectory 0, step 1, anchor 2, r = 1
#   row 2: prompt 0, trajectory 1, step 0, anchor 1, r = 3
#   row 3: prompt 1, trajectory 0, step 0, anchor 1, r = 2      (a prompt group of one trajectory, one row)
# gamma = 0.5: R = 1 (prompt 0 / traj 0), 3 (prompt 0 / traj 1), 2 (prompt 1 / traj 0);
# G = 0 + 0.5 * 1 = 0.5 (row 0), 1 (row 1), 3 (row 2), 2 (row 3).
HAND = dict(prompt_ids=np.array([0, 0, 0, 1]), trajectory_ids=np.array([0, 0, 1, 0]),
            step_index=np.array([0, 1, 0, 0]), anchor_ids=np.array([1, 2, 1, 1]),
            rewards=np.array([0.0, 1.0, 3.0, 2.0]))
MASK = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=np.float64)
S3 = math.sqrt(3.0)
HAND_EXPECTED = {
    # verl_agent: A_E over prompt 0's rows, R = [1, 1, 3], mean 5/3 -> -2/3, -2/3, 4/3; prompt 1 (one row):
    # mean 0 -> A_E = 2. Step groups within a prompt: (0, anchor 1) = rows 0, 2: G = [0.5, 3], mean 1.75 ->
    # -1.25, 1.25; rows 1 and 3 are alone -> 0.
    ("verl_agent", "mean_norm"): [-2 / 3 - 1.25, -2 / 3, 4 / 3 + 1.25, 2.0],
    # same groups, divided by the sample std: episode std sqrt((4/9 + 4/9 + 16/9) / 2) = 2/sqrt(3) ->
    # -1/sqrt(3), -1/sqrt(3), 2/sqrt(3); a group of one row: 2 / (1 + 0). Step std sqrt(2 * 1.25^2) ->
    # -+1/sqrt(2).
    ("verl_agent", "mean_std_norm"): [-1 / S3 - 1 / math.sqrt(2), -1 / S3, 2 / S3 + 1 / math.sqrt(2), 2.0],
    # trinity: A_E over prompt 0's trajectories, R = [1, 3], mean 2 -> -1, 1; prompt 1: one trajectory,
    # mean 0 -> 2. Step groups across the batch: anchor 1 = rows 0, 2, 3: G = [0.5, 3, 2], mean 11/6 ->
    # -4/3, 7/6, 1/6; anchor 2 = row 1 alone -> 0.
    ("trinity", "mean_norm"): [-1 - 4 / 3, -1.0, 1 + 7 / 6, 2 + 1 / 6],
    # roll: A_E as verl_agent but a group of one row gives 2 - 2 = 0; A_S as trinity.
    ("roll", "mean_norm"): [-2 / 3 - 4 / 3, -2 / 3, 4 / 3 + 7 / 6, 0 + 1 / 6],
}


@pytest.mark.parametrize("semantics, mode", sorted(HAND_EXPECTED))
def test_hand_computed_over_grpc(client, semantics, mode):
    cfg = {"semantics": semantics, "mode": mode, "gamma": 0.5, "epsilon": 0.0, "step_advantage_weight": 1.0}
    got = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, mask=MASK, **HAND).advantages
    want = np.asarray(HAND_EXPECTED[semantics, mode])[:, None] * MASK
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_step_advantage_weight_scales_the_step_part_only(client):
    base = {"semantics": "trinity", "gamma": 0.5, "epsilon": 0.0}
    a_e = np.array([-1.0, -1.0, 1.0, 2.0])           # trinity's A_E above
    a_s = np.array([-4 / 3, 0.0, 7 / 6, 1 / 6])      # trinity's A_S above
    for w in (0.0, 0.5, 3.0):
        got = client.compute("gigpo", {**base, "step_advantage_weight": w}, output_dtype="float64", as_numpy=True,
                             mask=MASK, **HAND).advantages
        np.testing.assert_allclose(got, (a_e + w * a_s)[:, None] * MASK, rtol=1e-12, atol=1e-12)


def test_trinity_divides_by_one_plus_epsilon_in_mean_norm(client):
    cfg = {"semantics": "trinity", "gamma": 0.5, "epsilon": 0.25}
    got = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, mask=MASK, **HAND).advantages
    want = np.asarray(HAND_EXPECTED["trinity", "mean_norm"]) / 1.25
    np.testing.assert_allclose(got, want[:, None] * MASK, rtol=1e-12)


def scalars(semantics, mode, eps=1e-6, gamma=0.5, **over):
    t = {k: torch.as_tensor(v) for k, v in {**HAND, **over}.items()}
    return gigpo_scalars(t["prompt_ids"], t["trajectory_ids"], t["step_index"], t["anchor_ids"], t["rewards"],
                         gamma, 1.0, mode, eps, semantics)


def test_zero_std_and_groups_of_one_under_mean_std_norm():
    # two trajectories of prompt 0 with equal R (1 and 1) and distinct anchors: the episode std is 0
    over = dict(rewards=np.array([0.0, 1.0, 1.0, 2.0]), anchor_ids=np.array([1, 2, 3, 4]))
    # verl_agent: (x - mean) / (0 + eps) = 0 for the tied group; the group of one row: R / (1 + eps)
    torch.testing.assert_close(scalars("verl_agent", "mean_std_norm", **over),
                               torch.tensor([0.0, 0.0, 0.0, 2 / (1 + 1e-6)], dtype=torch.float64))
    # roll: a group with std <= epsilon or one row gives 0
    torch.testing.assert_close(scalars("roll", "mean_std_norm", **over), torch.zeros(4, dtype=torch.float64))
    # trinity: the group of one trajectory: R / (1 + eps)
    torch.testing.assert_close(scalars("trinity", "mean_std_norm", **over),
                               torch.tensor([0.0, 0.0, 0.0, 2 / (1 + 1e-6)], dtype=torch.float64))


def test_epsilon_zero_with_tied_values_is_finite(client):
    tied = {**HAND, "rewards": np.array([0.1, 0.1, 0.2, 0.3]), "anchor_ids": np.array([5, 5, 5, 5])}
    for sem in ("verl_agent", "trinity", "roll"):
        got = client.compute("gigpo", {"semantics": sem, "mode": "mean_std_norm", "epsilon": 0.0, "gamma": 1.0},
                             as_numpy=True, mask=MASK, **tied).advantages
        assert np.isfinite(got).all()


# Tied groups whose value is not dyadic: a mean taken as sum / n misses 0.1 by an ulp in float64
# (0.1 + 0.1 + 0.1 = 0.30000000000000004), so the deviations were +-1 ulp and, with epsilon = 0, their
# ratio to a std of the same size gave +-sqrt((n - 1) / n) (-0.8165 at n = 3) instead of 0.
TIED_EPISODES = {"prompt_ids": np.array([0, 0, 0]), "trajectory_ids": np.array([0, 1, 2]),
                 "anchor_ids": np.array([1, 2, 3]), "rewards": np.array([0.1, 0.1, 0.1]), "mask": np.ones((3, 1))}
# a step group (anchor 7) tied at 0.1 beside a lone anchor 8; the episode group {0.1, 0.1, 0.1, 0.5} has
# mean 0.2 and sample std 0.2: A_E = -0.5 (three times), 1.5; A_S = 0 (tied group, group of one)
TIED_STEPS = {"prompt_ids": np.array([0, 0, 0, 0]), "trajectory_ids": np.array([0, 1, 2, 3]),
              "anchor_ids": np.array([7, 7, 7, 8]), "rewards": np.array([0.1, 0.1, 0.1, 0.5]),
              "mask": np.ones((4, 1))}


@pytest.mark.parametrize("semantics", ["verl_agent", "trinity", "roll"])
def test_tied_float64_groups_with_epsilon_zero_give_exactly_zero(client, semantics):
    cfg = {"semantics": semantics, "mode": "mean_std_norm", "epsilon": 0.0}
    got = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, **TIED_EPISODES).advantages
    np.testing.assert_array_equal(got, np.zeros((3, 1)))
    got = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, **TIED_STEPS).advantages[:, 0]
    np.testing.assert_allclose(got, [-0.5, -0.5, -0.5, 1.5], rtol=1e-12)
    assert got[0] == got[1] == got[2]


NUMBA = [True, False] if jit._numba is not None else [False]


@pytest.mark.parametrize("numba", NUMBA)  # the group statistics' numba (CPU) and torch (GPU) paths
@pytest.mark.parametrize("semantics", ["verl_agent", "trinity", "roll"])
@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
def test_tied_groups_are_exact_for_any_value_and_size(numba, semantics, mode):
    """n trajectories of one step, all with reward v, sharing one anchor: every A_E and A_S is exactly 0
    (epsilon 0 and 1e-6), whatever v's rounding; and the loop twin agrees bit for bit."""
    for v in (0.1, 0.7, 1 / 3, 0.3, 1e-3, 123.456):
        for n in range(2, 10):
            g, t = torch.zeros(n, dtype=torch.int64), torch.arange(n)
            a = torch.full((n,), 5)
            r = torch.full((n,), v, dtype=torch.float64)
            for eps in (0.0, 1e-6):
                with jit.use_numba(numba):
                    got = gigpo_scalars(g, t, None, a, r, 0.95, 1.0, mode, eps, semantics)
                assert (got == 0).all(), (v, n, eps, got)
                assert (gigpo_loop(g, t, None, a, r, 0.95, 1.0, mode, eps, semantics) == 0).all()


# ------------------------------------------------------------------------------------ kernel vs loop
def random_batch(seed: int):
    """Uneven trajectories (1..7 steps), 1..4 trajectories per prompt group (groups of one included),
    anchors from a small pool per group or shared by all groups (an anchor on 1..n trajectories),
    rows shuffled, step indices with gaps and occasional ties, trajectory ids reused across groups."""
    rng = np.random.default_rng(seed)
    rows = []
    shared = rng.random() < 0.5
    pool = int(rng.integers(1, 5))
    for g in range(int(rng.integers(1, 5))):
        for t in rng.choice(6, size=int(rng.integers(1, 5)), replace=False):
            L = int(rng.integers(1, 8))
            steps = rng.integers(0, 10, size=L) if rng.random() < 0.2 else np.arange(L) * 2
            for s in steps:
                rows.append((g * 7 % 5, int(t), int(s), int(rng.integers(0, pool)) + (0 if shared else 10 * g)))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    arr = torch.tensor(rows, dtype=torch.int64)
    r = torch.as_tensor(rng.choice([-1.0, 0.0, 0.5, 1.0, 3.0], size=len(rows)) + rng.normal(0, 0.1, len(rows)))
    return arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], r


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("semantics", ["verl_agent", "trinity", "roll"])
@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
def test_kernel_matches_loop_twin(seed, semantics, mode):
    g, t, s, a, r = random_batch(seed)
    gamma = [0.0, 0.5, 0.95, 1.0][seed % 4]
    w = [1.0, 0.5, 2.0][seed % 3]
    step = None if seed % 5 == 0 else s
    got = gigpo_scalars(g, t, step, a, r, gamma, w, mode, 1e-6, semantics)
    want = gigpo_loop(g, t, step, a, r, gamma, w, mode, 1e-6, semantics)
    # both take a tied group's mean as its value exactly (no rounding noise for mean_std_norm to divide by
    # 0 + epsilon); elsewhere they sum in different orders
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.999, 1.0])
def test_segmented_scan_matches_the_recursion(gamma):
    rng = np.random.default_rng(1)
    lengths = [1, 2, 3, 5000, 17, 1, 64]
    x = torch.as_tensor(rng.normal(size=sum(lengths)))
    seg_end = torch.as_tensor(np.repeat(np.cumsum(lengths) - 1, lengths))
    got = segmented_discounted_returns(x, seg_end, gamma)
    want, start = torch.empty_like(x), 0
    for L in lengths:
        running = 0.0
        for i in reversed(range(start, start + L)):
            running = float(x[i]) + gamma * running
            want[i] = running
        start += L
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------ input conventions
def test_step_index_orders_the_steps_and_may_be_omitted(client):
    base = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK, **HAND).advantages
    no_step = {k: v for k, v in HAND.items() if k != "step_index"}
    same = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK, **no_step).advantages
    np.testing.assert_array_equal(base, same)  # the batch order is the step order here
    # rows permuted: with step_index the answer is permuted with them; without it the order changes G
    perm = np.array([1, 3, 2, 0])
    permuted = {k: v[perm] for k, v in HAND.items()}
    got = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK[perm], **permuted).advantages
    np.testing.assert_allclose(got, base[perm], rtol=1e-12, atol=1e-12)
    permuted.pop("step_index")
    other = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK[perm], **permuted).advantages
    assert not np.allclose(other, base[perm])


def test_token_level_rewards_are_summed_per_row(client):
    r2 = np.zeros((4, 3))
    r2[:, 2] = HAND["rewards"] - 1.0
    r2[:, 0] = 1.0  # on a masked position of row 2: still counted (summed over all T)
    token = {**HAND, "rewards": r2}
    a = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK, **HAND).advantages
    b = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK, **token).advantages
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_trajectory_ids_are_per_prompt_group(client):
    # prompt 1's trajectory 0 is not prompt 0's trajectory 0: relabelling it changes nothing
    relabelled = {**HAND, "trajectory_ids": np.array([0, 0, 1, 9])}
    a = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK, **HAND).advantages
    b = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK, **relabelled).advantages
    np.testing.assert_array_equal(a, b)


def test_packed_layout_equals_padded(client):
    lengths = np.array([2, 1, 0, 3])
    cu = np.concatenate([[0], np.cumsum(lengths)])
    padded_mask = (np.arange(3)[None, :] < lengths[:, None]).astype(np.float32)
    dense = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=padded_mask, **HAND).advantages
    flat = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, cu_seqlens=cu, **HAND).advantages
    np.testing.assert_array_equal(flat, dense[padded_mask.astype(bool)])


def test_per_sample_result_is_broadcast_times_mask(client):
    res = client.compute("gigpo", None, per_sample=True, output_dtype="float64", as_numpy=True, mask=MASK, **HAND)
    assert res.layout == "broadcast_times_mask"
    dense = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK, **HAND).advantages
    np.testing.assert_array_equal(np.asarray(res.advantages)[:, None] * MASK, dense)


# ------------------------------------------------------------------------------------ errors and listing
@pytest.mark.parametrize("missing", ["trajectory_ids", "anchor_ids", "prompt_ids", "rewards"])
def test_missing_input_is_invalid_argument_naming_it(client, missing):
    inputs = {k: v for k, v in HAND.items() if k != missing}
    with pytest.raises(AdvantageServiceError) as info:
        client.compute("gigpo", None, mask=MASK, **inputs)
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert any(missing in f for f, _ in info.value.field_violations), info.value.field_violations


@pytest.mark.parametrize("config, field", [
    ({"gamma": 1.5}, "config.gamma"), ({"gamma": -0.1}, "config.gamma"), ({"epsilon": -1.0}, "config.epsilon"),
    ({"semantics": "verl"}, "config.semantics"), (pb.GiGPOConfig(mode=9), "config.mode")])
def test_bad_config_is_invalid_argument(client, config, field):
    with pytest.raises(AdvantageServiceError) as info:
        client.compute("gigpo", config, mask=MASK, **HAND)
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert any(f == field for f, _ in info.value.field_violations), info.value.field_violations


def _sha256(labels):
    return [hashlib.sha256(x.encode()).digest() for x in labels]


def test_anchor_hint_gives_a_signed_int64_recipe(client):
    """The missing-input message tells how to make an int64 anchor hash: 8 digest bytes read with
    signed=True (unsigned, 'a' hashes to 14598278634844962250 >= 2^63, which no int64 array holds) or the
    whole digest as uint8 rows; the recipe's ids work as anchors."""
    inputs = {k: v for k, v in HAND.items() if k != "anchor_ids"}
    with pytest.raises(AdvantageServiceError) as info:
        client.compute("gigpo", None, mask=MASK, **inputs)
    text = dict(info.value.field_violations)["inputs['anchor_ids']"]
    assert "signed=True" in text and "uint8 rows [B, 32]" in text, text
    labels = ["a", "b", "a", "c"]  # the anchors of HAND: 1, 2, 1, 1 -> use a, b, a, c (distinct for row 3)
    assert int.from_bytes(_sha256(labels)[0][:8], "big") >= 2**63
    hashed = np.array([int.from_bytes(d[:8], "big", signed=True) for d in _sha256(labels)], dtype=np.int64)
    want = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK,
                          **{**HAND, "anchor_ids": np.array([1, 2, 1, 3])}).advantages
    got = client.compute("gigpo", None, output_dtype="float64", as_numpy=True, mask=MASK,
                         **{**HAND, "anchor_ids": hashed}).advantages
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("semantics", ["verl_agent", "trinity", "roll"])
def test_ids_as_integer_rows(client, semantics):
    """anchor_ids as the whole sha256 digests (uint8 [B, 32]) and trajectory_ids as [B, 2] rows group the
    rows as the equivalent [B] ids do (equal rows, equal ids)."""
    cfg = {"semantics": semantics, "gamma": 0.5}
    want = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, mask=MASK,
                          **{**HAND, "anchor_ids": np.array([1, 2, 1, 3])}).advantages
    digests = np.frombuffer(b"".join(_sha256(["a", "b", "a", "c"])), dtype=np.uint8).reshape(4, 32)
    traj_rows = np.array([[5, 0], [5, 0], [5, 1], [5, 0]])  # trajectories 0, 0, 1, 0 of HAND
    got = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, mask=MASK,
                         **{**HAND, "anchor_ids": digests, "trajectory_ids": traj_rows}).advantages
    np.testing.assert_array_equal(got, want)
    assert np.abs(want).max() > 0.1


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_ids_as_labels_the_client_reduces(client, transport):
    """The client reduces trajectory_ids and anchor_ids as it reduces prompt_ids: uint64 hashes (8 bytes of a
    sha256, unsigned), Python ints beyond int64 and string labels (verl-agent's anchor observations) group the
    rows as the equivalent small ids do."""
    cfg = {"semantics": "verl_agent", "gamma": 0.5}
    want = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, mask=MASK, transport=transport,
                          **{**HAND, "anchor_ids": np.array([1, 2, 1, 3])}).advantages
    unsigned = [int.from_bytes(d[:8], "big") | (1 << 63) for d in _sha256(["a", "b", "a", "c"])]  # all >= 2**63
    for anchors in (np.array(unsigned, dtype=np.uint64), unsigned, ["obs a", "obs b", "obs a", "obs c"],
                    np.array(["obs a", "obs b", "obs a", "obs c"])):
        got = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, mask=MASK, transport=transport,
                             **{**HAND, "anchor_ids": anchors}).advantages
        np.testing.assert_array_equal(got, want, err_msg=repr(anchors))
    traj = [f"episode-{t}" for t in np.asarray(HAND["trajectory_ids"]).tolist()]
    got = client.compute("gigpo", cfg, output_dtype="float64", as_numpy=True, mask=MASK, transport=transport,
                         **{**HAND, "anchor_ids": np.array([1, 2, 1, 3]), "trajectory_ids": traj}).advantages
    np.testing.assert_array_equal(got, want)
    assert np.abs(want).max() > 0.1


def test_float_ids_are_invalid_argument(client):
    with pytest.raises(AdvantageServiceError) as info:
        client.compute("gigpo", None, mask=MASK, **{**HAND, "anchor_ids": HAND["anchor_ids"].astype(np.float32)})
    assert any("anchor_ids" in f for f, _ in info.value.field_violations)


def test_listing(client):
    info = next(e for e in client.list_estimators().estimators if e.name == "gigpo")
    req = {i.name for i in info.inputs if i.required}
    opt = {i.name for i in info.inputs if not i.required}
    assert req == {"prompt_ids", "rewards", "mask", "trajectory_ids", "anchor_ids"} and opt == {"step_index"}
    fields = {f.name: f for f in info.config_fields}
    assert fields["gamma"].default_value == "0.95 (verl_agent, roll); 1.0 (trinity)"
    assert list(fields["semantics"].allowed_values) == ["verl_agent", "trinity", "roll"]
    assert list(fields["mode"].allowed_values) == ["mean_norm", "mean_std_norm"]
    assert not info.produces_returns


def test_unknown_semantics_names_only_the_offered_values():
    """An unknown Semantics number lists what gigpo offers (not nemo_rl, verl, ... which it refuses)."""
    from advantage_client.proto import advantage_pb2 as pb
    from advantage_server.core import config_from_proto
    from advantage_server.errors import InvalidInput
    from advantage_server.estimators import registry

    msg = pb.GiGPOConfig(semantics=99)
    with pytest.raises(InvalidInput) as info:
        config_from_proto(registry.REGISTRY["gigpo"], msg)
    text = str(info.value)
    assert "SEMANTICS_VERL_AGENT, SEMANTICS_TRINITY, SEMANTICS_ROLL" in text and "NEMO_RL" not in text
