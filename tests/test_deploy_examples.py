"""Trainer integrations: the NeMo RL example (examples/nemo_rl/remote_advantage.py) reproduces NeMo RL's golden
values through a real server, and the CartPole demo writes its per-update CSV and learning-curve PNG."""
from __future__ import annotations

import csv
import json
import importlib.util
import pathlib
import re

import pytest

from conftest import assert_close_to_golden, golden_cases, load_case
from test_golden_nemo import nemo_kwargs

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOSS_KEYS = ("use_kl_in_reward", "reference_policy_kl_penalty", "reference_policy_kl_type")
CASES = ["nemo-rl-grpo-loo1-norm1-interleaved", "nemo-rl-gdpo-c2-w-norm1-loo1-uneven",
         "nemo-rl-rpp-mb1-k3-clamp-interleaved", "nemo-rl-gae-kl-k1-holes", "nemo-rl-opd-edge"]


def example_module():
    path = ROOT / "examples" / "nemo_rl" / "remote_advantage.py"
    spec = importlib.util.spec_from_file_location("remote_advantage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def master_config_for(case: dict) -> dict:
    """A NeMo RL master config holding the case's estimator config under grpo.adv_estimator and its KL keys
    under loss_fn, where NeMo RL keeps them."""
    config = dict(case["config"])
    loss = {k: config.pop(k) for k in LOSS_KEYS if k in config}
    return {"grpo": {"adv_estimator": config}, "loss_fn": {"ratio_clip_min": 0.2, **loss}}


@pytest.mark.parametrize("case_id", CASES)
def test_nemo_rl_example_reproduces_nemo_rl(case_id, target):
    paths = {p.stem: p for p in golden_cases("nemo-rl")}
    case = load_case(paths[case_id])
    estimator = example_module().create_remote_advantage_estimator(master_config_for(case), target=target,
                                                                   result_format="advantage_result")
    result = estimator.compute_advantage(**nemo_kwargs(case))
    assert_close_to_golden(result.advantages.numpy(), case, "advantages")
    if case["expected"]["returns"] is not None:
        assert_close_to_golden(result.returns.numpy(), case, "returns")
    assert set(result.metrics) == set(case["expected"]["metrics"])


def test_nemo_rl_example_falls_back_like_nemo_rl(target, monkeypatch):
    module = example_module()
    assert module.estimator_config({"grpo": {"normalize_rewards": False}}) == {
        "name": "grpo", "normalize_rewards": False, "use_leave_one_out_baseline": False, "minus_baseline": True}
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", target)
    estimator = module.create_remote_advantage_estimator({"grpo": {}, "loss_fn": {}})
    assert estimator.name == "grpo" and estimator.config.use_leave_one_out_baseline is False
    with pytest.raises(ValueError, match="Invalid adv_estimator name"):
        module.create_remote_advantage_estimator({"grpo": {"adv_estimator": {"name": "ppo"}}}, target=target)


# ---------------------------------------------------------------------------------------------------------------
# NeMo RL's released training loops, reduced to what touches the estimator. Mirrors NeMo RL main at
# references.REFERENCES["nemo_rl"]: nemo_rl/algorithms/grpo.py (the async and sync GRPO steps: the mask is
# token_mask * sample_mask, the return value goes straight into train_data["advantages"], OPD's metrics are read
# from adv_estimator.last_metrics, then the advantages are printed with format specs, clamped and masked) and
# nemo_rl/algorithms/ppo.py (a tuple is unpacked into advantages and returns, anything else is the advantages).
def released_grpo_step(adv_estimator, train_data: dict, prompt_ids, rewards, repeated_batch, teacher_logprobs=None,
                       clip_low=-10.0, clip_high=10.0) -> dict:
    import torch
    rollout_metrics: dict = {}
    mask = train_data["token_mask"] * train_data["sample_mask"].unsqueeze(-1)
    train_data["advantages"] = adv_estimator.compute_advantage(
        prompt_ids=prompt_ids, rewards=rewards, mask=mask, repeated_batch=repeated_batch,
        logprobs_policy=train_data["prev_logprobs"], logprobs_reference=train_data.get("reference_policy_logprobs"),
        teacher_logprobs=teacher_logprobs, prev_logprobs=train_data["prev_logprobs"],
        generation_logprobs=train_data["generation_logprobs"], sample_mask=train_data["sample_mask"])
    if hasattr(adv_estimator, "last_metrics") and adv_estimator.last_metrics:
        rollout_metrics.update(adv_estimator.last_metrics)
    advantages = train_data["advantages"]
    print(f"  advantages: min={advantages.min():.4f}, max={advantages.max():.4f}, mean={advantages.mean():.4f}, "
          f"std={advantages.std():.4f}")
    train_data["advantages"] = train_data["advantages"].clamp(min=clip_low).clamp(max=clip_high)
    torch.masked_select(train_data["advantages"], train_data["token_mask"].bool())
    train_data["advantages"].tolist()
    return rollout_metrics


def released_ppo_step(adv_estimator, train_data: dict, prompt_ids, advantage_mask) -> None:
    adv_kwargs = dict(prompt_ids=prompt_ids, rewards=train_data["rewards"], mask=advantage_mask,
                      reference_logprobs=train_data.get("reference_policy_logprobs"),
                      logprobs=train_data["prev_logprobs"])
    if "values" in train_data:
        adv_kwargs["values"] = train_data["values"]
    result = adv_estimator.compute_advantage(**adv_kwargs)
    if isinstance(result, tuple):
        advantages, returns = result
    else:
        advantages, returns = result, None
    train_data["advantages"] = advantages
    if returns is not None:
        train_data["returns"] = returns
    train_data["advantages"].mean()


def run_released_loop(estimator, case: dict) -> tuple[dict, dict]:
    """One case through the loop that NeMo RL runs that estimator in: GRPO's for grpo, gdpo,
    reinforce_plus_plus and opd, PPO's for raw_reward and gae."""
    import torch
    kw = nemo_kwargs(case)
    mask = kw["mask"]
    zeros = torch.zeros_like(mask)
    if case["estimator"] in ("raw_reward", "gae"):
        train_data = {"rewards": kw["rewards"], "prev_logprobs": kw.get("logprobs", zeros),
                      "reference_policy_logprobs": kw.get("reference_logprobs")}
        if "values" in kw:
            train_data["values"] = kw["values"]
        released_ppo_step(estimator, train_data, kw["prompt_ids"], mask)
        return train_data, {}
    prev = kw.get("prev_logprobs", kw.get("logprobs_policy", zeros))
    train_data = {"token_mask": mask, "sample_mask": torch.ones(mask.shape[0]), "prev_logprobs": prev,
                  "generation_logprobs": prev, "reference_policy_logprobs": kw.get("logprobs_reference")}
    metrics = released_grpo_step(estimator, train_data, kw["prompt_ids"], kw.get("rewards"),
                                 kw.get("repeated_batch", {}), teacher_logprobs=kw.get("teacher_logprobs"))
    return train_data, metrics


ALL_NEMO_CASES = {p.stem: p for p in golden_cases("nemo-rl")}
LOOP_CASES = ["nemo-rl-grpo-loo1-norm1-interleaved", "nemo-rl-gdpo-c2-w-norm1-loo1-uneven",
              "nemo-rl-rpp-mb1-k3-clamp-interleaved", "nemo-rl-raw-norm1-edge", "nemo-rl-gae-kl-k1-holes",
              "nemo-rl-opd-edge"]


@pytest.mark.parametrize("case_id", LOOP_CASES)
def test_released_nemo_rl_loop_takes_the_default_result_unchanged(case_id, target, monkeypatch):
    """NeMo RL as released is installed (no AdvantageResult): the example's estimator, built with its defaults,
    returns what NeMo RL's own class returns, and the released loop stores and uses it as a tensor."""
    from test_nemo_dropin import install_fake_nemo_rl
    import torch
    install_fake_nemo_rl(monkeypatch, with_advantage_result=False)
    case = load_case(ALL_NEMO_CASES[case_id])
    estimator = example_module().create_remote_advantage_estimator(master_config_for(case), target=target)
    assert estimator.result_format == "legacy"
    train_data, metrics = run_released_loop(estimator, case)
    advantages = train_data["advantages"]
    assert isinstance(advantages, torch.Tensor) and advantages.dtype == torch.float32
    assert_close_to_golden(advantages.clamp(-10, 10).numpy(), case, "advantages")
    if case["expected"]["returns"] is not None:
        assert_close_to_golden(train_data["returns"].numpy(), case, "returns")
    else:
        assert "returns" not in train_data
    assert set(metrics) == set(case["expected"]["metrics"])
    for key, want in case["expected"]["metrics"].items():
        assert metrics[key] == pytest.approx(want, abs=1e-5, rel=1e-4)


def test_released_nemo_rl_loop_cannot_take_an_advantage_result(target, monkeypatch):
    """The stand-in loop is strict: the PR #3512 form breaks it (so the test above proves the default)."""
    case = load_case(ALL_NEMO_CASES["nemo-rl-grpo-loo1-norm1-interleaved"])
    estimator = example_module().create_remote_advantage_estimator(master_config_for(case), target=target,
                                                                   result_format="advantage_result")
    with pytest.raises((TypeError, AttributeError)):
        run_released_loop(estimator, case)
    gae = load_case(ALL_NEMO_CASES["nemo-rl-gae-kl-k1-holes"])
    estimator = example_module().create_remote_advantage_estimator(master_config_for(gae), target=target,
                                                                   result_format="advantage_result")
    with pytest.raises(AttributeError):  # an AdvantageResult is no tuple: stored whole, .mean() fails
        run_released_loop(estimator, gae)


def test_pr3512_nemo_rl_gets_an_advantage_result(target, monkeypatch):
    """A NeMo RL that defines AdvantageResult (PR #3512) is installed: "auto" returns AdvantageResult, whose
    fields that PR's loops read (train_data["advantages"] = result.advantages; result.returns; result.metrics)."""
    from test_nemo_dropin import install_fake_nemo_rl
    from advantage_client import AdvantageResult
    install_fake_nemo_rl(monkeypatch, with_advantage_result=True)
    for case_id in ("nemo-rl-opd-edge", "nemo-rl-gae-kl-k1-holes"):
        case = load_case(ALL_NEMO_CASES[case_id])
        estimator = example_module().create_remote_advantage_estimator(master_config_for(case), target=target)
        result = estimator.compute_advantage(**nemo_kwargs(case))
        assert isinstance(result, AdvantageResult)
        assert_close_to_golden(result.advantages.numpy(), case, "advantages")
        assert set(result.metrics) == set(case["expected"]["metrics"])
        assert (result.returns is None) == (case["expected"]["returns"] is None)


def test_example_reads_nemo_rl_pydantic_master_config(target):
    """NeMo RL main's MasterConfig is a pydantic model (attribute sections, model_dump()), not a dict."""
    class Section:
        def __init__(self, **fields):
            self.__dict__.update(fields)

        def model_dump(self):
            return {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in self.__dict__.items()}
    master = Section(grpo=Section(adv_estimator=Section(name="reinforce_plus_plus", normalize_rewards=True,
                                                        use_leave_one_out_baseline=True, reward_weights=None,
                                                        minus_baseline=False),
                                  advantage_clip_low=None),
                     loss_fn=Section(use_kl_in_reward=True, reference_policy_kl_penalty=0.05,
                                     reference_policy_kl_type="k1", ratio_clip_min=0.2))
    estimator = example_module().create_remote_advantage_estimator(master, target=target)
    assert estimator.name == "reinforce_plus_plus"
    assert estimator.config.minus_baseline is False and estimator.config.use_kl_in_reward is True
    assert estimator.config.reference_policy_kl_penalty == 0.05


def test_cartpole_demo_writes_csv_and_learning_curve(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("matplotlib")
    from advantage_server.demo.cartpole import main

    csv_path, png = tmp_path / "run" / "cartpole.csv", tmp_path / "run" / "cartpole.png"
    csv_path.parent.mkdir()
    rc = main(["cartpole", "--total-steps", "2048", "--target-return", "inf", "--quiet", "--csv", str(csv_path),
               "--plot", str(png)])
    assert rc == 0
    rows = list(csv.DictReader(csv_path.open()))
    assert [int(r["update"]) for r in rows] == [1, 2, 3, 4]
    assert [int(r["env_steps"]) for r in rows] == [512, 1024, 1536, 2048]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 200_000


def test_readme_shows_the_committed_learning_curve():
    # the CartPole demo's section moved from the README to docs/demos.md (issue #29): a picture path relative to it
    page = (ROOT / "docs" / "demos.md").read_text()
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page)
    assert "cartpole_learning_curve.png" in pictures
    png = ROOT / "docs" / "cartpole_learning_curve.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 100_000


def test_bench_report_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from advantage_server.bench.plot import main as plot_main
    from advantage_server.bench.plot import plot_report

    rows = [dict(section="kernel", estimator="gae", size="64x256x8", impl="ours: estimator (in-process)", ms=0.25),
            dict(section="kernel", estimator="gae", size="64x256x8", impl="ref: per-time-step loop", ms=31.0),
            dict(section="kernel", estimator="gae", size="64x256x8", impl="ref: skipped", ms=None),
            dict(section="memory", estimator="gae", size="64x256x8", impl="core.compute peak extra RSS", ms=None,
                 extra_mib=0.4)]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"argv": ["advantage-bench"], "rows": rows}))
    png = tmp_path / "bench.png"
    assert plot_main([str(report), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_report({"rows": rows}, tmp_path / "again.png") == 3
