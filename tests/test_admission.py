"""Issue #22 items 2, 3 and 8 (server half): admission that one client cannot monopolise.

* slow-loris by reopening: a client that opens calls and sends nothing (each cut by --stream-idle-timeout,
  then reopened at once) kept every --max-concurrent-requests place (legitimate callers: 0 of 196 unary and
  0 of 195 stream calls). Now a client within its share of calls waiting for their body
  (--max-pending-per-peer / --max-pending-per-connection) takes a place back from the client beyond it;
* health ``Watch`` streams were unlimited (~17 KiB each, no token needed): capped in all and per client host;
* a full replica stayed SERVING: its ``advantage.v1.AdvantageService`` health goes NOT_SERVING while every
  place stays taken, SERVING again when one frees ("" stays SERVING: the server is alive).

Real servers in-process on loopback. Two client hosts on one machine: the attacker connects over IPv4
(127.0.0.1), the legitimate caller over IPv6 (::1) to a second port of the same server (gRPC's peer address
then differs in its host part); the tests that need that skip where ::1 cannot be bound. No assertion on
timings: only counts, codes and messages; every wait is bounded (generously, for a loaded 2-core machine).
"""
from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request
from advantage_server import create_server
from advantage_server.limits import FullReport, Limits, peer_host

SERVICE = pb.DESCRIPTOR.services_by_name["AdvantageService"].full_name
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="::1 cannot be bound here (no IPv6 loopback)")


@contextlib.contextmanager
def two_host_server(**kwargs):
    """A server on 127.0.0.1 (``.address``) and on [::1] (returned second): two client hosts on one machine."""
    srv = create_server("127.0.0.1", 0, device="cpu", **kwargs)
    v6 = srv.grpc_server.add_insecure_port("[::1]:0")
    assert v6, "could not bind [::1]"
    srv.start()
    try:
        yield srv, f"[::1]:{v6}"
    finally:
        srv.stop(grace=1.0)


def _request(i: int = 0) -> pb.ComputeAdvantageRequest:
    return build_request("raw_reward", None, rewards=[float(i), 0.0], mask=[[1.0], [1.0]])


def _stream_chunks(request: pb.ComputeAdvantageRequest):
    data = request.SerializeToString()
    yield pb.ComputeAdvantageChunk(total_size=len(data), data=data).SerializeToString()


class SlowLoris:
    """``threads`` loops over ``channels`` (round robin), each opening a call that sends nothing (unary: no
    message; stream: no chunk) and reopening it as soon as the server ends it, until stopped."""

    def __init__(self, channels: list[grpc.Channel], threads: int, kind: str):
        self.channels, self.kind = channels, kind
        self.stop = threading.Event()
        self.codes: list[str] = []
        self.details: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def _loop(self, i: int) -> None:
        channel = self.channels[i % len(self.channels)]
        while not self.stop.is_set():
            ended = threading.Event()

            def silent():  # the request: nothing, until the call has ended
                ended.wait(60)
                return
                yield
            try:
                if self.kind == "unary":
                    channel.stream_unary(f"/{SERVICE}/ComputeAdvantage")(silent(), timeout=60)
                else:
                    list(channel.stream_stream(f"/{SERVICE}/ComputeAdvantageStream")(silent(), timeout=60))
                code, detail = "OK", ""
            except grpc.RpcError as err:
                code, detail = err.code().name, err.details() or ""
            finally:
                ended.set()
            with self._lock:
                self.codes.append(code)
                self.details.append(detail)
            time.sleep(0.005)  # and again (5 ms: at once next to the 2 s timeout; spares the 2 shared cores)

    def __enter__(self) -> "SlowLoris":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(90)


