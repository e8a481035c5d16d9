"""Issue 21, items 2, 4 and 8: the Python clients' addresses, per-call deadlines and event loop.

* a target without a port (``"localhost"``: gRPC dialled port 443 and said "no advantage service answered") or
  an int (``AdvantageClient(50051)``: a TypeError) is refused at construction with a ValueError that says how to
  give one; every form that worked still connects (host:port, [v6]:port, dns:///, ipv4:, lists of replicas);
* ``compute(..., timeout=)`` is that call's deadline on every transport, sync and asyncio, coalesced calls
  included, and no option-looking keyword (``timeout``, ``deadline``, ``retry``, a misspelt ``timout=5.0``) is
  ever sent as an input tensor;
* an ``AsyncAdvantageClient`` used outside the event loop it was made in says so and how to fix it.

Deadline tests use a call that takes milliseconds (8 MiB up, GAE) against a 1 us deadline, as
tests/test_newcomer.py::test_a_too_short_deadline_mentions_timeout does; the calls that must succeed get 60 s.
"""
from __future__ import annotations

import asyncio
import pathlib
import socket
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError, AsyncAdvantageClient, WireError
from advantage_client.aio import LOOP_RULE, EventLoopError
from advantage_client.channel import TargetError
from advantage_server import create_server

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIG = dict(rewards=torch.ones(256, 4096), mask=torch.ones(256, 4096), values=torch.zeros(256, 4096))  # GAE, 8 MiB
SMALL = dict(rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 3), values=torch.zeros(2, 3))
GROUP = dict(prompt_ids=np.zeros(4, np.int64), rewards=np.array([1.0, 0.0, 1.0, 0.0], np.float32),
             mask=np.ones((4, 3), np.float32))
# grpo's defaults (NeMo RL's): leave-one-out baseline (1 - 1/3 = 2/3 for a 1, 0 - 2/3 for a 0) over the group's
# std (ddof = 1: sqrt(1/3)), on every token of the row
EXPECTED_GROUP = np.repeat(np.array([2, -2, 2, -2])[:, None] / 3 / np.sqrt(1 / 3), 3, axis=1)


def port_of(target: str) -> str:
    return target.rpartition(":")[2]


# ------------------------------------------------------------------------------------------ targets
@pytest.mark.parametrize("bad, example", [
    ("localhost", "localhost:50051"),
    ("localhost:", "localhost:50051"),
    ("dns:///localhost", "dns:///localhost:50051"),
    ("dns://8.8.8.8/advantage.svc", "dns://8.8.8.8/advantage.svc:50051"),
    ("ipv4:127.0.0.1", "ipv4:127.0.0.1:50051"),
    ("ipv6:[::1]", "ipv6:[::1]:50051"),
    ("[::1]", "[::1]:50051"),
    (["localhost"], "localhost:50051"),
])
@pytest.mark.parametrize("cls", [AdvantageClient, AsyncAdvantageClient])
def test_a_target_without_a_port_is_refused_at_construction(cls, bad, example):
    with pytest.raises(ValueError) as exc:  # before: dialled port 443, "no advantage service answered at ..."
        cls(bad)
    name = bad[0] if isinstance(bad, list) else bad
    assert isinstance(exc.value, TargetError)
    assert str(exc.value) == (f"target {name!r} has no port: give host:port (the server's default port is 50051), "
                              f"e.g. {example!r}")


def test_the_message_for_localhost_is_the_issues():
    with pytest.raises(ValueError, match=r"^target 'localhost' has no port: give host:port \(the server's default "
                                         r"port is 50051\), e.g. 'localhost:50051'$"):
        AdvantageClient("localhost")


@pytest.mark.parametrize("cls", [AdvantageClient, AsyncAdvantageClient])
def test_a_bare_ipv6_address_is_told_to_take_brackets(cls):
    with pytest.raises(TargetError, match=r"IPv6 address takes brackets.*'\[::1\]:50051'"):
        cls("::1")


@pytest.mark.parametrize("cls", [AdvantageClient, AsyncAdvantageClient])
@pytest.mark.parametrize("bad, example", [(50051, "'localhost:50051'"), (8080, "'localhost:8080'"),
                                          (None, "'localhost:50051'"), (b"localhost:50051", "'localhost:50051'"),
                                          ([50051], "'localhost:50051'")])
def test_a_target_that_is_not_a_string_is_refused(cls, bad, example):
    with pytest.raises(ValueError) as exc:  # before: TypeError: 'int' object is not iterable
        cls(bad)
    assert isinstance(exc.value, TargetError)
    assert f"give 'host:port' as a string, e.g. {example}" in str(exc.value), str(exc.value)


