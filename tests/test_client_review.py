"""Client fixes from review: per-sample results rebuilt from the mask that was sent (not the caller's buffer,
reused while the call is in flight), writable results at every T, ``mask_columns`` only with ``lengths`` (and
as the request field over shared memory), a temporary shared-memory fallback for ``transport="auto"``, and
``AsyncAdvantageClient(max_in_flight=...)`` queueing a gather beyond the server's concurrency limit."""
from __future__ import annotations

import asyncio
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AsyncAdvantageClient, WireError
from advantage_client import client as client_mod
from advantage_server import transport
from advantage_server.errors import InvalidInput

B, T = 4, 6
KW = dict(prompt_ids=np.array([0, 0, 1, 1]), rewards=np.array([1.0, 0.0, 2.0, 1.0], np.float32))


def _mask(kind: str):
    m = np.ones((B, T), np.bool_)
    m[:, 4:] = False
    m[0, 1] = False  # not a prefix mask: sent as bytes, rebuilt from the mask
    if kind == "uint8":
        return m.astype(np.uint8)
    if kind == "float64":  # no other float64 input: sent as it is
        return m.astype(np.float64)
    if kind == "torch":
        return torch.from_numpy(m.copy())
    return m


def _overwrite(mask) -> None:
    mask[:] = 1  # the trainer writes its next batch into the same buffer


CASES = [("verl", "bool"), ("verl", "uint8"), ("verl", "float64"), ("verl", "torch"), ("openrlhf", "bool"),
         ("openrlhf", "torch")]


@pytest.mark.parametrize("semantics,kind", CASES)
def test_sync_rebuilds_from_the_mask_that_was_sent_not_the_callers_buffer(target, monkeypatch, semantics, kind):
    cfg = {"semantics": semantics}
    with AdvantageClient(target, timeout=30.0, transport="unary") as c:
        want = c.compute("grpo", cfg, mask=_mask(kind), **KW)
        assert c.compute("grpo", cfg, mask=_mask(kind), per_sample=True, **KW).layout != "dense"
        mask = _mask(kind)
        sent = threading.Event()
        original = c._calls.unary

        def unary(*args, **kwargs):  # the reply is in: the caller's thread reuses its buffer before the rebuild
            reply = original(*args, **kwargs)
            sent.set()
            _overwrite(mask)
            return reply
        monkeypatch.setattr(c._calls, "unary", unary)
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("r", c.compute("grpo", cfg, mask=mask, **KW)))
        worker.start()
        worker.join(60)
        assert sent.is_set() and bool(np.asarray(mask).all())
        assert torch.equal(out["r"].advantages, want.advantages)
        if semantics == "verl":  # broadcast_times_mask: 0 where the sent mask is 0
            assert bool((out["r"].advantages[~torch.as_tensor(np.asarray(_mask(kind)) != 0)] == 0).all())


@pytest.mark.parametrize("semantics,kind", CASES)
def test_asyncio_rebuilds_from_the_mask_that_was_sent_not_the_callers_buffer(target, semantics, kind):
    cfg = {"semantics": semantics}

    async def main():
        async with AsyncAdvantageClient(target, timeout=30.0) as c:
            want = await c.compute("grpo", cfg, mask=_mask(kind), **KW)
            mask = _mask(kind)
            task = asyncio.ensure_future(c.compute("grpo", cfg, mask=mask, **KW))
            await asyncio.sleep(0)  # the request is prepared and sent
            _overwrite(mask)
            got = await task
            return want, got
    want, got = asyncio.run(main())
    assert torch.equal(got.advantages, want.advantages)


def _writable(x) -> bool:
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    return bool(x.flags.writeable)


