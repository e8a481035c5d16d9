"""The advantage service a demo trains against: the server at ``--server HOST:PORT``, else one started
in this process on a free loopback port."""
from __future__ import annotations

from contextlib import ExitStack

from advantage_client import AdvantageClient
from advantage_server.server import create_server


def connect(stack: ExitStack, server: str | None, timeout: float) -> AdvantageClient:
    """A ready client of ``server`` (``"host:port"``), or of an embedded server (``device="auto"``) when
    ``server`` is None; ``stack`` closes the client and stops the embedded server. Raises
    ``AdvantageServiceError`` (UNAVAILABLE) when the server is not ready within 10 s."""
    target = server
    if target is None:
        srv = create_server("127.0.0.1", 0, device="auto").start()
        stack.callback(srv.stop, 1.0)
        target = srv.address
    client = stack.enter_context(AdvantageClient(target, timeout=timeout))
    client.wait_ready(timeout=10.0)
    return client
