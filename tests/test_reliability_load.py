"""Bounded load on a real `advantage-server` process (loopback only): 32 concurrent clients with zero errors
and results bitwise equal to the single-client result, and resident memory that stays flat over 10,000
small requests. Both print what they did (counts, p50/p99 latency, throughput, RSS).
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from advantage_client import AdvantageClient
from advantage_client.channel import make_channel
from reliability_support import CALLS, percentiles, report, request_for, rss_bytes, start_server, stop_server

pytestmark = pytest.mark.slow

CLIENTS = 32
REQUESTS_PER_CLIENT = 25


def test_32_concurrent_clients_zero_errors_identical_results(tmp_path, capsys):
    srv = start_server(tmp_path, "load")  # default limits: --max-concurrent-requests 32, --workers 8
    names = list(CALLS)
    requests = {name: request_for(name, seed=3, B=64, T=256) for name in names}
    try:
        with AdvantageClient(srv.address, timeout=60) as single:
            expected = {n: single._stub.ComputeAdvantage(r, timeout=60).SerializeToString(deterministic=True)
                        for n, r in requests.items()}
        latencies: list[float] = []
        errors: list[str] = []
        mismatches: list[str] = []
        lock = threading.Lock()
        barrier = threading.Barrier(CLIENTS)

        def client(i: int):
            channel = make_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)])
            with AdvantageClient(srv.address, channel=channel, timeout=60) as c:
                c.wait_ready(20)
                barrier.wait(timeout=60)
                for k in range(REQUESTS_PER_CLIENT):
                    name = names[(i + k) % len(names)]
                    t0 = time.monotonic()
                    try:
                        reply = c._stub.ComputeAdvantage(requests[name], timeout=60)
                    except grpc.RpcError as err:
                        with lock:
                            errors.append(f"{err.code().name}: {err.details()}")
                        continue
                    dt = time.monotonic() - t0
                    same = reply.SerializeToString(deterministic=True) == expected[name]
                    with lock:
                        latencies.append(dt)
                        if not same:
                            mismatches.append(name)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads)
        assert stop_server(srv) == 0
    finally:
        srv.close()
    total = CLIENTS * REQUESTS_PER_CLIENT
    assert not errors, errors[:5]
    assert not mismatches, mismatches[:5]
    assert len(latencies) == total
    report(capsys, f"load: {CLIENTS} clients x {REQUESTS_PER_CLIENT} = {total} requests ([64, 256] batches, 6 "
                   f"estimators), 0 errors, all bitwise equal to the single-client result; {percentiles(latencies)}; "
                   f"{total / elapsed:.0f} req/s over {elapsed:.1f}s")


RSS_WARMUP = 1_000
RSS_REQUESTS = 10_000


def test_rss_flat_over_10000_requests(tmp_path, capsys):
    srv = start_server(tmp_path, "rss")
    small = [request_for(name, seed=i, B=16, T=64, groups=4) for i, name in enumerate(["grpo", "gae", "opd", "raw_reward"])]
    try:
        def run(n: int, threads: int = 4) -> list[float]:
            latencies: list[float] = []
            errors: list[str] = []

            def worker(w: int):
                channel = make_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)])
                with AdvantageClient(srv.address, channel=channel, timeout=30) as c:
                    for k in range(w, n, threads):
                        t0 = time.monotonic()
                        try:
                            c._stub.ComputeAdvantage(small[k % len(small)], timeout=30)
                        except grpc.RpcError as err:
                            errors.append(err.code().name)
                        latencies.append(time.monotonic() - t0)
            ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=600)
            assert not any(t.is_alive() for t in ts) and not errors, errors[:5]
            return latencies

        run(RSS_WARMUP)
        before = rss_bytes(srv.proc.pid)
        samples, latencies, t0 = [before], [], time.monotonic()
        for _ in range(5):
            latencies += run(RSS_REQUESTS // 5)
            samples.append(rss_bytes(srv.proc.pid))
        elapsed = time.monotonic() - t0
        after = samples[-1]
        assert stop_server(srv) == 0
    finally:
        srv.close()
    growth = after / before - 1
    mib = [f"{s / 2**20:.0f}" for s in samples]
    report(capsys, f"memory: {RSS_REQUESTS} small ([16, 64]) requests after {RSS_WARMUP} warm-up: server RSS {mib} MiB "
                   f"(growth {100 * growth:+.1f}%); {percentiles(latencies)}; {RSS_REQUESTS / elapsed:.0f} req/s")
    assert len(latencies) == RSS_REQUESTS
    assert growth < 0.10, f"RSS grew {100 * growth:.1f}% over {RSS_REQUESTS} requests: {mib} MiB"
