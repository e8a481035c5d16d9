"""SkyRL plugin: SkyRL 0.4.0's advantage estimators, computed by the advantage service, registered in SkyRL's
``AdvantageEstimatorRegistry`` under names its config can use.

Adoption at SkyRL's own entry point, one change to the launch command (the server: ``$ADVANTAGE_SERVICE_TARGET``)::

    python -m advantage_client.skyrl <the overrides> trainer.algorithm.advantage_estimator=remote_grpo
    # was: python -m skyrl.train.entrypoints.main_base <the overrides> trainer.algorithm.advantage_estimator=grpo

or, the same through SkyRL's own hook for custom entry points, its launch module unchanged::

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=advantage_client.skyrl <the overrides> \
        trainer.algorithm.advantage_estimator=remote_grpo

:func:`main` registers the estimators on the driver, then runs SkyRL's ``main_base`` module unchanged with the
overrides; SkyRL's ``initialize_ray`` sends the driver's registry to its registry actor (``sync_registries``), where
every worker finds it, and its ``ray.init`` is given this process's ``$ADVANTAGE_SERVICE_TARGET`` (and the TLS/token
variables) as job-wide ``env_vars`` (:func:`advantage_client.channel.forward_to_ray_workers`; SkyRL's own
variables kept), so workers on every node reach the service. A script of one's own does the same in two lines::

    import advantage_client.skyrl
    advantage_client.skyrl.register()          # server: $ADVANTAGE_SERVICE_TARGET (TLS/token: see below)
    # then: trainer.algorithm.advantage_estimator=remote_grpo

``register()`` adds ``remote_<name>`` for every estimator SkyRL 0.4.0 registers: ``remote_gae``, ``remote_grpo``,
``remote_rloo``, ``remote_reinforce++`` and ``remote_maxrl``. Each is a function with the keywords SkyRL's
``compute_advantages_and_returns`` passes every estimator (``token_level_rewards`` ``[B, T]`` float,
``response_mask`` ``[B, T]`` 0/1, ``index`` ``[B]`` uids (a list or NumPy array of str or int), ``values``
``[B, T]`` (gae), ``grpo_norm_by_std``, ``gamma``, ``lambd``, ``config``; other keywords are ignored, as SkyRL's
``**kwargs``) and returns ``(advantages, returns)`` ``[B, T]`` in ``token_level_rewards``' dtype on
``response_mask``'s device, as SkyRL's function of that name does (the service with ``semantics = skyrl``;
tests/test_diff_skyrl.py compares it with SkyRL's own on 200 batches per family). SkyRL passes every estimator
every keyword, so a registry entry under a new name receives all its inputs: unlike verl, nothing else of SkyRL
needs to change.

SkyRL's registry is backed by a named Ray actor (``advantage_estimator_registry``): with Ray initialised, what
``register()`` adds on the driver is cloudpickled to that actor, and a worker's ``AdvantageEstimatorRegistry.get``
loads it from there. So the estimator objects travel between processes: each holds its estimator name and the
server's address (never a client, which is created in each process on first use), and a worker reads
``$ADVANTAGE_SERVICE_TLS_CA`` / ``$ADVANTAGE_SERVICE_TOKEN_FILE`` (and ``$ADVANTAGE_SERVICE_TARGET`` when
``register()`` was given no address) from its own environment. ``register(target=client)`` with an
``AdvantageClient`` object works in one process only: pickling such an estimator raises ``TypeError``.

SkyRL's other uses of the estimator name (``skyrl/train/utils/utils.py`` ``validate_cfg``): for ``gae`` it
asserts that ``trainer.critic.model.path`` is set (the critic model is built from that path whatever the name),
and it rejects ``gae`` and ``reinforce++`` with ``generator.step_wise_trajectories=True``. A ``remote_gae`` user
sets ``trainer.critic.model.path`` as for ``gae`` (nothing checks it under the remote name: without a critic
SkyRL's ``values`` are None and ``remote_gae`` raises ``TypeError`` naming them), and should not combine
``remote_gae`` or ``remote_reinforce++`` with step-wise trajectories (SkyRL does not stop it there; the per-token
structure is lost as SkyRL's check says).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from advantage_client import channel
from advantage_client.verl import REMOTE_PREFIX, _client_for, _output_dtype, _with_semantics, group_labels

#: SkyRL 0.4.0 registry name -> the service's estimator (run with ``semantics = skyrl``)
ESTIMATORS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce++": "reinforce_plus_plus", "maxrl": "maxrl"}
#: the estimators SkyRL groups by ``index`` (gae and reinforce++ ignore it)
GROUPED = ("grpo", "rloo", "maxrl")


class RemoteEstimator:
    """SkyRL's advantage estimator ``name`` (a key of :data:`ESTIMATORS`), computed by the service at ``target``
    (``"host:port"``, a list of replica addresses, None: ``$ADVANTAGE_SERVICE_TARGET`` in the process that calls
    it, or an ``AdvantageClient``: this process only). Called with SkyRL's keywords (module docstring); returns
    ``(advantages, returns)`` ``[B, T]``. Raises ``TypeError`` without ``token_level_rewards`` and
    ``response_mask``, or without ``values`` for gae (SkyRL's critic gives them)."""

    def __init__(self, name: str, target: Any = None) -> None:
        if name not in ESTIMATORS:
            raise ValueError(f"Unknown advantage estimator {name!r}: SkyRL 0.4.0's are {', '.join(ESTIMATORS)}")
        self.name, self.target = name, target
        self.advantage_service = name
        self.__name__ = REMOTE_PREFIX + name

    def __getstate__(self) -> dict[str, Any]:
        if not (self.target is None or isinstance(self.target, str)
                or (isinstance(self.target, (list, tuple)) and all(isinstance(t, str) for t in self.target))):
            raise TypeError(f"{self.__name__} holds a {type(self.target).__name__}, which cannot go to another "
                            f"process (SkyRL's registry actor, a Ray worker): register(target=...) with the "
                            f"server's address, or set $ADVANTAGE_SERVICE_TARGET where it runs")
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"RemoteEstimator({self.name!r}, target={self.target!r})"

    def __call__(self, token_level_rewards: Any = None, response_mask: Any = None, index: Any = None,
                 values: Any = None, grpo_norm_by_std: bool = True, gamma: float = 1.0, lambd: float = 1.0,
                 config: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        if token_level_rewards is None or response_mask is None:
            raise TypeError(f"{self.__name__} needs token_level_rewards and response_mask")
        service = ESTIMATORS[self.name]
        cfg: dict[str, Any] = {}
        tensors: dict[str, Any] = {"rewards": token_level_rewards, "mask": response_mask}
        if self.name == "gae":
            if values is None:
                raise TypeError("remote_gae needs `values` [B, T] (SkyRL's critic: set trainer.critic.model.path)")
            cfg.update(gae_gamma=float(gamma), gae_lambda=float(lambd))
            tensors["values"] = values
        elif self.name == "reinforce++":
            cfg["gamma"] = float(gamma)
        elif self.name == "grpo":
            cfg["normalize_rewards"] = bool(grpo_norm_by_std)
        if self.name in GROUPED:
            if index is None:
                raise TypeError(f"{self.__name__} needs `index` (the uids: SkyRL's metadata['uids'])")
            tensors["prompt_ids"] = group_labels(index, self.name)
        result = _client_for(self.target).compute(service, _with_semantics(service, cfg, "skyrl"),
                                                  output_dtype=_output_dtype(token_level_rewards), **tensors)
        advantages = result.advantages
        returns = advantages if result.returns is None else result.returns
        device = getattr(response_mask, "device", None)
        if device is not None and hasattr(advantages, "to"):
            advantages, returns = advantages.to(device), returns.to(device)
        return advantages, returns


def _skyrl_registry() -> Any:
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry
    return AdvantageEstimatorRegistry


def register(target: Any = None, registry: Any = None) -> list[str]:
    """Add ``remote_<name>`` to SkyRL's ``AdvantageEstimatorRegistry`` for each of :data:`ESTIMATORS`
    (idempotent: an entry of this module is replaced, e.g. to change ``target``). With Ray initialised, SkyRL
    sends each to its registry actor, so Ray workers find them; registered before ``ray.init``, SkyRL sends them
    on its first ``sync_with_actor`` (every ``get`` does).

    target: see :class:`RemoteEstimator`. registry: SkyRL's ``AdvantageEstimatorRegistry`` class (default: the
    installed SkyRL's). Returns the names added. Raises ``ValueError`` where the registry holds a ``remote_`` name
    that is not this module's; ``ImportError`` where SkyRL is not installed and no ``registry`` is given.
    """
    registry = _skyrl_registry() if registry is None else registry
    added = []
    for name in ESTIMATORS:
        remote = REMOTE_PREFIX + name
        current = registry._functions.get(remote)
        if current is not None:
            if getattr(current, "advantage_service", None) != name:
                raise ValueError(f"SkyRL's registry already has {remote!r} ({current!r}), not this plugin's")
            registry.unregister(remote)
        registry.register(remote, RemoteEstimator(name, target))
        added.append(remote)
    return added


def unregister(registry: Any = None) -> None:
    """Remove the entries :func:`register` added (from the registry actor too, where Ray is initialised)."""
    registry = _skyrl_registry() if registry is None else registry
    for name, fn in list(registry._functions.items()):
        if getattr(fn, "advantage_service", None):
            registry.unregister(name)


def get_advantage_estimator(name: str, target: Any = None) -> Callable[..., tuple[Any, Any]]:
    """SkyRL's estimator ``name`` (``gae``, ``grpo``, ``rloo``, ``reinforce++``, ``maxrl``) computed by the service,
    without a registry: ``fn(token_level_rewards=..., response_mask=..., index=..., ...) -> (advantages, returns)``."""
    return RemoteEstimator(name, target)


#: the module SkyRL 0.4.0's users run, and the override by which its ``main`` hands a launch to another entry point
SKYRL_MAIN = "skyrl.train.entrypoints.main_base"
OVERRIDE_ENTRYPOINT = "trainer.override_entrypoint="


def main(argv: list[str] | None = None) -> None:
    """``python -m advantage_client.skyrl <SkyRL's overrides>``, or SkyRL's ``main_base`` with
    ``trainer.override_entrypoint=advantage_client.skyrl`` (which calls this): :func:`register` (the target each
    worker reads from its ``$ADVANTAGE_SERVICE_TARGET``), then SkyRL's ``main_base`` module (:data:`SKYRL_MAIN`)
    unchanged with the overrides (``trainer.override_entrypoint=advantage_client.skyrl`` left out, so it runs
    SkyRL's own main; another entry point named there is kept, and SkyRL's main runs that one), its
    ``ray.init`` given the service's variables for every worker (module docstring). Raises what SkyRL raises
    (an unknown estimator name: its ``validate_cfg``)."""
    import runpy

    import ray

    # this module as SkyRL's override is dropped (SkyRL's own main runs); another entry point is kept, and SkyRL's
    # main hands the launch to it with the estimators registered and ray.init given the variables
    this = OVERRIDE_ENTRYPOINT + "advantage_client.skyrl"  # as SkyRL names it (under -m, __name__ is __main__)
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != this]
    register()
    original = ray.init

    def init(*a: Any, **kwargs: Any) -> Any:
        kwargs["runtime_env"] = channel.forward_to_ray_workers(kwargs.get("runtime_env"),
                                                               channel.ray_job_runtime_env())
        return original(*a, **kwargs)

    ray.init = init
    sys.argv = [SKYRL_MAIN, *args]
    try:
        runpy.run_module(SKYRL_MAIN, run_name="__main__", alter_sys=True)
    finally:
        ray.init = original


__all__ = ["ESTIMATORS", "RemoteEstimator", "register", "unregister", "get_advantage_estimator", "main"]


if __name__ == "__main__":  # python -m advantage_client.skyrl <SkyRL main_base's overrides>
    main()
