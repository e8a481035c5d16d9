"""Faults against a real `advantage-server` process: out of memory under a capped address space, a client
that disconnects in the middle of a request (cancelled upload; process killed while its request computes),
and a slow client that stops reading its response. After each, the server is healthy and serves the next
request correctly. (kill -9 of a replica: tests/test_reliability_drain_failover.py.)

Every server listens on 127.0.0.1 only; every wait is bounded.
"""
from __future__ import annotations

import resource
import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request, decode_result
from reliability_support import (
    count_events, python_client_process, report, rss_bytes, slow_env, start_server, stop_server, wait_for,
)

pytestmark = pytest.mark.slow

SMALL_REWARDS = np.array([1.0, -2.0, 0.5], np.float32)
SMALL_MASK = np.ones((3, 5), np.float32)


def assert_healthy_and_serving(address: str) -> None:
    """Health says SERVING and a normal request gets the right answer."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        request = build_request("raw_reward", {"normalize_advantages": False}, rewards=SMALL_REWARDS, mask=SMALL_MASK)
        got = decode_result(pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage(request, timeout=20), as_numpy=True)
    np.testing.assert_array_equal(got.advantages, np.repeat(SMALL_REWARDS[:, None], 5, axis=1))


def first_success(address: str, within: float) -> float:
    """Seconds until a normal request succeeds, retrying only RESOURCE_EXHAUSTED (the slot still busy)."""
    t0 = time.monotonic()
    while True:
        try:
            assert_healthy_and_serving(address)
            return time.monotonic() - t0
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() - t0 > within:
                raise
            time.sleep(0.02)


def vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmSize"))
    return int(line.split()[1]) * 1024


# ------------------------------------------------------------------------------ out of memory
@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs Linux prlimit")
def test_out_of_memory_is_resource_exhausted_and_the_server_keeps_serving(tmp_path, capsys):
    srv = start_server(tmp_path, "oom")
    try:
        assert_healthy_and_serving(srv.address)
        headroom = 512 * 2**20
        cap = vm_size(srv.proc.pid) + headroom
        resource.prlimit(srv.proc.pid, resource.RLIMIT_AS, (cap, cap))
        # 64 MB on the wire (a uint8 mask), but computing needs it as float64 (512 MB) and more: too big
        B, T = 4096, 16384
        big = build_request("grpo", None, prompt_ids=np.arange(B, dtype=np.int64) // 8,
                            rewards=np.linspace(-1, 1, B), mask=np.ones((B, T), np.uint8))
        outcomes = []
        with grpc.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 2**30)]) as channel:
            call = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as exc:
                    call(big, timeout=60)
                assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (exc.value.code(), exc.value.details())
                assert "out of memory" in exc.value.details()
                outcomes.append(exc.value.code().name)
                assert_healthy_and_serving(srv.address)
        assert srv.proc.poll() is None
        assert "out of memory" in srv.stderr and "Traceback" not in srv.stderr, srv.stderr
        assert stop_server(srv) == 0
    finally:
        srv.close()
    report(capsys, f"OOM: address space capped at start + {headroom >> 20} MiB; 3 requests needing > 1 GiB -> "
                   f"{outcomes}, each followed by a correct small request; exit 0")


# ------------------------------------------------------------------------- client disconnects
def test_client_cancelling_in_the_middle_of_an_upload(tmp_path, capsys):
    srv = start_server(tmp_path, "upload", "--max-concurrent-requests", "1", "--workers", "1")
    try:
        B, T = 1024, 48 * 1024  # 192 MiB of float32 values
        big = build_request("gae", None, rewards=np.zeros(B, np.float32), mask=np.ones((B, T), np.bool_),
                            values=np.zeros((B, T), np.float32))
        before = rss_bytes(srv.proc.pid)
        with grpc.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 2**30)]) as channel:
            call = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage
            waits = []
            for delay in (0.02, 0.1, 0.3) * 2:
                future = call.future(big, timeout=60)
                time.sleep(delay)
                future.cancel()
                # the only slot comes back as soon as the abandoned call reaches its next checkpoint
                waits.append(first_success(srv.address, within=10.0))
        assert srv.proc.poll() is None
        peak = rss_bytes(srv.proc.pid)
        # what the cancelled uploads left behind goes back to the OS (no reference cycle holds the bytes,
        # and the server trims the heap); without that, RSS stays around +0.5-3 GiB. A call cancelled just
        # as its whole body had arrived left that body (240 MiB here) in gRPC's call state for good, about 1
        # run in 4, until the server dropped it (AdvantageServicer._receive)
        settle = time.monotonic()
        bound = before + 128 * 2**20
        wait_for(lambda: rss_bytes(srv.proc.pid) < bound, 15, "resident memory to come back")
        settled_in, after = time.monotonic() - settle, rss_bytes(srv.proc.pid)
        assert stop_server(srv) == 0
    finally:
        srv.close()
    waited = ", ".join(f"{1e3 * w:.0f}" for w in waits)
    report(capsys, f"disconnect: 6 x 192 MiB uploads cancelled after 20/100/300 ms (twice) with "
                   f"--max-concurrent-requests 1; next request served each time (after {waited} ms); RSS "
                   f"{before >> 20} MiB -> {peak >> 20} MiB just after -> {after >> 20} MiB {settled_in:.1f}s later")


CLIENT_CODE = """
import sys, grpc, numpy as np
from advantage_client.client import build_request
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
B, T = {B}, {T}
request = build_request("raw_reward", {{"normalize_advantages": False}}, output_dtype="float64",
                        rewards=np.ones(B, np.float64), mask=np.ones((B, T), np.bool_))
