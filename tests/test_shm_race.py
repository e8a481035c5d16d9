"""A shared-memory client racing its own region cannot crash the server (issue #22 item 1).

A sealed memfd region is read in place: the server's views of the inputs are the client's memory, which the
client (an attacker, or a trainer reusing its buffer while a call is in flight) may change at any moment.
Here a writer process maps the client's memfd and flips one ``prompt_ids`` element through two valid ids and
two far-out ones (1 << 40, -(1 << 40)) and one mask element through 1, 2 and NaN, continuously, while the
client sends a few hundred calls on the region. The server runs in its own process, so a write out of bounds
is its death, seen here. Every answer must be INVALID_ARGUMENT (a snapshot with the mask at 2 or NaN) or
exactly the answer to one of the id vectors the writer can leave (computed beforehand, unary): the server
validates and computes on one consistent private copy of the ids and masks.

Before the fix the server died with SIGSEGV within the first few calls (the group-index kernel read the ids'
min and max, then wrote ``seen[ids[i] - lo]`` for an id changed meanwhile).
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

from reliability_support import start_server, stop_server

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(os, "memfd_create")
                                     and hasattr(fcntl, "F_ADD_SEALS")), reason="memfd and file seals are Linux-only")

B, T = 1 << 15, 4
CALLS = 300
#: the states the writer cycles the flipped id through: two valid groups, then two far-out ids
HUGE, NEG = 1 << 40, -(1 << 40)

# Run as a separate process (no GIL shared with the client): maps the client's memfd through /proc and flips
# the int64 at ID_AT through IDS and the float32 at MASK_AT (unless negative) through 1, 2, 1, NaN until killed.
WRITER = r"""
import mmap, os, sys
import numpy as np
path, size, id_at, mask_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ids = [int(x) for x in sys.argv[5].split(",")]
fd = os.open(path, os.O_RDWR)
buf = np.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), np.uint8)
idv = buf[id_at:id_at + 8].view(np.int64)
mv = buf[max(mask_at, 0):max(mask_at, 0) + 4].view(np.float32)
masks = [np.float32(1), np.float32(2), np.float32(1), np.float32("nan")]
print("ready", flush=True)
i = 0
while True:
    idv[0] = ids[i & 3]
    if mask_at >= 0:
        mv[0] = masks[(i >> 2) % 4]
    i += 1
