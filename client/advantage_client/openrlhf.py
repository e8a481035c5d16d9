"""OpenRLHF drop-in: OpenRLHF 0.11.2's ``RemoteExperienceMaker.compute_advantages_and_returns`` with the advantages
and returns computed by the service.

Adoption at OpenRLHF's own entry point, one change to the launch command (the server: ``$ADVANTAGE_SERVICE_TARGET``)::

    python -m advantage_client.openrlhf <the arguments>    # was: python -m openrlhf.cli.train_ppo_ray <the arguments>

:func:`main` runs OpenRLHF's CLI module unchanged and gives its ``ray.init`` this drop-in as Ray's
``worker_process_setup_hook`` (:func:`with_setup_hook`; OpenRLHF's own ``env_vars`` kept, the service's variables
forwarded): OpenRLHF 0.11.2 builds the experience maker inside its ``PPOTrainer`` Ray actor, so the install must run
in Ray's workers, and the hook runs it in every one. A launch that calls ``ray.init`` itself (or ``ray job submit
--runtime-env-json``) gives the same two keys: ``{"worker_process_setup_hook": "advantage_client.openrlhf.install",
"env_vars": {"ADVANTAGE_SERVICE_TARGET": "host:50051"}}``. ``install()`` called in a driver, which cannot reach the
actor, warns. tests/test_openrlhf_launch.py runs the launch command; tests/test_openrlhf_dropin.py runs the method
in-process.

``install(target=None)`` replaces ``openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker
.compute_advantages_and_returns`` by :func:`compute_advantages_and_returns` (``uninstall()`` puts OpenRLHF's back).
Every OpenRLHF option keeps its meaning: ``--algo.advantage.estimator`` (all seven of 0.11.2: ``gae``,
``reinforce``, ``rloo``, ``reinforce_baseline``, ``group_norm``, ``dr_grpo``, ``flash_reinforce``),
``--algo.advantage.gamma`` / ``lambd`` / ``no_std_norm``, ``--rollout.n_samples_per_prompt``, ``--reward.clip_range``,
the length penalties (``--reward.overlong_buffer_len`` etc.) and the KL in the reward (``--algo.kl.init_coef`` with a
reference model and without ``--algo.kl.use_loss``; the maker's ``kl_ctl.value`` is read at each call, so the
adaptive controller works). The server: ``target`` (``"host:port"``, a list of replica addresses, or an
``AdvantageClient``), else ``$ADVANTAGE_SERVICE_TARGET`` (TLS/token: ``$ADVANTAGE_SERVICE_TLS_CA``,
``$ADVANTAGE_SERVICE_TOKEN_FILE``), as the other drop-ins read them.

Inputs (OpenRLHF's own, source: ``openrlhf/trainer/ppo_utils/experience_maker.py``): a list of ``Experience``
micro-batches, each with ``rewards`` ``[B_i]``, ``action_mask`` ``[B_i, A_i]`` (bool; the widths ``A_i`` may differ
between micro-batches, as ``Experience.concat_experiences`` pads each one), ``kl`` ``[B_i, A_i]`` (``make_experience``'s
``compute_approx_kl``, or zeros), ``values`` ``[B_i, A_i]`` (``gae``), ``index`` (each sample's position in the
rollout: OpenRLHF's prompt groups are contiguous blocks of ``n_samples_per_prompt`` of it; the micro-batches may
hold them in any order, as the dynamic-batching ``get_seqlen_balanced_partitions`` split does; OpenRLHF's
``--ds.packing_samples`` packs inside the model forward only, the experiences stay padded ``[B_i, A_i]``).

What it writes, as OpenRLHF 0.11.2 does: ``rewards`` (promoted to at least float32, length penalties applied, by
OpenRLHF's own ``apply_length_penalties``), ``info["group_reward_std"]`` ``[B_i]`` (n > 1), ``advantages`` and
``returns`` ``[B_i, A_i]``, ``info["return"]`` ``[B_i]`` (the row's shaped token rewards summed), ``kl = None``; and
``args.algo.advantage.gamma = 1.0`` for the group estimators (OpenRLHF's warning included). Dtypes as OpenRLHF's:
advantages and returns in ``kl``'s dtype (``gae``: promoted with ``values``' dtype; OpenRLHF's whitening computes its
mean and scale in float32 but writes into the advantages' own dtype).

What the service computes, all of it (one request for the whole list, so group baselines and the batch whitening see
every experience; ``semantics = "openrlhf"`` throughout): ``gae`` -> ``gae``, ``reinforce`` ->
``reinforce_plus_plus`` (with ``gamma``), ``rloo`` -> ``rloo``, ``reinforce_baseline`` ->
``reinforce_plus_plus_baseline``, ``group_norm`` / ``dr_grpo`` -> ``grpo`` with ``normalize_rewards`` true / false,
``flash_reinforce`` -> ``grpo`` (false) with the whole batch as one group (OpenRLHF's rollout-batch mean). Each gets
``--reward.clip_range`` as ``reward_clip_min`` / ``reward_clip_max`` (unset: no clamp), the whitened ones
``--algo.advantage.no_std_norm`` as ``no_std_norm``, ``gae`` the critic's ``values`` with ``gae_gamma`` /
``gae_lambda``. KL in the reward: the experience's per-token ``kl`` is sent as ``logprobs`` with
``reference_logprobs`` 0 and ``reference_policy_kl_type = "k1"`` (k1 of that pair is the KL itself; the clamps are
opened so nothing is clipped twice), ``reference_policy_kl_penalty`` = ``kl_ctl.value``. This module translates
OpenRLHF's options and tensors into that request and the answer back into OpenRLHF's fields and dtypes; it computes
no advantage or return itself (issue #36: the OpenRLHF semantics of ``gae``, ``no_std_norm``, the clip range and
the group estimators' KL are the service's, differential-tested against the release by tests/test_diff_openrlhf.py).

Logging fields computed here (not advantages): ``info["group_reward_std"]`` (OpenRLHF's ``std`` of each group) and
``info["return"]`` (OpenRLHF's ``reward.sum(-1)`` of the shaped token rewards): from the service's returns at the
row's first valid token (gamma 1) plus the KL of the masked positions, or, for ``reinforce`` / ``gae`` (no baseline),
``clip(r) - coef * sum(kl)``. A row with no action token under a baseline estimator gets ``info["return"]`` NaN (the
service's answer carries no shaped reward for it; OpenRLHF's generation always gives at least one token).

Raises ``ValueError`` for an unknown estimator (OpenRLHF raises ``Exception``); ``TypeError`` for ``gae`` without
``values``; the client's errors (``AdvantageServiceError`` subclasses)
when the service fails. Tested by tests/test_openrlhf_dropin.py against OpenRLHF 0.11.2's own method.
"""
from __future__ import annotations

