"""The real `advantage-server` process: startup log, health, reflection, port conflicts, clean shutdown.

Every server listens on 127.0.0.1 only; every wait is bounded.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_client import AdvantageClient
from advantage_client.client import build_request, decode_result
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc

SERVICE = "advantage.v1.AdvantageService"
START_TIMEOUT = 30.0
LISTENING = re.compile(r"advantage-server listening on (\S+) device=(\S+)")


def server_command() -> list[str]:
    script = pathlib.Path(sys.executable).with_name("advantage-server")
    if script.exists():
        return [str(script)]
    found = shutil.which("advantage-server")
    return [found] if found else [sys.executable, "-m", "advantage_server.cli"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A started `advantage-server` with its stdout/stderr captured in files."""

    def __init__(self, tmp: pathlib.Path, port: int, *extra: str, name: str = "server",
                 env: dict[str, str] | None = None):
        self.port = port
        self.out_path, self.err_path = tmp / f"{name}.out", tmp / f"{name}.err"
        self._out, self._err = self.out_path.open("wb"), self.err_path.open("wb")
        self.proc = subprocess.Popen(
            [*server_command(), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *extra],
            stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_listening(self, timeout: float = START_TIMEOUT) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = LISTENING.search(self.stderr)  # the start-up lines are logged (stderr), once
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"server did not report listening (rc={self.proc.poll()}):\n"
                             f"stdout: {self.stdout}\nstderr: {self.stderr}")

    def wait(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout}s:\n{self.stderr}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._out.close()
        self._err.close()


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("cli"), free_port())
    try:
        srv.wait_listening()
        yield srv
    finally:
        srv.close()


