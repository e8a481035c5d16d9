"""Issue 11, the last hardening items: per-client shared-memory quotas, a minimum upload rate, and deadline
checks inside the prepare stage. Each test here failed before its fix, except the guards against cutting
live uploads (``test_a_large_upload_on_loopback_is_not_cut``, ``test_a_slow_upload_above_the_minimum_is_not_cut``,
``test_the_minimum_rate_can_be_turned_off``).

In-process servers on 127.0.0.1; every wait is bounded. Separate clients are separate connections: each
channel gets its own subchannel pool (``grpc.use_local_subchannel_pool``), as separate trainer processes do.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

from advantage_client import AdvantageClient
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request, decode_result
from reliability_support import report

SERVICE = pb.DESCRIPTOR.services_by_name["AdvantageService"].full_name
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]


def _silent(stop: threading.Event):
    """A request iterator that never yields until ``stop`` (at most 30 s): the call's body never comes."""
    stop.wait(30)
    return
    yield


def _channel(address: str) -> grpc.Channel:
    """A channel on a connection of its own (one client, as the server's quotas see clients)."""
    return grpc.insecure_channel(address, options=OWN_CONNECTION)


def _register(stub, segment: shared_memory.SharedMemory) -> pb.RegisterSharedMemoryResponse:
    """Both registration steps: ask for a challenge, write it at offset 0, prove it."""
    reply = stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=segment.name, byte_size=segment.size),
                                      timeout=10)
    segment.buf[:len(reply.challenge)] = reply.challenge
    return stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=segment.name, byte_size=segment.size,
                                                                    proof=reply.challenge), timeout=10)


@pytest.fixture
def segments():
    """``segments(n)``: n new 4 KiB shared-memory segments, closed and unlinked after the test."""
    made: list[shared_memory.SharedMemory] = []

    def make(n: int) -> list[shared_memory.SharedMemory]:
        new = [shared_memory.SharedMemory(create=True, size=4096) for _ in range(n)]
        made.extend(new)
        return new
    yield make
    for s in made:
        s.close()
        s.unlink()


# ------------------------------------------------------------------ per-client shared-memory quotas
def test_one_client_cannot_take_every_region_and_another_still_registers(make_server, segments):
    """With the defaults, one client (one connection) registering distinct segments gets 64 regions, then
    RESOURCE_EXHAUSTED naming --max-shm-regions-per-client; another client still registers, and the first
    one registers again once it unregistered a region (before: the first client took all 256 regions, each
    segment within its per-segment cap of 4, and every other client was refused)."""
    srv = make_server()
    theirs_segment, *mine = segments(66)
    with _channel(srv.address) as a, _channel(srv.address) as b:
        stub_a, stub_b = pb_grpc.AdvantageServiceStub(a), pb_grpc.AdvantageServiceStub(b)
        held = [_register(stub_a, s) for s in mine[:64]]
        assert len({r.region_id for r in held}) == 64
        with pytest.raises(grpc.RpcError) as err:
            _register(stub_a, mine[64])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-shm-regions-per-client=64" in err.value.details()
        assert "holds 64 shared-memory regions" in err.value.details()
        theirs = _register(stub_b, theirs_segment)  # another client is not affected
        assert theirs.region_id and theirs.key
        stub_a.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(region_id=held[0].region_id,
                                                                       key=held[0].key), timeout=10)
        again = _register(stub_a, mine[64])  # a place of its own came back
        assert again.region_id
        for r in held[1:] + [again, theirs]:
            (stub_b if r is theirs else stub_a).UnregisterSharedMemory(
                pb.UnregisterSharedMemoryRequest(region_id=r.region_id, key=r.key), timeout=10)


def test_the_quota_flag_sets_the_regions_per_client(make_server, segments):
    srv = make_server(max_shm_regions_per_client=2)
    own = segments(4)
    with _channel(srv.address) as a, _channel(srv.address) as b:
        stub_a, stub_b = pb_grpc.AdvantageServiceStub(a), pb_grpc.AdvantageServiceStub(b)
        assert _register(stub_a, own[0]).region_id and _register(stub_a, own[1]).region_id
        with pytest.raises(grpc.RpcError) as err:  # already refused at the first step
            stub_a.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=own[2].name, byte_size=4096), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-shm-regions-per-client=2" in err.value.details()
        assert _register(stub_b, own[2]).region_id and _register(stub_b, own[3]).region_id


def test_a_flood_of_first_steps_evicts_only_the_flooding_clients_challenges(make_server, segments):
    """Client B holds a pending challenge; client A sends 1,100 first steps, for names of its own (none of
    them needs to exist) and for B's segment name. B then proves its challenge and registers; A's own
    challenge from before its flood is gone (PERMISSION_DENIED). Before: the 1,024-entry table dropped its
    oldest entries whoever held them, and 4 first steps naming B's segment replaced B's challenge."""
    srv = make_server()
    theirs, mine = segments(2)
    with _channel(srv.address) as a, _channel(srv.address) as b:
        stub_a, stub_b = pb_grpc.AdvantageServiceStub(a), pb_grpc.AdvantageServiceStub(b)
        pending = stub_b.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=theirs.name, byte_size=4096),
                                              timeout=10).challenge
        early = stub_a.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=mine.name, byte_size=4096),
                                            timeout=10).challenge
        for i in range(1100):
            name = theirs.name if i % 100 == 0 else f"no_such_segment_{i}"
            stub_a.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=name, byte_size=4096), timeout=10)
        theirs.buf[:len(pending)] = pending
        region = stub_b.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=theirs.name, byte_size=4096,
                                                                            proof=pending), timeout=10)
        assert region.region_id and region.key
        mine.buf[:len(early)] = early
        with pytest.raises(grpc.RpcError) as err:
            stub_a.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=mine.name, byte_size=4096, proof=early),
                                        timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _register(stub_a, mine).region_id  # a fresh challenge still works for A
        stub_b.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(region_id=region.region_id,
                                                                       key=region.key), timeout=10)


