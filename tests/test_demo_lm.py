"""The LM demo: its task, verifier and sampler, what each estimator is sent for one group, that a shortened
seeded run learns through the service, and its CLI (CSV, comparison plot, the advantage-demo dispatcher)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from advantage_server import demo
from advantage_server.demo import lm

# Measured (the defaults, CPU, 1 torch thread): held-out greedy accuracy, warm start -> after 100 RL steps
# (51200 samples)   seed 1: 22.8% -> 56.4%   seed 2: 19.0% -> 22.4%   seed 3: 18.4% -> 38.8%
LEARN_SEED = 1
LEARN_STEPS = 100
MIN_RISE = 0.20


def test_task_encoding_and_verifier():
    pairs = np.array([[42, 917], [999, 999], [0, 0]])
    assert lm.encode_prompts(pairs, 3)[0].tolist() == [0, 4, 2, lm.PLUS, 9, 1, 7, lm.EQUALS]
    target = lm.answers(pairs, 3)
    # 042 + 917 = 0959, written least significant digit first; 999 + 999 = 1998; 0 + 0 = 0000
    assert target.tolist() == [[9, 5, 9, 0, lm.EOS], [8, 9, 9, 1, lm.EOS], [0, 0, 0, 0, lm.EOS]]
    responses = torch.tensor([[9, 5, 9, 0, lm.EOS],        # right
                              [8, 9, 9, 2, lm.EOS],        # one digit wrong
                              [0, 0, lm.EOS, lm.PAD, lm.PAD]])  # stopped early: two digits right
    correct, partial = lm.verify(responses, target)
    assert correct.tolist() == [1.0, 0.0, 0.0]
    assert partial.tolist() == [1.0, 0.75, 0.5]
    assert lm.response_mask(responses).tolist() == [[1] * 5, [1] * 5, [1, 1, 1, 0, 0]]
    assert lm.response_mask(torch.tensor([[1, 2, 3, 4, 5]])).tolist() == [[1] * 5]  # no EOS: all of it


def test_make_problems_avoids_excluded_pairs():
    rng = np.random.default_rng(0)
    exclude = {(a, b) for a in range(10) for b in range(10) if (a + b) % 2}
    pairs = lm.make_problems(rng, 500, 1, exclude)
    assert pairs.shape == (500, 2) and pairs.min() >= 0 and pairs.max() <= 9
    assert not any((int(a), int(b)) in exclude for a, b in pairs)


def test_sampler_logprobs_match_the_policy():
    torch.manual_seed(0)
    policy = lm.TinyLM(13, 32, 1, 2)
    prompts = lm.encode_prompts(np.array([[1, 2], [345, 678], [999, 1]]), 3).repeat_interleave(4, dim=0)
    responses, logprobs = lm.generate(policy, prompts, 5, 1.0, torch.Generator().manual_seed(0))
    assert responses.shape == logprobs.shape == (12, 5)
    mask = lm.response_mask(responses)
    # after the first EOS only PAD, and the sampler's log-probabilities are the policy's
    assert (responses[mask == 0] == lm.PAD).all() and (mask[:, 0] == 1).all()
    with torch.no_grad():
        again = lm.response_logprobs(policy, prompts, responses)
    torch.testing.assert_close(logprobs * mask, again * mask, atol=1e-5, rtol=1e-5)


def make_group(rewards, mask_rows, partial=None, seed=0):
    G, R = len(rewards), len(mask_rows[0])
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    return lm.Group(prompt=lm.encode_prompts(np.array([[12, 34]]), 3)[0],
                    responses=torch.zeros(G, R, dtype=torch.int64), mask=mask,
                    correct=torch.tensor(rewards, dtype=torch.float32),
                    partial=torch.tensor(partial if partial is not None else rewards, dtype=torch.float32),
                    logprobs=-torch.rand(G, R, generator=g) * mask, ref_logprobs=-torch.rand(G, R, generator=g) * mask,
                    teacher_logprobs=-torch.rand(G, R, generator=g) * mask)


MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_group_advantages_from_the_service(client):
    group = make_group([1.0, 0.0, 0.0, 1.0], MASK)
    mask = group.mask.numpy()
    # GRPO (NeMo RL: leave-one-out baseline, divided by the group's std): a correct sample's baseline is
    # 1/3, a wrong one's 2/3; std of (1, 0, 0, 1) is 0.57735
    # (NeMo RL semantics broadcast it to every position, mask 0 included: the loss masks them)
    adv = lm.advantages_for_group(client, "grpo", {}, group)
    expected = np.array([2 / 3, -2 / 3, -2 / 3, 2 / 3]) / np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(adv * mask, expected[:, None] * mask, atol=1e-5)
    # RLOO (verl): reward minus the mean of the other samples, 0 where mask is 0
    adv = lm.advantages_for_group(client, "rloo", {}, group)
    np.testing.assert_allclose(adv, np.array([2 / 3, -2 / 3, -2 / 3, 2 / 3])[:, None] * mask, atol=1e-5)
    # OPD: per-token teacher minus sampling-policy log-probability
    adv = lm.advantages_for_group(client, "opd", {}, group)
    np.testing.assert_allclose(adv, ((group.teacher_logprobs - group.logprobs) * group.mask).numpy(), atol=1e-6)
    # pass@k: only the best sample gets advantage; a tie for the best gives 0 everywhere
    np.testing.assert_array_equal(lm.advantages_for_group(client, "grpo_passk", {}, group), 0.0)
    single = make_group([0.0, 1.0, 0.0, 0.0], MASK)
    adv = lm.advantages_for_group(client, "grpo_passk", {}, single)
    assert (adv[1, :3] > 0).all() and (np.delete(adv, 1, axis=0) == 0).all()


def test_gdpo_and_kl_in_reward(client):
    group = make_group([1.0, 0.0, 0.0, 0.0], MASK, partial=[1.0, 0.75, 0.25, 0.5])
    adv = lm.advantages_for_group(client, "gdpo", {}, group)
    per_row = adv[:, 0]
    np.testing.assert_allclose(adv, per_row[:, None] * np.ones((1, 5)), atol=1e-6)  # NeMo RL: one value per row
    # the correct sample is best; among the wrong ones the partial credit orders them
    assert per_row[0] > per_row[1] > per_row[3] > per_row[2]
    # KL in the reward (REINFORCE++ through the service): a KL penalty moves the advantages
    cfg = lm.LMConfig(estimator="reinforce_plus_plus", kl_coef=0.5, kl_in="reward", kl_type="k1")
    with_kl = lm.advantages_for_group(client, "reinforce_plus_plus", lm.estimator_config(cfg), group)
    without = lm.advantages_for_group(client, "reinforce_plus_plus", {}, group)
    assert with_kl.shape == without.shape == (4, 5)
    assert np.abs((with_kl - without) * group.mask.numpy()).max() > 1e-3


def test_kl_estimators():
    lp, ref = torch.tensor([-0.5, -1.0]), torch.tensor([-1.0, -1.0])
    torch.testing.assert_close(lm.kl_penalty(lp, ref, "k1"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(lm.kl_penalty(lp, ref, "k2"), torch.tensor([0.125, 0.0]))
    torch.testing.assert_close(lm.kl_penalty(lp, ref, "k3"), torch.tensor([math.exp(-0.5) - 1 + 0.5, 0.0]))


def test_grpo_learns_addition(target):
    """CI's shortened seeded run: held-out greedy accuracy rises at least 20 points above the warm start."""
    cfg = lm.LMConfig(seed=LEARN_SEED, max_steps=LEARN_STEPS, target_accuracy=float("inf"), quiet=True,
                      server=target)
    (result,) = lm.train(cfg)
    assert result.warm_accuracy < 0.5, result.warm_accuracy
    assert result.steps == LEARN_STEPS and result.samples == LEARN_STEPS * cfg.prompts_per_step * cfg.group_size
    assert result.final_accuracy >= result.warm_accuracy + MIN_RISE, (result.warm_accuracy, result.final_accuracy)
    assert 0.0 < result.rpc_seconds and 0.0 <= result.wait_seconds < result.wall_seconds


