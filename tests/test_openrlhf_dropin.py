"""The OpenRLHF drop-in (``advantage_client.openrlhf.install()``) against OpenRLHF 0.11.2's own
``RemoteExperienceMaker.compute_advantages_and_returns`` (openrlhf/trainer/ppo_utils/experience_maker.py), on the
same ``Experience`` micro-batches, against the live test server.

For every ``--algo.advantage.estimator`` of 0.11.2 (``gae``, ``reinforce``, ``rloo``, ``reinforce_baseline``,
``group_norm``, ``dr_grpo``, ``flash_reinforce``) x 4 configurations x 2 seeds: generated experiences (micro-batches
of different sizes and widths ``A_i``, as ``Experience.concat_experiences`` pads them; samples in a shuffled rollout
order, OpenRLHF's dynamic-batching reorder via ``index``; right-padded action masks of 1..A_i tokens; float32 and
float64 rewards/log-probs/values) with, per configuration: ``--reward.clip_range`` (the default, (-1, 2), (-20, 20),
unset); KL in the reward (``experience.kl`` from OpenRLHF's own
``compute_approx_kl`` k1/k2/k3 and a FixedKLController coefficient) or zeros; gamma != 1 (OpenRLHF resets it to 1
for the group estimators, which the test checks), GAE lambda < 1, ``--algo.advantage.no_std_norm``; DAPO overlong
and ProRL stop-properly length penalties.

Each case runs OpenRLHF's method three ways: as released in the batch's dtype (the "native" run: the fields it
writes, their dtypes and shapes, ``kl = None``, the mutated ``gamma``, ``rewards`` after the length penalties and
``info["group_reward_std"]`` must be identical there); as released on the float64-promoted experiences with its
``.float()`` calls kept in float64 (tests/references/openrlhf_ref.py ``precise``: y64) plus three runs with every
float64 input moved by its last bit (the reference's own sensitivity s); and with the drop-in installed. Compared
to y64 by the differential tests' rule (tests/test_diff_openrlhf.py): ``advantages``, ``returns`` (at every
position, masked ones included, as OpenRLHF writes them) and ``info["return"]``, within
``spacing(y64)/2 + 16 u64 |y64|max + 16 s``. The server's ``advantage_requests_total`` (ComputeAdvantage, OK)
must grow by the drop-in's calls: +1 per case (the service computes all of it, KL and whitening included).

Stubs (only what cannot run on a CPU; all in tests/references/openrlhf_ref.py, none of them computes an advantage):
    * ``ray`` (``ray.get``/``ray.put`` of ``make_experience``, not called), ``deepspeed`` (ZeRO-3 leaf modules
      imported by ``openrlhf.models.utils``), ``transformers.AutoTokenizer`` (``get_tokenizer``);
    * ``openrlhf.trainer.ray.launcher`` (the Ray actor-group launcher: vLLM/DeepSpeed import chain);
    * ``RemoteExperienceMaker.__init__`` is not run (it only stores Ray actor groups, a strategy and a tokenizer):
      the maker is built with ``object.__new__`` and given ``strategy.args``, ``args``, ``advantage_estimator`` and
      OpenRLHF's own ``FixedKLController``.
Everything the method calls runs as released: ``apply_length_penalties``, the group baselines, ``compute_reward``,
``get_advantages_and_returns``, ``get_cumulative_returns`` and the whitening.
"""
from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from advantage_client import openrlhf as dropin
from advantage_client import AdvantageClient
from references import openrlhf_ref