import importlib
import itertools
import logging
import sys
import warnings
from typing import Any, List

from advantage_client import channel
from advantage_client.verl import _client_for

# torch is imported where it is used: every advantage_client module imports without it (tests/test_client_only.py)

__all__ = ["ESTIMATORS", "install", "uninstall", "installed", "compute_advantages_and_returns", "main",
           "with_setup_hook"]

logger = logging.getLogger(__name__)

#: OpenRLHF 0.11.2 ``--algo.advantage.estimator`` -> (service estimator, fixed config)
ESTIMATORS: dict[str, tuple[str, dict[str, Any]]] = {
    "gae": ("gae", {"semantics": "openrlhf"}),
    "reinforce": ("reinforce_plus_plus", {"semantics": "openrlhf"}),
    "rloo": ("rloo", {"semantics": "openrlhf"}),
    "reinforce_baseline": ("reinforce_plus_plus_baseline", {"semantics": "openrlhf"}),
    "group_norm": ("grpo", {"semantics": "openrlhf", "normalize_rewards": True}),
    "dr_grpo": ("grpo", {"semantics": "openrlhf", "normalize_rewards": False}),
    "flash_reinforce": ("grpo", {"semantics": "openrlhf", "normalize_rewards": False}),
}
#: estimators OpenRLHF whitens over the batch (``--algo.advantage.no_std_norm`` applies to them)
WHITENED = ("gae", "reinforce", "reinforce_baseline")
#: the clip range sent for OpenRLHF's ``--reward.clip_range`` unset (no clamp): finite, as config values must be
_OPEN_CLAMP = 1e300
_original: Any = None
_target: Any = None


