"""What the reference harnesses share about their import-time stubs."""
from __future__ import annotations

import sys
from types import ModuleType


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
