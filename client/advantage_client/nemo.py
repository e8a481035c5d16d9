"""NeMo RL drop-in: ``RemoteAdvantageEstimator`` has the ``compute_advantage`` signature of NeMo RL's
advantage estimators and computes through the service.

    from advantage_client.nemo import RemoteAdvantageEstimator

    # was: adv_estimator = GRPOAdvantageEstimator(estimator_config, loss_config)
    adv_estimator = RemoteAdvantageEstimator("advantage-svc:50051", "grpo", {**estimator_config, **loss_config})
    train_data["advantages"] = adv_estimator.compute_advantage(prompt_ids, rewards, mask, repeated_batch=batch)

What ``compute_advantage`` returns follows the NeMo RL it runs in (``result_format``, default ``"auto"``):

* NeMo RL as released (main at the commit ``references.REFERENCES["nemo_rl"]`` names, whose
  ``nemo_rl/algorithms/advantage_estimator.py`` has no ``AdvantageResult``): what that release's estimator
  class returns (``"legacy"``): the ``[B, T]`` advantages tensor for grpo, gdpo, reinforce_plus_plus and
  opd; the tuple ``(advantages, returns)`` for raw_reward (``returns`` is ``None``) and gae. OPD's metrics
  are published in :attr:`RemoteAdvantageEstimator.last_metrics`, where NeMo RL's loop reads them.
  (At that commit, nemo_rl/algorithms/advantage_estimator.py: GRPO returns at line 98, GDPO 190,
  Reinforce++ 267, RawReward ``(adv, None)`` 299, GAE ``(advantages, returns)`` 496, OPD 611 with its
  metrics set at 623; nemo_rl/algorithms/grpo.py stores the value, ``train_data["advantages"] = ...``, at
  lines 3294 and 4839 and reads ``last_metrics`` at 4857; nemo_rl/algorithms/ppo.py unpacks a tuple at 1596.)
* a NeMo RL whose ``nemo_rl.algorithms.advantage_estimator`` defines ``AdvantageResult`` (NeMo RL PR #3512),
  or no NeMo RL installed: :class:`advantage_client.AdvantageResult` (``"advantage_result"``), whose
  ``advantages``/``returns``/``metrics`` fields are the ones that PR's loops read.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Mapping

from advantage_client import wire
from advantage_client.client import AdvantageClient, AdvantageResult

# NeMo RL keyword -> service input name (the service uses one name per concept for every estimator)
_RENAMES = {"logprobs_policy": "logprobs", "logprobs_reference": "reference_logprobs"}

#: the values ``result_format`` takes
RESULT_FORMATS = ("auto", "legacy", "advantage_result")

#: NeMo RL's estimators whose class (NeMo RL main, before PR #3512) returns ``(advantages, returns)``;
#: the others return the advantages tensor
TUPLE_ESTIMATORS = ("raw_reward", "gae")

#: Loss-config keys NeMo RL's estimator classes (main at ``references.REFERENCES["nemo_rl"]``) do not read
#: although the service's config has them: Reinforce++ and GAE call ``calculate_kl`` with its built-in clamps
#: (input 20, output 10; nemo_rl/algorithms/utils.py), whatever ``kl_input_clamp_value`` and
#: ``kl_output_clamp_value`` the loss config holds. The drop-in leaves them out (the service's defaults are
#: those clamps), so a loss config with other clamps gets NeMo RL's numbers and a ``UserWarning`` (once per key
#: per process) naming the plain client call that honours them.
NEMO_UNREAD_KEYS = {
    "reinforce_plus_plus": frozenset({"kl_input_clamp_value", "kl_output_clamp_value"}),
    "gae": frozenset({"kl_input_clamp_value", "kl_output_clamp_value"}),
}
#: the clamps NeMo RL's ``calculate_kl`` applies whatever the loss config says: a loss config holding these
#: values loses nothing when the drop-in leaves its keys out; any other value draws a warning
NEMO_BUILTIN_CLAMPS = {"kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0}

_warned: set[tuple[str, str]] = set()


def warn_unapplied(dropin: str, option: str, why: str, instead: str) -> None:
    """``UserWarning`` that drop-in ``dropin`` received ``option`` and will not apply it, once per
    (drop-in, option) per process: a silently dropped option would be a wrong run nobody sees."""
    if (dropin, option) in _warned:
        return
    _warned.add((dropin, option))
    warnings.warn(f"{dropin}: {option} is not applied ({why}); {instead}", UserWarning, stacklevel=3)

#: the module of NeMo RL that defines ``AdvantageResult`` once PR #3512 is in
NEMO_ESTIMATOR_MODULE = "nemo_rl.algorithms.advantage_estimator"

#: Config keys of NeMo RL (main at ``references.REFERENCES["nemo_rl"]``) that are no field of the service's
#: estimators: GRPO's ``AdvEstimatorConfig`` (nemo_rl/algorithms/advantage_estimator.py), PPO's
#: ``AdvEstimatorConfig`` (nemo_rl/algorithms/ppo.py) and ``ClippedPGLossConfig``
#: (nemo_rl/algorithms/loss/loss_functions.py), whose keys a caller merges into the config. They are
#: ignored silently, never taken for a misspelt field.
NEMO_CONFIG_KEYS = frozenset({
    "name", "normalize_rewards", "use_leave_one_out_baseline", "reward_weights", "minus_baseline",
    "gae_lambda", "gae_gamma", "normalize_advantages", "gae_lambda_value", "gae_lambda_policy",
    "length_adaptive_alpha",
    "disable_ppo_ratio", "token_level_loss", "sequence_level_importance_ratios", "ratio_clip_min",
    "ratio_clip_max", "ratio_clip_c", "reference_policy_kl_penalty", "reference_policy_kl_type",
    "kl_input_clamp_value", "kl_output_clamp_value", "use_kl_in_reward", "use_importance_sampling_correction",
    "truncated_importance_sampling_type", "truncated_importance_sampling_ratio",
    "truncated_importance_sampling_ratio_min", "use_on_policy_kl_approximation", "force_on_policy_ratio",
    "use_cispo", "positive_example_nll_weight",
})


def installed_nemo_rl_has_advantage_result() -> bool | None:
    """Whether the NeMo RL this process can import defines ``AdvantageResult`` in
    ``nemo_rl.algorithms.advantage_estimator`` (NeMo RL PR #3512).

    Returns ``None`` when no ``nemo_rl`` is installed, ``True`` when that module defines ``AdvantageResult``,
    ``False`` otherwise (NeMo RL as released; also a ``nemo_rl`` whose estimator module is missing or fails
    to import). An already imported module (``sys.modules``) is used as it is.
    """
    module = sys.modules.get(NEMO_ESTIMATOR_MODULE)
    if module is None:
        try:
            module = importlib.import_module(NEMO_ESTIMATOR_MODULE)
        except ModuleNotFoundError as err:
            if err.name == "nemo_rl" or ("nemo_rl" in sys.modules and sys.modules["nemo_rl"] is None):
                return None  # not installed (or blocked with sys.modules["nemo_rl"] = None)
            return False
        except Exception:  # noqa: BLE001 - a nemo_rl that cannot import its estimators: not PR #3512's
            return False
    return hasattr(module, "AdvantageResult")


def resolve_result_format(result_format: str) -> str:
    """``"auto"`` -> ``"legacy"`` or ``"advantage_result"`` (see :func:`installed_nemo_rl_has_advantage_result`:
    legacy unless the installed NeMo RL defines ``AdvantageResult``; ``AdvantageResult`` when no NeMo RL is
    installed); ``"legacy"``/``"advantage_result"`` are returned as given. Raises ``ValueError`` for any other
    value."""
    if result_format not in RESULT_FORMATS:
        raise ValueError(f"result_format={result_format!r}: choose one of {RESULT_FORMATS}")
    if result_format != "auto":
        return result_format
    return "legacy" if installed_nemo_rl_has_advantage_result() is False else "advantage_result"


def one_edit_apart(a: str, b: str) -> bool:
    """True when ``a`` becomes ``b`` by exactly one edit: one character inserted, deleted or replaced, or two
    adjacent characters swapped (Damerau-Levenshtein distance 1): ``gae_lamda``/``gae_lambda``,
    ``normalize_reward``/``normalize_rewards``, ``minsu_baseline``/``minus_baseline``."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    i = 0
    while i < len(short) and short[i] == long_[i]:
        i += 1
    return short[i:] == long_[i + 1:]


def _all_service_fields() -> frozenset[str]:
    return frozenset(f for _, cls in wire.ESTIMATOR_FIELDS.values() for f in cls.DESCRIPTOR.fields_by_name)


def _as_mapping(config: Any) -> Mapping[str, Any]:
    """A config dict, or a pydantic model (NeMo RL's ``AdvEstimatorConfig``/``ClippedPGLossConfig``) as one."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return config
    if hasattr(config, "model_dump"):
        return config.model_dump()
    raise TypeError(f"config must be a mapping or a pydantic model, got {type(config).__name__}")


def _nemo_dtype(name: str, config: Any, offered: Mapping[str, Any]) -> Any:
    """The dtype NeMo RL's estimator class gives its result for these inputs (torch's type promotion over the
    floating-point tensors that enter it), or ``None`` when no input is a floating-point torch tensor.

    grpo and raw_reward: ``rewards``; gdpo: the ``reward/<name>`` components; reinforce_plus_plus:
    ``rewards``, with ``logprobs``/``reference_logprobs`` when the KL penalty is applied; gae: ``rewards``,
    ``mask``, ``values`` and, when the KL penalty is applied, the logprobs; opd: ``teacher_logprobs``,
    ``prev_logprobs`` and ``mask``.
    """
    torch = wire.torch
    if torch is None:
        return None
    if name == "gdpo":
        keys = [k for k in offered if str(k).startswith("reward/")]
    elif name == "opd":
        keys = ["teacher_logprobs", "prev_logprobs", "mask"]
    else:
        keys = ["rewards"] + (["mask", "values"] if name == "gae" else [])
        kl = name in ("reinforce_plus_plus", "gae") and config.use_kl_in_reward
        if name == "gae" and config.HasField("reference_policy_kl_penalty"):
            kl = kl and config.reference_policy_kl_penalty > 0
        if kl and offered.get("logprobs") is not None and offered.get("reference_logprobs") is not None:
            keys += ["logprobs", "reference_logprobs"]
    dtype = None
    for key in keys:
        value = offered.get(key)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            dtype = value.dtype if dtype is None else torch.promote_types(dtype, value.dtype)
    return dtype


class RemoteAdvantageEstimator:
    """A NeMo RL advantage estimator that runs on an advantage server.

    target: server address; name: grpo, gdpo, reinforce_plus_plus, raw_reward, gae or opd;
    config: a dict (or pydantic model) with NeMo RL key names: the estimator config merged with the loss
    config (``use_kl_in_reward``, ``reference_policy_kl_penalty``, ``reference_policy_kl_type``). Keys the
    estimator has no field for are ignored, as NeMo's configs carry extra keys; a key that is one edit away
    from one of the estimator's fields (``gae_lamda``, ``normalize_reward``) and is neither a key NeMo RL
    knows (:data:`NEMO_CONFIG_KEYS`) nor a field of another estimator is still ignored, with a
    ``UserWarning`` naming both.
    result_format: ``"auto"`` (default), ``"legacy"`` or ``"advantage_result"``: what
    :meth:`compute_advantage` returns (see the module docstring); the resolved value (``"legacy"`` or
    ``"advantage_result"``) is kept in :attr:`result_format`.
    client: an ``AdvantageClient`` to use instead of one made for ``target`` with ``timeout``.

    Raises ``ValueError`` for an unknown estimator name or result_format, ``wire.WireError`` (a ValueError)
    for a config value the estimator cannot take.
    """

    def __init__(self, target: str, name: str, config: Any = None, *, timeout: float | None = 60.0,
                 client: AdvantageClient | None = None, result_format: str = "auto"):
        _, cls = wire.ESTIMATOR_FIELDS.get(name, (None, None))
        if cls is None:
            raise ValueError(wire.unknown_estimator(name, wire.ESTIMATOR_FIELDS))
        self.result_format = resolve_result_format(result_format)
        known = cls.DESCRIPTOR.fields_by_name
        config = _as_mapping(config)
        silent = NEMO_CONFIG_KEYS | _all_service_fields()
        for key in config:
            if key in known or key in silent:
                continue
            near = [f for f in known if one_edit_apart(str(key), f)]
            if near:
                warnings.warn(f"RemoteAdvantageEstimator({name!r}): config key {key!r} is not a field of {name} and "
                              f"is ignored; did you mean {' or '.join(repr(f) for f in near)}?", UserWarning,
                              stacklevel=2)
        self.name = name
        unread = NEMO_UNREAD_KEYS.get(name, frozenset())
        for key in sorted(unread):
            if config.get(key) is not None and float(config[key]) != NEMO_BUILTIN_CLAMPS[key]:
                warn_unapplied("advantage_client.nemo", f"{key}={config[key]!r}",
                               f"NeMo RL's {name} calls calculate_kl with its built-in clamp "
                               f"{NEMO_BUILTIN_CLAMPS[key]:g}, which the drop-in reproduces",
                               f"to clamp at {config[key]!r}, call AdvantageClient.compute({name!r}, "
                               f"{{{key!r}: {config[key]!r}, ...}}) instead of the drop-in")
        self.config = wire.config_message(name, {k: v for k, v in config.items() if k in known and k not in unread})
        self.client = client or AdvantageClient(target, timeout=timeout)
        self._inputs: list[Any] | None = None
        #: the latest call's metrics (OPD's three, else ``{}``), where NeMo RL's loop reads OPD's
        self.last_metrics: dict[str, float] = {}

    def _declared(self) -> list[Any]:
        if self._inputs is None:
            listing = self.client.list_estimators()
            info = next(e for e in listing.estimators if e.name == self.name)
            self._inputs = list(info.inputs)
        return self._inputs

    def compute_advantage(self, prompt_ids, rewards, mask, repeated_batch=None, **kwargs) -> Any:
        """Same arguments as NeMo RL's ``compute_advantage``; unknown keywords are ignored.

        prompt_ids: ``[B]`` group ids or ``[B, L]`` prompt token rows; rewards: ``[B]``; mask: ``[B, T]``.
        Accepts ``repeated_batch`` (a mapping holding ``reward/<name>`` ``[B]`` tensors, for GDPO),
        ``logprobs_policy``/``logprobs_reference`` (Reinforce++) or ``logprobs``/``reference_logprobs``
        (GAE), ``values``, ``teacher_logprobs``, ``prev_logprobs`` (``[B, T]``), ``bootstrap_values``.

        Returns, on ``mask``'s device and in the dtype NeMo RL's class gives (float32 for float32 inputs;
        float64 where a float64 input enters the result), by :attr:`result_format`:
        ``"legacy"``: the ``[B, T]`` advantages tensor (grpo, gdpo, reinforce_plus_plus, opd) or the tuple
        ``(advantages [B, T], returns)`` with ``returns`` ``None`` for raw_reward and ``[B, T]`` for gae;
        ``"advantage_result"``: :class:`AdvantageResult`. Either way :attr:`last_metrics` holds the call's
        metrics. Raises :class:`advantage_client.InvalidArgumentError` (a ``ValueError``) for input the
        service rejects (GDPO with fewer than two reward components, ...), ``AdvantageServiceError`` for
        other server errors.
        """
        offered = {"prompt_ids": prompt_ids, "rewards": rewards, "mask": mask}
        for key, value in kwargs.items():
            offered[_RENAMES.get(key, key)] = value
        if repeated_batch is not None:
            offered.update({k: repeated_batch[k] for k in repeated_batch.keys() if str(k).startswith("reward/")})
        tensors = {}
        for spec in self._declared():
            if spec.name.endswith("<name>"):
                prefix = spec.name[: -len("<name>")]
                tensors.update({k: v for k, v in offered.items() if k.startswith(prefix) and v is not None})
            elif offered.get(spec.name) is not None:
                tensors[spec.name] = offered[spec.name]
        dtype = _nemo_dtype(self.name, self.config, tensors)
        output_dtype = None if dtype is None or dtype == wire.torch.float32 else str(dtype).replace("torch.", "")
        result = self.client.compute(self.name, self.config, output_dtype=output_dtype, **tensors)
        device = getattr(mask, "device", None)
        if device is not None and hasattr(result.advantages, "to"):
            result.advantages = result.advantages.to(device)
            if result.returns is not None:
                result.returns = result.returns.to(device)
        self.last_metrics = dict(result.metrics)
        if self.result_format == "advantage_result":
            return result
        if self.name in TUPLE_ESTIMATORS:
            return result.advantages, result.returns
        return result.advantages
