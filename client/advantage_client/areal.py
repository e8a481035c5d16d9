"""AReaL drop-in: :class:`RemotePPOActor` is AReaL's ``PPOActor`` with ``compute_advantages`` done by the service.

AReaL's documented launch (``python3 examples/math/gsm8k_rl.py --config ... scheduler.type=local|ray|slurm``) is
single-controller: ``trainer.actor`` is a ``PPOActorController`` and the engines live in worker processes. There the
one change is the launch command::

    # was: python3 examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo.yaml scheduler.type=local ...
    python -m advantage_client.areal examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo.yaml \
        scheduler.type=local ...        # the server: $ADVANTAGE_SERVICE_TARGET

(:func:`main`: :func:`install`, then the script as ``python`` runs it), or two lines in one's own script before the
``PPOTrainer`` is made: ``import advantage_client.areal; advantage_client.areal.install()``. :func:`install` wraps
``PPOTrainer._create_train_engine`` (areal/trainer/rl_trainer.py:951-976), the one place AReaL 1.0.4 picks the
engine class, so the actor's goes through :func:`use_service` before ``initialize``: the controller's
``train_engine`` becomes ``RemoteFSDPPPOActor`` (or ``RemoteMegatronPPOActor``, ``RemoteArchonPPOActor``:
:func:`remote_engine_class`, AReaL's engine actor with :class:`RemotePPOActor` in ``.actor``), the class AReaL's
controller sends every worker as the import path ``advantage_client.areal.RemoteFSDPPPOActor`` (workers import it:
infra/rpc/guard/engine_blueprint.py:349, infra/rpc/ray_rpc_server.py:101; the client must be installed where AReaL
is, on every node); and ``$ADVANTAGE_SERVICE_TARGET`` / ``_TLS_CA`` / ``_TOKEN_FILE`` are added to the actor's
``scheduling_spec[i].env_vars``, which AReaL gives the role's worker processes on every node (Ray: the actor's
``runtime_env``). AReaL parses those as ``k=v,k=v``, so replicas travel space-separated. The ref and teacher engines
keep AReaL's class. A controller made by hand: ``use_service(FSDPPPOActor.as_controller(config, scheduler))`` or
``RemoteFSDPPPOActor.as_controller(config, scheduler)``; ``RemotePPOActor(controller.config, controller)`` raises
``TypeError`` (setting ``.actor`` on a controller would do nothing). AReaL's own launch with this change, on its
local and Ray schedulers: ``tests/installed/test_areal_launch.py``.

Where the engine is in one's own process (built by hand, or AReaL's SPMD mode: ``torchrun``, no scheduler), an AReaL
1.0.4 user changes one class name and keeps everything else (``PPOActorConfig``, the engine, the rollout data,
``compute_logp`` and ``ppo_update``)::

    # was: from areal.trainer.ppo.actor import PPOActor
    from advantage_client.areal import RemotePPOActor as PPOActor

    actor = PPOActor(config.actor, engine)          # server: $ADVANTAGE_SERVICE_TARGET
    adv_batch = actor.compute_advantages(rollout_batch)

AReaL's engine actors (``FSDPPPOActor``, ``MegatronPPOActor``, ``ArchonPPOActor``) build their ``PPOActor`` in
``__init__`` (``self.actor = PPOActor(config, self)``) and delegate ``compute_advantages`` to it; swap it after
construction (``engine.actor = RemotePPOActor(engine.config, engine)``) or in a subclass's ``__init__``. Any
other class with AReaL's ``self.config`` and ``_compute_advantages`` contract can take :class:`RemoteAdvantagesMixin`
first among its bases.

The server: ``advantage_client=`` (an :class:`~advantage_client.AdvantageClient`, or any object with its
``compute``), else ``advantage_target=`` (``"host:port"``, or a list or comma-separated string of replicas), else
``$ADVANTAGE_SERVICE_TARGET`` (default ``localhost:50051``); a client made here reads ``$ADVANTAGE_SERVICE_TLS_CA``
(a PEM file: TLS) and ``$ADVANTAGE_SERVICE_TOKEN_FILE`` (a bearer token), as ``advantage_client.verl`` does;
``advantage_timeout``: its deadline per call in seconds (default 60).

What changes: only ``_compute_advantages`` (one batch dict). AReaL's ``compute_advantages`` (its
``batched_call``: concatenating the trajectories, splitting the result back) stays AReaL's. For the batch dict
AReaL passes (``input_ids``, ``rewards`` ``[B]``, ``loss_mask``, ``attention_mask``, ``logprobs`` ``[B, T]``;
optional ``ref_logp``, ``values``, ``prox_logp`` ``[B, T]``), :func:`areal_advantages` writes into ``data``
exactly the keys AReaL 1.0.4 writes, with AReaL's dtypes, on the device of ``data["logprobs"]``:

* ``advantages`` ``[B, T]`` (float32 with ``adv_norm``, else float32 promoted with the ``values`` dtype) and
  ``returns`` (the latter dtype): the service's ``areal`` estimator with the actor's config
  (``semantics = "areal"``; reward bias/scaling/clip, ``reward_norm``, ``kl_ctl``, ``kl_estimator``,
  ``discount``, ``gae_lambda``, ``adv_norm``, ``mask_no_eos_with_zero``);
* ``kl_rewards`` and ``tot_rewards`` ``[B, T]`` float32 (AReaL's KL reward, and the token rewards with the
  reward score placed at ``seqlen - 2``): a second call of the same estimator, with ``discount = 0``, no values,
  no ``adv_norm``, an all-ones mask and the masked log-probs two columns wider, returns the KL reward per
  column and the (normalised) reward score in the extra column; the client then zeroes ``seqlen - 1`` and adds
  the score at ``max(seqlen - 2, 0)`` (not for rows without an end token under ``mask_no_eos_with_zero``), the
  indexing AReaL does. No advantage arithmetic runs in the client;
* as AReaL: ``loss_mask`` = the float loss mask rolled by -1; ``logprobs`` = the shifted log-probs (``prox_logp``
  when ``recompute_logprob`` and not ``use_decoupled_loss``, else ``logprobs`` rolled by -1) multiplied in place
  by that mask, also stored as ``prox_logp`` when neither option is on; ``ref_logp`` multiplied in place by it.

``overlong_reward_penalty``: applied client-side by AReaL's own ``reward_overlong_penalty`` (from the installed
AReaL that the actor's class comes from; ``data["rewards"]`` changes in place, as in AReaL) before the rewards
are sent. The service computes batch-level statistics (``mean_level``/``std_level`` = ``batch``) over the batch
it is sent: AReaL all-reduces them over the data-parallel group, so with several data-parallel ranks use
group-level normalisation or one rank's whole batch. The outputs agree with AReaL's own method within the
differential tests' rule (float32: ``|d| <= 2e-4 |AReaL| + 2e-5 max(1, max |AReaL|)``; the service rounds the
reward score once from float64), tested in ``tests/test_areal_actor.py``.

Errors: the service's INVALID_ARGUMENT (e.g. ``config.adv_norm.eps`` <= 0, a ``discount`` outside [0, 1]) as
:class:`~advantage_client.InvalidArgumentError` (a ``ValueError``) naming ``config.<field>``; ``ValueError`` as
AReaL for ``prox_logp`` None under ``recompute_logprob`` and for ``overlong_reward_penalty`` without
``overlong_tokens``/``overlong_penalty_factor``; ``ImportError`` for ``RemotePPOActor`` without AReaL installed;
``TypeError`` for ``RemotePPOActor`` on a controller and for :func:`use_service` on another object than AReaL's
actor controller or engine actor; ``RuntimeError`` for :func:`use_service` on a controller whose workers exist;
``ValueError`` for an ``ADVANTAGE_SERVICE_*`` value holding ``=`` (AReaL's ``env_vars`` cannot carry it);
``SystemExit`` for ``python -m advantage_client.areal`` without a script.

Installing beside AReaL 1.0.4: one ``pip install areal==1.0.4 advantage-client`` fails (ResolutionImpossible):
AReaL pins ``swanlab[dashboard]==0.6.12``, which declares ``protobuf<7``, and this client's generated stubs need
``protobuf>=7.35.1``. Install AReaL first, then the client in a second call (pip upgrades protobuf and reports
swanlab's requirement unmet; swanlab, AReaL's experiment logger, still imports with protobuf 7 and computes no
advantage). The README's swap on
a real ``FSDPPPOActor`` in such an environment: ``tests/installed/test_areal_installed.py``.

This module imports without AReaL and without torch: AReaL's ``PPOActor`` is imported, and the subclass made, when
``RemotePPOActor`` is first looked up; :func:`remote_actor_class` makes it from a given ``PPOActor`` class.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from typing import Any, Callable

from advantage_client import channel
from advantage_client.trl import client_from_environment

__all__ = ["RemotePPOActor", "RemoteAdvantagesMixin", "remote_actor_class", "areal_advantages", "service_config",
           "remote_engine_class", "use_service", "forward_service_env", "install", "uninstall", "main"]

#: PPOActorConfig fields the service's ``areal`` estimator takes as they are
_SCALARS = ("reward_bias", "reward_scaling", "reward_clip", "kl_ctl", "kl_estimator", "discount", "gae_lambda",
            "mask_no_eos_with_zero")
_NORM_FIELDS = ("mean_level", "mean_leave1out", "std_level", "std_unbiased", "eps", "group_size")
#: PPOActor class -> its RemotePPOActor (made once per base)
_classes: dict[type, type] = {}
_lock = threading.Lock()


def _norm(norm: Any) -> dict[str, Any] | None:
    """AReaL's ``NormConfig`` (or a dict of its fields) in the service's spelling (level None = ``"none"``)."""
    if not norm:
        return None
    get = norm.get if isinstance(norm, dict) else lambda k, d=None: getattr(norm, k, d)
    out = {k: get(k) for k in _NORM_FIELDS if get(k) is not None or k.endswith("_level")}
    for key in ("mean_level", "std_level"):
        out[key] = out.get(key) or "none"
    return out


def service_config(config: Any) -> dict[str, Any]:
    """The ``areal`` estimator config for an AReaL ``PPOActorConfig`` ``config`` (its fields as they are, the two
    ``NormConfig`` as dicts; ``semantics = "areal"``). The log-probs are sent already shifted and masked, so
    ``recompute_logprob`` is sent true and ``use_decoupled_loss`` false (the service does not roll them again)."""
    cfg: dict[str, Any] = {"semantics": "areal", "recompute_logprob": True, "use_decoupled_loss": False}
    for key in _SCALARS:
        cfg[key] = getattr(config, key)
    for key in ("reward_norm", "adv_norm"):
        norm = _norm(getattr(config, key, None))
        if norm is not None:
            cfg[key] = norm
    return cfg


def _cpu(t: Any) -> Any:
    return None if t is None else t.detach().cpu()


def _overlong_penalty(data: dict[str, Any], config: Any, penalty: Callable[..., Any] | None) -> dict[str, Any]:
    """AReaL's own ``reward_overlong_penalty`` on ``data`` (``penalty``, else imported from the installed AReaL)."""
    if penalty is None:
        try:
            from areal.utils.functional import reward_overlong_penalty as penalty
        except ImportError as exc:
            raise ImportError(f"overlong_reward_penalty=True is applied by AReaL's own reward_overlong_penalty, "
                              f"which could not be imported ({exc}): install areal==1.0.4, or set "
                              f"overlong_reward_penalty=False") from exc
    if config.overlong_tokens is None or config.overlong_penalty_factor is None:
        raise ValueError("overlong_reward_penalty=True needs PPOActorConfig.overlong_tokens and "
                         "overlong_penalty_factor (AReaL asserts both are set)")
    return penalty(data, overlong_tokens=config.overlong_tokens,
                   overlong_penalty_factor=config.overlong_penalty_factor,
                   max_response_length=config.max_new_tokens)


