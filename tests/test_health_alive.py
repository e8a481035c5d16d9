"""Issue #27: health means alive, and what anonymous callers hold cannot take a token holder's calls.

* item 1: with ``--auth-token-file``, a client without the token opens 128 health ``Watch`` streams from this host
  (the per-host bound). Before: the next client's own health ``Watch`` (gRPC's client-side health checking,
  ``advantage_client.channel.service_config``'s ``healthCheckConfig``) was refused RESOURCE_EXHAUSTED, gRPC marked
  the replica unhealthy and a token holder's ``AdvantageClient`` failed 5 of 5 calls UNAVAILABLE. Now a ``Watch``
  beyond the bound is answered UNIMPLEMENTED, which gRPC takes as "healthy" (grpc/doc/health-checking.md): 5 of 5.
* gRPC's backstop (``maximum_concurrent_rpcs``, 4x the thread pool: 68 on a server with 1 place and 1 worker)
  leaves room for every allowed ``Watch`` stream plus the pool's calls: open ``Watch`` streams are not counted
  against it (the health servicer is non-blocking; gRPC counts a call only while its handler runs on the pool),
  so 128 of them beside a backstop of 68 leave compute calls served. A guard: this held before the issue too.
* item 8 (the drain's part): an admitted call whose request never sends a byte is cut at the drain with
  UNAVAILABLE (the client sends it to another replica) instead of holding the drain for the whole ``--grace``;
  a call that has its body keeps computing and is answered.

Real servers in-process on loopback; counts, codes and values are asserted, never timings (every wait is bounded).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_client import AdvantageClient
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import AdvantageServiceError, build_request
from advantage_server.core import AdvantageCore
from advantage_server.limits import BACKSTOP_FACTOR
from advantage_server.shares import MAX_WATCHES_PER_HOST

SERVICE = pb.DESCRIPTOR.services_by_name["AdvantageService"].full_name
TOKEN = "t0ken-for-the-health-tests"
PROMPTS = np.array([0, 0, 1, 1], np.int64)
REWARDS = np.array([1.0, 0.0, 2.0, 5.0], np.float32)
MASK = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)
#: the server's own core on this process, before any test patches the registry
WANT = AdvantageCore("cpu").run("grpo", None, {"prompt_ids": torch.from_numpy(PROMPTS), "rewards": torch.from_numpy(
    REWARDS), "mask": torch.from_numpy(MASK)}).advantages.numpy()


def _wait_for(predicate, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        time.sleep(0.02)


def token_holder_calls(address: str, timeout: float, n: int = 5) -> list[str]:
    """``n`` GRPO calls of a token holder's new ``AdvantageClient`` (unary, its channel health-checking the
    service): "OK" for each answer equal to ``WANT``, else the error's status code name."""
    codes = []
    with AdvantageClient(address, timeout=timeout, token=TOKEN, transport="unary") as client:
        for _ in range(n):
            try:
                out = client.compute("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS, mask=MASK)
                np.testing.assert_allclose(np.asarray(out.advantages), WANT, rtol=1e-5, atol=1e-6)
                codes.append("OK")
            except AdvantageServiceError as exc:
                codes.append(exc.code.name)
    return codes


class WatchFlood:
    """``n`` health ``Watch`` streams held open from this host without a token, over channels of their own (one
    connection each, at most 50 streams per connection: under gRPC's per-connection stream limit)."""

    def __init__(self, address: str, n: int):
        self.channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range((n + 49) // 50)]
        self.streams = []
        for i in range(n):
            stream = health_pb2_grpc.HealthStub(self.channels[i // 50]).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=120)
            assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
            self.streams.append(stream)

    def close(self) -> None:
        for stream in self.streams:
            stream.cancel()
        for channel in self.channels:
            channel.close()


def test_a_tokenless_watch_flood_does_not_lock_out_a_token_holder(make_server):
    srv = make_server(auth_token=TOKEN)
    flood = WatchFlood(srv.address, MAX_WATCHES_PER_HOST)  # every Watch this host may hold
    try:
        assert srv.health.watches == MAX_WATCHES_PER_HOST
        # a token holder's client from the same host: its channel health-checks the service (its Watch is beyond
        # the bound), and calls
        codes = token_holder_calls(srv.address, timeout=20)
        assert codes == ["OK"] * 5, codes  # before: 5 x UNAVAILABLE ("health check call failed")
        # the flood's next Watch is beyond the bound: UNIMPLEMENTED (gRPC: "no health checking, assume healthy")
        with pytest.raises(grpc.RpcError) as err:
            next(health_pb2_grpc.HealthStub(flood.channels[0]).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value
        assert srv.health.watches == MAX_WATCHES_PER_HOST  # the bound still holds (memory)
        assert srv.health.watch_refusals >= 2  # the flood's extra one and the client's
    finally:
        flood.close()


def test_watch_streams_cannot_fill_the_grpc_backstop(make_server):
    """A server with 1 place and 1 worker (a pool of 19 threads, two of them for the waiting room; gRPC's backstop
    76 calls): 128 open Watch
    streams from one host (all it may hold) and the compute calls still go through: open Watch streams hold no
    thread and no place in gRPC's ``maximum_concurrent_rpcs``."""
    srv = make_server(max_concurrent_requests=1, workers=1)
    assert srv.limits.grpc_max_concurrent_rpcs == srv.limits.thread_pool_size * BACKSTOP_FACTOR == 76
    assert srv.limits.grpc_max_concurrent_rpcs < MAX_WATCHES_PER_HOST
    flood = WatchFlood(srv.address, MAX_WATCHES_PER_HOST)
    try:
        assert srv.health.watches == MAX_WATCHES_PER_HOST
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.AdvantageServiceStub(channel)
            for _ in range(3):
                reply = stub.ComputeAdvantage(build_request("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS,
                                                            mask=MASK), timeout=20)
                got = np.frombuffer(reply.advantages.data, np.float32).reshape(WANT.shape)
                np.testing.assert_allclose(got, WANT, rtol=1e-5, atol=1e-6)
    finally:
        flood.close()


# ------------------------------------------------------------------ the drain cuts uploads that never began
@pytest.fixture
def blocked_grpo(monkeypatch):
    """grpo computations wait until ``release`` is set (``entered`` counts those waiting)."""
    from advantage_server.estimators.registry import REGISTRY
    grpo = REGISTRY["grpo"]
    state = {"release": threading.Event(), "entered": 0}

    def held(cfg, batch):
        state["entered"] += 1
        assert state["release"].wait(60), "the test never released the held call"
        return grpo.fn(cfg, batch)
    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(grpo, fn=held))
    yield state
    state["release"].set()


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_the_drain_cuts_an_upload_that_never_began(make_server, blocked_grpo, caplog, kind):
    srv = make_server(max_concurrent_requests=4, workers=2, stream_idle_timeout=60.0)
    request = build_request("grpo", None, prompt_ids=PROMPTS, rewards=REWARDS, mask=MASK)
    ended = threading.Event()
    silent_result: dict = {}

    def silent():  # the request: nothing, until the test ends
        ended.wait(60)
        return
        yield

    def hold_silent() -> None:
        try:
            if kind == "unary":
                channel.stream_unary(f"/{SERVICE}/ComputeAdvantage")(silent(), timeout=60)
            else:
                list(channel.stream_stream(f"/{SERVICE}/ComputeAdvantageStream")(silent(), timeout=60))
            silent_result["code"] = "OK"
        except grpc.RpcError as err:
            silent_result["code"], silent_result["details"] = err.code(), err.details()

    with grpc.insecure_channel(srv.address) as channel:
        working = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage.future(request, timeout=60)
        _wait_for(lambda: blocked_grpo["entered"] == 1, what="the working call computing")
        holder = threading.Thread(target=hold_silent, daemon=True)
        holder.start()
        _wait_for(lambda: srv.gate.in_flight == 2, what="the silent call admitted")
        stopper = threading.Thread(target=srv.stop, kwargs={"grace": 30.0}, daemon=True)
        with caplog.at_level(logging.INFO, logger="advantage_server"):
            stopper.start()
            holder.join(20)  # cut at the drain's start (before: held until the grace ran out, 30 s)
            assert not holder.is_alive(), "the silent call still held the drain"
            assert silent_result["code"] == grpc.StatusCode.UNAVAILABLE, silent_result
            assert "had not begun to arrive" in silent_result["details"]
            assert srv.uploads.silent_cuts == 1
            assert not working.done()  # the call with its body is not cut: it finishes
            blocked_grpo["release"].set()
            reply = working.result(timeout=30)
            stopper.join(30)
        assert not stopper.is_alive()
        ended.set()
    np.testing.assert_allclose(np.frombuffer(reply.advantages.data, np.float32).reshape(WANT.shape), WANT,
                               rtol=1e-5, atol=1e-6)
    assert not any("grace period" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ silent health calls hold no service thread
class SilentHealth:
    """``n`` health calls (``Check`` or ``Watch``) that send their headers and never their request message, held
    open ``hold`` seconds: what grpcio took a pool thread for and waited on without a time limit."""

    def __init__(self, address: str, n: int, method: str = "Check", hold: float = 30.0, own_connection: bool = False):
        self.release = threading.Event()
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)] if own_connection else [])
        self.codes: list[grpc.StatusCode] = []

        def silent():
            self.release.wait(hold)
            return
            yield  # never reached: a request stream with no message
        call = (self.channel.stream_unary if method == "Check" else self.channel.stream_stream)(
            f"/grpc.health.v1.Health/{method}", request_serializer=None, response_deserializer=None)
        self.futures = [call.future(silent(), timeout=hold) if method == "Check" else call(silent(), timeout=hold)
                        for _ in range(n)]

    def ended(self) -> int:
        """How many of the calls have ended (and their codes, in ``codes``)."""
        done = 0
        for f in self.futures:
            if isinstance(f, grpc.Future):
                done += f.done()
            else:
                done += f.code() is not None if f.done() else 0
        return done

    def close(self) -> None:
        self.release.set()
        for f in self.futures:
            f.cancel()
        self.channel.close()


@pytest.mark.parametrize("method", ["Check", "Watch"])
def test_silent_health_calls_hold_no_service_thread(make_server, method, caplog):
    """RELIABILITY.md's H1: 40 tokenless health calls whose request message never comes (more than the server's
    whole pool of 22 threads at 2 places). Before: each held a pool thread until its own 30 s deadline, and a token
    holder's call timed out. Now health runs on its own 4-thread pool, a host has at most 2 health calls waiting for
    their request for ``HEALTH_REQUEST_S`` (then CANCELLED), its others for ``HEALTH_BUSY_REQUEST_S`` (then
    UNIMPLEMENTED): the token holder's calls and a same-host ``Watch`` are served meanwhile, and a health ``Check``
    is answered SERVING once the silent calls have ended."""
    srv = make_server(auth_token=TOKEN, max_concurrent_requests=2, workers=1)
    assert srv.limits.thread_pool_size < 40
    silent = SilentHealth(srv.address, 40, method)
    try:
        codes = token_holder_calls(srv.address, timeout=10)
        assert codes == ["OK"] * 5, codes  # before: DEADLINE_EXCEEDED
        # an ordinary Watch from the same host is served beside them (its message comes with its headers)
        with grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE),
                                                              timeout=20)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        # every silent call ends long before its own 30 s deadline: at most 2 of the host's at a time wait
        # HEALTH_REQUEST_S (CANCELLED), the others HEALTH_BUSY_REQUEST_S (UNIMPLEMENTED)
        _wait_for(lambda: silent.ended() == 40, timeout=15, what="the silent health calls ended by the server")
        got = collections.Counter(f.code() for f in silent.futures)
        assert set(got) <= {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED}, got
        assert got[grpc.StatusCode.CANCELLED] >= 2 and got[grpc.StatusCode.UNIMPLEMENTED] >= 20, got
        with grpc.insecure_channel(srv.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                              timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # a call the server ended before its message came leaves quietly: a handler that returned None for it had
        # gRPC log "Exception serializing message!" with a traceback for each (hundreds under a flood)
        noise = [r.getMessage() for r in caplog.records if r.name.startswith("grpc")]
        assert not noise, noise[:3]
    finally:
        silent.close()


class HealthFlood:
    """An attacker's silent health ``Check`` calls (no request message, ever), ``n`` open at once from this host over
    connections of their own, each reopened as soon as the server ends it, until :meth:`close`."""

    def __init__(self, address: str, n: int, per_connection: int = 75):
        self.channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range((n + per_connection - 1) // per_connection)]
        self.stop, self.release = threading.Event(), threading.Event()
        self.codes: collections.Counter = collections.Counter()

        def silent():
            self.release.wait(60)  # then the request stream ends without a message (INVALID_ARGUMENT)
            return
            yield  # never reached: a request stream with no message
        self.calls = [ch.stream_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                      response_deserializer=None) for ch in self.channels]
        self.futures = [self.calls[i // per_connection].future(silent(), timeout=60) for i in range(n)]

        def refill():
            while not self.stop.wait(0.01):
                for i, f in enumerate(self.futures):
                    if f.done():
                        code = f.code()
                        if code == grpc.StatusCode.UNAVAILABLE and "RST_STREAM" in (f.exception().details() or ""):
                            code = "REFUSED_STREAM"  # see the test's last assertion
                        self.codes[code] += 1
                        self.futures[i] = self.calls[i // per_connection].future(silent(), timeout=60)
        self.thread = threading.Thread(target=refill, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)  # codes recorded: then the open calls are cancelled
        for f in self.futures:
            f.cancel()
        self.release.set()
        for ch in self.channels:
            ch.close()


def test_a_flood_of_silent_health_calls_leaves_the_service_its_calls(make_server, capsys):
    """A tokenless attacker keeps 300 health ``Check`` calls open that never send their request message (reopened as
    the server ends them), from one host over 4 connections, against a server whose gRPC backstop
    (``maximum_concurrent_rpcs``) is 88. gRPC counts a call queued for the health pool against that backstop, so
    before the health queue had a limit the flood held it full and gRPC refused other calls ("Concurrent RPC limit
    exceeded!"): the token holder's channel had its health ``Watch`` refused, took the server as unhealthy and
    failed 5 of 5 calls UNAVAILABLE (measured with the limit taken out). Now at most half the
    backstop waits for a health thread (the rest are answered UNIMPLEMENTED at once, without a thread): the token
    holder gets 5 of 5 while the flood goes on; a fresh ``Check`` meanwhile is answered SERVING or, when it finds the
    queue full, UNIMPLEMENTED (never left waiting), and SERVING after the flood (within a second on a quiet machine)."""
    from reliability_support import report
    srv = make_server(auth_token=TOKEN, max_concurrent_requests=2, workers=1)
    backstop = srv.limits.grpc_max_concurrent_rpcs
    assert backstop == 88 and srv.health_reads.queue.limit == backstop // 2
    flood = HealthFlood(srv.address, 300)
    try:
        _wait_for(lambda: srv.health_reads.queue.refused > 0, timeout=10, what="the health queue full")
        time.sleep(1.0)  # the flood at its steady state: every ended call reopened
        active = srv.grpc_server._state.active_rpc_count  # gRPC's own count against the backstop
        codes = token_holder_calls(srv.address, timeout=10)
        assert codes == ["OK"] * 5, codes  # before: UNAVAILABLE x 5 (gRPC's backstop full)
        checks = []
        with grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(10):
                t = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
                    checks.append(("SERVING", time.monotonic() - t))
                except grpc.RpcError as err:
                    # a full queue's refusal (gRPC's "Method not found!"), never the reaper's: this call's message
                    # came with its headers
                    checks.append((err.code().name if err.details() == "Method not found!" else
                                   f"{err.code().name}: {err.details()}", time.monotonic() - t))
        # (never DEADLINE_EXCEEDED at 5 s: about a second at most on a quiet machine, 2.4 s seen on a swamped one)
        assert {c for c, _ in checks} <= {"SERVING", "UNIMPLEMENTED"}, checks
    finally:
        flood.close()
    assert active <= backstop // 2 + 4 + 8, active  # the queue, the health threads, a few calls on their way
    t_end = time.monotonic()
    with grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    after = time.monotonic() - t_end
    # the attacker's calls end UNIMPLEMENTED or CANCELLED (the health queue, the reaper), or are refused by gRPC's
    # per-connection stream limit (RST_STREAM REFUSED_STREAM, UNAVAILABLE at the client: it reopens a call as soon
    # as the last one's status arrives, before the server has let its stream go; seen on a swamped machine)
    assert set(flood.codes) <= {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED, "REFUSED_STREAM"}, \
        flood.codes
    report(capsys, f"health flood: 300 silent Check calls kept open against a backstop of {backstop}: gRPC's count "
                   f"{active}, token holder {codes.count('OK')}/5, {srv.health_reads.queue.refused} refused at the "
                   f"full queue; 10 fresh Checks meanwhile: {collections.Counter(c for c, _ in checks)}, slowest "
                   f"{max(s for _, s in checks):.2f} s; SERVING {after:.2f} s after the flood ended")


def test_health_queue_entries_never_taken_up_drop_out_of_the_count(monkeypatch):
    """gRPC may refuse a call at its backstop after the handler lookup counted it in the health queue; its
    behaviour never runs, so it is never taken up. Such entries drop out of the count once older than the
    queue's expiry, so leaked entries cannot keep the queue full (a fresh-eyes review reproduced every health
    call UNIMPLEMENTED for 10 s after such leaks)."""
    from advantage_server import health_service as hs
    now = [1000.0]
    monkeypatch.setattr(hs.time, "monotonic", lambda: now[0])
    queue = hs._HealthQueue(limit=4)
    import contextvars
    for _ in range(4):  # counted at the lookup, never taken up
        assert contextvars.copy_context().run(queue.enter)
    assert queue.queued == 4 and not contextvars.copy_context().run(queue.enter) and queue.refused == 1
    expiry = hs._QUEUE_EXPIRY_S + 4 * hs.HEALTH_MIN_READ_S / hs.HEALTH_THREADS
    now[0] += expiry + 0.01
    ctx = contextvars.copy_context()
    assert ctx.run(queue.enter) and queue.queued == 1  # the four leaked entries dropped; this one counted
    assert ctx.run(queue.take) == now[0] and queue.queued == 0


def test_the_health_port_takes_small_messages_only_and_its_pool_ends_with_the_server(make_server):
    """Health needs no token, and gRPC opens a pending read's window for the whole message (up to the server's
    receive limit): the ``--health-port`` server takes messages of at most ``HEALTH_MAX_MESSAGE_BYTES`` (a health
    request is a service name), so a tokenless 1 MiB ``Check`` is refused RESOURCE_EXHAUSTED there while an
    ordinary one is answered. And the health pools and their reaper threads end when the server stops (they were
    left running: five threads per stopped server)."""
    from advantage_server.metrics import HEALTH_MAX_MESSAGE_BYTES, HealthPort
    srv = make_server(health_port=0)
    port = next(e for e in srv.endpoints if isinstance(e, HealthPort))
    with grpc.insecure_channel(f"127.0.0.1:{port.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="x" * (2 * HEALTH_MAX_MESSAGE_BYTES)), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    with grpc.insecure_channel(srv.address) as channel:  # the main port: a health call starts its reaper too
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                         timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    reads = [srv.health_reads, port._reads]
    threads = [t for r in reads for t in [r._thread, *r.pool._threads] if t is not None]
    assert len(threads) >= 4, threads  # two reapers and at least one pool thread each
    srv.stop(grace=0)
    for t in threads:
        t.join(5)
    assert [t.name for t in threads if t.is_alive()] == []


def test_the_health_queue_stops_counting_if_grpcio_runs_the_behaviour_in_another_context(caplog):
    """The queue counts a call at gRPC's handler lookup and uncounts it where its behaviour runs, through the
    call's contextvars.Context (grpcio runs both in one). Were a grpcio to run them in different contexts, no entry
    would leave the count but by expiry and the queue would answer most health calls UNIMPLEMENTED: the first call
    taken up without its stamp turns the count off (and says so) instead."""
    import contextvars
    from advantage_server import health_service as hs
    queue = hs._HealthQueue(limit=2)
    for _ in range(2):
        assert contextvars.copy_context().run(queue.enter)
    assert not contextvars.copy_context().run(queue.enter)  # full: refused at the lookup
    with caplog.at_level(logging.WARNING, logger="advantage_server"):
        contextvars.copy_context().run(queue.take)  # a behaviour that does not see its lookup's stamp
    assert not queue.counting and queue.queued == 0
    assert "health queue off" in caplog.text
    assert all(contextvars.copy_context().run(queue.enter) for _ in range(5)) and queue.queued == 0
