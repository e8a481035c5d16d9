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


def test_floor_probe_work_only_arithmetic_is_the_services():
    """The floor probe's work-only server computes what the service answers (NeMo RL GRPO, default config,
    one group: leave-one-out baseline and std), tied, one-hot, tiny and prefix-mask groups included, so its row
    is a floor of the same work; and the work-only client rebuilds the service's dense tensor from it."""
    import numpy as np
    import torch
    from advantage_client.client import prepare_call
    from advantage_client.proto import advantage_pb2 as pb
    from advantage_server.bench import floor
    from advantage_server.core import AdvantageCore
    core = AdvantageCore("cpu")
    gen = torch.Generator().manual_seed(3)
    cases = [(torch.randn(16, generator=gen), False), ((torch.rand(16, generator=gen) < 0.5).float(), False),
             (torch.ones(16), False), (torch.tensor([1.0] + [0.0] * 15), False), (torch.randn(16, generator=gen), True),
             (torch.tensor([0.3, 1.7]), False), (torch.tensor([2.5]), False)]
    for rewards, prefix in cases:
        B = len(rewards)
        if prefix:  # sent as lengths by the client
            mask = (torch.arange(64)[None, :] < torch.randint(1, 65, (B, 1), generator=gen)).float()
        else:
            mask = (torch.rand(B, 64, generator=gen) < 0.7).float()
        tensors = {"prompt_ids": torch.zeros(B, dtype=torch.int64), "rewards": rewards, "mask": mask}
        want = core.run("grpo", {}, tensors).advantages
        request = prepare_call("grpo", {}, None, None, False, dict(tensors)).request.tobytes()
        assert ("lengths" in pb.ComputeAdvantageRequest.FromString(request).inputs) == prefix
        reply = pb.AdvantageResult.FromString(floor.work_only_answer(request))  # the service's own request bytes
        assert list(reply.dense_shape) == [B, 64]
        values = torch.from_numpy(np.frombuffer(reply.advantages.data, dtype=np.float32).copy())
        torch.testing.assert_close(values, want[:, 0], rtol=1e-6, atol=1e-7)
        assert torch.equal(want, want[:, :1].expand(B, 64))  # GRPO (nemo_rl) broadcasts over every column
        own, bool_mask = floor.work_only_request(rewards.numpy(), tensors["prompt_ids"].numpy(), mask.numpy())
        assert np.array_equal(bool_mask, mask.numpy() != 0)
        got = floor.work_only_result(floor.work_only_answer(own), bool_mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_floor_probe_runs_and_prints_every_row():
    cmd = [sys.executable, "-m", "advantage_server.bench.floor", "--rounds", "1", "--calls", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("echo (the same bytes, [B] answer)", "work-only server", "service", "work-only client + "
                "work-only server", "sync client + service", "asyncio client + service", "client work, work-only"):
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(row)), None)
        assert line is not None, (row, proc.stdout)
        assert float(line[len(row):].split()[0]) > 0, line
