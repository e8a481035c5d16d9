"""ROLL (alibaba/ROLL) adoption: ROLL's RLVR pipeline's ``compute_advantage`` and its agentic pipeline's
``agentic_compute_advantage`` served, by one line.

ROLL has no registry for its advantage step: ``roll/pipeline/rlvr/rlvr_pipeline.py`` imports ``compute_advantage``
from ``roll.utils.functionals`` and calls it once per domain. Rebinding the name that module imported is the smallest
patch; add to your launcher (``examples/start_rlvr_pipeline.py``), before the pipeline runs::

    import advantage_client.roll; advantage_client.roll.install()

(the server: ``$ADVANTAGE_SERVICE_TARGET``; TLS and the bearer token from ``$ADVANTAGE_SERVICE_TLS_CA`` /
``$ADVANTAGE_SERVICE_TOKEN_FILE``). ROLL's own ``get_sample_level_mask``, ``reward_postprocess`` (its normalisation
and reward clip) and ``compute_token_reward`` (placement, token-level KL, its KL controller's update) still run as
released; :func:`compute_advantage` sends what they left (``token_level_rewards``, the ``final_response_mask``,
``values`` for gae) with ``semantics = roll`` and ROLL's ``gamma``, ``lambd``, ``adv_estimator``, ``whiten_rewards``,
``whiten_advantages`` and ``advantage_clip``, one request per call, and sets ``data.batch["advantages"]`` and
``["returns"]`` (float32, on the device of ROLL's token rewards). It holds no math: the numbers are the service's,
checked against ROLL's own code at the commit ``advantage_client.references`` names (``tests/test_golden_roll.py``,
``tests/test_roll_dropin.py``).

Differences from ROLL's function, all in logging fields: ``data.batch["raw_advantages"]`` (which ROLL only logs) is the
returns for grpo / reinforce / step_reinforce (ROLL's value exactly: its advantages before whitening are the returns)
and the service's advantages for gae (ROLL: before whitening); ``token_level_rewards`` stays as ROLL's
``compute_token_reward`` left it (ROLL masks, and with ``whiten_rewards`` whitens, its copy); the
``critic/advantage_clip_frac`` metric is not set. Refused with a ``ValueError``: ``adv_estimator`` other than gae,
reinforce, step_reinforce and grpo (gigpo and the agentic estimators run in ROLL's agentic pipeline), and OPD
(``use_opd``, ``is_pure_opd``).

The agentic pipeline (``roll/pipeline/agentic/agentic_pipeline.py``) imports ``agentic_compute_advantage`` from
``roll.pipeline.agentic.utils`` and calls it once per step on the whole batch; :func:`install` rebinds that name too
(when the module imports: a process that cannot import it cannot run that pipeline). ROLL's function is its RLVR
``compute_advantage`` line for line plus ``adv_estimator = agentic_reinforce`` (``compute_agentic_reinforce_return``),
and its pipeline passes no ``response_mask`` (so ``response_mask[:, 1:]``). :func:`agentic_compute_advantage` sends
the same request as :func:`compute_advantage`, with ``gigpo`` (ROLL: the reinforce returns of the token rewards that
its ``compute_response_level_rewards`` and ``compute_token_reward`` left) as ``reinforce_plus_plus`` and
``agentic_reinforce`` as ``reinforce_plus_plus`` with ``segment_returns``. ROLL's step-level and trajectory-level
reward stages (``compute_discounted_returns``, ``compute_response_level_rewards`` with its ``agentic_reward_norm``
and GiGPO state groups) and the KL controller run as released; the same logging-field differences apply, and OPD is
refused alike.
"""
from __future__ import annotations

import importlib
import threading
from typing import Any

import numpy as np

from advantage_client.trl import client_from_environment

__all__ = ["agentic_compute_advantage", "compute_advantage", "install", "service_config", "AGENTIC_ESTIMATORS",
           "ESTIMATORS"]

#: ROLL's RLVR ``adv_estimator`` -> the service's estimator (ROLL's compute_advantage treats reinforce and
#: step_reinforce alike)
ESTIMATORS = {"grpo": "grpo", "reinforce": "reinforce_plus_plus", "step_reinforce": "reinforce_plus_plus",
              "gae": "gae"}
