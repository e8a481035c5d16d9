"""TLS, mutual TLS and bearer-token auth (certificates made at test time), and logs that never carry tensor
values or credentials.

Every server listens on 127.0.0.1 only; every wait is bounded.
"""
from __future__ import annotations

import pathlib
import logging
import struct

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client.channel import auth_metadata, channel_target, service_config
from advantage_server import auth, create_server
from advantage_server.cli import healthcheck_main
from advantage_server.cli import main as cli_main
from reliability_support import make_pki, report, start_server, stop_server

REWARDS = np.array([1.0, 0.0, 0.5, 0.25], np.float32)
MASK = np.ones((4, 3), np.float32)
TOKEN = "s3cr3t-token-4a1f9e"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def works(client: AdvantageClient) -> None:
    res = client.compute("raw_reward", {"normalize_advantages": False}, rewards=REWARDS, mask=MASK, as_numpy=True)
    np.testing.assert_array_equal(res.advantages[:, 0], REWARDS)


def refused(client: AdvantageClient, code: grpc.StatusCode) -> AdvantageServiceError:
    with pytest.raises(AdvantageServiceError) as exc:
        works(client)
    assert exc.value.code == code, (exc.value.code, str(exc.value))
    return exc.value


# ----------------------------------------------------------------------------------- TLS
def test_tls(make_server, pki):
    srv = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    with AdvantageClient(srv.address, timeout=5, tls_ca=pki["ca"]) as client:
        works(client)
    with AdvantageClient(srv.address, timeout=5, tls_ca=pki["ca"].read_bytes()) as client:  # PEM bytes too
        works(client)
    with AdvantageClient(srv.address, timeout=5, retry=False) as client:  # plaintext to a TLS port
        refused(client, grpc.StatusCode.UNAVAILABLE)
    with AdvantageClient(srv.address, timeout=5, tls_ca=pki["rogue_ca"], retry=False) as client:  # wrong CA
        refused(client, grpc.StatusCode.UNAVAILABLE)


def test_mutual_tls_requires_a_client_certificate_from_the_ca(make_server, pki):
    srv = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
    with AdvantageClient(srv.address, timeout=5, tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                         tls_key=pki["client_key"]) as client:
        works(client)
    with AdvantageClient(srv.address, timeout=5, tls_ca=pki["ca"], retry=False) as client:  # no certificate
        refused(client, grpc.StatusCode.UNAVAILABLE)
    with AdvantageClient(srv.address, timeout=5, tls_ca=pki["ca"], tls_cert=pki["rogue_client_cert"],
                         tls_key=pki["rogue_client_key"], retry=False) as client:  # certificate of another CA
        refused(client, grpc.StatusCode.UNAVAILABLE)


def test_tls_configuration_errors(pki):
    with pytest.raises(ValueError, match="--tls-key"):
        create_server("127.0.0.1", 0, device="cpu", tls_cert=pki["server_cert"])
    with pytest.raises(ValueError, match="--tls-client-ca"):
        create_server("127.0.0.1", 0, device="cpu", tls_client_ca=pki["ca"])
    with pytest.raises(ValueError, match="cannot read"):
        create_server("127.0.0.1", 0, device="cpu", tls_cert="/nonexistent/cert.pem", tls_key=pki["server_key"])


def test_client_tls_and_token_mistakes_name_the_option(tmp_path, pki):
    """A CA file that is not PEM, or a token that is not a str, is refused when the client is made, naming the
    option (a fresh-eyes trial found gRPC's "Failed to create security handshaker" at the first call, and a bare
    AttributeError for ``token=123``)."""
    der = tmp_path / "ca.der"
    der.write_bytes(b"\x30\x82\x01\x0a" + bytes(64))
    with pytest.raises(ValueError, match=r"tls_ca: .*ca\.der holds no PEM block"):
        AdvantageClient("localhost:1", tls_ca=der)
    with pytest.raises(ValueError, match="tls_key: the bytes given holds no PEM block"):
        AdvantageClient("localhost:1", tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=b"not a key")
    with pytest.raises(ValueError, match="token: give the bearer token as a str .* not int"):
        AdvantageClient("localhost:1", token=123)
    assert auth_metadata(token=" t ") == (("authorization", "Bearer t"),)
    assert auth_metadata(token="") == auth_metadata(token="  ") == ()  # unset, as before (token=os.environ.get(.., ""))
    # PEM given as text rather than a path is taken as PEM, and never echoed in an error (it may be a key)
    key_text = pathlib.Path(pki["client_key"]).read_text()
    AdvantageClient("localhost:1", tls_ca=pathlib.Path(pki["ca"]).read_text(), tls_cert=pki["client_cert"],
                    tls_key=key_text).close()
    body = "\n".join(line for line in key_text.splitlines() if "-----" not in line)  # its base64 lines only
    with pytest.raises(ValueError, match="tls_key: cannot read the text given") as err:
        AdvantageClient("localhost:1", tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=body)
    assert body[:40] not in str(err.value)
    client = AdvantageClient("localhost:1")
    client.close()
    with pytest.raises(ValueError, match="this AdvantageClient is closed"):  # was gRPC's "closed channel"
        client.compute("raw_reward", None, rewards=REWARDS, mask=MASK)