def test_client_identity_is_the_connections_peer_string():
    from advantage_server.transport import client_identity

    class Context:
        def __init__(self, peer):
            self._peer = peer

        def peer(self):
            if isinstance(self._peer, Exception):
                raise self._peer
            return self._peer
    assert client_identity(Context("ipv4:127.0.0.1:50612")) == "ipv4:127.0.0.1:50612"
    assert client_identity(Context("ipv6:[::1]:50612")) == "ipv6:[::1]:50612"
    assert client_identity(Context("unix:")) == "unix:"
    assert client_identity(Context("")) == "unknown"
    assert client_identity(Context(RuntimeError("no peer"))) == "unknown"


# ------------------------------------------------------------------ minimum upload rate
def _in_process(rewards, mask) -> np.ndarray:
    """raw_reward computed by the server's core in this process (what a served call must equal bit for bit)."""
    import torch
    from advantage_server.core import AdvantageCore
    result = AdvantageCore("cpu").run("raw_reward", None, {"rewards": torch.as_tensor(np.asarray(rewards, np.float32)),
                                                           "mask": torch.as_tensor(np.asarray(mask, np.float32))})
    return result.advantages.numpy()


class _FakeContext:
    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


def _trickle(watch, min_rate: int, window: float, seconds: float, nbytes: int = 1, every: float = 0.05):
    """Touch a watch with ``nbytes`` every ``every`` seconds for ``seconds`` (or until cut); the context."""
    ctx = _FakeContext()
    with watch.watch(ctx, min_rate, window) as touch:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not ctx.cancelled.is_set():
            touch(nbytes)
            time.sleep(every)
    return ctx


