"""Shared memory through a sealed Linux memfd: the zero-copy path (issue #11 item 6 follow-up).

The client makes its region a ``memfd`` sealed with ``F_SEAL_SHRINK | F_SEAL_SEAL`` and registers it as
``memfd:<pid>:<fd>``; the server opens it through ``/proc/<pid>/fd/<fd>``, checks the seal, maps it, and
reads inputs and writes results in place. A sealed file cannot shrink, so the SIGBUS the POSIX path guards
against (tests/test_hardening.py -k shrunk) cannot happen: the kernel refuses the client's ``ftruncate``.
An unsealed memfd is copied through its descriptor like a POSIX segment. Registration keeps the
challenge (proof of write access) and answers every failure alike. Whether the server mapped a region is
read from the server process's ``/proc/<pid>/maps`` (a line naming ``/memfd:<label>``).
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client import shm as shm_mod
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client.shm import MemfdSegment

from reliability_support import start_server, stop_server, wait_for

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(os, "memfd_create")
                                     and hasattr(fcntl, "F_ADD_SEALS")), reason="memfd and file seals are Linux-only")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def _gae(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"rewards": torch.randn(B, generator=g), "mask": (torch.rand(B, T, generator=g) < 0.8).float(),
            "values": torch.randn(B, T, generator=g)}


def _grpo(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_ids": torch.arange(B, dtype=torch.int64) // 4, "rewards": torch.randn(B, generator=g),
            "mask": (torch.rand(B, T, generator=g) < 0.9).float()}


def _mapped(pid: int, label: str = "advantage-shm") -> int:
    """How many mappings of memfds named ``label`` process ``pid`` holds."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(f"/memfd:{label} " in line for line in f)


@pytest.fixture(scope="module")
def proc_server(tmp_path_factory):
    """A real ``advantage-server`` process (a fault in it would be its death, not a test's)."""
    srv = start_server(tmp_path_factory.mktemp("memfd"), "memfd")
    yield srv
    assert stop_server(srv) == 0


@pytest.fixture(autouse=True)
def _memfd_on(monkeypatch):
    monkeypatch.delenv(shm_mod.MEMFD_ENV, raising=False)


def _equal(got, want) -> None:
    assert torch.equal(got.advantages, want.advantages)
    assert (got.returns is None) == (want.returns is None)
    if want.returns is not None:
        assert torch.equal(got.returns, want.returns)


