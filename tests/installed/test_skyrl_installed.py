"""SkyRL as its users install it (issue #28): run in a Python 3.12 venv holding ``skyrl==0.4.0`` with its declared
dependencies and Ray (tests/installed/requirements-skyrl.txt, built by ``make test-frameworks``), never in the
project's 3.11 venv (it skips there). Nothing of SkyRL is stubbed or loaded by a project loader: SkyRL is imported
as a user imports it.

The README's literal adoption: ``advantage_client.skyrl.register()`` on the driver (the target from
``$ADVANTAGE_SERVICE_TARGET``), after ``ray.init``, so SkyRL's registry actor carries the ``remote_`` names; then a
Ray task (another process, which imports SkyRL itself and registers nothing) runs SkyRL's own
``compute_advantages_and_returns`` with every ``remote_<name>`` (``trainer.algorithm.advantage_estimator=remote_<name>``)
and with SkyRL's ``<name>``. Each remote answer must equal SkyRL's by the differential tests' rule (float64 batches:
every position, rtol 1e-9 / atol 1e-9, tests/test_diff_skyrl.py rule 1; float64 because the float32 rule's rtol 2e-4
would let an answer scaled by 1.0001 pass), SkyRL's own names must not reach the service
(+0), and the server's ``advantage_requests_total`` must grow by exactly one per remote name (+5).

The server runs from the project's main venv (``$ADVANTAGE_SERVER_BIN``, default ``.venv/bin/advantage-server``)
in its own process, so the count is read where the README says to read it, at its metrics port.
"""
from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

if sys.version_info < (3, 12):
    pytest.skip("SkyRL 0.4.0 as installed needs Python >= 3.12: run by `make test-frameworks`",
                allow_module_level=True)

# Ray on 127.0.0.1 only (tests/conftest.py says why; this directory runs without it): set before Ray is imported
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
GROUP_SIZES = (3, 2, 4, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(metrics: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^advantage_requests_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def service():
    port, mport = _free_port(), _free_port()
    binary = os.environ.get("ADVANTAGE_SERVER_BIN", str(ROOT / ".venv" / "bin" / "advantage-server"))
    proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             "--metrics-port", str(mport), "--no-warmup", "--log-level", "WARNING"])
    metrics = f"127.0.0.1:{mport}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _requests(metrics)
            break
        except OSError:
            assert proc.poll() is None, f"{binary} exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            time.sleep(0.5)
    try:
        yield f"127.0.0.1:{port}", metrics
    finally:
        proc.terminate()
        proc.wait(30)


def skyrl_batch(seed: int) -> dict:
    """The keywords SkyRL's trainer passes ``compute_advantages_and_returns`` (as tests/test_skyrl_plugin.py)."""
    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.full(n, g) for g, n in enumerate(GROUP_SIZES)])
    rng.shuffle(labels)
    B, T = len(labels), 6
    mask = (np.arange(T)[None, :] < rng.integers(2, T + 1, B)[:, None]).astype(np.int64)
    mask[rng.random(B) < 0.3, 0] = 0
    last = T - 1 - np.argmax(mask[:, ::-1], 1)
    rewards = np.zeros((B, T))
    rewards[np.arange(B), last] = np.round(rng.normal(0.5, 1.0, B), 3)
    rewards += np.round(rng.normal(0, 0.3, (B, T)), 3) * mask
    return {"token_level_rewards": torch.from_numpy(rewards), "response_mask": torch.from_numpy(mask),
            "index": [f"{g:08x}-5f1c-4b7e-9a2d-{g * 31:012x}" for g in labels],
            "values": torch.from_numpy(np.round(rng.normal(0, 1, (B, T)), 3)),
            "grpo_norm_by_std": True, "gamma": 0.99, "lambd": 0.95, "config": None}


def _in_worker(kw: dict) -> dict:
    """A Ray task: SkyRL imported as a user imports it, nothing registered here."""
    import os

    from skyrl.backends.skyrl_train.utils import ppo_utils

    local = sorted(ppo_utils.AdvantageEstimatorRegistry._functions)
    names = sorted(ppo_utils.AdvantageEstimatorRegistry.list_available())
    out = {}
    for name in names:
        fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        with torch.no_grad():
            out[name] = ppo_utils.compute_advantages_and_returns(adv_estimator=name, **fresh)
    return {"pid": os.getpid(), "local_before": local, "names": names, "out": out}


