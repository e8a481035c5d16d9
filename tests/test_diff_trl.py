"""Differential tests: the service (over gRPC, ``grpo`` with ``semantics = "trl"``) against the released TRL
(``tests/references/requirements.txt`` pins it; ``tests/references/trl_ref.py`` runs
``GRPOTrainer._generate_and_score_completions`` in-process, the method that computes the advantages).

Every ``scale_rewards`` mode (group, batch, none), at least 200 hypothesis batches each
(``derandomize=True``): what TRL's API can express, i.e. ``num_generations`` n from 1 and prompt groups as
contiguous blocks of n completions (B and T from 1; uneven group sizes cannot be expressed, TRL views the
rewards as [-1, n]); rewards binary, tied, integer, real, large and near-tied,
and ``None`` (an unscorable completion: TRL leaves it out of the group's mean and std and gives it 0);
completion lengths from 0 and multi-turn tool masks with holes (TRL's advantages do not read them; the service
gets the same ``completion_mask * tool_mask``); float32 and float64. The service also gets the rows in a
shuffled order with the prompt ids to match (interleaved groups; integer ids or uid strings), and must give
the same per-row answers. An unscorable completion is sent as TRL users send it to the service: any finite
reward, an all-zero mask row and ``exclude_empty_responses = true``.

Compared at every position (TRL's advantage is one value per completion, applied to every token; the service
broadcasts it over every column).

The rule: y64 is the released method run in float64 (``precise=True``: only the float32 ``rewards_per_func``
that ``_calculate_rewards`` builds is float64 instead). The service computes in float64 and rounds once to
the batch's dtype, so its answer must equal y64 at every position to
    spacing(y64) / 2 + 16 u64 |y64|max + 16 s
spacing(y64) the gap between the batch dtype's numbers at y64 (round to nearest is off by at most half of it,
i.e. about u |y64|, u the unit roundoff of the batch's dtype: this is per position, not relative to the
batch's largest value), u64 |y64|max the float64 arithmetic of the two computations (a few roundings each,
relative to the batch's scale; 16 is a margin over that count), and s, per row, the largest change of y64
when every float64 reward moves by about its last bit (all by (1 + 3 u64), or alternately by (1 +- 2 u64)):
the reference's own sensitivity to the last bit of its input, large only where the answer is
ill-conditioned (near-ties, a group mean far larger than the spread). The released float32 run is not the
comparison target (its own float32 mean and std are off by about u32 times the rewards' size at every
position, more than this rule allows the service): it is run only to count the batches where it lost the
answer (float64 rewards, near-ties, large rewards), i.e. differs from y64 by more than 1e-5 of the batch's
scale; where it does not, the service agrees with TRL as released to that accuracy. TRL 1.16.0 returns
finite advantages for every finite input (``nan_to_num``), so every batch is compared; any disagreement
fails."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from references import strategies, trl_ref
from references.counts import TRIED

N_EXAMPLES = 200
SETTINGS = settings(max_examples=N_EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
MODES = ("group", "batch", "none")
U64 = float(np.finfo(np.float64).eps) / 2
FLOAT32_LOST: dict[str, int] = {}


@st.composite
def batches(draw):
    n = draw(st.integers(1, 5))
    groups = draw(st.integers(1, 4))
    B = n * groups
    T = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    r = draw(strategies.rewards(B, dtype))  # one kind (binary, tied, ...), as the batch's dtype holds them
    if draw(st.booleans()):
        unscorable = draw(st.lists(st.booleans(), min_size=B, max_size=B))
        r = [None if u else x for x, u in zip(r, unscorable)]
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    tool_masks = None
    if draw(st.booleans()):
        tool_masks = [draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)) for k in lengths]
    order = draw(st.permutations(list(range(B)))) if draw(st.booleans()) else list(range(B))
    return dict(n=n, B=B, T=T, dtype=dtype, rewards=r, lengths=lengths, tool_masks=tool_masks,
                order=order, uid_strings=draw(st.booleans()))


def loss_mask(case) -> np.ndarray:
    """TRL's ``completion_mask * tool_mask`` [B, T] (right padding to T)."""
    m = np.zeros((case["B"], case["T"]), dtype=np.int64)
    for i, k in enumerate(case["lengths"]):
        m[i, :k] = 1 if case["tool_masks"] is None else case["tool_masks"][i]
    return m


def last_bit(i: int, pattern: int) -> float:
    """The float64 factor moving reward i by about its last bit: pattern 0 all by (1 + 3 u64) (ties stay
    ties), 1 and 2 by (1 +- 2 u64) alternating (opposite signs)."""
    return 1 + 3 * U64 if pattern == 0 else 1 + 2 * U64 * (-1.0) ** (i + pattern)


def reference(case, mode: str, precise: bool, perturb: int | None = None) -> torch.Tensor:
    rewards = [None if x is None else x * (1.0 if perturb is None else last_bit(i, perturb))
               for i, x in enumerate(case["rewards"])]
    return trl_ref.compute(rewards, case["n"], scale_rewards=mode, completion_lengths=case["lengths"],
                           tool_masks=case["tool_masks"], precise=precise)


