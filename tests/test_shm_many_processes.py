"""64 shared-memory client processes on one host keep using shared memory (issue #27, done-criterion).

One server process (``ADVANTAGE_WARMUP=0``) and one driver process that forks 64 clients (a fork after the
imports and before any channel: the children share the parent's imported modules, so the test costs far less
memory and CPU than 64 interpreters). Each child grows its ``AdvantageClient``'s pool to the default
``shm_regions`` (8) registered regions; once every child holds its pool (64 x 8 = 512 regions on the server at
once), each makes ``CALLS`` ``transport="auto"`` calls and one call on every region of its pool, and checks
each result against a NumPy reference. The test asserts that every call of every child went over shared memory
(``last_transport``), that no child registered more than its pool (no region was evicted and registered
again: no churn) and that every value is right.

Before (a table of 256 regions, eviction of the globally least recently used idle one, INVALID_ARGUMENT for an
evicted region): children whose regions were evicted sent their calls unary (and their pool calls failed).
"""
from __future__ import annotations

import json
import subprocess
import sys

from reliability_support import report, start_server, stop_server

PROCESSES, CALLS = 64, 4

DRIVER = r'''
import json, os, sys
import numpy as np
from advantage_client import AdvantageClient

target, n, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
CFG = {"normalize_advantages": False}


def inputs(seed):
    rng = np.random.default_rng(seed)
    mask = (rng.random((4, 16)) < 0.8).astype(np.float32)
    return {"rewards": rng.standard_normal(4).astype(np.float32), "mask": mask}


def check(result, batch):
    # raw_reward, not whitened: the sample's reward at every token (the mask is not applied)
    want = np.broadcast_to(batch["rewards"][:, None], batch["mask"].shape)
    return bool(np.array_equal(np.asarray(result.advantages), want))


def child(i, ready_w, go_r):
    c = AdvantageClient(target, timeout=120.0, transport="auto", shm_min_mb=0)
    registered = [0]
    original = c._call

    def counted(method, request, *args, **kwargs):  # registrations done (a second step answered)
        reply = original(method, request, *args, **kwargs)
        if method == "RegisterSharedMemory" and request.proof:
            registered[0] += 1
        return reply
    c._call = counted
    out = {"i": i, "transports": [], "right": 0, "wrong": 0}
    try:
        need = c._shm_need(inputs(0))
        pool = [c._shm_take(need) for _ in range(c.shm_regions)]  # the pool at its default size
        for region in pool:
            c._shm_give(region)
        out["pool"] = c.shm_region_count
    finally:
        os.write(ready_w, b"x")
    os.read(go_r, 1)  # every child holds its pool now
    for k in range(calls):
        batch = inputs(1000 * i + k)
        result = c.compute("raw_reward", CFG, as_numpy=True, **batch)
        out["transports"].append(c.last_transport)
        out["right" if check(result, batch) else "wrong"] += 1
    pool = [c._shm_take(need) for _ in range(c.shm_regions)]
    for j, region in enumerate(pool):  # every region of the pool, the least recently used too
        batch = inputs(1000 * i + 500 + j)
        result = region.compute("raw_reward", CFG, as_numpy=True, **batch)
        out["transports"].append("shm")
        out["right" if check(result, batch) else "wrong"] += 1
    out["reregistered"] = sum(region.reregistered for region in pool)
    for region in pool:
        c._shm_give(region)
    out["registered"], out["shm_works"] = registered[0], c._shm_works
    c.close()
    return out


ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
res_r, res_w = os.pipe()
pids = []
for i in range(n):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r); os.close(go_w); os.close(res_r)
        try:
            line = json.dumps(child(i, ready_w, go_r))
        except BaseException as exc:
            import traceback; line = json.dumps({"i": i, "error": repr(exc)[:300] + traceback.format_exc()[-1500:].replace(chr(10), " | ")})
        os.write(res_w, (line + "\n").encode())  # one write of < PIPE_BUF bytes: never interleaved
        os._exit(0)
    pids.append(pid)
os.close(ready_w); os.close(go_r); os.close(res_w)
got = 0
while got < n:
    chunk = os.read(ready_r, n - got)
    if not chunk:
        break
    got += len(chunk)
os.write(go_w, b"x" * n)
data = b""
while True:
    chunk = os.read(res_r, 1 << 16)
    if not chunk:
        break
    data += chunk
for pid in pids:
    os.waitpid(pid, 0)
sys.stdout.write(data.decode())
'''


def test_64_shared_memory_client_processes_keep_using_shared_memory(tmp_path, capsys):
    srv = start_server(tmp_path, "shm64", env={"ADVANTAGE_WARMUP": "0"})
    try:
        run = subprocess.run([sys.executable, "-c", DRIVER, srv.address, str(PROCESSES), str(CALLS)],
                             capture_output=True, text=True, timeout=600)
    finally:
        stop_server(srv)
    assert run.returncode == 0, run.stderr[-3000:]
    outs = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    assert sorted(o["i"] for o in outs) == list(range(PROCESSES)), (len(outs), run.stderr[-3000:])
    errors = [o for o in outs if "error" in o]
    assert not errors, f"{len(errors)} children failed: " + "\n".join(o["error"] for o in errors[:2])
    from advantage_client.client import DEFAULT_SHM_REGIONS
    for o in outs:
        assert o["pool"] == DEFAULT_SHM_REGIONS, o
        assert o["transports"] == ["shm"] * (CALLS + DEFAULT_SHM_REGIONS), o
        assert o["right"] == CALLS + DEFAULT_SHM_REGIONS and o["wrong"] == 0, o
        # no region was evicted: no registration beyond the pool's, none again
        assert o["registered"] == DEFAULT_SHM_REGIONS and o["reregistered"] == 0, o
        assert o["shm_works"] is True, o
    report(capsys, f"{PROCESSES} client processes x {DEFAULT_SHM_REGIONS} regions ({PROCESSES * DEFAULT_SHM_REGIONS} "
                   f"registered at once): {sum(len(o['transports']) for o in outs)} calls, all over shared memory, "
                   "all exact, 0 registrations again")