def test_readme_register_reaches_the_service_from_a_ray_task(service, monkeypatch):
    address, metrics = service
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", address)
    # address="local": a cluster of this test's own, never one the machine already runs (a `ray start` left on
    # 127.0.0.1:6379 made a bare ray.init() attach to it and refuse num_cpus: CI, 2026-12-06), nor $RAY_ADDRESS's.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"ADVANTAGE_SERVICE_TARGET": address,
                                          "PYTHONPATH": os.pathsep.join(filter(None, [
                                              str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH")]))}})
    try:
        import advantage_client.skyrl
        from skyrl.backends.skyrl_train.utils import ppo_utils

        own = sorted(n for n in ppo_utils.AdvantageEstimatorRegistry.list_available() if not n.startswith("remote_"))
        added = advantage_client.skyrl.register()  # the README's line
        assert sorted(added) == sorted("remote_" + n for n in own), (added, own)
        assert len(added) == 5, added
        assert ray.get_actor(ppo_utils.AdvantageEstimatorRegistry._actor_name) is not None

        kw = skyrl_batch(1)
        before = _requests(metrics)
        result = ray.get(ray.remote(num_cpus=0)(_in_worker).remote(kw), timeout=300)
        after = _requests(metrics)
        assert result["pid"] != os.getpid()
        assert not any(n.startswith("remote_") for n in result["local_before"]), result["local_before"]
        assert set(added) <= set(result["names"]), result["names"]
        assert after - before == len(added), f"the service counted +{after - before}, want +{len(added)}"
        worst = 0.0
        for name in own:
            want, got = result["out"][name], result["out"]["remote_" + name]
            for w, g, what in zip(want, got, ("advantages", "returns")):
                assert g.shape == w.shape and g.dtype == w.dtype, (name, what, g.shape, w.shape, g.dtype, w.dtype)
                assert torch.isfinite(w).all() and torch.isfinite(g).all(), (name, what)
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=f"remote_{name} {what} != SkyRL's")
                worst = max(worst, float((g.double() - w.double()).abs().max()))
        print(f"SkyRL as installed: +{after - before} requests, {len(own)} names, max |diff| {worst:.3g}")
        advantage_client.skyrl.unregister()
    finally:
        ray.shutdown()


def _launch_env(address: str, tmp_path: pathlib.Path) -> tuple[dict, list[str]]:
    """The launch's environment (the probe on, ``RAY_ADDRESS=local``: a cluster of the launch's own on loopback)
    and SkyRL's overrides (``remote_grpo``; the console logger: SkyRL's default, wandb, needs an API key)."""
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "ADVANTAGE_SERVICE_TARGET": address, "ADVANTAGE_TEST_SKYRL_LAUNCH": "1",
           "ADVANTAGE_TEST_SKYRL_ESTIMATOR": "remote_grpo", "ADVANTAGE_TEST_SKYRL_PROBE": str(tmp_path / "probe.json"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(pathlib.Path(__file__).parent / "skyrl_launch"),
                                                       str(pathlib.Path(__file__).parent),
                                                       os.environ.get("PYTHONPATH")]))}
    overrides = ["trainer.algorithm.advantage_estimator=remote_grpo", "trainer.logger=console",
                 f"trainer.log_path={tmp_path / 'logs'}", f"trainer.ckpt_path={tmp_path / 'ckpt'}"]
    return env, overrides


LAUNCHES = {
    # the one change: the launcher module in place of SkyRL's
    "launcher": [sys.executable, "-m", "advantage_client.skyrl"],
    # SkyRL's own module, through its hook for custom entry points
    "override_entrypoint": [sys.executable, "-m", "skyrl.train.entrypoints.main_base",
                            "trainer.override_entrypoint=advantage_client.skyrl"],
}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_skyrls_own_launch_with_the_one_change_reaches_the_service(service, tmp_path, launch):
    """SkyRL's launch as its users type it (``main_base`` with its overrides), with the documented change: SkyRL's
    own argument parsing, ``validate_cfg``, ``initialize_ray`` (a local cluster on loopback of the launch's own,
    ``RAY_ADDRESS=local``) and ``skyrl_entrypoint`` as a Ray task, as far as a CPU allows. The probe
    (``tests/installed/skyrl_launch/sitecustomize.py``, in place of the policy tokenizer's load, the first step of
    ``BasePPOExp``) runs SkyRL's ``compute_advantages_and_returns`` with ``remote_grpo`` in that worker. The service
    counts exactly one request; the worker's job environment carries ``$ADVANTAGE_SERVICE_TARGET`` (forwarded to
    every node, not inherited from the driver's shell); the answer equals SkyRL's own ``grpo`` to 1e-9 (float64).
    Checked at x1.0001: with the server's ``grpo`` answer scaled by 1.0001 (``$ADVANTAGE_SERVER_BIN`` a wrapper
    that scales it), both launches fail in the probe's comparison."""
    address, metrics = service
    env, overrides = _launch_env(address, tmp_path)
    out = pathlib.Path(env["ADVANTAGE_TEST_SKYRL_PROBE"])
    before = _requests(metrics)
    done = subprocess.run([*LAUNCHES[launch], *overrides], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    after = _requests(metrics)
    log = done.stdout[-3000:] + done.stderr[-6000:]
    assert "ProbeDone: advantage test probe done" in log, log  # the launch got as far as the probe, and no further
    seen = __import__("json").loads(out.read_text())
    assert seen["env_vars"].get("ADVANTAGE_SERVICE_TARGET") == address, seen["env_vars"]
    assert "remote_grpo" in seen["names"] and seen["max_diff"] <= 1e-9, seen
    assert after - before == 1, f"the service counted +{after - before}, want +1"


def test_skyrls_own_launch_without_the_change_refuses_the_remote_name(service, tmp_path):
    """SkyRL's module alone: its ``validate_cfg`` refuses ``remote_grpo`` (the launch never reaches the probe), and
    the service counts nothing: what the one change above adds."""
    address, metrics = service
    env, overrides = _launch_env(address, tmp_path)
    before = _requests(metrics)
    done = subprocess.run([sys.executable, "-m", "skyrl.train.entrypoints.main_base", *overrides], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode != 0 and "remote_grpo" in log and "ProbeDone" not in log, log
    assert _requests(metrics) == before
