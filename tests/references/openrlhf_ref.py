"""The released OpenRLHF's advantage code, run in-process as a test oracle (test-only; the service never
imports this module or openrlhf).

What is called: ``RemoteExperienceMaker.compute_advantages_and_returns`` of the installed
``openrlhf/trainer/ppo_utils/experience_maker.py`` (``tests/references/requirements.txt`` pins the
release, installed ``--no-deps``), unchanged, on a real ``RemoteExperienceMaker`` built with
``object.__new__`` (its ``__init__`` only stores Ray actor groups, a strategy and a tokenizer, none of
which the method reads) and the attributes the method does read: ``strategy.args`` (a namespace holding
exactly the ``--algo.*``, ``--rollout.n_samples_per_prompt`` and ``--reward.*`` options it reads, at
OpenRLHF's CLI defaults unless a test sets them), ``advantage_estimator`` and ``kl_ctl`` (OpenRLHF's own
``FixedKLController``). That method runs, all as released: ``apply_length_penalties`` (off at the
defaults), the group baselines of ``rloo`` / ``reinforce_baseline`` / ``group_norm`` / ``dr_grpo``,
``openrlhf.models.utils.compute_reward`` (reward clip to ``--reward.clip_range``, KL penalty, reward on
the last action token), ``get_cumulative_returns`` and the batch whitening of ``reinforce`` /
``reinforce_baseline``. Its input is a list of real ``Experience`` micro-batches whose ``index`` says
where each sample sits in the rollout (so interleaved orders are OpenRLHF's own dynamic-batching
reorder); the per-token ``kl`` is OpenRLHF's ``compute_approx_kl`` of the given log-probs, as
``make_experience`` computes it, or zeros of the log-probs' dtype when no KL is used (as released).

What is stubbed, only while openrlhf is imported (the previous ``sys.modules`` entries are restored
afterwards, so other harnesses' stubs are untouched); see :data:`STUBS`:
    * ``ray`` (``experience_maker`` imports it for ``ray.get``/``ray.put`` in ``make_experience``, which is
      not called), ``deepspeed`` (``openrlhf.models.utils`` imports it for ZeRO-3 leaf modules),
      ``transformers`` (``openrlhf.utils.utils`` imports ``AutoTokenizer`` for ``get_tokenizer``);
    * ``openrlhf.trainer.ray.launcher``: the Ray actor-group launcher (``RayActorGroup`` is only a type
      annotation of ``__init__``), whose import chain is vLLM, DeepSpeed and the model classes.
A stub class cannot be instantiated and a stub function raises, so a stub reached by an advantage
computation fails the test instead of changing a number.
Package shells: ``openrlhf.models`` and ``openrlhf.utils`` are entered without running their
``__init__.py`` (which re-export the actor/critic models, peft/flash-attn, sympy and pylatexenc grading
code); their submodules that the advantage path imports (``openrlhf.models.utils``,
``openrlhf.utils.utils``, ``openrlhf.utils.logging_utils``, ``openrlhf.utils.seqlen_balancing``) are the
released files.

``precise=True``: the same released code on the float64-promoted inputs with every ``Tensor.float()``
call that the advantage path makes (the batch whitening's ``.float()``, ``compute_approx_kl``'s
``.float()``) leaving float64 tensors in float64, and torch's default dtype float64 during the call
(``get_cumulative_returns`` starts from ``torch.zeros(B)``), so the whole computation is float64: "the
reference run in float64" of the differential tests' float32 rule. Nothing else changes.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pathlib
import sys
import types
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import torch

from references.stubs import restore_modules

__all__ = ["STUBS", "ESTIMATORS", "load", "version", "compute", "approx_kl"]

#: every ``--algo.advantage.estimator`` value of OpenRLHF 0.11.2's CLI that computes from rewards alone
ESTIMATORS = ("reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce")


class StubUsed(RuntimeError):
    """A stub stood in for code that was actually run: the harness is not honest for this call."""


def _stub_class(module: str, name: str) -> type:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StubUsed(f"{module}.{name} is a stub in tests/references/openrlhf_ref.py")

    return type(name, (), {"__init__": __init__, "__module__": module})


def _stub_function(module: str, name: str):
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise StubUsed(f"{module}.{name} is a stub in tests/references/openrlhf_ref.py")

    stub.__name__ = name
    return stub


#: module -> {attribute: "class" | "function"}: the stubbed modules and the only names openrlhf's import
#: chain (for the advantage path) reads from them.
STUBS: dict[str, dict[str, str]] = {
    "ray": {"get": "function", "put": "function"},
    "deepspeed": {},
    "transformers": {"AutoTokenizer": "class"},
    "openrlhf.trainer.ray.launcher": {"RayActorGroup": "class"},
}
#: openrlhf packages entered without running their ``__init__.py`` (see the module docstring)
SHELLS = ("openrlhf.models", "openrlhf.utils")

_module: types.ModuleType | None = None


def _build_stub(name: str, attrs: dict[str, str]) -> types.ModuleType:
    module = types.ModuleType(name, f"stub of {name} (tests/references/openrlhf_ref.py): not advantage code")
    module.__path__ = []
    module.__stub__ = True  # type: ignore[attr-defined]
    for attr, kind in attrs.items():
        setattr(module, attr, _stub_class(name, attr) if kind == "class" else _stub_function(name, attr))

    def __getattr__(attr: str) -> Any:
        raise AttributeError(f"{name}.{attr}: not in tests/references/openrlhf_ref.py STUBS")

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def load() -> types.ModuleType:
    """``openrlhf.trainer.ppo_utils.experience_maker`` of the installed release, imported once."""
    global _module
    if _module is not None:
        return _module
    saved = {name: sys.modules.get(name) for name in STUBS}
    try:
        for name, attrs in STUBS.items():
            if name.startswith("openrlhf.") or not _importable(name):
                sys.modules[name] = _build_stub(name, attrs)
        root = pathlib.Path(importlib.util.find_spec("openrlhf").origin).parent
        importlib.import_module("openrlhf")
        for shell in SHELLS:
            if shell not in sys.modules:
                pkg = types.ModuleType(shell, f"{shell} entered without its __init__ (openrlhf_ref.py)")
                pkg.__path__ = [str(root / shell.split(".", 1)[1])]
                sys.modules[shell] = pkg
        _module = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
    finally:
        restore_modules(saved)
    return _module


def version() -> str:
    """The installed openrlhf's version (from its distribution metadata)."""
    import importlib.metadata
    return importlib.metadata.version("openrlhf")


