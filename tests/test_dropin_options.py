"""Options a drop-in receives but does not apply warn once (issue #22 item 10b), and the float32-overflow message
names ``output_dtype="float64"`` (item 10a).

* NeMo: ``kl_input_clamp_value`` / ``kl_output_clamp_value`` other than NeMo RL's built-in clamps (20, 10) in a
  Reinforce++ or GAE config: one ``UserWarning`` per key per process, naming the key and the plain client call;
  NeMo's own values (20, 10) draw none (nothing is lost);
* verl: ``config.exclude_empty_responses`` / ``config.sum_rewards_over_mask`` set: one warning each, and the
  result is still verl 0.9.1's (the options are not applied); unset or false: no warning.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from advantage_client import InvalidArgumentError, nemo
from advantage_client.nemo import RemoteAdvantageEstimator
from advantage_client.verl import get_adv_estimator_fn


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(nemo, "_warned", set())  # "once per process": each test starts a new "process"


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae"])
def test_nemo_other_kl_clamps_warn_once_per_key(name, client):
    cfg = {"kl_input_clamp_value": 2.0, "kl_output_clamp_value": 1.0, "reference_policy_kl_penalty": 0.1}
    _, first = _caught(lambda: RemoteAdvantageEstimator("unused:1", name, cfg, client=client))
    assert len(first) == 2, first
    assert any("kl_input_clamp_value=2.0 is not applied" in m and "built-in clamp 20" in m
               and f"AdvantageClient.compute({name!r}" in m for m in first), first
    assert any("kl_output_clamp_value=1.0 is not applied" in m and "built-in clamp 10" in m for m in first), first
    _, again = _caught(lambda: RemoteAdvantageEstimator("unused:1", name, cfg, client=client))
    assert again == []  # once per key per process


def test_nemo_builtin_clamps_and_other_estimators_do_not_warn(client):
    nemo_defaults = {"kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0}
    _, got = _caught(lambda: RemoteAdvantageEstimator("unused:1", "reinforce_plus_plus", nemo_defaults, client=client))
    assert got == []
    _, got = _caught(lambda: RemoteAdvantageEstimator("unused:1", "grpo", {"kl_input_clamp_value": 2.0},
                                                      client=client))
    assert got == []  # grpo has no KL clamp of NeMo's to reproduce: nothing unapplied


def _verl_batch():
    rng = np.random.default_rng(0)
    B, T = 8, 5
    mask = torch.from_numpy((np.arange(T)[None, :] < rng.integers(0, T + 1, B)[:, None]).astype(np.float32))
    mask[0] = 0  # an empty response: exclude_empty_responses would change the group's numbers
    rewards = torch.zeros(B, T)
    rewards[:, 0] = torch.from_numpy(rng.random(B).astype(np.float32))
    return rewards, mask, np.array(["a"] * 4 + ["b"] * 4, dtype=object)


@pytest.mark.parametrize("option", ["exclude_empty_responses", "sum_rewards_over_mask"])
def test_verl_later_options_warn_once_and_are_not_applied(option, target):
    fn = get_adv_estimator_fn("grpo", target)
    rewards, mask, index = _verl_batch()
    plain, none = _caught(lambda: fn(token_level_rewards=rewards, response_mask=mask, index=index,
                                     config={"norm_adv_by_std_in_grpo": True, option: False}))
    assert none == []
    (adv, _), got = _caught(lambda: fn(token_level_rewards=rewards, response_mask=mask, index=index,
                                       config={option: True}))
    assert len(got) == 1 and f"config.{option} is not applied" in got[0] and "verl 0.9.1" in got[0], got
    assert f"{option!r}: True" in got[0] and "AdvantageClient.compute('grpo'" in got[0]
    assert torch.equal(adv, plain[0])  # verl 0.9.1's numbers, the option not applied
    _, again = _caught(lambda: fn(token_level_rewards=rewards, response_mask=mask, index=index, config={option: True}))
    assert again == []


def test_float32_overflow_names_output_dtype_float64(client):
    """gigpo computes in float64 for rewards beyond float32's range; a float32 result would be infinite: the
    error names output_dtype="float64" (before: "request float32 or float64", float32 being the failing one)."""
    B, T = 4, 3
    tensors = dict(prompt_ids=np.zeros(B, np.int64), rewards=np.array([1e39, -1e39, 0.0, 0.0]),
                   mask=np.ones((B, T), np.float32), trajectory_ids=np.arange(B), anchor_ids=np.arange(B))
    with pytest.raises(InvalidArgumentError) as err:
        client.compute("gigpo", None, **tensors)
    assert 'beyond the range of float32; request output_dtype="float64"' in str(err.value)
    assert "float32 or" not in str(err.value)
    ok = client.compute("gigpo", None, output_dtype="float64", **tensors)
    assert ok.advantages.dtype == torch.float64 and abs(float(ok.advantages[0, 0])) > 1e38
    with pytest.raises(InvalidArgumentError, match='request output_dtype="float32" or output_dtype="float64"'):
        client.compute("grpo", {"normalize_rewards": False}, prompt_ids=np.zeros(2, np.int64),
                       rewards=np.array([1e6, -1e6]), mask=np.ones((2, 1), np.float32), output_dtype="float16")