# ------------------------------------------------------------------------------- token
def test_bearer_token_on_every_call_but_health(make_server):
    srv = make_server(auth_token=TOKEN)
    with AdvantageClient(srv.address, timeout=5, token=TOKEN) as client:
        works(client)
        client.list_estimators()
    for kwargs in ({}, {"token": "wrong"}, {"token": TOKEN + "x"}, {"token": TOKEN[:-1]}):
        with AdvantageClient(srv.address, timeout=5, **kwargs) as client:
            err = refused(client, grpc.StatusCode.UNAUTHENTICATED)
            assert TOKEN not in str(err)
            with pytest.raises(AdvantageServiceError) as exc:
                client.list_estimators()
            assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(srv.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # reflection is not health: it needs the token too
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
        with pytest.raises(grpc.RpcError) as exc:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a second authorization header does not help
        raw = channel.unary_unary("/advantage.v1.AdvantageService/ListEstimators")
        with pytest.raises(grpc.RpcError) as exc:
            raw(b"", timeout=5, metadata=[("authorization", "Bearer wrong"), ("authorization", f"Bearer {TOKEN}")])
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_token_is_compared_in_constant_time(monkeypatch):
    seen = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)
    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    interceptor = auth.TokenAuthInterceptor(TOKEN)
    assert interceptor._authorized([("authorization", f"Bearer {TOKEN}")])
    assert not interceptor._authorized([("authorization", "Bearer nope")])
    assert not interceptor._authorized([])
    assert len(seen) == 2 and all(b == f"Bearer {TOKEN}".encode() for _, b in seen)


def test_token_file(tmp_path, make_server):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert auth.load_token(path) == TOKEN
    assert auth_metadata(token_file=path) == (("authorization", f"Bearer {TOKEN}"),)
    srv = make_server(auth_token=auth.load_token(path))
    with AdvantageClient(srv.address, timeout=5, token_file=path) as client:
        works(client)
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ValueError) as exc:
            auth.load_token(bad)
        assert TOKEN not in str(exc.value)
    with pytest.raises(ValueError, match="not both"):
        auth_metadata(token="a", token_file=path)


