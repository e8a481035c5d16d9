"""OpenRLHF adopted at its own entry point (issue #36 item 1): a user's ``python -m openrlhf.cli.train_ppo_ray ...``
becomes ``python -m advantage_client.openrlhf ...``, and nothing else changes.

The test runs exactly that command, with the arguments a user gives OpenRLHF, in a fresh process: OpenRLHF 0.11.2's
own ``train_ppo_ray`` module runs unchanged as ``__main__`` (its argument parsing, its checks, ``train(args)`` and
``train``'s own ``ray.init``, which starts a local Ray cluster on 127.0.0.1: ``RAY_ADDRESS=local``,
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``). What a CPU cannot run is stubbed, and only that
(tests/openrlhf_launch/sitecustomize.py): the vLLM and DeepSpeed actors ``train`` would build, and
``get_strategy``, the first call after ``ray.init``, which is the test's probe. The probe reads the job's runtime
environment, and runs OpenRLHF's released ``RemoteExperienceMaker.compute_advantages_and_returns`` (``rloo``, a
real maker and ``Experience`` batch from tests/references/openrlhf_ref.py) in a Ray worker of the job and in the
driver. Checked:

* the job's runtime environment has the drop-in as Ray's ``worker_process_setup_hook``, the service's address
  forwarded, and OpenRLHF's own ``env_vars`` (``TOKENIZERS_PARALLELISM``, ``NCCL_DEBUG``,
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``) kept;
* in the worker (another process) the experience maker's method is the drop-in's, it reached the server (the
  server's own count of OK ComputeAdvantage calls grows by exactly 1) and its advantages and returns equal
  OpenRLHF's own in the driver within 1e-12 (so a service off by x1.0001 fails: checked by scaling the server's
  results in ``AdvantageCore.run`` by 1.0001 by hand, 2026-12-06);
* OpenRLHF parsed the user's arguments (``--algo.advantage.estimator rloo --rollout.n_samples_per_prompt 2``).

Not run: the PPOTrainer actor itself (it needs the GPU stack); the worker stands in for it, as any actor of the job
gets the same setup hook."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("ray")
from references import openrlhf_ref  # noqa: E402

openrlhf_ref.load()  # openrlhf installed (the differential tests' pin)
TESTS = pathlib.Path(__file__).resolve().parent


def requests_ok(server) -> float:
    return sum(s.value for family in server.metrics.registry.collect() for s in family.samples
               if s.name == "advantage_requests_total" and s.labels.get("method") == "ComputeAdvantage"
               and s.labels.get("code") == "OK")


def test_openrlhfs_own_launch_with_the_launcher_reaches_the_service(server, tmp_path):
    env = {**os.environ, "ADVANTAGE_TEST_OPENRLHF_LAUNCH": "1", "ADVANTAGE_SERVICE_TARGET": server.address,
           "RAY_ADDRESS": "local", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS / "openrlhf_launch"), str(TESTS),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("ADVANTAGE_SERVICE_TLS_CA", None)
    env.pop("ADVANTAGE_SERVICE_TOKEN_FILE", None)
    before = requests_ok(server)
    proc = subprocess.run([sys.executable, "-m", "advantage_client.openrlhf",  # was: -m openrlhf.cli.train_ppo_ray
                           "--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and len(lines) == 1, (proc.returncode, proc.stdout[-3000:], proc.stderr[-5000:])
    probe = json.loads(lines[0][len("PROBE "):])
    assert requests_ok(server) - before == 1, "the worker's experience maker did not reach the service once"

    runtime_env = probe["runtime_env"]
    assert runtime_env["worker_process_setup_hook"] == "advantage_client.openrlhf.install", runtime_env
    env_vars = runtime_env["env_vars"]
    assert env_vars["ADVANTAGE_SERVICE_TARGET"] == server.address
    assert {"TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"} <= set(env_vars), env_vars
    assert probe["args"] == {"estimator": "rloo", "n_samples_per_prompt": 2}

    worker = probe["worker"]
    assert worker["pid"] != probe["driver_pid"] and worker["installed"], worker
    assert worker["target"] == server.address
    for field in ("advantages", "returns"):
        got, want = np.array(worker[field]), np.array(probe["released"][field])
        assert got.shape == want.shape == (6, 3)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert np.abs(want).max() > 0.4  # (a batch with non-zero answers)


def test_the_launcher_keeps_a_runtime_environments_own_settings(monkeypatch):
    """``with_setup_hook``: the hook added, the service's variables forwarded, OpenRLHF's own variables kept (an
    explicit value in them wins), another setup hook refused with the way to combine them."""
    from advantage_client import openrlhf as dropin

    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", "svc:50051")
    monkeypatch.delenv("ADVANTAGE_SERVICE_TLS_CA", raising=False)
    monkeypatch.setenv("ADVANTAGE_SERVICE_TOKEN_FILE", "/run/token")
    env = dropin.with_setup_hook({"env_vars": {"NCCL_DEBUG": "WARN", "ADVANTAGE_SERVICE_TARGET": "mine:1"},
                                  "pip": ["x"]})
    assert env == {"env_vars": {"NCCL_DEBUG": "WARN", "ADVANTAGE_SERVICE_TARGET": "mine:1",
                                "ADVANTAGE_SERVICE_TOKEN_FILE": "/run/token"},
                   "pip": ["x"], "worker_process_setup_hook": "advantage_client.openrlhf.install"}
    with pytest.raises(ValueError, match="install"):
        dropin.with_setup_hook({"worker_process_setup_hook": "mypkg.setup"})


def test_the_launcher_under_ray_job_submit_adds_nothing_the_job_gives(monkeypatch):
    """Fresh-eyes review: under ``ray job submit --runtime-env-json '{"env_vars": {"ADVANTAGE_SERVICE_TARGET": ...}}'``
    the driver has that variable, and Ray refuses a ``ray.init`` runtime environment repeating any key or variable
    name of the job's ("Failed to merge the Job's runtime env ... because of a conflict"). The launcher reads the
    job's (``$RAY_JOB_CONFIG_JSON_ENV_VAR``) and adds only what it lacks; Ray's own merge accepts the result."""
    import json

    from advantage_client import openrlhf as dropin
    from ray.runtime_env.runtime_env import _merge_runtime_env as merge  # ray.init's merge with the job's env

    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", "svc:50051")
    job = {"env_vars": {"ADVANTAGE_SERVICE_TARGET": "svc:50051"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": job}))
    openrlhf_env = {"env_vars": {"NCCL_DEBUG": "WARN"}}
    mine = dropin.with_setup_hook(openrlhf_env, dropin._job_runtime_env())
    assert mine == {"env_vars": {"NCCL_DEBUG": "WARN"}, "worker_process_setup_hook": dropin.SETUP_HOOK}
    assert merge(job, mine, override=False) is not None
    assert merge(job, dropin.with_setup_hook(openrlhf_env), override=False) is None  # the conflict
    hooked = {"worker_process_setup_hook": dropin.SETUP_HOOK, "env_vars": {"ADVANTAGE_SERVICE_TARGET": "svc:50051"}}
    assert dropin.with_setup_hook(openrlhf_env, hooked) == openrlhf_env  # the job gives both: nothing added
    with pytest.raises(ValueError, match="install"):
        dropin.with_setup_hook(openrlhf_env, {"worker_process_setup_hook": "mypkg.setup"})
