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


def count_rules(label: str, rules: dict[str, int], at_least: int) -> None:
    """Record one differential test's outcome: ``rules`` maps the rule that settled each batch (``"agree"``, or
    a documented difference) to its count; every batch counts under ``label`` and each documented difference
    also under ``"<label> (<rule>)"``. Fails when fewer than ``at_least`` batches were tried."""
    total = sum(rules.values())
    TRIED[label] += total
    for rule, n in sorted(rules.items()):
        if rule != "agree":
            TRIED[f"{label} ({rule})"] += n
    assert total >= at_least, f"{label}: only {total} batches tried"