def _wait_for(predicate, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        time.sleep(0.02)


def _legit_calls(target: str, kind: str, n: int) -> list[str]:
    """``n`` calls one after the other from another host; their status names (results checked when OK)."""
    codes = []
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        for i in range(n):
            try:
                if kind == "unary":
                    reply = stub.ComputeAdvantage(_request(i), timeout=20)
                    assert np.isfinite(np.frombuffer(reply.advantages.data, np.float32)).sum() == 2
                else:
                    replies = list(channel.stream_stream(f"/{SERVICE}/ComputeAdvantageStream")(
                        _stream_chunks(_request(i)), timeout=20))
                    assert replies
                codes.append("OK")
            except grpc.RpcError as err:
                codes.append(err.code().name)
    return codes


# ------------------------------------------------------------------ item 2: slow-loris by reopening
@needs_ipv6
@pytest.mark.parametrize("kind", ["unary", "stream"])
@pytest.mark.parametrize("connections", [1, 4])
def test_a_slow_loris_keeps_only_its_share_and_legitimate_calls_go_through(kind, connections):
    """The issue's setting (4 places, --stream-idle-timeout 2): 8 loops of stalled calls from one host, over one
    connection or four, reopened as soon as they end. A caller from another host then makes 30 calls one after
    the other: at least 90% succeed (before: 0%), each by cutting one of the attacker's calls beyond its share
    (--max-pending-per-peer=1: max(1, 4 // 4)), whose status names the flag."""
    with two_host_server(max_concurrent_requests=4, workers=2, stream_idle_timeout=2.0) as (srv, legit_target):
        assert srv.limits.pending_per_peer == 1 and srv.limits.pending_per_connection == 1
        opts = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
        channels = [grpc.insecure_channel(srv.address, options=opts) for _ in range(connections)]
        try:
            with SlowLoris(channels, threads=8, kind=kind) as loris:
                _wait_for(lambda: srv.gate.full, what="the attacker filling every place")
                codes = _legit_calls(legit_target, kind, 30)
                evictions = srv.uploads.evictions
        finally:
            for c in channels:
                c.close()
    ok = codes.count("OK")
    assert ok >= 27, f"{ok} of 30 legitimate {kind} calls succeeded: {codes}"
    assert evictions > 0  # places came from the attacker's calls beyond its share (others found one free)
    cut = [d for d in loris.details if "cut to give its place" in d]
    assert cut and all("--max-pending-per-" in d for d in cut), loris.details[:5]
    assert set(loris.codes) <= {"RESOURCE_EXHAUSTED", "CANCELLED", "UNAVAILABLE"}, set(loris.codes)


@needs_ipv6
def test_a_client_within_its_share_is_not_cut_and_does_not_take_places_it_has():
    """A full server whose places are taken by clients within their shares (2 hosts, 2 stalled calls each,
    --max-pending-per-peer 2): a third call from either host is refused naming --max-concurrent-requests, and
    nobody's call is cut to make room for it."""
    with two_host_server(max_concurrent_requests=4, workers=1, stream_idle_timeout=30.0,
                         max_pending_per_peer=2) as (srv, v6_target):
        with grpc.insecure_channel(srv.address) as a, grpc.insecure_channel(v6_target) as b:
            release = threading.Event()

            def silent():
                release.wait(30)
                return
                yield
            held = [ch.stream_unary(f"/{SERVICE}/ComputeAdvantage").future(silent(), timeout=30)
                    for ch in (a, a, b, b)]
            try:
                _wait_for(lambda: srv.gate.full, what="4 stalled calls admitted")
                for ch in (a, b):
                    with pytest.raises(grpc.RpcError) as err:
                        pb_grpc.AdvantageServiceStub(ch).ComputeAdvantage(_request(), timeout=10)
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "--max-concurrent-requests=4" in err.value.details()
                assert srv.uploads.evictions == 0
                assert not any(f.done() for f in held)
            finally:
                release.set()
                for f in held:
                    f.cancel()


def test_a_burst_beyond_the_share_is_served_while_there_is_room(make_server):
    """The share bounds what a client keeps when others need places, not its burst: 16 concurrent calls over one
    connection against --max-concurrent-requests 16 (share 4) all succeed."""
    srv = make_server(max_concurrent_requests=16, workers=4)
    assert srv.limits.pending_per_connection == 4
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        with futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda i: stub.ComputeAdvantage(_request(i), timeout=30), range(16)))
    assert all(np.isfinite(np.frombuffer(r.advantages.data, np.float32)).sum() == 2 for r in replies)
    assert srv.uploads.evictions == 0


