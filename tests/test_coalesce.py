"""Client-side coalescing in AsyncAdvantageClient (``coalesce_ms``; issue #12), against a real server.

* the contract that makes coalescing safe (``COALESCE_EXAMPLES=200`` for a longer search than the default 12): for every estimator and semantics the server declares
  group-local (``EstimatorInfo.group_local``), hypothesis-generated batches of whole prompt groups, split
  into consecutive calls, give bit-identical advantages and returns computed call by call (coalescing off)
  and merged into one request by the coalescing client, over gRPC; calls of one batch reuse the same
  prompt labels, so a merge that forgot to keep the calls' groups apart would be caught;
* the same check catches estimators that are NOT group-local (trl ``scale_rewards = batch``, gpg, verl
  reinforce_plus_plus_baseline) when a false declaration is injected into the client;
* many concurrent calls, mixed compatible/incompatible calls, an invalid call inside a batch, a cancelled
  waiting caller, the window bounding the added wait, the row cap, and the option checks.
"""
from __future__ import annotations

import asyncio
import os
import time

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from advantage_client import AsyncAdvantageClient, InvalidArgumentError
from advantage_client.aio import _UNKNOWN, _default, group_local
from advantage_client.client import PUSHBACK_MAX_RETRIES
from advantage_server.core import config_from_dict, list_estimators
from advantage_server.estimators.registry import REGISTRY

LISTING = {e.name: e for e in list_estimators().estimators}


def run(coro):
    return asyncio.run(coro)


def _defaults(info) -> dict[str, str]:
    return {f.name: f.default_value for f in info.config_fields}


def _base_configs(info) -> list[dict]:
    """Every semantics (and trl scale_rewards) of an estimator, as a config dict."""
    fields = {f.name: f for f in info.config_fields}
    out = [{}] if "semantics" not in fields else [{"semantics": s} for s in fields["semantics"].allowed_values]
    if "scale_rewards" in fields:
        out = [dict(c, scale_rewards=v) if _default(fields["scale_rewards"].default_value, c.get("semantics"))
               is not _UNKNOWN else c for c in out for v in fields["scale_rewards"].allowed_values]
        out = [dict(t) for t in {tuple(sorted(c.items())) for c in out}]
    return sorted(out, key=lambda c: sorted(c.items()))


def _cases(declared: bool) -> list[tuple[str, dict]]:
    cases = []
    for name, info in sorted(LISTING.items()):
        for cfg in _base_configs(info):
            if group_local(list(info.group_local), cfg, _defaults(info)) == declared:
                cases.append((name, cfg))
    return cases


GROUP_LOCAL = _cases(True)


def test_declarations_cover_the_group_family():
    """The declared set is what the registry says (and what the contract below checks, case by case)."""
    names = {n for n, _ in GROUP_LOCAL}
    assert names == {"grpo", "rloo", "opo", "grpo_passk", "pkpo", "qae", "maxrl"}
    assert ("grpo", {"scale_rewards": "batch", "semantics": "trl"}) not in GROUP_LOCAL
    assert ("grpo", {"scale_rewards": "group", "semantics": "trl"}) in GROUP_LOCAL
    for name in ("gae", "gpg", "gdpo", "gigpo", "opd", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                 "raw_reward", "remax"):
        assert list(LISTING[name].group_local) == [], name
    assert all(not LISTING[n].metrics for n in names)  # metrics are batch values: never group-local


def test_client_reads_the_declarations_as_the_server_evaluates_them():
    """The client's reading of ``EstimatorInfo.group_local`` (with the listed defaults) agrees with the registry's
    ``group_local_for`` on the resolved config, for every semantics, trl scale_rewards and bool setting."""
    checked = 0
    for name, info in LISTING.items():
        spec, defaults = REGISTRY[name], _defaults(info)
        for base in _base_configs(info):
            semantics = base.get("semantics", defaults.get("semantics"))
            flips = [f.name for f in info.config_fields
                     if f.type == "bool" and _default(f.default_value, semantics) is not _UNKNOWN]
            for cfg in [base] + [dict(base, **{f: v}) for f in flips for v in (True, False)]:
                server_cfg = config_from_dict(spec, cfg).resolved()
                assert group_local(list(info.group_local), cfg, defaults) == spec.group_local_for(server_cfg), \
                    (name, cfg)
                checked += 1
    assert checked > 100