def _experience_maker_class() -> Any:
    return importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker").RemoteExperienceMaker


#: the module OpenRLHF 0.11.2's users run (``python -m openrlhf.cli.train_ppo_ray ...``), and Ray's worker setup hook
#: that installs this drop-in in every worker of the job (the PPOTrainer actor's included)
OPENRLHF_CLI = "openrlhf.cli.train_ppo_ray"
SETUP_HOOK = "advantage_client.openrlhf.install"
#: this process's environment variables a worker's client reads, forwarded to the workers
FORWARDED_ENV = channel.FORWARDED_ENV
_job_runtime_env = channel.ray_job_runtime_env


def with_setup_hook(runtime_env: dict | None, job: dict | None = None) -> dict:
    """``runtime_env`` (a Ray runtime environment; None: empty) with :data:`SETUP_HOOK` as its
    ``worker_process_setup_hook`` and this process's :data:`FORWARDED_ENV` variables added to its ``env_vars``
    (the ones it already sets, OpenRLHF's ``TOKENIZERS_PARALLELISM``, ``NCCL_DEBUG`` and
    ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` among them, kept). ``job``: the runtime environment of the Ray job
    (``ray job submit --runtime-env-json``); Ray refuses a ``ray.init`` that repeats any of its keys or variable
    names, so what the job already gives (the hook, a variable) is not added again. Raises ``ValueError`` when either
    names another setup hook (Ray runs one per job: call :func:`install` from yours)."""
    env, job = dict(runtime_env or {}), dict(job or {})
    for hook in (env.get("worker_process_setup_hook"), job.get("worker_process_setup_hook")):
        if hook not in (None, SETUP_HOOK):
            raise ValueError(f"the runtime environment already has worker_process_setup_hook={hook!r}; Ray runs one "
                             "per job: call advantage_client.openrlhf.install() from it instead")
    if "worker_process_setup_hook" not in job:
        env["worker_process_setup_hook"] = SETUP_HOOK
    return channel.forward_to_ray_workers(env, job)


def main(argv: list[str] | None = None) -> None:
    """``python -m advantage_client.openrlhf <train_ppo_ray's arguments>``: OpenRLHF's own CLI module
    (:data:`OPENRLHF_CLI`), unchanged, with its arguments; its ``ray.init`` is given :func:`with_setup_hook`'s
    runtime environment, so Ray installs this drop-in in every worker (the PPOTrainer actor's experience maker
    included) and hands them ``$ADVANTAGE_SERVICE_TARGET`` (and the TLS/token variables), and OpenRLHF's own
    environment variables stay. The one change to an OpenRLHF launch: ``python -m openrlhf.cli.train_ppo_ray ...``
    becomes ``python -m advantage_client.openrlhf ...`` (also as a ``ray job submit`` entrypoint). Raises what
    OpenRLHF raises; ``ValueError`` from :func:`with_setup_hook`."""
    import runpy

    import ray

    original = ray.init

    def init(*args: Any, **kwargs: Any) -> Any:
        kwargs["runtime_env"] = with_setup_hook(kwargs.get("runtime_env"), _job_runtime_env())
        return original(*args, **kwargs)

    ray.init = init
    sys.argv = [OPENRLHF_CLI, *(sys.argv[1:] if argv is None else argv)]
    try:
        runpy.run_module(OPENRLHF_CLI, run_name="__main__", alter_sys=True)
    finally:
        ray.init = original


def _in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor's or a task's process), read without importing Ray."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return ray._private.worker.global_worker.mode == ray.WORKER_MODE
    except Exception:  # noqa: BLE001 - another Ray: no claim
        return False


#: the warning of an install() that cannot reach OpenRLHF's experience maker
NOT_IN_WORKER = ("advantage_client.openrlhf.install() patched RemoteExperienceMaker in this process only, which is not "
                 "a Ray worker: OpenRLHF 0.11.2's train_ppo_ray builds the experience maker inside its PPOTrainer Ray "
                 "actor, where this has no effect. Give it to Ray as the workers' setup hook instead: "
                 "ray.init(runtime_env={'worker_process_setup_hook': 'advantage_client.openrlhf.install', 'env_vars': "
                 "{'ADVANTAGE_SERVICE_TARGET': ...}}), or ray job submit --runtime-env-json with the same keys "
                 "(docs/frameworks.md)")