def start_server(tmp_path: pathlib.Path, name: str, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    srv = ServerProcess(tmp_path, free_port(), *extra, name=name, env=env)
    srv.wait_listening()
    return srv


# ------------------------------------------------------------------------------- startup
def test_logs_device_and_address(running):
    match = running.wait_listening()
    assert match.group(1) == running.address
    assert match.group(2) == "cpu"
    log = running.stderr
    assert running.address in log and "device=cpu" in log, log
    # each start-up line once: logged to stderr, not printed to stdout as well
    assert len(LISTENING.findall(log)) == 1 and "listening" not in running.stdout, (log, running.stdout)


def test_health_check_reports_serving(running):
    with grpc.insecure_channel(running.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as exc:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(running):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(running.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert SERVICE in services, services
        assert "grpc.health.v1.Health" in services
        file_proto = db.FindFileContainingSymbol(SERVICE)
        service = next(s for s in file_proto.service if s.name == "AdvantageService")
        assert {m.name for m in service.method} == {"ComputeAdvantage", "ListEstimators", "ComputeAdvantageStream",
                                                     "RegisterSharedMemory", "UnregisterSharedMemory",
                                                     "ComputeAdvantageShm"}


def test_serves_requests(running):
    with AdvantageClient(running.address, timeout=10) as client:
        names = {e.name for e in client.list_estimators().estimators}
        assert names == {"grpo", "gdpo", "reinforce_plus_plus", "raw_reward", "gae", "opd", "grpo_passk",
                         "reinforce_plus_plus_baseline", "rloo", "opo", "remax", "gpg", "optimal_token_baseline",
                         "tir_optimal_token_baseline", "pkpo", "qae", "gigpo", "maxrl", "areal"}
        res = client.compute("raw_reward", {"normalize_advantages": False}, rewards=np.array([1.5, -2.0], np.float32),
                             mask=np.ones((2, 2), np.float32), as_numpy=True)
        np.testing.assert_array_equal(res.advantages, [[1.5, 1.5], [-2.0, -2.0]])


def test_second_server_on_the_same_port_fails_loudly(running, tmp_path):
    second = ServerProcess(tmp_path, running.port, name="second")
    try:
        rc = second.wait(timeout=START_TIMEOUT)
        assert rc != 0, f"second server exited {rc}:\n{second.stderr}"
        err = second.stderr
        assert "cannot bind" in err and str(running.port) in err, err
        assert not LISTENING.search(second.stdout + err), second.stdout
    finally:
        second.close()
    # the first one is untouched
    assert running.proc.poll() is None
    with AdvantageClient(running.address, timeout=10) as client:
        client.list_estimators()


def test_unknown_device_exits_non_zero(tmp_path):
    if torch.cuda.device_count() > 7:  # pragma: no cover
        pytest.skip("this machine has a cuda:7")
    srv = ServerProcess(tmp_path, free_port(), "--device", "cuda:7", name="nodevice")  # last --device wins
    try:
        assert srv.wait(timeout=START_TIMEOUT) == 2
        assert "cuda:7" in srv.stderr, srv.stderr
        assert not LISTENING.search(srv.stdout + srv.stderr)
    finally:
        srv.close()


def test_resolve_device_checks_the_cuda_index(monkeypatch):
    """With one GPU visible, cuda:0 is fine and cuda:7 is refused (not deferred to the first request)."""
    from advantage_server.core import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match="cuda:7"):
        resolve_device("cuda:7")
    assert resolve_device("cpu") == torch.device("cpu")


# ------------------------------------------------------------------------------ shutdown
# Loaded by the server's interpreter through PYTHONPATH (the real console script, unmodified): makes
# `opd` announce that it started (a marker file) and then take a fixed time, so the test knows the
# request is in flight when SIGTERM arrives, whatever the speed of the machine.
SLOW_OPD_SITECUSTOMIZE = """
import os
if os.environ.get("ADVANTAGE_TEST_SLOW_OPD"):
    import dataclasses, pathlib, time
    from advantage_server.estimators import REGISTRY
    _spec = REGISTRY["opd"]
    def _slow(cfg, batch, _fn=_spec.fn):
        pathlib.Path(os.environ["ADVANTAGE_TEST_STARTED"]).write_text("started")
        time.sleep(float(os.environ["ADVANTAGE_TEST_SLOW_OPD"]))
        return _fn(cfg, batch)
    REGISTRY["opd"] = dataclasses.replace(_spec, fn=_slow)
"""


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def test_sigterm_lets_the_in_flight_request_finish(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_OPD_SITECUSTOMIZE)
    started = tmp_path / "started"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
           "ADVANTAGE_TEST_SLOW_OPD": "1.5", "ADVANTAGE_TEST_STARTED": str(started)}
    srv = start_server(tmp_path, "sigterm", "--grace", "30", env=env)
    try:
        rng = np.random.default_rng(0)
        mask = (rng.random((8, 16)) < 0.8).astype(np.float32)
        teacher = -rng.random((8, 16)).astype(np.float32)
        prev = -rng.random((8, 16)).astype(np.float32)
        request = build_request("opd", None, mask=mask, teacher_logprobs=teacher, prev_logprobs=prev)
        with grpc.insecure_channel(srv.address) as channel:
            future = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage.future(request, timeout=60)
            _wait_for(started.exists, 20, "the request to reach the estimator")
            srv.proc.send_signal(signal.SIGTERM)
            _wait_for(lambda: "shutting down" in srv.stderr, 10, "the server to start shutting down")
            assert not future.done(), "the request finished before the shutdown began: nothing was in flight"
            reply = future.result(timeout=60)
        assert srv.wait(timeout=30) == 0, srv.stderr
        got = decode_result(reply, as_numpy=True)
        np.testing.assert_allclose(got.advantages, (teacher - prev) * mask, rtol=0, atol=1e-7)
        assert set(got.metrics) == {"on_policy_distillation/teacher_student_logprob_gap_mean",
                                    "on_policy_distillation/adv_mean", "on_policy_distillation/adv_std"}
        assert "stopped" in srv.stderr, srv.stderr
    finally:
        srv.close()


def test_sigint_exits_zero_and_stops_listening(tmp_path):
    srv = start_server(tmp_path, "sigint")
    try:
        with AdvantageClient(srv.address, timeout=10) as client:
            client.wait_ready(10)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.wait(timeout=30) == 0, srv.stderr
        assert "Traceback" not in srv.stderr, srv.stderr
        with grpc.insecure_channel(srv.address) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert exc.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        srv.close()


def test_sigusr1_prints_every_threads_stack_and_the_server_goes_on():
    """``kill -USR1``: the stacks of a server that seems stuck (faulthandler), without stopping it."""
    import signal as _signal
    import subprocess as _sp
    import time as _time
    proc = _sp.Popen([sys.executable, "-m", "advantage_server.cli", "--port", "0", "--device", "cpu"],
                     stdout=_sp.PIPE, stderr=_sp.PIPE, text=True)
    try:
        line = ""
        deadline = _time.monotonic() + 60
        while "listening" not in line and _time.monotonic() < deadline:
            line = proc.stderr.readline()
        assert "listening" in line, line
        proc.send_signal(_signal.SIGUSR1)
        stacks = []
        while _time.monotonic() < deadline:
            stacks.append(proc.stderr.readline())
            if "Thread 0x" in "".join(stacks) and "most recent call first" in "".join(stacks) and len(stacks) > 5:
                break
        assert "most recent call first" in "".join(stacks), stacks[:20]
        assert proc.poll() is None  # still serving
        proc.send_signal(_signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