def test_an_empty_target_is_refused():
    with pytest.raises(TargetError, match="is empty: give host:port"):
        AdvantageClient("")
    with pytest.raises(TargetError, match="at least one address"):
        AdvantageClient([])


def test_the_verl_dropin_names_the_environment_variable(monkeypatch):
    from advantage_client.verl import get_adv_estimator_fn
    monkeypatch.setenv("ADVANTAGE_SERVICE_TARGET", "advantage-svc")
    with pytest.raises(ValueError) as exc:
        get_adv_estimator_fn("grpo")
    assert str(exc.value) == ("target $ADVANTAGE_SERVICE_TARGET='advantage-svc' has no port: give host:port (the "
                              "server's default port is 50051), e.g. 'advantage-svc:50051'")


def test_the_nemo_dropin_refuses_it_too():
    from advantage_client import RemoteAdvantageEstimator
    with pytest.raises(TargetError, match="'localhost' has no port"):
        RemoteAdvantageEstimator("localhost", "grpo")


def good_targets(target: str) -> list:
    port = port_of(target)
    return [target, f"localhost:{port}", f"dns:///localhost:{port}", f"dns:///127.0.0.1:{port}",
            f"ipv4:127.0.0.1:{port}", f"ipv4:127.0.0.1:{port},127.0.0.1:{port}", [target],
            [f"127.0.0.1:{port}", f"127.0.0.1:{port}"]]


def test_every_form_that_worked_still_connects(target):
    for good in good_targets(target):
        with AdvantageClient(good, timeout=30.0) as client:
            names = [e.name for e in client.list_estimators().estimators]
            assert "grpo" in names, good
            got = client.compute("grpo", None, transport="unary", **GROUP)
            np.testing.assert_allclose(got.advantages.numpy(), EXPECTED_GROUP, rtol=1e-5)

    async def each():
        for good in good_targets(target):
            async with AsyncAdvantageClient(good, timeout=30.0) as client:
                got = await client.compute("grpo", None, as_numpy=True, **GROUP)
                np.testing.assert_allclose(got.advantages, EXPECTED_GROUP, rtol=1e-5)
    asyncio.run(each())


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_bracketed_ipv6_target_connects():
    server = create_server("::1", 0, device="cpu").start()
    try:
        port = port_of(server.address)
        for good in (f"[::1]:{port}", f"ipv6:[::1]:{port}", [f"[::1]:{port}", f"[::1]:{port}"]):
            with AdvantageClient(good, timeout=30.0) as client:
                got = client.compute("grpo", None, transport="unary", **GROUP)
            np.testing.assert_allclose(got.advantages.numpy(), EXPECTED_GROUP, rtol=1e-5)
    finally:
        server.stop(0)


def test_other_target_schemes_pass_as_given():
    # no port to check in a socket path, a vsock's own syntax or another resolver's URI: gRPC reads them
    for good in ("unix:/tmp/advantage.sock", "unix:///tmp/advantage.sock", "unix-abstract:advantage",
                 "vsock:2:50051", "xds:///advantage"):
        client = AdvantageClient(good, timeout=5.0, retry=False)
        assert client.target == good
        client.close()
    # a port that is a TCP service name passes as gRPC takes it (getaddrinfo: http is port 80); one that is not
    # a number nor such a name is refused at construction (tests/test_error_messages_ops.py)
    try:
        socket.getservbyname("http", "tcp")
    except OSError:  # no /etc/services (netbase) on this machine: gRPC could not resolve it either
        pass
    else:
        AdvantageClient("localhost:http").close()
    with pytest.raises(TargetError, match="port 'abc' is not a number"):
        AdvantageClient("localhost:abc")


# ------------------------------------------------------------------------------------------ per-call deadlines
def assert_deadline(err: BaseException, timeout: float) -> None:
    assert isinstance(err, AdvantageServiceError), repr(err)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, (err.code, str(err))  # before: INVALID_ARGUMENT
    assert not isinstance(err, ValueError)
    assert f"timeout={timeout:g}" in str(err) and "for this call alone" in str(err), str(err)


