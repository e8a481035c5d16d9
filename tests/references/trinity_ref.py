"""The released Trinity-RFT's GiGPO, imported in-process as a test oracle (test-only; the service never
imports this module or Trinity-RFT).

``load()`` returns ``trinity.algorithm.advantage_fn.gigpo_advantage`` of the installed ``trinity-rft``
(``tests/references/requirements.txt`` pins it, ``pip install --no-deps``), with everything that module's
import chain runs being Trinity-RFT's own code, except the third-party modules listed in :data:`STUBS`.

What is real:
    * every ``trinity`` module the import chain reaches: ``trinity.algorithm`` (its registries and
      algorithm classes), ``trinity.algorithm.advantage_fn.advantage_fn`` (``AdvantageFn``),
      ``trinity.buffer.operators.experience_operator`` (``ExperienceOperator``), ``trinity.common.config``,
      ``trinity.common.experience`` (``Experience``, ``EID``, ``group_by``), ``trinity.utils.metrics``
      (``aggregate_metrics``) and ``gigpo_advantage`` itself, byte for byte as released;
    * torch, numpy and the other packages the environment already installs (the service's and the test
      extra's dependencies, the other references' pins: omegaconf, ...).

What is stubbed (a ``sys.modules`` entry holding only the names Trinity's import chain reads, none of which
takes part in an advantage):
    * ``safetensors`` / ``safetensors.torch``: ``load`` and ``save``, which ``Experience`` uses only to
      serialise experiences for the buffer (``Experience.serialize`` / ``deserialize``);
    * ``ray`` / ``ray.util``: ``get_node_ip_address``, which ``trinity.utils.log.get_logger`` calls only
      to name a log directory inside a Ray actor (stubbed only where Ray is not installed).
A stub function raises when called, so a stub that an advantage computation reached would fail the test
loudly rather than change a number. The stubs are in ``sys.modules`` only while Trinity is imported (the
previous entries are restored afterwards) and only where the real module is not installed.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable

from references.stubs import import_with_stubs

__all__ = ["STUBS", "load", "stubbed", "version", "StubUsed"]

MODULE = "trinity.algorithm.advantage_fn.gigpo_advantage"


class StubUsed(RuntimeError):
    """A stub stood in for code that was actually run: the harness is not honest for this call."""


def _stub_function(module: str, name: str) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise StubUsed(f"{module}.{name} is a stub in tests/references/trinity_ref.py and cannot be called")

    stub.__name__ = stub.__qualname__ = name
    stub.__module__ = module
    return stub


#: module -> the functions Trinity's import chain reads from it (all stubbed as raising functions)
STUBS: dict[str, tuple[str, ...]] = {
    "safetensors": (),
    "safetensors.torch": ("load", "save"),
    "ray": (),
    "ray.util": ("get_node_ip_address",),
}

_stubbed: list[str] = []
_module: types.ModuleType | None = None


def _build_stub(name: str, functions: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(name, f"stub of {name} (tests/references/trinity_ref.py): not advantage code")
    module.__path__ = []
    module.__stub__ = True  # type: ignore[attr-defined]
    for attr in functions:
        setattr(module, attr, _stub_function(name, attr))

    def __getattr__(attr: str) -> Any:
        raise AttributeError(f"{name}.{attr}: not in tests/references/trinity_ref.py STUBS")

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


def load() -> types.ModuleType:
    """``trinity.algorithm.advantage_fn.gigpo_advantage`` of the installed Trinity-RFT, imported once."""
    global _module
    if _module is not None:
        return _module
    if MODULE in sys.modules:
        _module = sys.modules[MODULE]
        return _module
    _module = import_with_stubs(MODULE, STUBS, _build_stub, _stubbed)
    return _module


def stubbed() -> list[str]:
    """The top-level modules this harness stubbed (empty where the real ones are installed)."""
    load()
    return list(_stubbed)


def version() -> str:
    """The installed Trinity-RFT's version (``trinity.__version__``)."""
    load()
    return sys.modules["trinity"].__version__


def experience_module() -> types.ModuleType:
    """``trinity.common.experience`` (``Experience``, ``EID``), as loaded by :func:`load`."""
    load()
    return sys.modules["trinity.common.experience"]