"""


@pytest.fixture(scope="module")
def proc_server(tmp_path_factory):
    """A real ``advantage-server`` process: a write out of bounds kills it, not the test."""
    srv = start_server(tmp_path_factory.mktemp("race"), "race")
    yield srv
    assert stop_server(srv) == 0, srv.stderr[-5000:]


@pytest.fixture(autouse=True)
def _memfd_on(monkeypatch):
    monkeypatch.delenv(shm_mod.MEMFD_ENV, raising=False)


def _batch(estimator: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {"prompt_ids": np.arange(B, dtype=np.int64) // 4,
           "rewards": rng.standard_normal(B).astype(np.float32),
           "mask": (rng.random((B, T)) < 0.9).astype(np.float32)}
    if estimator == "gigpo":  # every id input: trajectories of 2 steps, anchors shared by pairs of trajectories
        out["trajectory_ids"] = np.arange(B, dtype=np.int64) // 2
        out["anchor_ids"] = np.arange(B, dtype=np.int64) % 8
        out["step_index"] = np.arange(B, dtype=np.int64) % 2
    out["mask"][:, 0] = 1  # the flipped mask element stays 1 in every valid state
    return out


def _answers(c: AdvantageClient, estimator: str, tensors: dict[str, np.ndarray], k: int) -> list[torch.Tensor]:
    """The advantages for each id the writer can leave at prompt_ids[k] (unary: private copies)."""
    out = []
    for v in (tensors["prompt_ids"][k], 0, HUGE, NEG):
        ids = tensors["prompt_ids"].copy()
        ids[k] = v
        out.append(c.compute(estimator, None, transport="unary", **{**tensors, "prompt_ids": ids}).advantages)
    return out


def _writer(region, id_at: int, mask_at: int, ids: list[int]) -> subprocess.Popen:
    path = f"/proc/{os.getpid()}/fd/{region.shm._fd}"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(region.size), str(id_at), str(mask_at),
                             ",".join(str(i) for i in ids)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def _race(proc_server, region, call, answers: list[torch.Tensor], id_at: int, mask_at: int, ids: list[int],
          refused: str = "inputs['mask']") -> dict[str, int]:
    """``call()`` CALLS times while the writer flips; checks each outcome (an error: INVALID_ARGUMENT naming
    ``refused``); returns the counts per outcome."""
    counts = {"INVALID_ARGUMENT": 0, **{f"ids{i}": 0 for i in range(len(answers))}}
    writer = _writer(region, id_at, mask_at, ids)
    try:
        n = 0
        # at least CALLS calls, and on until both a refusal and an answer were seen (a writer starved by a loaded
        # machine may miss a few hundred calls: the race must really happen for the test to prove anything)
        while n < CALLS or not (counts["INVALID_ARGUMENT"] and sum(counts.values()) > counts["INVALID_ARGUMENT"]):
            if n >= 10 * CALLS:
                break
            n += 1
            try:
                got = call()
            except AdvantageServiceError as err:
                assert proc_server.proc.poll() is None, (
                    f"the server died (rc={proc_server.proc.returncode}) at call {n}:\n{proc_server.stderr[-3000:]}")
                assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (n, err.code, str(err))
                assert refused in str(err), str(err)
                counts["INVALID_ARGUMENT"] += 1
                continue
            match = [i for i, want in enumerate(answers) if torch.equal(got, want)]
            assert match, f"call {n}: an OK answer that is the answer to none of the writer's id vectors"
            counts[f"ids{match[0]}"] += 1
    finally:
        writer.kill()
        writer.wait(timeout=10)
    assert proc_server.proc.poll() is None, proc_server.stderr[-3000:]
    assert counts["INVALID_ARGUMENT"] and sum(counts.values()) > counts["INVALID_ARGUMENT"], counts
    return counts


@pytest.mark.parametrize("estimator", ["grpo", "gigpo"])
def test_a_writer_racing_region_compute_never_crashes_the_server(proc_server, estimator):
    """The public API: inputs made with ``region.empty`` and passed to ``region.compute`` are read in place."""
    tensors = _batch(estimator)
    k = B - 1
    with AdvantageClient(proc_server.address, timeout=60.0) as c:
        answers = _answers(c, estimator, tensors, k)
        with c.shared_memory(8 << 20) as region:
            assert region.memfd
            placed = {}
            for name, v in tensors.items():
                placed[name] = region.empty(v.shape, str(v.dtype))
                placed[name].copy_(torch.from_numpy(v))
            id_at = region._offset_of(placed["prompt_ids"].numpy()) + 8 * k
            mask_at = region._offset_of(placed["mask"].numpy())  # mask[0, 0]
            counts = _race(proc_server, region, lambda: region.compute(estimator, None, **placed).advantages,
                           answers, id_at, mask_at, [int(tensors["prompt_ids"][k]), HUGE, 0, NEG])
        # the server serves on, exactly
        assert torch.equal(c.compute(estimator, None, transport="shm", **tensors).advantages, answers[0])
    print(estimator, counts)


def test_a_writer_racing_a_raw_shm_request_never_crashes_the_server(proc_server):
    """The raw ``ComputeAdvantageShm`` request, built once and sent again and again over the racing region."""
    tensors = _batch("grpo")
    k = B // 2
    with AdvantageClient(proc_server.address, timeout=60.0) as c:
        answers = _answers(c, "grpo", tensors, k)
        with c.shared_memory(8 << 20) as region:
            request = pb.ComputeAdvantageShmRequest(key=region.key, output_region_id=region.region_id)
            request.request.grpo.SetInParent()
            offsets = {}
            for name, v in tensors.items():
                placed = region.empty(v.shape, str(v.dtype))
                placed.copy_(torch.from_numpy(v))
                offsets[name] = region._offset_of(placed.numpy())
                request.inputs[name].CopyFrom(pb.SharedMemoryTensor(
                    dtype=pb.DTYPE_INT64 if v.dtype == np.int64 else pb.DTYPE_FLOAT32, shape=v.shape,
                    region_id=region.region_id, offset=offsets[name]))
            request.output_offset = region._next
            request.output_byte_size = region.size - region._next

            def call() -> torch.Tensor:
                reply = c._call("ComputeAdvantageShm", request, pb.ComputeAdvantageShmResponse)
                t = reply.advantages
                assert list(t.shape) == [B, T] and t.dtype == pb.DTYPE_FLOAT32
                n = B * T * 4
                return torch.from_numpy(region._buf[t.offset:t.offset + n].view(np.float32).reshape(B, T).copy())
            t0 = time.monotonic()
            counts = _race(proc_server, region, call, answers, offsets["prompt_ids"] + 8 * k, offsets["mask"] + 4 * T,
                           [int(tensors["prompt_ids"][k]), NEG, 0, HUGE])
        print("raw", counts, f"{time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------- the second line: kernels check their indices
def test_the_group_index_kernel_checks_every_id_against_the_range_it_was_given(monkeypatch):
    """``_dense_rank`` returns False for an id outside [lo, lo + span) (never writes there), and
    ``group_index`` turns that into INVALID_ARGUMENT on prompt_ids: here the kernel is handed a span one short,
    as if the largest id had grown after the min and max were read."""
    from advantage_server.errors import InvalidInput
    from advantage_server.estimators import groups, jit
    if not jit.NUMBA:
        pytest.skip("the compiled kernel needs numba")
    out = np.empty(3, np.int64)
    assert groups._dense_rank(np.array([0, 1, 5]), 0, 2, out) is False
    assert groups._dense_rank(np.array([0, -1 << 40, 1]), 0, 2, out) is False
    assert groups._dense_rank(np.array([3, 1, 3]), 1, 3, out) is True and out.tolist() == [1, 0, 1]
    real = groups._dense_rank
    monkeypatch.setattr(groups, "_dense_rank", lambda ids, lo, span, o: real(ids, lo, span - 1, o))
    with pytest.raises(InvalidInput) as err:
        groups.group_index(torch.arange(64) // 4)
    assert err.value.violations[0][0] == "inputs['prompt_ids']" and "changed while the server read it" in str(err.value)


NO_SNAPSHOT = """
from advantage_server import transport
transport.read_in_place = lambda kind, dtype: True  # every input of a mapped region read in place
"""


def test_without_the_snapshot_the_kernels_bounds_checks_still_keep_the_server_alive(tmp_path):
    """Defence in depth: a server whose snapshot is switched off (a test hook reads every input in place) and a
    writer flipping prompt_ids only. The group-index kernel meets ids outside the range it read: each such
    call is INVALID_ARGUMENT naming prompt_ids, every other call is the answer to one of the writer's id
    vectors, and the server never dies (before: SIGSEGV within a few calls)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NO_SNAPSHOT)
    srv = start_server(tmp_path, "nosnap", env={"PYTHONPATH": os.pathsep.join(
        filter(None, [str(hook), os.environ.get("PYTHONPATH")]))})
    try:
        tensors = _batch("grpo")
        k = B - 1
        with AdvantageClient(srv.address, timeout=60.0) as c:
            answers = _answers(c, "grpo", tensors, k)
            with c.shared_memory(8 << 20) as region:
                placed = {}
                for name, v in tensors.items():
                    placed[name] = region.empty(v.shape, str(v.dtype))
                    placed[name].copy_(torch.from_numpy(v))
                id_at = region._offset_of(placed["prompt_ids"].numpy()) + 8 * k
                counts = _race(srv, region, lambda: region.compute("grpo", None, **placed).advantages, answers,
                               id_at, -1, [int(tensors["prompt_ids"][k]), HUGE, 0, NEG], refused="inputs['prompt_ids']")
        print("no snapshot", counts)
    finally:
        assert stop_server(srv) == 0, srv.stderr[-5000:]