@pytest.mark.parametrize("transport", ["unary", "stream", "shm"])
def test_a_call_timeout_is_that_calls_deadline(transport, target):
    with AdvantageClient(target, timeout=60.0, transport=transport, chunk_mb=1) as client:
        if transport == "shm":  # a region large enough already: the deadline then ends the compute call itself
            client.compute("gae", None, **BIG)
            assert client.shm_region_count == 1
        with pytest.raises(AdvantageServiceError) as exc:
            client.compute("gae", None, timeout=1e-6, **BIG)
        assert_deadline(exc.value, 1e-6)
        assert client.last_transport == transport
        # the client's own deadline is back for the next call, and the client still works
        got = client.compute("gae", {"gae_gamma": 1.0, "gae_lambda": 1.0}, **SMALL)
        np.testing.assert_allclose(got.returns.numpy(), [[1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize("transport", ["unary", "stream", "shm", "auto"])
@pytest.mark.parametrize("timeout", [60.0, None])
def test_a_call_timeout_overrides_a_short_client_timeout(transport, timeout, target):
    """A client whose own deadline no call can meet: the call's timeout (or None: no deadline) is used, for the
    shared-memory registration the call needs too."""
    with AdvantageClient(target, timeout=1e-6, transport=transport, chunk_mb=1) as client:
        got = client.compute("gae", {"gae_gamma": 1.0, "gae_lambda": 1.0}, timeout=timeout, **SMALL)
        np.testing.assert_allclose(got.returns.numpy(), [[1, 1, 1], [0, 0, 0]])
        with pytest.raises(AdvantageServiceError) as exc:  # without one, the client's 1 us deadline
            client.compute("gae", None, **BIG)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_an_async_call_timeout_is_that_calls_deadline(transport, target):
    async def main():
        async with AsyncAdvantageClient(target, timeout=60.0, transport=transport, chunk_mb=1) as client:
            with pytest.raises(AdvantageServiceError) as exc:
                await client.compute("gae", None, timeout=1e-6, **BIG)
            assert_deadline(exc.value, 1e-6)
            got = await client.compute("gae", {"gae_gamma": 1.0, "gae_lambda": 1.0}, **SMALL)
            np.testing.assert_allclose(got.returns.numpy(), [[1, 1, 1], [0, 0, 0]])
        async with AsyncAdvantageClient(target, timeout=1e-6, transport=transport, chunk_mb=1) as client:
            for timeout in (60.0, None):
                got = await client.compute("gae", {"gae_gamma": 1.0, "gae_lambda": 1.0}, timeout=timeout, **SMALL)
                np.testing.assert_allclose(got.returns.numpy(), [[1, 1, 1], [0, 0, 0]])
    asyncio.run(main())


def test_a_coalesced_call_keeps_its_own_deadline(target, client):
    """A call waiting to be coalesced (a 60 s window here) ends at its own deadline, alone; one whose deadline is
    longer than the client's is sent alone under its own (the merged request would run under the client's)."""
    rng = np.random.default_rng(21)  # one group of 256 rows, T = 4096: a 4 MiB answer, never within 1 us
    big_group = dict(prompt_ids=np.zeros(256, np.int64), rewards=rng.integers(0, 2, 256).astype(np.float32),
                     mask=np.ones((256, 4096), np.float32))
    want = client.compute("grpo", None, as_numpy=True, **big_group).advantages

    async def main():
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=60_000.0) as co:
            task = asyncio.ensure_future(co.compute("grpo", None, timeout=0.2, **GROUP))
            with pytest.raises(AdvantageServiceError) as exc:
                await asyncio.wait_for(task, 30.0)  # never the 60 s window
            assert_deadline(exc.value, 0.2)
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=1.0) as co:
            await co.compute("grpo", None, **GROUP)  # reads the group-local rules once
            co.timeout = 1e-6  # no merged request can meet the client's deadline now
            got = await co.compute("grpo", None, as_numpy=True, timeout=60.0, **big_group)
            np.testing.assert_array_equal(got.advantages, want)
            with pytest.raises(AdvantageServiceError) as exc:
                await co.compute("grpo", None, **big_group)  # the client's deadline: the merged request fails
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    asyncio.run(main())


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "30", True])
def test_a_bad_call_timeout_is_refused(bad, client):
    with pytest.raises(ValueError, match="timeout="):
        client.compute("gae", None, timeout=bad, **SMALL)


