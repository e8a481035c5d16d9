"""advantage_server: the estimators, the transport-agnostic core, the gRPC servicer and the CLI."""
from advantage_server import tuning

# before torch allocates anything (it reads THP_MEM_ALLOC_ENABLE once): see advantage_server.tuning,
# ADVANTAGE_MEMORY_DEFAULTS=0 turns it off
tuning.apply()

from advantage_server.core import AdvantageCore  # noqa: E402
from advantage_server.server import create_server  # noqa: E402

__all__ = ["AdvantageCore", "create_server"]
