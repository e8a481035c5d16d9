"""Warm-up before SERVING (issue #22 item 7, issue #29 item 1): every numba kernel signature a request can need is
compiled, or loaded from numba's cache, while health says NOT_SERVING; nothing compiles after SERVING.

The coverage checks run in their own processes with an EMPTY numba cache (``NUMBA_CACHE_DIR`` a fresh temporary
directory): a kernel that only other kernels call gets a signature of its own only when it is compiled, not when
its caller is loaded from the cache. Then two more starts on the cache that process filled: one from the
signature list it wrote (no sweep of 1,065 calls) and one with the list removed (the calls, loading from the
cache); both must hold exactly the signatures the compiling start held (so the wider sweep, run after the
compiling start, compiles nothing after them either). Time assumption: a cold compile of every
signature takes ~30 s of CPU (~50 s on a loaded 2-core machine); the subprocesses get 600 s. Start -> SERVING
times are printed by scripts/start_time.py, not asserted here.
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
if sys.argv[1:] == ["--warm-only"]:
    print(json.dumps({"line": report.line(), "calls_run": report.calls, "after_warmup": after_warmup,
                      "signatures": {n: sorted(v) for n, v in warmed.items()}}))
    sys.exit(0)

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
print(json.dumps({"line": report.line(), "calls_run": report.calls, "after_warmup": after_warmup, "before": before,
                  "signatures": {n: sorted(v) for n, v in warmed.items()},
                  "after": jit.compiled_signatures(), "calls": calls,
                  "new": [f"{kname(k)}{s}" for k in jit.KERNELS for s in map(str, k.signatures)
                          if s not in warmed[kname(k)]]}))
'''


def cold_env(tmp_path: pathlib.Path) -> dict[str, str]:
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}


def coverage(env: dict[str, str], *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", COVERAGE, *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_nothing_more(out: dict) -> None:
    assert out["calls"] > 1000
    assert out["after"] == out["before"], (
        f"{out['after'] - out['before']} kernel signature(s) compiled after the warm-up: "
        + "\n".join(out["new"]))


@pytest.mark.skipif(not jit.NUMBA, reason="numba kernels disabled or absent")
def test_warmup_reaches_every_kernel_and_a_wider_sweep_compiles_nothing_more(tmp_path):
    """Empty cache: the warm-up's calls compile every signature and write the signature list; a wider sweep
    compiles nothing more. Then, on that cache: a start from the list (no sweep: one call per estimator) loads
    exactly the same signatures, compiling none; a start without the list (the calls, loading from the cache)
    holds the same signatures too: the callee kernels' included, which numba makes only when compiling their
    callers (advantage_kernel_signatures read 49 against 56)."""
    env = cold_env(tmp_path)
    out = coverage(env)
    assert re.match(r"warmed \d+ kernel signatures in [\d.]+ s \(0 loaded from cache, \d+ compiled; \d+ estimator "
                    r"calls, signature list written to \S+advantage-warmup-\w+\.pkl;", out["line"]), out["line"]
    assert len(out["after_warmup"]) >= 25, out["after_warmup"]  # every @jit.njit kernel is listed
    missed = sorted(k for k, n in out["after_warmup"].items() if n == 0 and k not in UNREACHABLE)
    assert not missed, f"kernels the warm-up never compiles (extend advantage_server.warmup): {missed}"
    assert not (UNREACHABLE - set(out["after_warmup"])), "UNREACHABLE names a kernel that no longer exists"
    assert out["calls_run"] > 1000
    assert_nothing_more(out)
    compiled = out["signatures"]
    total = sum(map(len, compiled.values()))
    lists = list(pathlib.Path(env["NUMBA_CACHE_DIR"]).rglob("advantage-warmup-*.pkl"))
    assert len(lists) == 1, lists

    # the same signatures as the compiling start: so the wider sweep above, which dispatches on them alone,
    # compiles nothing here either (not run again: ~40 s)
    listed = coverage(env, "--warm-only")
    assert re.match(rf"warmed {total} kernel signatures in [\d.]+ s \({total} loaded from cache, 0 compiled; "
                    rf"\d+ estimator calls, from the signature list {re.escape(str(lists[0]))};", listed["line"]), \
        listed["line"]
    assert listed["calls_run"] < 50, "a start from the list ran the sweep"  # one call per estimator
    assert listed["signatures"] == compiled, "a start from the list held other signatures than a compiling one"

    lists[0].unlink()
    called = coverage(env, "--warm-only")
    assert re.match(rf"warmed {total} kernel signatures in [\d.]+ s \({total} loaded from cache, 0 compiled; "
                    r"\d+ estimator calls, signature list written to ", called["line"]), called["line"]
    assert called["calls_run"] > 1000
    assert called["signatures"] == compiled, "a cache-loaded start held other signatures than a compiling one"


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


#: modules that the fingerprinted code imports but whose code cannot change a kernel's argument types, and why
NOT_FINGERPRINTED = {
    "advantage_server": "the package's __init__: create_server imported on first use",
    "advantage_server.errors": "exception classes",
    "advantage_server.limits": "core's checkpoint() hook: raises for a cancelled call, passes no tensor",
    "advantage_client": "the package's __init__ (its re-exports; `from advantage_client import wire` names it)",
    "advantage_client.proto": "the generated protobuf classes (config messages, enum names)",
    "advantage_client._proto.advantage.v1": "the generated protobuf package",
    "advantage_client._proto.advantage.v1.advantage_pb2": "the generated protobuf classes",
}


def test_the_fingerprint_covers_the_code_the_warm_up_runs():
    """The signature list is reused while warmup.fingerprint() is unchanged: every advantage_* module that the
    fingerprinted files import is fingerprinted itself, or named in NOT_FINGERPRINTED with the reason."""
    import ast
    import importlib.util

    from advantage_server import warmup

    def origin(module: str) -> pathlib.Path | None:
        """The source file of ``module``, None when it is not a module (a name imported from one)."""
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, AttributeError, ValueError):
            return None
        return pathlib.Path(spec.origin) if spec is not None and spec.origin else None

    hashed = set()
    for package, entries in warmup.HASHED.items():
        root = origin(package).parent
        for entry in entries:
            hashed.update(sorted((root / entry).rglob("*.py")) if (root / entry).is_dir() else [root / entry])
    missing = set()
    for path in hashed:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if not name.startswith(("advantage_server", "advantage_client")) or name in NOT_FINGERPRINTED:
                    continue
                source = origin(name)
                if source is not None and source not in hashed:
                    missing.add(name)
    assert not missing, f"fingerprint the source of these (warmup.HASHED) or say why not: {sorted(missing)}"
    assert len(warmup.fingerprint()) == 20 and warmup.fingerprint() == warmup.fingerprint()


def test_a_signature_list_is_read_only_when_it_is_this_codes(tmp_path):
    """read_list: a missing file, a damaged file or one that names a kernel this code lacks is ignored (the
    warm-up's calls run and write a new list); write_list then read_list round-trips every held signature and
    removes the lists of other fingerprints beside it."""
    if not jit.NUMBA:
        pytest.skip("numba kernels disabled or absent")
    import pickle

    from advantage_server import warmup

    path = tmp_path / f"{warmup.LIST_PREFIX}{warmup.fingerprint()}.pkl"
    assert warmup.read_list(str(path)) is None
    path.write_bytes(b"not a pickle")
    assert warmup.read_list(str(path)) is None
    path.write_bytes(pickle.dumps([("advantage_server.estimators.gone._kernel", ())]))
    assert warmup.read_list(str(path)) is None
    stale = tmp_path / f"{warmup.LIST_PREFIX}0123456789abcdef0123.pkl"
    stale.write_bytes(b"")
    kernel = jit.KERNELS[0]
    kernel(0, 3, np.zeros(3, dtype=np.int16), np.zeros((3, 2), dtype=np.int16))  # one signature held at least
    assert warmup.write_list(str(path)) == str(path) and not stale.exists()
    pairs = warmup.read_list(str(path))
    assert sorted((warmup.kernel_name(k), str(sig)) for k, sig in pairs) == \
        sorted((warmup.kernel_name(k), str(sig)) for k in jit.KERNELS for sig in k.signatures)
    assert any(k is kernel for k, _ in pairs)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def wait_serving(srv: ServerProcess, health_port: int, timeout: float = 600) -> list[int]:
    """Poll the plaintext health port until SERVING; the statuses seen (the process must not exit)."""
    statuses = []
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout
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
    assert statuses and statuses[-1] == health_pb2.HealthCheckResponse.SERVING, srv.stderr
    return statuses


def first_calls(address: str) -> list[str]:
    """One call of every estimator (B=64, T=256), each timed."""
    from advantage_client import AdvantageClient

    from reliability_support import CALLS, batch

    timings = []
    with AdvantageClient(address) as client:
        for name, (config, names) in CALLS.items():
            data = batch(1, B=64, T=256, groups=16)
            started = time.perf_counter()
            client.compute(name, config, **{k: data[k] for k in names})
            timings.append(f"{name} {1e3 * (time.perf_counter() - started):.1f} ms")
    return timings


@pytest.mark.skipif(not jit.NUMBA, reason="numba kernels disabled or absent")
def test_server_with_an_empty_cache_serves_every_estimator_without_compiling(tmp_path, capsys):
    """advantage-server with an EMPTY NUMBA_CACHE_DIR: health NOT_SERVING while it compiles, the start-up log
    says how long the warm-up took, then SERVING; the first call of every estimator after that compiles nothing
    (advantage_kernel_signatures does not move). A second server on the cache the first filled loads the
    signature list instead of running the warm-up's calls, and reports the same advantage_kernel_signatures
    (a cache-loaded start read 49 against a compiling one's 56); its first calls compile nothing either. The
    times are printed, not asserted (a loaded machine); scripts/start_time.py and advantage-bench's cold-start
    section measure them."""
    cache = str(tmp_path / "empty-cache")
    figures = []
    signatures = None
    for name in ("cold", "filled"):
        port, health_port, metrics_port = free_port(), free_port(), free_port()
        srv = ServerProcess(tmp_path, port, "--health-port", str(health_port), "--metrics-port", str(metrics_port),
                            name=name, env={"NUMBA_CACHE_DIR": cache, "ADVANTAGE_WARMUP": "1"})
        try:
            statuses = wait_serving(srv, health_port)
            line = re.search(r"warmed (\d+) kernel signatures in ([\d.]+) s \((\d+) loaded from cache, (\d+) "
                             r"compiled; (\d+) estimator calls[^;]*;", srv.stderr)
            assert line, srv.stderr
            held, loaded, compiled, calls = (int(line.group(i)) for i in (1, 3, 4, 5))
            if name == "cold":
                assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, "health said SERVING before the warm-up"
                assert held == compiled > 0 and loaded == 0 and calls > 1000, line.group(0)
                assert "signature list written to" in line.group(0), line.group(0)
                signatures = metric(metrics_port, "advantage_kernel_signatures")
                assert signatures == held
            else:
                assert "from the signature list" in line.group(0) and calls < 50, line.group(0)
                assert held == loaded and compiled == 0, line.group(0)
                assert metric(metrics_port, "advantage_kernel_signatures") == signatures, \
                    "a cache-loaded start holds other kernel signatures than a compiling one"
            timings = first_calls(srv.address)
            assert metric(metrics_port, "advantage_kernel_signatures") == held, "a call compiled a kernel"
            figures.append(f"{name} cache: {line.group(0)} first calls after SERVING: {', '.join(timings)}")
        finally:
            srv.proc.terminate()
            srv.wait(timeout=60)
            srv.close()
    with capsys.disabled():
        print("\n[warmup] " + "\n[warmup] ".join(figures))


def test_no_signature_list_is_used_or_written_with_numba_off(tmp_path, monkeypatch):
    """ADVANTAGE_NUMBA=0: the warm-up's calls run the torch paths and make no signature, so a list written then
    would be empty and a later start with numba on would load nothing from it: none is read or written."""
    import types

    from advantage_server import warmup

    path = tmp_path / "advantage-warmup-test.pkl"
    monkeypatch.setattr(warmup, "list_path", lambda fp=None: str(path))
    ran = []
    core = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"),
                                 run=lambda name, cfg, tensors, **kw: ran.append(name))
    monkeypatch.setattr(jit, "NUMBA", False)
    report = warmup.warm(core)
    assert not path.exists() and report.calls == len(ran) > 1000 and "signature list" not in report.line()
    if jit._numba is not None and jit.KERNELS:
        monkeypatch.setattr(jit, "NUMBA", True)  # the same with numba on writes it
        ran.clear()
        report = warmup.warm(core)
        assert path.exists() and f"signature list written to {path}" in report.line()
