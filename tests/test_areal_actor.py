"""AReaL's actor with the service in it: ``advantage_client.areal.RemotePPOActor`` against AReaL 1.0.4's own
``PPOActor.compute_advantages`` on the same rollout data.

Both actors are built from AReaL's own config classes (``areal/api/cli_args.py``'s ``PPOActorConfig`` and
``NormConfig``, imported from the installed release by ``references.areal_ref.load_config``) and the released
``PPOActor`` (``references.areal_ref.load``); the engine is a stand-in that raises on any use (``PPOActor``
only stores it; computing advantages never touches it). Each case calls AReaL's public
``compute_advantages(list_of_trajectories)`` (its ``batched_call``: concatenation with padding, then the split
back per trajectory) on one copy of the data and the remote actor's on another, over real gRPC, and compares
every key AReaL returns in every trajectory: the computed ones (``advantages``, ``returns``, ``kl_rewards``,
``tot_rewards``) per position under the differential tests' rule (tests/test_diff_areal.py: ``|remote - AReaL|
<= rtol |AReaL| + atol max(1, max |AReaL|)``, float32 2e-4 / 2e-5, float64 1e-9 / 1e-9), every other key
(``loss_mask``, ``logprobs``, ``prox_logp``, ``ref_logp``, ``rewards``, ...) bitwise; dtypes and shapes equal.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from advantage_client import InvalidArgumentError
from advantage_client import areal as remote
from references import areal_ref
from test_diff_areal import _close  # the differential tests' tolerance rule, as they apply it

ACTOR = areal_ref.load()
CLI = areal_ref.load_config()
COMPUTED = ("advantages", "returns", "kl_rewards", "tot_rewards")


class NoEngine:
    """The engine stand-in: ``PPOActor.__init__`` stores it; any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"compute_advantages used the engine ({name})")


def _config(**kw) -> object:
    return CLI.PPOActorConfig(experiment_name="test", trial_name="areal-actor", **kw)


def _trajectories(seed: int, groups: int, n: int, *, values: bool = False, ref: bool = False, prox: bool = False,
                  dtype=torch.float32, full: float = 0.3, first: bool = False) -> list[dict]:
    """AReaL rollout trajectories: one dict per prompt with its ``n`` samples ``[n, L]`` (L: the group's longest
    sequence), prompt then response then padding; a share ``full`` of the rows fill the batch's widest
    trajectory, so after AReaL's concatenation they have no end token. ``first``: some rows train their first
    column (AReaL's circular roll brings it to the last column, where ``seqlen - 1`` of a full row is zeroed)."""
    rng = np.random.default_rng(seed)
    width = int(rng.integers(6, 11))
    out = []
    for g in range(groups):
        prompt = int(rng.integers(1, 4))
        seqlen = rng.integers(prompt + 1, width + 1, n)
        seqlen[rng.random(n) < full] = width if g == 0 else seqlen.max()
        if g == 0:
            seqlen[0] = width  # the batch's width: row 0 of group 0 has no end token
        L = int(seqlen.max())
        cols = np.arange(L)[None, :]
        attention = (cols < seqlen[:, None]).astype(np.int64)
        loss = ((cols >= prompt) & (cols < seqlen[:, None])).astype(np.int64)
        loss[rng.random(n) < 0.2, prompt] = 0  # a hole
        if first:
            loss[rng.random(n) < 0.6, 0] = 1
        d = {
            "input_ids": torch.from_numpy(rng.integers(3, 100, (n, L)) * attention),
            "attention_mask": torch.from_numpy(attention),
            "loss_mask": torch.from_numpy(loss),
            "logprobs": torch.from_numpy(-rng.uniform(0.01, 3.0, (n, L)) * loss).to(dtype),
            "rewards": torch.from_numpy(rng.choice([0.0, 1.0, 0.5, -1.0], n)).to(dtype),
        }
        if ref:
            d["ref_logp"] = torch.from_numpy(-rng.uniform(0.01, 3.0, (n, L))).to(dtype)
        if values:
            d["values"] = torch.from_numpy(rng.normal(0, 1, (n, L))).to(dtype)
        if prox:
            d["prox_logp"] = torch.from_numpy(-rng.uniform(0.01, 3.0, (n, L))).to(dtype)
        out.append(d)
    return out


