"""Results written straight into caller-supplied memory (the shared-memory transport's output room), and
the memory-speed input/output checks: identical results and identical errors to the copy/torch paths."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client.client import AdvantageServiceError
from advantage_server import shm_output, validate
from advantage_server.core import AdvantageCore
from advantage_server.errors import InvalidInput
from advantage_server.estimators import REGISTRY, jit

B, T = 24, 40  # B * T * 8 bytes > 4 KiB: several rows per check
NUMBA = [True, False] if jit._numba is not None else [False]


def _tensors(estimator: str, seed: int = 0, dtype=torch.float32) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.2).to(dtype)
    mask[3] = 0  # an empty row
    ids = torch.arange(B) // 4
    r = torch.randn(B, generator=g, dtype=dtype)
    if estimator == "gae":
        return {"gae_lambda": 0.9}, dict(rewards=r, mask=mask, values=torch.randn(B, T, generator=g, dtype=dtype))
    if estimator in ("grpo", "reinforce_plus_plus"):
        return {}, dict(prompt_ids=ids, rewards=r, mask=mask)
    if estimator == "gdpo":
        return {}, {"prompt_ids": ids, "mask": mask, "reward/a": r, "reward/b": torch.randn(B, generator=g, dtype=dtype)}
    if estimator == "raw_reward":
        return {}, dict(rewards=r, mask=mask)
    if estimator == "opd":
        return {}, dict(mask=mask, teacher_logprobs=-torch.rand(B, T, generator=g, dtype=dtype),
                        prev_logprobs=-torch.rand(B, T, generator=g, dtype=dtype))
    raise AssertionError(estimator)


DENSE = ["gae", "grpo", "gdpo", "raw_reward", "reinforce_plus_plus", "opd"]


# ------------------------------------------------------------------------------------- Batch.output
@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_results_written_into_provided_memory_equal_the_allocated_ones(name, dtype):
    config, tensors = _tensors(name, dtype=dtype)
    core = AdvantageCore("cpu")
    ref = core.run(name, config, tensors)
    buf = np.zeros(4 * B * T * 8 + 4096, np.uint8)
    room = shm_output.OutputRoom(buf, 128, buf.size, dtype)
    got = core.run(name, config, tensors, output_provider=room)
    assert torch.equal(got.advantages, ref.advantages)
    assert (got.returns is None) == (ref.returns is None)
    if ref.returns is not None:
        assert torch.equal(got.returns, ref.returns)
    assert got.metrics == ref.metrics
    if jit.enabled():  # the CPU kernels write their [B, T] results into the provided memory
        base = buf.__array_interface__["data"][0]
        assert "advantages" in room.handed
        assert base <= got.advantages.data_ptr() < base + buf.size
        assert room.place("advantages", got.advantages) == room.handed["advantages"][1]
        assert np.array_equal(buf[room.handed["advantages"][1]:][:B * T * got.advantages.element_size()]
                              .view(got.advantages.numpy().dtype).reshape(B, T), ref.advantages.numpy())


def test_provider_is_not_used_for_the_packed_layout_or_another_dtype():
    config, tensors = _tensors("gae")
    core = AdvantageCore("cpu")
    buf = np.zeros(1 << 16, np.uint8)
    room = shm_output.OutputRoom(buf, 0, buf.size, torch.float64)  # requested float64, computed in float32
    core.run("gae", config, tensors, output_provider=room)
    assert room.handed == {}
    room = shm_output.OutputRoom(buf, 0, buf.size, torch.float32)
    cu = torch.tensor([0, 3, 5])
    core.run("gae", {}, {"rewards": torch.ones(2), "values": torch.ones(5)}, cu_seqlens=cu, output_provider=room)
    assert room.handed == {}


def test_room_never_overlaps_an_input_and_too_small_rooms_fall_back():
    buf = np.zeros(1 << 12, np.uint8)
    room = shm_output.OutputRoom(buf, 0, buf.size, torch.float32, inputs=[(100, 200)])
    assert room("advantages", (4, 8), torch.float32, torch.device("cpu")) is None  # [0, 128) overlaps [100, 200)
    room = shm_output.OutputRoom(buf, 256, buf.size, torch.float32, inputs=[(100, 200)])
    view = room("advantages", (4, 8), torch.float32, torch.device("cpu"))
    assert view is not None and room.handed["advantages"][1] == 256
    assert room("returns", (1000, 8), torch.float32, torch.device("cpu")) is None  # beyond the room
    with pytest.raises(InvalidInput) as err:
        room.place("returns", torch.zeros(1000, 8))
    assert err.value.violations[0][0] == "output_byte_size"


# ------------------------------------------------------------------------------------- through the server
def _in_place(monkeypatch):
    seen = []
    place = shm_output.OutputRoom.place

    def spy(self, name, t):
        pos = place(self, name, t)
        seen.append((name, name in self.handed and pos == self.handed[name][1] and
                     t.data_ptr() == self.handed[name][0].data_ptr()))
        return pos
    monkeypatch.setattr(shm_output.OutputRoom, "place", spy)
    return seen


@pytest.mark.parametrize("name", DENSE)
def test_shm_results_written_in_place_are_identical_to_the_copy_path(client, monkeypatch, name):
    config, tensors = _tensors(name, seed=3)
    ref = client.compute(name, config, transport="unary", **tensors)
    seen = _in_place(monkeypatch)
    with client.shared_memory(1 << 20) as region:
        placed = {}
        for k, v in tensors.items():
            placed[k] = region.empty(tuple(v.shape), v.dtype)
            placed[k].copy_(v)
        got = region.compute(name, config, copy=False, **placed)
        assert torch.equal(got.advantages, ref.advantages)
        if ref.returns is not None:
            assert torch.equal(got.returns, ref.returns)
        assert got.metrics == pytest.approx(ref.metrics)
        base = region._buf.__array_interface__["data"][0]
        assert base <= got.advantages.data_ptr() < base + region.size
        for k, v in placed.items():  # the inputs are untouched
            assert torch.equal(v, tensors[k]), k
        copied = region.compute(name, config, copy=True, output_dtype="float64", **placed)  # cast: copy path
        assert torch.allclose(copied.advantages, ref.advantages.double())
        del got, placed, v, copied
    if jit.enabled():
        assert (("advantages", True) in seen), seen


def test_shm_too_small_room_is_invalid_argument(client):
    _, tensors = _tensors("gae")
    with client.shared_memory(1 << 20) as region:
        placed = {k: region.empty(tuple(t.shape), t.dtype) for k, t in tensors.items()}
        for k, t in tensors.items():
            placed[k].copy_(t)
        req = pb.ComputeAdvantageShmRequest(key=region.key, output_region_id=region.region_id)
        req.request.gae.CopyFrom(pb.GAEConfig())
        for k, v in placed.items():
            offset = v.data_ptr() - region._buf.__array_interface__["data"][0]
            req.inputs[k].CopyFrom(pb.SharedMemoryTensor(dtype=pb.DTYPE_FLOAT32, shape=list(v.shape),
                                                         region_id=region.region_id, offset=offset))
        start = region._next
        for room in (B * T * 4 + 64, B * T * 4 - 4, 0):  # advantages fit but not returns; neither; nothing
            req.output_offset, req.output_byte_size = start, room
            with pytest.raises(AdvantageServiceError) as err:
                client._call("ComputeAdvantageShm", req, pb.ComputeAdvantageShmResponse)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, room
            assert "output room" in str(err.value), str(err.value)
        # output room over the inputs: computed correctly (copied after reading), inputs intact until then
        ref = client.compute("gae", None, transport="unary", **tensors)
        req.output_offset, req.output_byte_size = 0, region.size
        reply = client._call("ComputeAdvantageShm", req, pb.ComputeAdvantageShmResponse)
        adv = region._buf[reply.advantages.offset:][:B * T * 4].view(np.float32).reshape(B, T)
        assert np.array_equal(adv, ref.advantages.numpy())
        del placed, adv, v


# ------------------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("numba", NUMBA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1,), (7,), (64 * 4096,), (3, 5), (300, 1000), (2, 3, 4)])
def test_all_finite_matches_torch(numba, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    t = torch.randn(shape, generator=g, dtype=dtype) * 1e30
    with jit.use_numba(numba):
        assert validate.all_finite(t)
        flat = t.view(-1)
        for bad in (float("nan"), float("inf"), -float("inf")):
            for pos in {0, flat.numel() // 2, flat.numel() - 1}:
                u = t.clone()
                u.view(-1)[pos] = bad
                assert not validate.all_finite(u), (bad, pos)
        assert validate.all_finite(torch.full(shape, torch.finfo(dtype).max, dtype=dtype))
    assert validate.all_finite(torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("numba", NUMBA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8,
                                   torch.float16])
def test_is_binary_matches_torch(numba, dtype):
    m = (torch.rand(300, 1000, generator=torch.Generator().manual_seed(1)) > 0.5).to(dtype)
    with jit.use_numba(numba):
        assert validate.is_binary(m)
        for bad in ([2, 255] if not dtype.is_floating_point else [0.5, -1.0, float("nan"), float("inf"), 1e-3]):
            u = m.clone()
            u[299, 999] = bad
            assert not validate.is_binary(u), bad
            assert validate.is_binary(u) == bool(((u == 0) | (u == 1)).all())


@pytest.mark.parametrize("numba", NUMBA)
def test_input_errors_are_unchanged(numba):
    core = AdvantageCore("cpu")
    _, tensors = _tensors("gae")
    cases = [("values", (5, 7), float("nan"), "contains NaN or infinity"),
             ("values", (0, 0), float("-inf"), "contains NaN or infinity"),
             ("mask", (2, 2), float("nan"), "contains NaN or infinity"),
             ("mask", (2, 2), float("inf"), "contains NaN or infinity"),
             ("mask", (B - 1, T - 1), 0.5, "holds values other than 0 and 1"),
             ("rewards", (1,), float("inf"), "contains NaN or infinity")]
    with jit.use_numba(numba):
        for key, pos, value, words in cases:
            bad = dict(tensors)
            bad[key] = tensors[key].clone()
            bad[key][pos] = value
            with pytest.raises(InvalidInput) as err:
                core.run("gae", None, bad)
            (field, description), = err.value.violations
            assert field == f"inputs[{key!r}]" and words in description, (key, value, description)
        bad = dict(tensors, mask=tensors["mask"].long())
        bad["mask"][0, 0] = 2
        with pytest.raises(InvalidInput) as err:
            core.run("gae", None, bad)
        assert "holds values other than 0 and 1" in err.value.violations[0][1]
        with pytest.raises(InvalidInput) as err:  # finite inputs, overflowing arithmetic
            core.run("gae", {"normalize_advantages": False}, {"rewards": torch.tensor([3e38, -3e38]),
                                                              "mask": torch.ones(2, 4), "values": torch.full((2, 4), -3e38)})
        assert "overflowed" in err.value.violations[0][1]


def test_prepare_does_not_copy_inputs_that_have_the_compute_dtype():
    core = AdvantageCore("cpu")
    spec = REGISTRY["gae"]
    cfg = spec.config().resolved()
    _, tensors = _tensors("gae")
    out = core.prepare(spec, cfg, tensors)
    for k in ("values", "mask", "rewards"):
        assert out[k].data_ptr() == tensors[k].data_ptr(), k
    out = core.prepare(spec, cfg, dict(tensors, mask=tensors["mask"].bool()))
    assert out["mask"].dtype == torch.float32 and torch.equal(out["mask"], tensors["mask"])


# ------------------------------------------------------------------------------------- GAE's fused overflow check
@pytest.mark.skipif(jit._numba is None, reason="numba kernels only")
@pytest.mark.parametrize("config", [{}, {"normalize_advantages": False}, {"semantics": "verl"},
                                    {"semantics": "verl", "normalize_advantages": False},
                                    {"gae_lambda_value": 0.5, "gae_lambda_policy": 0.9}])
def test_gae_kernel_overflow_flags_agree_with_the_full_check(config):
    core = AdvantageCore("cpu")
    _, tensors = _tensors("gae")
    ok = core.run("gae", config, tensors)
    assert ok.finite and validate.all_finite(ok.advantages) and validate.all_finite(ok.returns)
    huge = dict(tensors, rewards=torch.full((B,), 3e38), values=torch.full((B, T), -3e38))
    try:  # huge float32 inputs are computed in float64 (issue 11 item 7)
        full = core.run("gae", config, huge)
    except InvalidInput as err:  # a float32 result overflows: named after the largest input
        (field, description), = err.violations
        assert field in ("inputs['rewards']", "inputs['values']") and "overflowed" in description
    else:  # every result fits float32 (computed in float64, then cast): no overflow to report
        assert full.advantages.dtype == torch.float32
        assert validate.all_finite(full.advantages) and validate.all_finite(full.returns)
    spec = REGISTRY["gae"]
    cfg = core_config(spec, config)
    from advantage_server.estimators import Batch
    res = spec.fn(cfg, Batch(dict(huge)))  # the float32 kernel itself: its overflow flag
    assert not res.finite and not (validate.all_finite(res.advantages) and validate.all_finite(res.returns))


def core_config(spec, config):
    from advantage_server.core import config_from_dict
    return config_from_dict(spec, config).resolved()


def test_calls_writing_into_one_region_wait_for_each_other(target, monkeypatch):
    """A call whose client gave up may still be writing into the room: the next call on the region
    waits for it (within its deadline) instead of having its results overwritten."""
    import threading

    from advantage_client import AdvantageClient
    held = threading.Lock()
    monkeypatch.setattr(shm_output, "region_lock", lambda region: held)
    config, tensors = _tensors("gae")
    with AdvantageClient(target, timeout=0.5) as c, c.shared_memory(1 << 20) as region:
        held.acquire()  # as if an abandoned call were still writing
        try:
            with pytest.raises(AdvantageServiceError) as err:
                region.compute("gae", config, **tensors)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            held.release()
        with pytest.raises(RuntimeError, match="abandoned"):  # the client-side guard comes first
            region.compute("gae", config, **tensors)
        region.abandoned = None  # past the guard: the server-side wait still keeps the results intact
        got = region.compute("gae", config, **tensors)
        ref = c.compute("gae", config, transport="unary", **tensors)
        assert torch.equal(got.advantages, ref.advantages)
        assert not held.locked()


@pytest.mark.parametrize("config", [{"semantics": "verl"}, {"normalize_advantages": False},
                                    {"gae_lambda_value": 0.5, "length_adaptive_alpha": 0.1},
                                    {"use_kl_in_reward": True}])
def test_gae_variants_in_provided_memory_equal_the_allocated_ones(config):
    _, tensors = _tensors("gae")
    if config.get("use_kl_in_reward"):
        tensors = dict(tensors, logprobs=-torch.rand(B, T), reference_logprobs=-torch.rand(B, T))
    core = AdvantageCore("cpu")
    ref = core.run("gae", config, tensors)
    buf = np.zeros(3 * B * T * 4, np.uint8)
    got = core.run("gae", config, tensors, output_provider=shm_output.OutputRoom(buf, 0, buf.size, torch.float32))
    assert torch.equal(got.advantages, ref.advantages) and torch.equal(got.returns, ref.returns)