@st.composite
def batches(draw, info, base: dict):
    """(config, [tensors of each call]): whole prompt groups of random sizes, split into consecutive calls."""
    defaults, semantics = _defaults(info), base.get("semantics", _defaults(info).get("semantics"))
    cfg = dict(base)
    for f in info.config_fields:
        if f.type == "bool" and f.name not in cfg and _default(f.default_value, semantics) is not _UNKNOWN:
            if draw(st.booleans()):
                value = draw(st.booleans())
                # a setting that makes the config batch-wide (trl rloo's normalize_advantages) is not this
                # contract's: test_client_reads_the_declarations_as_the_server_evaluates_them covers it
                if group_local(list(info.group_local), dict(cfg, **{f.name: value}), defaults):
                    cfg[f.name] = value
    if "reference_policy_kl_type" in defaults and \
            _default(defaults["reference_policy_kl_type"], semantics) is not _UNKNOWN:  # (prime_rl has no KL)
        cfg["reference_policy_kl_type"] = draw(st.sampled_from(["k1", "k2", "k3"]))
    T = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    token_rewards = draw(st.booleans())  # rewards [B, T] (summed over the row) instead of [B]
    n_calls = draw(st.integers(2, 5))
    calls = []
    for _ in range(n_calls):
        sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
        labels = draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes), unique=True))
        ids = np.repeat(np.array(labels, dtype=np.int64), sizes)
        B = len(ids)
        order = np.array(draw(st.permutations(list(range(B)))), dtype=np.int64)  # a call's groups interleaved
        ids = ids[order]
        rewards = np.array(draw(st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0, 0.1, 3.25]), min_size=B, max_size=B)))
        lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
        mask = (np.arange(T)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
        if token_rewards:
            rewards = np.concatenate([rewards[:, None], np.zeros((B, T - 1))], 1)
        tensors = {"prompt_ids": ids, "rewards": rewards.astype(dtype), "mask": mask}
        for spec in info.inputs:
            if spec.name in tensors or spec.required or not spec.required_when:
                continue
            if group_local([spec.required_when], cfg, defaults):
                if "[B, T]" not in spec.shapes:  # per-sample counts (prime_rl's length penalty)
                    tensors[spec.name] = np.array(draw(st.lists(st.integers(0, 50), min_size=B, max_size=B)),
                                                  dtype=np.float32)
                    continue
                vals = draw(st.lists(st.floats(-3, 0, width=32), min_size=B * T, max_size=B * T))
                tensors[spec.name] = np.array(vals, dtype=np.float32).reshape(B, T)
        calls.append(tensors)
    return cfg, calls


def _count_requests(co: AsyncAdvantageClient) -> list[int]:
    """The rows of each request ``co`` sends from now on (its direct path is wrapped), in a list kept current."""
    sent: list[int] = []
    direct = co._compute_direct

    async def spy(*args):
        tensors = args[-1]
        sent.append(len(tensors["mask"] if "mask" in tensors else tensors["lengths"]))
        return await direct(*args)
    co._compute_direct = spy
    return sent


async def _alone_and_merged(target, name, cfg, calls, *, declare: bool = False):
    async with AsyncAdvantageClient(target, timeout=30.0) as plain:
        alone = [await plain.compute(name, cfg, **t) for t in calls]
    async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=200.0) as co:
        if declare:  # a false declaration, to show that the comparison catches it
            await co._group_local_rules()
            co._group_local[name] = ([""], co._group_local[name][1])
        sent = _count_requests(co)
        merged = await asyncio.gather(*(co.compute(name, cfg, **t) for t in calls))
    assert sent == [sum(t["mask"].shape[0] for t in calls)], sent  # one request carried every call
    return alone, merged


