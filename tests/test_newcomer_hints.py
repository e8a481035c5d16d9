"""The errors a newcomer meets right after starting a server point at the fix: a server still warming up
(NOT_SERVING), a plaintext client against a TLS server, and a health check without a port."""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client.errors import hint
from advantage_server.cli import healthcheck_main
from advantage_server.server import SERVICE_NAME
from reliability_support import make_pki

GROUP = dict(prompt_ids=np.array([0, 0, 1, 1]), rewards=np.array([1.0, 0.0, 1.0, 1.0], np.float32),
             mask=np.ones((4, 3), np.float32))


def test_a_server_reporting_not_serving_is_named_with_the_way_to_wait(make_server):
    srv = make_server()
    srv.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)  # what warm-up reports
    with AdvantageClient(srv.address, timeout=3.0) as client:
        with pytest.raises(AdvantageServiceError) as info:
            client.compute("grpo", None, **GROUP)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(info.value).startswith(f"the advantage service at {srv.address} is up but reports NOT_SERVING"), \
        str(info.value)  # the hint first, gRPC's own text after it
    assert "wait_for_ready=True" in str(info.value), str(info.value)


def test_wait_for_ready_waits_for_a_warming_server_as_the_readme_says(make_server):
    """README, "One call": a call before the warm-up ends fails at once, ``wait_for_ready=True`` waits for the
    server instead. NOT_SERVING (what the warm-up reports) for 1.5 s, then SERVING: the call returns after the
    switch, with what the same call gets from the server once it serves."""
    srv = make_server()
    srv.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    timer = threading.Timer(1.5, srv.health.set, (SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING))
    start = time.monotonic()
    timer.start()
    try:
        with AdvantageClient(srv.address, timeout=30.0, wait_for_ready=True) as client:
            res = client.compute("grpo", None, as_numpy=True, **GROUP)
    finally:
        timer.cancel()
    assert time.monotonic() - start >= 1.5
    with AdvantageClient(srv.address, timeout=30.0) as client:
        again = client.compute("grpo", None, as_numpy=True, **GROUP)
    assert res.advantages.shape == (4, 3) and np.array_equal(res.advantages, again.advantages)
    assert np.abs(res.advantages[:2]).min() > 0.5 and not res.advantages[2:].any()  # a group of equal rewards: 0


def test_a_plaintext_client_against_a_tls_server_is_told_about_tls(make_server, tmp_path):
    pki = make_pki(tmp_path)
    srv = make_server(tls_cert=pki["server_cert"].read_bytes(), tls_key=pki["server_key"].read_bytes())
    with AdvantageClient(srv.address, timeout=3.0) as client:
        with pytest.raises(AdvantageServiceError) as info:
            client.compute("grpo", None, **GROUP)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "tls_ca" in str(info.value), str(info.value)


@pytest.mark.parametrize("message, words", [
    ("connections to all backends failing; last error: ipv4:127.0.0.1:50071: backend unhealthy", "NOT_SERVING"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", "tls_ca"),
    ("Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame)", "metrics"),
    # a dropped SYN, e.g. a server's gate on an address holding more than its share (issue #35; a newcomer's probe)
    ("connections to all backends failing; last error: UNAVAILABLE: ipv4:127.0.0.1:41911: Connection timed out",
     "--max-connections-per-host"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused",
     "start advantage-server there"),
    # a host name that resolves to nothing: nothing to start there (grpcio 1.7x, c-ares; a fresh-clone newcomer's try)
    ("errors resolving nonexistent-host.invalid:50051: [field:hostname lookup error:address lookup failed for "
     "nonexistent-host.invalid:50051: Domain name not found]", "resolves to no address"),
])
def test_hint_by_cause(message, words):
    said = hint(grpc.StatusCode.UNAVAILABLE, message, "localhost:50071", 3.0)
    assert words in said, said
    assert ("start advantage-server there" in said) == (words == "start advantage-server there"), said


def test_healthcheck_without_a_port_says_so(capsys):
    with pytest.raises(SystemExit) as exit_info:
        healthcheck_main(["--address", "localhost"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'localhost' has no port" in err and "50051" in err, err


def test_the_connect_timeout_hint_quotes_the_servers_own_log_line():
    """The hint for a dropped connection request tells the user what to look for in the server's log; it quoted
    'refusing new connections from', which the server never wrote (its gate's WARNING says 'dropping ...')."""
    import inspect

    from advantage_server.server import ConnectionReaper
    said = hint(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNAVAILABLE: "
                "ipv4:127.0.0.1:1: Connection timed out", "localhost:50071", 3.0)
    quoted = said.split("its log says '")[1].split("...'")[0]
    assert quoted == "dropping new connections from ", said
    assert f'log.warning("{quoted}' in inspect.getsource(ConnectionReaper.sweep)
