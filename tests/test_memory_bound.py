"""Peak server memory under a hostile mix stays within what the flags allow (RELIABILITY.md, "Memory bound").

The bound, for a server started with ``--max-concurrent-requests C --workers W --max-message-mb M
--max-stream-mb S --max-batch-elements E --stream-window-mb F``::

    peak RSS growth <= 3 x C x max(M, S) MiB        (admitted request bodies, each at most its size limit,
                                                      held by gRPC's core, as Python bytes, and parsed)
                     + W x WORKING_SET_BYTES x E    (calls computing at once, each at most E elements a tensor)
                     + 2 x C x F                     (calls waiting for a place: gRPC's core receives up to the
                                                      fixed stream window F = --stream-window-mb of each body)
                     + SLACK_MIB                     (gRPC's flow-control windows, allocator arenas, stacks)

One real server process (``--device cpu``) gets, at once and for several rounds: more maximum-size GAE
requests than it admits (over unary and the stream RPC), requests of the largest allowed body made of junk
protobuf fields, and streams that send half their body and stall (cut by ``--stream-idle-timeout``). The
server's peak resident size is sampled every 5 ms; the test asserts the bound and that the server serves a
correct request afterwards. It prints the measured peak next to the bound.
"""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb

from test_hardening import SERVICE, _PeakRss

C, W, M, S = 4, 2, 32, 32          # --max-concurrent-requests, --workers, --max-message-mb, --max-stream-mb
F = 4                              # --stream-window-mb (the default)
E = 1 << 21                        # --max-batch-elements: a [256, 8192] GAE batch is the largest allowed
#: bytes per element of the largest tensor a computing call may hold: the decoded float32 inputs (values,
#: the one-byte mask widened to the compute dtype), float64 temporaries of the kernel and whitening, the
#: float32 advantages and returns and their encoded copies in the response (GAE, the estimator with the
#: largest working set: one call alone grows the server by 28-37 bytes per element; twice that here)
WORKING_SET_BYTES = 64
SLACK_MIB = 96


def bound_mib() -> float:
    return 3 * C * max(M, S) + W * WORKING_SET_BYTES * E / 2**20 + 2 * C * F + SLACK_MIB


@pytest.mark.slow
def test_peak_memory_under_a_hostile_mix_is_within_the_flags_bound(tmp_path, capsys):
    from reliability_support import report, start_server, stop_server
    srv = start_server(tmp_path, "membound", "--max-concurrent-requests", str(C), "--workers", str(W),
                       "--max-message-mb", str(M), "--max-stream-mb", str(S), "--max-batch-elements", str(E),
                       "--stream-idle-timeout", "2", "--stream-window-mb", str(F))
    B, T = 256, E // 256
    rng = np.random.default_rng(0)
    tensors = dict(rewards=rng.standard_normal(B).astype(np.float32),
                   values=rng.standard_normal((B, T)).astype(np.float32),
                   mask=(rng.random((B, T)) < 0.9).astype(np.float32))  # holes: sent as one byte per token
    junk = b"\x78\x00" * ((M << 20) // 2 - 64)  # a body of the largest allowed size, all unknown fields
    codes: list[str] = []
    lock = threading.Lock()

    def record(code: str) -> None:
        with lock:
            codes.append(code)

    def gae(transport: str) -> None:
        with AdvantageClient(srv.address, timeout=60, transport=transport, max_message_mb=64) as client:
            for _ in range(3):
                try:
                    res = client.compute("gae", {"gae_gamma": 0.99}, **tensors)
                    assert res.advantages.shape == (B, T)
                    record("OK")
                except AdvantageServiceError as err:
                    record(err.code.name)

    def junk_call(channel: grpc.Channel) -> None:
        for _ in range(3):
            try:
                channel.unary_unary(f"/{SERVICE}/ComputeAdvantage")(junk, timeout=60)
                record("OK")
            except grpc.RpcError as err:
                record(err.code().name)

    def stalled(channel: grpc.Channel) -> None:
        def chunks():
            yield pb.ComputeAdvantageChunk(total_size=S << 20, data=b"\0" * ((S << 20) // 2)).SerializeToString()
            time.sleep(6)  # past --stream-idle-timeout: the server cuts the call and frees its half body
        try:
            list(channel.stream_stream(f"/{SERVICE}/ComputeAdvantageStream")(chunks(), timeout=30))
            record("OK")
        except grpc.RpcError as err:
            record(err.code().name)

    try:
        opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(srv.address, options=opts) as channel:
            with AdvantageClient(srv.address, timeout=60) as warm:  # compile the kernels before measuring
                warm.compute("gae", {"gae_gamma": 0.99}, rewards=tensors["rewards"][:2],
                             values=tensors["values"][:2, :8], mask=tensors["mask"][:2, :8])
            time.sleep(0.5)
            with _PeakRss(srv.proc.pid) as rss:
                threads = ([threading.Thread(target=gae, args=("unary",)) for _ in range(4)]
                           + [threading.Thread(target=gae, args=("stream",)) for _ in range(2)]
                           + [threading.Thread(target=junk_call, args=(channel,)) for _ in range(3)]
                           + [threading.Thread(target=stalled, args=(channel,)) for _ in range(2)])
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(180)
                assert not any(t.is_alive() for t in threads), "a hostile call did not end"
            with AdvantageClient(srv.address, timeout=60) as client:  # still serving, and right
                res = client.compute("gae", {"gae_gamma": 1.0, "gae_lambda": 1.0, "normalize_advantages": False},
                                     rewards=np.array([1.0], np.float32), values=np.zeros((1, 3), np.float32),
                                     mask=np.ones((1, 3), np.float32))
                np.testing.assert_allclose(np.asarray(res.advantages), [[1.0, 1.0, 1.0]])
    finally:
        stop_server(srv)
    assert "OK" in codes, codes  # the mix really computed maximum-size batches
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "CANCELLED"}, codes
    assert rss.growth_mib <= bound_mib(), (
        f"peak server RSS grew {rss.growth_mib:.0f} MiB under the hostile mix, beyond the flags' bound "
        f"{bound_mib():.0f} MiB; calls: {sorted(codes)}")
    report(capsys, f"memory bound: hostile mix ({len(codes)} calls: {codes.count('OK')} OK, "
                   f"{codes.count('RESOURCE_EXHAUSTED')} RESOURCE_EXHAUSTED, {codes.count('INVALID_ARGUMENT')} "
                   f"INVALID_ARGUMENT, {codes.count('CANCELLED')} CANCELLED) against C={C}, W={W}, M=S={M} MiB, "
                   f"E={E}: peak RSS +{rss.growth_mib:.0f} MiB <= bound {bound_mib():.0f} MiB")