def _same(a, b) -> bool:
    if (a.returns is None) != (b.returns is None) or a.layout != b.layout or a.metrics != b.metrics:
        return False
    pairs = [(a.advantages, b.advantages)] + ([] if a.returns is None else [(a.returns, b.returns)])
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("name,base", GROUP_LOCAL, ids=[f"{n}-{'-'.join(c.values()) or 'default'}"
                                                           for n, c in GROUP_LOCAL])
def test_group_local_contract(target, name, base):
    info = LISTING[name]

    @settings(max_examples=int(os.environ.get("COALESCE_EXAMPLES", "12")), deadline=None, suppress_health_check=list(HealthCheck))
    @given(batches(info, base))
    def check(case):
        cfg, calls = case
        alone, merged = run(_alone_and_merged(target, name, cfg, calls))
        for i, (a, m) in enumerate(zip(alone, merged)):
            assert _same(a, m), (i, cfg, a, m)
    check()


NOT_LOCAL = [("grpo", {"semantics": "trl", "scale_rewards": "batch"}), ("gpg", {}),
             ("reinforce_plus_plus_baseline", {"semantics": "verl"})]


@pytest.mark.parametrize("name,cfg", NOT_LOCAL, ids=[n for n, _ in NOT_LOCAL])
def test_contract_catches_estimators_that_are_not_group_local(target, name, cfg):
    """Declared group-local by mistake, these give merged results that differ from the calls alone."""
    info = LISTING[name]
    assert not group_local(list(info.group_local), cfg, _defaults(info))
    rng = np.random.default_rng(0)
    calls = []
    for c in range(3):
        B = 4 * (c + 1)
        calls.append({"prompt_ids": np.repeat(np.arange(c + 1), 4), "rewards": rng.choice([0.0, 1.0, 2.0], B)
                      .astype(np.float32) + c, "mask": (np.arange(5)[None, :] < rng.integers(1, 6, B)[:, None])
                      .astype(np.float32)})
    alone, merged = run(_alone_and_merged(target, name, cfg, calls, declare=True))
    assert not all(_same(a, m) for a, m in zip(alone, merged))


def _group(seed: int, B: int = 8, T: int = 16):
    rng = np.random.default_rng(seed)
    return {"prompt_ids": np.zeros(B, dtype=np.int64) + seed % 3, "rewards": rng.random(B).astype(np.float32),
            "mask": (np.arange(T)[None, :] < rng.integers(1, T + 1, B)[:, None]).astype(np.float32)}


def test_many_concurrent_calls_match_alone(target):
    groups = [_group(i) for i in range(64)]

    async def go():
        async with AsyncAdvantageClient(target, timeout=30.0) as plain:
            alone = await asyncio.gather(*(plain.compute("grpo", None, **g) for g in groups))
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=20.0, coalesce_max_rows=128) as co:
            sent = _count_requests(co)
            merged = await asyncio.gather(*(co.compute("grpo", None, **g) for g in groups))
            per_sample = await asyncio.gather(*(co.compute("grpo", None, per_sample=True, **g) for g in groups[:8]))
            numpy_out = await asyncio.gather(*(co.compute("grpo", None, as_numpy=True, **g) for g in groups[:8]))
        return alone, merged, sent, per_sample, numpy_out
    alone, merged, sent, per_sample, numpy_out = run(go())
    assert sum(sent[:4]) == 64 * 8 and max(sent[:4]) <= 128 and len(sent) < 64  # capped batches, far fewer calls
    for a, m in zip(alone, merged):
        assert _same(a, m)
        assert m.advantages.shape == (8, 16)
    for a, p, n in zip(alone, per_sample, numpy_out):
        assert p.layout == "broadcast" and p.advantages.shape == (8,)
        assert torch.equal(p.advantages, a.advantages[:, 0])
        assert isinstance(n.advantages, np.ndarray) and np.array_equal(n.advantages, a.advantages.numpy())


