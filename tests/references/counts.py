"""How many differential batches each test tried, for the terminal summary (tests/conftest.py).

``TRIED[name] += 1`` once per generated batch that a differential test (``tests/test_diff_*.py``)
computed with both the released reference and the service; ``name`` is ``"<reference>/<estimator>"``
(e.g. ``"openrlhf/group_norm"``). ``pytest_terminal_summary`` prints one
``differential batches tried: <name>: <n>`` line per entry, so CI output shows the counts.
"""
from __future__ import annotations

from collections import Counter

#: "<reference>/<estimator or mode>" -> number of batches compared
TRIED: dict[str, int] = Counter()
