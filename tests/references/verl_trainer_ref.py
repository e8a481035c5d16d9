"""verl's trainer-side advantage dispatch, imported in-process for the plugin tests (test-only; the service never
imports this module or verl).

``load()`` returns ``verl.trainer.ppo.ray_trainer`` of the installed verl (0.9.1, tests/references/requirements.txt),
whose ``compute_advantage(data: DataProto, adv_estimator, gamma, lam, num_repeat, norm_adv_by_std_in_grpo,
config)`` is what verl's PPO trainers call once per step. Everything it runs is verl's own code and the real
third-party packages its advantage path touches: ``DataProto`` (verl/protocol.py) over a real ``tensordict``
``TensorDict`` (tensordict 0.15.3, pinned in requirements.txt: pure Python; verl 0.9.1's metadata asks for
<= 0.10.0, whose wheel is compiled and whose pyvers pins packaging < 26, and nothing of ``DataProto`` the tests
use differs), ``torch``, ``numpy``, ``omegaconf`` and ``transformers`` (imported by verl's model and FSDP
utilities; installed for the TRL tests, and required here: without it :func:`load` raises ``ImportError``).

Stubbed, only where not really installed, as tests/references/verl_ref.py does (a stub class cannot be built and
a stub function raises when called, so a stub reached by an advantage computation fails the test): the modules
ray_trainer's import chain reads and no advantage code runs, listed in :data:`STUBS` with the only names read:
torchdata's ``StatefulDataLoader`` (the trainer's data loader), peft (LoRA), cachetools, uvicorn and fastapi (the
rollout HTTP server), plus verl_ref's own list. ray is the real one (a test dependency).
"""
from __future__ import annotations

import os
import types

from references import verl_ref
from references.stubs import import_with_stubs

__all__ = ["STUBS", "load", "stubbed"]

TARGET = "verl.trainer.ppo.ray_trainer"

#: module -> {attribute: kind} (kinds as verl_ref.STUBS): verl_ref's, and the modules ray_trainer adds
STUBS: dict[str, dict] = {
    **verl_ref.STUBS,
    "torchdata": {},
    "torchdata.stateful_dataloader": {"StatefulDataLoader": "class"},
    "peft": {"LoraConfig": "class", "TaskType": "class", "get_peft_model": "function"},
    "peft.utils": {},
    "peft.utils.save_and_load": {"get_peft_model_state_dict": "function"},
    "cachetools": {"LRUCache": "class"},
    "uvicorn": {"Config": "class", "Server": "class"},
    "fastapi": {"FastAPI": "class"},
}

_stubbed: list[str] = []
_module: types.ModuleType | None = None


def load() -> types.ModuleType:
    """``verl.trainer.ppo.ray_trainer``, imported once (the stubs are in ``sys.modules`` only during the import).
    Raises ``ImportError`` where transformers or tensordict is not installed (their real code is needed)."""
    global _module
    if _module is not None:
        return _module
    import importlib.util
    for package in ("transformers", "tensordict"):
        if importlib.util.find_spec(package) is None:
            raise ImportError(f"verl's ray_trainer needs the real {package} (tests/references/verl_trainer_ref.py)")
    os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    # with every stub at once: ``import verl`` may import a module $VERL_USE_EXTERNAL_MODULES names, which may
    # import ray_trainer itself (advantage_client.verl does)
    _module = import_with_stubs(TARGET, STUBS, verl_ref._build_stub, _stubbed)
    return _module


def stubbed() -> list[str]:
    """The top-level modules this harness stubbed (those not really installed)."""
    load()
    return list(_stubbed)


#: verl's v1 trainer (``trainer.use_v1=True``) computes advantages through ``compute_advantage_for_multi_trajectories``
#: of verl/trainer/ppo/v1/utils.py; v1's package ``__init__`` imports the whole v1 trainer stack (TransferQueue,
#: agent loops), so :func:`load_v1_utils` imports that one file under a package stand-in whose ``__init__`` is not
#: run, with ``transfer_queue`` stubbed (``KVBatchMeta``: an annotation of v1's replay buffer, which utils.py
#: imports for a constant) where it is not installed
V1_STUBS: dict[str, dict] = {"transfer_queue": {"KVBatchMeta": "class"}}
_v1: types.ModuleType | None = None


def load_v1_utils() -> types.ModuleType:
    """``verl.trainer.ppo.v1.utils`` of the installed verl, imported once (after :func:`load`)."""
    global _v1
    if _v1 is not None:
        return _v1
    import pathlib
    import sys

    load()
    package = "verl.trainer.ppo.v1"
    if package not in sys.modules:
        stand_in = types.ModuleType(package, "package stand-in (tests/references/verl_trainer_ref.py): "
                                             "verl/trainer/ppo/v1/__init__.py not run")
        stand_in.__path__ = [str(pathlib.Path(sys.modules["verl.trainer.ppo"].__file__).parent / "v1")]
        sys.modules[package] = stand_in
    _v1 = import_with_stubs(package + ".utils", V1_STUBS, verl_ref._build_stub, _stubbed)
    return _v1