def install(target: Any = None, maker_class: Any = None) -> None:
    """Make ``RemoteExperienceMaker.compute_advantages_and_returns`` (of ``maker_class``, default the installed
    OpenRLHF's) compute through the service at ``target`` (see the module docstring). Idempotent. Called for the
    installed OpenRLHF in a process that is not a Ray worker (a driver script), it warns (``RuntimeWarning``,
    :data:`NOT_IN_WORKER`): OpenRLHF runs the maker in a Ray actor, which only the setup hook reaches."""
    global _original, _target
    if maker_class is None and not _in_ray_worker():
        warnings.warn(NOT_IN_WORKER, RuntimeWarning, stacklevel=2)
    cls = maker_class if maker_class is not None else _experience_maker_class()
    current = cls.__dict__["compute_advantages_and_returns"]
    if not getattr(current, "advantage_service", False):
        _original = (cls, current)
    _target = target

    def remote_compute_advantages_and_returns(self, experiences):
        return compute_advantages_and_returns(self, experiences, target=_target)

    remote_compute_advantages_and_returns.advantage_service = True  # type: ignore[attr-defined]
    remote_compute_advantages_and_returns.__doc__ = compute_advantages_and_returns.__doc__
    cls.compute_advantages_and_returns = remote_compute_advantages_and_returns


def uninstall() -> None:
    """Put OpenRLHF's own method back (no-op where :func:`install` was not called)."""
    global _original
    if _original is not None:
        cls, original = _original
        cls.compute_advantages_and_returns = original
        _original = None


def installed(maker_class: Any = None) -> bool:
    """Whether the class's method is this drop-in's."""
    cls = maker_class if maker_class is not None else _experience_maker_class()
    return bool(getattr(cls.__dict__.get("compute_advantages_and_returns"), "advantage_service", False))


def _pad(t: Any, width: int, dtype: Any) -> Any:
    import torch
    t = t.to(dtype)
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t


def compute_advantages_and_returns(maker: Any, experiences: List[Any], target: Any = None) -> List[Any]:
    """OpenRLHF 0.11.2 ``RemoteExperienceMaker.compute_advantages_and_returns(experiences)`` through the service.

    maker: the ``RemoteExperienceMaker`` (its ``strategy.args``, ``advantage_estimator`` and ``kl_ctl`` are read);
    experiences: OpenRLHF ``Experience`` micro-batches (module docstring: ``rewards`` ``[B_i]``, ``action_mask``,
    ``kl``, ``values`` ``[B_i, A_i]``, ``index``). Writes the fields OpenRLHF writes, in its dtypes, and returns the
    same list. Raises ``ValueError`` / ``TypeError`` as the module docstring says, and the client's errors.
    """
    import torch
    with torch.no_grad():  # as OpenRLHF's @torch.no_grad()
        return _compute(maker, experiences, target)


