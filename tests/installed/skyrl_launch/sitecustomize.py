"""Test-only (tests/installed/test_skyrl_installed.py): with ``ADVANTAGE_TEST_SKYRL_LAUNCH=1`` in the environment,
every Python process started with this directory on ``PYTHONPATH`` (the launch's driver and the Ray workers it
starts) has the test's probe in place of ``skyrl.utils.tok.get_tokenizer``, and nothing else changes.

SkyRL 0.4.0's launch (``main_base.main``) parses the overrides, validates them (an estimator name SkyRL's registry
lacks is refused there), runs ``initialize_ray`` (its ``ray.init`` and ``sync_registries``), then runs
``skyrl_entrypoint`` as a Ray task, whose ``BasePPOExp`` first loads the policy's tokenizer: the probe. From there
on SkyRL builds the GPU stack (vLLM engines, FSDP workers), which a CPU cannot run. The probe, in that Ray worker,
runs SkyRL's own ``compute_advantages_and_returns`` with the launched estimator name (``$ADVANTAGE_TEST_SKYRL_ESTIMATOR``)
and with SkyRL's own name, on the batch of ``test_skyrl_installed.skyrl_batch``, writes what it saw to
``$ADVANTAGE_TEST_SKYRL_PROBE`` (a JSON file: the worker's pid, the job's runtime-environment variables, the
registry's names, the largest difference) and raises :class:`ProbeDone`, which ends the launch."""
from __future__ import annotations

import os


class ProbeDone(RuntimeError):
    """The probe ran: the launch stops here (what follows needs GPUs)."""


def probe(*args, **kwargs):
    import json

    import ray
    import torch
    from skyrl.backends.skyrl_train.utils import ppo_utils

    from test_skyrl_installed import skyrl_batch

    name = os.environ["ADVANTAGE_TEST_SKYRL_ESTIMATOR"]
    kw = skyrl_batch(2)
    with torch.no_grad():
        remote = ppo_utils.compute_advantages_and_returns(adv_estimator=name, **{
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
        own = ppo_utils.compute_advantages_and_returns(adv_estimator=name.removeprefix("remote_"), **kw)
    for g, w in zip(remote, own):  # float64: the differential tests' rule 1 (an answer x1.0001 fails it)
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    seen = {"pid": os.getpid(), "env_vars": dict(ray.get_runtime_context().runtime_env.get("env_vars") or {}),
            "names": sorted(ppo_utils.AdvantageEstimatorRegistry.list_available()),
            "max_diff": max(float((g.double() - w.double()).abs().max()) for g, w in zip(remote, own))}
    with open(os.environ["ADVANTAGE_TEST_SKYRL_PROBE"], "w") as f:
        json.dump(seen, f)
    raise ProbeDone(f"advantage test probe done in pid {os.getpid()}")


if os.environ.get("ADVANTAGE_TEST_SKYRL_LAUNCH") == "1":
    import skyrl.utils.tok

    skyrl.utils.tok.get_tokenizer = probe
