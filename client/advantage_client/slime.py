"""slime (THUDM/slime) adoption by configuration: two of slime's own flags, no patch, no code of yours.

Add to the ``train.py`` command line (the server: ``$ADVANTAGE_SERVICE_TARGET`` in the processes slime starts; TLS
and the bearer token from ``$ADVANTAGE_SERVICE_TLS_CA`` / ``$ADVANTAGE_SERVICE_TOKEN_FILE``)::

    --custom-advantage-function-path advantage_client.slime.compute_advantages_and_returns
    --custom-reward-post-process-path advantage_client.slime.post_process_rewards        # optional

* :func:`compute_advantages_and_returns` is what slime's trainer calls in place of its estimator branch of
  ``compute_advantages_and_returns`` (``slime/backends/megatron_utils/loss.py``, after the KL, before slime's own
  ``--normalize-advantages`` whitening, which stays slime's: it is reduced over the data-parallel group). It sends
  the rank's batch in the packed layout (``cu_seqlens`` from ``response_lengths``: responses of 1 and 16k tokens cost
  their tokens, not ``B x max(T)``), ``semantics = slime``, and sets ``rollout_data["advantages"]`` and
  ``["returns"]`` to lists of ``[T_i]`` float32 tensors on the device of slime's own ``rollout_data["kl"]``.
* :func:`post_process_rewards` is what slime's rollout manager calls in place of ``_post_process_rewards``: the
  group normalisation of ``grpo``, ``gspo``, ``cispo`` and ``reinforce_plus_plus_baseline``, computed by the service
  on the whole rollout (it sees every sample of each prompt). Without it slime normalises its rewards itself, as
  released.

Both translate slime's flags (``--advantage-estimator``, ``--kl-coef``, ``--kl-loss-type``, ``--gamma``,
``--lambd``, ``--disable-rewards-normalization``, ``--disable-grpo-std-normalization``, ``--n-samples-per-prompt``,
``--rollout-batch-size``, ``--use-rollout-logprobs``) into one request and hold no math: the numbers are the
service's, checked against slime's own code at the commit ``advantage_client.references`` names
(``tests/test_golden_slime.py``). Context parallelism (``--context-parallel-size`` > 1, which hands each rank a
chunk of every response) is refused with a ``ValueError`` saying so.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np

from advantage_client.trl import client_from_environment

__all__ = ["compute_advantages_and_returns", "post_process_rewards", "service_config", "ESTIMATORS"]

#: slime's ``--advantage-estimator`` -> the service's estimator (``grpo``, ``gspo`` and ``cispo`` share their
#: advantages; ``ppo`` is GAE)
ESTIMATORS = {"grpo": "grpo", "gspo": "grpo", "cispo": "grpo", "reinforce_plus_plus": "reinforce_plus_plus",
              "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "ppo": "gae"}
#: the estimators whose rewards slime's rollout normalises per prompt group (``_post_process_rewards``)
GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")

_client: Any = None
_lock = threading.Lock()


def _shared_client() -> Any:
    global _client
    with _lock:
        if _client is None:
            _client = client_from_environment()
        return _client


def _estimator(args: Any) -> str:
    name = ESTIMATORS.get(getattr(args, "advantage_estimator", None))
    if name is None:
        raise ValueError(f"--advantage-estimator {getattr(args, 'advantage_estimator', None)!r}: the advantage "
                         f"service serves slime's {', '.join(ESTIMATORS)}; unset --custom-advantage-function-path "
                         "for the others")
    return name


def service_config(args: Any, *, trainer: bool = True) -> tuple[str, dict[str, Any]]:
    """(estimator, config) of slime's ``args`` for the service under ``semantics = slime``.

    ``trainer``: the request of :func:`compute_advantages_and_returns` (the rollout has normalised the rewards,
    and slime whitens after the hook: ``rewards_normalization`` and ``normalize_advantages`` off); False: the whole
    step, as a direct caller of the service would ask for slime's numbers. Raises ``ValueError`` for an estimator
    the service does not serve."""
    name = _estimator(args)
    config: dict[str, Any] = {"semantics": "slime"}
    kl_coef = float(getattr(args, "kl_coef", 0.0) or 0.0)
    if name != "grpo":  # slime's grpo, gspo and cispo leave the KL to the loss
        config["use_kl_in_reward"] = kl_coef != 0
        if kl_coef:
            kind = getattr(args, "kl_loss_type", "k1")
            config["reference_policy_kl_penalty"] = kl_coef
            config["reference_policy_kl_type"] = "k3" if kind == "low_var_kl" else kind
            if kind == "low_var_kl":  # slime's low_var_kl: k3 clamped to +-10
                config["kl_output_clamp_value"] = 10.0
    if name in ("grpo", "reinforce_plus_plus_baseline"):
        config["rewards_normalization"] = bool(getattr(args, "rewards_normalization", True)) and not trainer
    if name == "grpo":
        config["normalize_rewards"] = bool(getattr(args, "grpo_std_normalization", True))
    if name == "reinforce_plus_plus":
        config["gamma"] = float(getattr(args, "gamma", 1.0))
    if name == "gae":
        config["gae_gamma"], config["gae_lambda"] = float(getattr(args, "gamma", 1.0)), float(getattr(args, "lambd", 1.0))
    config["normalize_advantages"] = bool(getattr(args, "normalize_advantages", False)) and not trainer
    return name, config


def _flat(tensors: Any) -> Any:
    """slime's per-sample ``[T_i]`` tensors as one flat float32 CPU tensor ``[N]`` (the packed layout)."""
    import torch
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