EM = openrlhf_ref.load()
PPO_UTILS = sys.modules["openrlhf.trainer.ppo_utils"]
#: OpenRLHF's own method, taken before any install (the drop-in replaces the class attribute)
RELEASED = EM.RemoteExperienceMaker.__dict__["compute_advantages_and_returns"]
assert not getattr(RELEASED, "advantage_service", False)
ESTIMATORS = ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce")
U64 = float(np.finfo(np.float64).eps) / 2
#: configurations: dtype, KL (estimator, coef) or None, gamma, lambd, no_std_norm, length penalties, --reward.clip_range
#: (the default, narrow enough to clamp many rewards and baselined rewards, wider than +-10, and unset: no clamp)
CONFIGS = {
    "f32-plain": dict(dtype=torch.float32, kl=None, gamma=1.0, lambd=1.0, no_std_norm=False, penalties=False,
                      clip=(-10.0, 10.0)),
    "f32-kl-k3": dict(dtype=torch.float32, kl=("k3", 0.1), gamma=0.99, lambd=0.95, no_std_norm=False, penalties=True,
                      clip=(-1.0, 2.0)),
    "f64-kl-k1": dict(dtype=torch.float64, kl=("k1", 0.01), gamma=1.0, lambd=0.9, no_std_norm=True, penalties=False,
                      clip=(-20.0, 20.0)),
    "f32-kl-k2": dict(dtype=torch.float32, kl=("k2", 1.0), gamma=0.5, lambd=1.0, no_std_norm=False, penalties=True,
                      clip=None),
}
SEEDS = (0, 1)


def make_case(estimator: str, config: dict, seed: int) -> dict:
    """Rollout of ``groups`` prompts x ``n`` samples, split into micro-batches of different sizes and widths."""
    rng = np.random.default_rng(seed * 7919 + len(estimator))
    n, groups = (int(rng.integers(2, 5)), int(rng.integers(2, 4)))
    B = n * groups
    order = rng.permutation(B).tolist()
    cuts = sorted(set(rng.integers(1, B, size=2).tolist()))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, B])]
    dtype = config["dtype"]
    # multiples of 2^-10: the length penalties (multiples of 1/8) add to them exactly in float32, so OpenRLHF's
    # float32 penalised rewards (which the drop-in writes bit for bit, checked) are the float64 run's inputs too
    rewards = torch.tensor(np.round(rng.normal(0.3, 2.0, B) * 1024) / 1024 * (1 + 5 * (rng.random(B) < 0.2)),
                           dtype=dtype)
    micro = []
    start = 0
    for size in sizes:
        width = int(rng.integers(2, 7))
        lengths = rng.integers(1, width + 1, size)
        mask = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None])
        if config["kl"] is not None:
            lp = torch.tensor(rng.uniform(-6, 0, (2, size, width)), dtype=dtype)
            # make_experience's experience.kl (float32, as compute_approx_kl returns it): the drop-in's input
            kl = openrlhf_ref.approx_kl(lp[0], lp[1], config["kl"][0]).to(dtype)
        else:
            kl = torch.zeros(size, width, dtype=dtype)  # make_experience without a reference model
        micro.append(dict(rewards=rewards[start:start + size], mask=mask, kl=kl,
                          values=torch.tensor(np.round(rng.normal(0, 1, (size, width)), 3), dtype=dtype),
                          index=order[start:start + size],
                          response_length=torch.tensor(lengths + rng.integers(0, 20, size), dtype=torch.float32),
                          truncated=torch.from_numpy(rng.random(size) < 0.3)))
        start += size
    return dict(n=n, micro=micro, config=config, estimator=estimator)


def args_for(case: dict) -> SimpleNamespace:
    c = case["config"]
    return SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=case["estimator"], gamma=c["gamma"], lambd=c["lambd"],
                                                       no_std_norm=c["no_std_norm"])),
        rollout=SimpleNamespace(n_samples_per_prompt=case["n"], max_new_tokens=16),
        data=SimpleNamespace(max_len=16),
        reward=SimpleNamespace(clip_range=c["clip"],
                               overlong_buffer_len=4.0 if c["penalties"] else None, overlong_penalty_factor=0.5,
                               stop_properly_penalty_coef=0.25 if c["penalties"] else None))


