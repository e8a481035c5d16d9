"""Hypothesis strategies the differential tests share (test-only)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

#: the reward shapes a group of completions can take: 0/1, all tied, small integers, real, large, near-tied
REWARD_KINDS = ("binary", "tied", "integer", "real", "large", "near_tie")


@st.composite
def rewards(draw, B: int, dtype: torch.dtype) -> list[float]:
    """``B`` rewards of one kind (:data:`REWARD_KINDS`), as ``dtype`` holds them: binary 0/1; one tied value
    in [-5, 5]; integers in [-3, 3]; reals in [-1e4, 1e4]; within 2e-6 of a base in [-100, 100]; reals in [-3, 3]
    (TRL's GRPO and RLOO differential tests)."""
    kind = draw(st.sampled_from(REWARD_KINDS))
    if kind == "binary":
        r = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=B, max_size=B))
    elif kind == "tied":
        r = [draw(st.floats(-5, 5, allow_nan=False, width=32))] * B
    elif kind == "integer":
        r = draw(st.lists(st.integers(-3, 3).map(float), min_size=B, max_size=B))
    elif kind == "large":
        r = draw(st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=B, max_size=B))
    elif kind == "near_tie":
        base = draw(st.floats(-100, 100, allow_nan=False))
        r = [base + k * 1e-6 for k in draw(st.lists(st.integers(-2, 2), min_size=B, max_size=B))]
    else:
        r = draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=B, max_size=B))
    return [float(torch.tensor(x, dtype=dtype)) for x in r]
