"""Input layouts over gRPC: the packed (ragged) layout, and group ids given as string labels.

Packed layout (``ComputeAdvantageRequest.cu_seqlens``): for every estimator the server lists, built
from its ListEstimators entry alone, a random ragged batch sent packed gives exactly the padded
layout's results at the valid positions: with holes in a flat mask, with the mask left out, with
per-sample and token-level rewards, with empty rows. Malformed ``cu_seqlens`` is INVALID_ARGUMENT naming
it, and the server keeps serving.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageServiceError, wire
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client.client import build_request, reduce_prompt_ids
from advantage_server.estimators import REGISTRY

NAMES = sorted(REGISTRY)
B = 7
COMPONENTS = ("reward/a", "reward/b")


@pytest.fixture(scope="module")
def listing(client):
    return {e.name: e for e in client.list_estimators().estimators}


def test_listing_covers_the_registry(listing):
    assert set(listing) == set(NAMES)


# ------------------------------------------------------------------------------ batch building
def symbols(shape: str) -> list[str]:
    return [s.strip() for s in shape.strip("[]").split(",") if s.strip()]


def token_level(spec) -> bool:
    return any("T" in symbols(s) for s in spec.shapes)


def ragged_lengths(rng: np.random.Generator) -> np.ndarray:
    """B row lengths in 0..8 with one empty row, one long row, and N != B (so [B] and [N] never collide)."""
    while True:
        lengths = rng.integers(1, 8, size=B)
        lengths[rng.integers(B)] = 0
        lengths[(np.argmin(lengths) + 1) % B] = 9
        if lengths.sum() != B:
            return lengths


def random_values(name: str, kind: str, size: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if kind == "mask":
        return (rng.random(size) < 0.75).astype(np.float32)
    if kind == "integer":  # ids (GiGPO trajectory_ids, anchor_ids, step_index)
        return rng.integers(0, 3, size=size).astype(np.int64)
    if name.endswith("logprobs"):
        return (-rng.random(size) * 3).astype(np.float32)
    if name == "sum_pi_squared":
        return rng.uniform(0.05, 1.0, size).astype(np.float32)
    if name.endswith("weights"):
        return rng.uniform(0.5, 1.5, size).astype(np.float32)
    return rng.standard_normal(size).astype(np.float32)


def ragged_batch(info, seed: int, token_rewards: bool) -> tuple[np.ndarray, dict, dict]:
    """(lengths, packed tensors, padded tensors) with one tensor per declared input.

    Token-level inputs: flat [N] packed, [B, T_max] padded (zeros beyond each row's length). Inputs
    that accept [B] or [B, T] (rewards) are per-sample unless ``token_rewards``. ``prompt_ids``: [B]
    ids, every group of size >= 2 (pass@k needs that). The packed mask is flat with holes."""
    rng = np.random.default_rng(seed)
    lengths = ragged_lengths(rng)
    T, N = int(lengths.max()), int(lengths.sum())
    rows = np.repeat(np.arange(B), lengths)
    cols = np.arange(N) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    packed, padded = {}, {}
    for spec in info.inputs:
        keys = COMPONENTS if spec.name.endswith("<name>") else (spec.name,)
        for key in keys:
            shapes = [symbols(s) for s in spec.shapes]
            if key == "prompt_ids":
                ids = rng.permutation(np.arange(B) % 3).astype(np.int64) * 7 + 11  # groups of 2-3, non-contiguous
                packed[key] = padded[key] = ids
            elif token_level(spec) and (token_rewards or ["B"] not in shapes):
                flat = random_values(key, spec.kind, (N,), rng)
                full = np.zeros((B, T), dtype=flat.dtype)
                full[rows, cols] = flat
                packed[key], padded[key] = flat, full
            else:
                size = tuple({"B": B}.get(s, 3) for s in shapes[0])
                packed[key] = padded[key] = random_values(key, spec.kind, size, rng)
    return lengths, packed, padded


def config_variants(info) -> list[dict | None]:
    """Defaults; every bool switched on (every optional path: KL in reward, leave-one-out, ...); and each
    other value of a `semantics` field (values an estimator does not offer are skipped by the caller)."""
    variants: list[dict | None] = [None]
    # a bool that applies under some semantics only (listed "false (verl); not applicable otherwise") is
    # switched on with the first semantics it applies to, the others all together
    bools = {f.name: True for f in info.config_fields if f.type == "bool" and "not applicable" not in f.default_value}
    if bools:
        variants.append(bools)
    for f in info.config_fields:
        if f.type == "bool" and "not applicable" in f.default_value:
            variants.append({"semantics": f.default_value.split("(")[1].split(")")[0].split(",")[0].strip(),
                             f.name: True})
    for field in info.config_fields:
        if field.type == "Semantics":
            names = [n for n in wire.enum_names(pb.Semantics.DESCRIPTOR).values() if n]
            variants += [{"semantics": n} for n in names if n != field.default_value.split(" ")[0]]
    return variants


def compute_or_skip(client, name, config, **kwargs):
    """``client.compute``; None when ``config`` picks a semantics the estimator does not offer."""
    try:
        return client.compute(name, config, **kwargs)
    except AdvantageServiceError as err:
        if config and "semantics" in config and any(f == "config.semantics" for f, _ in err.field_violations):
            return None
        raise


def valid_positions(lengths: np.ndarray) -> np.ndarray:
    T = int(lengths.max())
    return np.arange(T)[None, :] < lengths[:, None]


def cu_of(lengths: np.ndarray, dtype=np.int64) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)


def accepts_token_rewards(info) -> bool:
    return any(s.name == "rewards" and token_level(s) and ["B"] in [symbols(x) for x in s.shapes]
               for s in info.inputs)


def assert_packed_equals_padded(packed_result, padded_result, lengths):
    valid = valid_positions(lengths)
    N = int(lengths.sum())
    assert tuple(packed_result.advantages.shape) == (N,)
    torch.testing.assert_close(packed_result.advantages, padded_result.advantages[torch.from_numpy(valid)],
                               rtol=1e-6, atol=1e-6)
    if padded_result.returns is None:
        assert packed_result.returns is None
    else:
        assert tuple(packed_result.returns.shape) == (N,)
        torch.testing.assert_close(packed_result.returns, padded_result.returns[torch.from_numpy(valid)],
                                   rtol=1e-6, atol=1e-6)
    assert packed_result.metrics.keys() == padded_result.metrics.keys()
    for key, value in padded_result.metrics.items():
        assert abs(packed_result.metrics[key] - value) <= 1e-6 + 1e-6 * abs(value), key


# ------------------------------------------------------------------------------ packed == padded
@pytest.mark.parametrize("rewards_form", ["per_sample", "token"])
@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_padded_with_holes(client, listing, name, rewards_form):
    info = listing[name]
    if rewards_form == "token" and not accepts_token_rewards(info):
        pytest.skip(f"{name} takes per-sample rewards only")
    for seed in (0, 1):
        for config in config_variants(info):
            lengths, packed, padded = ragged_batch(info, seed, token_rewards=rewards_form == "token")
            if name == "gae" and (config or {}).get("semantics") == "slime":
                # slime's ppo puts the reward on the response's last token: the packed row's end, which a padded
                # row shows only where its mask ends with 1
                ends = np.cumsum(lengths)[lengths > 0] - 1
                packed["mask"][ends] = 1
                padded["mask"][np.flatnonzero(lengths), lengths[lengths > 0] - 1] = 1
            want = compute_or_skip(client, name, config, **padded)
            if want is None:
                continue
            got = client.compute(name, config, cu_seqlens=cu_of(lengths, np.int32 if seed else np.int64), **packed)
            assert_packed_equals_padded(got, want, lengths)


@pytest.mark.parametrize("name", NAMES)
def test_packed_mask_may_be_omitted(client, listing, name):
    info = listing[name]
    lengths, packed, padded = ragged_batch(info, seed=3, token_rewards=False)
    del packed["mask"]
    padded["mask"] = valid_positions(lengths).astype(np.float32)
    got = client.compute(name, None, cu_seqlens=cu_of(lengths), **packed)
    want = client.compute(name, None, **padded)
    assert_packed_equals_padded(got, want, lengths)


def test_packed_results_are_flat_in_row_order(client):
    """A tiny hand-checked case: raw rewards broadcast to each row's tokens, rows concatenated."""
    rewards = np.array([1.0, -2.0, 3.0], dtype=np.float32)
    cu = np.array([0, 2, 2, 5])
    result = client.compute("raw_reward", {"normalize_advantages": False}, cu_seqlens=cu, rewards=rewards)
    np.testing.assert_array_equal(result.advantages.numpy(), [1.0, 1.0, 3.0, 3.0, 3.0])


def test_per_sample_reading_when_n_equals_b(client):
    """With N == B a rewards tensor of length B is per-sample (documented in the proto)."""
    cu = np.array([0, 0, 2])  # B = 2, N = 2
    values = np.array([0.5, -0.5], dtype=np.float32)
    rewards = np.array([3.0, 7.0], dtype=np.float32)
    got = client.compute("gae", {"normalize_advantages": False}, cu_seqlens=cu, rewards=rewards, values=values)
    want = client.compute("gae", {"normalize_advantages": False}, rewards=rewards,
                          values=np.array([[0, 0], [0.5, -0.5]], dtype=np.float32),
                          mask=np.array([[0, 0], [1, 1]], dtype=np.float32))
    np.testing.assert_allclose(got.advantages.numpy(), want.advantages.numpy()[1])


def test_packed_with_every_row_empty(client):
    result = client.compute("raw_reward", None, cu_seqlens=np.array([0, 0, 0]),
                            rewards=np.array([1.0, 2.0], dtype=np.float32))
    assert tuple(result.advantages.shape) == (0,)


# ------------------------------------------------------------------------------ bad cu_seqlens
GAE_N7 = dict(rewards=np.array([1.0, 2.0, 3.0], dtype=np.float32), values=np.zeros(7, dtype=np.float32))


@pytest.mark.parametrize("cu, fragment", [
    (np.array([1, 3, 3, 7]), "start at 0"),
    (np.array([0, 4, 3, 7]), "non-decreasing"),
    (np.array([0, 3, 3, 8]), "N = 8"),
    (np.array([0, 3, 3, 6]), "N = 6"),
    (np.array([0.0, 3.0, 3.0, 7.0]), "int32 or int64"),
    (np.array([[0, 3, 3, 7]]), "[B + 1]"),
    (np.array([0]), "B >= 1"),
    (np.array([], dtype=np.int64), "B >= 1"),
])
def test_bad_cu_seqlens_is_invalid_argument(client, cu, fragment):
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("gae", None, cu_seqlens=cu, **GAE_N7)
    err = exc.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (err.code, str(err))
    assert "cu_seqlens" in str(err) and fragment in str(err), str(err)
    assert any(f.startswith("cu_seqlens") for f, _ in err.field_violations), err.field_violations
    assert client.compute("gae", None, cu_seqlens=np.array([0, 3, 3, 7]), **GAE_N7).advantages.shape == (7,)


def test_cu_seqlens_with_bad_bytes_is_invalid_argument(target):
    from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc

    request = build_request("gae", None, None, np.array([0, 3, 3, 7]), **GAE_N7)
    request.cu_seqlens.data = request.cu_seqlens.data[:-3]
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage(request, timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cu_seqlens" in exc.value.details()


def test_token_level_input_sent_padded_with_cu_seqlens_is_invalid_argument(client):
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("gae", None, cu_seqlens=np.array([0, 3, 3, 7]), rewards=GAE_N7["rewards"],
                       values=np.zeros((3, 4), dtype=np.float32))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "values" in str(exc.value) and "flat [N]" in str(exc.value)


def test_flat_mask_of_wrong_length_names_cu_seqlens(client):
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("raw_reward", None, cu_seqlens=np.array([0, 2, 5]),
                       rewards=np.array([1.0, 2.0], dtype=np.float32), mask=np.ones(4, dtype=np.float32))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cu_seqlens" in str(exc.value) and "mask" in str(exc.value)


def test_packed_without_cu_seqlens_is_an_ordinary_shape_error(client):
    """Flat tensors without cu_seqlens are a plain shape mismatch (the padded layout is the default)."""
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("gae", None, **GAE_N7)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_padding_beyond_the_server_limit_is_resource_exhausted(client, monkeypatch):
    """Many short rows and one long row would pad to B x T_max; beyond the limit the server refuses."""
    from advantage_server import core

    monkeypatch.setattr(core, "MAX_PADDED_ELEMENTS", 30)  # the test server runs in this process
    with pytest.raises(AdvantageServiceError) as exc:
        client.compute("raw_reward", None, cu_seqlens=np.array([0, 1, 2, 22]),
                       rewards=np.array([1.0, 2.0, 3.0], dtype=np.float32))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cu_seqlens" in str(exc.value)
    monkeypatch.undo()
    assert client.compute("raw_reward", None, cu_seqlens=np.array([0, 1, 2, 22]),
                          rewards=np.array([1.0, 2.0, 3.0], dtype=np.float32)).advantages.shape == (22,)


def test_request_field_is_documented_in_the_schema():
    field = pb.ComputeAdvantageRequest.DESCRIPTOR.fields_by_name["cu_seqlens"]
    assert field.number == 12 and field.message_type.full_name == "advantage.v1.Tensor"


# ------------------------------------------------------------------------------ string group ids
def test_reduce_prompt_ids_maps_labels_to_ids():
    labels = np.array(["007", "7", "a", "007", "7"], dtype=object)
    ids = reduce_prompt_ids(labels)
    assert ids.dtype == np.int64 and ids.shape == (5,)
    assert ids[0] == ids[3] and ids[1] == ids[4] and len({ids[0], ids[1], ids[2]}) == 3  # "007" != "7"
    np.testing.assert_array_equal(reduce_prompt_ids(["b", "a", "b"]), reduce_prompt_ids(np.array(["b", "a", "b"])))
    mixed = reduce_prompt_ids(["7", 7, "7"])  # a list mixing the string and the integer: two labels
    assert mixed[0] == mixed[2] != mixed[1]
    np.testing.assert_array_equal(reduce_prompt_ids(np.array([5, 9, 5])), [5, 9, 5])  # integers pass through
    rows = reduce_prompt_ids(np.array([[1, 2], [1, 3], [1, 2]]))
    assert rows[0] == rows[2] != rows[1]
    odd = reduce_prompt_ids(np.array([None, "a", None], dtype=object))  # unorderable labels
    assert odd[0] == odd[2] != odd[1]


@pytest.mark.parametrize("form", ["object", "str", "list"])
def test_string_group_ids_over_grpc(client, form):
    uids = ["q-b", "q-a", "007", "q-b", "7", "q-a", "007", "7"]
    ints = np.array([0, 1, 2, 0, 3, 1, 2, 3], dtype=np.int64)
    prompt_ids = {"object": np.array(uids, dtype=object), "str": np.array(uids), "list": uids}[form]
    rng = np.random.default_rng(5)
    rewards = rng.standard_normal(8).astype(np.float32)
    mask = np.ones((8, 3), dtype=np.float32)
    got = client.compute("grpo", None, prompt_ids=prompt_ids, rewards=rewards, mask=mask)
    want = client.compute("grpo", None, prompt_ids=ints, rewards=rewards, mask=mask)
    torch.testing.assert_close(got.advantages, want.advantages)
    merged = client.compute("grpo", None, prompt_ids=np.array([0, 1, 2, 0, 2, 1, 2, 2]), rewards=rewards, mask=mask)
    assert not torch.allclose(got.advantages, merged.advantages), "'007' and '7' must be different groups"
