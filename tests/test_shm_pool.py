"""Shared memory with concurrent callers: one client's calls from many threads each take a region of their own
from a pool grown on demand up to ``shm_regions`` (no client-wide lock), every answer is right, and
:meth:`AdvantageClient.close` unregisters and unlinks every region."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from advantage_client import AdvantageClient
from advantage_client.shm import SharedMemoryRegion


def _gae(B: int, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"rewards": torch.randn(B, generator=g), "mask": (torch.rand(B, T, generator=g) < 0.8).float(),
            "values": torch.randn(B, T, generator=g)}


def _grpo(T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_ids": torch.zeros(16, dtype=torch.int64), "rewards": torch.randn(16, generator=g),
            "mask": (torch.rand(16, T, generator=g) < 0.9).float()}


class _Seen:
    """Records every region a call ran on, and the Register / Unregister calls the client made."""

    def __init__(self, client: AdvantageClient, monkeypatch, gate: threading.Barrier | None = None):
        self.regions: dict[int, SharedMemoryRegion] = {}
        self.registered = self.unregistered = 0
        self.lock = threading.Lock()
        self.max_busy = self.busy = 0
        compute, call = SharedMemoryRegion.compute, client._call
        seen = self

        def counted_compute(region, *args, **kwargs):
            with seen.lock:
                seen.regions[id(region)] = region
                seen.busy += 1
                seen.max_busy = max(seen.max_busy, seen.busy)
            try:
                if gate is not None and not getattr(threading.current_thread(), "passed_gate", False):
                    threading.current_thread().passed_gate = True
                    gate.wait(timeout=30)  # every gated thread holds its region at the same time
                return compute(region, *args, **kwargs)
            finally:
                with seen.lock:
                    seen.busy -= 1

        def counted_call(method, request, *args, **kwargs):
            with seen.lock:
                if method == "RegisterSharedMemory" and not request.proof:
                    seen.registered += 1
                elif method == "UnregisterSharedMemory":
                    seen.unregistered += 1
            return call(method, request, *args, **kwargs)

        monkeypatch.setattr(SharedMemoryRegion, "compute", counted_compute)
        monkeypatch.setattr(client, "_call", counted_call)


def _run(n_threads: int, work) -> None:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_concurrent_shm_calls_from_one_client_use_several_regions_and_are_right(make_server, monkeypatch, transport):
    srv = make_server(max_concurrent_requests=64)
    n = 6
    batches = [_gae(8 * (1 + i % 3), 4096, i) for i in range(n)]  # 128-384 KiB: over shm_min_mb, different sizes
    with AdvantageClient(srv.address, timeout=60.0) as c:
        refs = [c.compute("gae", None, transport="unary", **b) for b in batches]
        seen = _Seen(c, monkeypatch, gate=threading.Barrier(n))
        used: list[str] = []

        def work(i: int) -> None:
            for k in range(4):
                got = c.compute("gae", None, transport=transport, **batches[(i + k) % n])
                used.append(c.last_transport)
                want = refs[(i + k) % n]
                assert torch.equal(got.advantages, want.advantages) and torch.equal(got.returns, want.returns)
        _run(n, work)
        assert used == ["shm"] * (4 * n)
        # one region per concurrent call (an idle region too small for a larger batch is replaced by a larger one)
        assert seen.max_busy == n == c.shm_region_count and seen.registered >= n
        names = [r.shm.name for r in seen.regions.values()]
    assert seen.unregistered == seen.registered  # close() unregistered every region and unlinked its segment
    assert c.shm_region_count == 0
    assert not any(os.path.exists(f"/dev/shm/{name.lstrip('/')}") for name in names)


def test_the_pool_stops_at_shm_regions_and_many_threads_share_it(make_server, monkeypatch):
    srv = make_server(max_concurrent_requests=64)
    batches = [_grpo(1024, i) for i in range(32)]
    with AdvantageClient(srv.address, timeout=60.0, shm_regions=3) as c:
        refs = [c.compute("grpo", None, transport="unary", **b).advantages for b in batches]
        seen = _Seen(c, monkeypatch)

        def work(i: int) -> None:
            for k in range(3):
                j = (i * 3 + k) % len(batches)
                assert torch.equal(c.compute("grpo", None, transport="shm", **batches[j]).advantages, refs[j])
        _run(32, work)
        assert 1 < seen.registered <= 3 and seen.max_busy <= 3 and c.shm_region_count == seen.registered
        # transport="auto" does not wait for a busy pool: with every region taken, it sends the call another way
        held = [c._shm_take(0) for _ in range(c.shm_region_count)]
        try:
            big = _gae(8, 4096, 0)
            want = c.compute("gae", None, transport="unary", **big)
            got = c.compute("gae", None, **big)
            assert c.last_transport == "unary" and torch.equal(got.advantages, want.advantages)
        finally:
            for region in held:
                c._shm_give(region)
    assert seen.unregistered == seen.registered and c.shm_region_count == 0


def test_a_region_busy_at_close_is_released_when_its_call_ends(make_server, monkeypatch):
    monkeypatch.setenv("ADVANTAGE_SHM_MEMFD", "0")  # a POSIX segment: its name is in /dev/shm (test_shm_memfd.py)
    srv = make_server()
    c = AdvantageClient(srv.address, timeout=30.0)
    c.compute("gae", None, transport="shm", **_gae(8, 256, 0))
    region = c._shm_take(0)
    name = region.shm.name.lstrip("/")
    c.close()
    assert os.path.exists(f"/dev/shm/{name}")  # still in use by a call
    c._shm_give(region)
    assert not os.path.exists(f"/dev/shm/{name}") and c.shm_region_count == 0
    with pytest.raises(ValueError):
        c._shm_take(0)


def test_shm_regions_must_be_positive():
    with pytest.raises(ValueError):
        AdvantageClient("127.0.0.1:1", shm_regions=0)
