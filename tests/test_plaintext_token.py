"""A bearer token sent in plaintext to another machine is warned about (issue #37, a newcomer's finding: nothing
said that ``token=`` without TLS crosses the network readable). Loopback, unix sockets, TLS and a caller's own
channel stay quiet."""
from __future__ import annotations

import warnings

import grpc
import pytest

from advantage_client import AdvantageClient, PlaintextTokenWarning
from advantage_client.aio import AsyncAdvantageClient


@pytest.mark.parametrize("target, hosts", [("10.0.0.7:50051", "10.0.0.7"), ("trainer-svc:50051", "trainer-svc"),
                                           ("dns:///svc.ns:50051", "svc.ns"),
                                           ("ipv4:10.0.0.7:1,127.0.0.1:2", "10.0.0.7")])
def test_a_token_to_another_host_without_tls_warns_naming_it(target, hosts):
    with pytest.warns(PlaintextTokenWarning, match=f"unencrypted .* to {hosts}: .*tls_ca=") as got:
        AdvantageClient(target, token="s3cret").close()
    assert "s3cret" not in str(got[0].message)  # the warning never shows the token
    assert got[0].filename == __file__  # it points at the caller's line


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "localhost:50051", "[::1]:50051", "unix:/tmp/adv.sock",
                                    "ipv4:127.0.0.1:1,127.0.0.2:2", "0.0.0.0:50051"])
def test_loopback_and_unix_sockets_stay_quiet(target):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlaintextTokenWarning)
        AdvantageClient(target, token="s3cret").close()


def test_no_token_tls_or_an_own_channel_stay_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlaintextTokenWarning)
        AdvantageClient("10.0.0.7:50051").close()
        AdvantageClient("10.0.0.7:50051", token="s3cret", tls=True).close()
        with grpc.insecure_channel("10.0.0.7:50051") as ch:
            AdvantageClient("10.0.0.7:50051", token="s3cret", channel=ch).close()


def test_the_asyncio_client_warns_too():
    async def make():
        client = AsyncAdvantageClient("10.0.0.7:50051", token="s3cret")
        await client.close()
    import asyncio
    with pytest.warns(PlaintextTokenWarning):
        asyncio.run(make())
