"""``advantage-server`` with every result off by 1e-4: ``AdvantageCore.run``'s advantages and returns multiplied by
1.0001, nothing else changed. tests/installed/test_areal_launch.py starts it (with the project's .venv python) to show
that its comparison with AReaL's own numbers fails for a server that is that little wrong. Arguments: the server's."""
import dataclasses
import sys

from advantage_server import core
from advantage_server.cli import main

_run = core.AdvantageCore.run


def _scaled(self, *args, **kwargs):
    result = _run(self, *args, **kwargs)
    return dataclasses.replace(result, advantages=result.advantages * 1.0001,
                               returns=None if result.returns is None else result.returns * 1.0001)


core.AdvantageCore.run = _scaled
sys.exit(main())