def experiences(case: dict, precise: bool = False, perturb: int | None = None) -> list:
    """Real OpenRLHF ``Experience`` micro-batches (fresh objects each call)."""
    out = []
    for k, m in enumerate(case["micro"]):
        rewards, kl, values = m["rewards"].clone(), m["kl"].clone(), m["values"].clone()
        if precise:
            rewards, kl, values = rewards.double(), kl.double(), values.double()
            if perturb is not None:
                def move(t, shift):
                    flat = torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape)
                    sign = torch.ones_like(flat) if perturb == 0 else (-1.0) ** (flat + perturb + shift)
                    return t * (1 + (3 if perturb == 0 else 2) * U64 * sign)
                rewards, kl, values = move(rewards, k), move(kl, k + 1), move(values, k)
        out.append(PPO_UTILS.Experience(rewards=rewards, action_mask=m["mask"].clone(), kl=kl, values=values,
                                        index=list(m["index"]), response_length=m["response_length"].clone(),
                                        truncated=m["truncated"].clone(), info={}))
    return out


def maker_for(case: dict):
    args = args_for(case)
    maker = object.__new__(EM.RemoteExperienceMaker)
    maker.strategy = SimpleNamespace(args=args)
    maker.args = args
    maker.advantage_estimator = case["estimator"]
    maker.kl_ctl = PPO_UTILS.FixedKLController(case["config"]["kl"][1] if case["config"]["kl"] else 0.0)
    return maker


def run_released(case: dict, precise: bool = False, perturb: int | None = None):
    maker = maker_for(case)
    exps = experiences(case, precise, perturb)
    with (openrlhf_ref._float64_kept() if precise else _null()):
        out = RELEASED(maker, exps)
    return maker, out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def fields(out: list) -> dict[str, torch.Tensor]:
    return {"advantages": torch.cat([e.advantages.flatten() for e in out]),
            "returns": torch.cat([e.returns.flatten() for e in out]),
            "info.return": torch.cat([e.info["return"] for e in out])}


def requests_ok(server) -> float:
    return sum(s.value for family in server.metrics.registry.collect() for s in family.samples
               if s.name == "advantage_requests_total" and s.labels.get("method") == "ComputeAdvantage"
               and s.labels.get("code") == "OK")


@pytest.fixture(scope="module")
def installed(server):
    client = AdvantageClient(server.address, timeout=60.0)
    dropin.install(client, maker_class=EM.RemoteExperienceMaker)
    try:
        yield
    finally:
        dropin.uninstall()
        client.close()


