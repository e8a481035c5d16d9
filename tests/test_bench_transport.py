"""The benchmark's transport rows: the stream split and ``--big-mib`` (one streamed row with both peaks)."""
from __future__ import annotations

from advantage_server.bench import run


def test_big_mib_runs_one_stream_row_with_both_peaks(monkeypatch):
    monkeypatch.setattr(run, "HUGE_BYTES", 0)  # the path of a multi-GiB row, on 1 MiB
    report = run.main(["--sections", "e2e", "--estimators", "gae", "--big-mib", "1"])
    rows = [r for r in report.rows if r.section == "e2e"]
    assert [r.impl for r in rows] == ["grpc-stream"] and rows[0].size == "16x8192x8"
    note = rows[0].note
    assert "server peak +" in note and "client peak +" in note and "first call (cold processes" in note
    assert "stream split: up " in note and "MiB/s" in note
    assert rows[0].ms > 0


def test_big_mib_is_skipped_without_the_memory(monkeypatch):
    monkeypatch.setattr(run, "available_bytes", lambda: 1 << 20)
    report = run.main(["--sections", "e2e", "--estimators", "gae", "--big-mib", "64"])
    (row,) = [r for r in report.rows if r.section == "e2e"]
    assert row.note.startswith("skipped: needs about") and row.ms is None
