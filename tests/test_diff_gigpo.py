"""Differential test: the released Trinity-RFT's GiGPO (``trinity-rft==0.6.0``, tests/references/requirements.txt;
imported in-process by tests/references/trinity_ref.py) against the service's ``gigpo`` with
``semantics = trinity``, over real gRPC (the ``client`` fixture's server).

Hypothesis generates multi-turn batches: 1..4 tasks (prompt groups), 1..4 trajectories per task (groups
of one trajectory included), 1..6 steps per trajectory (uneven lengths), the rows shuffled (so the batch
order is not the step order; step_index values with gaps), trajectory ids reused across tasks, anchor
states drawn from a small pool per task or from one pool shared by every task (so an anchor is shared by
1..n trajectories, within and across tasks, and groups of one anchor occur), step rewards from a small
set ([B], or token-level [B, T] on random positions), masks with holes and all-zero rows, float32 or
float64, gamma, omega, fnorm (mode) and epsilon varied.

Each batch becomes one Trinity ``Experience`` per step row (``eid.task`` = prompt id, ``eid.run`` =
trajectory id, ``eid.step`` = step_index, ``info["step_reward"]`` = the row's reward,
``info["env_state_hash"]`` = anchor id, ``action_mask`` = the row's mask) for
``GiGPOAdvantageFn(omega, gamma, fnorm, epsilon)``; its ``advantages`` rows are compared with the
service's ``[B, T]`` advantages.

The comparison rule (that of tests/test_diff_verl.py): where mask = 1,
``|service - trinity| <= rtol * |trinity| + atol * scale`` with ``scale = max(1, max |trinity|)``, at the
float32 tolerance (rtol = 2e-4, atol = 2e-5) for every batch, since Trinity computes its statistics in
float32 whatever the input (the service computes in float64 and rounds once to the output dtype); where
mask = 0 both are 0; the service's output is finite everywhere. Rewards come from a small set of dyadic
values, so float32 group statistics do not cancel catastrophically (no rule-2 batches are expected; a
difference fails the test).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from references import trinity_ref
from references.counts import TRIED

GIGPO = trinity_ref.load()
EXP = trinity_ref.experience_module()
EXAMPLES = 300
RTOL, ATOL = 2e-4, 2e-5
REWARDS = (-1.0, -0.5, 0.0, 0.0, 0.5, 1.0, 2.0)


@st.composite
def batches(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_tasks = draw(st.integers(1, 4))
    shared_pool = draw(st.booleans())
    pool_size = draw(st.integers(1, 4))
    rows = []  # (task, run, step, anchor)
    for task in range(n_tasks):
        task_id = int(rng.integers(0, 1000))
        while any(r[0] == task_id for r in rows):
            task_id += 1
        n_runs = draw(st.integers(1, 4))
        runs = rng.choice(8, size=n_runs, replace=False)  # run ids reused across tasks
        for run in runs:
            length = int(rng.integers(1, 7))
            steps = np.sort(rng.choice(20, size=length, replace=False)) if rng.random() < 0.5 else np.arange(length)
            for s in steps:
                base = 0 if shared_pool else 100 * (task + 1)
                rows.append((task_id, int(run), int(s), base + int(rng.integers(0, pool_size))))
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    B = len(rows)
    T = draw(st.integers(1, 5))
    mask = (rng.random((B, T)) < 0.75).astype(np.float32)
    mask[rng.random(B) < 0.1] = 0.0  # some all-zero rows
    r = rng.choice(REWARDS, size=B)
    token_level = draw(st.booleans())
    if token_level:
        rewards = np.zeros((B, T))
        cols = rng.integers(0, T, size=B)
        rewards[np.arange(B), cols] = r  # anywhere in the row, masked positions included
    else:
        rewards = r.copy()
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    config = {"semantics": "trinity",
              "gamma": draw(st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0])),
              "step_advantage_weight": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
              "mode": draw(st.sampled_from(["mean_norm", "mean_std_norm"])),
              "epsilon": draw(st.sampled_from([1e-6, 1e-3]))}
    arr = np.array(rows, dtype=np.int64)
    return {"prompt_ids": arr[:, 0], "trajectory_ids": arr[:, 1], "step_index": arr[:, 2],
            "anchor_ids": arr[:, 3], "rewards": rewards.astype(dtype), "mask": mask, "config": config,
            "step_rewards": r}


def trinity_advantages(case) -> torch.Tensor:
    cfg = case["config"]
    exps = []
    B, T = case["mask"].shape
    for i in range(B):
        exps.append(EXP.Experience(
            eid=EXP.EID(batch=0, task=int(case["prompt_ids"][i]), run=int(case["trajectory_ids"][i]),
                        step=int(case["step_index"][i])),
            tokens=torch.arange(T + 1), prompt_length=1,
            action_mask=torch.as_tensor(case["mask"][i]).bool(),
            info={"step_reward": float(case["step_rewards"][i]), "env_state_hash": int(case["anchor_ids"][i])}))
    fn = GIGPO.GiGPOAdvantageFn(omega=cfg["step_advantage_weight"], gamma=cfg["gamma"],
                                fnorm="std" if cfg["mode"] == "mean_std_norm" else "none", epsilon=cfg["epsilon"])
    out, _ = fn(exps)
    assert [id(e) for e in out] == [id(e) for e in exps]
    return torch.stack([e.advantages.to(torch.float64) for e in out])


def check(case, svc: np.ndarray, ref: torch.Tensor) -> None:
    got = torch.as_tensor(np.asarray(svc, dtype=np.float64))
    assert bool(torch.isfinite(got).all()), "non-finite service output"
    assert got.shape == ref.shape
    sel = torch.as_tensor(case["mask"]).bool()
    assert bool((got[~sel] == 0).all()) and bool((ref[~sel] == 0).all())
    g, w = got[sel], ref[sel]
    if g.numel() == 0:
        return
    scale = max(1.0, float(w.abs().max()))
    bad = (g - w).abs() > RTOL * w.abs() + ATOL * scale
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        pytest.fail(f"gigpo (trinity): {int(bad.sum())} of {g.numel()} masked positions differ, e.g. service "
                    f"{float(g[i])!r} vs Trinity-RFT {trinity_ref.version()} {float(w[i])!r}\ncase={case!r}")


def test_service_matches_released_trinity(client):
    tried = 0

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batches())
    def run(case):
        nonlocal tried
        inputs = {k: case[k] for k in ("prompt_ids", "trajectory_ids", "step_index", "anchor_ids", "rewards", "mask")}
        svc = client.compute("gigpo", case["config"], as_numpy=True, **inputs).advantages
        check(case, svc, trinity_advantages(case))
        tried += 1

    run()
    TRIED["trinity/gigpo"] += tried
    assert tried >= EXAMPLES


def test_installed_trinity_is_the_pinned_release():
    from advantage_client.references import REFERENCES
    assert trinity_ref.version() == REFERENCES["trinity"].release


def test_harness_stubs_nothing_that_computes_an_advantage():
    """The loader's stubs are serialisation (safetensors) and Ray's node address (logging): calling one
    raises, and the GiGPO module, Experience and group_by are Trinity's own files."""
    for name in ("safetensors", "ray"):
        assert name in trinity_ref.STUBS
    assert GIGPO.__file__.endswith("trinity/algorithm/advantage_fn/gigpo_advantage.py")
    assert EXP.__file__.endswith("trinity/common/experience.py")
    assert GIGPO.group_by is EXP.group_by
    stub = trinity_ref._build_stub("safetensors.torch", trinity_ref.STUBS["safetensors.torch"])
    with pytest.raises(trinity_ref.StubUsed):
        stub.save({})
