"""AsyncAdvantageClient (grpc.aio) against real servers on loopback.

* every NeMo RL and verl golden case through the asyncio client: dense (the default), per-sample
  (``per_sample=True``, rebuilt with ``advantage_client.layout.rebuild``), with a bool mask and, where the
  mask is a prefix mask, with ``lengths``;
* 64 concurrent calls from one event loop, each identical to the sync client's answer;
* the error contract (InvalidArgumentError is a ValueError, field violations, WireError before sending,
  UNAUTHENTICATED, UNAVAILABLE), the token, TLS and mutual TLS, and failover over a list of replicas.
"""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from advantage_client import (
    AdvantageClient, AdvantageServiceError, AsyncAdvantageClient, InvalidArgumentError, RemoteAdvantageEstimator,
    WireError, layout, wire,
)
from advantage_client.client import AdvantageResult

from conftest import assert_close_to_golden, golden_cases, load_case
from references.verl_releases import OLDER_VERL_CONFIG, changed_in_release
from reliability_support import make_pki
from test_golden_nemo import nemo_kwargs
from test_golden_verl import SAME_RETURNS, check_case, service_call

NEMO = golden_cases("nemo-rl")
VERL = golden_cases("verl")


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------ golden cases
class _Recorder:
    """Stands in for a client under RemoteAdvantageEstimator: records the compute call the NeMo RL drop-in
    makes (estimator, config, tensors with the service's names), so the test can send it asynchronously."""

    def __init__(self, real: AdvantageClient):
        self.real, self.calls = real, []

    def list_estimators(self):
        return self.real.list_estimators()

    def compute(self, name, config, **kwargs):
        self.calls.append((name, config, kwargs))
        return AdvantageResult(torch.zeros(1))


def _variants(tensors: dict) -> dict[str, dict]:
    """The call's tensors as sent by the trainer, with the mask as bool, and as lengths when it is a prefix."""
    out = {"as given": tensors}
    mask = tensors.get("mask")
    if mask is None:
        return out
    m = mask.numpy() if hasattr(mask, "numpy") else np.asarray(mask)
    out["bool mask"] = {**tensors, "mask": m != 0}
    lengths = (m != 0).sum(1)
    if np.array_equal(m != 0, np.arange(m.shape[1])[None, :] < lengths[:, None]):
        out["lengths"] = {**{k: v for k, v in tensors.items() if k != "mask"}, "lengths": lengths.astype(np.int32),
                          "mask_columns": m.shape[1]}
    return out


async def _all_paths(target: str, name: str, config, tensors: dict) -> dict[str, AdvantageResult]:
    """Every path a golden case goes through, concurrently on one client: unary and stream, dense and
    per-sample (rebuilt here), each mask form."""
    async with AsyncAdvantageClient(target, timeout=60.0) as client:
        jobs = {}
        for form, kw in _variants(tensors).items():
            for transport in ("unary", "stream"):
                jobs[(form, transport, False)] = client.compute(name, config, transport=transport, **kw)
            jobs[(form, "auto", True)] = client.compute(name, config, per_sample=True, **kw)
        results = dict(zip(jobs, await asyncio.gather(*jobs.values())))
    mask = tensors.get("mask")
    out = {}
    for (form, transport, per_sample), r in results.items():
        if per_sample and r.layout != "dense":
            assert r.advantages.shape == (mask.shape[0],), (form, r.advantages.shape)
            m = layout.bool_mask(mask, like=r.advantages)
            code = {layout.layout_name(c): c for c in layout.PER_SAMPLE_LAYOUTS}[r.layout]
            r = AdvantageResult(layout.rebuild(r.advantages, code, m),
                                None if r.returns is None else layout.rebuild(r.returns, code, m), r.metrics,
                                layout=r.layout)  # the layout it came in
        out[f"{form}/{transport}/{'per_sample' if per_sample else 'dense'}"] = r
    return out


@pytest.mark.parametrize("path", NEMO, ids=[p.stem for p in NEMO])
def test_nemo_golden_through_the_async_client(path, target, client):
    case = load_case(path)
    recorder = _Recorder(client)
    RemoteAdvantageEstimator(target, case["estimator"], case["config"], client=recorder,
                             result_format="advantage_result").compute_advantage(**nemo_kwargs(case))
    (name, config, tensors), = recorder.calls
    results = run(_all_paths(target, name, config, tensors))
    assert len(results) >= 6
    for how, result in results.items():
        assert result.advantages.shape == tensors["mask"].shape, how
        assert_close_to_golden(result.advantages.numpy(), case, "advantages")
        if case["expected"]["returns"] is None:
            assert result.returns is None, how
        else:
            assert_close_to_golden(result.returns.numpy(), case, "returns")
        for key, want in case["expected"]["metrics"].items():
            assert abs(result.metrics[key] - want) <= 1e-5 + 1e-4 * abs(want), (how, key)
    first = results["as given/unary/dense"]
    for how, result in results.items():  # every path gives the same bits
        assert torch.equal(result.advantages, first.advantages), how
    kl = name == "reinforce_plus_plus" and wire.config_message(name, config).use_kl_in_reward
    per_row = {"grpo": "broadcast", "gdpo": "broadcast", "raw_reward": "broadcast",
               "reinforce_plus_plus": "dense" if kl else "broadcast"}
    assert results["as given/auto/per_sample"].layout == per_row.get(name, "dense"), (name, config)


