"""What the reference harnesses share about their import-time stubs."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable, Mapping


def restore_modules(saved: dict[str, ModuleType | None]) -> None:
    """Put ``sys.modules`` back as ``saved`` recorded it: a name that was absent (None) is removed again, any
    other is set back, so one harness's stubs never leak into another's import."""
    for name, old in saved.items():
        if old is None:
            current = sys.modules.get(name)
            if current is not None and getattr(current, "__file__", None):
                continue  # the real package was imported meanwhile (e.g. ray, when installed): keep it whole
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old


def really_installed(top: str) -> bool:
    """Whether the real top-level module ``top`` is installed (another harness's stub, which has no
    ``__file__``, does not count)."""
    module = sys.modules.get(top)
    if module is not None:
        return bool(getattr(module, "__file__", None))
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def import_with_stubs(target: str, stubs: Mapping[str, Any], build: Callable[[str, Any], ModuleType],
                      stubbed: list[str]) -> ModuleType:
    """Import the reference module ``target`` with each module ``name`` of ``stubs`` stood in by
    ``build(name, stubs[name])`` while it imports, unless its top-level package is really installed (and was
    not stubbed before by this harness: ``stubbed`` lists those, and collects the new ones). The stubs are in
    ``sys.modules`` only during the import (the modules the reference imported keep their references to
    them); :func:`restore_modules` puts the previous entries back afterwards."""
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        for name, spec in stubs.items():
            top = name.split(".")[0]
            if top not in stubbed and really_installed(top):
                continue  # the reference gets the real one
            stub = build(name, spec)
            sys.modules[name] = stub
            if "." in name:
                setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], stub)
            if top not in stubbed:
                stubbed.append(top)
        return importlib.import_module(target)
    finally:
        restore_modules(saved)


class StubUsed(RuntimeError):
    """A stub stood in for code that was actually run: the harness is not honest for this call."""


def raising(name: str, owner: str) -> Callable[..., Any]:
    """A stand-in function for ``name`` that raises :class:`StubUsed` when called (``owner``: the harness file)."""
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise StubUsed(f"{name} is a stub in {owner}")
    return stub


def cannot_build(name: str, owner: str) -> type:
    """A stand-in class for ``name`` (an annotation, a base class) whose construction raises :class:`StubUsed`."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise StubUsed(f"{name} is a stub in {owner}")
    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__})


def stub_module(name: str, attrs: Mapping[str, Any], owner: str) -> ModuleType:
    """A module ``name`` holding only ``attrs``; reading any other name raises AttributeError naming ``owner``."""
    module = ModuleType(name, f"stub of {name} ({owner}): not advantage code")
    module.__path__ = []
    module.__stub__ = True  # type: ignore[attr-defined]
    for attr, value in attrs.items():
        setattr(module, attr, value)

    def __getattr__(attr: str) -> Any:
        raise AttributeError(f"{name}.{attr}: not in the STUBS of {owner}")

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


def package_standin(name: str, root: Any, owner: str) -> ModuleType:
    """``name`` as a package whose submodules load from the installed files under ``root`` (the top-level
    package's directory), its ``__init__`` not run."""
    module = ModuleType(name, f"package stand-in ({owner}): {name}.__init__ not run")
    module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
    module.__package__ = name
    return module


def import_released(target: str, root: Any, packages: tuple[str, ...], stubs: Mapping[str, Mapping[str, Any]],
                    optional: tuple[str, ...], stubbed: list[str], owner: str,
                    prepare: Callable[[], None] | None = None) -> ModuleType:
    """Import ``target`` from an installed release with only its package stand-ins and ``stubs`` in place.

    Every module under the top-level names involved is taken out of ``sys.modules`` for the import: each of
    ``packages`` becomes a :func:`package_standin` over ``root``, each of ``stubs`` a :func:`stub_module` (those
    under ``optional`` top-level names only where the real package is not installed; the stubbed names are
    added to ``stubbed``), ``prepare()`` runs, then ``target`` is imported. Afterwards ``sys.modules`` is put
    back as it was (the imported modules keep their references to the stand-ins)."""
    tops = {name.split(".")[0] for name in (*packages, *stubs)}
    saved = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] in tops}

    def install(name: str, module: ModuleType) -> None:
        sys.modules[name] = module
        if "." in name:
            setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], module)

    try:
        for name in saved:
            del sys.modules[name]
        for name in packages:
            install(name, package_standin(name, root, owner))
        for name, attrs in stubs.items():
            if name.split(".")[0] in optional and really_installed(name.split(".")[0]):
                continue  # the real one is imported
            install(name, stub_module(name, attrs, owner))
            if name not in stubbed:
                stubbed.append(name)
        if prepare is not None:
            prepare()
        return importlib.import_module(target)
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in tops]:
            del sys.modules[name]
        sys.modules.update(saved)
