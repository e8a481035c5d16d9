"""The region table's bounds (issue #22 item 6, ``advantage_server.regions``).

* a client registering the memfds of its forked children is charged per connection too: beyond the
  per-connection share (``--max-shm-regions-per-client``) it is refused, whatever pids the names carry
  (before: each child's pid had a quota of its own, and one client with 4 sleeping children took all 256);
* a full table evicts its least recently used region that no call is using (before: RESOURCE_EXHAUSTED for
  everyone until some client unregistered), and refuses only when every region is in use;
* a SIGKILLed owner's region is released by the periodic sweep within ``SWEEP_PERIOD`` (5 s) plus a sweep's
  time, with no other registration needed (before: it stayed mapped until another client registered).
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client import shm as shm_mod
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_server import regions
from advantage_server.errors import ResourceLimit

from reliability_support import report, start_server, stop_server, wait_for

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(os, "memfd_create")
                                     and hasattr(fcntl, "F_ADD_SEALS")), reason="memfd and file seals are Linux-only")

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _memfd() -> int:
    fd = os.memfd_create("advantage-shm", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


def _register(stub, name: str, fd: int) -> pb.RegisterSharedMemoryResponse:
    """Both steps for ``name``; the challenge is written through ``fd`` (the same file)."""
    reply = stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=name, byte_size=4096), timeout=10)
    os.pwrite(fd, reply.challenge, 0)
    return stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(name=name, byte_size=4096,
                                                                    proof=reply.challenge), timeout=10)


# ---------------------------------------------------------------- (1) forked children share the connection's quota
def test_a_client_registering_its_childrens_memfds_gets_one_connections_share(make_server):
    """One connection registers memfds held by 3 sleeping children (``memfd:<child pid>:<fd>``, each pid
    with no region yet): with --max-shm-regions-per-client=2 the third is RESOURCE_EXHAUSTED naming the
    connection and the flag; another connection still registers that child's memfd."""
    srv = make_server(max_shm_regions_per_client=2)
    fds = [_memfd() for _ in range(3)]
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=[fd])
                for fd in fds]
    try:
        names = [f"memfd:{child.pid}:{fd}" for child, fd in zip(children, fds)]
        with grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as a, \
                grpc.insecure_channel(srv.address, options=OWN_CONNECTION) as b:
            stub_a, stub_b = pb_grpc.AdvantageServiceStub(a), pb_grpc.AdvantageServiceStub(b)
            assert _register(stub_a, names[0], fds[0]).region_id and _register(stub_a, names[1], fds[1]).region_id
            with pytest.raises(grpc.RpcError) as err:
                _register(stub_a, names[2], fds[2])
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = err.value.details()
            assert "--max-shm-regions-per-client=2" in details and "holds 2 shared-memory regions" in details
            assert "ipv4:127.0.0.1:" in details and "pid:" not in details  # the connection's share, not a pid's
            assert _register(stub_b, names[2], fds[2]).region_id  # another connection: a share of its own
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=10)
        for fd in fds:
            os.close(fd)


# ---------------------------------------------------------------- (2) LRU eviction when the table is full
def test_a_full_table_evicts_the_least_recently_used_region(make_server, monkeypatch):
    """A table of 3 (MAX_REGIONS patched): regions r0, r1, r2; a call on r0 makes r1 the least recently used;
    a fourth registration evicts r1 (the server answers its next call NOT_FOUND, evicted: the client registers
    the segment again and resends, so the call answers exactly) and r0, r2, r3 answer exactly. Before: the
    fourth registration was RESOURCE_EXHAUSTED; then r1's call was INVALID_ARGUMENT."""
    monkeypatch.setattr(regions, "MAX_REGIONS", 3)
    monkeypatch.setattr(regions, "RECENT_USE_S", 0.0)  # r0's call has just used it: with the default it is kept
    monkeypatch.delenv(shm_mod.MEMFD_ENV, raising=False)
    srv = make_server()
    g = torch.Generator().manual_seed(3)
    tensors = {"rewards": torch.randn(8, generator=g), "mask": torch.ones(8, 16), "values": torch.randn(8, 16, generator=g)}
    with AdvantageClient(srv.address, timeout=30.0) as c:
        want = c.compute("gae", None, transport="unary", **tensors).advantages
        made = [c.shared_memory(1 << 16) for _ in range(3)]
        assert torch.equal(made[0].compute("gae", None, **tensors).advantages, want)
        made.append(c.shared_memory(1 << 16))  # full: r1, the least recently used, goes
        evicted = made[1].region_id
        with pytest.raises(AdvantageServiceError) as err:  # what the server answers: NOT_FOUND, evicted
            c._call("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(region_id=evicted, key=made[1].key),
                    pb.UnregisterSharedMemoryResponse)
        assert err.value.code == grpc.StatusCode.NOT_FOUND and shm_mod.region_gone(err.value) == shm_mod.REASON_EVICTED
        assert torch.equal(made[1].compute("gae", None, **tensors).advantages, want)  # r2, now the LRU, goes
        assert made[1].reregistered == 1 and made[1].region_id != evicted
        for i in (0, 2, 3):
            assert torch.equal(made[i].compute("gae", None, **tensors).advantages, want), i
        # each registration again evicted the table's least recently used region in turn: r2, then r3
        assert [r.reregistered for r in made] == [0, 1, 1, 1]
        for region in made:
            region.close()