def service(client, case, mode: str) -> np.ndarray:
    """The service's [B, T] advantages, in TRL's row order (sent in ``case["order"]``)."""
    order = np.array(case["order"])
    unscorable = np.array([x is None for x in case["rewards"]])
    rewards = np.array([0.0 if x is None else x for x in case["rewards"]])
    mask = loss_mask(case)
    config = {"semantics": "trl", "scale_rewards": mode}
    if unscorable.any():
        mask = np.where(unscorable[:, None], 0, 1)
        config["exclude_empty_responses"] = True
    np_dtype = np.float32 if case["dtype"] == torch.float32 else np.float64
    groups = (np.arange(case["B"]) // case["n"])[order]
    prompt_ids = [f"uid-{g}" for g in groups] if case["uid_strings"] else groups
    out = client.compute("grpo", config, output_dtype=np_dtype.__name__, as_numpy=True,
                         rewards=rewards[order].astype(np_dtype), mask=mask[order], prompt_ids=prompt_ids)
    adv = np.empty((case["B"], case["T"]), dtype=np.float64)
    adv[order] = np.asarray(out.advantages, dtype=np.float64)
    return adv


def check(client, case, mode: str) -> None:
    y64 = reference(case, mode, precise=True).double()
    assert torch.isfinite(y64).all()
    sens = torch.stack([(reference(case, mode, precise=True, perturb=p).double() - y64).abs()
                        for p in range(3)]).amax(0)  # per row: the reference's own last-bit sensitivity
    got = service(client, case, mode)
    want = np.repeat(y64.numpy()[:, None], case["T"], axis=1)
    np_dtype = np.float32 if case["dtype"] == torch.float32 else np.float64
    # per position (module docstring): one rounding to the batch's dtype (half its spacing at y64), float64
    # arithmetic relative to the batch's scale, and the reference's own last-bit sensitivity
    tol = (np.spacing(np.abs(want).astype(np_dtype)).astype(np.float64) / 2
           + 16 * U64 * float(np.abs(want).max()) + 16 * sens.numpy()[:, None])
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"trl scale_rewards={mode}: service != released TRL (float64 run) at {int(bad.sum())} "
                           f"positions: got {got[bad][:5]} want {want[bad][:5]} error {np.abs(got - want)[bad][:5]} "
                           f"tol {np.broadcast_to(tol, got.shape)[bad][:5]}; "
                           f"case {case}")
    native = reference(case, mode, precise=False).double()
    if not np.allclose(native.numpy(), y64.numpy(), rtol=1e-5, atol=1e-5 * max(1.0, float(y64.abs().max()))):
        FLOAT32_LOST[mode] = FLOAT32_LOST.get(mode, 0) + 1
        TRIED[f"trl/grpo scale_rewards={mode} (released float32 lost the answer: float64 run)"] += 1
    TRIED[f"trl/grpo scale_rewards={mode}"] += 1


@pytest.mark.parametrize("mode", MODES)
def test_service_matches_released_trl(client, mode):
    key = f"trl/grpo scale_rewards={mode}"
    before = TRIED[key]

    @SETTINGS
    @given(case=batches())
    def run(case):
        check(client, case, mode)

    run()
    assert TRIED[key] - before >= N_EXAMPLES


@pytest.mark.parametrize("mode", ["group", "batch"])
def test_float32_losses_are_exercised(client, mode):
    """The float64 rule is not vacuous: on a float64 near-tie TRL's float32 ``rewards_per_func`` loses the
    answer (each group's two rewards round to one float32: advantages 0), and the service matches the
    float64 run (non-zero, of opposite signs in each group). The generated batches count such cases in the summary; this one is fixed, so
    the check does not depend on what the generator happened to draw."""
    case = dict(n=2, B=4, T=2, dtype=torch.float64, kind="near_tie", rewards=[100.0, 100.0 + 1e-6, 3.0, 3.0 + 5e-8],
                lengths=[2, 2, 1, 2], tool_masks=None, order=[0, 1, 2, 3], uid_strings=False)
    y64 = reference(case, mode, precise=True).double()
    native = reference(case, mode, precise=False).double()
    assert torch.equal(native, torch.zeros(4, dtype=torch.float64)), native  # float32 lost it
    assert (y64 != 0).all() and (y64[0] < 0 < y64[1]) and (y64[2] < 0 < y64[3]), y64
    check(client, case, mode)  # the service gives the float64 answer


def test_advantages_do_not_depend_on_loss_type():
    """TRL 1.16.0 computes the advantages without reading ``loss_type`` (it only changes how the loss is
    aggregated), so the service has no loss_type-dependent advantage: checked on the released source, and
    on a batch run with each loss type."""
    gt = trl_ref.load()
    assert "loss_type" not in inspect.getsource(gt.GRPOTrainer._generate_and_score_completions)
    outs = [trl_ref.compute([1.0, 0.0, 0.5, 2.0], 2, loss_type=lt) for lt in ("grpo", "bnpo", "dr_grpo", "dapo")]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)


def test_released_code_is_the_pinned_release():
    from advantage_client.references import REFERENCES
    assert trl_ref.version() == REFERENCES["trl"].release
    assert trl_ref.load().__file__.endswith(REFERENCES["trl"].code)


def test_known_values():
    """Hand-checked: two prompts of two completions, rewards [1, 0 | 2, None]: the first group gives
    +-0.5 / (std 0.7071 + 1e-4); the second has one scorable completion (std NaN -> 0) and the unscorable
    one gets 0."""
    out = trl_ref.compute([1.0, 0.0, 2.0, None], 2, precise=True)
    a = 0.5 / (2 ** -0.5 + 1e-4)
    torch.testing.assert_close(out, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64))