@pytest.mark.parametrize("path", VERL, ids=[p.stem for p in VERL])
def test_verl_golden_through_the_async_client(path, target):
    case = load_case(path)
    service, config, tensors = service_call(case)
    if changed_in_release(case):
        config.update(OLDER_VERL_CONFIG[case["estimator"]])
    results = run(_all_paths(target, service, config, tensors))
    for how, result in results.items():
        if case["estimator"] in SAME_RETURNS:
            assert result.returns is None, how
            check_case(case, result.advantages, result.advantages)
        else:
            check_case(case, result.advantages, result.returns)
    first = results["as given/unary/dense"]
    for how, result in results.items():
        assert torch.equal(result.advantages, first.advantages), how
    per_row = {"grpo": "broadcast_times_mask", "grpo_passk": "broadcast_times_mask", "rloo": "broadcast_times_mask",
               "opo": "broadcast_times_mask", "gpg": "broadcast_times_mask", "gdpo": "broadcast_times_mask",
               "reinforce_plus_plus_baseline": "broadcast_times_mask"}
    assert results["as given/auto/per_sample"].layout == per_row.get(service, "dense"), service


# ------------------------------------------------------------------------------------ concurrency
def _group(i: int) -> tuple[str, dict, dict]:
    g = torch.Generator().manual_seed(i)
    B, T = 16, 64 + 8 * i
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    if i % 3 == 2:
        mask[:, 0] = 0  # not a prefix mask: sent as bytes
    rewards = torch.randn(B, generator=g)
    ids = torch.zeros(B, dtype=torch.int64)
    kind = i % 4
    if kind == 0:
        return "grpo", {}, dict(prompt_ids=ids, rewards=rewards, mask=mask)
    if kind == 1:
        return "grpo", {"semantics": "verl"}, dict(prompt_ids=ids, rewards=rewards, mask=mask)
    if kind == 2:
        return "rloo", {"semantics": "openrlhf"}, dict(prompt_ids=ids, rewards=rewards, mask=mask)
    return "gae", {"gae_lambda": 0.9}, dict(rewards=rewards, mask=mask, values=torch.randn(B, T, generator=g))


def test_64_concurrent_calls_from_one_event_loop(make_server):
    srv = make_server(max_concurrent_requests=128)
    calls = [_group(i) for i in range(64)]
    with AdvantageClient(srv.address, timeout=60.0, transport="unary") as sync:
        want = [sync.compute(name, cfg, **kw) for name, cfg, kw in calls]

    async def main():
        async with AsyncAdvantageClient(srv.address, timeout=60.0) as client:
            await client.wait_ready(10.0)
            return await asyncio.gather(*(client.compute(name, cfg, **kw) for name, cfg, kw in calls))

    got = run(main())
    assert len(got) == 64
    for (name, _, kw), g, w in zip(calls, got, want):
        assert g.advantages.shape == kw["mask"].shape and g.layout == "dense"
        assert torch.equal(g.advantages, w.advantages), name
        assert (g.returns is None) == (w.returns is None) and (g.returns is None or torch.equal(g.returns, w.returns))
        g.advantages += 1  # writable, whether rebuilt from per-sample values or decoded


def test_transports_and_last_transport(target):
    name, cfg, kw = _group(1)

    async def main():
        async with AsyncAdvantageClient(target, timeout=30.0, stream_threshold_mb=0.0001) as client:  # ~100 bytes
            auto = await client.compute(name, cfg, **kw)
            seen = [client.last_transport]
            unary = await client.compute(name, cfg, transport="unary", **kw)
            seen.append(client.last_transport)
            return auto, unary, seen

    auto, unary, seen = run(main())
    assert seen == ["stream", "unary"]
    assert torch.equal(auto.advantages, unary.advantages)


def test_per_sample_result_is_one_value_per_row(target):
    name, cfg, kw = _group(1)  # verl GRPO: broadcast times mask

    async def main():
        async with AsyncAdvantageClient(target, timeout=30.0) as client:
            return await asyncio.gather(client.compute(name, cfg, per_sample=True, **kw),
                                        client.compute(name, cfg, **kw),
                                        client.compute("gae", None, per_sample=True, **_group(3)[2]))

    small, dense, gae = run(main())
    assert small.layout == "broadcast_times_mask" and small.advantages.shape == (16,)
    assert torch.equal(small.advantages[:, None] * kw["mask"], dense.advantages)
    assert gae.layout == "dense" and gae.advantages.shape == _group(3)[2]["mask"].shape  # GAE is per token


