"""``compact=False`` on either client: the tensors go as given (float mask) and the dense result comes back over
the wire; the values are the same as with the default (compact masks, per-sample results rebuilt)."""
from __future__ import annotations

import asyncio

import torch

from advantage_client import AdvantageClient, AsyncAdvantageClient
from advantage_client.client import prepare_call


def _group(T: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(16, T)
    for b in range(16):
        mask[b, 2:2 + 1 + b * 3 % (T - 2)] = 1
    return {"prompt_ids": torch.zeros(16, dtype=torch.int64), "rewards": torch.randn(16, generator=g), "mask": mask}


def test_prepare_call_without_compact_sends_the_float_mask_and_asks_for_dense():
    t = _group()
    on = prepare_call("grpo", None, None, None, False, dict(t))
    off = prepare_call("grpo", None, None, None, False, dict(t), compact=False)
    assert on.mask is not None and off.mask is None  # the default asks for per-sample results
    assert off.request.nbytes > 16 * 64 * 4 > on.request.nbytes
    asked = prepare_call("grpo", None, None, None, True, dict(t), compact=False)
    assert asked.mask is not None  # per_sample=True still asks


def test_both_clients_give_the_same_values_with_compact_off(target):
    t = _group()
    with AdvantageClient(target, timeout=30.0, transport="unary") as on, \
            AdvantageClient(target, timeout=30.0, transport="unary", compact=False) as off:
        a, b = on.compute("grpo", None, **t), off.compute("grpo", None, **t)
        assert a.layout == b.layout == "dense" and torch.equal(a.advantages, b.advantages)

    async def run():
        async with AsyncAdvantageClient(target, timeout=30.0, compact=False) as client:
            return await client.compute("grpo", None, **t)
    assert torch.equal(asyncio.run(run()).advantages, a.advantages)
