"""Test-only (tests/installed/test_areal_launch.py): with ``ADVANTAGE_TEST_AREAL_LAUNCH=1`` in the environment, every
Python process started with this directory on ``PYTHONPATH`` (the launch's driver, and AReaL's workers, which get the
driver's ``sys.path``) gets the changes below when it imports the AReaL module named; nothing else changes.

* ``areal.trainer.rl_trainer.PPOTrainer._init_rollout`` (AReaL 1.0.4 rl_trainer.py:308, called from
  ``PPOTrainer.__init__`` once the actor and ref controllers are initialised, i.e. their workers run and hold their
  engines) becomes the probe: it starts the inference servers (vLLM/SGLang: GPU-only), the first step a CPU cannot
  run. The probe runs the trainer's own ``self.actor.compute_advantages`` (AReaL's controller -> its worker's engine
  over AReaL's RPC) and AReaL's own ``PPOActor.compute_advantages`` in the driver on copies of the same trajectories
  (two batches: :data:`BATCHES`), saves both results (``$ADVANTAGE_TEST_AREAL_PROBE`` + ``.pt``, compared by the
  test), writes what it saw to ``$ADVANTAGE_TEST_AREAL_PROBE`` (JSON), deletes the workers and raises
  :class:`ProbeDone`, which ends the launch.
* ``areal.infra.controller.train_controller.TrainController.initialize`` (train_controller.py:254) first removes
  ``$ADVANTAGE_SERVICE_TARGET`` from the driver's environment (kept in :data:`SEEN`): the workers, started from here
  on (a local process, or a Ray actor on the local Ray cluster, which starts here too), get the target only through
  AReaL's ``scheduling_spec[i].env_vars``, the path it takes to workers on other nodes.
* loopback only: ``areal.infra.scheduler.local.gethostip`` and the address part of
  ``areal.infra.scheduler.ray.get_placement_group_master_ip_and_port`` return 127.0.0.1 (AReaL addresses its workers
  by the host's interface address; the yaml binds them to 127.0.0.1).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

TARGET_ENV = "ADVANTAGE_SERVICE_TARGET"
#: the probe's batches: name -> keywords of test_areal_installed.trajectories (2 prompts x 4 samples: the yaml's
#: reward_norm group_size). float32 as AReaL's rollouts; float64 critic values: float64 returns (held to 1e-9)
BATCHES = {"rollout_float32": dict(seed=361, groups=2, n=4, ref=True, prox=True),
           "values_float64": dict(seed=362, groups=2, n=4, ref=True, prox=True, values=True, dtype="float64")}
SEEN: dict = {}


class ProbeDone(RuntimeError):
    """The probe ran: the launch stops here (what follows needs GPUs)."""


def _initialize(original):
    def initialize(self, *args, **kwargs):
        if TARGET_ENV in os.environ:
            SEEN["driver_target"] = os.environ.pop(TARGET_ENV)
        return original(self, *args, **kwargs)

    return initialize


def _probe(self, *args, **kwargs):
    import copy
    import json

    import torch
    from areal.infra.rpc.rtensor import RTensor
    from areal.trainer.ppo.actor import PPOActor

    from test_areal_installed import trajectories

    out = os.environ["ADVANTAGE_TEST_AREAL_PROBE"]
    try:
        results = {}
        for name, kw in BATCHES.items():
            kw = {**kw, "dtype": getattr(torch, kw.get("dtype", "float32"))}
            data = trajectories(**kw)
            want = PPOActor(self.config.actor, object()).compute_advantages(copy.deepcopy(data))  # AReaL's own
            got = RTensor.localize(self.actor.compute_advantages(copy.deepcopy(data)))  # the worker's engine
            results[name] = {"got": got, "want": want}
        torch.save(results, out + ".pt")
        engine = self.actor.train_engine
        ref = None if self.ref is None else self.ref.train_engine
        seen = {**SEEN, "pid": os.getpid(), "controller": type(self.actor).__name__,
                "train_engine": f"{engine.__module__}.{engine.__name__}",
                "ref_controller": None if self.ref is None else type(self.ref).__name__,
                "ref_engine": None if ref is None else f"{ref.__module__}.{ref.__name__}",
                "actor_env_vars": dict(self.config.actor.scheduling_spec[0].env_vars or {}),
                "driver_target_at_probe": os.environ.get(TARGET_ENV),
                "scheduler": type(getattr(self, "scheduler", None)).__name__}
        with open(out, "w") as f:
            json.dump(seen, f)
    finally:
        self.actor.destroy()  # its workers (the ref is colocated on them)
    raise ProbeDone(f"advantage test probe done in pid {os.getpid()}")


def _after(name, module):
    if name == "areal.trainer.rl_trainer":
        module.PPOTrainer._init_rollout = _probe
    elif name == "areal.infra.controller.train_controller":
        module.TrainController.initialize = _initialize(module.TrainController.initialize)
    elif name == "areal.infra.scheduler.local":
        module.gethostip = lambda *a, **k: "127.0.0.1"
    elif name == "areal.infra.scheduler.ray":
        found = module.get_placement_group_master_ip_and_port
        module.get_placement_group_master_ip_and_port = lambda *a, **k: ("127.0.0.1", found(*a, **k)[1])


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_after` on the modules named once they have been executed."""

    names = ("areal.trainer.rl_trainer", "areal.infra.controller.train_controller", "areal.infra.scheduler.local",
             "areal.infra.scheduler.ray")

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _after(name, module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("ADVANTAGE_TEST_AREAL_LAUNCH") == "1":
    sys.meta_path.insert(0, _AfterImport())