#: ROLL's agentic ``adv_estimator`` -> the service's estimator (``agentic_compute_advantage``: gigpo takes the
#: reinforce returns of its token rewards; agentic_reinforce: reinforce_plus_plus with segment_returns)
AGENTIC_ESTIMATORS = {**ESTIMATORS, "gigpo": "reinforce_plus_plus", "agentic_reinforce": "reinforce_plus_plus"}
#: the pipeline module whose imported name :func:`install` rebinds
PIPELINE_MODULE = "roll.pipeline.rlvr.rlvr_pipeline"
#: the agentic pipeline module whose imported ``agentic_compute_advantage`` :func:`install` rebinds
AGENTIC_PIPELINE_MODULE = "roll.pipeline.agentic.agentic_pipeline"

_client: Any = None
_lock = threading.Lock()


def _shared_client() -> Any:
    global _client
    with _lock:
        if _client is None:
            _client = client_from_environment()
        return _client


#: what :func:`install` rebound: pipeline module name -> the function it replaced
INSTALLED: dict[str, Any] = {}


def install(module: Any = None, agentic_module: Any = None) -> Any:
    """Rebind ``compute_advantage`` in ROLL's RLVR pipeline module (``module``, else :data:`PIPELINE_MODULE`
    imported) to :func:`compute_advantage`, and ``agentic_compute_advantage`` in its agentic pipeline module
    (``agentic_module``, else :data:`AGENTIC_PIPELINE_MODULE` imported) to :func:`agentic_compute_advantage`. A
    module that is not given and does not import is left out (that process cannot run its pipeline); when neither
    imports, an ImportError naming both and the RLVR module's own error is raised. :data:`INSTALLED` records what was rebound. Returns the RLVR
    function it replaced (None when only the agentic module imported)."""
    replaced, errors = {}, []
    for path, given, name, fn in ((PIPELINE_MODULE, module, "compute_advantage", compute_advantage),
                                  (AGENTIC_PIPELINE_MODULE, agentic_module, "agentic_compute_advantage",
                                   agentic_compute_advantage)):
        if given is None:
            try:
                given = importlib.import_module(path)
            except ImportError as err:
                errors.append(err)
                continue
        replaced[path] = getattr(given, name)
        setattr(given, name, fn)
    if not replaced:
        raise ImportError(f"advantage_client.roll.install() rebinds names in ROLL's pipeline modules "
                          f"({PIPELINE_MODULE}, {AGENTIC_PIPELINE_MODULE}), and neither imports here: {errors[0]}. "
                          "Call it in ROLL's own environment (its launcher), or pass the module: "
                          "install(module=...)") from errors[0]
    INSTALLED.update(replaced)
    return replaced.get(PIPELINE_MODULE)


def service_config(adv_estimator: str, gamma: float, lambd: float, advantage_clip: float | None,
                   whiten_advantages: bool, whiten_rewards: bool, agentic: bool = False) -> tuple[str, dict[str, Any]]:
    """(estimator, config) of ROLL's ``compute_advantage`` arguments (``agentic``: its
    ``agentic_compute_advantage``'s) under ``semantics = roll``. Raises ``ValueError`` for an ``adv_estimator``
    the service does not serve here."""
    table = AGENTIC_ESTIMATORS if agentic else ESTIMATORS
    name = table.get(adv_estimator)
    if name is None:
        where = "agentic_compute_advantage" if agentic else ("RLVR compute_advantage; the agentic estimators are "
                                                             "served through agentic_compute_advantage")
        raise ValueError(f"adv_estimator {adv_estimator!r}: advantage_client.roll serves {', '.join(table)} in "
                         f"ROLL's {where}")
    config: dict[str, Any] = {"semantics": "roll", "normalize_advantages": bool(whiten_advantages),
                              "whiten_rewards": bool(whiten_rewards)}
    if adv_estimator == "agentic_reinforce":
        config["segment_returns"] = True
    if name == "gae":
        config["gae_gamma"], config["gae_lambda"] = float(gamma), float(lambd)
    else:
        config["gamma"] = float(gamma)
    if advantage_clip is not None:
        config["advantage_clip"] = float(advantage_clip)
    return name, config


