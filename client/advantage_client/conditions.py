"""The condition language of ``ListEstimators`` (``EstimatorInfo.per_sample`` layouts, ``group_local``), read
by the server's registry and by the clients, so the two sides evaluate the same text the same way.

A condition is ``""`` (always) or ``field = value`` terms joined by ``and``, clauses joined by ``or``, e.g.
``"semantics = nemo_rl and use_kl_in_reward = false"``. Values: ``true``/``false`` (bools), numbers (compared
as floats) and enum short names (strings).
"""
from __future__ import annotations

from typing import Any, Callable

#: what a lookup returns for a field whose value cannot be told: the term then does not hold
UNKNOWN: Any = object()


def value_of(text: str) -> Any:
    """A condition's value text as a Python value: ``True``/``False``, a float, else the text itself."""
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    try:
        return float(text)
    except ValueError:
        return text


def holds(when: str, lookup: Callable[[str], Any]) -> bool:
    """Whether condition ``when`` holds where ``lookup(field)`` gives each field's value (or :data:`UNKNOWN`).
    A bool never equals a number here (``true`` is not ``1``). ``lookup`` may raise for a field it lacks."""
    if not when:
        return True
    for clause in when.split(" or "):
        ok = True
        for term in clause.split(" and "):
            name, _, text = (x.strip() for x in term.partition("="))
            have, want = lookup(name), value_of(text)
            if have is UNKNOWN or isinstance(have, bool) != isinstance(want, bool) or have != want:
                ok = False
                break
        if ok:
            return True
    return False