# ---------------------------------------------------------------- (1) round trip, zero-copy
@pytest.mark.parametrize("estimator,tensors", [("gae", _gae(64, 1024)), ("grpo", _grpo(64, 1024))])
def test_a_sealed_memfd_region_is_mapped_by_the_server_and_answers_exactly_like_unary(proc_server, estimator, tensors):
    pid = proc_server.proc.pid
    with AdvantageClient(proc_server.address, timeout=60.0) as c:
        want = c.compute(estimator, None, transport="unary", **tensors)
        before = _mapped(pid)
        with c.shared_memory(8 << 20) as region:
            assert region.memfd and isinstance(region.shm, MemfdSegment)
            assert region.shm.name == f"memfd:{os.getpid()}:{region.shm._fd}"
            assert fcntl.fcntl(region.shm._fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            assert _mapped(pid) == before + 1  # the server maps the registered region (zero-copy)
            _equal(region.compute(estimator, None, **tensors), want)  # inputs copied into the region
            placed = {}
            for k, v in tensors.items():  # inputs living in the region: read in place by the server
                placed[k] = region.empty(tuple(v.shape), v.dtype)
                placed[k].copy_(v)
            _equal(region.compute(estimator, None, copy=False, **placed), want)
            for k, v in tensors.items():  # read in place, never written: the trainer's tensors are as they were
                assert torch.equal(placed[k], v), k
        wait_for(lambda: _mapped(pid) == before, 10, "the server to unmap the unregistered region")
        # the client's own pool (transport="shm" / "auto") uses sealed memfds too
        _equal(c.compute(estimator, None, transport="shm", **tensors), want)
        assert c.last_transport == "shm" and c._shm.memfd and _mapped(pid) == before + 1


# ---------------------------------------------------------------- (2) the attack: shrinking a sealed region
def test_the_kernel_refuses_to_shrink_a_sealed_region_and_the_server_keeps_serving(proc_server):
    B, T = 512, 8192
    tensors = _gae(B, T, 1)
    with AdvantageClient(proc_server.address, timeout=60.0) as c:
        want = c.compute("gae", None, transport="unary", **tensors)
        with c.shared_memory(3 * B * T * 4 + 2 * B * T * 4 + (1 << 20)) as region:
            fd, refused = region.shm._fd, []

            def shrink() -> None:
                try:
                    os.ftruncate(fd, 4096)
                except PermissionError as err:
                    refused.append(err)
            with pytest.raises(PermissionError):  # right after registration
                os.ftruncate(fd, 4096)
            for delay_ms in (0, 2, 5, 10, 20):  # and during calls
                timer = threading.Timer(delay_ms / 1e3, shrink)
                timer.start()
                got = region.compute("gae", None, **tensors)
                timer.join()
                _equal(got, want)
            assert len(refused) == 5 and os.fstat(fd).st_size == region.size
            with pytest.raises(PermissionError):  # F_SEAL_SEAL: no seal can be added (nor any removed, ever)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        assert proc_server.proc.poll() is None
        _equal(c.compute("gae", None, transport="shm", **tensors), want)


# ---------------------------------------------------------------- (3) an unsealed memfd: copied, like POSIX
def _shm_gae_request(region, B: int, T: int) -> pb.ComputeAdvantageShmRequest:
    """A 1024 x 8192-class GAE request over ``region`` with its inputs placed in it (nothing read back here)."""
    rng = np.random.default_rng(0)
    request = pb.ComputeAdvantageShmRequest(key=region.key, output_region_id=region.region_id)
    request.request.gae.SetInParent()
    for name, value in (("rewards", rng.standard_normal(B, dtype=np.float32)), ("mask", np.ones((B, T), np.float32)),
                        ("values", rng.standard_normal((B, T), dtype=np.float32))):
        placed = region.empty(value.shape, "float32")
        placed.copy_(torch.from_numpy(value))
        request.inputs[name].CopyFrom(pb.SharedMemoryTensor(dtype=pb.DTYPE_FLOAT32, shape=value.shape,
                                                            region_id=region.region_id,
                                                            offset=region._offset_of(placed.numpy())))
    request.output_offset = region._next
    request.output_byte_size = region.size - region._next
    return request


def test_an_unsealed_memfd_is_copied_and_shrinking_it_fails_only_that_call(proc_server, monkeypatch):
    """Documented choice: an unsealed memfd is accepted and read/written through its descriptor (never
    mapped), so shrinking it mid-call is INVALID_ARGUMENT for that call, as for a POSIX segment."""
    monkeypatch.setattr(shm_mod, "MemfdSegment", lambda size: MemfdSegment(size, seal=False))
    pid = proc_server.proc.pid
    B, T = 1024, 8192
    codes: list[str] = []
    with AdvantageClient(proc_server.address, timeout=60.0) as c:
        tensors = _gae(32, 512, 2)
        want = c.compute("gae", None, transport="unary", **tensors)
        before = _mapped(pid)
        with c.shared_memory(4 << 20) as region:
            assert region.memfd and fcntl.fcntl(region.shm._fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0
            _equal(region.compute("gae", None, **tensors), want)
            assert _mapped(pid) == before  # registered, not mapped
        for delay_ms in (0, 5, 20, 40):
            region = c.shared_memory(4 * B * T * 4 + (4 << 20))
            request = _shm_gae_request(region, B, T)
            shrink = threading.Timer(delay_ms / 1e3, os.ftruncate, (region.shm._fd, 4096))
            future = c._stub.ComputeAdvantageShm.future(request, timeout=60)
            shrink.start()
            try:
                future.result()
                codes.append("OK")
            except grpc.RpcError as err:
                codes.append(err.code().name)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (delay_ms, err.details())
                assert "fewer than the" in err.details() and "registered" in err.details()
            shrink.join()
            assert proc_server.proc.poll() is None, proc_server.stderr[-3000:]
            region.close()  # nothing here reads the shrunk region
        assert "INVALID_ARGUMENT" in codes, codes
        _equal(c.compute("gae", None, transport="shm", **tensors), want)  # the server serves on


# ---------------------------------------------------------------- (4) names that must not register
def _register(c: AdvantageClient, name: str, proof: bytes = b"") -> pb.RegisterSharedMemoryResponse:
    return c._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(name=name, byte_size=4096, proof=proof),
                   pb.RegisterSharedMemoryResponse)


def _denied(c: AdvantageClient, name: str, write=None) -> str:
    """Both steps for ``name`` (``write(challenge)`` puts the challenge where the caller can): the second is
    PERMISSION_DENIED; returns its message with the name taken out."""
    first = _register(c, name)
    assert len(first.challenge) == 32 and not first.region_id and not first.key
    if write is not None:
        write(first.challenge)
    with pytest.raises(AdvantageServiceError) as err:
        _register(c, name, first.challenge)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, (name, str(err.value))
    return str(err.value).replace(repr(name), "NAME")


def test_memfd_names_of_other_processes_or_non_memfd_files_are_denied_alike(proc_server, tmp_path):
    holder = ("import os, sys\n"
              "fd = os.memfd_create('advantage-shm', os.MFD_ALLOW_SEALING)\n"
              "os.ftruncate(fd, 1 << 20)\n"
              "print(os.getpid(), fd, flush=True)\n"
              "sys.stdin.read()\n")
    other = subprocess.Popen([sys.executable, "-c", holder],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    opened: list[int] = []
    posix = shared_memory.SharedMemory(create=True, size=4096)
    try:
        pid, fd = other.stdout.readline().split()

        def at_zero(fd: int):
            return lambda challenge: os.pwrite(fd, challenge, 0)
        regular = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(regular, 4096)
        mine = os.memfd_create("advantage-shm", os.MFD_ALLOW_SEALING)
        os.ftruncate(mine, 4096)
        r, w = os.pipe()
        directory = os.open(tmp_path, os.O_RDONLY)
        opened += [regular, mine, r, w, directory]
        me = os.getpid()
        with AdvantageClient(proc_server.address, timeout=30.0) as c:
            messages = {
                # another process's memfd: the caller cannot write the challenge into it
                "another process's memfd": _denied(c, f"memfd:{pid}:{fd}"),
                # files the caller writes the challenge into, but no memfd
                "a regular file": _denied(c, f"memfd:{me}:{regular}", at_zero(regular)),
                "a POSIX segment": _denied(c, f"memfd:{me}:{posix._fd}", at_zero(posix._fd)),
                "a pipe": _denied(c, f"memfd:{me}:{w}"),
                "a directory": _denied(c, f"memfd:{me}:{directory}"),
                # this process's memfd without the challenge in it, a closed descriptor, no such process
                "a memfd without the challenge": _denied(c, f"memfd:{me}:{mine}"),
                "a closed descriptor": _denied(c, f"memfd:{me}:{max(opened) + 100}"),
                "no such process": _denied(c, "memfd:4999999999:3"),
                "the server's own descriptor": _denied(c, f"memfd:{proc_server.proc.pid}:0"),
            }
            assert len(set(messages.values())) == 1, messages  # one answer: nothing learnt about the name
            assert "does not hold a challenge" in next(iter(messages.values()))
            assert os.pread(regular, 32, 0) != b"\0" * 32  # the challenge was there: refused for the file's kind
            # the same memfd with the challenge written registers (the control)
            first = _register(c, f"memfd:{me}:{mine}")
            os.pwrite(mine, first.challenge, 0)
            assert _register(c, f"memfd:{me}:{mine}", first.challenge).region_id
    finally:
        other.stdin.close()
        other.wait(timeout=30)
        for fd_ in opened:
            os.close(fd_)
        posix.close()
        posix.unlink()


@pytest.mark.parametrize("name", ["memfd:", "memfd:1", "memfd:0:3", "memfd:-1:3", "memfd:01:3", "memfd:1:03",
                                  "memfd:1:+3", "memfd:1:-3", "memfd:1:3:4", "memfd:x:3", "memfd: 1:3", "memfd:1:3 ",
                                  "memfd:1:3\n", "memfd:12345678901:3", "memfd:1:٣"])
def test_a_malformed_memfd_name_is_invalid_argument_before_anything_is_opened(name):
    from advantage_server import create_server
    srv = create_server("127.0.0.1", 0, device="cpu").start()
    try:
        with AdvantageClient(srv.address, timeout=30.0) as c:
            with pytest.raises(AdvantageServiceError) as err:  # not even a challenge
                _register(c, name)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "memfd:<pid>:<fd>" in str(err.value)
    finally:
        srv.stop(0)


# ---------------------------------------------------------------- (5) fallback
def test_with_memfd_off_regions_are_posix_segments_and_work(proc_server, monkeypatch):
    tensors = _gae(16, 256, 3)
    monkeypatch.setenv(shm_mod.MEMFD_ENV, "0")
    with AdvantageClient(proc_server.address, timeout=30.0) as c:
        want = c.compute("gae", None, transport="unary", **tensors)
        with c.shared_memory(1 << 20) as region:
            assert not region.memfd and isinstance(region.shm, shared_memory.SharedMemory)
            assert os.path.exists(f"/dev/shm/{region.shm.name.lstrip('/')}")
            _equal(region.compute("gae", None, **tensors), want)
        _equal(c.compute("gae", None, transport="shm", **tensors), want)
        assert not c._shm.memfd
    monkeypatch.delenv(shm_mod.MEMFD_ENV)
    with AdvantageClient(proc_server.address, timeout=30.0) as c, \
            shm_mod.SharedMemoryRegion(c, 1 << 20, memfd=False) as region:  # the option, per region
        assert not region.memfd
        _equal(region.compute("gae", None, **tensors), want)


def test_a_server_that_cannot_open_the_memfd_gets_posix_segments_from_then_on(make_server, monkeypatch):
    """Another PID namespace or user (here: the server's opening of /proc/<pid>/fd/<fd> fails): the region
    is retried as a POSIX segment, and the client's later regions are POSIX ones without a memfd try."""
    from advantage_server import regions

    def refuse(pid: int, fd: int) -> int:
        raise PermissionError("another PID namespace")
    monkeypatch.setattr(regions, "_open_memfd", refuse)
    srv = make_server()
    tensors = _gae(16, 256, 4)
    with AdvantageClient(srv.address, timeout=30.0) as c:
        want = c.compute("gae", None, transport="unary", **tensors)
        names: list[str] = []
        call = c._call

        def seen(method, request, *args, **kwargs):
            if method == "RegisterSharedMemory" and not request.proof:
                names.append(request.name)
            return call(method, request, *args, **kwargs)
        monkeypatch.setattr(c, "_call", seen)
        with c.shared_memory(1 << 20) as region:
            assert not region.memfd and c._shm_memfd_refused
            _equal(region.compute("gae", None, **tensors), want)
        with c.shared_memory(1 << 20) as region:
            assert not region.memfd
        assert [n.startswith("memfd:") for n in names] == [True, False, False], names
        with pytest.raises(AdvantageServiceError) as err:  # memfd=True insists
            shm_mod.SharedMemoryRegion(c, 1 << 20, memfd=True)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_server_told_not_to_map_copies_sealed_memfds(tmp_path):
    srv = start_server(tmp_path, "nomap", env={"ADVANTAGE_SHM_MEMFD_MAP": "0"})
    try:
        tensors = _gae(32, 512, 5)
        with AdvantageClient(srv.address, timeout=30.0) as c:
            want = c.compute("gae", None, transport="unary", **tensors)
            with c.shared_memory(4 << 20) as region:
                assert region.memfd
                _equal(region.compute("gae", None, **tensors), want)
                assert _mapped(srv.proc.pid) == 0
    finally:
        assert stop_server(srv) == 0


@pytest.mark.parametrize("how", ["closed", "replaced by a regular file"])
def test_a_memfd_region_whose_descriptor_is_closed_is_forgotten(proc_server, tmp_path, how):
    """The memfd twin of a POSIX segment unlinked without unregistering (the client exited): the name
    ``memfd:<pid>:<fd>`` no longer reaches the file, and the next registration sweeps the region (and the
    server's mapping of it). A descriptor number now naming another kind of file is never stat'ed."""
    pid = proc_server.proc.pid
    with AdvantageClient(proc_server.address, timeout=30.0) as c:
        before = _mapped(pid)
        leaked = c.shared_memory(1 << 20)
        assert leaked.memfd and _mapped(pid) == before + 1
        number = leaked.shm._fd
        leaked.shm.unlink()  # closes the descriptor: the name is gone
        if how != "closed":
            other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
            if other != number:
                os.dup2(other, number)
                os.close(other)
        with c.shared_memory(1 << 20) as fresh:
            assert fresh.compute("gae", None, **_gae(4, 8)).advantages.shape == (4, 8)
        with pytest.raises(AdvantageServiceError) as err:
            leaked.compute("gae", None, **_gae(4, 8))
        # NOT_FOUND (unknown region), and registering the segment again fails: its name reaches no memfd now
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "registering the segment again failed" in str(err.value)
        wait_for(lambda: _mapped(pid) == before, 10, "the server to unmap the forgotten region")
        leaked._buf = None
        leaked.shm.close()
        if how != "closed":
            os.close(number)


def test_a_region_larger_than_any_call_can_use_is_refused(make_server):
    """A sealed sparse memfd costs its client nothing but is mapped whole by the server: regions beyond
    4 x --max-stream-mb were registered and mapped, and ~90 of 64 TiB each used up the server's address space
    (every later call of every client timed out). Now such a region is RESOURCE_EXHAUSTED naming the flag;
    registering a part of the same segment (byte_size within the cap) still works."""
    import fcntl
    srv = make_server(max_stream_mb=1)  # cap: 4 MiB
    fd = os.memfd_create("advantage-shm", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 40)  # 1 TiB, sparse
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        name = f"memfd:{os.getpid()}:{fd}"
        with AdvantageClient(srv.address, timeout=30.0) as c:
            for byte_size, refused in ((0, True), ((4 << 20) + 1, True), (4 << 20, False)):
                first = c._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(name=name, byte_size=byte_size),
                                pb.RegisterSharedMemoryResponse)
                os.pwrite(fd, first.challenge, 0)
                request = pb.RegisterSharedMemoryRequest(name=name, byte_size=byte_size, proof=first.challenge)
                if refused:
                    with pytest.raises(AdvantageServiceError) as err:
                        c._call("RegisterSharedMemory", request, pb.RegisterSharedMemoryResponse)
                    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "--max-stream-mb=1" in str(err.value) and str(4 << 20) in str(err.value)
                else:
                    reply = c._call("RegisterSharedMemory", request, pb.RegisterSharedMemoryResponse)
                    assert reply.region_id and reply.key
    finally:
        os.close(fd)