def test_peer_host_and_the_share_flags():
    assert peer_host("ipv4:10.1.2.3:5678") == "ipv4:10.1.2.3"
    assert peer_host("ipv6:[::1]:5678") == "ipv6:[::1]"
    assert peer_host("ipv6:[::ffff:10.1.2.3]:5678") == "ipv4:10.1.2.3"  # an IPv4 client on an IPv6 socket
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock" and peer_host("unknown") == "unknown"
    assert Limits(max_concurrent_requests=32).pending_per_peer == 8
    assert Limits(max_concurrent_requests=3).pending_per_peer == 1
    assert Limits(max_pending_per_peer=5, max_pending_per_connection=2).pending_per_connection == 2
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="--max-pending-per-peer"):
            Limits(max_pending_per_peer=bad)
    from advantage_server.cli import build_parser, main
    args = build_parser().parse_args(["--max-pending-per-peer", "3", "--max-pending-per-connection", "2"])
    assert (args.max_pending_per_peer, args.max_pending_per_connection) == (3, 2)
    for flag in ("--max-pending-per-peer", "--max-pending-per-connection"):
        assert main(["--port", "0", "--device", "cpu", flag, "0"]) == 2


def test_every_ipv4_loopback_address_is_one_host():
    """All of 127.0.0.0/8 is this machine: a same-host client binding its connections to 127.0.0.2, 127.0.0.3, ...
    must not get one pending share (and one health Watch share) per address."""
    assert peer_host("ipv4:127.0.0.2:5678") == peer_host("ipv4:127.255.3.4:1") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::ffff:127.0.0.9]:5678") == "ipv4:127.0.0.1"
    assert peer_host("ipv4:10.1.2.3:5678") == "ipv4:10.1.2.3" and peer_host("ipv6:[::1]:5678") == "ipv6:[::1]"


