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
    estimator = example_module().create_remote_advantage_estimator(master_config_for(case), target=target)
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
    readme = (ROOT / "README.md").read_text()
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert "docs/cartpole_learning_curve.png" in pictures
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
