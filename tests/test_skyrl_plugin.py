"""The SkyRL plugin (``advantage_client.skyrl.register``, issue #24): SkyRL 0.4.0's own
``compute_advantages_and_returns`` with ``remote_<name>`` equals it with SkyRL's ``<name>``, for every estimator of
SkyRL's ``AdvantageEstimatorRegistry`` (the loop is over the names the release registers: a new one fails
``test_plugin_covers_the_released_registry``). SkyRL is loaded by tests/references/skyrl_ref.py (its stand-ins:
SkyRL's package ``__init__``s, ``ray`` with ``is_initialized`` False, so the registry is process-local here;
jaxtyping/loguru where not installed). Batches: uneven interleaved groups of two or more with distinct rewards,
right-padded masks with holes, outcome and token-level rewards, values for gae; float32 and float64;
``grpo_norm_by_std`` true and false; gamma/lambd varied. Compared with the SkyRL differential tests' rule
(tests/test_diff_skyrl.py, rule 1: every position, float64 1e-9 / 1e-9, float32 2e-4 / 2e-5); verl's side must be
finite (the batches stay in rule 1). A client that counts its calls proves that each remote name reached the
service with ``semantics = skyrl``.

The Ray half (SkyRL's registry backed by its named Ray actor, an estimator registered on the driver called from a
Ray task through SkyRL's registry) is ``check_in_ray_worker`` below, run by tests/test_ray.py on the cluster its
``cluster`` fixture starts.
"""
from __future__ import annotations

import pathlib
import sys
from unittest import mock

import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient
from advantage_client import skyrl as plugin
from references import skyrl_ref
from references.stubs import really_installed
from test_diff_skyrl import TOL, _finite, _pair_close

PPO = skyrl_ref.load()
NAMES = sorted(n for n in PPO.AdvantageEstimatorRegistry._functions if not n.startswith("remote_"))
GROUP_SIZES = (3, 2, 4, 3)
TESTS = str(pathlib.Path(__file__).parent)


class CountingClient:
    """An ``AdvantageClient`` that records each call's estimator and config (the service did compute); also used
    by tests/test_verl_plugin.py."""

    def __init__(self, address: str) -> None:
        self.client = AdvantageClient(address, timeout=60.0)
        self.calls: list[tuple[str, dict]] = []

    def compute(self, estimator, config=None, **kwargs):
        self.calls.append((estimator, dict(config or {})))
        return self.client.compute(estimator, config, **kwargs)


@pytest.fixture
def service(server):
    spy = CountingClient(server.address)
    plugin.register(spy, registry=PPO.AdvantageEstimatorRegistry)
    try:
        yield spy
    finally:
        plugin.unregister(PPO.AdvantageEstimatorRegistry)
        spy.client.close()


def skyrl_batch(seed: int, dtype: torch.dtype) -> dict:
    """The keywords SkyRL's trainer passes ``compute_advantages_and_returns`` (besides the estimator's name)."""
    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.full(n, g) for g, n in enumerate(GROUP_SIZES)])
    rng.shuffle(labels)
    B, T = len(labels), 6
    mask = (np.arange(T)[None, :] < rng.integers(2, T + 1, B)[:, None]).astype(np.int64)
    mask[rng.random(B) < 0.3, 0] = 0
    last = T - 1 - np.argmax(mask[:, ::-1], 1)
    rewards = np.zeros((B, T))
    rewards[np.arange(B), last] = np.round(rng.normal(0.5, 1.0, B), 3)
    if seed % 2:
        rewards += np.round(rng.normal(0, 0.3, (B, T)), 3) * mask
    return {"token_level_rewards": torch.from_numpy(rewards).to(dtype), "response_mask": torch.from_numpy(mask),
            "index": [f"{g:08x}-5f1c-4b7e-9a2d-{g * 31:012x}" for g in labels],  # SkyRL's metadata["uids"]
            "values": torch.from_numpy(np.round(rng.normal(0, 1, (B, T)), 3)).to(dtype),
            "grpo_norm_by_std": seed % 2 == 0, "gamma": (1.0, 0.99, 0.9, 1.0)[seed],
            "lambd": (1.0, 0.95, 0.9, 0.0)[seed], "config": None}


