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
