"""NeMo RL drop-in: ``RemoteAdvantageEstimator`` has the ``compute_advantage`` signature of NeMo RL's
advantage estimators and computes through the service.

    from advantage_client.nemo import RemoteAdvantageEstimator

    # was: adv_estimator = GRPOAdvantageEstimator(estimator_config, loss_config)
    adv_estimator = RemoteAdvantageEstimator("advantage-svc:50051", "grpo", {**estimator_config, **loss_config})
    result = adv_estimator.compute_advantage(prompt_ids, rewards, mask, repeated_batch=batch)
    result.advantages, result.returns, result.metrics
"""
from __future__ import annotations

from typing import Any, Mapping

from advantage_client import wire
from advantage_client.client import AdvantageClient, AdvantageResult

# NeMo RL keyword -> service input name (the service uses one name per concept for every estimator)
_RENAMES = {"logprobs_policy": "logprobs", "logprobs_reference": "reference_logprobs"}


class RemoteAdvantageEstimator:
    """A NeMo RL advantage estimator that runs on an advantage server.

    target: server address; name: grpo, gdpo, reinforce_plus_plus, raw_reward, gae or opd;
    config: dict with NeMo RL key names (estimator config merged with the loss-config keys
    ``use_kl_in_reward``, ``reference_policy_kl_penalty``, ``reference_policy_kl_type``). Keys the
    estimator has no field for are ignored, as NeMo's configs allow extra keys.
    """

    def __init__(self, target: str, name: str, config: Mapping[str, Any] | None = None, *, timeout: float | None = 60.0,
                 client: AdvantageClient | None = None):
        _, cls = wire.ESTIMATOR_FIELDS.get(name, (None, None))
        if cls is None:
            raise ValueError(f"unknown estimator {name!r}; choose one of {sorted(wire.ESTIMATOR_FIELDS)}")
        known = cls.DESCRIPTOR.fields_by_name
        self.name = name
        self.config = wire.config_message(name, {k: v for k, v in (config or {}).items() if k in known})
        self.client = client or AdvantageClient(target, timeout=timeout)
        self._inputs: list[Any] | None = None
        self.last_metrics: dict[str, float] = {}

    def _declared(self) -> list[Any]:
        if self._inputs is None:
            listing = self.client.list_estimators()
            info = next(e for e in listing.estimators if e.name == self.name)
            self._inputs = list(info.inputs)
        return self._inputs

    def compute_advantage(self, prompt_ids, rewards, mask, repeated_batch=None, **kwargs) -> AdvantageResult:
        """Same arguments as NeMo RL's ``compute_advantage``; unknown keywords are ignored.

        Accepts ``repeated_batch`` (a mapping holding ``reward/<name>`` tensors, for GDPO),
        ``logprobs_policy``/``logprobs_reference`` (Reinforce++) or ``logprobs``/``reference_logprobs``
        (GAE), ``values``, ``teacher_logprobs``, ``prev_logprobs``, ``bootstrap_values``.
        Returns :class:`AdvantageResult` with tensors on ``mask``'s device.
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
        result = self.client.compute(self.name, self.config, **tensors)
        device = getattr(mask, "device", None)
        if device is not None and hasattr(result.advantages, "to"):
            result.advantages = result.advantages.to(device)
            if result.returns is not None:
                result.returns = result.returns.to(device)
        self.last_metrics = dict(result.metrics)
        return result