# ------------------------------------------------------------------------------------ errors
def test_errors_follow_the_sync_clients_contract(target):
    name, cfg, kw = _group(0)

    async def main():
        async with AsyncAdvantageClient(target, timeout=30.0) as client:
            with pytest.raises(InvalidArgumentError) as bad:
                await client.compute("grpo", None, rewards=kw["rewards"], mask=kw["mask"])  # no prompt_ids
            with pytest.raises(WireError):
                await client.compute("no_such_estimator", None, **kw)
            with pytest.raises(InvalidArgumentError) as nan:
                await client.compute(name, cfg, **{**kw, "rewards": torch.full((16,), float("nan"))})
            return bad.value, nan.value

    bad, nan = run(main())
    assert isinstance(bad, ValueError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad.field_violations] == ["inputs['prompt_ids']"]
    assert [f for f, _ in nan.field_violations] == ["inputs['rewards']"] and "NaN" in str(nan)
    with pytest.raises(ValueError, match="shared memory"):
        AsyncAdvantageClient(target, transport="shm")


def test_token_tls_and_mutual_tls(make_server, tmp_path):
    pki = make_pki(tmp_path)
    rewards, mask = np.array([1.0, 0.0], np.float32), np.ones((2, 3), np.float32)
    token_srv = make_server(auth_token="tok-123")
    mtls_srv = make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])

    async def call(address, **options):
        async with AsyncAdvantageClient(address, timeout=5.0, **options) as client:
            r = await client.compute("raw_reward", {"normalize_advantages": False}, rewards=rewards, mask=mask)
            return r.advantages

    with pytest.raises(AdvantageServiceError) as no_token:
        run(call(token_srv.address))
    assert no_token.value.code == grpc.StatusCode.UNAUTHENTICATED and not isinstance(no_token.value, ValueError)
    assert torch.equal(run(call(token_srv.address, token="tok-123")), torch.tensor([[1.0] * 3, [0.0] * 3]))
    got = run(call(mtls_srv.address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"]))
    assert torch.equal(got[:, 0], torch.tensor([1.0, 0.0]))
    with pytest.raises(AdvantageServiceError) as no_cert:  # TLS without a client certificate
        run(call(mtls_srv.address, tls_ca=pki["ca"], retry=False))
    assert no_cert.value.code == grpc.StatusCode.UNAVAILABLE


def test_replicas_fail_over_when_one_stops(make_server):
    replicas = [make_server(), make_server()]
    name, cfg, kw = _group(0)

    async def main():
        async with AsyncAdvantageClient([r.address for r in replicas], timeout=20.0) as client:
            await client.wait_ready(10.0)
            before = await asyncio.gather(*(client.compute(name, cfg, **kw) for _ in range(8)))
            replicas[0].stop(grace=0.5)
            after = await asyncio.gather(*(client.compute(name, cfg, **kw) for _ in range(16)))
            return before, after

    before, after = run(main())
    for r in before + after:
        assert torch.equal(r.advantages, before[0].advantages)


def test_unavailable_when_no_server_answers():
    async def main():
        async with AsyncAdvantageClient("127.0.0.1:1", timeout=5.0, retry=False) as client:
            await client.compute("raw_reward", None, rewards=[1.0], mask=[[1.0]])

    with pytest.raises(AdvantageServiceError) as err:
        run(main())
    assert err.value.code == grpc.StatusCode.UNAVAILABLE

    async def ready():
        async with AsyncAdvantageClient("127.0.0.1:1", timeout=5.0) as client:
            await client.wait_ready(0.3)

    with pytest.raises(AdvantageServiceError, match="no server answered at 127.0.0.1:1 within 0.3s") as err:
        run(ready())
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_list_estimators_says_which_are_per_sample(target):
    async def main():
        async with AsyncAdvantageClient(target, timeout=10.0) as client:
            return {e.name: e for e in (await client.list_estimators()).estimators}

    listing = run(main())
    rules = {name: [(r.when, layout.layout_name(r.layout)) for r in e.per_sample] for name, e in listing.items()}
    assert rules["grpo"] == [("semantics = nemo_rl", "broadcast"),
                             ("semantics = verl or semantics = skyrl", "broadcast_times_mask"),  # SkyRL's is verl's code
                             ("semantics = openrlhf and use_kl_in_reward = false", "up_to_last_valid"), ("semantics = trl", "broadcast"),
                             ("semantics = slime", "broadcast"),  # slime's whole row, whitened or not
                             ("semantics = prime_rl", "broadcast_times_mask")]  # prime-rl's sampled tokens
    assert rules["maxrl"] == [("", "broadcast_times_mask")]
    assert rules["gae"] == [] and rules["opd"] == []