#: the rollout_data keys the trainer hook reads, and the slime flag that makes slime provide each
_WHY = {"rewards": "always", "response_lengths": "always", "loss_masks": "always",
        "log_probs": "--kl-coef other than 0 (estimators other than grpo, gspo, cispo)",
        "rollout_log_probs": "--kl-coef other than 0 with --use-rollout-logprobs",
        "ref_log_probs": "--kl-coef other than 0 (a reference model: slime's --ref-load)",
        "values": "--advantage-estimator ppo (a critic)"}


def _rows(rollout_data: dict[str, Any], key: str, lengths: list[int]) -> list[Any]:
    """``rollout_data[key]``, checked to hold one entry per sample of the length slime's ``response_lengths`` gives
    it. Raises ``ValueError`` naming the key, the sample and slime's flag that provides it."""
    rows = rollout_data.get(key)
    if rows is None:
        raise ValueError(f"rollout_data[{key!r}] is missing: slime provides it with {_WHY[key]}; check the "
                         "slime flags, or unset --custom-advantage-function-path")
    if len(rows) != len(lengths):
        raise ValueError(f"rollout_data[{key!r}] holds {len(rows)} samples but response_lengths {len(lengths)}")
    if key != "rewards":
        for i, (row, n) in enumerate(zip(rows, lengths)):
            if row.numel() != n:
                raise ValueError(f"rollout_data[{key!r}][{i}] holds {row.numel()} tokens but response_lengths[{i}] "
                                 f"is {n}: each sample's tensors must be its response's length (context parallelism "
                                 "hands each rank a chunk; see --context-parallel-size)")
    return rows