@pytest.mark.parametrize("keyword, value, says", [
    ("deadline", 5.0, "compute takes timeout="),
    ("metadata", (("x-a", "b"),), "token= or token_file="),
    ("wait_for_ready", True, "option of the client"),
    ("retry", False, "option of the client"),
    ("compact", False, "option of the client"),
    ("wait_for_ready", None, "option of the client"),
    ("timout", 5.0, "compute has no option 'timout'"),
    ("transpotr", "unary", "compute has no option 'transpotr'"),
    ("per_sampel", True, "compute has no option 'per_sampel'"),
    ("rewards", 1.0, "compute has no option 'rewards'"),
    ("gamma", np.float32(0.9), "compute has no option 'gamma'"),
])
def test_options_are_never_sent_as_input_tensors(keyword, value, says):
    """Refused by the client before anything is sent: nothing listens at port 1, so a call that went out would
    be UNAVAILABLE (before: the server answered INVALID_ARGUMENT "gae does not read 'timeout'")."""
    with AdvantageClient("127.0.0.1:1", timeout=5.0, retry=False) as client:
        with pytest.raises(WireError) as exc:
            client.compute("gae", None, **{**SMALL, keyword: value})
    assert exc.value.field == keyword and says in str(exc.value), str(exc.value)
    assert not isinstance(exc.value, AdvantageServiceError)

    async def main():
        async with AsyncAdvantageClient("127.0.0.1:1", timeout=5.0, retry=False) as aclient:
            with pytest.raises(WireError) as aexc:
                await aclient.compute("gae", None, **{**SMALL, keyword: value})
            assert aexc.value.field == keyword and says in str(aexc.value), str(aexc.value)
    asyncio.run(main())


def test_an_async_client_option_is_named_as_its_own(client):
    async def main():
        async with AsyncAdvantageClient("127.0.0.1:1", timeout=5.0, retry=False) as aclient:
            with pytest.raises(WireError, match=r"AsyncAdvantageClient\(target, coalesce_ms=\.\.\.\)"):
                await aclient.compute("gae", None, coalesce_ms=5, **SMALL)
    asyncio.run(main())
    # a None input is still skipped, and mask_columns (a request field given beside lengths) still passes
    got = client.compute("grpo", None, as_numpy=True, prompt_ids=GROUP["prompt_ids"], rewards=GROUP["rewards"],
                         lengths=np.array([3, 3, 3, 3]), mask_columns=3, values=None)
    np.testing.assert_allclose(got.advantages, EXPECTED_GROUP, rtol=1e-5)


# ------------------------------------------------------------------------------------------ the event loop
def test_an_async_client_from_an_earlier_asyncio_run_names_the_rule(target):
    async def make():
        return AsyncAdvantageClient(target, timeout=30.0)
    client = asyncio.run(make())

    async def use():
        await client.compute("grpo", None, **GROUP)
    with pytest.raises(EventLoopError) as exc:  # before: RuntimeError "... attached to a different loop"
        asyncio.run(use())
    assert isinstance(exc.value, RuntimeError) and LOOP_RULE in str(exc.value)
    assert LOOP_RULE == ("create AsyncAdvantageClient inside the event loop that awaits it (e.g. inside your "
                         "async main, or `async with AsyncAdvantageClient(...)`)")

    async def listing():
        await client.list_estimators()
    with pytest.raises(EventLoopError):
        asyncio.run(listing())


def test_an_async_client_made_in_a_thread_without_a_loop_names_the_rule():
    caught: list[BaseException] = []

    def make():
        try:
            AsyncAdvantageClient("127.0.0.1:1")
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            caught.append(err)
    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(caught) == 1 and isinstance(caught[0], EventLoopError), caught
    assert "where no event loop runs" in str(caught[0]) and LOOP_RULE in str(caught[0])


def test_an_async_client_made_at_import_time_names_the_rule(target):
    script = ("import asyncio, sys\n"
              "from advantage_client import AsyncAdvantageClient\n"
              f"client = AsyncAdvantageClient({target!r}, timeout=30.0)  # at import: no loop runs\n"
              "async def main():\n"
              "    return await client.list_estimators()\n"
              "try:\n"
              "    asyncio.run(main())\n"
              "except RuntimeError as err:\n"
              "    print(type(err).__name__, err)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("EventLoopError ") and LOOP_RULE in out.stdout, out.stdout + out.stderr


def test_run_until_complete_on_the_current_loop_still_works(target):
    """Code that makes the client where no loop runs and drives the thread's current loop itself (the floor
    bench does) keeps working: the client belongs to that loop."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        client = AsyncAdvantageClient(target, timeout=30.0)
        got = loop.run_until_complete(client.compute("grpo", None, as_numpy=True, **GROUP))
        np.testing.assert_allclose(got.advantages, EXPECTED_GROUP, rtol=1e-5)
        loop.run_until_complete(client.close())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def test_readme_states_the_rule():
    text = (ROOT / "docs" / "python-client.md").read_text()  # the README's "Using it" until issue #29
    assert "EventLoopError" in text and "inside the event loop that awaits it" in text
    assert "timeout=" in text and "has no port" in text