def test_cli_csv_compare_plot_and_dispatcher(tmp_path, capsys, target):
    pytest.importorskip("matplotlib")
    csv_path, png = tmp_path / "lm.csv", tmp_path / "compare.png"
    code = demo.main(["lm", "--compare", "grpo,opd", "--max-steps", "2", "--quiet", "--server", target,
                      "--warm-accuracy", "0", "--teacher-steps", "5", "--csv", str(csv_path), "--plot", str(png)])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert [line.split("]")[0] for line in out[:2]] == ["[grpo", "[opd"], out
    assert out[-1] == f"learning curve written to {png}"
    assert png.stat().st_size > 10_000
    for name in ("grpo", "opd"):
        rows = (tmp_path / f"lm.{name}.csv").read_text().strip().splitlines()
        assert rows[0] == ",".join(lm.CSV_HEADER)
        assert [r.split(",")[:2] for r in rows[1:]] == [["1", "512"], ["2", "1024"]]


def test_cli_rejects_bad_options(capsys):
    assert demo.main(["lm", "--estimator", "ppo", "--max-steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--estimator 'ppo' is not an estimator this demo runs. Choose one of grpo, rloo" in err, err
    assert demo.main(["lm", "--estimator", "grpo", "--kl-coef", "0.1", "--kl-in", "reward", "--max-steps", "1",
                      "--quiet"]) == 2
    assert "--kl-in reward needs" in capsys.readouterr().err
    assert demo.main(["nope"]) == 2
    assert "unknown demo" in capsys.readouterr().err


def test_ctrl_c_keeps_the_steps_measured_and_writes_the_plot(tmp_path, monkeypatch, capsys):
    """`make demo` stopped with Ctrl-C: the steps run so far stay in the CSV and the plot is still written."""
    pytest.importorskip("matplotlib")
    real_update, calls = lm.policy_update, []

    def update(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_update(*args, **kwargs)

    monkeypatch.setattr(lm, "policy_update", update)
    csv_path, png = tmp_path / "lm.csv", tmp_path / "lm.png"
    assert lm.main(["--max-steps", "10", "--warm-accuracy", "0.0", "--csv", str(csv_path), "--plot", str(png)]) == 0
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("step,samples") and [r.split(",")[0] for r in rows[1:]] == ["1", "2"]
    assert png.stat().st_size > 0
    assert "stopped by Ctrl-C after 2 RL steps" in capsys.readouterr().out
