"""Helpers for the reliability tests: server processes, a slow-estimator hook, test certificates, reports.

Every server listens on 127.0.0.1 only; every wait is bounded.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import psutil

from test_server_cli import START_TIMEOUT, ServerProcess, free_port  # noqa: F401 - re-exported

# Loaded by a server process through PYTHONPATH (the real console script, unmodified): every estimator
# appends "start" to $ADVANTAGE_TEST_EVENTS when it begins, sleeps $ADVANTAGE_TEST_DELAY seconds, and
# appends "end" when it returns. Tests count accepted work from the server's side with it.
SLOW_SITECUSTOMIZE = """
import os
if os.environ.get("ADVANTAGE_TEST_DELAY"):
    import dataclasses, time
    from advantage_server.estimators import REGISTRY
    _events, _delay = os.environ["ADVANTAGE_TEST_EVENTS"], float(os.environ["ADVANTAGE_TEST_DELAY"])
    def _note(word):
        with open(_events, "a") as f:
            f.write(word + "\\n")
    def _wrap(fn):
        def slow(cfg, batch):
            _note("start")
            time.sleep(_delay)
            out = fn(cfg, batch)
            _note("end")
            return out
        return slow
    for _name, _spec in list(REGISTRY.items()):
        REGISTRY[_name] = dataclasses.replace(_spec, fn=_wrap(_spec.fn))
"""


def slow_env(tmp: pathlib.Path, delay: float) -> tuple[dict[str, str], pathlib.Path]:
    """Environment for a server whose estimators take ``delay`` seconds more, and its events file."""
    hook = tmp / "slow_hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_SITECUSTOMIZE)
    events = tmp / f"events-{time.monotonic_ns()}"
    events.touch()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
           "ADVANTAGE_TEST_DELAY": str(delay), "ADVANTAGE_TEST_EVENTS": str(events)}
    return env, events


def count_events(events: pathlib.Path, word: str) -> int:
    return events.read_text().split().count(word)


def start_server(tmp: pathlib.Path, name: str, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
    # PYTHONFAULTHANDLER: a server that hangs is sent SIGABRT by stop_server and dumps every thread's stack
    srv = ServerProcess(tmp, free_port(), *flags, name=name, env={"PYTHONFAULTHANDLER": "1", **(env or {})})
    try:
        srv.wait_listening()
    except BaseException:
        srv.close()
        raise
    return srv


def wait_serving(srv: ServerProcess, timeout: float = START_TIMEOUT) -> None:
    """Poll the server's health until SERVING: it logs that it listens before its warm-up (health NOT_SERVING
    while the kernels compile or load), and a first call with a tight deadline must not pay for the warm-up."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(srv.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert srv.proc.poll() is None, srv.stderr
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"{srv.address} not SERVING after {timeout} s:\n{srv.stderr}")


def stop_server(srv: ServerProcess, timeout: float = 30.0) -> int:
    """SIGTERM and wait (bounded); returns the exit code. A server still running after ``timeout`` is sent
    SIGABRT (its thread stacks land in its stderr) and the test fails showing them."""
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
    try:
        return srv.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        srv.proc.send_signal(signal.SIGABRT)
        try:
            srv.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        raise AssertionError(f"server still running {timeout}s after SIGTERM; its stacks:\n{srv.stderr[-20000:]}") from None


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def percentiles(latencies_s: list[float]) -> str:
    ms = sorted(1e3 * x for x in latencies_s)
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return f"p50 {p(0.50):.1f} ms, p99 {p(0.99):.1f} ms, max {ms[-1]:.1f} ms, mean {statistics.fmean(ms):.1f} ms"


def report(capsys, line: str) -> None:
    """Print one result line even while pytest captures output (so `make test` shows it)."""
    with capsys.disabled():
        print(f"\n[reliability] {line}", flush=True)


# ------------------------------------------------------------------------------ requests
def batch(seed: int, B: int = 16, T: int = 32, groups: int = 4) -> dict[str, np.ndarray]:
    """A random but valid batch with every input any estimator reads."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.85).astype(np.float32)
    mask[:, 0] = 1
    return {
        "prompt_ids": np.repeat(np.arange(groups, dtype=np.int64), B // groups),
        "rewards": rng.standard_normal(B).astype(np.float32),
        "mask": mask,
        "values": rng.standard_normal((B, T)).astype(np.float32),
        "logprobs": -rng.random((B, T)).astype(np.float32),
        "reference_logprobs": -rng.random((B, T)).astype(np.float32),
        "teacher_logprobs": -rng.random((B, T)).astype(np.float32),
        "prev_logprobs": -rng.random((B, T)).astype(np.float32),
        "reward/a": rng.standard_normal(B).astype(np.float32),
        "reward/b": rng.standard_normal(B).astype(np.float32),
    }


#: estimator -> (config, the inputs it reads)
CALLS = {
    "grpo": (None, ("prompt_ids", "rewards", "mask")),
    "gdpo": (None, ("prompt_ids", "mask", "reward/a", "reward/b")),
    "reinforce_plus_plus": ({"use_kl_in_reward": True},
                            ("prompt_ids", "rewards", "mask", "logprobs", "reference_logprobs")),
    "raw_reward": (None, ("rewards", "mask")),
    "gae": ({"gae_gamma": 0.99, "gae_lambda": 0.95}, ("rewards", "mask", "values")),
    "opd": (None, ("mask", "teacher_logprobs", "prev_logprobs")),
}


def request_for(estimator: str, seed: int, **shape):
    from advantage_client.client import build_request

    config, names = CALLS[estimator]
    data = batch(seed, **shape)
    return build_request(estimator, config, **{k: data[k] for k in names})


# ------------------------------------------------------------------------------ certificates
def make_pki(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and an unrelated CA with
    its own client certificate (the impostor). Written as PEM files; returns their paths by name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths: dict[str, pathlib.Path] = {}

    def write(name: str, data: bytes) -> None:
        paths[name] = directory / f"{name}.pem"
        paths[name].write_bytes(data)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(ca_key, ca_cert, cn: str, server: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
                   .issuer_name(ca_cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                         else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = ca("advantage test CA")
    write("ca", ca_cert.public_bytes(serialization.Encoding.PEM))
    skey, scert = leaf(ca_key, ca_cert, "advantage-server", server=True)
    write("server_cert", scert.public_bytes(serialization.Encoding.PEM))
    write("server_key", key_pem(skey))
    ckey, ccert = leaf(ca_key, ca_cert, "trainer", server=False)
    write("client_cert", ccert.public_bytes(serialization.Encoding.PEM))
    write("client_key", key_pem(ckey))
    rogue_key, rogue_cert = ca("someone else's CA")
    write("rogue_ca", rogue_cert.public_bytes(serialization.Encoding.PEM))
    rkey, rcert = leaf(rogue_key, rogue_cert, "impostor", server=False)
    write("rogue_client_cert", rcert.public_bytes(serialization.Encoding.PEM))
    write("rogue_client_key", key_pem(rkey))
    rskey, rscert = leaf(rogue_key, rogue_cert, "impostor-server", server=True)
    write("rogue_server_cert", rscert.public_bytes(serialization.Encoding.PEM))
    write("rogue_server_key", key_pem(rskey))
    return paths


def python_client_process(code: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A separate Python process running ``code`` (a client the test can kill or stop)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
