"""Regressions from the issue-2 review: error size in trailers, message-size range, overflow handling."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_server.limits import Limits


def test_many_bad_fields_still_give_invalid_argument_with_capped_details(client):
    """100 unknown inputs: the status must fit the trailers (clients cap them at 8-16 KiB)."""
    extra = {f"unknown_input_{i:03d}_" + "x" * 60: np.zeros(2, np.float32) for i in range(100)}
    with pytest.raises(AdvantageServiceError) as err:
        client.compute("grpo", prompt_ids=np.array([0, 0]), rewards=np.array([1.0, 0.0], np.float32),
                       mask=np.ones((2, 3), np.float32), **extra)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert 1 <= len(err.value.field_violations) <= 10
    assert "and 90 more" in str(err.value)
    ok = client.compute("grpo", prompt_ids=np.array([0, 0]), rewards=np.array([1.0, 0.0], np.float32),
                        mask=np.ones((2, 3), np.float32))
    assert ok.advantages.shape == (2, 3)


@pytest.mark.parametrize("mb", [0, -1, 2048, 4096])
def test_message_size_limit_out_of_range_is_refused(mb):
    with pytest.raises(ValueError, match="max-message-mb|max_message_mb"):
        Limits(max_message_mb=mb)
    with pytest.raises(ValueError, match="max_message_mb"):
        AdvantageClient("127.0.0.1:1", max_message_mb=mb)


def test_float16_output_overflow_is_invalid_argument_not_infinity(client):
    with pytest.raises(AdvantageServiceError) as err:
        client.compute("raw_reward", {"normalize_advantages": False}, output_dtype="float16",
                       rewards=np.array([1e5, -1e5], np.float32), mask=np.ones((2, 3), np.float32))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "output_dtype" in str(err.value) and "float16" in str(err.value)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the overflow is an answer, not a warning on stderr
def test_float32_overflow_from_finite_inputs_is_invalid_argument(client):
    values = torch.zeros(2, 4)
    with pytest.raises(AdvantageServiceError) as err:
        client.compute("gae", {"normalize_advantages": False}, rewards=torch.tensor([3e38, -3e38]),
                       mask=torch.ones(2, 4), values=values - 3e38)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "overflowed" in str(err.value)
    # the same magnitudes in float64 are fine
    res = client.compute("gae", {"normalize_advantages": False}, output_dtype="float64",
                         rewards=torch.tensor([3e38, -3e38], dtype=torch.float64),
                         mask=torch.ones(2, 4), values=torch.zeros(2, 4, dtype=torch.float64) - 3e38)
    assert torch.isfinite(res.advantages).all()


def test_stream_size_cap_comes_from_the_server_flag():
    """A streamed request declaring more than --max-stream-mb is refused before any allocation."""
    import subprocess, sys, socket
    from advantage_server import create_server
    srv = create_server("127.0.0.1", 0, device="cpu", max_stream_mb=1).start()
    try:
        with AdvantageClient(srv.address, timeout=30, transport="stream") as c:
            rewards = np.zeros(2, np.float32)
            with pytest.raises(AdvantageServiceError) as err:
                c.compute("gae", {"normalize_advantages": False}, rewards=rewards,
                          mask=np.ones((2, 300_000), np.float32), values=np.zeros((2, 300_000), np.float32))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-stream-mb=1 " in str(err.value)
            ok = c.compute("gae", {"normalize_advantages": False}, rewards=rewards,
                           mask=np.ones((2, 8), np.float32), values=np.zeros((2, 8), np.float32))
            assert ok.advantages.shape == (2, 8)
    finally:
        srv.stop(grace=1.0)