def _can_bind(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def _source_proxy(source: str, port: int) -> str:
    """A TCP relay on 127.0.0.1 whose connections reach the server at 127.0.0.1:``port`` from ``source``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with listener:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                up = socket.socket()
                up.bind((source, 0))
                up.connect(("127.0.0.1", port))
                threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
                threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


@needs_ipv6
@pytest.mark.skipif(not all(_can_bind(f"127.0.0.{i}") for i in range(2, 6)),
                    reason="127.0.0.2-5 cannot be bound here")
def test_a_slow_loris_rotating_loopback_addresses_keeps_only_one_share():
    """4 places (share 1): one stalled call from each of 127.0.0.2..5 filled the server with every source
    "within its share", so a caller from another host (::1) was refused 3 of 3 (no eviction). They are one host
    now: the caller cuts one of them and is served."""
    with two_host_server(max_concurrent_requests=4, workers=2, stream_idle_timeout=30.0) as (srv, v6_target):
        port = int(srv.address.rsplit(":", 1)[1])
        release = threading.Event()

        def silent():
            release.wait(30)
            return
            yield
        opts = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.insecure_channel(_source_proxy(f"127.0.0.{i}", port), options=opts) for i in range(2, 6)]
        held = [ch.stream_unary(f"/{SERVICE}/ComputeAdvantage").future(silent(), timeout=30) for ch in channels]
        try:
            _wait_for(lambda: srv.gate.full, what="4 stalled calls from 4 loopback addresses admitted")
            codes = _legit_calls(v6_target, "unary", 3)
            assert codes == ["OK"] * 3, codes
            assert srv.uploads.evictions >= 1
        finally:
            release.set()
            for f in held:
                f.cancel()
            for ch in channels:
                ch.close()


# ------------------------------------------------------------------ item 3: health Watch streams are capped
def _watch(channel: grpc.Channel, service: str = ""):
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=60)


@needs_ipv6
def test_health_watch_streams_are_capped_per_host_and_in_all():
    with two_host_server() as (srv, v6_target):
        health = srv.health
        assert (health.max_watches, health.max_watches_per_peer) == (1024, 128)  # the defaults
        health.max_watches, health.max_watches_per_peer = 8, 5
        with grpc.insecure_channel(srv.address) as a, grpc.insecure_channel(v6_target) as b:
            opened = []
            for _ in range(5):  # host A's share
                s = _watch(a)
                assert next(s).status == SERVING
                opened.append(s)
            with pytest.raises(grpc.RpcError) as err:
                next(_watch(a))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "per host" in err.value.details() and "ipv4:127.0.0.1" in err.value.details()
            for _ in range(3):  # host B, up to the server's total of 8
                s = _watch(b)
                assert next(s).status == SERVING
                opened.append(s)
            with pytest.raises(grpc.RpcError) as err:
                next(_watch(b))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "8 health Watch" in err.value.details()
            refused = 0
            for _ in range(50):  # a flood: every one refused, the count (what memory follows) stays at the cap
                with pytest.raises(grpc.RpcError):
                    next(_watch(a))
                refused += 1
            assert health.watches == 8 and health.watch_refusals == 52
            # Check stays unlimited and answers
            assert health_pb2_grpc.HealthStub(a).Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
            for s in opened:
                s.cancel()
            _wait_for(lambda: health.watches == 0, what="closed Watch streams released")
            s = _watch(a)  # the places came back
            assert next(s).status == SERVING
            s.cancel()


def test_max_concurrent_streams_is_set_per_connection():
    assert Limits().max_streams_per_connection == 100
    assert Limits(max_concurrent_requests=500).max_streams_per_connection == 500 + 16


# ------------------------------------------------------------------ item 8: a full server says so
@pytest.fixture
def blocked_grpo(monkeypatch):
    """grpo computations wait until ``release`` is set (``entered`` counts those waiting)."""
    from advantage_server.estimators.registry import REGISTRY
    grpo = REGISTRY["grpo"]
    state = {"release": threading.Event(), "entered": 0}
    lock = threading.Lock()

    def held(cfg, batch):
        with lock:
            state["entered"] += 1
        assert state["release"].wait(60), "the test never released the held calls"
        return grpo.fn(cfg, batch)
    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(grpo, fn=held))
    yield state
    state["release"].set()


def _status(channel: grpc.Channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_a_full_server_reports_not_serving_and_serving_again_when_a_place_frees(make_server, blocked_grpo):
    srv = make_server(max_concurrent_requests=2, workers=2)
    grpo = build_request("grpo", None, prompt_ids=[0, 0], rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    with grpc.insecure_channel(srv.address) as channel:
        watch = _watch(channel, SERVICE)
        assert next(watch).status == SERVING
        stub = pb_grpc.AdvantageServiceStub(channel)
        held = [stub.ComputeAdvantage.future(grpo, timeout=60) for _ in range(2)]
        _wait_for(lambda: blocked_grpo["entered"] == 2, what="both places computing")
        assert next(watch).status == NOT_SERVING  # after FULL_REPORT_AFTER seconds full
        assert _status(channel, SERVICE) == NOT_SERVING
        assert _status(channel, "") == SERVING  # alive: the liveness probe's service stays SERVING
        blocked_grpo["release"].set()
        for f in held:
            assert f.result(timeout=60).advantages.data
        assert next(watch).status == SERVING
        assert _status(channel, SERVICE) == SERVING
        watch.cancel()
    assert srv.full_report.changes == 2


def test_full_report_flapping_is_bounded():
    """The report changes only after ``after`` seconds full without a break: a server that fills for moments
    never leaves the rotation, and one that stays full at the edge changes status at most twice per ``after``."""
    seen: list[bool] = []
    report = FullReport(seen.append, after=0.3).start()
    try:
        for _ in range(200):  # full for 5 ms at a time: never reported
            report(True)
            time.sleep(0.005)
            report(False)
        time.sleep(0.4)
        assert seen == []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:  # full a little longer than ``after``, then freed for a moment
            report(True)
            time.sleep(0.35)
            report(False)
            time.sleep(0.02)
        report(False)
        elapsed = time.monotonic() - t0
        _wait_for(lambda: not seen or seen[-1] is True, what="the final SERVING")
    finally:
        report.stop()
    assert len(seen) <= 2 * (elapsed / 0.3) + 2, (len(seen), elapsed)
    assert all(a != b for a, b in zip(seen, seen[1:]))  # alternating: each report is a change
