"""advantage_server: the estimators, the transport-agnostic core, the gRPC servicer and the CLI."""
from advantage_server import tuning

# opt-in malloc settings (ADVANTAGE_MALLOC_TUNING=1; see advantage_server.tuning), applied before anything
# is allocated
tuning.apply()

from advantage_server.core import AdvantageCore  # noqa: E402
from advantage_server.server import create_server  # noqa: E402

__all__ = ["AdvantageCore", "create_server"]