def check(case: dict, server) -> None:
    native_maker, native = run_released(case)
    _, y64 = run_released(case, precise=True)
    want = {k: v.double() for k, v in fields(y64).items()}
    sens = {k: torch.zeros_like(v) for k, v in want.items()}
    for pattern in range(3):
        _, moved = run_released(case, precise=True, perturb=pattern)
        for k, v in fields(moved).items():
            sens[k] = torch.maximum(sens[k], (v.double() - want[k]).abs())

    dropin.install(dropin._target, maker_class=EM.RemoteExperienceMaker)
    assert dropin.installed(EM.RemoteExperienceMaker)
    maker = maker_for(case)
    exps = experiences(case)
    before = requests_ok(server)
    out = maker.compute_advantages_and_returns(exps)  # OpenRLHF's method name, now the drop-in's
    calls = requests_ok(server) - before
    assert calls == 1, (case["estimator"], calls)  # one request computes everything (the drop-in holds no math)

    assert maker.args.algo.advantage.gamma == native_maker.args.algo.advantage.gamma
    for got, ref in zip(out, native):
        assert got.kl is None and ref.kl is None
        assert torch.equal(got.rewards, ref.rewards) and got.rewards.dtype == ref.rewards.dtype
        assert set(got.info) == set(ref.info), (set(got.info), set(ref.info))
        if "group_reward_std" in ref.info:
            assert torch.equal(got.info["group_reward_std"], ref.info["group_reward_std"])
        for name in ("advantages", "returns"):
            g, r = getattr(got, name), getattr(ref, name)
            assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype, g.shape, r.shape)
        assert got.info["return"].dtype == ref.info["return"].dtype
    np_dtype = np.float32 if case["config"]["dtype"] == torch.float32 else np.float64
    for name, g in fields(out).items():
        w, s = want[name].numpy(), sens[name].numpy()
        g = g.double().numpy()
        assert np.isfinite(w).all() and np.isfinite(g).all(), name
        scale = float(np.abs(w).max())
        tol = np.spacing(np.abs(w).astype(np_dtype)).astype(np.float64) / 2 + 16 * U64 * scale + 16 * s
        bad = np.abs(g - w) > tol
        assert not bad.any(), (f"{case['estimator']} {name}: drop-in != OpenRLHF 0.11.2 (float64 run) at "
                               f"{int(bad.sum())} positions: got {g[bad][:5]} want {w[bad][:5]} tol {tol[bad][:5]}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_dropin_equals_released_openrlhf(installed, server, estimator, config, seed):
    check(make_case(estimator, CONFIGS[config], seed), server)


def test_install_replaces_and_uninstall_restores(installed):
    original = dropin._original[1]
    assert original is RELEASED
    assert EM.RemoteExperienceMaker.compute_advantages_and_returns is not original
    dropin.uninstall()
    assert EM.RemoteExperienceMaker.compute_advantages_and_returns is original
    assert not dropin.installed(EM.RemoteExperienceMaker)
    dropin.install(dropin._target, maker_class=EM.RemoteExperienceMaker)
    assert dropin.installed(EM.RemoteExperienceMaker)


def test_every_released_estimator_is_served():
    """The drop-in covers the CLI's ``--algo.advantage.estimator`` choices of the installed 0.11.2 (read from
    openrlhf/cli/train_ppo_ray.py's text, since that module needs Ray/DeepSpeed to import)."""
    import importlib.util
    import pathlib
    import re
    cli = pathlib.Path(importlib.util.find_spec("openrlhf").origin).parent / "cli" / "train_ppo_ray.py"
    text = cli.read_text()
    block = re.search(r'"--algo\.advantage\.estimator",.*?choices=\[(.*?)\]', text, re.S).group(1)
    choices = set(re.findall(r'"(\w+)"', block))
    assert choices == set(ESTIMATORS) == set(dropin.ESTIMATORS)


def test_unknown_estimator_raises(installed):
    case = make_case("rloo", CONFIGS["f32-plain"], 0)
    maker = maker_for(case)
    maker.args.algo.advantage.estimator = maker.advantage_estimator = "ppo"
    with pytest.raises(ValueError, match="Unkown advantage_estimator"):
        maker.compute_advantages_and_returns(experiences(case))


def test_install_outside_a_ray_worker_warns_naming_the_setup_hook(monkeypatch):
    """Issue #36 item 1: ``install()`` in the driver (the module docstring's one line, before OpenRLHF's
    ``train(args)``) patched only the driver's class, and OpenRLHF 0.11.2 runs the experience maker in its
    PPOTrainer Ray actor: it silently did nothing. It now warns, naming Ray's worker setup hook; in a Ray worker
    (where the hook runs it) it does not."""
    monkeypatch.setattr(dropin, "_experience_maker_class", lambda: EM.RemoteExperienceMaker)
    was, target = dropin.installed(EM.RemoteExperienceMaker), dropin._target  # the module fixture's install, if any
    try:
        with pytest.warns(RuntimeWarning, match="worker_process_setup_hook"):
            dropin.install("localhost:1")
        monkeypatch.setattr(dropin, "_in_ray_worker", lambda: True)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dropin.install("localhost:1")
    finally:
        dropin.uninstall()
        if was:
            dropin.install(target, maker_class=EM.RemoteExperienceMaker)
