"""The CartPole PPO demo: its rollout-to-segments split matches per-step GAE, it learns, and its CLI runs."""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("gymnasium")

from advantage_server.demo.cartpole import (NOT_ENDED, TERMINATED, TRUNCATED, PPOConfig, Rollout, main,
                                            service_gae, train)

# Measured (40960 env steps, no early stop, CPU): mean return of the first 20 / last 20 episodes
#   seed 1: 21.4 / 183.5   seed 2: 18.7 / 244.6   seed 3: 19.3 / 200.7   seed 4: 20.0 / 244.9   seed 5: 19.9 / 196.9
LEARN_STEPS = 40960
LEARN_SEED = 1
MIN_FINAL_RETURN = 100.0
MIN_IMPROVEMENT = 3.0


def reference_gae(ro: Rollout, gamma: float, lam: float) -> np.ndarray:
    """Per-env backward loop over the ``[N, E]`` rollout, restarting at every episode end."""
    N, E = ro.rewards.shape
    adv = np.zeros((N, E))
    for e in range(E):
        running = 0.0
        for t in reversed(range(N)):
            if ro.ends[t, e] != NOT_ENDED or t == N - 1:
                next_value, running = ro.cut_values[t, e], 0.0
            else:
                next_value = ro.values[t + 1, e]
            running = ro.rewards[t, e] + gamma * next_value - ro.values[t, e] + gamma * lam * running
            adv[t, e] = running
    return adv


def test_service_gae_matches_per_env_loop(client):
    rng = np.random.default_rng(0)
    N, E = 60, 3
    ends = np.where(rng.random((N, E)) < 0.1, TERMINATED, NOT_ENDED).astype(np.int8)
    ends[rng.random((N, E)) < 0.05] = TRUNCATED
    ends[0, 0] = TERMINATED  # a one-step segment
    cut_values = np.where(ends == TERMINATED, 0.0, rng.normal(size=(N, E))).astype(np.float32)
    ro = Rollout(obs=np.zeros((N, E, 4), np.float32), actions=np.zeros((N, E), np.int64),
                 logprobs=np.zeros((N, E), np.float32), rewards=rng.normal(size=(N, E)).astype(np.float32),
                 values=rng.normal(size=(N, E)).astype(np.float32), ends=ends, cut_values=cut_values)
    advantages, returns = service_gae(client, ro, 0.99, 0.95)
    expected = reference_gae(ro, 0.99, 0.95)
    np.testing.assert_allclose(advantages, expected, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(returns, expected + ro.values, atol=1e-4, rtol=1e-4)


def test_ppo_learns_cartpole(target):
    result = train(PPOConfig(total_steps=LEARN_STEPS, seed=LEARN_SEED, target_return=math.inf, quiet=True,
                             server=target))
    first = float(np.mean(result.episode_returns[:20]))
    assert result.env_steps == LEARN_STEPS
    assert len(result.episode_returns) >= 40
    assert result.final_mean_return >= MIN_FINAL_RETURN, (first, result.final_mean_return)
    assert result.final_mean_return >= MIN_IMPROVEMENT * first, (first, result.final_mean_return)
    assert 0.0 < result.rpc_seconds < result.wall_seconds


def test_cli_end_to_end(tmp_path, capsys):
    csv_path = tmp_path / "run.csv"
    code = main(["cartpole", "--total-steps", "2048", "--quiet", "--seed", "3", "--csv", str(csv_path)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("final mean return "), lines
    assert "env steps 2048" in lines[0]
    rows = csv_path.read_text().strip().splitlines()
    assert rows[0] == "update,env_steps,mean_return,rpc_share,wall_s"
    assert [r.split(",")[1] for r in rows[1:]] == ["512", "1024", "1536", "2048"]