def test_mixed_compatible_and_incompatible_calls(target):
    """gae (not group-local), another config, another T, a torch input, [B, L] prompt rows and masks in other
    forms in one gather."""
    g, g2 = _group(1), _group(2, T=7)
    calls = [("grpo", None, g), ("grpo", {"semantics": "verl"}, g), ("grpo", None, g2),
             ("grpo", None, {**g, "rewards": torch.from_numpy(g["rewards"])}),
             ("grpo", None, {**g, "prompt_ids": np.stack([g["prompt_ids"], g["prompt_ids"]], 1)}),
             ("grpo", {"semantics": "trl", "scale_rewards": "batch"}, g),
             ("gae", None, {"rewards": np.ones((8, 16), np.float32), "values": np.zeros((8, 16), np.float32),
                            "mask": g["mask"]}),
             ("rloo", None, g),
             # the mask as bool, as a torch tensor, and not a prefix mask (sent as bytes, not lengths)
             ("grpo", None, {**g, "mask": g["mask"].astype(bool)}), ("grpo", None, {**g, "mask": torch.from_numpy(g["mask"])}),
             ("grpo", None, {**g, "mask": np.concatenate([np.zeros((8, 1), np.float32), g["mask"][:, 1:]], 1)}),
             ("grpo", None, g), ("grpo", None, _group(3))]

    async def go():
        async with AsyncAdvantageClient(target, timeout=30.0) as plain:
            alone = [await plain.compute(n, c, **t) for n, c, t in calls]
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=50.0) as co:
            merged = await asyncio.gather(*(co.compute(n, c, **t) for n, c, t in calls))
        return alone, merged
    alone, merged = run(go())
    for i, (a, m) in enumerate(zip(alone, merged)):
        assert _same(a, m), i


def test_invalid_call_in_a_batch_gets_its_own_error(target):
    good = [_group(i) for i in range(5)]
    bad = dict(_group(9), rewards=np.array([np.nan] + [0.0] * 7, np.float32))

    async def go():
        async with AsyncAdvantageClient(target, timeout=30.0) as plain:
            alone = [await plain.compute("grpo", None, **g) for g in good]
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=50.0) as co:
            out = await asyncio.gather(*(co.compute("grpo", None, **g) for g in [*good[:2], bad, *good[2:]]),
                                       return_exceptions=True)
        return alone, out
    alone, out = run(go())
    err = out[2]
    assert isinstance(err, InvalidArgumentError) and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "rewards" in str(err)
    for a, m in zip(alone, out[:2] + out[3:]):
        assert _same(a, m)


def test_cancelled_waiting_caller_does_not_break_the_others(target):
    groups = [_group(i) for i in range(4)]

    async def go():
        async with AsyncAdvantageClient(target, timeout=30.0) as plain:
            alone = [await plain.compute("grpo", None, **g) for g in groups]
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=100.0) as co:
            await co._group_local_rules()
            tasks = [asyncio.ensure_future(co.compute("grpo", None, **g)) for g in groups]
            await asyncio.sleep(0.02)  # all four are waiting in the batch now
            tasks[1].cancel()
            out = await asyncio.gather(*tasks, return_exceptions=True)
        return alone, out
    alone, out = run(go())
    assert isinstance(out[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        assert _same(alone[i], out[i])


def test_window_bounds_the_added_wait(target):
    g = _group(0)

    async def go(ms):
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=ms) as co:
            await co.compute("grpo", None, **g)  # the listing is read once, not timed here
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                await co.compute("grpo", None, **g)
                times.append(time.perf_counter() - t0)
            return min(times)
    fast, slow = run(go(1.0)), run(go(150.0))
    assert 0.150 <= slow < 0.150 + 0.5, slow  # a lone call waits the window, then goes
    assert fast < 0.15, fast


def test_cap_sends_at_once_and_large_calls_go_alone(target):
    groups = [_group(i) for i in range(4)]

    async def go():
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=5000.0, coalesce_max_rows=16) as co:
            t0 = time.perf_counter()
            out = await asyncio.gather(*(co.compute("grpo", None, **g) for g in groups))  # 2 full batches of 16
            big = await co.compute("grpo", None, **_group(5, B=32))  # over the cap: not held
            return time.perf_counter() - t0, out, big
    elapsed, out, big = run(go())
    assert elapsed < 2.0 and len(out) == 4 and big.advantages.shape == (32, 16)


