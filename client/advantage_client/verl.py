"""verl drop-in: ``get_adv_estimator_fn`` returns functions with verl's keyword signature that compute
through the advantage service.

A verl user swaps one import and keeps every call::

    # was: from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from advantage_client.verl import get_adv_estimator_fn

    adv_estimator_fn = get_adv_estimator_fn(config.algorithm.adv_estimator)  # server: $ADVANTAGE_SERVICE_TARGET
    advantages, returns = adv_estimator_fn(token_level_rewards=token_level_rewards,
                                           response_mask=response_mask,
                                           index=data.non_tensor_batch["uid"],
                                           config=config.algorithm)

``get_adv_estimator_fn(name, target)`` takes the server address (``"host:port"``) or an
:class:`~advantage_client.AdvantageClient` as ``target``; without one it uses the environment variable
``ADVANTAGE_SERVICE_TARGET`` (default ``localhost:50051``), so verl's one-argument call works unchanged.

The returned function accepts verl's keyword names (``token_level_rewards``, ``response_mask``,
``index``, ``values``, ``gamma``, ``lam``, ``epsilon``, ``norm_adv_by_std_in_grpo``,
``reward_baselines``, ``old_log_probs``, ``sum_pi_squared``, ``rollout_is_weights``,
``handle_zero_tail``, ``f_norm``, ``alpha``, ``config``, ``non_tensor_batch``, ``batch``) and, positionally, each verl function's own
argument order. Unknown keywords are ignored, as verl's ``**kwargs`` does; ``config.exclude_empty_responses``
and ``config.sum_rewards_over_mask`` (later verl releases' options, not in 0.9.1) are not applied and, when
set, warn once each (``UserWarning``) naming the plain client call that applies them. Each option is read where
verl's function reads it: ``grpo_passk`` reads ``norm_adv_by_std_in_grpo`` and ``reinforce_plus_plus``
reads ``gamma`` from ``config`` (a dict, an OmegaConf ``DictConfig``, verl's ``AlgoConfig`` or any object
with those attributes); ``gpg``'s ``alpha`` is recomputed by verl from the batch, so the keyword is
ignored; ``epsilon`` is passed on only to the estimators whose verl function uses it.
It returns ``(advantages, returns)`` as torch tensors ``[B, T]`` on ``response_mask``'s device, in
``token_level_rewards``' dtype; where verl returns the advantages tensor twice (GRPO family, RLOO, OPO,
GPG, REINFORCE++-baseline), so does this function.

Group labels (``index``): a NumPy array (or list, or tensor) of uid strings or integers; equal labels
form a group, so ``"007"`` and ``"7"`` are two groups. ``grpo_vectorized`` reproduces verl's
``as_torch_index`` instead, which turns numeric-looking strings into integers (``"007"`` and ``"7"``
become one group). ``rloo_vectorized`` groups with ``np.unique`` in verl, i.e. by the labels as given,
and multiplies by (group size > 1): a group of one gets 0 there, where verl's ``rloo`` (and the
service's ``rloo``) keeps the sample's score; this function zeroes those rows for ``rloo_vectorized``.

Not reproduced bit for bit: verl 0.9.1's ``grpo_vectorized`` computes the group mean and std in float32
whatever the input dtype (``group_mean_std`` casts; it is called with ``eps=0.0``, so no variance floor);
the service computes them in float64 with ``grpo``'s verl semantics, so float64 results equal verl's
``grpo`` and agree with ``grpo_vectorized`` to float32 precision.

``gdpo`` (verl PR #5503) runs the service's ``gdpo`` with ``semantics = verl``. As verl's function: with
``config``, ``non_tensor_batch`` and ``batch`` all given (verl's trainer passes them), one reward
component per key of ``config.gdpo_reward_keys``, read from ``non_tensor_batch[key]`` as float32, weighted
by ``config.gdpo_reward_weights`` (float32; default all 1); otherwise the single component is
``token_level_rewards`` summed over T. ``norm_adv_by_std_in_grpo`` and ``epsilon`` are read from the
keywords (verl's trainer passes neither: true, 1e-6). A missing or empty ``gdpo_reward_keys``, or a key
absent from ``non_tensor_batch``, raises ``ValueError`` (verl asserts). The result is in
``token_level_rewards``' dtype, as for every name (verl's own is float32 when the components come from
``non_tensor_batch``).

Names: the pinned verl's (0.9.1) registry names ``gae``, ``grpo``, ``grpo_vectorized``, ``grpo_passk``,
``gdpo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``, ``rloo``,
``rloo_vectorized``, ``opo``, ``gpg``, ``optimal_token_baseline``, ``tir_optimal_token_baseline`` (or
verl's ``AdvantageEstimator`` enum members; tests/test_diff_verl.py fails when the registry has a name
this module lacks). Shared service estimators (gae, grpo, gdpo, reinforce_plus_plus, rloo, ...) run with
``semantics = verl``. A client built from an address also reads ``$ADVANTAGE_SERVICE_TLS_CA`` (a PEM file: TLS)
and ``$ADVANTAGE_SERVICE_TOKEN_FILE`` (bearer token), as examples/nemo_rl/remote_advantage.py does.

Plugin (configuration alone, no change to verl's code): :func:`register` adds ``remote_<name>`` to verl's
registry for every name above and lets verl's ``compute_advantage`` dispatch it with the inputs verl gives
``<name>`` (its docstring says what it changes in the process); ``VERL_USE_EXTERNAL_MODULES=advantage_client.verl``
makes verl import this module, which then registers, in every verl process. Then
``algorithm.adv_estimator=remote_grpo``. tests/test_verl_plugin.py runs verl's own ``compute_advantage`` with each
name and its remote name.
"""
from __future__ import annotations

