"""NeMo RL computing its advantages on an advantage server: the few lines a NeMo RL user changes.

NeMo RL builds its estimator in ``nemo_rl/algorithms/grpo.py``, ``_create_advantage_estimator(master_config)``,
and calls ``adv_estimator.compute_advantage(prompt_ids=..., rewards=..., mask=..., repeated_batch=...,
logprobs_policy=..., logprobs_reference=...)`` once per step. ``RemoteAdvantageEstimator`` has that same
``compute_advantage``, so only the construction changes. Either edit that function::

    -    adv_estimator = GRPOAdvantageEstimator(adv_estimator_config, loss_config)
    +    from advantage_client import RemoteAdvantageEstimator
    +    adv_estimator = RemoteAdvantageEstimator(os.environ["ADVANTAGE_SERVICE_TARGET"], adv_estimator_config["name"],
    +                                             {**adv_estimator_config, **loss_config})

or leave NeMo RL's source alone and replace the factory from your launch script (``run_grpo_math.py`` or yours),
before ``grpo_train`` runs::

    import nemo_rl.algorithms.grpo as grpo
    from remote_advantage import create_remote_advantage_estimator

    grpo._create_advantage_estimator = create_remote_advantage_estimator

``compute_advantage`` returns what the NeMo RL it runs in expects (``result_format="auto"``): with NeMo RL as
released (no ``AdvantageResult`` in ``nemo_rl.algorithms.advantage_estimator``) the advantages tensor, or
``(advantages, returns)`` for raw_reward and gae, exactly as NeMo RL's own classes, so
``train_data["advantages"] = adv_estimator.compute_advantage(...)`` keeps working; with a NeMo RL that has
``AdvantageResult`` (PR #3512) an ``AdvantageResult``. Pass ``result_format="legacy"`` or
``"advantage_result"`` to choose. The master config may be NeMo RL's pydantic ``MasterConfig`` or a plain dict.

The server is ``$ADVANTAGE_SERVICE_TARGET`` (``host:port``, ``dns:///advantage-service.<ns>.svc:50051`` on
Kubernetes, or a comma-separated list of replicas; default ``localhost:50051``); ``$ADVANTAGE_SERVICE_TLS_CA``
(a PEM file) turns on TLS and ``$ADVANTAGE_SERVICE_TOKEN_FILE`` sends its bearer token. Results come back on the
mask's device, so the rest of the training step is unchanged. ``tests/test_deploy_examples.py`` runs this file
against a real server with NeMo RL's own golden inputs, in both result forms, and through a stand-in of NeMo RL's
released GRPO and PPO loops.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from advantage_client import AdvantageClient, RemoteAdvantageEstimator

NEMO_ESTIMATORS = ("grpo", "gdpo", "reinforce_plus_plus", "raw_reward", "gae", "opd")


def _as_dict(value: Any) -> Mapping[str, Any]:
    """A dict, or NeMo RL's pydantic config (``MasterConfig``, ``GRPOConfig``, ``ClippedPGLossConfig``) as one."""
    if value is None:
        return {}
    return value.model_dump() if hasattr(value, "model_dump") else value


def _section(config: Any, key: str) -> Mapping[str, Any]:
    """``config[key]`` of a dict master config, ``config.<key>`` of NeMo RL's pydantic one; ``{}`` when absent."""
    if isinstance(config, Mapping):
        return _as_dict(config.get(key))
    return _as_dict(getattr(config, key, None))


def estimator_config(master_config: Any, algorithm: str = "grpo") -> dict[str, Any]:
    """The estimator config NeMo RL's ``_create_advantage_estimator`` reads: ``<algorithm>.adv_estimator``, or
    the backward-compatible defaults from the older top-level keys, as NeMo RL falls back to them."""
    section = _section(master_config, algorithm)
    return dict(_as_dict(section.get("adv_estimator")) or {
        "name": "grpo",
        "normalize_rewards": section.get("normalize_rewards", True),
        "use_leave_one_out_baseline": section.get("use_leave_one_out_baseline", False),
        "minus_baseline": True,
    })


def create_remote_advantage_estimator(master_config: Any, *, algorithm: str = "grpo", target: str | None = None,
                                      timeout: float = 120.0, result_format: str = "auto") -> RemoteAdvantageEstimator:
    """Drop-in for NeMo RL's ``_create_advantage_estimator(master_config)``: the same estimator, computed remotely.

    master_config: NeMo RL's ``MasterConfig`` (pydantic) or a dict of the same sections. The estimator config
    and the loss config (``use_kl_in_reward``, ``reference_policy_kl_penalty``, ``reference_policy_kl_type``)
    are merged, as NeMo RL's estimators read both. result_format: see ``RemoteAdvantageEstimator`` ("auto":
    what the installed NeMo RL's loop expects). Raises ``ValueError`` for an estimator name the service does
    not run for NeMo RL.
    """
    adv_config = estimator_config(master_config, algorithm)
    name = adv_config.get("name", "grpo")
    if name not in NEMO_ESTIMATORS:
        raise ValueError(f"Invalid adv_estimator name: {name} (the service runs {', '.join(NEMO_ESTIMATORS)})")
    target = target or os.environ.get("ADVANTAGE_SERVICE_TARGET", "localhost:50051")
    replicas = [t.strip() for t in target.split(",")] if "," in target else target
    client = AdvantageClient(replicas, timeout=timeout, tls_ca=os.environ.get("ADVANTAGE_SERVICE_TLS_CA"),
                             token_file=os.environ.get("ADVANTAGE_SERVICE_TOKEN_FILE"))
    config = {**_section(master_config, "loss_fn"), **adv_config}
    print(f"  ✓ Using the advantage service's {name} estimator at {target}")
    return RemoteAdvantageEstimator(target, name, config, client=client, result_format=result_format)