def test_the_upload_watch_cuts_a_trickle_below_the_minimum_rate():
    from advantage_server.limits import UploadCut, UploadWatch
    watch = UploadWatch(timeout=30.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(UploadCut) as err:  # 20 B/s against 1 KiB/s, idle clock restarted every 50 ms
            _trickle(watch, 1024, 0.4, seconds=10)
        assert time.monotonic() - t0 < 3  # one window and a check period
        assert "--min-upload-rate-kib=1" in str(err.value) and "--upload-rate-window=0.4" in str(err.value)
        assert watch.slow_cuts == 1 and watch.cuts == 1
        # above the minimum (20 KiB/s against 1 KiB/s), and with the minimum off: never cut
        _trickle(watch, 1024, 0.4, seconds=1.5, nbytes=1024)
        _trickle(watch, 0, 0.4, seconds=1.5)
        assert watch.cuts == 1
    finally:
        watch.stop()


def _trickle_stream(channel: grpc.Channel, request: bytes, stop: threading.Event, every: float = 0.1):
    """A ComputeAdvantageStream call that sends its request one byte per chunk, ``every`` seconds apart:
    far under any sane rate, but never idle for as long as --stream-idle-timeout."""
    def chunks():
        for i in range(len(request)):
            yield pb.ComputeAdvantageChunk(total_size=len(request) if i == 0 else 0,
                                           data=request[i:i + 1]).SerializeToString()
            if stop.wait(every):
                return
    return channel.stream_stream(f"/{SERVICE}/ComputeAdvantageStream")(chunks(), timeout=30)


def test_a_trickling_upload_is_cut_and_its_place_comes_back(make_server, capsys):
    """One byte per 0.1 s keeps the idle clock (5 s here) from ever running out; before, that held the only
    --max-concurrent-requests place until the client's own 30 s deadline. Now it is cut with
    RESOURCE_EXHAUSTED naming --min-upload-rate-kib after the 1 s window, and the next client is served."""
    srv = make_server(max_concurrent_requests=1, stream_idle_timeout=5.0, upload_rate_window=1.0)
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]]).SerializeToString()
    stop = threading.Event()
    try:
        with _channel(srv.address) as a, _channel(srv.address) as b:
            t0 = time.monotonic()
            responses = _trickle_stream(a, request, stop)
            deadline = time.monotonic() + 10  # until the trickle holds the place (a fixed 0.3 s was too short for
            while not srv.gate.full and time.monotonic() < deadline:  # a busy loop beside it: issue #37's runs)
                time.sleep(0.02)
            assert srv.gate.full
            # the trickle holds the only place: a call on its own connection is refused (one on another connection
            # of this host, holding nothing, would now cut the trickle for its place: issue #35 item 2)
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.AdvantageServiceStub(a).ComputeAdvantage(build_request(
                    "raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]]), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-requests=1" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                list(responses)
            cut_after = time.monotonic() - t0
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "--min-upload-rate-kib=1024" in err.value.details()
            assert cut_after < 4, cut_after  # the 1 s window, a check period, and slack for a loaded machine
            assert srv.uploads.slow_cuts == 1
            deadline = time.monotonic() + 10
            while srv.gate.in_flight and time.monotonic() < deadline:  # the cut call's last callbacks
                time.sleep(0.05)
            assert srv.gate.in_flight == 0
            reply = pb_grpc.AdvantageServiceStub(b).ComputeAdvantage(build_request(
                "raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]]), timeout=10)
            np.testing.assert_array_equal(decode_result(reply, as_numpy=True).advantages,
                                          _in_process([1.0, 0.0], [[1.0], [1.0]]))
    finally:
        stop.set()
    report(capsys, f"a stream trickling 1 byte per 0.1 s (--stream-idle-timeout 5, --upload-rate-window 1, "
                   f"--max-concurrent-requests 1): cut after {cut_after:.2f} s naming --min-upload-rate-kib=1024, "
                   "the next client served")


def test_a_slow_upload_above_the_minimum_is_not_cut(make_server):
    """A 12 MiB request sent in 64 KiB chunks 25 ms apart, about 2.5 MiB/s (some 5 s, over two 2 s windows;
    forty times the 64 KiB/s minimum) is served.

    The margin is for the test's own machine: client and server share one process here, so a loaded CI machine
    stalls both together. An upload at forty times the minimum must go quiet for ~1.95 s of a 2 s window to fall
    under it (the 0.5 s window this test used before was cut once on CI, after a stall of about 0.4 s; at ten times a
    256 KiB/s minimum it was cut once in 10 runs beside a busy loop on both cores, the client's own sends slowed to
    185 KiB/s)."""
    srv = make_server(upload_rate_window=2.0, min_upload_rate_kib=64)
    rng = np.random.default_rng(3)
    rewards = rng.standard_normal(1 << 20).astype(np.float32)
    mask = np.ones((1 << 20, 2), np.float32)
    request = build_request("raw_reward", None, rewards=rewards, mask=mask).SerializeToString()
    assert len(request) > 12 << 20
    step = 64 << 10
    sent: list[float] = []

    def steady():
        for i in range(0, len(request), step):
            sent.append(time.monotonic())
            yield pb.ComputeAdvantageChunk(total_size=len(request) if i == 0 else 0,
                                           data=request[i:i + step]).SerializeToString()
            time.sleep(0.025)
    with _channel(srv.address) as channel:
        t0 = time.monotonic()
        try:
            replies = list(channel.stream_stream(f"/{SERVICE}/ComputeAdvantageStream")(steady(), timeout=60))
        except grpc.RpcError as err:  # say how long the client itself went quiet, to tell a stall from a bug
            gap = max(b - a for a, b in zip(sent, sent[1:])) if len(sent) > 1 else None
            pytest.fail(f"cut after {time.monotonic() - t0:.2f} s, {len(sent)} chunks sent, the longest gap between "
                        f"two of them {gap} s: {err.code()}: {err.details()}")
        took = time.monotonic() - t0
    assert replies and took > 2.0, took  # the rate was checked at least once (the first check comes after 2 s)
    assert srv.uploads.cuts == 0


def test_a_large_upload_on_loopback_is_not_cut(make_server, capsys):
    """A 320 MiB request through the streaming transport, against the default 1 MiB/s over a short window
    (0.25 s, so the rate is checked several times during the upload): served, and right."""
    srv = make_server(upload_rate_window=0.25)
    B, T = 4096, 20480
    rng = np.random.default_rng(5)
    rewards = rng.standard_normal(B).astype(np.float32)
    mask = (rng.random((B, T)) < 0.9).astype(np.float32)
    # compact=False: the float32 mask goes as it is (320 MiB), not compacted to a few bytes per row
    with AdvantageClient(srv.address, timeout=120, transport="stream", compact=False) as client:
        t0 = time.monotonic()
        result = client.compute("raw_reward", rewards=rewards, mask=mask, as_numpy=True)
        took = time.monotonic() - t0
        assert client.last_timing["request_bytes"] > 320 << 20, client.last_timing
    np.testing.assert_array_equal(result.advantages, _in_process(rewards, mask))
    assert srv.uploads.cuts == 0, took
    report(capsys, f"a {client.last_timing['request_bytes'] / 2**20:.0f} MiB streamed request against "
                   f"--min-upload-rate-kib 1024 over a 0.25 s window: not cut, served in {took:.2f} s")


def test_the_minimum_rate_can_be_turned_off(make_server):
    """--min-upload-rate-kib 0: a trickle is bounded by --stream-idle-timeout only (not cut within 2 s)."""
    srv = make_server(min_upload_rate_kib=0, upload_rate_window=0.5)
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]]).SerializeToString()
    stop = threading.Event()
    with _channel(srv.address) as channel:
        responses = _trickle_stream(channel, request[:40] if len(request) > 40 else request, stop, every=0.05)
        time.sleep(2.0)
        assert srv.uploads.cuts == 0
        stop.set()
        with pytest.raises(grpc.RpcError) as err:  # the client ended its stream early: malformed, not cut
            list(responses)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_new_flags_are_checked():
    from advantage_server.cli import build_parser, main
    from advantage_server.limits import Limits
    for flag, bad in (("--min-upload-rate-kib", "-1"), ("--min-upload-rate-kib", "1.5"),
                      ("--upload-rate-window", "0"), ("--upload-rate-window", "nan"),
                      ("--max-shm-regions-per-client", "0")):
        assert main(["--port", "0", "--device", "cpu", flag, bad]) == 2, (flag, bad)
    args = build_parser().parse_args(["--min-upload-rate-kib", "0", "--max-shm-regions-per-client", "8"])
    assert args.min_upload_rate_kib == 0 and args.max_shm_regions_per_client == 8
    defaults = build_parser().parse_args([])
    assert (defaults.min_upload_rate_kib, defaults.upload_rate_window, defaults.max_shm_regions_per_client) == \
        (1024, 5.0, 64)
    assert Limits().min_upload_rate_bytes == 1 << 20
    for bad in ({"min_upload_rate_kib": -1}, {"upload_rate_window": 0.0}, {"max_shm_regions_per_client": 0}):
        with pytest.raises(ValueError):
            Limits(**bad)


# ------------------------------------------------------------------ prepare checks the call's deadline
def test_prepare_stops_at_the_calls_checkpoint():
    """The deadline passes during the first input check: the call stops at the next check, inside prepare
    (before: prepare had no checkpoint, so it checked, scanned and cast every input, and the estimator ran)."""
    import torch
    from advantage_server import core as core_mod
    from advantage_server.limits import RequestExpired, checkpoints
    stages: list[str] = []

    def check(stage: str) -> None:
        stages.append(stage)
        if len(stages) > 1:
            raise RequestExpired(stage, deadline=True)
    B, T = 8, 16
    core = core_mod.AdvantageCore("cpu")
    with checkpoints(check), pytest.raises(RequestExpired) as err:
        core.run("gae", None, {"rewards": torch.ones(B, T), "values": torch.zeros(B, T), "mask": torch.ones(B, T)})
    assert err.value.stage == "while checking the inputs"
    assert stages == ["while checking the inputs"] * 2  # stopped at the second of 6 or more


def test_an_expired_call_stops_in_prepare_and_never_computes(make_server, monkeypatch, caplog):
    """Each input check made slow (2 s, as a pass over a 2**27-element input is on a loaded machine), a
    1.5 s deadline: DEADLINE_EXCEEDED, the server stops after the first check (logged "deadline expired
    while checking the inputs") and the estimator never runs (before: every check ran, then it stopped
    "before computing"). The deadline leaves the request 1.5 s to arrive (0.4 s checks and a 0.25 s deadline ran
    out while receiving it once, at a load average of 28)."""
    from advantage_server import validate
    from advantage_server.estimators import REGISTRY
    checks: list[float] = []
    computed: list[int] = []
    def slow(real):
        def check(t):
            time.sleep(2.0)
            checks.append(time.monotonic())
            return real(t)
        return check

    def counted(fn):
        def run(cfg, batch):
            computed.append(1)
            return fn(cfg, batch)
        return run
    monkeypatch.setattr(validate, "is_binary", slow(validate.is_binary))
    monkeypatch.setattr(validate, "all_finite", slow(validate.all_finite))
    monkeypatch.setitem(REGISTRY, "opd", dataclasses.replace(REGISTRY["opd"], fn=counted(REGISTRY["opd"].fn)))
    srv = make_server()
    B, T = 4, 8
    request = build_request("opd", None, mask=np.ones((B, T), np.float32),
                            teacher_logprobs=np.zeros((B, T), np.float32),
                            prev_logprobs=np.zeros((B, T), np.float32))
    with caplog.at_level(logging.DEBUG, logger="advantage_server"), _channel(srv.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage(request, timeout=1.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while "deadline expired" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.5)  # a second check, were one made, would have ended by now
    assert "deadline expired while checking the inputs" in caplog.text, caplog.text
    assert computed == [] and len(checks) == 1, (computed, checks)


def test_large_chunks_above_the_minimum_rate_are_never_cut_and_a_trickle_still_is():
    """The rate counts whole chunks (gRPC hands a message over only once all of it has arrived): a reviewer's
    128 MiB chunks at ~11 MiB/s read as 0 KiB/s over the 5 s window and were cut. The window now widens to two
    chunks' time at the minimum, so 8 MiB chunks every 4 s (2 MiB/s) against 1 MiB/s over a 1 s window are
    never cut, checked at every 0.1 s of a simulated minute; 1-byte chunks every 0.1 s still are, and nothing
    is measured before the first chunk (the idle timeout bounds that wait)."""
    from advantage_server.limits import _Upload
    mib = 1 << 20
    big = _Upload(context=None, idle_deadline=1e9, min_rate=mib, window=1.0, now=0.0)
    trickle = _Upload(context=None, idle_deadline=1e9, min_rate=mib, window=1.0, now=0.0)
    assert big.rate_below(3.0) is None  # no chunk yet: not measured
    cut_at = None
    for step in range(1, 601):
        now = step / 10
        if step % 40 == 0:  # a whole 8 MiB chunk arrives every 4 s
            big.received += 8 * mib
            big.largest = max(big.largest, 8 * mib)
        assert big.rate_below(now) is None, f"cut at {now} s, span {big.span()} s"
        trickle.received += 1
        trickle.largest = 1
        if cut_at is None and trickle.rate_below(now) is not None:
            cut_at = now
    assert big.span() == 16.0
    assert cut_at is not None and cut_at <= 1.2


def test_memfd_regions_count_against_their_process_whatever_the_connection(make_server):
    """A reviewer took all 256 regions by opening 64 connections (a quota each). A memfd region now counts
    against the process holding it (its name says memfd:<pid>:<fd>, and the proof shows the caller can write
    it): with --max-shm-regions-per-client=2, this process's third memfd is refused on a second connection
    too, while its POSIX segments still count per connection."""
    import fcntl
    import os
    srv = make_server(max_shm_regions_per_client=2)
    fds = []
    try:
        for _ in range(3):
            fd = os.memfd_create("advantage-shm", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 4096)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            fds.append(fd)

        def register(stub, fd):
            name = f"memfd:{os.getpid()}:{fd}"
            reply = stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=name, byte_size=4096), timeout=10)
            os.pwrite(fd, reply.challenge, 0)
            return stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=name, byte_size=4096,
                                                                            proof=reply.challenge), timeout=10)

        with _channel(srv.address) as a, _channel(srv.address) as b:
            stub_a, stub_b = pb_grpc.AdvantageServiceStub(a), pb_grpc.AdvantageServiceStub(b)
            assert register(stub_a, fds[0]).region_id and register(stub_b, fds[1]).region_id
            with pytest.raises(grpc.RpcError) as err:
                register(stub_b, fds[2])
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"pid:{os.getpid()}" in err.value.details()
            assert "--max-shm-regions-per-client=2" in err.value.details()
    finally:
        for fd in fds:
            os.close(fd)


