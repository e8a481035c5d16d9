"""The released verl's advantage code, imported in-process as a test oracle (test-only; the service never
imports this module or verl).

``load()`` returns ``verl.trainer.ppo.core_algos`` of the installed ``verl`` (``tests/references/
requirements.txt`` pins it, ``pip install --no-deps``), with everything that module's import chain runs
being verl's own code, except the third-party modules listed in :data:`STUBS`.

What is real:
    * every ``verl`` module: ``verl/__init__.py``, ``verl.protocol``, ``verl.utils.torch_functional``
      (``masked_mean``, ``masked_var``, ``masked_whiten``), ``verl.utils.groupwise`` (``as_torch_index``,
      ``group_mean_std``), ``verl.trainer.config`` (``AlgoConfig``), ``verl.workers.config`` ... and
      ``core_algos`` itself, byte for byte as released;
    * torch, numpy, packaging (the service's own dependencies), and the small pure-Python packages pinned
      below verl in ``requirements.txt``: ``omegaconf`` (``DictConfig``, which ``core_algos`` and verl's
      configs use) and ``codetiming`` (imported by verl's utilities). ``omegaconf`` reads YAML with PyYAML,
      which the test extra already installs (through kubernetes-validate).

What is stubbed (a ``sys.modules`` entry holding only the names verl's import chain reads, none of which
takes part in an advantage): see :data:`STUBS`. In short:
    * ``ray``: the distributed runtime (``verl.protocol`` imports it; advantage code never calls it);
    * ``tensordict``: the batch container behind ``DataProto`` (type annotations and isinstance checks
      only; the advantage functions receive plain tensors);
    * ``transformers``: model/tokenizer/config classes used as type annotations and as the base of one
      output dataclass (``verl.utils.model.CausalLMOutputForPPO``).
A stub class cannot be instantiated and a stub function raises when called, so a stub that an
advantage computation reached would fail the test loudly rather than change a number. Optional imports
that verl guards with ``try/except ImportError`` (``flash_attn``, ``torch_npu``, ``transfer_queue``) are
left missing, so verl takes its own fallback. Plugin discovery is off (``VERL_USE_EXTERNAL_PLUGINS=none``)
so that whatever else is installed cannot change what is imported.

Nothing else is patched: no verl function is replaced; the stubs are in ``sys.modules`` only while verl
is imported (the previous entries, e.g. another harness's stubs, are restored afterwards), and only for
modules that are not really installed (with the real ``ray`` or ``transformers`` installed, verl gets
those).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Any, Callable

from references.stubs import import_with_stubs

__all__ = ["STUBS", "load", "registry", "version", "stubbed"]


class StubUsed(RuntimeError):
    """A stub stood in for code that was actually run: the harness is not honest for this call."""


def _stub_class(module: str, name: str, *, dataclass: bool = False) -> type:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StubUsed(f"{module}.{name} is a stub in tests/references/verl_ref.py and cannot be built")

    cls = type(name, (), {"__init__": __init__, "__module__": module, "__qualname__": name})
    return dataclasses.dataclass(cls) if dataclass else cls


def _stub_function(module: str, name: str) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise StubUsed(f"{module}.{name} is a stub in tests/references/verl_ref.py and cannot be called")

    stub.__name__ = stub.__qualname__ = name
    stub.__module__ = module
    return stub


#: module -> {attribute: kind}: the stubbed third-party modules and the only names verl's import chain
#: reads from them ("class", "dataclass" (a class a verl dataclass derives from), "function", or a value).
STUBS: dict[str, dict[str, Any]] = {
    "ray": {"ObjectRef": "class"},
    "tensordict": {"__version__": "0.10.0", "TensorDict": "class"},
    "tensordict.tensorclass": {"NonTensorData": "class", "NonTensorStack": "class"},
    "transformers": {name: "class" for name in (
        "PreTrainedTokenizer", "PretrainedConfig", "PreTrainedModel", "GenerationConfig", "AutoConfig", "AutoModel",
        "AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
        "MistralForSequenceClassification", "AutoModelForImageTextToText")},
    "transformers.modeling_outputs": {"CausalLMOutputWithPast": "dataclass"},
    "orjson": {"dumps": "function", "OPT_SERIALIZE_NUMPY": 16},
}


def _build_stub(name: str, attrs: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name, f"stub of {name} (tests/references/verl_ref.py): not advantage code")
    module.__path__ = []  # a package, so that listed submodules import
    module.__stub__ = True  # type: ignore[attr-defined]
    for attr, kind in attrs.items():
        if kind == "class":
            value: Any = _stub_class(name, attr)
        elif kind == "dataclass":
            value = _stub_class(name, attr, dataclass=True)
        elif kind == "function":
            value = _stub_function(name, attr)
        else:
            value = kind
        setattr(module, attr, value)

    def __getattr__(attr: str) -> Any:
        raise AttributeError(f"{name}.{attr}: not in tests/references/verl_ref.py STUBS (verl read it "
                             "while importing; add it there if it is not advantage code)")

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


_stubbed: list[str] = []
_module: types.ModuleType | None = None


def load() -> types.ModuleType:
    """``verl.trainer.ppo.core_algos`` of the installed verl, imported once.

    The stubs are in ``sys.modules`` only while verl is imported (the modules verl imported keep their
    reference to them); the previous entries are restored afterwards, so other harnesses (and a real
    module imported later) see ``sys.modules`` as it was. A top-level module that is really installed
    is not stubbed.
    """
    global _module
    if _module is not None:
        return _module
    if "verl.trainer.ppo.core_algos" in sys.modules:
        _module = sys.modules["verl.trainer.ppo.core_algos"]
        return _module
    os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    _module = import_with_stubs("verl.trainer.ppo.core_algos", STUBS, _build_stub, _stubbed)
    return _module


def stubbed() -> list[str]:
    """The top-level modules this harness stubbed (empty where the real ones are installed)."""
    load()
    return list(_stubbed)


def registry() -> dict[str, Callable[..., Any]]:
    """verl's advantage-estimator registry (``ADV_ESTIMATOR_REGISTRY``): name -> function."""
    return dict(load().ADV_ESTIMATOR_REGISTRY)


def version() -> str:
    """The installed verl's version (``verl.__version__``)."""
    load()
    return sys.modules["verl"].__version__
