"""The client's result type, :class:`AdvantageResult` (importable from ``advantage_client`` and, as before,
from ``advantage_client.client``); defined here so that the shared-memory transport returns it without
importing the client.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AdvantageResult:
    """What every estimator returns (NeMo RL's result type).

    advantages: ``[B, T]``; returns: ``[B, T]`` for GAE, else ``None``; metrics: OPD's three, else ``{}``.
    layout:     ``"dense"``, or for a per-sample result (``compute(..., per_sample=True)``) how the ``[B]``
                advantages/returns stand for the ``[B, T]`` ones: ``"broadcast"``, ``"broadcast_times_mask"``
                or ``"up_to_last_valid"`` (see ``advantage_client.layout``).
    """

    advantages: Any
    returns: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    layout: str = "dense"