def test_a_new_connection_holding_nothing_cuts_a_stalled_upload_of_its_own_host(make_server, monkeypatch):
    """Issue #35 item 2: a slow-loris opening a fresh connection per stalled call holds one pending call on each, and
    a same-host newcomer could take a place back only from a connection holding two more than its own: it never
    could, and got 0 calls. A newcomer whose connection holds nothing now cuts a stalled upload of another
    connection of its host (here the only place, held by a call that never sends its body) and is served."""
    from advantage_server import server as server_mod

    # a newcomer (no result yet) cuts only an upload stalled this long (0.5 s by default; shortened here)
    monkeypatch.setattr(server_mod, "NEWCOMER_CUT_STALL_S", 0.25)
    srv = make_server(max_concurrent_requests=1, stream_idle_timeout=30.0)
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    stop = threading.Event()

    with _channel(srv.address) as a, _channel(srv.address) as b:
        stalled = a.stream_unary(f"/{SERVICE}/ComputeAdvantage").future(_silent(stop), timeout=30)
        try:
            deadline = time.monotonic() + 10
            while not srv.uploads._watched and time.monotonic() < deadline:  # admitted, waiting for its body
                time.sleep(0.05)
            time.sleep(0.3)  # stalled: no bytes for STALL_S
            reply = pb_grpc.AdvantageServiceStub(b).ComputeAdvantage(request, timeout=10)
            np.testing.assert_array_equal(decode_result(reply, as_numpy=True).advantages,
                                          _in_process([1.0, 0.0], [[1.0], [1.0]]))
            with pytest.raises(grpc.RpcError) as err:
                stalled.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            from advantage_client.client import CUT_FOR_ANOTHER  # the client sends such a cut call again
            assert err.value.details().startswith(CUT_FOR_ANOTHER)
            assert srv.uploads.evictions == 1
        finally:
            stop.set()