def areal_advantages(config: Any, data: dict[str, Any], *, client: Any = None,
                     overlong_penalty: Callable[..., Any] | None = None, timeout: Any = None) -> dict[str, Any]:
    """AReaL 1.0.4's ``PPOActor._compute_advantages(data)`` with the advantages from the service (module docstring).

    config: an AReaL ``PPOActorConfig`` (or any object with its field names); data: AReaL's batch dict
    (``input_ids`` ``[B, T]``, ``rewards`` ``[B]``, ``loss_mask``, ``attention_mask``, ``logprobs`` ``[B, T]``,
    optional ``ref_logp``, ``values``, ``prox_logp`` ``[B, T]``), torch tensors on any device; client: an
    :class:`~advantage_client.AdvantageClient` (None: ``$ADVANTAGE_SERVICE_TARGET``); overlong_penalty: AReaL's
    ``reward_overlong_penalty`` (None: imported from ``areal`` when the config asks for it). Returns ``data``
    with ``advantages``, ``returns``, ``kl_rewards``, ``tot_rewards``, ``loss_mask``, ``logprobs`` (and
    ``prox_logp``, ``ref_logp``) written as AReaL writes them. Raises what the module docstring lists.
    """
    import torch

    client = client if client is not None else client_from_environment()
    kwargs = {} if timeout is None else {"timeout": timeout}
    if config.overlong_reward_penalty:
        data = _overlong_penalty(data, config, overlong_penalty)

    # AReaL's bookkeeping of the batch dict, line for line (areal/trainer/ppo/actor.py)
    raw_mask = data["loss_mask"]
    loss_mask = torch.roll(raw_mask.float(), shifts=-1, dims=-1)
    if not config.use_decoupled_loss and config.recompute_logprob:
        prox = data["prox_logp"]
        if prox is None:
            raise ValueError("prox_logp is None but recompute_logprob=True. "
                             "This indicates compute_logp() was skipped incorrectly.")
        old_logp = data["logprobs"] = prox
    else:
        old_logp = torch.roll(data["logprobs"], shifts=-1, dims=-1)
        if not config.use_decoupled_loss:
            data["prox_logp"] = old_logp
    ref_logp = data.get("ref_logp")
    sent_ref = ref_logp is not None
    if ref_logp is None:
        ref_logp = torch.zeros_like(old_logp)
    ref_logp *= loss_mask
    old_logp *= loss_mask

    attention = data["attention_mask"]
    values = data.get("values")
    B, T = loss_mask.shape
    cfg = service_config(config)
    device = old_logp.device

    # 1. advantages and returns: the whole pipeline on the service
    out = client.compute(
        "areal", cfg, output_dtype="float64" if values is not None and values.dtype == torch.float64 else "float32",
        rewards=_cpu(data["rewards"]), mask=_cpu(raw_mask), attention_mask=_cpu(attention),
        logprobs=_cpu(old_logp), reference_logprobs=_cpu(ref_logp) if sent_ref else None, values=_cpu(values),
        **kwargs)
    out_dtype = torch.float32 if values is None else torch.promote_types(torch.float32, values.dtype)
    returns = torch.as_tensor(out.returns).to(device=device, dtype=out_dtype)
    advantages = torch.as_tensor(out.advantages).to(
        device=device, dtype=torch.float32 if config.adv_norm else out_dtype)

    # 2. the token rewards: KL per column and the reward score (extra column T), discount 0 so A_t = reward_t
    pad = torch.zeros(B, 2, dtype=old_logp.dtype)
    token_cfg = {k: v for k, v in cfg.items() if k != "adv_norm"}
    token_cfg.update(discount=0.0, gae_lambda=0.0, mask_no_eos_with_zero=False)
    token = client.compute(
        "areal", token_cfg, output_dtype="float32", rewards=_cpu(data["rewards"]),
        mask=torch.ones(B, T + 2, dtype=torch.int8), attention_mask=torch.ones(B, T + 2, dtype=torch.int8),
        logprobs=torch.cat([_cpu(old_logp), pad], dim=1),
        reference_logprobs=torch.cat([_cpu(ref_logp), pad], dim=1) if sent_ref else None, **kwargs)
    token_rewards = torch.as_tensor(token.advantages).to(device=device, dtype=torch.float32)
    kl_rewards, score = token_rewards[:, :T].contiguous(), token_rewards[:, T]

    # AReaL's placement of the reward score (indexing only)
    rows = torch.arange(B, device=device, dtype=torch.long)
    seqlens = attention.sum(-1).long().to(device)
    rewards = kl_rewards.clone()
    rewards[rows, seqlens - 1] = 0
    placed = torch.where(seqlens == attention.shape[1], 0, score) if config.mask_no_eos_with_zero else score
    rewards[rows, torch.clip(seqlens - 2, min=0)] += placed

    data["returns"] = returns
    data["advantages"] = advantages
    data["kl_rewards"] = kl_rewards
    data["tot_rewards"] = rewards
    data["loss_mask"] = loss_mask
    data["logprobs"] = old_logp
    return data