import enum
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from advantage_client import wire
from advantage_client.channel import TARGET_ENV, TLS_CA_ENV, TOKEN_FILE_ENV, settings_from_environment
from advantage_client.client import AdvantageClient, reduce_prompt_ids
from advantage_client.nemo import warn_unapplied

DEFAULT_TARGET_ENV = TARGET_ENV


@dataclass(frozen=True)
class _VerlEstimator:
    service: str                 # service estimator name
    positional: tuple[str, ...]  # verl's own positional argument order
    inputs: tuple[str, ...]      # verl keyword names of the tensors verl's function reads
    same_returns: bool           # verl returns (advantages, advantages)


_OUTCOME = ("token_level_rewards", "response_mask", "index", "epsilon", "config")
_GRPO = ("token_level_rewards", "response_mask", "index", "epsilon", "norm_adv_by_std_in_grpo", "config")
_OTB = ("token_level_rewards", "response_mask", "index", "old_log_probs", "sum_pi_squared", "rollout_is_weights",
        "handle_zero_tail", "epsilon")
_GROUPED = ("token_level_rewards", "response_mask", "index")

ESTIMATORS: dict[str, _VerlEstimator] = {
    "gae": _VerlEstimator("gae", ("token_level_rewards", "values", "response_mask", "gamma", "lam"),
                          ("token_level_rewards", "response_mask", "values"), False),
    "grpo": _VerlEstimator("grpo", _GRPO, _GROUPED, True),
    "grpo_vectorized": _VerlEstimator("grpo", _GRPO, _GROUPED, True),
    "grpo_passk": _VerlEstimator("grpo_passk", _GRPO, _GROUPED, True),
    "reinforce_plus_plus": _VerlEstimator("reinforce_plus_plus", ("token_level_rewards", "response_mask", "config"),
                                          ("token_level_rewards", "response_mask"), False),
    "reinforce_plus_plus_baseline": _VerlEstimator("reinforce_plus_plus_baseline", _OUTCOME, _GROUPED, True),
    "remax": _VerlEstimator("remax", ("token_level_rewards", "reward_baselines", "response_mask", "config"),
                            ("token_level_rewards", "response_mask", "reward_baselines"), False),
    "rloo": _VerlEstimator("rloo", _OUTCOME, _GROUPED, True),
    "rloo_vectorized": _VerlEstimator("rloo", _OUTCOME, _GROUPED, True),
    "opo": _VerlEstimator("opo", _OUTCOME, _GROUPED, True),
    "gpg": _VerlEstimator("gpg", ("token_level_rewards", "response_mask", "index", "epsilon", "f_norm", "alpha",
                                  "config"), _GROUPED, True),
    "optimal_token_baseline": _VerlEstimator(
        "optimal_token_baseline", _OTB,
        _GROUPED + ("old_log_probs", "sum_pi_squared", "rollout_is_weights"), False),
    "tir_optimal_token_baseline": _VerlEstimator(
        "tir_optimal_token_baseline", _OTB,
        _GROUPED + ("old_log_probs", "sum_pi_squared", "rollout_is_weights"), False),
    # inputs: the components are built by _gdpo_components (verl reads them from non_tensor_batch)
    "gdpo": _VerlEstimator("gdpo", _GRPO + ("non_tensor_batch", "batch"), ("response_mask", "index"), True),
}