def test_options_are_checked():
    for bad in (-1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="coalesce_ms"):
            AsyncAdvantageClient("localhost:1", coalesce_ms=bad)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="coalesce_max_rows"):
            AsyncAdvantageClient("localhost:1", coalesce_max_rows=bad)


def test_close_fails_waiting_calls_and_server_errors_reach_every_caller(target, make_server):
    async def go():
        co = AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=60_000.0)
        await co._group_local_rules()
        tasks = [asyncio.ensure_future(co.compute("grpo", None, **_group(i))) for i in range(3)]
        await asyncio.sleep(0.02)
        await co.close()
        return await asyncio.gather(*tasks, return_exceptions=True)
    out = run(go())
    assert all(getattr(e, "code", None) == grpc.StatusCode.CANCELLED for e in out), out

    srv = make_server()

    async def gone():  # the server stops while the calls wait: the merged request's UNAVAILABLE reaches all
        async with AsyncAdvantageClient(srv.address, timeout=5.0, coalesce_ms=200.0, retry=False) as co:
            await co._group_local_rules()
            tasks = [asyncio.ensure_future(co.compute("grpo", None, **_group(i))) for i in range(3)]
            await asyncio.sleep(0.02)
            srv.stop(grace=None)
            return await asyncio.gather(*tasks, return_exceptions=True)
    out = run(gone())
    assert all(getattr(e, "code", None) == grpc.StatusCode.UNAVAILABLE for e in out), out


def test_a_config_changed_after_the_call_changes_no_result(target):
    """Issue #22 item 4: the callers share one config dict and one of them changes it 20 ms after calling,
    while the calls wait in the 100 ms window. Before, the merged request read the dict when it was sent, so
    all 4 callers got advantages without the std division (silently); now each call's config is read when
    ``compute`` starts: every result equals the call made alone with the config as it was."""
    groups = [dict(_group(i), rewards=np.random.default_rng(i).random(8).astype(np.float32)) for i in range(4)]

    async def go():
        async with AsyncAdvantageClient(target, timeout=30.0) as plain:
            alone = [await plain.compute("grpo", {"normalize_rewards": True}, **g) for g in groups]
            changed = [await plain.compute("grpo", {"normalize_rewards": False}, **g) for g in groups]
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=100.0) as co:
            await co._group_local_rules()
            sent = _count_requests(co)
            cfg = {"normalize_rewards": True}
            tasks = [asyncio.ensure_future(co.compute("grpo", cfg, **g)) for g in groups]
            await asyncio.sleep(0.02)  # every call has started and waits in the window
            cfg["normalize_rewards"] = False
            merged = await asyncio.gather(*tasks)
        return alone, changed, merged, sent
    alone, changed, merged, sent = run(go())
    assert sent == [32], sent  # one merged request carried the 4 calls
    for a, c, m in zip(alone, changed, merged):
        assert not torch.equal(a.advantages, c.advantages)  # the change would show
        assert _same(a, m)


def test_tensors_reused_after_the_call_change_no_result(target):
    """Issue #27 item 6: a caller writes its next batch into the same buffers as soon as ``compute`` has
    returned (right after creating the call's task, and again once the task has started). Before, a fresh
    coalescing client copied the tensors only after awaiting the server's estimator listing (and any client
    read them only once its coroutine ran), so the request carried the new data and the caller silently got
    its advantages; now the tensors are captured when ``compute`` is called: every result equals the call made
    alone with the original data, exactly, on a fresh client with coalescing on (and off, and on a client
    that has coalesced before), numpy and torch buffers alike."""
    originals = [dict(_group(i), rewards=np.random.default_rng(10 + i).random(8).astype(np.float32))
                 for i in range(4)]

    async def go(coalesce_ms: float, warm: bool, kind: str):
        async with AsyncAdvantageClient(target, timeout=30.0) as plain:
            alone = [await plain.compute("grpo", None, **g) for g in originals]
        async with AsyncAdvantageClient(target, timeout=30.0, coalesce_ms=coalesce_ms) as client:
            if warm:
                await client.compute("grpo", None, **originals[0])
            buffers = [{k: (torch.from_numpy(v.copy()) if kind == "torch" else v.copy()) for k, v in g.items()}
                       for g in originals]
            tasks = [asyncio.ensure_future(client.compute("grpo", None, **b)) for b in buffers]
            for i, b in enumerate(buffers):  # the next batch, written into the same buffers at once
                b["rewards"][:] = 100.0 + i
                b["mask"][:] = 1.0
            await asyncio.sleep(0)  # every task has started (a fresh client now awaits its listing)
            for b in buffers:
                b["rewards"][:] = -7.0
                b["prompt_ids"][:] = 0
            got = await asyncio.gather(*tasks)
        return alone, got
    for coalesce_ms, warm, kind in [(20.0, False, "numpy"), (20.0, False, "torch"), (0.0, False, "numpy"),
                                    (20.0, True, "numpy")]:
        alone, got = run(go(coalesce_ms, warm, kind))
        for a, g in zip(alone, got):
            assert torch.equal(g.advantages, a.advantages), (coalesce_ms, warm, kind)