def compute(name: str, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL's ``compute_advantages_and_returns`` on fresh copies (some estimators write into their inputs); the
    loguru stand-in is put back for the call where loguru is not installed (rloo imports it inside the call)."""
    stand_in = {} if really_installed("loguru") else {"loguru": skyrl_ref._stub("loguru", skyrl_ref.STUBS["loguru"])}
    fresh = {k: v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v
             for k, v in kw.items()}
    with mock.patch.dict(sys.modules, stand_in), torch.no_grad():
        return PPO.compute_advantages_and_returns(adv_estimator=name, **fresh)


def test_plugin_covers_the_released_registry(service):
    assert set(NAMES) == set(plugin.ESTIMATORS), f"SkyRL {skyrl_ref.version()} registers {NAMES}"
    added = plugin.register(service, registry=PPO.AdvantageEstimatorRegistry)  # idempotent
    assert sorted(added) == sorted("remote_" + n for n in NAMES)
    for name in NAMES:
        assert PPO.AdvantageEstimatorRegistry.get("remote_" + name).advantage_service == name


@pytest.mark.parametrize("name", NAMES)
def test_remote_name_equals_skyrl_name(name, service):
    assert name in plugin.ESTIMATORS, f"SkyRL {skyrl_ref.version()} registers {name!r}; the plugin lacks it"
    for seed in range(4):
        for dtype in (torch.float32, torch.float64):
            kw = skyrl_batch(seed, dtype)
            before = len(service.calls)
            want = compute(name, kw)
            assert len(service.calls) == before
            got = compute("remote_" + name, kw)
            calls = service.calls[before:]
            assert [c[0] for c in calls] == [plugin.ESTIMATORS[name]], calls
            if "semantics" in calls[0][1]:
                assert calls[0][1]["semantics"] == "skyrl"
            assert _finite(want), f"{name} seed {seed} {dtype}: SkyRL not finite: the batch must stay in rule 1"
            assert _finite(got) and got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
            ok, why = _pair_close(got, want, dtype)
            assert ok, f"remote_{name} != SkyRL's {name} (seed {seed}, {dtype}, tolerance {TOL[dtype]}): {why}"


def test_errors_name_the_missing_input(service):
    kw = skyrl_batch(0, torch.float64)
    with pytest.raises(TypeError, match="values"):
        compute("remote_gae", {**kw, "values": None})
    with pytest.raises(TypeError, match="index"):
        compute("remote_grpo", {**kw, "index": None})
    assert service.calls == []


def test_an_estimator_holding_a_client_refuses_to_leave_the_process(service):
    import cloudpickle

    with pytest.raises(TypeError, match="address"):
        cloudpickle.dumps(PPO.AdvantageEstimatorRegistry.get("remote_grpo"))
    estimator = cloudpickle.loads(cloudpickle.dumps(plugin.RemoteEstimator("maxrl", "10.0.0.1:50051")))
    assert (estimator.name, estimator.target) == ("maxrl", "10.0.0.1:50051")


def check_in_ray_worker(address: str) -> None:
    """On a Ray cluster this process is the driver of (``ray.init`` done): SkyRL's ppo_utils with the real ray
    (tests/references/skyrl_ray_ref.py), the plugin registered on the driver (so in SkyRL's registry actor), and a
    Ray task (another process, which loads SkyRL itself) that runs SkyRL's ``compute_advantages_and_returns`` with
    ``remote_grpo``/``remote_maxrl``: it finds them only through the registry actor and computes on the server at
    ``address``; the answers equal SkyRL's ``grpo``/``maxrl`` computed here."""
    import ray

    from references import skyrl_ray_ref

    ppo = skyrl_ray_ref.load()
    registry = ppo.AdvantageEstimatorRegistry
    assert ray.get_actor(registry._actor_name) is not None  # SkyRL created its registry actor
    plugin.register(address, registry=registry)
    try:
        kw = skyrl_batch(1, torch.float32)

        def in_worker(tests: str, kw: dict) -> dict:
            import os
            import sys

            sys.path.insert(0, tests)
            from references import skyrl_ray_ref as worker_ref

            worker = worker_ref.load()  # a registry of its own, with SkyRL's built-ins only
            local = sorted(worker.AdvantageEstimatorRegistry._functions)
            out = {name: worker.compute_advantages_and_returns(adv_estimator=name, **kw)
                   for name in ("remote_grpo", "remote_maxrl")}
            return {"pid": os.getpid(), "local_before": local, **out}

        result = ray.get(ray.remote(num_cpus=0)(in_worker).remote(TESTS, kw), timeout=240)
        assert result["pid"] != __import__("os").getpid()
        assert not any(n.startswith("remote_") for n in result["local_before"]), result["local_before"]
        for name in ("grpo", "maxrl"):
            want = ppo.compute_advantages_and_returns(adv_estimator=name, **{
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
            ok, why = _pair_close(result["remote_" + name], want, torch.float32)
            assert ok, f"remote_{name} in a Ray worker != SkyRL's {name}: {why}"
    finally:
        plugin.unregister(registry)
    assert not any(n.startswith("remote_") for n in registry.list_available())