class RemoteAdvantagesMixin:
    """``_compute_advantages`` from the service for a class with AReaL's ``self.config`` (``PPOActorConfig``):
    put it first among the bases (``class MyActor(RemoteAdvantagesMixin, PPOActor)``). The client is
    ``self.advantage_client`` when set, else one made from ``$ADVANTAGE_SERVICE_TARGET`` on first use."""

    advantage_client: Any = None
    _advantage_lock = threading.Lock()

    def _remote_client(self) -> Any:
        with self._advantage_lock:
            if self.advantage_client is None:
                self.advantage_client = client_from_environment()
            return self.advantage_client

    def _areal_overlong_penalty(self) -> Callable[..., Any] | None:
        """AReaL's ``reward_overlong_penalty`` as the base ``PPOActor``'s module holds it (None: not found)."""
        for cls in type(self).__mro__:
            method = cls.__dict__.get("_compute_advantages")
            if method is not None and cls is not RemoteAdvantagesMixin:
                found = getattr(method, "__globals__", {}).get("reward_overlong_penalty")
                if found is not None:
                    return found
        return None

    def _compute_advantages(self, data: dict[str, Any]) -> dict[str, Any]:
        return areal_advantages(self.config, data, client=self._remote_client(),  # type: ignore[attr-defined]
                                overlong_penalty=self._areal_overlong_penalty())


