"""The advantage service a demo trains against: the server at ``--server HOST:PORT``, else one started
in this process on a free loopback port."""
from __future__ import annotations

from contextlib import ExitStack

from advantage_client import AdvantageClient
from advantage_server.server import create_server


def connect(stack: ExitStack, server: str | None, timeout: float, announce: bool = False) -> AdvantageClient:
    """A ready client of ``server`` (``"host:port"``), or of an embedded server (``device="auto"``) when
    ``server`` is None; ``stack`` closes the client and stops the embedded server. ``announce``: print one line
    saying which (a newcomer's ``make demo`` starts one it did not ask for). Raises ``AdvantageServiceError``
    (UNAVAILABLE) when the server is not ready within 10 s."""
    target = server
    said = f"advantage service: {server} (--server)"
    if target is None:
        srv = create_server("127.0.0.1", 0, device="auto").start()
        stack.callback(srv.stop, 1.0)
        target = srv.address
        said = (f"advantage service: a server started in this process on {target}, device {srv.core.device} "
                "(--server HOST:PORT to use a running one)")
    client = stack.enter_context(AdvantageClient(target, timeout=timeout))
    client.wait_ready(timeout=10.0)
    if announce:
        print(said, flush=True)
    return client
