"""TRL drop-in: :class:`RemoteGRPOTrainer` is TRL's ``GRPOTrainer`` with its advantages computed by the service.

A TRL 1.16.0 user changes one class name and keeps everything else (model, reward functions, ``GRPOConfig``,
datasets, callbacks, ``accelerate launch``)::

    # was: from trl import GRPOTrainer
    from advantage_client.trl import RemoteGRPOTrainer as GRPOTrainer

    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=GRPOConfig(...),
                          train_dataset=dataset)             # server: $ADVANTAGE_SERVICE_TARGET
    trainer.train()

The server: ``advantage_client=`` (an :class:`~advantage_client.AdvantageClient`, or any object with its
``compute``, e.g. ``AdvantageClient.from_ray(...)``), else ``advantage_target=`` (``"host:port"``, or a list or
comma-separated string of replica addresses), else ``$ADVANTAGE_SERVICE_TARGET`` (default ``localhost:50051``);
a client made here reads ``$ADVANTAGE_SERVICE_TLS_CA`` (a PEM file: TLS) and ``$ADVANTAGE_SERVICE_TOKEN_FILE``
(a bearer token), as ``examples/nemo_rl/remote_advantage.py`` does; ``advantage_timeout`` is that client's
deadline per call in seconds (default 60; a client passed in keeps its own). Every other argument is
``GRPOTrainer``'s own, passed on unchanged.

What is computed remotely: TRL 1.16.0 has no advantage method to override. ``_calculate_rewards`` returns the
float32 ``rewards_per_func`` ``[B_total, F]`` gathered from every process (NaN where a reward function returned
``None``), and ``_generate_and_score_completions`` computes the advantages inline and returns this process's
slice as ``out["advantages"]`` (float32 ``[B_local]``) before ``_prepare_inputs`` shuffles the batch. This class
keeps the gathered ``rewards_per_func``, lets TRL's method run, and then replaces ``out["advantages"]`` with the
service's answer for the same rows: estimator ``grpo`` with ``semantics = "trl"`` and TRL's ``scale_rewards``
(``group``, ``batch`` or ``none``; ``True``/``False`` as ``GRPOConfig`` maps them), for
``multi_objective_aggregation = "sum_then_normalize"``:

* rewards: the weighted sum of the reward functions (``reward_weights``; a ``None``/NaN of one function
  counts 0, as TRL's ``nansum``), in float64, one per completion; groups: blocks of ``num_generations``
  consecutive rows of the gathered batch (``num_generations_eval`` in evaluation), as TRL views them;
* a completion that every reward function left unscorable (all ``None``): TRL leaves it out of its group's
  mean and std (and of the batch std) and gives it 0; it is sent with reward 0, an all-zero mask row and
  ``exclude_empty_responses = true``, which does the same;
* multi-process: every process sends the gathered batch (the same rows, so the same answer) and keeps the
  slice TRL keeps, ``process_index * B_local`` to ``(process_index + 1) * B_local``.

The service computes in float64 and rounds once to float32, so the advantages differ from TRL's own float32
computation by at most about one float32 ulp of their size (``tests/test_diff_trl.py`` and, through real
``GRPOTrainer`` training, ``tests/test_trl_trainer.py``). TRL's own computation still runs (it is inline), and
what TRL logs from it stays TRL's: the completions table's ``advantages`` column (``_logs["advantages"]``)
and ``frac_reward_zero_std``; the reward metrics are the same numbers either way.

Not offered, refused when the trainer is constructed (``ValueError`` naming the option):
``multi_objective_aggregation = "normalize_then_sum"`` (TRL's per-function normalisation is not a service
estimator) and a ``scale_rewards`` other than group, batch or none. Service errors during training are raised as the client
raises them (:class:`~advantage_client.AdvantageServiceError`; INVALID_ARGUMENT, e.g. an infinite reward, as
:class:`~advantage_client.InvalidArgumentError`, a ``ValueError``).

:class:`RemoteRLOOTrainer` is TRL's ``RLOOTrainer`` the same way (one class name changed; ``RLOOConfig`` and the
rest unchanged)::

    from advantage_client.trl import RemoteRLOOTrainer as RLOOTrainer

TRL 1.16.0 computes RLOO advantages inline in ``RLOOTrainer._generate_and_score_completions`` too. The class
keeps the gathered ``rewards_per_func`` and, when ``beta != 0``, the per-token log-probs of the policy and of the
reference that the method computes for the KL penalty (the first and second ``_get_per_token_logps_and_entropies``
calls of the step), with the ``completion_mask``; all three are gathered over processes as TRL gathers the KL
(padded to the widest completion first). It sends estimator ``rloo`` with ``semantics = "trl"``: rewards the weighted
sum of the reward functions as above, NaN for an unscorable completion (the service leaves it out of the
leave-one-out means and of the normalisation, and gives it 0, as TRL does); ``normalize_advantages`` and
``reward_clip_range`` (as ``reward_clip_min``/``reward_clip_max``) as configured; ``beta`` as
``use_kl_in_reward`` with ``reference_policy_kl_penalty = beta`` (the trl semantics' KL is TRL's: k1, the
policy's log-prob minus the reference's, unclamped). The per-sample answer
(``per_sample = true``: one advantage per completion) replaces this process's slice of ``out["advantages"]``.
Proven against TRL's own trainer in ``tests/test_trl_trainer.py`` and against the released method on generated
batches in ``tests/test_diff_trl_rloo.py``.

This module imports without TRL (and without torch): TRL is imported, and the subclass made, when a trainer is
first looked up (``from advantage_client.trl import RemoteGRPOTrainer``); a missing TRL is an ``ImportError``
then.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from advantage_client.channel import TARGET_ENV, TLS_CA_ENV, TOKEN_FILE_ENV, replica_list, settings_from_environment
from advantage_client.client import AdvantageClient

__all__ = ["RemoteGRPOTrainer", "RemoteRLOOTrainer", "trl_advantages", "trl_rloo_advantages",
           "client_from_environment", "SCALE_REWARDS", "TLS_CA_ENV", "TOKEN_FILE_ENV"]

#: TRL 1.16.0's ``scale_rewards`` values (after ``GRPOConfig`` maps True/False to group/none)
SCALE_REWARDS = ("group", "batch", "none")


def client_from_environment(target: Any = None, timeout: float | None = 60.0) -> AdvantageClient:
    """A client for ``target`` (``"host:port"``, a list of replica addresses or a comma-separated string of
    them; None: ``$ADVANTAGE_SERVICE_TARGET``, else ``localhost:50051``), with TLS from
    ``$ADVANTAGE_SERVICE_TLS_CA`` and the bearer token from ``$ADVANTAGE_SERVICE_TOKEN_FILE`` when set.
    Raises :class:`~advantage_client.TargetError` (a ``ValueError``) for a target without a port or a URL."""
    target, tls_ca, token_file = settings_from_environment(replica_list(target))
    return AdvantageClient(target, timeout=timeout, tls_ca=tls_ca, token_file=token_file)


def trl_advantages(client: Any, rewards_per_func: Any, reward_weights: Any, num_generations: int,
                   scale_rewards: str, *, timeout: Any = None) -> np.ndarray:
    """TRL 1.16.0's GRPO advantages (``sum_then_normalize``) of a gathered batch, from the service.

    rewards_per_func: ``[B, F]`` (torch tensor or array; NaN: that function returned ``None``), rows in TRL's
    order (prompt g's completions are rows ``g * n .. g * n + n - 1``); reward_weights: ``[F]``;
    num_generations: n (``B`` must be a multiple); scale_rewards: "group", "batch" or "none".
    Returns float32 ``[B]`` (one advantage per completion; 0 for a row every function left NaN).
    Raises ``ValueError`` for a ``scale_rewards`` not offered or a ``B`` that is not a multiple of n, and what
    ``client.compute`` raises (``InvalidArgumentError`` for an infinite reward)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: the service offers TRL's {', '.join(SCALE_REWARDS)}")
    rewards, unscorable = weighted_rewards(rewards_per_func, reward_weights, num_generations)
    B = len(rewards)
    config: dict[str, Any] = {"semantics": "trl", "scale_rewards": scale_rewards}
    mask = np.ones((B, 1), dtype=np.float32)
    if unscorable.any():
        rewards[unscorable] = 0.0
        mask[unscorable] = 0.0
        config["exclude_empty_responses"] = True
    kwargs = {} if timeout is None else {"timeout": timeout}
    out = client.compute("grpo", config, output_dtype="float32", as_numpy=True, rewards=rewards, mask=mask,
                         prompt_ids=np.arange(B, dtype=np.int64) // num_generations, **kwargs)
    return np.asarray(out.advantages, dtype=np.float32).reshape(B, -1)[:, 0]


def _numpy64(x: Any) -> np.ndarray:
    return x.detach().cpu().double().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)


def weighted_rewards(rewards_per_func: Any, reward_weights: Any, num_generations: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """TRL's reward of each completion, the input sent: ``(rewards_per_func * reward_weights).nansum(dim=1)``
    (a ``None``/NaN of one function counts 0), float64 ``[B]``, and the ``[B]`` bool of the unscorable rows
    (every function NaN; their reward here is 0). rewards_per_func: ``[B, F]``; reward_weights: ``[F]``.
    Raises ``ValueError`` for other shapes or a ``B`` that is not a multiple of ``num_generations``."""
    r, w = _numpy64(rewards_per_func), _numpy64(reward_weights)
    if r.ndim != 2 or w.shape != (r.shape[1],):
        raise ValueError(f"rewards_per_func must be [B, F] and reward_weights [F], got {r.shape} and {w.shape}")
    B = r.shape[0]
    if num_generations < 1 or B % num_generations:
        raise ValueError(f"the batch of {B} completions is not a whole number of groups of num_generations="
                         f"{num_generations}")
    return np.nansum(r * w[None, :], axis=1), np.isnan(r).all(axis=1)


def trl_rloo_advantages(client: Any, rewards_per_func: Any, reward_weights: Any, num_generations: int, *,
                        beta: float = 0.0, logprobs: Any = None, reference_logprobs: Any = None,
                        completion_mask: Any = None, normalize_advantages: bool = False,
                        reward_clip_range: Any = None, timeout: Any = None) -> np.ndarray:
    """TRL 1.16.0's RLOO advantages of a gathered batch, from the service (``rloo``, ``semantics = "trl"``).

    rewards_per_func: ``[B, F]`` (NaN: that function returned ``None``), prompt g's completions at rows
    ``g * n .. g * n + n - 1``; reward_weights: ``[F]``; num_generations: n; beta: ``RLOOConfig.beta`` (KL in
    the reward; with beta != 0, logprobs and reference_logprobs ``[B, T]``, the policy's and the reference's
    per-token log-probs, and completion_mask ``[B, T]`` 0/1); normalize_advantages and reward_clip_range
    (``(min, max)`` or None): ``RLOOConfig``'s. Returns float32 ``[B]``, one advantage per completion (0 for an
    unscorable one). Raises ``ValueError`` for shapes that do not fit (or beta != 0 without the log-probs), and
    what ``client.compute`` raises."""
    rewards, unscorable = weighted_rewards(rewards_per_func, reward_weights, num_generations)
    B = len(rewards)
    rewards[unscorable] = np.nan  # the service's trl semantics: NaN = unscorable, as TRL marks it
    config: dict[str, Any] = {"semantics": "trl", "normalize_advantages": bool(normalize_advantages)}
    tensors: dict[str, Any] = {"mask": np.ones((B, 1), dtype=np.float32)}
    if reward_clip_range:  # TRL's (min, max); an end None is an open end, as torch's clamp takes it
        lo, hi = reward_clip_range
        config.update({k: float(v) for k, v in (("reward_clip_min", lo), ("reward_clip_max", hi)) if v is not None})
    if beta != 0.0:
        if logprobs is None or reference_logprobs is None or completion_mask is None:
            raise ValueError("beta != 0: send logprobs, reference_logprobs and completion_mask [B, T] (TRL's KL "
                             "penalty is in the reward)")
        # the KL type and clamps are left to the trl semantics' defaults: k1, unclamped (TRL's)
        config.update(use_kl_in_reward=True, reference_policy_kl_penalty=float(beta))
        tensors = {"mask": _numpy64(completion_mask).astype(np.float32), "logprobs": _numpy64(logprobs),
                   "reference_logprobs": _numpy64(reference_logprobs)}
        if any(t.shape != (B, tensors["mask"].shape[1]) for t in tensors.values()):
            raise ValueError(f"logprobs, reference_logprobs and completion_mask must be [B, T] with B = {B}, got "
                             f"{[list(t.shape) for t in tensors.values()]}")
    kwargs = {} if timeout is None else {"timeout": timeout}
    out = client.compute("rloo", config, output_dtype="float32", as_numpy=True, per_sample=True, rewards=rewards,
                         prompt_ids=np.arange(B, dtype=np.int64) // num_generations, **tensors, **kwargs)
    return np.asarray(out.advantages, dtype=np.float32).reshape(B)


def _check_config(args: Any) -> None:
    """``ValueError`` for a ``GRPOConfig`` this trainer cannot serve (None: TRL's defaults, which it can)."""
    if args is None:
        return
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    if aggregation != "sum_then_normalize":
        raise ValueError(f"GRPOConfig.multi_objective_aggregation={aggregation!r} is not offered by the advantage "
                         f"service: use 'sum_then_normalize' (the default), or TRL's own GRPOTrainer")
    scale = {True: "group", False: "none"}.get(getattr(args, "scale_rewards", "group"),
                                                getattr(args, "scale_rewards", "group"))
    if scale not in SCALE_REWARDS:
        raise ValueError(f"GRPOConfig.scale_rewards={scale!r}: use one of {', '.join(SCALE_REWARDS)}")


def _process_slice(advantages: np.ndarray, local: Any, process_index: int) -> Any:
    """This process's rows of the gathered batch's ``[B_total]`` advantages, as TRL slices them
    (``process_index * B_local`` on), in ``local``'s dtype and device (``local``: TRL's own ``[B_local]``)."""
    import torch
    start = process_index * len(local)
    return torch.from_numpy(advantages[start:start + len(local)].copy()).to(device=local.device, dtype=local.dtype)


def _make_class(base: type) -> type:
    import inspect

    import torch

    signature = inspect.signature(base.__init__)

    class RemoteGRPOTrainer(base):  # type: ignore[misc, valid-type]
        """TRL's ``GRPOTrainer`` whose advantages come from the advantage service (module
        ``advantage_client.trl`` says what is sent and what stays TRL's).

        Arguments: ``GRPOTrainer``'s own, unchanged, plus the keywords ``advantage_client`` (a client, or any
        object with its ``compute``), ``advantage_target`` (``"host:port"``, replicas as a list or a
        comma-separated string; default ``$ADVANTAGE_SERVICE_TARGET``, else ``localhost:50051``) and
        ``advantage_timeout`` (seconds per call of a client made here, default 60). Raises ``ValueError`` for
        ``multi_objective_aggregation="normalize_then_sum"`` or a ``scale_rewards`` other than group, batch or
        none, before TRL loads anything; ``TypeError`` for an ``advantage_client`` without ``compute``.
        ``out["advantages"]`` of ``_generate_and_score_completions``: float32 ``[B_local]``, the service's.
        """

        def __init__(self, *args: Any, advantage_target: Any = None, advantage_client: Any = None,
                     advantage_timeout: float | None = 60.0, **kwargs: Any) -> None:
            bound = signature.bind_partial(self, *args, **kwargs)
            _check_config(bound.arguments.get("args"))
            if advantage_client is not None and not callable(getattr(advantage_client, "compute", None)):
                raise TypeError(f"advantage_client must be an AdvantageClient (or have its compute), "
                                f"got {type(advantage_client).__name__}")
            self.advantage_client = advantage_client if advantage_client is not None else \
                client_from_environment(advantage_target, advantage_timeout)
            self._remote_rewards_per_func = None
            super().__init__(*args, **kwargs)
            _check_config(self)  # what TRL made of the config (its defaults when args was None)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._remote_rewards_per_func = rewards_per_func  # [B_total, F] float32, gathered
            return rewards_per_func

        def _generate_and_score_completions(self, inputs):
            self._remote_rewards_per_func = None
            out = super()._generate_and_score_completions(inputs)
            rewards_per_func, self._remote_rewards_per_func = self._remote_rewards_per_func, None
            if rewards_per_func is None:
                raise RuntimeError("RemoteGRPOTrainer: TRL's _generate_and_score_completions did not call "
                                   "_calculate_rewards (a TRL other than 1.16.0?): no rewards to send")
            n = self.num_generations if self.model.training else self.num_generations_eval
            advantages = trl_advantages(self.advantage_client, rewards_per_func, self.reward_weights, n,
                                        self.scale_rewards)
            out["advantages"] = _process_slice(advantages, out["advantages"], self.accelerator.process_index)
            return out

    RemoteGRPOTrainer.__module__ = __name__
    RemoteGRPOTrainer.__qualname__ = "RemoteGRPOTrainer"
    return RemoteGRPOTrainer


def _make_rloo_class(base: type) -> type:
    import inspect
    import sys

    import torch

    signature = inspect.signature(base.__init__)
    trainer_module = sys.modules[base.__module__]  # TRL's own gather (accelerate's), as it gathers the KL

    class RemoteRLOOTrainer(base):  # type: ignore[misc, valid-type]
        """TRL's ``RLOOTrainer`` whose advantages come from the advantage service (module
        ``advantage_client.trl`` says what is sent and what stays TRL's).

        Arguments: ``RLOOTrainer``'s own, unchanged, plus ``advantage_client``, ``advantage_target`` and
        ``advantage_timeout`` as :class:`RemoteGRPOTrainer` takes them. Raises ``TypeError`` for an
        ``advantage_client`` without ``compute``, and ``RuntimeError`` during training when TRL's
        ``_generate_and_score_completions`` did not make the calls this class reads (a TRL other than 1.16.0).
        ``out["advantages"]`` of ``_generate_and_score_completions``: float32 ``[B_local]``, the service's.
        """

        def __init__(self, *args: Any, advantage_target: Any = None, advantage_client: Any = None,
                     advantage_timeout: float | None = 60.0, **kwargs: Any) -> None:
            signature.bind_partial(self, *args, **kwargs)  # TypeError for arguments RLOOTrainer does not take
            if advantage_client is not None and not callable(getattr(advantage_client, "compute", None)):
                raise TypeError(f"advantage_client must be an AdvantageClient (or have its compute), "
                                f"got {type(advantage_client).__name__}")
            self.advantage_client = advantage_client if advantage_client is not None else \
                client_from_environment(advantage_target, advantage_timeout)
            self._remote_rewards_per_func = None
            self._remote_logps: list | None = None
            super().__init__(*args, **kwargs)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._remote_rewards_per_func = rewards_per_func  # [B_total, F] float32, gathered
            return rewards_per_func

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if self._remote_logps is not None:  # inside _generate_and_score_completions: policy, then reference
                self._remote_logps.append(out[0].detach())
            return out

        def _generate_and_score_completions(self, inputs):
            self._remote_rewards_per_func, self._remote_logps = None, []
            try:
                out = super()._generate_and_score_completions(inputs)
                rewards_per_func, logps = self._remote_rewards_per_func, self._remote_logps
            finally:
                self._remote_rewards_per_func, self._remote_logps = None, None
            want = 2 if self.beta != 0.0 else 1
            if rewards_per_func is None or len(logps) != want:
                raise RuntimeError(f"RemoteRLOOTrainer: TRL's _generate_and_score_completions made "
                                   f"{'no' if rewards_per_func is None else 'a'} _calculate_rewards call and "
                                   f"{len(logps)} log-prob calls, not 1 and {want} (a TRL other than 1.16.0?): "
                                   "nothing to send")
            kl: dict[str, Any] = {}
            if self.beta != 0.0:  # TRL gathers the KL; the service needs its per-token terms: gather those
                pad = self.accelerator.pad_across_processes
                kl = {name: trainer_module.gather(pad(t, dim=1)) for name, t in
                      (("logprobs", logps[0]), ("reference_logprobs", logps[1]),
                       ("completion_mask", out["completion_mask"]))}
            n = self.num_generations if self.model.training else self.num_generations_eval
            advantages = trl_rloo_advantages(self.advantage_client, rewards_per_func, self.reward_weights, n,
                                             beta=self.beta, normalize_advantages=self.normalize_advantages,
                                             reward_clip_range=self.reward_clip_range, **kl)
            out["advantages"] = _process_slice(advantages, out["advantages"], self.accelerator.process_index)
            return out

    RemoteRLOOTrainer.__module__ = __name__
    RemoteRLOOTrainer.__qualname__ = "RemoteRLOOTrainer"
    return RemoteRLOOTrainer


_classes: dict[type, type] = {}
_lock = threading.Lock()
#: the drop-in's name -> (TRL's class it subclasses, the factory)
_TRAINERS = {"RemoteGRPOTrainer": ("GRPOTrainer", _make_class), "RemoteRLOOTrainer": ("RLOOTrainer", _make_rloo_class)}


def __getattr__(name: str) -> Any:
    """``RemoteGRPOTrainer`` / ``RemoteRLOOTrainer``: the subclass of the installed ``trl.GRPOTrainer`` /
    ``trl.RLOOTrainer`` (made once per base class)."""
    if name not in _TRAINERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base_name, factory = _TRAINERS[name]
    try:
        import trl
        base = getattr(trl, base_name)
    except ImportError as exc:
        raise ImportError(f"advantage_client.trl.{name} needs TRL (pip install trl==1.16.0): {exc}") from exc
    with _lock:
        if base not in _classes:
            _classes[base] = factory(base)
        return _classes[base]