#: verl keyword -> service input name
_INPUT_NAMES = {
    "token_level_rewards": "rewards", "response_mask": "mask", "index": "prompt_ids", "values": "values",
    "reward_baselines": "reward_baselines", "old_log_probs": "logprobs", "sum_pi_squared": "sum_pi_squared",
    "rollout_is_weights": "rollout_is_weights",
}

_clients: dict[Any, AdvantageClient] = {}
_clients_lock = threading.Lock()


def _client_for(target: Any, tls_ca: str | None = None, token_file: str | None = None) -> AdvantageClient:
    """The client for ``target``: an ``AdvantageClient`` (or anything with ``compute``) as given; else one client
    per (address, TLS CA, token file) per process, built from ``target`` (``"host:port"``, a list of replica
    addresses, or None: ``$ADVANTAGE_SERVICE_TARGET``, comma-separated for replicas, default ``localhost:50051``),
    ``tls_ca`` (default ``$ADVANTAGE_SERVICE_TLS_CA``: a PEM file turns TLS on) and ``token_file`` (default
    ``$ADVANTAGE_SERVICE_TOKEN_FILE``: its bearer token is sent), as examples/nemo_rl/remote_advantage.py reads
    them. Raises ``TypeError`` for any other ``target``."""
    if isinstance(target, AdvantageClient) or callable(getattr(target, "compute", None)):
        return target  # a client, or one that stands for several (AdvantageClient.from_ray)
    target, tls_ca, token_file = settings_from_environment(target, tls_ca, token_file)
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, str) for t in target):
        addresses: Any = tuple(target)  # replica addresses
    elif isinstance(target, str):
        addresses = target
    else:
        raise TypeError(f"target must be a 'host:port' string, a list of them or an AdvantageClient, "
                        f"got {type(target).__name__}")
    key = (addresses, tls_ca, token_file)
    with _clients_lock:  # verl looks the estimator up on every step: one channel per address
        if key not in _clients:
            _clients[key] = AdvantageClient(list(addresses) if isinstance(addresses, tuple) else addresses,
                                            tls_ca=tls_ca, token_file=token_file)
        return _clients[key]


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for a mapping (dict, ``DictConfig``), ``config.key`` for an object; ``default`` if absent."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except (TypeError, KeyError, AttributeError):
            pass
    return getattr(config, key, default)


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def group_labels(index: Any, name: str) -> np.ndarray:
    """verl ``index`` -> what the client sends as ``prompt_ids`` (labels; the client maps them to ids).

    Equal labels form a group, as in verl's dict-based estimators. ``grpo_vectorized`` follows verl's
    ``as_torch_index``: integers as given, near-integer floats rounded, and an array whose every
    label parses as an integer (``"007"``, ``"7"``) converted to those integers.
    """
    arr = _numpy(index).reshape(-1)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if name == "grpo_vectorized":
        if arr.dtype.kind == "f":
            rounded = np.rint(arr.astype(np.float64))
            if np.allclose(arr, rounded, rtol=0.0, atol=1e-6):
                return rounded.astype(np.int64)
        try:
            return arr.astype(np.int64)
        except (TypeError, ValueError, OverflowError):
            pass
    if arr.dtype.kind in "fb":  # float or bool labels: group by value
        return np.unique(arr, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return arr


def _zero_singleton_groups(advantages: Any, labels: np.ndarray) -> Any:
    """verl's rloo_vectorized multiplies by (group size > 1): a group of one gets 0, where verl's loop
    ``rloo`` (what the service's rloo computes) keeps the sample's score."""
    ids = reduce_prompt_ids(labels)  # any labels -> int64 ids, as the client sends them
    inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)[1:]
    keep = (counts[inverse.reshape(-1)] > 1)[:, None]
    if keep.all():
        return advantages
    if hasattr(advantages, "new_tensor"):
        return advantages * advantages.new_tensor(keep)
    return advantages * keep