def test_fresh_connections_answer_for_their_stalling_host_until_they_have_had_a_result(make_server, monkeypatch):
    """Issue #35 item 2, stalling judged per host: a slow-loris opening a fresh connection for every stalled call had
    each call judged by a clean record of its own, so its calls filled every place (other host: 10% of unattacked
    goodput). A connection that has had no result delivered now answers for its host: while its host holds stalled
    uploads it may fill the server only to ``stalled_cap`` (half the places), so 6 fresh silent callers of one host
    hold 2 of 4 places, not 4, and a connection of the same host that has had a result keeps its own record: served
    from a free place, cutting nothing. Each silent newcomer past ``stalled_cap`` waits and is refused, cutting
    nothing: it may cut one of its host's stalled uploads only once its body has arrived (read while it waits,
    :class:`advantage_server.uploads.EarlyBody`). Until the room-full fix each cut one on arrival, and 20 such
    connections churned the places they held so fast that a new client whose body had arrived found none to cut."""
    from advantage_server import server as server_mod

    monkeypatch.setattr(server_mod, "NEWCOMER_CUT_STALL_S", 0.25)  # 0.5 s by default: the test's calls are 0.3 s apart
    srv = make_server(max_concurrent_requests=4, stream_idle_timeout=30.0)
    assert srv.gate.stalled_cap == 2
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    want = _in_process([1.0, 0.0], [[1.0], [1.0]])
    stop = threading.Event()

    reader = _channel(srv.address)
    stub = pb_grpc.AdvantageServiceStub(reader)
    np.testing.assert_array_equal(decode_result(stub.ComputeAdvantage(request, timeout=10), as_numpy=True).advantages,
                                  want)  # this connection has had a result: it keeps its own record
    fresh, calls = [], []
    try:
        for _ in range(6):
            ch = _channel(srv.address)
            fresh.append(ch)
            calls.append(ch.stream_unary(f"/{SERVICE}/ComputeAdvantage").future(_silent(stop), timeout=30))
            time.sleep(0.3)  # admitted (or not), then stalled: no bytes for STALL_S
        deadline = time.monotonic() + 10  # each waits STALLED_WAIT_S (2 s); the last started 1.5 s after the first
        while sum(1 for c in calls if c.done()) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        host_pending = max(srv.uploads.shares._hosts.values(), default=0)
        refused = [c for c in calls if c.done()]
        assert host_pending == srv.gate.stalled_cap, (host_pending, srv.uploads.evictions)
        assert len(refused) == 4 and srv.uploads.evictions == 0, (len(refused), srv.uploads.evictions)
        for c in refused:  # held below stalled_cap for its host's stalls, and told so
            assert c.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "(or, before its first result, its host does)" in c.exception().details()
        before = srv.uploads.evictions
        for _ in range(3):
            reply = stub.ComputeAdvantage(request, timeout=10)
            np.testing.assert_array_equal(decode_result(reply, as_numpy=True).advantages, want)
        assert srv.uploads.evictions == before  # a free place each time: nothing cut for the reader
    finally:
        stop.set()
        for ch in (reader, *fresh):
            ch.close()


