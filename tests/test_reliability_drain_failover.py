"""Graceful drain under load (SIGTERM), failover across three replicas (kill -9 of one in the middle of a
run of requests), and bitwise determinism, with real `advantage-server` processes.

Every server listens on 127.0.0.1 only; every loop is bounded in count and time.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.channel import SERVICE_NAME as SERVICE, service_config
from advantage_client.client import build_request
from reliability_support import (
    CALLS, batch, count_events, report, request_for, slow_env, start_server, stop_server, wait_for,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------- drain
def test_sigterm_under_load_drains(tmp_path, capsys):
    env, events = slow_env(tmp_path, 0.4)
    srv = start_server(tmp_path, "drain", "--workers", "4", "--grace", "30", "--log-level", "DEBUG", env=env)
    request = request_for("gae", seed=1)
    statuses: list[str] = []
    outcomes: list[tuple[float, float, str, bytes]] = []  # (sent, done, code, advantages bytes)
    lock, stop = threading.Lock(), threading.Event()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            expected = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage(request, timeout=30).advantages.data
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)

            def watcher():
                try:
                    for reply in watch:
                        statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                except grpc.RpcError:
                    pass
            threading.Thread(target=watcher, daemon=True).start()
            wait_for(lambda: statuses == ["SERVING"], 10, "the health watch")

            def client():
                # the client's own retry policy (UNAVAILABLE and a server's CANCELLED retried); health checking
                # off, so that this client keeps calling this server and meets its refusals
                policy = json.dumps(service_config(health_check=False))
                with grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                                 ("grpc.service_config", policy)]) as ch:
                    call = pb_grpc.AdvantageServiceStub(ch).ComputeAdvantage
                    for _ in range(60):  # bounded; stops at the first refusal after the signal
                        sent = time.monotonic()
                        try:
                            code, data = "OK", call(request, timeout=30).advantages.data
                        except grpc.RpcError as err:
                            code, data = err.code().name, b""
                        with lock:
                            outcomes.append((sent, time.monotonic(), code, data))
                        if code != "OK" or stop.is_set() and srv.proc.poll() is not None:
                            return
            threads = [threading.Thread(target=client) for _ in range(8)]
            for t in threads:
                t.start()
            wait_for(lambda: count_events(events, "start") >= 12, 30, "load on the server")
            signalled = time.monotonic()
            in_flight_at_signal = count_events(events, "start") - count_events(events, "end")
            stop.set()
            rc = stop_server(srv, timeout=40)
            exited = time.monotonic()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads)
    finally:
        srv.close()
    assert rc == 0, srv.stderr
    codes = [c for _, _, c, _ in outcomes]
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    ok = [o for o in outcomes if o[2] == "OK"]
    assert all(data == expected for _, _, _, data in ok), "a drained request returned a different result"
    accepted, finished = count_events(events, "start"), count_events(events, "end")
    # every request the server started (1 reference + the load) finished and reached its client
    assert accepted == finished == len(ok) + 1, (accepted, finished, len(ok))
    completed_across_signal = sum(1 for sent, done, code, _ in ok if sent < signalled < done)
    assert completed_across_signal >= 1, "no request was in flight when the signal came"
    # refused by the drain: answered after the signal (a call sent just before it may reach the server after it)
    refused_after = sum(1 for _, done, code, _ in outcomes if code == "UNAVAILABLE" and done >= signalled)
    assert refused_after >= 1 and codes.count("UNAVAILABLE") == refused_after
    assert statuses[:2] == ["SERVING", "NOT_SERVING"], statuses
    log = srv.stderr
    assert log.index("shutting down") < log.index("stopped"), log
    # the open health watch did not hold the exit until the 30 s grace ran out
    assert exited - signalled < 15, exited - signalled
    report(capsys, f"drain: SIGTERM with {in_flight_at_signal} computing; {len(ok)} OK (all bitwise equal, "
                   f"{completed_across_signal} in flight at the signal), {refused_after} UNAVAILABLE after it, "
                   f"0 other; health watch {statuses}; exit 0 after {exited - signalled:.1f}s")


def test_the_drain_answers_calls_on_their_way_before_grpc_stops(make_server, monkeypatch):
    """A call that arrives just after the drain began is answered by the service (UNAVAILABLE, "shutting down"),
    not cut by gRPC: gRPC's server drops the calls it has queued but not started when it shuts down (a bare
    CANCELLED), so the drain refuses calls itself until none came for ``DRAIN_QUIET_S`` before gRPC stops.
    Before, gRPC stopped at once and this call met a closed server instead. The quiet period is 2 s here (0.1 s
    in production), so that a loaded machine's stall between the drain and this call does not end it first."""
    from advantage_server import server as server_mod
    monkeypatch.setattr(server_mod, "DRAIN_QUIET_S", 2.0)
    monkeypatch.setattr(server_mod, "DRAIN_QUIET_MAX_S", 8.0)
    srv = make_server()
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    with grpc.insecure_channel(srv.address, options=[("grpc.enable_retries", 0)]) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        stub.ComputeAdvantage(request, timeout=10)  # connected, served
        t0 = time.monotonic()
        stopper = threading.Thread(target=srv.stop, kwargs={"grace": 20.0})
        stopper.start()
        wait_for(lambda: srv.gate.draining, 5, "the drain")
        with pytest.raises(grpc.RpcError) as err:
            stub.ComputeAdvantage(request, timeout=10)
        refused_after = time.monotonic() - t0
        stopper.join(timeout=20)
        took = time.monotonic() - t0
    assert not stopper.is_alive()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert "shutting down" in err.value.details(), err.value.details()
    # the refusal restarted the quiet period: the stop waited 2 s after it, and no longer than the cap (the server
    # refused a little before this client saw it: 50 ms of slack for that, against a 2 s period)
    assert refused_after + 2.0 - 0.05 <= took < 8.0 + 5, (refused_after, took)