def _resource_exhausted_count(srv) -> float:
    """ComputeAdvantage calls the server answered RESOURCE_EXHAUSTED (its metrics, every estimator label)."""
    return sum(s.value for family in srv.metrics.registry.collect() for s in family.samples
               if s.name == "advantage_requests_total" and s.labels.get("method") == "ComputeAdvantage"
               and s.labels.get("code") == "RESOURCE_EXHAUSTED")


def test_an_admission_refusal_of_a_merged_request_is_shared_not_multiplied(make_server, monkeypatch):
    """Issue #22 item 4: the only --max-concurrent-requests place is held by a call that waits in its
    estimator; 16 coalesced callers' merged request is refused there. Before, the refusal sent each call
    again alone (17 refusals on the server for 16 callers); now every caller gets the one RESOURCE_EXHAUSTED
    (naming the flag) and the server counts exactly one refusal. Once the place is free, the same 16 calls
    are served as one request."""
    import dataclasses
    import threading

    from advantage_server.estimators.registry import REGISTRY
    entered, release = threading.Event(), threading.Event()
    opd = REGISTRY["opd"]

    def held(cfg, batch):
        entered.set()
        assert release.wait(30), "the test never released the held call"
        return opd.fn(cfg, batch)
    monkeypatch.setitem(REGISTRY, "opd", dataclasses.replace(opd, fn=held))
    srv = make_server(max_concurrent_requests=1)
    groups = [_group(i) for i in range(16)]

    async def go():
        async with AsyncAdvantageClient(srv.address, timeout=30.0, coalesce_ms=100.0) as co:
            await co._group_local_rules()
            sent = _count_requests(co)
            blocker = asyncio.ensure_future(co.compute("opd", None, mask=np.ones((2, 3), np.float32),
                                                       teacher_logprobs=np.zeros((2, 3), np.float32),
                                                       prev_logprobs=np.zeros((2, 3), np.float32)))
            assert await asyncio.to_thread(entered.wait, 10), ("the holding call did not reach the estimator",
                                                               blocker.done() and blocker.exception())
            before = _resource_exhausted_count(srv)
            refused = await asyncio.gather(*(co.compute("grpo", None, **g) for g in groups), return_exceptions=True)
            refusals = _resource_exhausted_count(srv) - before
            release.set()
            await blocker
            served = await asyncio.gather(*(co.compute("grpo", None, **g) for g in groups))
        return refused, refusals, sent, served
    try:
        refused, refusals, sent, served = run(go())
    finally:
        release.set()
    assert all(getattr(e, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused), refused
    assert all("--max-concurrent-requests=1" in str(e) for e in refused)
    # the merged request is refused, and sent again after each retry pushback as ONE request (issue #27 item 3;
    # a server without pushback: once)
    attempts = 1 if refused[0].pushback_s is None else 1 + PUSHBACK_MAX_RETRIES
    assert refusals == attempts, refusals
    # the holding call, the refused merged request, the served one
    assert sent == [2, 16 * 8, 16 * 8], sent  # one request: its attempts are made inside it (counted above)
    assert all(m.advantages.shape == (8, 16) for m in served)