def remote_actor_class(base: type) -> type:
    """``RemotePPOActor`` for the given AReaL ``PPOActor`` class ``base`` (made once per base)."""
    with _lock:
        if base not in _classes:
            cls = _classes[base] = _make_class(base)
            cls.__module__, cls.__qualname__ = __name__, "RemotePPOActor"
        return _classes[base]


def _make_class(base: type) -> type:
    class RemotePPOActor(RemoteAdvantagesMixin, base):  # type: ignore[misc, valid-type]
        """AReaL's ``PPOActor`` whose advantages come from the advantage service (module
        ``advantage_client.areal`` says what is sent and what stays AReaL's).

        Arguments: ``PPOActor``'s own (``config``: ``PPOActorConfig``, ``engine``), plus the keywords
        ``advantage_client`` (a client, or any object with its ``compute``), ``advantage_target``
        (``"host:port"``, replicas as a list or comma-separated string; default ``$ADVANTAGE_SERVICE_TARGET``,
        else ``localhost:50051``) and ``advantage_timeout`` (seconds per call of a client made here, default 60).
        Raises ``TypeError`` for an ``advantage_client`` without ``compute``.
        """

        def __init__(self, config: Any, engine: Any, *, advantage_target: Any = None, advantage_client: Any = None,
                     advantage_timeout: float | None = 60.0) -> None:
            if advantage_client is not None and not callable(getattr(advantage_client, "compute", None)):
                raise TypeError(f"advantage_client must be an AdvantageClient (or have its compute), "
                                f"got {type(advantage_client).__name__}")
            if _is_controller(engine):
                raise TypeError(f"{type(engine).__name__} is AReaL's single controller: its engines run in worker "
                                "processes, and an actor set here would never run. Launch with python -m "
                                "advantage_client.areal <script.py> ..., or call advantage_client.areal."
                                "use_service(controller) before controller.initialize()")
            super().__init__(config, engine)
            self.advantage_client = advantage_client if advantage_client is not None else \
                client_from_environment(advantage_target, advantage_timeout)

    return RemotePPOActor