def test_the_wait_for_quiet_counts_from_the_last_refusal():
    from advantage_server.limits import Draining, RequestGate
    gate = RequestGate(4, 2)
    assert gate.wait_quiet(10.0, 10.0)  # not draining: nothing to wait for
    t0 = time.monotonic()  # before the drain begins: the quiet counts from inside start_draining (taken after
    gate.start_draining()  # it, t0 fell 2 ms short of 0.2 s beside a busy loop, issue #37's runs)
    assert gate.wait_quiet(0.2, 5.0)
    assert 0.2 <= time.monotonic() - t0 < 5  # quiet since the drain began
    stop = threading.Event()

    def refused_every_50_ms():
        while not stop.wait(0.05):
            with pytest.raises(Draining):
                with gate.admit(limited=True):
                    pass
    caller = threading.Thread(target=refused_every_50_ms)
    caller.start()
    try:
        first = gate._quiet_since
        wait_for(lambda: gate._quiet_since != first, 5, "a first refusal")
        t0 = time.monotonic()
        # refusals keep coming (a loaded machine would have to stall the caller 1 s to make it quiet)
        assert not gate.wait_quiet(1.0, 2.0)
        assert 2.0 <= time.monotonic() - t0 < 10
    finally:
        stop.set()
        caller.join()
    t0 = time.monotonic()
    assert gate.wait_quiet(0.2, 5.0) and time.monotonic() - t0 < 5