@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("as_numpy", [True, False])
@pytest.mark.parametrize("cfg", [{}, {"semantics": "verl"}, {"semantics": "openrlhf"}])
def test_per_sample_results_are_writable_at_every_width(target, width, as_numpy, cfg):
    kw = dict(KW, mask=np.ones((B, width), np.float32))

    async def aio():
        async with AsyncAdvantageClient(target, timeout=30.0) as c:
            return await c.compute("grpo", cfg, as_numpy=as_numpy, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch: "The given NumPy array is not writable"
        with AdvantageClient(target, timeout=30.0, transport="unary") as c:
            results = [c.compute("grpo", cfg, as_numpy=as_numpy, **kw)]
        results.append(asyncio.run(aio()))
    for r in results:
        assert r.layout == "dense" and tuple(r.advantages.shape) == (B, width)
        assert _writable(r.advantages)
        before = r.advantages.copy() if as_numpy else r.advantages.clone()
        r.advantages[0, 0] = 123.0
        assert float(r.advantages[0, 0]) == 123.0
        assert bool((r.advantages[1:] == before[1:]).all())


@pytest.mark.parametrize("transport_", ["auto", "unary", "stream", "shm"])
def test_mask_columns_with_a_mask_is_a_wire_error_naming_it(target, transport_):
    with AdvantageClient(target, timeout=30.0) as c:
        with pytest.raises(WireError, match="mask_columns"):
            c.compute("grpo", None, mask=np.ones((B, T), np.float32), mask_columns=T, transport=transport_, **KW)
        with pytest.raises(WireError, match="mask_columns"):  # no lengths either
            c.compute("grpo", None, mask_columns=T, transport=transport_, **KW)

    async def aio():
        async with AsyncAdvantageClient(target, timeout=30.0) as c:
            await c.compute("grpo", None, mask=np.ones((B, T), np.float32), mask_columns=T, **KW)
    with pytest.raises(WireError, match="mask_columns"):
        asyncio.run(aio())


def test_lengths_and_mask_columns_over_shared_memory_are_the_request_field(target):
    lengths = np.array([6, 3, 0, 2], np.int32)
    with AdvantageClient(target, timeout=30.0) as c:
        for cfg in ({}, {"semantics": "verl"}):
            want = c.compute("grpo", cfg, transport="unary", lengths=lengths, mask_columns=8, **KW)
            got = c.compute("grpo", cfg, transport="shm", lengths=lengths, mask_columns=8, **KW)
            assert tuple(got.advantages.shape) == (B, 8)
            assert torch.equal(got.advantages, want.advantages)


def _big() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(rewards=torch.randn(8, generator=g), mask=(torch.rand(8, 4096, generator=g) > 0.1).float(),
                values=torch.randn(8, 4096, generator=g))  # 256 KiB: above shm_min_mb


def test_auto_tries_shared_memory_again_after_a_refusal(make_server, monkeypatch):
    monkeypatch.setenv("ADVANTAGE_SHM_MEMFD", "0")  # one registration per try (a memfd refused is retried as POSIX)
    srv = make_server()
    monkeypatch.setattr(client_mod, "SHM_RETRY_S", 0.5)
    real = transport.Region.__init__
    refusals = {"n": 1}

    def refuse_once(self, *args, **kwargs):
        if refusals["n"]:
            refusals["n"] -= 1
            raise InvalidInput("name", "cannot open shared-memory segment (refused once)")
        real(self, *args, **kwargs)
    monkeypatch.setattr(transport.Region, "__init__", refuse_once)
    tensors = _big()
    with AdvantageClient(srv.address, timeout=30.0) as c:
        want = c.compute("gae", None, transport="unary", **tensors).advantages
        got = c.compute("gae", None, **tensors)
        assert c.last_transport == "unary" and c._shm_works is False and torch.equal(got.advantages, want)
        registrations = []
        original = c.shared_memory
        monkeypatch.setattr(c, "shared_memory", lambda n: registrations.append(n) or original(n))
        c.compute("gae", None, **tensors)  # within SHM_RETRY_S: not tried
        assert c.last_transport == "unary" and not registrations
        time.sleep(0.6)
        got = c.compute("gae", None, **tensors)
        assert c.last_transport == "shm" and c._shm_works is True and len(registrations) == 1
        assert torch.equal(got.advantages, want)


def test_auto_a_refused_growth_pauses_the_growth_only(make_server, monkeypatch):
    srv = make_server()
    monkeypatch.setattr(client_mod, "SHM_RETRY_S", 0.5)
    tensors = _big()
    with AdvantageClient(srv.address, timeout=30.0) as c:
        want = c.compute("gae", None, transport="unary", **tensors).advantages
        c.compute("gae", None, **tensors)
        assert c.last_transport == "shm" and c._shm_works is True and c.shm_region_count == 1
        busy = c._shm_take(c._shm_need(dict(tensors)))  # another thread's call holds the only region
        real = transport.Region.__init__

        def refuse(self, *args, **kwargs):
            raise InvalidInput("name", "no more regions (refused)")
        monkeypatch.setattr(transport.Region, "__init__", refuse)
        got = c.compute("gae", None, **tensors)  # the pool cannot grow: sent another way
        assert c.last_transport == "unary" and torch.equal(got.advantages, want)
        assert c._shm_works is True and c.shm_region_count == 1
        registrations = []
        original = c.shared_memory
        monkeypatch.setattr(c, "shared_memory", lambda n: registrations.append(n) or original(n))
        c.compute("gae", None, **tensors)  # growth paused: no registration tried
        assert c.last_transport == "unary" and not registrations
        c._shm_give(busy)
        got = c.compute("gae", None, **tensors)  # the pool's region works on
        assert c.last_transport == "shm" and torch.equal(got.advantages, want) and not registrations
        monkeypatch.setattr(transport.Region, "__init__", real)
        busy = c._shm_take(c._shm_need(dict(tensors)))
        time.sleep(0.6)
        c.compute("gae", None, **tensors)  # growth again after SHM_RETRY_S
        assert c.last_transport == "shm" and len(registrations) == 1 and c.shm_region_count == 2
        c._shm_give(busy)


def test_asyncio_max_in_flight_queues_a_gather_beyond_the_servers_limit(make_server):
    srv = make_server(max_concurrent_requests=8)
    g = torch.Generator().manual_seed(0)
    groups = [dict(prompt_ids=np.zeros(16, np.int64), rewards=torch.randn(16, generator=g),
                   mask=(torch.rand(16, 512, generator=g) > 0.2).float()) for _ in range(100)]
    with AdvantageClient(srv.address, timeout=60.0, transport="unary") as c:
        want = [c.compute("grpo", None, **grp).advantages for grp in groups]

    async def main():
        async with AsyncAdvantageClient(srv.address, timeout=60.0, max_in_flight=8) as c:
            return await asyncio.gather(*(c.compute("grpo", None, **grp) for grp in groups))
    got = asyncio.run(main())
    assert all(torch.equal(r.advantages, w) for r, w in zip(got, want))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_asyncio_max_in_flight_is_checked(bad):
    with pytest.raises(ValueError, match="max_in_flight"):
        AsyncAdvantageClient("127.0.0.1:9", max_in_flight=bad)


@pytest.mark.parametrize("width", [1, 5])
def test_layout_rebuild_broadcast_is_a_new_writable_array(width):
    from advantage_client import layout
    values = np.arange(3, dtype=np.float32)
    out = layout.rebuild(values, layout.BROADCAST, None, width)
    assert out.flags.writeable and out.flags.c_contiguous and not np.shares_memory(out, values)
    t = layout.rebuild(torch.from_numpy(values), layout.BROADCAST, None, width)  # the torch path rebuilds in numpy
    assert not np.shares_memory(t.numpy(), values)
