"""Test-only (tests/test_openrlhf_launch.py): with ``ADVANTAGE_TEST_OPENRLHF_LAUNCH=1`` in the environment, every
Python process started with this directory on ``PYTHONPATH`` (the launcher's driver and the Ray workers it starts)
finds stubs for OpenRLHF's GPU stack, which a CPU cannot run, and nothing else changes:

* ``openrlhf.trainer.ray`` (vLLM engines: ``create_vllm_engines``), ``openrlhf.trainer.ray.launcher``
  (``RayActorGroup``, ``ReferenceModelActor``, ``RewardModelActor``), ``.ppo_actor`` (``PolicyModelActor``),
  ``.ppo_critic`` (``CriticModelActor``): DeepSpeed and vLLM actors. A stub class cannot be built, a stub function
  raises, so a stub reached by the launch fails the test;
* ``openrlhf.utils`` and ``openrlhf.models`` entered without their ``__init__`` (which import DeepSpeed, flash-attn,
  the grading code), their submodules the released files; ``openrlhf.utils.get_strategy`` (the DeepSpeed strategy,
  the first thing ``train(args)`` does after its ``ray.init``) is the test's probe, :func:`probe`;
* ``deepspeed``, where it is not installed.

The probe runs in the driver inside OpenRLHF's ``train(args)``, after OpenRLHF's own ``ray.init``: it records the
job's runtime environment, runs OpenRLHF 0.11.2's released ``RemoteExperienceMaker.compute_advantages_and_returns``
in a Ray worker of the job (tests/references/openrlhf_ref.py builds the maker and its ``Experience`` batch) and in
the driver, prints one ``PROBE {json}`` line and ends the process (``os._exit(0)``): what follows in ``train`` is the
GPU stack."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

if os.environ.get("ADVANTAGE_TEST_OPENRLHF_LAUNCH") == "1":
    _STUBS = {
        "openrlhf.trainer.ray": {"create_vllm_engines": "function", "batch_vllm_engine_call": "function"},
        "openrlhf.trainer.ray.launcher": {"RayActorGroup": "class", "ReferenceModelActor": "class",
                                          "RewardModelActor": "class"},
        "openrlhf.trainer.ray.ppo_actor": {"PolicyModelActor": "class"},
        "openrlhf.trainer.ray.ppo_critic": {"CriticModelActor": "class"},
    }
    _SHELLS = ("openrlhf.utils", "openrlhf.models")

    def _stub(module: str, name: str, kind: str):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"{module}.{name} is a stub of tests/openrlhf_launch/sitecustomize.py (GPU stack)")
        if kind == "class":
            return type(name, (), {"__init__": refuse, "__module__": module})
        refuse.__name__ = name
        return refuse

    class _Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return types.ModuleType(spec.name, f"stub or shell of {spec.name} (tests/openrlhf_launch)")

        def exec_module(self, module):
            name = module.__name__
            if name in _STUBS:
                module.__path__ = []
                for attr, kind in _STUBS[name].items():
                    setattr(module, attr, _stub(name, attr, kind))
            else:  # a shell: the real package directory, its __init__ not run
                real = importlib.util.find_spec("openrlhf").submodule_search_locations[0]
                module.__path__ = [os.path.join(real, name.split(".", 1)[1])]
                if name == "openrlhf.utils":
                    module.get_strategy = probe

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname in _STUBS or fullname in _SHELLS:
                return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
            return None

    if importlib.util.find_spec("deepspeed") is None:
        _STUBS["deepspeed"] = {}
    sys.meta_path.insert(0, _Finder())


def _case():
    import torch
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    return rewards, mask, 2, [3, 0, 1, 5, 2, 4], [4, 2]


def _in_worker() -> dict:
    """In a Ray worker of the launched job: OpenRLHF's released method on a real maker, whatever the job's setup
    hook made of it."""
    import advantage_client.openrlhf as dropin
    from references import openrlhf_ref

    em = openrlhf_ref.load()
    rewards, mask, n, index, sizes = _case()
    adv, ret = openrlhf_ref.compute("rloo", rewards, mask, n, index, sizes)
    return {"pid": os.getpid(), "installed": dropin.installed(em.RemoteExperienceMaker),
            "advantages": adv.tolist(), "returns": ret.tolist(),
            "target": os.environ.get("ADVANTAGE_SERVICE_TARGET")}


def probe(args):
    """Stands in for ``openrlhf.utils.get_strategy(args)``, the first call of OpenRLHF's ``train(args)`` after its
    ``ray.init``: see the module docstring."""
    import json

    import ray

    from references import openrlhf_ref

    runtime_env = dict(ray.get_runtime_context().runtime_env)
    worker = ray.get(ray.remote(num_cpus=0)(_in_worker).remote(), timeout=300)
    rewards, mask, n, index, sizes = _case()
    adv, ret = openrlhf_ref.compute("rloo", rewards, mask, n, index, sizes)  # the driver: OpenRLHF's own method
    print("PROBE " + json.dumps({
        "driver_pid": os.getpid(), "runtime_env": runtime_env, "worker": worker,
        "released": {"advantages": adv.tolist(), "returns": ret.tolist()},
        "args": {"estimator": args.algo.advantage.estimator, "n_samples_per_prompt": args.rollout.n_samples_per_prompt},
    }), flush=True)
    sys.stdout.flush()
    os._exit(0)