def test_channel_targets():
    assert channel_target("localhost:1") == "localhost:1"
    assert channel_target(["127.0.0.1:1"]) == "127.0.0.1:1"
    assert channel_target(["127.0.0.1:1", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    for bad in (["host-a:1", "host-b:1"], ["127.0.0.1:1", "[::1]:2"], ["127.0.0.1", "127.0.0.2:1"], []):
        with pytest.raises(ValueError):
            channel_target(bad)
    cfg = service_config()
    assert cfg["loadBalancingConfig"] == [{"round_robin": {}}]
    policy = cfg["methodConfig"][0]["retryPolicy"]
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED"] and policy["maxAttempts"] >= 3


# ------------------------------------------------------------------- the real command line
def test_cli_with_mutual_tls_and_token(tmp_path, pki, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    srv = start_server(tmp_path, "secure", "--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]),
                       "--tls-client-ca", str(pki["ca"]), "--auth-token-file", str(token_file))
    try:
        assert "mutual TLS, bearer token" in srv.stderr, srv.stderr
        tls = ["--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["client_cert"]), "--tls-key", str(pki["client_key"])]
        assert healthcheck_main(["--address", srv.address, *tls]) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        assert healthcheck_main(["--address", srv.address, "--timeout", "2"]) == 1  # plaintext to a TLS port
        with AdvantageClient(srv.address, timeout=10, tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                             tls_key=pki["client_key"], token_file=token_file) as client:
            works(client)
        with AdvantageClient(srv.address, timeout=10, tls_ca=pki["ca"], tls_cert=pki["client_cert"],
                             tls_key=pki["client_key"]) as client:
            refused(client, grpc.StatusCode.UNAUTHENTICATED)
        assert stop_server(srv) == 0
        assert TOKEN not in srv.stderr + srv.stdout
    finally:
        srv.close()
    report(capsys, "CLI --tls-cert/--tls-key/--tls-client-ca/--auth-token-file: mTLS+token call OK, no token "
                   "UNAUTHENTICATED, healthcheck with client cert SERVING, without TLS unhealthy")


@pytest.mark.parametrize("flags,message", [
    (["--auth-token-file", "/nonexistent/token"], "--auth-token-file"),
    (["--tls-cert", "/nonexistent/cert.pem"], "--tls-key"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests"),
], ids=["token-file", "cert-without-key", "zero-limit"])
def test_cli_refuses_bad_security_and_limit_flags(capsys, flags, message):
    """`advantage-server` exits 2 naming the flag (run in-process: the CLI's main, its logging restored after)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        assert cli_main(["--host", "127.0.0.1", "--port", "0", "--device", "cpu", *flags]) == 2
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert message in err, err


# ------------------------------------------------------------------------------- logs
DISTINCT = 8675309.0  # a value no log line has a reason to contain


def test_logs_never_contain_tensor_values_or_credentials(tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    wrong_token = "wr0ng-t0ken-77c2d1"
    srv = start_server(tmp_path, "logs", "--auth-token-file", str(token_file), "--log-level", "DEBUG")
    rewards = np.array([DISTINCT, 1234567.5, -7654321.25, 31415926.0], np.float32)
    values = np.full((4, 3), 27182818.0, np.float32)
    calls = 0
    try:
        with AdvantageClient(srv.address, timeout=10, token=TOKEN) as client:
            client.compute("raw_reward", {"normalize_advantages": False}, rewards=rewards, mask=MASK)
            client.compute("gae", None, rewards=rewards, mask=MASK, values=values)
            bad = rewards.copy()
            bad[1] = np.nan
            for call in (lambda: client.compute("gae", None, rewards=bad, mask=MASK, values=values),      # NaN
                         lambda: client.compute("grpo", None, prompt_ids=np.arange(4), rewards=rewards,
                                                mask=MASK * 2),                                               # mask
                         lambda: client.compute("gae", {"gae_gamma": 8675309.0}, rewards=rewards, mask=MASK,
                                                values=values)):                                            # config
                with pytest.raises(AdvantageServiceError):
                    call()
            calls = 5
        with AdvantageClient(srv.address, timeout=10, token=wrong_token) as client:
            refused(client, grpc.StatusCode.UNAUTHENTICATED)
            calls += 1
        assert stop_server(srv) == 0
    finally:
        srv.close()
    logs = srv.stdout + srv.stderr
    assert logs.count("ComputeAdvantage") >= 5, f"expected one DEBUG line per call:\n{logs}"
    assert "missing or wrong bearer token" in logs  # the refusal is logged, without the token
    forbidden = [TOKEN, wrong_token, "8675309", "1234567", "7654321", "31415926", "27182818", "2718281"]
    forbidden += [struct.pack("<f", x).hex() for x in (DISTINCT, 27182818.0)]
    leaked = [f for f in forbidden if f in logs]
    assert not leaked, f"logs contain {leaked}:\n{logs}"
    report(capsys, f"log audit: {calls} calls (valid, NaN, bad mask, bad config, wrong token) at DEBUG, "
                   f"{len(logs.splitlines())} log lines, none holds a tensor value or a token")


def test_the_async_client_says_it_is_closed():
    """``AsyncAdvantageClient.compute`` after ``close()``: ValueError naming the client (was grpc.aio's
    ``UsageError: Channel is closed.``)."""
    import asyncio
    from advantage_client import AsyncAdvantageClient

    async def main():
        client = AsyncAdvantageClient("localhost:1", timeout=2)
        await client.close()
        with pytest.raises(ValueError, match="this AsyncAdvantageClient is closed"):
            await client.compute("raw_reward", None, rewards=REWARDS, mask=MASK)
    asyncio.run(main())
