"""Warm-up before SERVING (issue #22 item 7): every numba kernel signature a request can need is compiled, or
loaded from numba's cache, while health says NOT_SERVING; nothing compiles after SERVING.

The coverage checks run in their own process with an EMPTY numba cache (``NUMBA_CACHE_DIR`` a fresh temporary
directory): a kernel that only other kernels call gets a signature of its own only when it is compiled, not when
its caller is loaded from the cache. Time assumption: a cold compile of every signature takes ~20 s of CPU
(~45 s on a loaded 2-core machine); the subprocesses get 600 s.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_server import server as server_module
from advantage_server.cli import build_parser
from advantage_server.estimators import jit

from test_server_cli import ServerProcess, free_port

#: kernels no request reaches, and why (each must say so; a new kernel is not added here to pass the test)
UNREACHABLE = {
    # gdpo standardises through _standardized_rows for float32/float64 results; _standardize serves other
    # compute dtypes, and the core computes only in float32 or float64
    "advantage_server.estimators.gdpo._standardize",
}

COVERAGE = r'''
import json, sys
import numpy as np, torch
from advantage_server.core import AdvantageCore
from advantage_server import warmup
from advantage_server.errors import InvalidInput
from advantage_server.estimators import REGISTRY, jit

core = AdvantageCore("cpu")
report = warmup.warm(core)
def kname(k):
    return f"{k.py_func.__module__}.{k.py_func.__name__}"
warmed = {kname(k): {str(s) for s in k.signatures} for k in jit.KERNELS}
after_warmup = {n: len(sigs) for n, sigs in warmed.items()}
before = jit.compiled_signatures()

# a wider sweep than the warm-up's: each bool False as well as True, every layout with and without the optional
# inputs and with [B, T] rewards, per-sample results and the packed layout for every config, small rows (numpy paths) and rows big enough
# to split over the cores, half-precision and integer inputs
rng = np.random.default_rng(7)
calls = 0
def run(name, cfg, tensors, **kw):
    global calls
    try:
        core.run(name, dict(cfg), tensors, **kw)
        calls += 1
    except InvalidInput:
        pass

for name, spec in REGISTRY.items():
    cfgs = list(warmup.configs(spec))
    for cfg in list(cfgs):
        cfgs += [{**cfg, k: False} for k, v in cfg.items() if v is True]
    for dtype in (np.float32, np.float64):
        for cfg in cfgs:
            for layout in warmup.LAYOUTS:
                for optional, float_shape in ((True, 0), (False, 0), (False, 1)):
                    t = warmup.batch(spec, dtype, rng, layout=layout, optional=optional, float_shape=float_shape)
                    run(name, cfg, t, per_sample=True)
                    small = {k: v[:8, :5] if v.dim() == 2 and k != "prompt_ids" else v[:8] for k, v in t.items()}
                    run(name, cfg, small)
        big = warmup.batch(spec, dtype, rng, rows=512, optional=False)
        big = {k: (v.repeat(1, 40) if v.dim() == 2 and k != "prompt_ids" else v) for k, v in big.items()}
        run(name, {}, big)  # 512 x 2880: the rows split over the pool
        for cfg in cfgs:  # the packed layout, with [B] and with [B, T] rewards
            for float_shape in (0, 1):
                flat, keywords = warmup.packed(warmup.batch(spec, dtype, rng, optional=False, float_shape=float_shape))
                run(name, cfg, flat, **keywords)
    t = warmup.batch(spec, np.float32, rng, optional=False)
    for k, v in list(t.items()):
        if v.is_floating_point() and k != "mask":
            run(name, {}, {**t, k: v.to(torch.float16)})
            run(name, {}, {**t, k: v.to(torch.bfloat16)})
            run(name, {}, {**t, k: (v * 3).round().to(torch.int64)})
print(json.dumps({"line": report.line(), "after_warmup": after_warmup, "before": before,
                  "after": jit.compiled_signatures(), "calls": calls,
                  "new": [f"{kname(k)}{s}" for k in jit.KERNELS for s in map(str, k.signatures)
                          if s not in warmed[kname(k)]]}))
'''


def cold_env(tmp_path: pathlib.Path) -> dict[str, str]:
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}


@pytest.mark.skipif(not jit.NUMBA, reason="numba kernels disabled or absent")
def test_warmup_reaches_every_kernel_and_a_wider_sweep_compiles_nothing_more(tmp_path):
    proc = subprocess.run([sys.executable, "-c", COVERAGE], env=cold_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert re.match(r"warmed \d+ kernel signatures in [\d.]+ s \(0 loaded from cache, \d+ compiled", out["line"]), \
        out["line"]
    assert len(out["after_warmup"]) >= 25, out["after_warmup"]  # every @jit.njit kernel is listed
    missed = sorted(k for k, n in out["after_warmup"].items() if n == 0 and k not in UNREACHABLE)
    assert not missed, f"kernels the warm-up never compiles (extend advantage_server.warmup): {missed}"
    assert not (UNREACHABLE - set(out["after_warmup"])), "UNREACHABLE names a kernel that no longer exists"
    assert out["calls"] > 1000
    assert out["after"] == out["before"], (
        f"{out['after'] - out['before']} kernel signature(s) compiled after the warm-up: "
        + "\n".join(out["new"]))


def test_the_sweep_would_see_a_missing_signature(tmp_path):
    """The check above can fail: a kernel variant the warm-up does not make (a 3-D array here) is counted."""
    before = jit.compiled_signatures()
    kernel = jit.KERNELS[0]  # any compiled kernel; a signature no request uses
    if not jit.NUMBA or not hasattr(kernel, "signatures"):
        pytest.skip("numba kernels disabled or absent")
    vals = np.zeros(3, dtype=np.int16)
    kernel(0, 3, vals, np.zeros((3, 2), dtype=np.int16))  # _fill_rows for int16: not a request's
    assert jit.compiled_signatures() == before + 1


def test_flag_defaults_and_create_server_warms_before_serving(monkeypatch):
    """advantage-server warms unless --no-warmup; create_server(warmup=True) warms inside start(), while health
    is NOT_SERVING, then reports SERVING; create_server's default does not warm."""
    monkeypatch.delenv("ADVANTAGE_WARMUP", raising=False)
    assert build_parser().parse_args([]).warmup is True
    assert build_parser().parse_args(["--no-warmup"]).warmup is False
    monkeypatch.setenv("ADVANTAGE_WARMUP", "0")  # what the suite sets for the servers it starts
    assert build_parser().parse_args([]).warmup is False
    monkeypatch.delenv("ADVANTAGE_WARMUP")
    seen = []

    class Report:
        stopped = False

        def line(self):
            return "warmed 0 kernel signatures in 0.0 s (test)"

    def fake_warm(core, stop=None):
        statuses = {name: srv.health._server_status.get(name) for name in ("", server_module.SERVICE_NAME)}
        seen.append(statuses)
        return Report()

    monkeypatch.setattr(server_module, "warm", fake_warm)
    srv = server_module.create_server("127.0.0.1", 0, "cpu", warmup=True)
    try:
        srv.start()
        assert seen == [{"": health_pb2.HealthCheckResponse.NOT_SERVING,
                         server_module.SERVICE_NAME: health_pb2.HealthCheckResponse.NOT_SERVING}]
        assert isinstance(srv.warmup_report, Report)
        with grpc.insecure_channel(srv.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(grace=0)
    plain = server_module.create_server("127.0.0.1", 0, "cpu")
    try:
        plain.start()
        assert plain.warmup is False and plain.warmup_report is None and len(seen) == 1
    finally:
        plain.stop(grace=0)


def test_a_read_only_cache_dir_is_copied_to_a_writable_one(tmp_path, monkeypatch):
    """numba uses only a cache directory it can write to: a read-only one (the image's, under a read-only root
    filesystem) is copied into $TMPDIR and numba pointed at the copy."""
    if jit._numba is None:
        pytest.skip("numba absent")
    seed = tmp_path / "image-cache"
    (seed / "some" / "dir").mkdir(parents=True)
    (seed / "some" / "dir" / "k.nbi").write_bytes(b"index")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(jit._numba.config, "CACHE_DIR", str(seed))
    monkeypatch.setattr(jit.tempfile, "gettempdir", lambda: str(scratch))
    real = jit._writable
    monkeypatch.setattr(jit, "_writable", lambda path: False if path == str(seed) else real(path))
    where = jit._use_cache_dir()
    copy = pathlib.Path(jit._numba.config.CACHE_DIR)
    assert copy.parent == scratch and copy.name.startswith("advantage-numba-cache-")
    assert (copy / "some" / "dir" / "k.nbi").read_bytes() == b"index"
    assert where == f"{copy} (a copy of read-only {seed})"


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


@pytest.mark.skipif(not jit.NUMBA, reason="numba kernels disabled or absent")
def test_server_with_an_empty_cache_serves_every_estimator_without_compiling(tmp_path, capsys):
    """advantage-server with an EMPTY NUMBA_CACHE_DIR: health NOT_SERVING while it compiles, the start-up log
    says how long the warm-up took, then SERVING; the first call of every estimator after that compiles nothing
    (advantage_kernel_signatures does not move). The first-call times are printed, not asserted (a loaded
    machine); advantage-bench's cold-start section measures them."""
    from advantage_client import AdvantageClient

    from reliability_support import CALLS, batch

    port, health_port, metrics_port = free_port(), free_port(), free_port()
    srv = ServerProcess(tmp_path, port, "--health-port", str(health_port), "--metrics-port", str(metrics_port),
                        name="cold", env={"NUMBA_CACHE_DIR": str(tmp_path / "empty-cache"), "ADVANTAGE_WARMUP": "1"})
    statuses = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                assert srv.proc.poll() is None, srv.stderr
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                except grpc.RpcError:
                    time.sleep(0.1)  # not bound yet
                    continue
                statuses.append(status)
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.1)
        assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING, srv.stderr
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, "health said SERVING before the warm-up"
        line = re.search(r"warmed (\d+) kernel signatures in ([\d.]+) s \(0 loaded from cache, (\d+) compiled",
                         srv.stderr)
        assert line and int(line.group(1)) == int(line.group(3)) > 0, srv.stderr
        signatures = metric(metrics_port, "advantage_kernel_signatures")
        assert signatures == int(line.group(1))
        timings = []
        with AdvantageClient(srv.address) as client:
            for name, (config, names) in CALLS.items():
                data = batch(1, B=64, T=256, groups=16)
                started = time.perf_counter()
                client.compute(name, config, **{k: data[k] for k in names})
                timings.append(f"{name} {1e3 * (time.perf_counter() - started):.1f} ms")
        assert metric(metrics_port, "advantage_kernel_signatures") == signatures, "a call compiled a kernel"
        with capsys.disabled():
            print(f"\n[warmup] {line.group(0)}; first calls after SERVING: {', '.join(timings)}")
    finally:
        srv.proc.terminate()
        srv.wait(timeout=60)
        srv.close()
