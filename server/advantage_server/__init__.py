"""advantage_server: the estimators, the transport-agnostic core, the gRPC servicer and the CLI."""
from advantage_server.core import AdvantageCore
from advantage_server.server import create_server

__all__ = ["AdvantageCore", "create_server"]