def test_the_client_retries_a_call_the_servers_grpc_cancelled(make_server):
    """A draining server's gRPC ends the calls it had queued but not started with CANCELLED. The client's retry
    policy sends such a call again (every compute is idempotent); with ``retry=False`` the CANCELLED is raised.
    A proxy in front of a real server answers the first ComputeAdvantage with CANCELLED and forwards the rest."""
    real = make_server()
    attempts: list[str] = []
    upstream = grpc.insecure_channel(real.address)

    def handler(details):
        method = details.method
        forward = upstream.unary_unary(method)  # bytes in, bytes out

        def call(request: bytes, context):
            if method.endswith("/ComputeAdvantage"):
                attempts.append(method)
                if len(attempts) == 1:
                    context.abort(grpc.StatusCode.CANCELLED, "dropped by a shutting-down server")
            return forward(request, timeout=10)
        return grpc.unary_unary_rpc_method_handler(call) if method.startswith("/advantage.v1.") else None

    proxy = grpc.server(futures.ThreadPoolExecutor(4))
    proxy.add_generic_rpc_handlers([type("Proxy", (grpc.GenericRpcHandler,), {"service": lambda self, d: handler(d)})()])
    port = proxy.add_insecure_port("127.0.0.1:0")
    proxy.start()
    rewards, mask = [1.0, 0.0, 0.5], [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]
    try:
        with AdvantageClient(f"127.0.0.1:{port}", timeout=10, transport="unary") as client:
            result = client.compute("raw_reward", rewards=rewards, mask=mask, as_numpy=True)
        assert len(attempts) == 2
        with AdvantageClient(real.address, timeout=10, transport="unary") as direct:
            np.testing.assert_array_equal(result.advantages,
                                          direct.compute("raw_reward", rewards=rewards, mask=mask,
                                                         as_numpy=True).advantages)
        attempts.clear()
        with AdvantageClient(f"127.0.0.1:{port}", timeout=10, transport="unary", retry=False) as client:
            with pytest.raises(AdvantageServiceError) as err:
                client.compute("raw_reward", rewards=rewards, mask=mask, as_numpy=True)
        assert err.value.code == grpc.StatusCode.CANCELLED and len(attempts) == 1
    finally:
        proxy.stop(None)
        upstream.close()


