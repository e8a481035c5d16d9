"""advantage_server: the estimators, the transport-agnostic core, the gRPC servicer and the CLI.

``AdvantageCore`` and ``create_server`` are imported on first use (PEP 562 ``__getattr__``): importing the
package, or a light module of it (``advantage_server.cli`` to parse flags, ``advantage-healthcheck``), does not
import torch or numba.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from advantage_server import tuning

# opt-in malloc settings (ADVANTAGE_MALLOC_TUNING=1; see advantage_server.tuning), applied before anything
# is allocated: every module of the package, the heavy ones included, is imported after this line
tuning.apply()

if TYPE_CHECKING:  # pragma: no cover
    from advantage_server.core import AdvantageCore
    from advantage_server.server import create_server

__all__ = ["AdvantageCore", "create_server"]


def __getattr__(name: str) -> Any:
    """``advantage_server.AdvantageCore`` / ``advantage_server.create_server``, imported when first asked for."""
    if name == "AdvantageCore":
        from advantage_server.core import AdvantageCore as value
    elif name == "create_server":
        from advantage_server.server import create_server as value
    else:
        raise AttributeError(f"module 'advantage_server' has no attribute {name!r}")
    globals()[name] = value  # asked for once: a plain attribute from now on
    return value
