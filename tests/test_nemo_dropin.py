"""The NeMo RL drop-in (advantage_client.nemo.RemoteAdvantageEstimator): what ``result_format`` returns, how
"auto" reads the installed NeMo RL, the dtype NeMo RL's classes give, and the warning for a misspelt config key.

The return types were checked against NeMo RL main at references.REFERENCES["nemo_rl"]
(nemo_rl/algorithms/advantage_estimator.py): GRPO/GDPO/Reinforce++/OPD return the [B, T] tensor, RawReward
``(advantages, None)``, GAE ``(advantages, returns)``; OPD keeps its metrics in ``last_metrics``.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import warnings

import pytest
import torch

from advantage_client import AdvantageClient, AdvantageResult, RemoteAdvantageEstimator
from advantage_client import nemo
from advantage_client.nemo import NEMO_ESTIMATOR_MODULE, one_edit_apart, resolve_result_format


def install_fake_nemo_rl(monkeypatch, *, with_advantage_result: bool):
    """Put a stand-in ``nemo_rl`` package in sys.modules: as released (no AdvantageResult) or with PR #3512's
    ``AdvantageResult`` dataclass in nemo_rl.algorithms.advantage_estimator."""
    root, algorithms = types.ModuleType("nemo_rl"), types.ModuleType("nemo_rl.algorithms")
    estimators = types.ModuleType(NEMO_ESTIMATOR_MODULE)
    root.__path__, algorithms.__path__ = [], []
    root.algorithms, algorithms.advantage_estimator = algorithms, estimators
    if with_advantage_result:
        @dataclasses.dataclass
        class AdvantageResult:  # noqa: F811 - the PR's type, as NeMo RL would define it
            advantages: torch.Tensor
            returns: torch.Tensor | None = None
            metrics: dict = dataclasses.field(default_factory=dict)
        estimators.AdvantageResult = AdvantageResult
    for name, module in (("nemo_rl", root), ("nemo_rl.algorithms", algorithms), (NEMO_ESTIMATOR_MODULE, estimators)):
        monkeypatch.setitem(sys.modules, name, module)


def no_nemo_rl(monkeypatch):
    """As if nemo_rl were not installed, even where it is."""
    for name in [n for n in sys.modules if n == "nemo_rl" or n.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nemo_rl", None)


def batch(B=4, T=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(B, T, dtype=dtype)
    mask[0, 3:] = 0
    mask[2, 1] = 0
    return dict(prompt_ids=torch.tensor([0, 0, 1, 1]), rewards=torch.tensor([1.0, 0.0, 0.5, 2.0]), mask=mask,
                values=torch.randn(B, T, generator=g, dtype=dtype),
                teacher_logprobs=-torch.rand(B, T, generator=g, dtype=dtype),
                prev_logprobs=-torch.rand(B, T, generator=g, dtype=dtype))


# ------------------------------------------------------------------ result_format="auto"
def test_auto_is_advantage_result_without_nemo_rl(monkeypatch, target):
    no_nemo_rl(monkeypatch)
    assert nemo.installed_nemo_rl_has_advantage_result() is None
    assert resolve_result_format("auto") == "advantage_result"
    out = RemoteAdvantageEstimator(target, "grpo", {}).compute_advantage(**batch())
    assert isinstance(out, AdvantageResult) and out.advantages.shape == (4, 5) and out.returns is None


def test_auto_is_legacy_with_released_nemo_rl(monkeypatch, target):
    install_fake_nemo_rl(monkeypatch, with_advantage_result=False)
    assert nemo.installed_nemo_rl_has_advantage_result() is False
    est = RemoteAdvantageEstimator(target, "grpo", {"use_leave_one_out_baseline": False, "normalize_rewards": False})
    assert est.result_format == "legacy"
    out = est.compute_advantage(**batch())
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (4, 5)
    # rewards [1, 0, 0.5, 2] in groups {0, 1}, {2, 3}: minus the group mean, broadcast over T
    assert torch.equal(out, torch.tensor([0.5, -0.5, -0.75, 0.75]).unsqueeze(-1).expand(4, 5))


def test_auto_is_advantage_result_with_pr3512_nemo_rl(monkeypatch, target):
    install_fake_nemo_rl(monkeypatch, with_advantage_result=True)
    assert nemo.installed_nemo_rl_has_advantage_result() is True
    out = RemoteAdvantageEstimator(target, "gae", {"gae_gamma": 1.0, "gae_lambda": 1.0,
                                                   "normalize_advantages": False}).compute_advantage(**batch())
    assert isinstance(out, AdvantageResult)
    assert out.returns.shape == (4, 5) and out.metrics == {}


def test_nemo_rl_without_importable_estimators_is_released(monkeypatch):
    root = types.ModuleType("nemo_rl")  # a plain module, no nemo_rl.algorithms below it
    monkeypatch.setitem(sys.modules, "nemo_rl", root)
    monkeypatch.delitem(sys.modules, NEMO_ESTIMATOR_MODULE, raising=False)
    assert nemo.installed_nemo_rl_has_advantage_result() is False
    assert resolve_result_format("auto") == "legacy"


def test_result_format_is_checked(target):
    with pytest.raises(ValueError, match="result_format='tensor'"):
        RemoteAdvantageEstimator(target, "grpo", {}, result_format="tensor")


# ------------------------------------------------------------------ result_format="legacy": NeMo RL main's returns
@pytest.mark.parametrize("name,config,kind", [
    ("grpo", {}, "tensor"),
    ("reinforce_plus_plus", {}, "tensor"),
    ("opd", {}, "tensor"),
    ("raw_reward", {"normalize_advantages": False}, "tuple_none"),
    ("gae", {"gae_gamma": 1.0, "gae_lambda": 1.0, "normalize_advantages": False}, "tuple"),
])
def test_legacy_returns_what_nemo_rl_main_returns(name, config, kind, target):
    inputs = batch()
    est = RemoteAdvantageEstimator(target, name, config, result_format="legacy")
    out = est.compute_advantage(**inputs)
    full = RemoteAdvantageEstimator(target, name, config, result_format="advantage_result").compute_advantage(**inputs)
    if kind == "tensor":
        assert isinstance(out, torch.Tensor) and torch.equal(out, full.advantages)
    else:
        assert isinstance(out, tuple) and len(out) == 2 and torch.equal(out[0], full.advantages)
        if kind == "tuple_none":
            assert out[1] is None
            # raw reward as advantage, not whitened: each row's reward on every token
            assert torch.equal(out[0], inputs["rewards"].unsqueeze(-1).expand(4, 5))
        else:
            assert torch.equal(out[1], full.returns)
            # gamma = lambda = 1, the reward on the last token of a full row: returns (advantages + values) are
            # that reward at every position, whatever the values
            assert torch.allclose(out[1][3], torch.full((5,), 2.0), atol=1e-5)
    if name == "opd":
        assert set(est.last_metrics) == {"on_policy_distillation/teacher_student_logprob_gap_mean",
                                         "on_policy_distillation/adv_mean", "on_policy_distillation/adv_std"}
        gap = (inputs["teacher_logprobs"] - inputs["prev_logprobs"])[inputs["mask"].bool()].mean().item()
        assert est.last_metrics["on_policy_distillation/teacher_student_logprob_gap_mean"] == pytest.approx(gap, abs=1e-6)
    else:
        assert est.last_metrics == {}


def test_gdpo_legacy_reads_repeated_batch(target):
    inputs = batch()
    repeated = {"reward/a": torch.tensor([1.0, 0.0, 1.0, 1.0]), "reward/b": torch.tensor([0.0, 1.0, 1.0, 0.0]),
                "message_log": ["not a tensor"] * 4}
    out = RemoteAdvantageEstimator(target, "gdpo", {}, result_format="legacy").compute_advantage(
        inputs["prompt_ids"], None, inputs["mask"], repeated)
    assert isinstance(out, torch.Tensor) and out.shape == (4, 5)
    # GDPO ends with a batch standardisation: mean 0, std 1 over the B values
    col = out[:, 0].double()
    assert abs(col.mean().item()) < 1e-6 and col.std().item() == pytest.approx(1.0, abs=1e-5)


def test_dtype_follows_nemo_rl_type_promotion(target):
    """NeMo RL's GAE and OPD multiply by the mask (and GAE adds values): float64 ones make a float64 result;
    Reinforce++ without the KL penalty reads only the rewards: float32 whatever the logprobs are."""
    f64 = batch(dtype=torch.float64)
    gae = RemoteAdvantageEstimator(target, "gae", {"gae_gamma": 0.9, "gae_lambda": 0.8}, result_format="legacy")
    adv, ret = gae.compute_advantage(**f64)
    assert adv.dtype == ret.dtype == torch.float64
    opd = RemoteAdvantageEstimator(target, "opd", {}, result_format="legacy").compute_advantage(**f64)
    assert opd.dtype == torch.float64
    # the float64 result is the exact difference, not a float32 rounding of it
    assert torch.equal(opd, (f64["teacher_logprobs"] - f64["prev_logprobs"]) * f64["mask"])
    rpp = RemoteAdvantageEstimator(target, "reinforce_plus_plus", {"use_kl_in_reward": False}, result_format="legacy")
    out = rpp.compute_advantage(**{**batch(), "logprobs_policy": f64["values"], "logprobs_reference": f64["values"]})
    assert out.dtype == torch.float32
    rpp_kl = RemoteAdvantageEstimator(target, "reinforce_plus_plus", {"use_kl_in_reward": True}, result_format="legacy")
    out = rpp_kl.compute_advantage(**{**batch(), "logprobs_policy": f64["values"], "logprobs_reference": f64["prev_logprobs"]})
    assert out.dtype == torch.float64


# ------------------------------------------------------------------ config keys
def test_one_edit_apart():
    assert one_edit_apart("gae_lamda", "gae_lambda") and one_edit_apart("normalize_reward", "normalize_rewards")
    assert one_edit_apart("nromalize_rewards", "normalize_rewards")  # adjacent swap
    assert one_edit_apart("gae_gammb", "gae_gamma")
    assert not one_edit_apart("gae_lambda", "gae_lambda") and not one_edit_apart("gae_lmda", "gae_lambda")
    assert not one_edit_apart("ratio_clip_min", "ratio_clip_max")


@pytest.mark.parametrize("name,key,field", [
    ("gae", "gae_lamda", "gae_lambda"), ("grpo", "normalize_reward", "normalize_rewards"),
    ("reinforce_plus_plus", "minsu_baseline", "minus_baseline"), ("raw_reward", "normalise_advantage", None),
])
def test_misspelt_config_key_warns_and_is_ignored(name, key, field, target):
    if field is None:  # two edits away: ignored silently like any other extra key
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            RemoteAdvantageEstimator(target, name, {key: False})
        return
    with pytest.warns(UserWarning) as caught:
        est = RemoteAdvantageEstimator(target, name, {key: 0.5 if "gae" in key else False})
    assert len(caught) == 1
    message = str(caught[0].message)
    assert repr(key) in message and repr(field) in message
    assert not est.config.HasField(field)  # the misspelt value was not used


def test_nemo_rl_keys_and_extra_keys_stay_silent(target):
    loss_fn = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": None, "disable_ppo_ratio": False,
               "use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
               "reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k3", "use_kl_in_reward": False,
               "token_level_loss": True, "kl_input_clamp_value": 20.0, "positive_example_nll_weight": 0.0}
    adv = {"name": "grpo", "normalize_rewards": True, "use_leave_one_out_baseline": True, "minus_baseline": True,
           "reward_weights": None, "my_custom_flag": 3, "gamma": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("grpo", "gdpo", "reinforce_plus_plus", "raw_reward", "gae", "opd"):
            RemoteAdvantageEstimator(target, name, {**loss_fn, **adv})


def test_pydantic_style_config_is_read(target):
    class Model:  # NeMo RL's configs are pydantic models: model_dump() gives the dict
        def model_dump(self):
            return {"name": "grpo", "normalize_rewards": False, "use_leave_one_out_baseline": True}
    est = RemoteAdvantageEstimator(target, "grpo", Model())
    assert est.config.normalize_rewards is False and est.config.use_leave_one_out_baseline is True


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae"])
def test_kl_clamps_of_the_loss_config_are_not_read(name, target):
    """NeMo RL main's Reinforce++ and GAE call calculate_kl with its built-in clamps (20, 10) whatever the loss
    config says; the drop-in gives those numbers, where the plain client honours the clamps it is sent."""
    B, T = 2, 3
    lp = torch.tensor([[-0.1, -0.2, -0.3], [-0.5, -0.1, -0.2]])
    ref = torch.tensor([[-4.0, -0.2, -6.0], [-0.5, -5.0, -0.2]])  # log ratios of -3.9 .. -5.8: k3 = e^r - 1 - r
    mask = torch.ones(B, T)
    loss_cfg = {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k3",
                "kl_input_clamp_value": 2.0, "kl_output_clamp_value": 1.0}
    tensors = dict(prompt_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]), mask=mask)
    extra = ({"logprobs_policy": lp, "logprobs_reference": ref} if name == "reinforce_plus_plus" else
             {"logprobs": lp, "reference_logprobs": ref, "values": torch.zeros(B, T)})
    est = RemoteAdvantageEstimator(target, name, loss_cfg, result_format="advantage_result")
    assert not est.config.HasField("kl_input_clamp_value") and not est.config.HasField("kl_output_clamp_value")
    got = est.compute_advantage(**tensors, **extra).advantages
    nemo_defaults = {k: v for k, v in loss_cfg.items() if not k.startswith("kl_")}
    plain = {"logprobs": lp, "reference_logprobs": ref, **({"values": torch.zeros(B, T)} if name == "gae" else {})}
    sent = {k: v for k, v in tensors.items() if not (name == "gae" and k == "prompt_ids")}  # gae reads no groups
    with AdvantageClient(target) as client:
        want = client.compute(name, nemo_defaults, **sent, **plain).advantages
        clamped = client.compute(name, loss_cfg, **sent, **plain).advantages
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got - clamped).abs().max() > 1e-3  # the clamps would have changed the numbers