def test_a_call_during_the_drain_takes_no_place_from_an_upload_in_progress(make_server, monkeypatch):
    """While the drain refuses calls (before gRPC stops), a call that finds the server full is refused UNAVAILABLE
    and cuts nobody: the uploads already admitted keep their places and finish (before, such a call cut the
    most stalled upload of a client beyond its share to make room, then was refused anyway)."""
    from advantage_server import server as server_mod
    monkeypatch.setattr(server_mod, "DRAIN_QUIET_S", 2.0)  # room for a loaded machine
    srv = make_server(max_concurrent_requests=2, max_pending_per_connection=1, max_pending_per_peer=100)
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    release = threading.Event()

    def stalled():
        release.wait(20)
        yield request.SerializeToString()
    method = f"/{SERVICE}/ComputeAdvantage"
    own = [("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(srv.address, options=own) as a, grpc.insecure_channel(srv.address, options=own) as b:
        held = [a.stream_unary(method).future(stalled(), timeout=30) for _ in range(2)]  # beyond a's share of 1
        wait_for(lambda: srv.gate.full, 10, "two stalled uploads admitted")
        grpc.channel_ready_future(b).result(timeout=10)
        try:
            stopper = threading.Thread(target=srv.stop, kwargs={"grace": 20.0})
            stopper.start()
            wait_for(lambda: srv.gate.draining, 5, "the drain")
            with pytest.raises(grpc.RpcError) as err:
                b.unary_unary(method)(request.SerializeToString(), timeout=10)
            release.set()
            replies = [f.result(timeout=20) for f in held]  # raises if an upload was cut
            stopper.join(timeout=30)
        finally:
            release.set()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
    assert len(replies) == 2 and srv.uploads.evictions == 0 and not stopper.is_alive()


def test_the_client_policy_resends_calls_grpc_dropped_at_shutdown():
    """gRPC's own drop, reproduced: replica A's serve thread is held (an interceptor waits in it) while calls
    arrive, so they wait in gRPC's core; then A stops, and only then is its serve thread let go. A plain client
    without retries loses them (a bare CANCELLED, or UNAVAILABLE for a call that reached A only once it was
    stopping); with the client's retry policy (round_robin over A and B) the same moment loses no call: each
    dropped call is sent again and B serves it. Plain gRPC servers: this is about the client's policy and grpcio's
    server, not about this service's drain.

    Deterministic (issue #37 item 2: it failed 1 run in 2 of a full ``make test`` on a loaded machine): the serve
    thread is held on an event until A's stop has begun, not for a fixed second after 0.3 s sleeps, so no call can
    be served by A's pool in the meantime however slow the machine; the wait before the stop only decides how a
    call is lost (waiting in A's core, or refused as A stops), never whether."""
    method = f"/{SERVICE}/ComputeAdvantage"

    class Hold(grpc.ServerInterceptor):  # runs in grpcio's serve thread
        def __init__(self):
            self.armed, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()

        def intercept_service(self, continuation, details):
            if self.armed.is_set() and ("hold", "1") in tuple(details.invocation_metadata or ()):
                self.armed.clear()
                self.entered.set()
                self.release.wait(30)
            return continuation(details)

    def replica(name: str, served: list, hold: Hold | None = None):
        def answer(request: bytes, context) -> bytes:
            served.append(name)
            return name.encode()
        handlers = {"ComputeAdvantage": grpc.unary_unary_rpc_method_handler(answer)}
        server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[hold] if hold else [])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, port

    def moment(retry: bool) -> list[str]:
        served: list[str] = []
        hold = Hold()
        a, port_a = replica("A", served, hold)
        b, port_b = replica("B", served)
        try:
            if retry:
                target = f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}"
                options = [("grpc.service_config", json.dumps(service_config(health_check=False)))]
            else:
                target, options = f"127.0.0.1:{port_a}", [("grpc.enable_retries", 0)]
            with grpc.insecure_channel(target, options=options) as channel, \
                    grpc.insecure_channel(f"127.0.0.1:{port_a}") as to_a:
                call = channel.unary_unary(method)
                for _ in range(4):  # both replicas connected
                    call(b"", timeout=30)
                to_a.unary_unary(method)(b"", timeout=30)
                hold.armed.set()
                holder = to_a.unary_unary(method).future(b"", timeout=60, metadata=(("hold", "1"),))
                assert hold.entered.wait(30), "A's serve thread never reached the hold"
                calls = [call.future(b"", timeout=60) for _ in range(6)]  # those sent to A wait in its core
                time.sleep(0.5)  # let them reach A (one that does not is refused as A stops: lost all the same)
                # grpcio's stop() waits for the lock A's serve thread holds while it is held: stop from a thread,
                # then let the serve thread go; the stop takes the lock as soon as the held call is handed over
                stopper = threading.Thread(target=a.stop, args=(5,))
                stopper.start()
                time.sleep(0.2)
                hold.release.set()
                stopper.join(30)
                results = []
                for f in [holder, *calls]:
                    try:
                        results.append(f.result().decode())
                    except grpc.RpcError as err:
                        results.append(err.code().name)
            return results[1:]
        finally:
            hold.release.set()
            a.stop(None)
            b.stop(None)

    # with the client's policy the moment loses no call, every time: each dropped call was sent again, to B
    # (round_robin sent about half of the 6 to A); without it, the same moment loses calls (CANCELLED waiting in
    # A's core, or UNAVAILABLE as A stops), unless A's serve thread happened to pick every one up before the
    # stop: 1 moment in 30 measured on a quiet machine, but 3 of 3 beside a busy loop on both cores with other
    # test modules running (issue #37's runs), so the plain client gets up to 12 moments to show its loss
    plain_runs = []
    for _ in range(12):
        kept = moment(retry=True)
        assert len(kept) == 6 and set(kept) <= {"A", "B"} and kept.count("B") >= 3, kept
        plain = moment(retry=False)
        assert len(plain) == 6 and set(plain) <= {"A", "CANCELLED", "UNAVAILABLE"}, plain
        plain_runs.append(plain)
        if any(r != "A" for r in plain):
            break
    assert any(r != "A" for r in plain_runs[-1]), plain_runs