def test_a_new_connection_whose_body_arrives_while_it_waits_is_served_beside_fresh_silent_connections(make_server):
    """Issue #35 item 2, measured on a client process started beside a slow-loris that opens a fresh connection per
    stalled call: its first call was refused six times in a row (12 s; RESOURCE_EXHAUSTED after the client's 5
    resends). Its connection answered for its host's stalls like the slow-loris's own, so it waited behind them,
    held below ``stalled_cap``, and tried to take a place back only once, before any upload had been silent for
    ``NEWCOMER_CUT_STALL_S``. Now it reads its body while it waits (:class:`advantage_server.uploads.EarlyBody`):
    the body arrives, the connection has a record of its own, and it is admitted as a prompt caller: to a place
    the stalling host may not fill, or by cutting a silent upload as soon as one qualifies. Here 5 fresh silent calls
    of this host come at once: those that come before the first has stalled take every place (4 when all come within
    ``STALL_S``; beside a busy loop, as few as ``stalled_cap``, 2), the rest wait or are refused. A new connection
    0.15 s later is served on its first attempt (no resend: a raw stub), by at most one cut; the silent ones never
    count as having sent a body."""
    srv = make_server(max_concurrent_requests=4, stream_idle_timeout=30.0)
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    stop = threading.Event()
    fresh = [_channel(srv.address) for _ in range(5)]
    try:
        calls = [ch.stream_unary(f"/{SERVICE}/ComputeAdvantage").future(_silent(stop), timeout=30) for ch in fresh]
        deadline = time.monotonic() + 10
        settled = lambda: len(srv.uploads._watched) + srv.gate.waiting + sum(c.done() for c in calls) == 5  # noqa: E731
        while not (settled() and len(srv.uploads._watched) >= srv.gate.stalled_cap) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(srv.uploads._watched) >= srv.gate.stalled_cap, (len(srv.uploads._watched), srv.gate.waiting)
        time.sleep(0.15)  # stalled (STALL_S): the host holds stalled uploads; none silent for NEWCOMER_CUT_STALL_S yet
        with _channel(srv.address) as newcomer:
            reply = pb_grpc.AdvantageServiceStub(newcomer).ComputeAdvantage(request, timeout=10)
        np.testing.assert_array_equal(decode_result(reply, as_numpy=True).advantages,
                                      _in_process([1.0, 0.0], [[1.0], [1.0]]))
        assert len(srv.uploads._early) == 1  # the newcomer's connection, not a silent one
        from advantage_client.client import CUT_FOR_ANOTHER

        def cut() -> list:
            return [c for c in calls if c.done() and c.exception().details().startswith(CUT_FOR_ANOTHER)]
        deadline = time.monotonic() + 5  # the cut call's status reaches its client a moment later on a loaded machine
        while len(cut()) < srv.uploads.evictions and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(cut()) == srv.uploads.evictions <= 1, (len(cut()), srv.uploads.evictions)
    finally:
        stop.set()
        for ch in fresh:
            ch.close()