def __getattr__(name: str) -> Any:
    """``RemotePPOActor``: the subclass of the installed ``areal.trainer.ppo.actor.PPOActor``."""
    if name == "RemotePPOActor":
        return remote_actor_class(_installed_ppo_actor())
    base_name = name[len("Remote"):] if name.startswith("Remote") else ""
    if base_name in ENGINE_ACTORS:  # what AReaL's workers import by path (import_from_string)
        return remote_engine_class(getattr(importlib.import_module(ENGINE_ACTORS[base_name]), base_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _installed_ppo_actor() -> type:
    """AReaL's ``PPOActor``; ``ImportError`` saying what to install when AReaL is missing."""
    try:
        from areal.trainer.ppo.actor import PPOActor
    except ImportError as exc:
        raise _areal_import_error(exc) from exc
    return PPOActor


def _areal_import_error(exc: ImportError) -> ImportError:
    """The ``ImportError`` of ``RemotePPOActor`` when ``areal.trainer.ppo.actor`` does not import, naming what
    is missing: AReaL itself, a module of AReaL 1.0.4 the installed AReaL lacks, or a module one of AReaL's own
    dependencies should provide (``ModuleNotFoundError.name``: the module Python could not find)."""
    what = "advantage_client.areal.RemotePPOActor subclasses AReaL's PPOActor (areal.trainer.ppo.actor)"
    name = getattr(exc, "name", None) or ""
    if not isinstance(exc, ModuleNotFoundError) or not name:  # "cannot import name ...", an error inside AReaL
        return ImportError(f"{what}; AReaL is installed, but importing it failed: {exc}. The usual cause is "
                           "another AReaL than 1.0.4, or one of its dependencies at another version than AReaL "
                           "declares: pip install areal==1.0.4")
    if name == "areal" or name.startswith("areal.") and importlib.util.find_spec("areal") is None:
        return ImportError(f"{what}, and AReaL is not installed here: pip install areal==1.0.4 ({exc})")
    if name.startswith("areal."):
        return ImportError(f"{what}, and the installed AReaL has no module {name!r}: this module follows AReaL "
                           f"1.0.4; pip install areal==1.0.4 ({exc})")
    top = name.partition(".")[0]
    if top != name and importlib.util.find_spec(top) is not None:
        return ImportError(f"{what}; AReaL is installed, but its dependency {top!r} has no module {name!r}: "
                           f"install the version of {top!r} that AReaL 1.0.4 declares ({exc})")
    return ImportError(f"{what}; AReaL is installed, but a module it imports is not: no module named {name!r}. "
                       f"Install the package that provides {top!r} (pip install areal==1.0.4 installs every "
                       f"dependency AReaL declares) ({exc})")


# ---- single controller (scheduler.type=local|ray|slurm): the engine class AReaL sends its workers ----

#: AReaL 1.0.4's engine actors (each builds ``self.actor = PPOActor(config, self)`` in ``__init__``:
#: fsdp_engine.py:2163-2167, megatron_engine.py:2286-2290, experimental/engine/archon_engine.py:1403-1407)
ENGINE_ACTORS = {"FSDPPPOActor": "areal.engine.fsdp_engine", "MegatronPPOActor": "areal.engine.megatron_engine",
                 "ArchonPPOActor": "areal.experimental.engine.archon_engine"}
#: AReaL's ``get_env_vars`` parses ``scheduling_spec.env_vars`` joined as ``k=v,k=v`` (areal/infra/utils/launcher.py:
#: 140-144): a value with ``,`` or ``=`` breaks worker creation, so replicas travel space-separated
_SEP = " "
_engine_classes: dict[type, type] = {}


def _target_from_env() -> Any:
    """``$ADVANTAGE_SERVICE_TARGET`` as forwarded to a worker: replicas separated by commas or (as forwarded through
    AReaL's env_vars) spaces; None when unset (the client's default)."""
    raw = os.environ.get(channel.TARGET_ENV, "").strip()
    if not raw:
        return None
    parts = [p for p in re.split(r"[,\s]+", raw) if p]
    return parts if len(parts) > 1 else parts[0]


def forward_service_env(config: Any) -> Any:
    """Adds this process's ``$ADVANTAGE_SERVICE_TARGET`` / ``_TLS_CA`` / ``_TOKEN_FILE`` to every
    ``config.scheduling_spec[i].env_vars`` that does not set them (AReaL gives those variables to the role's worker
    processes on every node, local, Ray or Slurm: areal/infra/scheduler/local.py:740-757, ray.py:130-143).

    config: AReaL's ``PPOActorConfig`` (or any object with ``scheduling_spec``: ``SchedulingSpec`` objects or dicts).
    Replicas (``h1:p,h2:p``) are written space-separated. Returns ``config``, changed in place. Raises ``ValueError``
    for a value holding ``=``, which AReaL's ``k=v,k=v`` parsing cannot carry."""
    for spec in getattr(config, "scheduling_spec", ()) or ():
        # a SchedulingSpec (AReaL's pinned omegaconf 2.4.0.dev2 builds them); a dict with other omegaconf releases
        env = (spec.get("env_vars") if isinstance(spec, dict) else spec.env_vars) or {}
        for key in channel.FORWARDED_ENV:
            value = os.environ.get(key, "").strip()
            if value and key not in env:
                if "=" in value:
                    raise ValueError(f"${key}={value!r}: AReaL's scheduling_spec.env_vars cannot carry '='")
                env[key] = _SEP.join(p for p in re.split(r"[,\s]+", value) if p)
        if isinstance(spec, dict):
            spec["env_vars"] = env
        else:
            spec.env_vars = env
    return config


def remote_engine_class(base: type) -> type:
    """``Remote<Base>``: AReaL's engine actor ``base`` (``FSDPPPOActor``, ``MegatronPPOActor``, ``ArchonPPOActor``)
    whose ``.actor`` is :class:`RemotePPOActor` (made once per base; importable as ``<this module>.Remote<Base>``,
    the path AReaL's controller sends its workers). Its ``as_controller`` forwards the service's variables
    (:func:`forward_service_env`) and returns AReaL's controller for this class."""
    with _lock:  # (the module's lock, as remote_actor_class)
        made = _engine_classes.get(base)
        if made is not None:
            return made
        if base.__name__ not in ENGINE_ACTORS or base in _engine_classes.values():
            raise TypeError(f"remote_engine_class takes one of AReaL's engine actors ({', '.join(ENGINE_ACTORS)}), "
                            f"got {base.__module__}.{base.__qualname__}")
        name = "Remote" + base.__name__

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, config, *args, **kwargs)
            # the RemotePPOActor of AReaL's own PPOActor (not a patched name): advantages from the service
            self.actor = remote_actor_class(_installed_ppo_actor())(config, self, advantage_target=_target_from_env())

        def as_controller(cls, config: Any, scheduler: Any) -> Any:
            forward_service_env(config)
            return base.as_controller.__func__(cls, config, scheduler)

        cls = type(name, (base,), {"__init__": __init__, "as_controller": classmethod(as_controller),
                                   "__module__": __name__, "__qualname__": name,
                                   "__doc__": f"AReaL's {base.__name__} with compute_advantages on the service."})
        _engine_classes[base] = cls
        return cls


def _is_controller(obj: Any) -> bool:
    """Whether ``obj`` is one of AReaL's train controllers (``TrainController``: areal/infra/controller/
    train_controller.py:174; ``GatewayTrainController``, the v2 controller), subclasses included."""
    return any(c.__name__ in ("TrainController", "GatewayTrainController") and c.__module__.startswith("areal.")
               for c in type(obj).__mro__)


def use_service(engine: Any) -> Any:
    """The actor ``engine`` (AReaL's ``PPOActorController``/``PPOActorControllerV2`` before ``initialize``, or an
    engine actor built in this process) with its advantages from the service; returns it.

    A controller: its ``train_engine`` (the class every worker builds) becomes :func:`remote_engine_class` of it, and
    its config's ``scheduling_spec`` env_vars get the service's variables. ``RuntimeError`` once its workers exist
    (the engines are built: too late). An engine (SPMD mode, or one built by hand): ``engine.actor =
    RemotePPOActor(engine.config, engine)``, the README's swap.

    Raises ``TypeError`` for any other object (no ``actor`` and ``config``, not a controller)."""
    if _is_controller(engine):
        if getattr(engine, "workers", None) or getattr(engine, "_initialized", False):
            raise RuntimeError("use_service(controller) after controller.initialize(): the engines are built in the "
                               "workers already; call it first (python -m advantage_client.areal does)")
        train_engine = engine.train_engine
        if isinstance(train_engine, str):  # the v2 controller also takes an import path
            module, _, attr = train_engine.rpartition(".")
            train_engine = getattr(importlib.import_module(module), attr)
        if train_engine not in _engine_classes.values():
            engine.train_engine = remote_engine_class(train_engine)
        forward_service_env(engine.config)
        return engine
    if hasattr(engine, "actor") and hasattr(engine, "config"):
        engine.actor = remote_actor_class(_installed_ppo_actor())(engine.config, engine)
        return engine
    raise TypeError(f"use_service takes AReaL's actor controller or engine actor, got {type(engine).__name__}")


_installed: dict[str, Any] = {}


def install() -> None:
    """Every ``PPOTrainer`` made after this computes the actor's advantages on the service: its
    ``_create_train_engine`` (areal/trainer/rl_trainer.py:951-976, the one place the trainer picks the engine class;
    called for the actor, the ref and the train-engine teacher) is wrapped so the actor's goes through
    :func:`use_service` (``self.actor`` is made at rl_trainer.py:171, initialised at :288). Idempotent;
    :func:`uninstall` undoes it. ``ImportError`` naming what to install where ``areal.trainer.rl_trainer`` does not
    import."""
    try:
        from areal.trainer.rl_trainer import PPOTrainer
    except ImportError as exc:
        raise _areal_import_error(exc) from exc

    if "create" in _installed:
        return
    original = PPOTrainer._create_train_engine

    def _create_train_engine(self: Any, actor_config: Any, alloc: Any) -> Any:
        engine = original(self, actor_config, alloc)
        if actor_config is self.config.actor:  # the ref and a teacher keep AReaL's class
            use_service(engine)
        return engine

    _create_train_engine.__wrapped__ = original  # type: ignore[attr-defined]
    PPOTrainer._create_train_engine = _create_train_engine
    _installed["create"] = (PPOTrainer, original)


def uninstall() -> None:
    """Undoes :func:`install` (``PPOTrainer._create_train_engine`` is AReaL's again); nothing when not installed."""
    entry = _installed.pop("create", None)
    if entry is not None:
        entry[0]._create_train_engine = entry[1]


def main(argv: list[str] | None = None) -> None:
    """``python -m advantage_client.areal <script.py> <its arguments>``: :func:`install`, then the script as
    ``python <script.py> <its arguments>`` would run it (``__main__``, its directory first on ``sys.path``).
    Raises ``SystemExit`` (usage) without a ``.py`` script; the script's own exceptions propagate."""
    import runpy

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or not args[0].endswith(".py"):
        raise SystemExit("usage: python -m advantage_client.areal <script.py> --config <yaml> [overrides...]")
    if not os.path.isfile(args[0]):
        raise SystemExit(f"python -m advantage_client.areal: no script {args[0]!r} (give the path of the AReaL script "
                         "you would run with python3)")
    if not os.environ.get("ADVANTAGE_SERVICE_TARGET"):
        import warnings
        warnings.warn("python -m advantage_client.areal: $ADVANTAGE_SERVICE_TARGET is not set, so AReaL's workers "
                      "get no server address and each calls localhost:50051; set it to the server's host:port",
                      stacklevel=1)
    install()
    script = os.path.abspath(args[0])
    sys.argv = [script, *args[1:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":  # python -m advantage_client.areal <script.py> <its arguments>
    import advantage_client.areal  # the importable module (classes made here carry its path, not "__main__")

    advantage_client.areal.main()