# ------------------------------------------------------------------------------ failover
def test_kill_minus_nine_of_one_replica_loses_no_request(tmp_path, capsys):
    replicas, event_files = [], []
    try:
        for i in range(3):
            env, events = slow_env(tmp_path, 0.03)
            replicas.append(start_server(tmp_path, f"replica{i}", "--workers", "4", env=env))
            event_files.append(events)
        request = request_for("grpo", seed=2, B=32, T=64)
        results: list[bytes] = []
        failures: list[str] = []
        lock = threading.Lock()
        total, per_thread, kill_after = 240, 60, 80
        killed_at = {}
        with AdvantageClient([r.address for r in replicas], timeout=30) as client:
            client.wait_ready(10)

            def worker():
                for _ in range(per_thread):
                    try:
                        reply = client._stub.ComputeAdvantage(request, timeout=30)
                        with lock:
                            results.append(reply.advantages.data)
                            if len(results) == kill_after:
                                victim = replicas[1]
                                killed_at["in_flight"] = (count_events(event_files[1], "start")
                                                          - count_events(event_files[1], "end"))
                                killed_at["served"] = count_events(event_files[1], "end")
                                victim.proc.kill()  # SIGKILL: no drain, connections reset
                    except grpc.RpcError as err:
                        with lock:
                            failures.append(f"{err.code().name}: {err.details()}")
            threads = [threading.Thread(target=worker) for _ in range(4)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads)
        assert replicas[1].proc.wait(timeout=10) == -9
        assert not failures, failures[:5]
        assert len(results) == total
        assert len(set(results)) == 1, "replicas disagree"
        served = [count_events(e, "end") for e in event_files]
        assert killed_at["served"] > 0, "the killed replica never served before the kill"
        assert all(served[i] > 0 for i in (0, 2)), served
        for i in (0, 2):  # the survivors are healthy
            with grpc.insecure_channel(replicas[i].address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for r in replicas:
            r.close()
    report(capsys, f"failover: {total} requests over 3 replicas, replica 1 killed -9 after {kill_after} "
                   f"({killed_at['in_flight']} of its calls in flight, retried elsewhere); 0 failed; served per "
                   f"replica {served}; {total / elapsed:.0f} req/s")


# --------------------------------------------------------------------------- determinism
def test_same_request_gives_bitwise_identical_results(client, capsys):
    """Every estimator, float32 and float64 inputs: repeated and concurrent calls return the same bytes."""
    from concurrent import futures

    requests = {}
    for name, (config, names) in CALLS.items():
        data = batch(11, B=64, T=128)
        requests[name] = build_request(name, config, **{k: data[k] for k in names})
        data64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in data.items()}
        requests[name + "/f64"] = build_request(name, config, output_dtype="float64",
                                                **{k: data64[k] for k in names})
    stub = client._stub
    first = {k: stub.ComputeAdvantage(r, timeout=30) for k, r in requests.items()}
    jobs = [k for k in requests for _ in range(6)]
    with futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda k: (k, stub.ComputeAdvantage(requests[k], timeout=30)), jobs))
    for k, reply in replies:
        assert reply.SerializeToString(deterministic=True) == first[k].SerializeToString(deterministic=True), k
    report(capsys, f"determinism: {len(requests)} requests (6 estimators x f32/f64) x {len(jobs) // len(requests)} "
                   f"concurrent repeats on 8 threads: all {len(jobs)} results bitwise identical to the first")


