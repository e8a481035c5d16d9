"""Smoke test of ``advantage-bench``: the quick mode on tiny sizes runs every section and prints the rows it
promises (no timing assertions: the numbers belong in BENCHMARKS.md, not in CI)."""
from __future__ import annotations

import json
import subprocess
import sys

from advantage_server.bench import run, transports


def test_quick_bench_prints_every_section(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "advantage_server.bench", "--quick", "--sizes", "8x32x4", "--group-sizes", "64x4x4",
           "--repeats", "1", "--ref-repeats", "1", "--concurrency-seconds", "0.05", "--callers", "3",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    assert "copy bandwidth" in table and "machine:" in table and "implementation" in table
    rows = json.loads(out.read_text())["rows"]
    have = {(r["section"], r["estimator"], r["size"], r["impl"]) for r in rows}

    def impls(section: str, estimator: str, size: str) -> set[str]:
        return {i for s, e, z, i in have if (s, e, z) == (section, estimator, size)}

    gae = impls("kernel", "gae", "8x32x4")
    assert {"ours: estimator (in-process)", "ours: gae_kernel", "ref: per-time-step loop", "ours: gae_kernel, full rows",
            "memory floor: gae_kernel", "memory floor: estimator"} <= gae
    assert any(i.startswith("peer:") for i in gae), gae
    for est in ("grpo", "gdpo", "reinforce_plus_plus", "opd"):
        for size in ("8x32x4", "64x4x4"):
            got = impls("kernel", est, size)
            assert "ours: estimator (in-process)" in got and "memory floor" in got, (est, size, got)
            assert any(i.startswith("ref:") for i in got), (est, size, got)
    for est, size in (("gae", "8x32x4"), ("grpo", "64x4x4")):
        got = impls("concurrency", est, size)
        assert {f"{n} caller{'s' if n > 1 else ''} ({how})" for n in (1, 3)
                for how in ("rows split over the cores", "each call on one core")} == got, got
    assert impls("memory", "gae", "8x32x4") == {"core.compute peak extra RSS"}
    assert impls("memory", "grpo", "64x4x4") == {"core.compute peak extra RSS"}
    e2e = [r for r in rows if r["section"] == "e2e"]
    assert {r["impl"] for r in e2e} == {t.name for t in transports.TRANSPORTS}
    assert all(r["ms"] and r["ms"] > 0 and r["err"] == 0.0 for r in e2e), e2e  # the wire changes no bit
    # every timed kernel row agrees with its reference to float32 tolerance
    for r in rows:
        if r["section"] == "kernel" and r["err"] is not None:
            assert r["err"] < 1e-4, r
        assert r["section"] in run.SECTIONS
    for line in ("kernel ", "concurrency ", "memory ", "e2e "):
        assert any(ln.startswith(line) for ln in table.splitlines()), line
