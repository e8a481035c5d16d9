"""Smoke test of ``advantage-bench --sections groups`` (per-group traffic) on tiny sizes: every row it promises
is there with its columns, the service's answers equal the in-process estimator's, and the bytes per call are
the server's counts (compact requests and per-sample answers smaller than the dense ones). No timing
assertions: the figures belong in BENCHMARKS.md."""
from __future__ import annotations

import json
import subprocess
import sys


def test_groups_section_runs_and_prints_its_columns(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "advantage_server.bench", "--sections", "groups", "--group-tokens", "32",
           "--group-callers", "1,3", "--group-seconds", "0.02", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    for column in ("implementation", "compact", "callers", "p50 ms", "p99 ms", "calls/s", "p50 x echo",
                   "calls/s x echo", "bytes in", "bytes out"):
        assert column in table, column
    rows = [r for r in json.loads(out.read_text())["rows"] if r["section"] == "groups"]
    have = {(r["impl"], r["compact"], r["callers"]) for r in rows}
    impls = {
        ("estimator in-process", ""),
        *((f"service {t}, sync client", c) for t in ("unary", "stream") for c in ("on", "off")),
        ("service shm, sync client", "n/a"),
        *((f"service {t}, asyncio client", c) for t in ("unary", "stream") for c in ("on", "off")),
        ("service unary, asyncio client, coalesced", "on"),
        ("echo, dense bytes each way, sync", "off"), ("echo, dense request, [B] response, sync", "off"),
        ("echo, the compact call's bytes, sync", "on"), ("echo, dense bytes each way, asyncio", "off"),
        ("echo, the compact call's bytes, asyncio", "on"),
    }
    assert have == {(i, c, n) for i, c in impls for n in (1, 3)}, have ^ {(i, c, n) for i, c in impls for n in (1, 3)}
    for r in rows:
        assert r["size"] == "16x32x16" and r["estimator"] == "grpo"
        assert r["ms"] > 0 and r["p99_ms"] >= r["ms"] and r["calls_s"] > 0, r
        if r["impl"].startswith("service") or r["impl"] == "estimator in-process":
            assert r["err"] == 0.0, r  # the wire and the per-sample rebuild change no bit
        if r["impl"].startswith(("service", "echo")):
            assert r["bytes_in"] > 0 and r["bytes_out"] > 0, r
        if r["impl"].startswith("service") or r["impl"].startswith("estimator"):
            assert r["vs_ours"] is not None and r["vs_floor"] is not None, r
    by = {(r["impl"], r["compact"]): r for r in rows if r["callers"] == 1}
    dense, small = by[("service unary, sync client", "off")], by[("service unary, sync client", "on")]
    assert dense["bytes_out"] >= 16 * 32 * 4 > small["bytes_out"]  # [B, T] float32 against [B]
    assert dense["bytes_in"] > small["bytes_in"]  # float32 mask against one byte per token
    assert by[("echo, dense bytes each way, sync", "off")]["bytes_in"] == dense["bytes_in"]
    assert by[("echo, the compact call's bytes, sync", "on")]["bytes_out"] == small["bytes_out"]
    # coalesced: bytes per logical call; with 3 callers several groups share one request (per-sample out: 16
    # values a group, so the response per logical call stays near the single call's)
    co = {r["callers"]: r for r in rows if r["impl"] == "service unary, asyncio client, coalesced"}
    assert co[1]["bytes_in"] == small["bytes_in"] and co[1]["bytes_out"] == small["bytes_out"]