class _Fake:
    """What :class:`regions.RegionTable` reads of a region."""

    def __init__(self, n: int):
        self.key, self.name, self.inode, self.size = f"k{n}", f"seg{n}", (0, n), 4096
        self.owner = self.connection = ""
        self.in_use, self.calls, self.closed, self.gone = 0, 0, False, False
        self.uid, self.used_at = 0, -1e18

    def check_size(self, field: str) -> None:
        pass

    def stale(self) -> bool:
        return self.gone

    def close(self) -> None:
        self.closed = True


def test_a_region_in_use_by_a_call_is_never_evicted():
    """With both regions of a table of 2 held by calls, a registration is RESOURCE_EXHAUSTED (at the first step
    too) and closes nothing; once one call is done, that region (idle, least recently used) is evicted."""
    table = regions.RegionTable(quota=64, max_regions=2, sweep_period=3600, recent_use=0.0)
    a, b, c = _Fake(0), _Fake(1), _Fake(2)
    ida, idb = table.add(a, "x", "x"), table.add(b, "y", "y")
    with table.hold(idb, "k1", "f"):
        with table.hold(ida, "k0", "f"):
            with pytest.raises(ResourceLimit, match="every one is in use"):
                table.check_room("z", "z")
            with pytest.raises(ResourceLimit, match="every one is in use"):
                table.add(c, "z", "z")
            assert not a.closed and not b.closed and c.closed and len(table) == 2
        c = _Fake(2)
        table.add(c, "z", "z")  # a is idle now: evicted although b was registered after it and used since
        assert a.closed and not b.closed and table.evicted == 1
        with pytest.raises(regions.RegionGone, match="was evicted") as gone:
            table.get(ida, "k0", "f")
        assert gone.value.reason == regions.REASON_EVICTED
        with pytest.raises(regions.RegionGone, match="no shared-memory region") as gone:
            table.get(ida, "not-its-key", "f")  # the evicted region's id, another key: unknown
        assert gone.value.reason == regions.REASON_UNKNOWN
    table.close()
    assert b.closed and c.closed


def test_the_quota_counts_the_owner_and_the_connection():
    table = regions.RegionTable(quota=2, max_regions=16, sweep_period=3600)
    table.add(_Fake(0), "pid:1", "conn-a")
    table.add(_Fake(1), "pid:2", "conn-a")
    with pytest.raises(ResourceLimit, match=r"\(conn-a\) holds 2"):
        table.add(_Fake(2), "pid:3", "conn-a")  # a new pid on a full connection
    table.add(_Fake(3), "pid:1", "conn-b")
    with pytest.raises(ResourceLimit, match=r"\(pid:1\) holds 2"):
        table.add(_Fake(4), "pid:1", "conn-c")  # a full pid on a new connection
    table.close()


# ---------------------------------------------------------------- (3) a SIGKILLed owner's region is swept
CLIENT = r"""
import sys, time
from advantage_client import AdvantageClient
c = AdvantageClient(sys.argv[1], timeout=30.0)
region = c.shared_memory(64 << 20)
assert region.memfd
print("ready", flush=True)
time.sleep(600)
"""


def _mapped(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/memfd:advantage-shm " in line for line in f)


def test_a_killed_owners_region_is_released_by_the_periodic_sweep(tmp_path, capsys, monkeypatch):
    """A client process registers a 64 MiB sealed memfd (the server maps it), then is SIGKILLed. With no other
    call or registration, the server's mapping is gone within SWEEP_PERIOD (5 s) plus a sweep; the test allows
    30 s (a loaded 2-core machine). Before: it stayed mapped until some other client registered."""
    monkeypatch.delenv(shm_mod.MEMFD_ENV, raising=False)
    srv = start_server(tmp_path, "sweep")
    try:
        pid = srv.proc.pid
        before = _mapped(pid)
        client = subprocess.Popen([sys.executable, "-c", CLIENT, srv.address], stdout=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL)
        try:
            assert client.stdout.readline().strip() == b"ready"
            assert _mapped(pid) == before + 1
        finally:
            client.kill()
            client.wait(timeout=10)
        killed = time.monotonic()
        wait_for(lambda: _mapped(pid) == before, 30, "the sweep to release the killed client's region", poll=0.1)
        elapsed = time.monotonic() - killed
        report(capsys, f"a SIGKILLed client's 64 MiB memfd region released by the sweep {elapsed:.1f} s after the "
                       f"kill (SWEEP_PERIOD = {regions.SWEEP_PERIOD:g} s), with no other registration")
        # the server serves on
        with AdvantageClient(srv.address, timeout=30.0) as c:
            r = c.compute("grpo", None, transport="shm", prompt_ids=np.arange(64) // 4,
                          rewards=np.arange(64, dtype=np.float32), mask=np.ones((64, 512), np.float32))
            assert c.last_transport == "shm" and r.advantages.shape == (64, 512)
    finally:
        assert stop_server(srv) == 0
