"""The released SkyRL's advantage code, run in-process as a test oracle (test-only; the service never imports
this module or skyrl).

Where the code is: SkyRL 0.4.0 (``skyrl==0.4.0`` on PyPI) keeps its advantage estimators in
``skyrl/backends/skyrl_train/utils/ppo_utils.py``: ``compute_gae_advantage_return``,
``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage`` and ``compute_maxrl_advantage``, registered in the
``AdvantageEstimatorRegistry`` under ``gae``, ``grpo``, ``rloo``, ``reinforce++`` and ``maxrl`` and called by
the trainer through ``compute_advantages_and_returns`` (:func:`compute` calls exactly that function, with the
keywords ``RayPPOTrainer.compute_advantages_and_returns`` passes). The file is imported as released, with
``torch_utils.py`` (``masked_mean``) and ``off_policy_correction_utils.py``, which it imports.

Python version. SkyRL 0.4.0 declares ``Requires-Python >= 3.12``; this venv and CI run Python 3.11. The three
modules above use nothing newer than 3.11 (``enum.StrEnum`` is 3.11; they compile and import under 3.11, and
:func:`load` imports them from the installed files), so ``make setup`` installs the pinned wheel with
``pip install --no-deps --ignore-requires-python`` (the Makefile's refs line; by hand:
``pip install --no-deps --ignore-requires-python skyrl==0.4.0``). Only the installed files are read; nothing
else of SkyRL (its trainer, inference, JAX backends) is imported.

Stand-ins, only while ppo_utils is imported (the previous ``sys.modules`` entries are restored afterwards, so
other harnesses' stubs and the real packages are untouched):
    * the packages ``skyrl``, ``skyrl.backends``, ``skyrl.backends.skyrl_train``,
      ``skyrl.backends.skyrl_train.utils``: empty package modules whose ``__path__`` is the installed
      directory, so their submodules load from the released files but the packages' ``__init__``s (which
      import SkyRL's backends, IO and trainer stack) do not run. No maths in them.
    * ``skyrl.train.config``: only ``AlgorithmConfig``, a class that cannot be built (an annotation in
      ppo_utils; the estimators take ``config`` and never read it).
    * ``ray``: the Ray actor registry's hooks only: ``remote`` (the ``RegistryActor`` decorator, returns the
      class unchanged) and ``is_initialized`` (False: the registry stays process-local, as SkyRL's own unit
      tests run it); every other ray function raises. A real ray, initialised by another test in the same
      process, would make the registry create actors.
    * ``jaxtyping`` (``Float``, ``Integer``: subscriptable annotations) and ``loguru`` (``logger``: the standard
      ``logging`` logger "skyrl"), where not installed: annotations and logging. ``compute_rloo_outcome_advantage``
      imports loguru inside the call, so :func:`compute` puts the loguru stub back for the call only.
Any other name read from a stub raises, so a stub reached by the advantage computation fails the test.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import pathlib
import sys
import types
from typing import Any

import numpy as np
import torch

from references.stubs import (
    StubUsed, cannot_build, import_released, package_standin, raising, really_installed, restore_modules, stub_module,
)

__all__ = ["load", "version", "compute", "ESTIMATORS", "STUBS", "StubUsed"]

TARGET = "skyrl.backends.skyrl_train.utils.ppo_utils"
PACKAGES = ("skyrl", "skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.utils")
#: the service's estimator name -> SkyRL's registry name
ESTIMATORS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce++", "maxrl": "maxrl"}
OWNER = "tests/references/skyrl_ref.py"


class _Annotation:
    """jaxtyping's ``Float[torch.Tensor, "b t"]``: subscripting gives the array type back (annotations only)."""

    def __class_getitem__(cls, item: Any) -> Any:
        return item[0] if isinstance(item, tuple) else item


#: module -> {attribute: value}: the stubbed modules and the only names ppo_utils' import chain reads
STUBS: dict[str, dict[str, Any]] = {
    "skyrl.train": {},
    "skyrl.train.config": {"AlgorithmConfig": cannot_build("skyrl.train.config.AlgorithmConfig", OWNER)},
    "ray": {"remote": lambda cls: cls, "is_initialized": lambda: False,
            **{n: raising(f"ray.{n}", OWNER) for n in ("get", "get_actor", "kill", "init")}},
    "jaxtyping": {"Float": _Annotation, "Integer": _Annotation},
    "loguru": {"logger": logging.getLogger("skyrl")},
}
_OPTIONAL = ("jaxtyping", "loguru")  # stubbed only where the real package is not installed

_module: types.ModuleType | None = None
_stubbed: list[str] = []  # the module names stood in for (import_released fills it)


def _stub(name: str, attrs: dict[str, Any]) -> types.ModuleType:
    """The stand-in module ``name`` holding ``attrs`` (:func:`references.stubs.stub_module`)."""
    return stub_module(name, attrs, OWNER)


def _package(name: str, root: pathlib.Path) -> types.ModuleType:
    """``name`` as a package whose submodules load from the installed files, its ``__init__`` not run."""
    return package_standin(name, root, OWNER)


def load() -> types.ModuleType:
    """``skyrl.backends.skyrl_train.utils.ppo_utils`` of the installed release, imported once."""
    global _module
    if _module is not None:
        return _module
    spec = importlib.util.find_spec("skyrl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("skyrl is not installed: run `make setup` (it installs tests/references/requirements.txt)")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    _module = import_released(TARGET, root, PACKAGES, STUBS, _OPTIONAL, _stubbed, OWNER)
    return _module


def stubbed() -> list[str]:
    """The top-level modules :func:`load` stood in for (besides SkyRL's own package inits)."""
    return list(dict.fromkeys(name.split(".")[0] for name in _stubbed))


def version() -> str:
    """The installed skyrl's version (from its distribution metadata)."""
    return importlib.metadata.version("skyrl")


def compute(name: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, *,
            values: torch.Tensor | None = None, grpo_norm_by_std: bool = True, gamma: float = 1.0,
            lambd: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) ``[B, T]`` from the released ``compute_advantages_and_returns``.

    name: the service's estimator name (:data:`ESTIMATORS` maps it to SkyRL's). token_level_rewards,
    values: ``[B, T]`` float (written to in place by some estimators: fresh copies are passed);
    response_mask: ``[B, T]`` 0/1 (int64 or float); index: ``[B]`` uids (a list of str, as SkyRL's
    ``metadata["uids"]``, or a numpy array). ``config`` is None (no estimator reads it).
    Raises what the released code raises (``masked_var`` with fewer than two valid tokens: ValueError).
    """
    ppo = load()
    # compute_rloo_outcome_advantage imports loguru inside the call (its group-of-one warning)
    saved = {"loguru": sys.modules.get("loguru")}
    if not really_installed("loguru"):
        sys.modules["loguru"] = _stub("loguru", STUBS["loguru"])
    try:
        with torch.no_grad():
            return ppo.compute_advantages_and_returns(
                token_level_rewards=token_level_rewards.clone(), response_mask=response_mask.clone(),
                index=index.copy() if isinstance(index, np.ndarray) else list(index),
                adv_estimator=ESTIMATORS[name], config=None,
                values=None if values is None else values.clone(), grpo_norm_by_std=grpo_norm_by_std,
                gamma=gamma, lambd=lambd)
    finally:
        restore_modules(saved)