def test_a_new_connection_is_served_when_fresh_silent_connections_also_fill_the_waiting_room(make_server):
    """Issue #35 item 2, the room-full variant (found by a fresh-eyes review): a slow-loris with a fresh connection
    per silent call and enough connections to fill the places *and* the waiting room. A new connection of its host
    ranks with the silent ones (each answers for the host's stalls) and, coming last, was dropped by the full room
    before its body could arrive: with 12 attacker connections at C=4, 4 of 20 new clients were served; with 20, 0 of
    20. Now it takes the room of the waiter whose body has been awaited longest; its own body arrives at once, and it
    is served as a prompt caller. Here 14 silent calls of this host fill the 4 places and the room of 8 (2 are refused
    or dropped); a new connection is served on its first attempt (a raw stub, no resend), and the one silent call it
    displaced is refused, not served."""
    srv = make_server(max_concurrent_requests=4, stream_idle_timeout=30.0)
    assert srv.gate.max_waiting == 8
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    stop = threading.Event()
    fresh = [_channel(srv.address) for _ in range(14)]
    try:
        calls = []
        for ch in fresh:  # one at a time, so that each finds the host already stalling
            calls.append(ch.stream_unary(f"/{SERVICE}/ComputeAdvantage").future(_silent(stop), timeout=30))
            time.sleep(0.03)
        deadline = time.monotonic() + 10
        while srv.gate.waiting < srv.gate.max_waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.gate.waiting == srv.gate.max_waiting, (srv.gate.waiting, len(srv.uploads._watched))
        dropped = srv.gate.dropped
        with _channel(srv.address) as newcomer:
            reply = pb_grpc.AdvantageServiceStub(newcomer).ComputeAdvantage(request, timeout=10)
        np.testing.assert_array_equal(decode_result(reply, as_numpy=True).advantages,
                                      _in_process([1.0, 0.0], [[1.0], [1.0]]))
        assert srv.gate.dropped >= dropped + 1  # the silent call whose room it took
        assert not any(c.done() and c.exception() is None for c in calls)  # no silent call was served
        assert len(srv.uploads._early) == 1  # the newcomer's connection: no silent one counts as having sent a body
    finally:
        stop.set()
        for ch in fresh:
            ch.close()


def _trickling_chunks(stop: threading.Event, declared: int = 1 << 20, every: float = 1.0):
    """A streamed upload's chunks that never finish: 16 bytes of a declared ``declared`` first, then 16 bytes every
    ``every`` seconds until ``stop`` (the stream is never half-closed)."""
    yield pb.ComputeAdvantageChunk(total_size=declared, data=b"\0" * 16).SerializeToString()
    while not stop.wait(every):
        yield pb.ComputeAdvantageChunk(data=b"\0" * 16).SerializeToString()


def _chunked(request: pb.ComputeAdvantageRequest, size: int) -> list[bytes]:
    """``request`` as the streaming transport's serialized chunk messages of ``size`` bytes each."""
    body = request.SerializeToString()
    return [pb.ComputeAdvantageChunk(total_size=len(body) if i == 0 else 0, data=body[i:i + size]).SerializeToString()
            for i in range(0, len(body), size)]


def test_a_new_stream_is_served_beside_fresh_trickling_streams_that_also_fill_the_waiting_room(make_server):
    """Issue #35 item 2, the streamed variant: a slow-loris of ``ComputeAdvantageStream`` calls, each on a fresh
    connection reopened as soon as it ends, that send 16 bytes of a declared 1 MiB and then 16 bytes a second,
    filling the places and the waiting room. A new stream of the same host ranks with them and, unlike a unary call,
    could not show its body while it waited: the full room refused it at once, and the one cut it could try on arrival
    found no upload silent for ``NEWCOMER_CUT_STALL_S``, since the slow-loris's own arrivals cut them first (measured
    at C=4 beside 24 such loops: 1 new stream of 10 served). Now a waiting stream is read early
    (:class:`advantage_server.uploads.EarlyStream`): it takes the room of the waiter furthest behind, and once its
    stream has arrived whole (a small request) or its first 16 MiB have (a large one), it ranks and cuts as a prompt
    caller, for this call only. Here 16 loops keep the 4 places and the room of 8 full; three small new streams and
    a 20 MiB one are each served within two attempts (raw stubs, a fresh connection each; one attempt in 10 runs
    beside two busy loops was refused), no trickling stream is, and no connection is given a record for a stream
    (``_early`` stays empty)."""
    srv = make_server(max_concurrent_requests=4, stream_idle_timeout=30.0)
    stop = threading.Event()
    method = f"/{SERVICE}/ComputeAdvantageStream"
    served_trickles = []

    def loop() -> None:
        while not stop.is_set():
            with _channel(srv.address) as ch:
                try:
                    list(ch.stream_stream(method)(_trickling_chunks(stop), timeout=30))
                    served_trickles.append(1)
                except grpc.RpcError:
                    pass
            stop.wait(0.005)
    loops = [threading.Thread(target=loop, daemon=True) for _ in range(16)]
    try:
        for t in loops:
            t.start()
        deadline = time.monotonic() + 10
        while srv.gate.waiting < srv.gate.max_waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.gate.waiting == srv.gate.max_waiting, (srv.gate.waiting, len(srv.uploads._watched))
        time.sleep(1.0)  # the loops' arrivals now cut and refill the places, as they would in a long attack
        small = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
        n = 5 << 20  # 20 MiB of float32 rewards: past EARLY_STREAM_BYTES, proven by its first 16 MiB
        rewards = np.linspace(-1.0, 1.0, n, dtype=np.float32)
        large = build_request("raw_reward", None, rewards=rewards, mask=np.ones((n, 1), np.float32))
        expected_small = _in_process([1.0, 0.0], [[1.0], [1.0]])
        from advantage_client import codec, streaming
        for request, expected in ((small, expected_small), (small, expected_small), (small, expected_small),
                                  (large, _in_process(rewards, np.ones((n, 1), np.float32)))):
            for attempt in (1, 2):  # a second attempt (a fresh connection again) only for a refusal: a loaded CI
                # worker may descend on a moment of no silent upload; the tree before refused 9-10 of 10 attempts
                with grpc.insecure_channel(srv.address, options=[*OWN_CONNECTION,
                                                                 ("grpc.max_send_message_length", 64 << 20)]) as ch:
                    try:
                        pieces = list(ch.stream_stream(method)(iter(_chunked(request, 1 << 20)), timeout=20))
                        break
                    except grpc.RpcError as err:
                        if attempt == 2 or err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
            buf = streaming.reassemble(codec.decode_chunk(p) for p in pieces)
            np.testing.assert_array_equal(codec.decode_result(memoryview(buf)).advantages.numpy("advantages"), expected)
        assert srv.gate.dropped >= 1 and not served_trickles  # trickling waiters were dropped; none was served
        assert len(srv.uploads._early) == 0  # a stream's proof is its call's, never its connection's record
    finally:
        stop.set()
        for t in loops:
            t.join(35)


