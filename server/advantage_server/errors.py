"""Domain errors raised by the core; the servicer maps each class to one gRPC status code.

``InvalidInput``   -> INVALID_ARGUMENT (with one ``google.rpc.BadRequest`` field violation each)
``ResourceLimit``  -> RESOURCE_EXHAUSTED
``NotPermitted``   -> PERMISSION_DENIED
anything else      -> INTERNAL (a bug: logged with its traceback, never shown as UNKNOWN)
"""
from __future__ import annotations

from advantage_client.wire import WireError


class InvalidInput(ValueError):
    """The request is malformed. ``violations`` is a list of ``(field, description)`` pairs."""

    def __init__(self, field_or_violations: str | list[tuple[str, str]], description: str | None = None):
        if isinstance(field_or_violations, str):
            violations = [(field_or_violations, description or "")]
        else:
            violations = list(field_or_violations)
        self.violations = violations
        super().__init__("; ".join(f"{f}: {d}" for f, d in violations))

    @classmethod
    def from_wire(cls, err: WireError) -> "InvalidInput":
        return cls(err.field, err.description)


class ResourceLimit(RuntimeError):
    """The request exceeds a configured server limit (size, elements, concurrency)."""


class NotPermitted(PermissionError):
    """The caller may not do this (e.g. register a shared-memory segment it cannot prove it writes)."""
