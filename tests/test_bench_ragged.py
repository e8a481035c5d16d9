"""The ragged-batch bench (issue #38, ``python -m advantage_server.bench.ragged``): a slime-shaped batch (mean ~1k
tokens, one row of 16k) is sent packed in the bytes its tokens need, plus a few hundred bytes of headers, where
padding it to ``[B, max(T)]`` would cost more than ten times as much."""
from __future__ import annotations

import numpy as np
import pytest

from advantage_server.bench import ragged


def test_slime_lengths_are_slime_shaped():
    lengths = ragged.slime_lengths(256)
    assert lengths.max() == 16384 and lengths.min() >= 1
    assert 800 <= lengths.mean() <= 1300


@pytest.mark.parametrize("name", sorted(ragged.REQUESTS))
def test_packed_costs_its_tokens_and_padding_costs_more_than_ten_times(name):
    lengths = ragged.slime_lengths(64)
    need, packed = ragged.needed_bytes(name, lengths), ragged.request_bytes(name, lengths, packed=True)
    assert need <= packed <= need + 512, (need, packed)  # headers and field tags only
    assert ragged.request_bytes(name, lengths, packed=False) > 10 * packed


def test_main_prints_a_row_per_request_and_size(capsys):
    rows = ragged.main(["--rows", "8"])
    assert [r["request"] for r in rows] == list(ragged.REQUESTS)
    assert all(r["N"] == int(ragged.slime_lengths(8).sum()) for r in rows)
    out = capsys.readouterr().out
    assert "packed / needed" in out and out.count("\n") == 1 + len(ragged.REQUESTS)
    assert np.all([r["packed"] < r["padded"] for r in rows])