def _output_dtype(token_level_rewards: Any) -> str:
    name = str(getattr(token_level_rewards, "dtype", "float32")).replace("torch.", "")
    return name if name in ("float64", "bfloat16", "float16") else "float32"


#: options of later verl releases' ``AlgoConfig`` (verl PRs #6452, #6310) that verl 0.9.1, which this drop-in
#: reproduces, does not have: set (true) in ``config``, they draw a warning (once each) instead of a silent drop
VERL_UNAPPLIED_OPTIONS = ("exclude_empty_responses", "sum_rewards_over_mask")


def _warn_unapplied_options(name: str, service: str, config: Any) -> None:
    for option in VERL_UNAPPLIED_OPTIONS:
        if config_get(config, option):
            warn_unapplied("advantage_client.verl", f"config.{option}",
                           "this drop-in reproduces verl 0.9.1, whose estimators have no such option",
                           f"to apply it, call AdvantageClient.compute({service!r}, {{'semantics': 'verl', "
                           f"{option!r}: True, ...}}) (where the service's {service} takes it) instead of "
                           f"verl's {name}")


def _service_config(name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The service config for verl estimator ``name``, each option read where verl's function reads it."""
    config = args.get("config")
    _warn_unapplied_options(name, ESTIMATORS[name].service, config)
    cfg: dict[str, Any] = {}
    if name == "gae":
        gamma = args.get("gamma") if args.get("gamma") is not None else config_get(config, "gamma")
        lam = args.get("lam") if args.get("lam") is not None else config_get(config, "lam")
        if gamma is None or lam is None:
            raise TypeError("gae needs `gamma` and `lam` (keywords, or keys of `config`)")
        cfg.update(gae_gamma=float(gamma), gae_lambda=float(lam))
    elif name in ("grpo", "grpo_vectorized"):
        norm = args.get("norm_adv_by_std_in_grpo")
        cfg.update(normalize_rewards=bool(True if norm is None else norm),
                   epsilon=float(1e-6 if args.get("epsilon") is None else args["epsilon"]))
    elif name == "grpo_passk":  # verl reads the flag from config, not from the keyword
        cfg.update(normalize_rewards=bool(config_get(config, "norm_adv_by_std_in_grpo", True)),
                   epsilon=float(1e-6 if args.get("epsilon") is None else args["epsilon"]))
    elif name == "reinforce_plus_plus":  # verl reads gamma from config (AlgoConfig default 1.0)
        gamma = config_get(config, "gamma")
        if gamma is None:
            gamma = args.get("gamma")
        cfg.update(gamma=float(1.0 if gamma is None else gamma))
    elif name == "gpg":  # alpha is recomputed by verl as B / max(#nonzero scores, 1): not forwarded
        cfg.update(f_norm=float(1.0 if args.get("f_norm") is None else args["f_norm"]))
    elif name == "gdpo":  # verl's gdpo reads the flag from the keyword (its trainer never passes it)
        norm = args.get("norm_adv_by_std_in_grpo")
        cfg.update(normalize_rewards=bool(True if norm is None else norm),
                   epsilon=float(1e-6 if args.get("epsilon") is None else args["epsilon"]))
    elif name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        if args.get("handle_zero_tail") is not None:
            cfg.update(handle_zero_tail=bool(args["handle_zero_tail"]))
        cfg.update(epsilon=float(1e-8 if args.get("epsilon") is None else args["epsilon"]))
    return cfg


def _gdpo_components(args: Mapping[str, Any]) -> tuple[dict[str, Any], list[float] | None]:
    """verl gdpo's reward components and weights: ``({"reward/<k>_<key>": [B] float32}, weights)``.

    As verl's ``compute_gdpo_outcome_advantage``: with ``config``, ``non_tensor_batch`` and ``batch`` all
    given, one component per key of ``config.gdpo_reward_keys`` (required, non-empty), read from
    ``non_tensor_batch[key]`` and rounded to float32 as verl does, with ``config.gdpo_reward_weights``
    (rounded to float32, verl's weight tensor) or all 1; ``batch`` only places verl's scores on the
    response's last token, which the per-row sum ignores. Otherwise the one component is
    ``token_level_rewards`` summed over T. Raises ``ValueError`` where verl's assertions fail (no keys, a
    key missing from ``non_tensor_batch``).
    """
    config, non_tensor, raw = args.get("config"), args.get("non_tensor_batch"), args.get("batch")
    if config is None or non_tensor is None or raw is None:
        rewards = args["token_level_rewards"]
        return {"reward/score": rewards.sum(-1) if hasattr(rewards, "sum") else np.asarray(rewards).sum(-1)}, None
    keys = config_get(config, "gdpo_reward_keys")
    if not keys:
        raise ValueError("gdpo needs config.gdpo_reward_keys: the reward component keys returned by compute_score "
                         "(e.g. ['format_reward', 'accuracy_reward']), as verl's algorithm.gdpo_reward_keys")
    components = {}
    for k, key in enumerate(keys):
        if key not in non_tensor:
            raise ValueError(f"GDPO reward key {key!r} not found in non_tensor_batch; available keys: "
                             f"{list(non_tensor.keys())}")
        components[f"reward/{k:04d}_{key}"] = np.asarray(non_tensor[key], dtype=np.float32)  # sorted = key order
    weights = config_get(config, "gdpo_reward_weights")
    if weights is not None:
        weights = [float(w) for w in np.asarray(list(weights), dtype=np.float32)]
    return components, weights


def _with_semantics(service: str, cfg: dict[str, Any], semantics: str = "verl") -> dict[str, Any]:
    """Add ``semantics`` (``verl``; the SkyRL plugin's ``skyrl``) where the service's config message has that
    field (shared names)."""
    _, cls = wire.ESTIMATOR_FIELDS.get(service, (None, None))
    if cls is not None and "semantics" in cls.DESCRIPTOR.fields_by_name:
        return {"semantics": semantics, **cfg}
    return cfg


def get_adv_estimator_fn(name_or_enum: Any, target: Any = None) -> Callable[..., tuple[Any, Any]]:
    """The verl advantage estimator ``name_or_enum`` (a registry name or ``AdvantageEstimator`` member),
    computed by the advantage server at ``target`` (``"host:port"`` or an ``AdvantageClient``; default
    ``$ADVANTAGE_SERVICE_TARGET`` or ``localhost:50051``).

    Returns ``fn(**verl_kwargs) -> (advantages, returns)``. Raises ``ValueError`` for a name verl's
    registry does not have (as verl does).
    """
    name = name_or_enum.value if isinstance(name_or_enum, enum.Enum) else name_or_enum
    spec = ESTIMATORS.get(name)
    if spec is None:
        raise ValueError(f"Unknown advantage estimator simply: {name}; the service runs {sorted(ESTIMATORS)}")
    client = _client_for(target)

    def adv_estimator_fn(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if len(args) > len(spec.positional):
            raise TypeError(f"{name} takes at most {len(spec.positional)} positional arguments "
                            f"({', '.join(spec.positional)}), got {len(args)}")
        bound = dict(kwargs)  # unknown keywords are ignored below, as verl's **kwargs does
        for key, value in zip(spec.positional, args):
            if key in kwargs:
                raise TypeError(f"{name} got multiple values for argument {key!r}")
            bound[key] = value
        rewards, mask = bound.get("token_level_rewards"), bound.get("response_mask")
        if rewards is None or mask is None:
            raise TypeError(f"{name} needs token_level_rewards and response_mask")
        cfg = _with_semantics(spec.service, _service_config(name, bound))
        tensors = {}
        for key in spec.inputs:
            value = bound.get(key)
            if value is None:
                continue
            tensors[_INPUT_NAMES[key]] = group_labels(value, name) if key == "index" else value
        if name == "gdpo":
            components, weights = _gdpo_components(bound)
            tensors.update(components)
            if weights is not None:
                cfg["reward_weights"] = weights
        result = client.compute(spec.service, cfg, output_dtype=_output_dtype(rewards), **tensors)
        device = getattr(mask, "device", None)
        advantages = result.advantages
        if name == "rloo_vectorized" and "prompt_ids" in tensors:
            advantages = _zero_singleton_groups(advantages, tensors["prompt_ids"])
        if device is not None and hasattr(advantages, "to"):
            advantages = advantages.to(device)
        if spec.same_returns:
            return advantages, advantages
        returns = result.returns
        if returns is None:
            raise RuntimeError(f"the server's {spec.service!r} returned no `returns`; verl's {name} returns them")
        if device is not None and hasattr(returns, "to"):
            returns = returns.to(device)
        return advantages, returns

    adv_estimator_fn.__name__ = f"remote_{name}"
    adv_estimator_fn.__qualname__ = adv_estimator_fn.__name__
    adv_estimator_fn.__doc__ = (f"verl's {name!r} advantage estimator, computed by the advantage service "
                                f"({spec.service!r}). Returns (advantages, returns).")
    adv_estimator_fn.name = name  # type: ignore[attr-defined]
    adv_estimator_fn.client = client  # type: ignore[attr-defined]
    return adv_estimator_fn


# ------------------------------------------------------------------------------------------ the verl plugin
#: the prefix of the names :func:`register` adds to verl's registry: ``remote_grpo`` is verl's ``grpo``, computed
#: by the service
REMOTE_PREFIX = "remote_"
#: the ``algorithm`` config section's key that may name the server (``target``, ``tls_ca``, ``token_file``)
CONFIG_KEY = "advantage_service"
#: verl's functions that take the estimator name and branch on it: (module, function); :func:`register` wraps
#: each one that can be imported
DISPATCHERS = (("verl.trainer.ppo.ray_trainer", "compute_advantage"),
               ("verl.trainer.ppo.v1.utils", "compute_advantage_for_multi_trajectories"))

_plugin: dict[str, Any] = {"target": None}  # register()'s target (None: the algorithm config or the environment)
_plugin_lock = threading.Lock()


def remote_name(name_or_enum: Any) -> str | None:
    """``"remote_grpo"`` -> ``"grpo"``; None for any other value (verl's own names and enum members). Raises
    ``ValueError`` for a ``remote_`` name whose verl estimator the service does not run."""
    if isinstance(name_or_enum, enum.Enum) or not isinstance(name_or_enum, str) \
            or not name_or_enum.startswith(REMOTE_PREFIX):
        return None
    name = name_or_enum[len(REMOTE_PREFIX):]
    if name not in ESTIMATORS:
        raise ValueError(f"Unknown advantage estimator simply: {name_or_enum}; the service runs "
                         f"{', '.join(REMOTE_PREFIX + n for n in sorted(ESTIMATORS))}")
    return name


def service_client(config: Any = None, target: Any = None) -> AdvantageClient:
    """The client a ``remote_<name>`` estimator computes with: ``target`` if given, else :func:`register`'s,
    else ``config.advantage_service`` (verl's ``algorithm`` section: ``target``, ``tls_ca``, ``token_file``;
    e.g. ``+algorithm.advantage_service.target=host:port`` on verl's command line), else the environment
    (``$ADVANTAGE_SERVICE_TARGET``, ``$ADVANTAGE_SERVICE_TLS_CA``, ``$ADVANTAGE_SERVICE_TOKEN_FILE``)."""
    target = target if target is not None else _plugin["target"]
    if target is not None:
        return _client_for(target)
    section = config_get(config, CONFIG_KEY)
    return _client_for(config_get(section, "target"), config_get(section, "tls_ca"),
                       config_get(section, "token_file"))


class _ServiceCoreAlgos:
    """verl's ``core_algos`` module as verl's own code sees it while it runs a ``remote_<name>``: the three
    entry points through which verl computes advantages answered by the service (this module's drop-ins, with
    verl's keywords), every other attribute (``AdvantageEstimator``, ``compute_pf_ppo_reweight_data``, ...)
    verl's."""

    def __init__(self, core_algos: Any, client: Any) -> None:
        self._core, self._client = core_algos, client

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._core, attr)

    def compute_gae_advantage_return(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return get_adv_estimator_fn("gae", self._client)(*args, **kwargs)

    def compute_grpo_outcome_advantage(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return get_adv_estimator_fn("grpo", self._client)(*args, **kwargs)

    def get_adv_estimator_fn(self, name_or_enum: Any) -> Callable[..., tuple[Any, Any]]:
        return get_adv_estimator_fn(name_or_enum, self._client)


def _on_service(fn: Callable[..., Any], client: Any, originals: Mapping[str, Callable[..., Any]]) -> Callable[..., Any]:
    """A copy of verl's function ``fn`` (its own code object) whose global ``core_algos`` is
    :class:`_ServiceCoreAlgos` and whose globals naming another dispatcher (``compute_advantage`` in v1's
    ``compute_advantage_for_multi_trajectories``) name that dispatcher's copy."""
    import types

    from verl.trainer.ppo import core_algos

    namespace = dict(fn.__globals__)
    namespace["core_algos"] = _ServiceCoreAlgos(core_algos, client)
    for attr, original in originals.items():
        if original is not fn and attr in namespace:
            namespace[attr] = _on_service(original, client, {})
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _dispatcher(original: Callable[..., Any], originals: Mapping[str, Callable[..., Any]]) -> Callable[..., Any]:
    """verl's ``original`` (``compute_advantage(data, adv_estimator, ..., config)`` and its v1 twin) taking
    ``remote_<name>`` too: verl's own names go to ``original`` untouched; ``remote_<name>`` runs ``original``'s
    code with ``adv_estimator=<name>`` (so verl's branches hand the estimator exactly the inputs they give
    ``<name>``) and its estimator calls answered by the service (:func:`_on_service`)."""
    import functools
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        name = remote_name(bound.arguments.get("adv_estimator"))
        if name is None:
            return original(*args, **kwargs)
        bound.arguments["adv_estimator"] = name
        client = service_client(bound.arguments.get("config"))
        return _on_service(original, client, originals)(*bound.args, **bound.kwargs)

    dispatch.advantage_service_original = original  # type: ignore[attr-defined]
    return dispatch


def _replace_everywhere(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
    """Every loaded module's global bound to ``original`` (``from ... import compute_advantage`` before
    :func:`register` ran: verl's v1 trainer, the experimental trainers, a recipe) rebound to ``replacement``."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                namespace[attr] = replacement


def _registry_entry(name: str) -> Callable[..., tuple[Any, Any]]:
    """``remote_<name>`` in verl's registry: verl's ``<name>`` with verl's keywords, computed by the service
    (the client resolved on each call, :func:`service_client` with the call's ``config``)."""
    def remote_estimator(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return get_adv_estimator_fn(name, service_client(kwargs.get("config")))(*args, **kwargs)

    remote_estimator.__name__ = remote_estimator.__qualname__ = REMOTE_PREFIX + name
    remote_estimator.__doc__ = f"verl's {name!r} advantage estimator, computed by the advantage service."
    remote_estimator.advantage_service = name  # type: ignore[attr-defined]
    return remote_estimator


def register(target: Any = None) -> list[str]:
    """Make verl 0.9.1 compute advantages on the service by configuration alone: ``remote_<name>`` for every
    name of verl's ``ADV_ESTIMATOR_REGISTRY`` (``algorithm.adv_estimator=remote_grpo``), ``gae`` and ``grpo``
    included. Idempotent; call it in the process that runs verl's trainer (or let verl import this module:
    ``VERL_USE_EXTERNAL_MODULES=advantage_client.verl``, which calls it).

    What it changes in the process:
      * verl's ``ADV_ESTIMATOR_REGISTRY`` gains ``remote_<name>`` (verl's keyword signature; verl's own entries
        are untouched);
      * ``verl.trainer.ppo.ray_trainer.compute_advantage`` and, where verl's v1 trainer imports,
        ``verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories`` are replaced, in every loaded
        module that holds them, by a dispatcher: a verl name runs verl's function untouched; ``remote_<name>``
        runs a copy of verl's own function with ``<name>``, whose ``core_algos`` calls
        (``compute_gae_advantage_return``, ``compute_grpo_outcome_advantage``, ``get_adv_estimator_fn``) the
        service answers. So a remote name gets exactly the inputs verl gives its own name (``values`` for gae,
        GDPO's ``non_tensor_batch``/``batch``, the optimal-token-baseline inputs, the v1 trainer's
        last-session GRPO).

    target: ``"host:port"``, a list of replica addresses or an ``AdvantageClient`` (in-process only); default:
    ``algorithm.advantage_service`` or the environment (:func:`service_client`). Returns the names added.
    Raises ``ImportError`` when verl is not installed. A name of verl's registry this module does not know
    (a newer verl) gets no remote entry and a ``UserWarning``.
    """
    import importlib
    import warnings

    from verl.trainer.ppo import core_algos

    with _plugin_lock:
        _plugin["target"] = target
        registry = core_algos.ADV_ESTIMATOR_REGISTRY
        added = []
        for name in [n for n in list(registry) if not n.startswith(REMOTE_PREFIX)]:
            if name not in ESTIMATORS:
                warnings.warn(f"advantage_client.verl: verl's estimator {name!r} has no remote_{name} (the service "
                              f"runs {', '.join(sorted(ESTIMATORS))})", UserWarning, stacklevel=2)
                continue
            current = registry.get(REMOTE_PREFIX + name)
            if current is not None and getattr(current, "advantage_service", None) != name:
                raise ValueError(f"verl's registry already has {REMOTE_PREFIX + name!r} ({current!r}), not this "
                                 f"plugin's: unregister it or rename it")
            if current is None:
                registry[REMOTE_PREFIX + name] = _registry_entry(name)
            added.append(REMOTE_PREFIX + name)
        originals: dict[str, Callable[..., Any]] = {}
        modules = []
        for module_name, attr in DISPATCHERS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # verl's v1 trainer needs transfer_queue: without it, v1 cannot run either
                continue
            current = getattr(module, attr)
            originals[attr] = getattr(current, "advantage_service_original", current)
            modules.append((module, attr))
        for module, attr in modules:
            current = getattr(module, attr)
            if hasattr(current, "advantage_service_original"):
                continue  # registered before
            dispatch = _dispatcher(originals[attr], originals)
            _replace_everywhere(originals[attr], dispatch)
            _plugin.setdefault("dispatchers", []).append((originals[attr], dispatch))
        return added


def unregister() -> None:
    """Undo :func:`register` in this process: the ``remote_`` entries it added leave verl's registry and verl's
    own functions are bound again wherever the dispatchers were (tests; a process that switches back)."""
    core_algos = sys.modules.get("verl.trainer.ppo.core_algos")
    with _plugin_lock:
        if core_algos is not None:
            registry = core_algos.ADV_ESTIMATOR_REGISTRY
            for name in [n for n, fn in registry.items() if getattr(fn, "advantage_service", None)]:
                del registry[name]
        for original, dispatch in _plugin.pop("dispatchers", []):
            _replace_everywhere(dispatch, original)
        _plugin["target"] = None


def _named_by_verl() -> bool:
    """Whether verl is importing this module because ``$VERL_USE_EXTERNAL_MODULES`` names it (verl's
    ``verl/__init__.py`` imports each module that variable lists, in every process that imports verl)."""
    return __name__ in [m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")]


__all__ = ["get_adv_estimator_fn", "ESTIMATORS", "config_get", "group_labels", "DEFAULT_TARGET_ENV", "register",
           "unregister", "remote_name", "service_client", "REMOTE_PREFIX"]

if _named_by_verl():
    register()