def compute_advantage(data: Any, gamma: float, lambd: float, adv_estimator: str, advantage_clip: float | None = None,
                      whiten_advantages: bool = False, whiten_rewards: bool = False, response_mask: Any = None,
                      pipeline_config: Any = None, *, client: Any = None) -> Any:
    """ROLL's ``roll.utils.functionals.compute_advantage``, its signature and its effect on ``data`` (a DataProto:
    ``data.batch`` with ``token_level_rewards`` [B, T], ``response_mask`` [B, T + 1], ``values`` [B, T] for gae),
    served. ``response_mask``: ROLL's ``final_response_mask`` [B, T] (None: ``response_mask[:, 1:]``, as ROLL).
    Returns ``data``. client: an :class:`~advantage_client.AdvantageClient` (None: one per process from
    ``$ADVANTAGE_SERVICE_TARGET``). Raises ``ValueError`` for OPD or an estimator not served, and what
    ``client.compute`` raises."""
    if pipeline_config is not None and (getattr(pipeline_config, "use_opd", False)
                                        or getattr(pipeline_config, "is_pure_opd", False)):
        raise ValueError("use_opd / is_pure_opd: ROLL's on-policy distillation is not served by advantage_client.roll; "
                         "leave compute_advantage as released (do not call install())")
    return _compute(data, gamma, lambd, adv_estimator, advantage_clip, whiten_advantages, whiten_rewards,
                    response_mask, client, agentic=False)


def agentic_compute_advantage(data: Any, gamma: float, lambd: float, adv_estimator: str,
                              advantage_clip: float | None = None, whiten_advantages: bool = False,
                              whiten_rewards: bool = False, response_mask: Any = None, pipeline_config: Any = None,
                              *, client: Any = None) -> Any:
    """ROLL's ``roll.pipeline.agentic.utils.agentic_compute_advantage``, its signature and its effect on ``data``,
    served: as :func:`compute_advantage`, with ``adv_estimator`` one of :data:`AGENTIC_ESTIMATORS` (gae, reinforce,
    grpo, gigpo, step_reinforce, agentic_reinforce). ROLL's agentic pipeline passes no ``response_mask``
    (``response_mask[:, 1:]`` is used). Returns ``data``. Raises ``ValueError`` for OPD or another estimator."""
    if pipeline_config is not None and (getattr(pipeline_config, "use_opd", False)
                                        or getattr(pipeline_config, "is_pure_opd", False)):
        raise ValueError("use_opd / is_pure_opd: ROLL's on-policy distillation is not served by advantage_client.roll; "
                         "leave agentic_compute_advantage as released (do not call install())")
    return _compute(data, gamma, lambd, adv_estimator, advantage_clip, whiten_advantages, whiten_rewards,
                    response_mask, client, agentic=True)


def _compute(data: Any, gamma: float, lambd: float, adv_estimator: str, advantage_clip: float | None,
             whiten_advantages: bool, whiten_rewards: bool, response_mask: Any, client: Any, agentic: bool) -> Any:
    """One request for ROLL's advantage function (RLVR or ``agentic``); sets ``data.batch``'s ``advantages``,
    ``returns`` and ``raw_advantages``. Returns ``data``."""
    name, config = service_config(adv_estimator, gamma, lambd, advantage_clip, whiten_advantages, whiten_rewards,
                                  agentic=agentic)
    batch = data.batch
    for key in ("token_level_rewards",) + (("values",) if name == "gae" else ()):
        if key not in batch.keys():
            raise ValueError(f"data.batch[{key!r}] is missing: ROLL's compute_token_reward sets token_level_rewards, "
                             "its critic the values (adv_estimator gae)")
    if response_mask is None:
        response_mask = batch["response_mask"][:, 1:]
    rewards = batch["token_level_rewards"]
    inputs: dict[str, Any] = {"rewards": rewards, "mask": response_mask}
    if name == "grpo":  # required by grpo; not read from token-level rewards (ROLL normalised them already)
        inputs["prompt_ids"] = np.zeros(int(rewards.shape[0]), dtype=np.int64)
    if name == "gae":
        inputs["values"] = batch["values"]
    result = (client or _shared_client()).compute(name, config, output_dtype="float32", **inputs)
    advantages, returns = result.advantages.to(rewards.device), result.returns.to(rewards.device)
    batch["advantages"] = advantages
    batch["returns"] = returns
    batch["raw_advantages"] = returns if name != "gae" else advantages
    return data
