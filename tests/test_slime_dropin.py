"""slime's two extension points served (issue #38): ``--custom-advantage-function-path
advantage_client.slime.compute_advantages_and_returns`` and ``--custom-reward-post-process-path
advantage_client.slime.post_process_rewards``.

Each hook is called the way slime calls it: resolved from its dotted path as slime's ``load_function`` does
(``rpartition(".")`` and ``importlib.import_module``), and given what slime gives it: an ``argparse.Namespace`` of
slime's flags, and slime's ``rollout_data`` (lists of ``[T_i]`` tensors, the loss masks as int32, the rewards its
rollout normalised) or its ``Sample`` list. The answers are checked against slime's own outputs on every golden case
(``tests/golden_slime/``: what slime's trainer step computes before its own whitening, and what its rollout's
``_post_process_rewards`` returns), the requests are counted at the server (one per hook call; none for a reward step
slime leaves unnormalised), and with the server's answers scaled by 1.0001 every case fails.

slime's own code (megatron-based, no package) cannot run in CI: ``tests/golden_slime/generate.py --check-dropin``
runs the hooks inside slime's real ``compute_advantages_and_returns`` and ``_post_process_rewards`` at the pinned
commit, by hand (its outcome is recorded in the cases' ``source``).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib

import numpy as np
import pytest

from advantage_client import slime as dropin

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent / "golden_slime"
GOLDEN = json.loads((HERE / "slime_cases.json").read_text())
CASES = GOLDEN["cases"]
RTOL, ATOL = 1e-5, 2e-6


def load_function(path: str):
    """slime's ``slime.utils.misc.load_function``: the module before the last dot, then the attribute."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def slime_args(case: dict) -> argparse.Namespace:
    return argparse.Namespace(**case["slime_args"], use_rollout_logprobs=False, context_parallel_size=1,
                              custom_advantage_function_path="advantage_client.slime.compute_advantages_and_returns")


def rollout_data(case: dict) -> dict:
    """slime's trainer ``rollout_data`` for ``case``: per-sample lists, as ``_get_rollout_data`` builds them."""
    lengths = np.diff(case["cu_seqlens"]).astype(int)
    cuts = np.cumsum(lengths)[:-1]

    def rows(key: str, dtype=torch.float32) -> list:
        return [torch.tensor(x, dtype=dtype) for x in np.split(np.asarray(case[key], np.float64), cuts)]
    data = {"rewards": list(case["post_processed_rewards"]), "response_lengths": lengths.tolist(),
            "total_lengths": (lengths + np.asarray(case["prompt_length"])).tolist(),
            "loss_masks": rows("loss_mask", torch.int32), "log_probs": rows("log_probs"),
            "ref_log_probs": rows("ref_log_probs"), "kl": [torch.zeros(int(n)) for n in lengths]}
    if "values" in case:
        data["values"] = rows("values")
    return data


class Sample:
    """What ``_post_process_rewards`` reads of slime's ``Sample``."""

    def __init__(self, reward: float):
        self.reward = reward

    def get_reward_value(self, args) -> float:
        return self.reward


def close(got, want) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= RTOL * np.abs(want) + ATOL * scale))


def hook_outputs(case: dict, client) -> tuple[np.ndarray, np.ndarray]:
    data = rollout_data(case)
    hook = load_function("advantage_client.slime.compute_advantages_and_returns")
    hook(slime_args(case), data, client=client)
    for key in ("advantages", "returns"):
        assert [t.shape[0] for t in data[key]] == data["response_lengths"], key
        assert all(t.dtype == torch.float32 for t in data[key]), key
    return torch.cat(data["advantages"]).numpy(), torch.cat(data["returns"]).numpy()