def _compute(maker: Any, experiences: List[Any], target: Any) -> List[Any]:
    import torch
    from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties

    args = maker.strategy.args
    estimator = args.algo.advantage.estimator
    if estimator not in ESTIMATORS or maker.advantage_estimator not in ESTIMATORS:
        raise ValueError(f"Unkown advantage_estimator {estimator}: OpenRLHF 0.11.2's are {', '.join(ESTIMATORS)}")
    for experience in experiences:
        experience.rewards = experience.rewards.to(torch.promote_types(experience.rewards.dtype, torch.float32))
    apply_length_penalties(experiences, args)

    n = args.rollout.n_samples_per_prompt
    exp_len = [len(e.index) for e in experiences]
    order = list(itertools.chain.from_iterable(e.index for e in experiences))
    indices = torch.tensor(order)
    raw = torch.cat([e.rewards for e in experiences], dim=0)
    if n > 1:  # logging, as OpenRLHF
        by_prompt = torch.empty_like(raw)
        by_prompt[indices] = raw
        stds = by_prompt.reshape(-1, n).std(-1, keepdim=True).repeat(1, n).reshape(-1)[indices].split(exp_len)
        for experience, s in zip(experiences, stds):
            experience.info["group_reward_std"] = s
    if estimator not in ("gae", "reinforce") and args.algo.advantage.gamma != 1.0:
        logger.warning(f"gamma is set to 1.0 for {estimator}")
        args.algo.advantage.gamma = 1.0
    gamma = float(args.algo.advantage.gamma)
    clip = args.reward.clip_range  # OpenRLHF clamps only when it is set
    low, high = (float(clip[0]), float(clip[1])) if clip else (-_OPEN_CLAMP, _OPEN_CLAMP)

    width = max(e.action_mask.shape[1] for e in experiences)
    mask = torch.cat([_pad(e.action_mask, width, torch.int64) for e in experiences])
    kl_dtypes = [e.kl.dtype if e.kl is not None else e.rewards.dtype for e in experiences]
    kl = torch.cat([_pad(e.kl if e.kl is not None else torch.zeros(e.action_mask.shape, dtype=e.rewards.dtype),
                         width, torch.float64) for e in experiences])
    coef = float(maker.kl_ctl.value)
    coef = coef if coef > 0.0 else 0.0
    use_kl = coef > 0.0 and bool(kl.any())
    rewards = raw.to(torch.float64)

    service, fixed = ESTIMATORS[estimator]
    cfg: dict[str, Any] = dict(fixed, reward_clip_min=low, reward_clip_max=high)
    tensors: dict[str, Any] = {"rewards": rewards, "mask": mask}
    if estimator in WHITENED:
        cfg["no_std_norm"] = bool(args.algo.advantage.no_std_norm)
    if estimator == "reinforce":
        cfg["gamma"] = gamma
    if estimator == "gae":
        if any(e.values is None for e in experiences):
            raise TypeError("gae needs each experience's `values` [B, A] (OpenRLHF's critic)")
        tensors["values"] = torch.cat([_pad(e.values, width, torch.float64) for e in experiences])
        cfg.update(gae_gamma=gamma, gae_lambda=float(args.algo.advantage.lambd))
    elif estimator == "flash_reinforce":  # FlashREINFORCE: the whole rollout batch is one group
        tensors["prompt_ids"] = torch.zeros(len(order), dtype=torch.int64).numpy()
    elif estimator != "reinforce":
        tensors["prompt_ids"] = (indices // n).numpy()
    if use_kl:  # the experience's per-token KL as a k1 pair, its clamps opened (module docstring)
        cfg.update(use_kl_in_reward=True, reference_policy_kl_penalty=coef, reference_policy_kl_type="k1",
                   kl_input_clamp_value=_OPEN_CLAMP, kl_output_clamp_value=_OPEN_CLAMP)
        tensors.update(logprobs=kl, reference_logprobs=torch.zeros_like(kl))
    out = _client_for(target).compute(service, cfg, output_dtype="float64", **tensors)
    advantages = torch.as_tensor(out.advantages, dtype=torch.float64)
    returns = torch.as_tensor(out.returns, dtype=torch.float64)

    # info["return"]: the row's shaped token rewards summed over every position (OpenRLHF's reward.sum(-1))
    valid = mask.bool()
    kl_all = coef * kl.sum(-1)
    if estimator in ("gae", "reinforce"):
        total = rewards.clamp(low, high) - kl_all  # a logging field: OpenRLHF's reward.sum(-1)
    else:
        first = valid.int().argmax(1)
        at_first = returns.gather(1, first[:, None])[:, 0]
        kl_masked_out = coef * (kl * (~valid)).sum(-1)
        total = torch.where(valid.any(1), at_first - kl_masked_out, torch.full_like(at_first, float("nan")))

    start = 0
    for experience, size, kl_dtype in zip(experiences, exp_len, kl_dtypes):
        rows = slice(start, start + size)
        start += size
        a_i = experience.action_mask.shape[1]
        ret_dtype = kl_dtype if estimator != "gae" else torch.promote_types(kl_dtype, experience.values.dtype)
        experience.returns = returns[rows, :a_i].to(ret_dtype)
        experience.advantages = advantages[rows, :a_i].to(ret_dtype)
        experience.info["return"] = total[rows].to(kl_dtype)
        experience.kl = None
    return experiences


if __name__ == "__main__":  # python -m advantage_client.openrlhf <train_ppo_ray's arguments>
    main()