def run_both(client, config, trajectories) -> tuple[list[dict], list[dict]]:
    areal_actor = ACTOR.PPOActor(config, NoEngine())
    remote_actor = remote.remote_actor_class(ACTOR.PPOActor)(config, NoEngine(), advantage_client=client)
    with torch.no_grad():  # as AReaL's engines call it
        want = areal_actor.compute_advantages(copy.deepcopy(trajectories))
        got = remote_actor.compute_advantages(copy.deepcopy(trajectories))
    return got, want


def compare(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), (i, sorted(g), sorted(w))
        for key, wv in w.items():
            gv = g[key]
            if not isinstance(wv, torch.Tensor):
                assert gv == wv, (i, key)
                continue
            assert gv.dtype == wv.dtype and gv.shape == wv.shape and gv.device == wv.device, \
                (i, key, gv.dtype, wv.dtype, gv.shape, wv.shape)
            if key in COMPUTED:
                ok, why = _close(gv, wv)
                assert ok, f"trajectory {i} {key}: {why}"
            else:
                assert torch.equal(gv, wv), f"trajectory {i} {key}: {gv.tolist()} != {wv.tolist()}"


CASES = {
    # AReaL's PPO: a critic, discount and lambda < 1, the KL reward against a reference model, adv_norm batch
    "ppo_values": (dict(discount=0.99, gae_lambda=0.95, kl_ctl=0.1, reward_bias=-0.5, reward_scaling=2.0,
                        adv_norm=CLI.NormConfig()), dict(values=True, ref=True, first=True)),
    # AReaL's GRPO examples: no values, group reward normalisation, no KL
    "grpo_group_norm": (dict(kl_ctl=0.0, reward_norm=CLI.NormConfig(mean_level="group", std_level="group",
                                                                     group_size=4)), dict()),
    # GRPO with leave-one-out group means and a batch-normalised advantage
    "grpo_adv_norm_batch": (dict(kl_ctl=0.0, reward_norm=CLI.NormConfig(mean_level="group", mean_leave1out=True,
                                                                         std_level=None, group_size=4),
                                 adv_norm=CLI.NormConfig(mean_level="batch", std_level="batch")), dict()),
    # the KL reward on (k3, no reference model), rows without an end token lose their reward
    "kl_k3_mask_no_eos": (dict(kl_ctl=0.3, kl_estimator="k3", mask_no_eos_with_zero=True, reward_clip=0.75),
                          dict(full=0.5, first=True)),
    # the recomputed log-probs (prox_logp, not rolled) with a k2 KL against a reference, values
    "recompute_prox_k2": (dict(kl_ctl=0.2, kl_estimator="k2", recompute_logprob=True, discount=0.9),
                          dict(ref=True, prox=True, values=True)),
    # the decoupled loss: logprobs rolled, prox_logp left as given
    "decoupled": (dict(kl_ctl=0.1, use_decoupled_loss=True, recompute_logprob=True,
                       adv_norm=CLI.NormConfig(mean_level="group", std_level="group", group_size=2)),
                  dict(ref=True, prox=True)),
    # DAPO's overlong penalty: applied by AReaL's own reward_overlong_penalty before the rewards are sent
    "overlong_penalty": (dict(kl_ctl=0.0, overlong_reward_penalty=True, overlong_tokens=3,
                              overlong_penalty_factor=0.5, max_new_tokens=6,
                              reward_norm=CLI.NormConfig(mean_level="group", std_level="group", group_size=4)),
                         dict()),
    # float64 critic values: AReaL's advantages and returns come out float64
    "values_float64": (dict(discount=0.97, gae_lambda=0.9, kl_ctl=0.05), dict(values=True, ref=True,
                                                                             dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_remote_actor_writes_what_areal_writes(client, name, seed):
    config_kw, data_kw = CASES[name]
    trajectories = _trajectories(seed, groups=3, n=4, **data_kw)
    got, want = run_both(client, _config(**config_kw), trajectories)
    compare(got, want)
    expected = {"advantages", "returns", "kl_rewards", "tot_rewards", "loss_mask", "logprobs"}
    assert expected <= set(want[0]), sorted(want[0])  # the keys AReaL writes are there and were compared
    if name == "kl_k3_mask_no_eos":  # the batch has rows with and without an end token, KL nonzero
        assert any(bool((t["attention_mask"].sum(-1) == t["attention_mask"].shape[1]).any()) for t in want)
        assert any(bool((t["kl_rewards"] != 0).any()) for t in want)


def test_one_trajectory_and_a_row_that_fills_the_width(client):
    """A single trajectory (AReaL's concat returns its dict as is) with every row at the full width: no row has an
    end token, so every value is bootstrapped and, with mask_no_eos_with_zero, no reward is placed."""
    data = _trajectories(5, groups=1, n=3, values=True, full=1.0)
    for flag in (False, True):
        got, want = run_both(client, _config(mask_no_eos_with_zero=flag, discount=0.9), data)
        compare(got, want)


def test_the_advantages_are_the_services(client):
    """The remote actor's numbers come from the service: a client that refuses fails the call."""
    class Refusing:
        def compute(self, *args, **kwargs):
            raise RuntimeError("service called")

    actor = remote.remote_actor_class(ACTOR.PPOActor)(_config(), NoEngine(), advantage_client=Refusing())
    with pytest.raises(RuntimeError, match="service called"):
        actor.compute_advantages(_trajectories(0, 2, 2))


def test_an_invalid_norm_config_is_the_services_error_naming_the_field(client):
    actor = remote.remote_actor_class(ACTOR.PPOActor)(_config(adv_norm=CLI.NormConfig(eps=0.0)), NoEngine(),
                                                      advantage_client=client)
    with pytest.raises(InvalidArgumentError, match=r"config\.adv_norm\.eps"):
        actor.compute_advantages(_trajectories(0, 2, 2))


def test_overlong_penalty_needs_its_fields(client):
    cfg = _config(overlong_reward_penalty=True, overlong_tokens=None, overlong_penalty_factor=0.5)
    actor = remote.remote_actor_class(ACTOR.PPOActor)(cfg, NoEngine(), advantage_client=client)
    with pytest.raises(ValueError, match="overlong_tokens"):
        actor.compute_advantages(_trajectories(0, 2, 2))


def test_target_and_token_from_the_environment(make_server, tmp_path, monkeypatch):
    """Without ``advantage_client``/``advantage_target`` the actor's client is made from
    ``$ADVANTAGE_SERVICE_TARGET`` with the bearer token of ``$ADVANTAGE_SERVICE_TOKEN_FILE``."""
    srv = make_server(auth_token="areal-s3cret")
    token = tmp_path / "token"
    token.write_text("areal-s3cret\n")
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", srv.address)
    monkeypatch.setenv("ADVANTAGE_SERVICE_TOKEN_FILE", str(token))
    config = _config(kl_ctl=0.0, reward_norm=CLI.NormConfig(mean_level="group", std_level="group", group_size=4))
    actor = remote.remote_actor_class(ACTOR.PPOActor)(config, NoEngine())
    data = _trajectories(3, groups=2, n=4)
    want = ACTOR.PPOActor(config, NoEngine()).compute_advantages(copy.deepcopy(data))
    compare(actor.compute_advantages(copy.deepcopy(data)), want)
    actor.advantage_client.close()


NO_AREAL = """
import sys
sys.modules["areal"] = None   # `import areal` raises ImportError
sys.modules["torch"] = None
import advantage_client.areal as m
assert callable(m.areal_advantages) and m.service_config is not None
try:
    m.RemotePPOActor
except ImportError as e:
    print(e)
else:
    raise SystemExit("RemotePPOActor without areal")
"""


def test_module_imports_without_areal():
    """``advantage_client.areal`` imports with AReaL unimportable (the client package stays AReaL- and torch-free
    at import); looking up ``RemotePPOActor`` then says what to install."""
    client_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "client")
    out = subprocess.run([sys.executable, "-c", NO_AREAL], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": client_dir})
    assert out.returncode == 0, out.stderr
    assert "pip install areal==1.0.4" in out.stdout