with grpc.insecure_channel(sys.argv[1] if len(sys.argv) > 1 else "{address}",
                           options=[("grpc.max_receive_message_length", 2**30)]) as channel:
    print("sending", flush=True)
    pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage(request, timeout=120)
    print("done", flush=True)
"""


def test_client_killed_while_its_request_computes(tmp_path, capsys):
    env, events = slow_env(tmp_path, 1.5)
    srv = start_server(tmp_path, "killed-client", "--max-concurrent-requests", "1", "--log-level", "DEBUG", env=env)
    client = python_client_process(CLIENT_CODE.format(B=64, T=64, address=srv.address))
    try:
        wait_for(lambda: count_events(events, "start") == 1, 60, "the client's request to start computing")
        client.kill()
        client.wait(timeout=10)
        wait_for(lambda: count_events(events, "end") == 1, 10, "the estimator to return")
        wait_for(lambda: "client cancelled the call before encoding" in srv.stderr, 10,
                 "the server to stop the abandoned call")
        assert_healthy_and_serving(srv.address)  # the slot came back
        assert stop_server(srv) == 0
    finally:
        client.kill()
        srv.close()
    report(capsys, "disconnect: client killed -9 while its request computed; the server stopped the call before "
                   "encoding, freed the only slot and served the next request")


def test_slow_client_that_stops_reading(tmp_path, capsys):
    env, events = slow_env(tmp_path, 1.0)
    srv = start_server(tmp_path, "slow-reader", "--max-concurrent-requests", "1", env=env)
    # 8 MiB request, 64 MiB response: far more than the socket buffers and HTTP/2 windows hold
    client = python_client_process(CLIENT_CODE.format(B=1024, T=8192, address=srv.address))
    try:
        wait_for(lambda: count_events(events, "start") == 1, 60, "the client's request to start computing")
        client.send_signal(signal.SIGSTOP)  # the client process stops: it reads nothing more
        wait_for(lambda: count_events(events, "end") == 1, 10, "the estimator to return")
        t0 = time.monotonic()
        freed_after = first_success(srv.address, within=10.0)  # the slot frees once the 64 MiB are encoded
        for _ in range(3):
            assert_healthy_and_serving(srv.address)
        served_in = time.monotonic() - t0
        assert client.poll() is None  # still stuck, not finished
        client.kill()
        client.wait(timeout=10)
        assert_healthy_and_serving(srv.address)
        assert srv.proc.poll() is None
        assert stop_server(srv) == 0
    finally:
        client.kill()
        srv.close()
    report(capsys, f"slow reader: a client stopped (SIGSTOP) with a 64 MiB response unread; with "
                   f"--max-concurrent-requests 1 the next request was served {freed_after:.2f}s after the estimator "
                   f"returned (every call takes 1 s on this slowed server) and 4 in {served_in:.2f}s; the stuck "
                   "client was then killed; exit 0")