def compute_advantages_and_returns(args: Any, rollout_data: dict[str, Any], *, client: Any = None) -> None:
    """slime's ``--custom-advantage-function-path`` hook: ``rollout_data["advantages"]`` and ``["returns"]`` from
    the service, in place.

    rollout_data: slime's (``rewards`` list of B floats, ``response_lengths`` list of B ints, ``loss_masks`` list of
    ``[T_i]``, ``log_probs`` / ``rollout_log_probs`` and ``ref_log_probs`` lists of ``[T_i]`` when ``--kl-coef`` is
    not 0, ``values`` list of ``[T_i]`` for ``ppo``, ``kl`` list of ``[T_i]``). Sets lists of ``[T_i]`` float32
    tensors on ``kl``'s device (empty lists, and no request, for a rank with no sample). client: an
    :class:`~advantage_client.AdvantageClient` (None: one per process from ``$ADVANTAGE_SERVICE_TARGET``). Raises
    ``ValueError`` for an estimator not served, context parallelism, or a missing key or a sample whose tensors are
    not its response's length (naming the key, the sample and the slime flag that provides it), and what
    ``client.compute`` raises (``InvalidArgumentError`` naming the input, e.g. a NaN reward)."""
    import torch

    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ValueError("--context-parallel-size > 1 hands each rank a chunk of every response, and the advantage "
                         "service takes whole responses: run without context parallelism, or unset "
                         "--custom-advantage-function-path")
    name, config = service_config(args, trainer=True)
    if rollout_data.get("response_lengths") is None:
        raise ValueError(f"rollout_data['response_lengths'] is missing: slime provides it {_WHY['response_lengths']}")
    lengths = [int(n) for n in rollout_data["response_lengths"]]
    B = len(lengths)
    if B == 0:  # nothing on this rank: nothing to ask
        rollout_data["advantages"], rollout_data["returns"] = [], []
        return
    inputs: dict[str, Any] = {
        "rewards": torch.tensor([float(r) for r in _rows(rollout_data, "rewards", lengths)], dtype=torch.float32),
        "mask": _flat(_rows(rollout_data, "loss_masks", lengths))}
    if name in ("grpo", "reinforce_plus_plus_baseline"):
        inputs["prompt_ids"] = np.zeros(B, dtype=np.int64)  # read only with rewards_normalization, off here
    if config.get("use_kl_in_reward"):
        policy = "rollout_log_probs" if getattr(args, "use_rollout_logprobs", False) else "log_probs"
        inputs["logprobs"] = _flat(_rows(rollout_data, policy, lengths))
        inputs["reference_logprobs"] = _flat(_rows(rollout_data, "ref_log_probs", lengths))
    if name == "gae":
        inputs["values"] = _flat(_rows(rollout_data, "values", lengths))
    cu_seqlens = np.fromiter(itertools.accumulate(lengths, initial=0), dtype=np.int64, count=B + 1)
    result = (client or _shared_client()).compute(name, config, output_dtype="float32", cu_seqlens=cu_seqlens,
                                                  **inputs)
    like = (rollout_data.get("kl") or rollout_data["loss_masks"])[0]
    rollout_data["advantages"] = list(torch.split(result.advantages.to(like.device), lengths))
    rollout_data["returns"] = list(torch.split(result.returns.to(like.device), lengths))


def post_process_rewards(args: Any, samples: list[Any], *, client: Any = None) -> tuple[list[float], list[float]]:
    """slime's ``--custom-reward-post-process-path`` hook: ``(raw_rewards, rewards)`` as ``_post_process_rewards``
    returns them, the group normalisation from the service.

    samples: slime's ``Sample`` list (``get_reward_value(args)``), each prompt's ``--n-samples-per-prompt`` samples
    back to back (the whole batch is one group when the count is not ``n * --rollout-batch-size``, as in slime).
    Returns two lists of B floats; ``rewards`` is ``raw_rewards`` where slime normalises nothing (``ppo``,
    ``reinforce_plus_plus``, ``--disable-rewards-normalization``)."""
    raw = [sample.get_reward_value(args) for sample in samples]
    if getattr(args, "advantage_estimator", None) not in GROUP_NORMALISED or \
            not getattr(args, "rewards_normalization", True):
        return raw, raw
    name, config = service_config(args, trainer=False)
    config["normalize_advantages"] = False
    config.pop("use_kl_in_reward", None)  # the KL joins in the trainer (compute_advantages_and_returns)
    for key in ("reference_policy_kl_penalty", "reference_policy_kl_type", "kl_output_clamp_value"):
        config.pop(key, None)
    B, n = len(raw), int(getattr(args, "n_samples_per_prompt", 1))
    groups = np.arange(B) // n if B == n * int(getattr(args, "rollout_batch_size", 0)) else np.zeros(B, np.int64)
    result = (client or _shared_client()).compute(
        name, config, output_dtype="float32", as_numpy=True, rewards=np.asarray(raw, dtype=np.float32),
        prompt_ids=groups.astype(np.int64), mask=np.ones((B, 1), dtype=np.float32))
    return raw, [float(a) for a in np.asarray(result.advantages).reshape(B, -1)[:, 0]]