def test_a_newcomer_cuts_only_an_upload_stalled_for_half_a_second(make_server):
    """A connection with no result yet (a newcomer, or a slow-loris's fresh connection) cuts only an upload that has
    been without bytes for ``NEWCOMER_CUT_STALL_S`` (0.5 s): 64 client processes starting at once on 2 cores had
    their first bodies stall past ``STALL_S`` (0.1 s) and cut each other (tests/test_shm_many_processes.py). Here the
    one place is held by a silent call: a newcomer 0.1 s later is refused without cutting it (its own wait ends
    before the upload has been silent 0.5 s: 0.25 s of margin for a loaded machine; at 0.3 s later the margin was
    50 ms, and a full `make test` once ran past it); one after ~1 s cuts it and is served."""
    from advantage_server import server as server_mod

    assert server_mod.NEWCOMER_CUT_STALL_S == 0.5
    srv = make_server(max_concurrent_requests=1, stream_idle_timeout=30.0)
    request = build_request("raw_reward", None, rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    stop = threading.Event()

    with _channel(srv.address) as a:
        stalled = a.stream_unary(f"/{SERVICE}/ComputeAdvantage").future(_silent(stop), timeout=30)
        try:
            deadline = time.monotonic() + 10
            while not srv.uploads._watched and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.1)
            with _channel(srv.address) as b:
                with pytest.raises(grpc.RpcError) as err:  # 0.1-0.25 s stalled: not cut for a newcomer
                    pb_grpc.AdvantageServiceStub(b).ComputeAdvantage(request, timeout=0.15)
            assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert srv.uploads.evictions == 0 and not stalled.done()
            time.sleep(1.0)
            with _channel(srv.address) as c:
                reply = pb_grpc.AdvantageServiceStub(c).ComputeAdvantage(request, timeout=10)
            np.testing.assert_array_equal(decode_result(reply, as_numpy=True).advantages,
                                          _in_process([1.0, 0.0], [[1.0], [1.0]]))
            assert srv.uploads.evictions == 1
        finally:
            stop.set()


class _PeerContext(_FakeContext):
    """A fake call context from connection ``peer`` (``ipv4:HOST:PORT``)."""

    def __init__(self, peer: str):
        super().__init__()
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_a_newcomer_from_another_host_cuts_a_stalled_upload_without_the_half_second():
    """``NEWCOMER_CUT_STALL_S`` guards a host's own slowed first bodies from its neighbours. Between hosts the fair
    shares already pick a host holding two more pending calls than the caller's, so a newcomer of another host cuts
    an upload as soon as it counts as stalled (``STALL_S``). A fresh trainer on another host beside a slow-loris
    whose calls had all come at once waited up to 0.5 s for its first call (bench ``slow-loris-fresh``)."""
    from advantage_server.shares import STALL_S
    from advantage_server.uploads import UploadCut, UploadWatch

    watch = UploadWatch(timeout=30.0)
    stalled = [_PeerContext(f"ipv4:10.0.0.1:{5000 + i}") for i in range(3)]
    blocks = [watch.watch(ctx) for ctx in stalled]
    for block in blocks:
        block.__enter__()
    try:
        time.sleep(STALL_S + 0.05)  # stalled, but far from the min_stall below
        # a min_stall of a minute, not NEWCOMER_CUT_STALL_S's half second: a loaded CI worker once slept past the
        # half second here, and the rule under test is the same whatever the figure
        neighbour = _PeerContext("ipv4:10.0.0.1:6000")
        assert not watch.evict_for(neighbour, min_stall=60.0)  # its own host: min_stall holds
        assert not any(ctx.cancelled.is_set() for ctx in stalled)
        other = _PeerContext("ipv4:10.0.0.2:6000")
        assert watch.evict_for(other, min_stall=60.0)  # another host: stalled is enough
        assert watch.evictions == 1
        assert sum(ctx.cancelled.is_set() for ctx in stalled) == 1
        time.sleep(0.3)
        assert watch.evict_for(neighbour, min_stall=0.3)  # its own host, once min_stall has passed
        assert sum(ctx.cancelled.is_set() for ctx in stalled) == 2
    finally:
        cut = 0
        for block in blocks:
            try:
                block.__exit__(None, None, None)
            except UploadCut:
                cut += 1
    assert cut == 2