@pytest.fixture
def counted(monkeypatch):
    """Count the estimator runs of the in-process server (one per request), optionally scaling its answers."""
    from advantage_server.estimators.registry import REGISTRY

    state = {"calls": 0, "scale": 1.0}
    for name in ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"):
        spec = REGISTRY[name]

        def fn(cfg, batch, _inner=spec.fn):
            state["calls"] += 1
            out = _inner(cfg, batch)
            if state["scale"] != 1.0:
                out = dataclasses.replace(out, advantages=out.advantages * state["scale"],
                                          returns=None if out.returns is None else out.returns * state["scale"])
            return out
        monkeypatch.setitem(REGISTRY, name, dataclasses.replace(spec, fn=fn))
    return state


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_trainer_hook_gives_slimes_advantages_and_returns(client, counted, case):
    """What slime's trainer computes before its own --normalize-advantages whitening, in one request."""
    advantages, returns = hook_outputs(case, client)
    assert counted["calls"] == 1
    assert close(advantages, case.get("expected_advantages_unwhitened", case["expected_advantages"]))
    assert close(returns, case["expected_returns"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_reward_hook_gives_slimes_rewards(client, counted, case):
    args = slime_args(case)
    hook = load_function("advantage_client.slime.post_process_rewards")
    raw, rewards = hook(args, [Sample(r) for r in case["raw_rewards"]], client=client)
    assert raw == case["raw_rewards"]
    np.testing.assert_allclose(rewards, case["post_processed_rewards"], rtol=2e-6, atol=2e-6)
    normalised = case["slime_estimator"] in dropin.GROUP_NORMALISED and case["slime_args"]["rewards_normalization"]
    assert counted["calls"] == int(normalised)  # slime normalises nothing else: no request


def test_every_case_fails_with_the_servers_answers_scaled(client, counted):
    counted["scale"] = 1.0001
    passed = [c["name"] for c in CASES
              if all(close(a, w) for a, w in zip(hook_outputs(c, client),
                                                 (c.get("expected_advantages_unwhitened", c["expected_advantages"]),
                                                  c["expected_returns"])))]
    assert not passed, passed
    assert counted["calls"] == len(CASES)


def test_context_parallelism_and_other_estimators_are_refused(client):
    case = CASES[0]
    args = slime_args(case)
    args.context_parallel_size = 2
    with pytest.raises(ValueError, match="context-parallel-size"):
        dropin.compute_advantages_and_returns(args, rollout_data(case), client=client)
    args = slime_args(case)
    args.advantage_estimator = "on_policy_distillation"
    with pytest.raises(ValueError, match="advantage-estimator 'on_policy_distillation'"):
        dropin.compute_advantages_and_returns(args, rollout_data(case), client=client)


def test_the_batch_travels_packed(client, monkeypatch):
    """The request carries the tokens (cu_seqlens), never a [B, max(T)] padding."""
    case = max(CASES, key=lambda c: np.diff(c["cu_seqlens"]).max() * (len(c["cu_seqlens"]) - 1))
    seen = {}
    real = client.compute

    def spy(name, config=None, **kwargs):
        seen.update(kwargs)
        return real(name, config, **kwargs)
    monkeypatch.setattr(client, "compute", spy)
    hook_outputs(case, client)
    N = case["cu_seqlens"][-1]
    assert list(seen["cu_seqlens"]) == case["cu_seqlens"]
    assert all(np.asarray(v).size in (N, len(case["raw_rewards"])) for k, v in seen.items()
               if k not in ("cu_seqlens", "output_dtype", "as_numpy", "transport", "timeout"))


def test_use_rollout_logprobs_sends_the_rollouts_log_probs(client):
    """--use-rollout-logprobs: slime's KL (and so the hook's request) takes ``rollout_log_probs``, not ``log_probs``
    (a review found no test sending them apart)."""
    case = next(c for c in CASES if c["slime_estimator"] == "reinforce_plus_plus" and c["slime_args"]["kl_coef"])
    want = hook_outputs(case, client)
    data = rollout_data(case)
    data["rollout_log_probs"], data["log_probs"] = data["log_probs"], [t + 5.0 for t in data["log_probs"]]
    args = slime_args(case)
    args.use_rollout_logprobs = True
    dropin.compute_advantages_and_returns(args, data, client=client)
    np.testing.assert_array_equal(torch.cat(data["advantages"]).numpy(), want[0])
    args.use_rollout_logprobs = False
    dropin.compute_advantages_and_returns(args, data, client=client)  # the shifted log_probs: another answer
    assert not np.allclose(torch.cat(data["advantages"]).numpy(), want[0])


def test_the_reward_hook_groups_the_whole_batch_when_the_count_differs(client):
    """slime's _post_process_rewards reshapes to (-1, n_samples_per_prompt) only when the batch holds
    rollout_batch_size * n samples; otherwise the whole batch is one group (e.g. after dynamic filtering)."""
    args = argparse.Namespace(advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
                              n_samples_per_prompt=2, rollout_batch_size=3)
    rewards = [1.0, 0.0, 3.0, 1.0, 2.0]  # 5 != 3 * 2
    _, got = dropin.post_process_rewards(args, [Sample(r) for r in rewards], client=client)
    r = torch.tensor(rewards)
    want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()  # slime's rule for one group (torch.std: unbiased)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    args.rollout_batch_size = 2
    _, got = dropin.post_process_rewards(args, [Sample(r) for r in rewards[:4]], client=client)
    np.testing.assert_allclose(got, [0.7071062, -0.7071062, 0.7071064, -0.7071064], rtol=1e-5)  # pairs


def test_what_slime_did_not_provide_is_named_with_the_flag(client):
    """A newcomer's findings: a missing key was a bare KeyError; a sample's mask of another length than its
    response passed silently (shifted between samples) when the totals agreed; an empty rank raised torch's
    ``torch.cat(): expected a non-empty list``."""
    case = next(c for c in CASES if c["slime_estimator"] == "ppo" and c["slime_args"]["kl_coef"])
    args = slime_args(case)
    for key, flag in (("values", "--advantage-estimator ppo"), ("ref_log_probs", "--kl-coef"),
                      ("loss_masks", "always")):
        data = rollout_data(case)
        del data[key]
        with pytest.raises(ValueError, match=rf"rollout_data\['{key}'\] is missing: slime provides it with {flag}"):
            dropin.compute_advantages_and_returns(args, data, client=client)
    data = rollout_data(case)
    data["loss_masks"][0], data["loss_masks"][1] = (torch.cat([data["loss_masks"][0], data["loss_masks"][1][:1]]),
                                                    data["loss_masks"][1][1:])  # same total, shifted by one
    with pytest.raises(ValueError, match=r"rollout_data\['loss_masks'\]\[0\] holds \d+ tokens but "
                                         r"response_lengths\[0\] is \d+"):
        dropin.compute_advantages_and_returns(args, data, client=client)
    data = rollout_data(case)
    data["rewards"] = data["rewards"][:-1]
    with pytest.raises(ValueError, match=r"rollout_data\['rewards'\] holds \d+ samples but response_lengths \d+"):
        dropin.compute_advantages_and_returns(args, data, client=client)
    empty = {k: [] for k in rollout_data(case)}
    dropin.compute_advantages_and_returns(args, empty, client=client)
    assert empty["advantages"] == [] and empty["returns"] == []