def test_failover_client_survives_a_restart_with_wait_for_ready(tmp_path):
    """A single replica restarted on the same port: with wait_for_ready the call waits for it instead of failing."""
    srv = start_server(tmp_path, "restart-a")
    port = srv.port
    try:
        with AdvantageClient(srv.address, timeout=60, wait_for_ready=True) as client:
            client.compute("raw_reward", None, rewards=np.ones(2, np.float32), mask=np.ones((2, 2), np.float32))
            assert stop_server(srv) == 0
            srv.close()
            result: dict = {}

            def call():
                try:
                    result["res"] = client.compute("raw_reward", {"normalize_advantages": False},
                                                   rewards=np.full(2, 3.0, np.float32), mask=np.ones((2, 2), np.float32),
                                                   as_numpy=True)
                except AdvantageServiceError as err:
                    result["err"] = err
            t = threading.Thread(target=call)
            t.start()
            time.sleep(1.0)
            assert t.is_alive(), f"the call did not wait for the server: {result}"
            from reliability_support import ServerProcess
            srv = ServerProcess(tmp_path, port, name="restart-b")
            srv.wait_listening()
            t.join(timeout=60)
            assert "res" in result, result
            np.testing.assert_array_equal(result["res"].advantages, np.full((2, 2), 3.0, np.float32))
    finally:
        srv.close()


def test_round_robin_spreads_calls_and_skips_a_replica_that_is_not_serving(capsys):
    """Client-side health checking: a replica that reports NOT_SERVING (draining) gets no more calls."""
    from advantage_server import create_server

    replicas = [create_server("127.0.0.1", 0, device="cpu").start() for _ in range(2)]
    counts = [0, 0]
    for i, srv in enumerate(replicas):
        def counted(request, *args, _orig=srv.core.compute_result, _i=i, **kwargs):
            counts[_i] += 1
            return _orig(request, *args, **kwargs)
        srv.core.compute_result = counted  # what every ComputeAdvantage transport calls
    args = dict(rewards=np.ones(2, np.float32), mask=np.ones((2, 2), np.float32))
    try:
        with AdvantageClient([r.address for r in replicas], timeout=10) as client:
            client.wait_ready(10)
            for _ in range(20):
                client.compute("raw_reward", None, **args)
            spread = list(counts)
            replicas[0].health.set("advantage.v1.AdvantageService", health_pb2.HealthCheckResponse.NOT_SERVING)
            # the client learns it over its health watch: wait (bounded) until 5 calls in a row skip replica 0
            deadline, streak = time.monotonic() + 10, 0
            while streak < 5:
                assert time.monotonic() < deadline, f"the NOT_SERVING replica kept getting calls: {counts}"
                seen = counts[0]
                client.compute("raw_reward", None, **args)
                streak = streak + 1 if counts[0] == seen else 0
            before, other = counts[0], counts[1]
            for _ in range(20):
                client.compute("raw_reward", None, **args)
    finally:
        for r in replicas:
            r.stop(grace=1.0)
    assert min(spread) >= 5, f"round_robin did not spread the calls: {spread}"
    assert counts[0] == before, f"the NOT_SERVING replica still got calls: {counts}"
    assert counts[1] - other == 20
    report(capsys, f"round_robin: 20 calls over 2 replicas -> {spread}; after one reported NOT_SERVING and the "
                   "client saw it, the next 20 all went to the other")


def test_drain_while_health_watchers_disconnect(tmp_path, capsys):
    """SIGTERM at the moment many clients with client-side health checking go away. grpcio-health-checking's
    servicer deadlocks here (status sent under its lock while the closing watch needs the lock); the
    server's own servicer must drain and exit 0 every time."""
    rounds, watchers = 3, 48
    took = []
    for r in range(rounds):
        srv = start_server(tmp_path, f"watch-{r}")
        try:
            channels = [grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)])
                        for _ in range(watchers)]
            streams = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=60)
                       for ch in channels]
            for stream in streams:
                assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
            closer = threading.Thread(target=lambda chs=channels: [ch.close() for ch in chs])
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            closer.start()
            assert stop_server(srv, timeout=20) == 0
            took.append(time.monotonic() - t0)
            closer.join(timeout=20)
        finally:
            srv.close()
    report(capsys, f"drain with {watchers} health watchers disconnecting at SIGTERM, {rounds} rounds: exit 0 after "
                   f"{', '.join(f'{t:.1f}' for t in took)} s")
