"""The released AReaL's advantage pipeline, run in-process as a test oracle (test-only; the service never imports
this module or areal).

Where the code is: AReaL 1.0.4 (``areal==1.0.4`` on PyPI) computes advantages in
``PPOActor._compute_advantages`` (``areal/trainer/ppo/actor.py``), with ``Normalization`` and ``KLEstimator`` from
``areal/utils/data.py``. :func:`compute` builds a ``PPOActor`` and calls that method on a batch dict, the
smallest released function that contains the whole pipeline.

Installed with ``pip install --no-deps areal==1.0.4`` (tests/references/requirements.txt); AReaL declares
``Requires-Python >= 3.11, < 3.13``, so it installs on this venv's 3.11 as is. Only these released files are
imported, from the installed package: ``areal/trainer/ppo/actor.py``, ``areal/trainer/ppo/stats.py``,
``areal/utils/data.py``, ``areal/utils/math.py``, ``areal/utils/constants.py``, ``areal/utils/functional/``
(``__init__``, ``functional.py``, ``vocab_parallel.py``) and the ``NormConfig`` class of
``areal/api/cli_args.py`` (its class statement compiled from the installed file alone: the rest of that module
imports hydra, uvloop and AReaL's engines).

Stand-ins, only while those files are imported (the previous ``sys.modules`` entries are restored afterwards):
    * the packages ``areal``, ``areal.utils``, ``areal.trainer``, ``areal.trainer.ppo``: empty package modules
      whose ``__path__`` is the installed directory, so their submodules load from the released files but the
      packages' ``__init__``s (AReaL's controllers, inference and trainer stack) do not run.
    * ``areal.api`` (``TrainEngine``), ``areal.api.cli_args`` (``NormConfig``: the released class;
      ``MicroBatchSpec``, ``PPOActorConfig``, ``RejectionSamplingConfig``: annotations, cannot be built),
      ``areal.infra`` (``TrainController``), ``areal.infra.platforms`` (``current_platform``,
      ``is_npu_available``: device selection), ``areal.infra.rpc.serialization``,
      ``areal.experimental.training_service.controller.controller`` (remote controllers), ``areal.utils.logging``
      (the standard ``logging`` logger), ``areal.utils.seqpack`` (micro-batch packing), ``areal.utils.stats_tracker``
      and ``areal.utils.perf_tracer`` (their decorators return the function unchanged), ``einops`` and
      ``torchdata`` (where not installed; used by data.py's padding and data-loader helpers only).
    * the actor's config: a ``types.SimpleNamespace`` with ``PPOActorConfig``'s field names (a data holder).
Any other name read from a stub raises, so a stub reached by the advantage computation fails the test.

:func:`load_config` imports the released ``areal/api/cli_args.py`` itself (AReaL's ``PPOActorConfig``,
``NormConfig``, ... with their ``__post_init__`` checks; tests/test_areal_actor.py builds both actors from them),
with the stand-ins of :data:`CONFIG_STUBS` (hydra, uvloop, name_resolve, pkg_version, the seqpack constant).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.util
import logging
import pathlib
import sys
import types
from typing import Any

import torch

from references.stubs import StubUsed, cannot_build, import_released, raising

__all__ = ["load", "load_config", "version", "compute", "norm_config", "STUBS", "CONFIG_STUBS", "stubbed", "StubUsed"]

TARGET = "areal.trainer.ppo.actor"
PACKAGES = ("areal", "areal.utils", "areal.trainer", "areal.trainer.ppo")
OWNER = "tests/references/areal_ref.py"


def _raises(name: str):
    return raising(name, OWNER)


def _cannot_build(name: str) -> type:
    return cannot_build(name, OWNER)


def _identity_decorator(*args: Any, **kwargs: Any):
    return lambda fn: fn


#: module -> {attribute: value}: the stubbed modules and the only names the import chain reads
STUBS: dict[str, dict[str, Any]] = {
    "areal.api": {"TrainEngine": _cannot_build("areal.api.TrainEngine")},
    "areal.api.cli_args": {n: _cannot_build(f"areal.api.cli_args.{n}")
                           for n in ("MicroBatchSpec", "PPOActorConfig", "RejectionSamplingConfig")},
    "areal.infra": {"TrainController": _cannot_build("areal.infra.TrainController")},
    "areal.infra.platforms": {"current_platform": None, "is_npu_available": lambda: False},
    "areal.infra.rpc": {},
    "areal.infra.rpc.serialization": {"serialize_value": _raises("areal.infra.rpc.serialization.serialize_value")},
    "areal.experimental": {},
    "areal.experimental.training_service": {},
    "areal.experimental.training_service.controller": {},
    "areal.experimental.training_service.controller.controller": {
        "GatewayTrainController": _cannot_build("GatewayTrainController")},
    "areal.utils.logging": {"getLogger": lambda name=None: logging.getLogger(f"areal.{name}")},
    "areal.utils.seqpack": {"get_allocate_fn": _raises("areal.utils.seqpack.get_allocate_fn"),
                            "flat2d": _raises("areal.utils.seqpack.flat2d")},
    "areal.utils.stats_tracker": {"scope_func_wrapper": _identity_decorator},
    "areal.utils.perf_tracer": {"trace_perf": _identity_decorator},
    "einops": {"rearrange": _raises("einops.rearrange")},
    "torchdata": {},
    "torchdata.stateful_dataloader": {"StatefulDataLoader": _cannot_build("StatefulDataLoader")},
}
_OPTIONAL = ("einops", "torchdata")  # stubbed only where the real package is not installed

_module: types.ModuleType | None = None
_stubbed: list[str] = []


def _released_norm_config(root: pathlib.Path) -> type:
    """The ``NormConfig`` class statement of the installed ``areal/api/cli_args.py``, compiled alone."""
    path = root / "api" / "cli_args.py"
    tree = ast.parse(path.read_text(), str(path))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NormConfig")
    namespace: dict[str, Any] = {"dataclass": dataclasses.dataclass, "field": dataclasses.field,
                                 "__name__": "areal.api.cli_args"}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["NormConfig"]


def _root() -> pathlib.Path:
    spec = importlib.util.find_spec("areal")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("areal is not installed: run `make setup` (it installs tests/references/requirements.txt)")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def load() -> types.ModuleType:
    """``areal.trainer.ppo.actor`` of the installed release, imported once."""
    global _module
    if _module is not None:
        return _module
    root = _root()

    def prepare() -> None:
        sys.modules["areal.api.cli_args"].NormConfig = _released_norm_config(root)

    _module = import_released(TARGET, root, PACKAGES, STUBS, _OPTIONAL, _stubbed, OWNER, prepare)
    return _module


#: the stand-ins while ``areal/api/cli_args.py`` itself is imported (:func:`load_config`): its launcher and
#: cluster helpers (hydra, uvloop, name_resolve, pkg_version: not reached by the config classes) and the
#: seqpack constant its ``MicroBatchSpec`` checks (the released value, ``areal/utils/seqpack.py``)
CONFIG_STUBS: dict[str, dict[str, Any]] = {
    "hydra": {"compose": _raises("hydra.compose"), "initialize": _raises("hydra.initialize")},
    "hydra.core": {},
    "hydra.core.global_hydra": {"GlobalHydra": _cannot_build("hydra.core.global_hydra.GlobalHydra")},
    "uvloop": {"install": lambda: None},
    "areal.utils.logging": STUBS["areal.utils.logging"],
    "areal.utils.name_resolve": {"reconfigure": _raises("areal.utils.name_resolve.reconfigure")},
    "areal.utils.pkg_version": {"is_version_greater_or_equal":
                                _raises("areal.utils.pkg_version.is_version_greater_or_equal")},
    "areal.utils.seqpack": {"PACKING_ALGORITHMS": {"ffd", "kk"}},
}
_CONFIG_PACKAGES = ("areal", "areal.api", "areal.utils", "areal.engine", "areal.engine.fsdp_utils")
_config_module: types.ModuleType | None = None
_config_stubbed: list[str] = []


def load_config() -> types.ModuleType:
    """``areal.api.cli_args`` of the installed release, imported once: AReaL's own config classes
    (``PPOActorConfig``, ``NormConfig``, ...) with their defaults and ``__post_init__`` checks. Its imports of
    ``areal/utils/constants.py`` and ``areal/engine/fsdp_utils/attn_impl.py`` (the attention-name check, which
    reads transformers) are the released files; :data:`CONFIG_STUBS` stand in for the rest (``hydra`` and
    ``uvloop`` only where not installed). The actor of :func:`load` takes these configs as they are."""
    global _config_module
    if _config_module is None:
        _config_module = import_released("areal.api.cli_args", _root(), _CONFIG_PACKAGES, CONFIG_STUBS,
                                         ("hydra", "uvloop"), _config_stubbed, OWNER)
    return _config_module


def stubbed() -> list[str]:
    """The modules :func:`load` stood in for (besides AReaL's own package inits)."""
    return list(_stubbed)


def version() -> str:
    """The installed areal's version (from its distribution metadata)."""
    return importlib.metadata.version("areal")


def norm_config(spec: dict[str, Any] | None) -> Any:
    """AReaL's released ``NormConfig`` from a dict in the service's spelling (level ``"none"`` = None), or None."""
    if spec is None:
        return None
    NormConfig = load().Normalization.__init__.__globals__["NormConfig"]
    kw = dict(spec)
    for key in ("mean_level", "std_level"):
        if key in kw and kw[key] == "none":
            kw[key] = None
    return NormConfig(**kw)


def compute(*, rewards: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor,
            logprobs: torch.Tensor, ref_logp: torch.Tensor | None = None, values: torch.Tensor | None = None,
            reward_norm: dict | None = None, adv_norm: dict | None = None, reward_bias: float = 0.0,
            reward_scaling: float = 1.0, reward_clip: float = 20.0, kl_ctl: float = 0.1, kl_estimator: str = "k1",
            discount: float = 1.0, gae_lambda: float = 1.0, mask_no_eos_with_zero: bool = False,
            recompute_logprob: bool = False, use_decoupled_loss: bool = False) -> dict[str, Any]:
    """The batch dict the released ``PPOActor._compute_advantages`` returns (``advantages``, ``returns``, ...).

    rewards ``[B]``; loss_mask, attention_mask ``[B, T]`` 0/1; logprobs ``[B, T]`` (AReaL's ``logprobs``, or its
    ``prox_logp`` with recompute_logprob and not use_decoupled_loss); ref_logp, values ``[B, T]`` or None
    (left out of the dict, as AReaL's batch without a reference model or critic). Every tensor is passed as a
    fresh copy (AReaL writes into some). Raises what the released code raises.
    """
    actor_mod = load()
    config = types.SimpleNamespace(
        reward_bias=reward_bias, reward_scaling=reward_scaling, reward_clip=reward_clip, kl_ctl=kl_ctl,
        kl_estimator=kl_estimator, adv_norm=norm_config(adv_norm), reward_norm=norm_config(reward_norm),
        discount=discount, gae_lambda=gae_lambda, mask_no_eos_with_zero=mask_no_eos_with_zero, temperature=1.0,
        m2_threshold=None, overlong_reward_penalty=False, use_decoupled_loss=use_decoupled_loss,
        recompute_logprob=recompute_logprob, eps_clip=0.2, c_clip=None, rejection_sampling=None,
        prox_logp_method="recompute", importance_sampling_level="token")
    actor = actor_mod.PPOActor(config, engine=None)
    B, T = loss_mask.shape
    data: dict[str, Any] = {
        "input_ids": torch.zeros(B, T, dtype=torch.long), "rewards": rewards.clone(),
        "loss_mask": loss_mask.clone(), "attention_mask": attention_mask.clone(),
    }
    if recompute_logprob and not use_decoupled_loss:
        data["prox_logp"] = logprobs.clone()
        data["logprobs"] = torch.zeros_like(logprobs)  # overwritten by AReaL with prox_logp
    else:
        data["logprobs"] = logprobs.clone()
    if ref_logp is not None:
        data["ref_logp"] = ref_logp.clone()
    if values is not None:
        data["values"] = values.clone()
    with torch.no_grad():
        return actor._compute_advantages(data)