@contextlib.contextmanager
def _float64_kept() -> Iterator[None]:
    """``Tensor.float()`` leaves a float64 tensor as it is (see ``precise``)."""
    had = "float" in torch.Tensor.__dict__
    original = torch.Tensor.float

    def float_(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = float_  # type: ignore[method-assign]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(default)
        if had:
            torch.Tensor.float = original  # type: ignore[method-assign]
        else:
            del torch.Tensor.float


def approx_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kl_estimator: str,
              precise: bool = False) -> torch.Tensor:
    """OpenRLHF's ``compute_approx_kl(log_probs, log_probs_base, kl_estimator=...)`` ``[B, T]`` (float32
    as released; float64 with ``precise``), what ``make_experience`` stores as ``experience.kl``."""
    load()
    utils = sys.modules["openrlhf.models.utils"]
    ctx = _float64_kept() if precise else contextlib.nullcontext()
    with ctx:
        return utils.compute_approx_kl(logprobs, reference_logprobs, kl_estimator=kl_estimator)


def compute(estimator: str, rewards: torch.Tensor, mask: torch.Tensor, n_samples_per_prompt: int,
            index: Sequence[int], micro_batches: Sequence[int], *, kl: torch.Tensor | None = None,
            kl_coef: float = 0.0, gamma: float = 1.0, clip_range: tuple[float, float] | None = (-10.0, 10.0),
            no_std_norm: bool = False, values: torch.Tensor | None = None, lambd: float = 1.0,
            precise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[B, T]`` from the released ``compute_advantages_and_returns``.

    rewards: ``[B]`` one reward per sample, in the order the experiences hold them; mask ``[B, T]``
    (the action mask, 0/1); ``index[i]``: sample i's position in the rollout, whose contiguous blocks of
    ``n_samples_per_prompt`` are OpenRLHF's prompt groups (a permutation of ``range(B)``);
    ``micro_batches``: sizes of the consecutive ``Experience`` micro-batches (summing to B);
    kl: the per-token ``experience.kl`` ``[B, T]`` (None: zeros of ``rewards``' dtype, OpenRLHF without a
    reference model); ``kl_coef``: ``--algo.kl.init_kl_coef`` (FixedKLController); gamma, clip_range,
    no_std_norm: ``--algo.advantage.gamma``, ``--reward.clip_range``, ``--algo.advantage.no_std_norm``;
    values: the critic's ``experience.values`` ``[B, T]`` (``gae``), lambd: ``--algo.advantage.lambd``.
    Returns (advantages, returns), each ``[B, T]`` in experience order, in the dtype OpenRLHF leaves
    them in (float64 throughout with ``precise``). Raises what the released code raises.
    """
    em = load()
    ppo_utils = sys.modules["openrlhf.trainer.ppo_utils"]
    B, T = mask.shape
    if precise:
        rewards = rewards.to(torch.float64)
        kl = kl.to(torch.float64) if kl is not None else None
        values = values.to(torch.float64) if values is not None else None
    if kl is None:
        kl = torch.zeros(B, T, dtype=rewards.dtype)
    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=gamma, lambd=lambd,
                                                       no_std_norm=no_std_norm)),
        rollout=SimpleNamespace(n_samples_per_prompt=n_samples_per_prompt),
        reward=SimpleNamespace(clip_range=clip_range, overlong_buffer_len=None, overlong_penalty_factor=1.0,
                               stop_properly_penalty_coef=None),
    )
    maker = object.__new__(em.RemoteExperienceMaker)
    maker.strategy = SimpleNamespace(args=args)
    maker.args = args
    maker.advantage_estimator = estimator
    maker.kl_ctl = ppo_utils.FixedKLController(kl_coef)
    experiences, start = [], 0
    for size in micro_batches:
        rows = slice(start, start + size)
        experiences.append(ppo_utils.Experience(
            rewards=rewards[rows].clone(), action_mask=mask[rows].bool(), kl=kl[rows].clone(),
            values=None if values is None else values[rows].clone(), index=list(index[rows]), info={}))
        start += size
    ctx = _float64_kept() if precise else contextlib.nullcontext()
    with ctx:
        out = maker.compute_advantages_and_returns(experiences)
    return torch.cat([e.advantages for e in out]), torch.cat([e.returns for e in out])
