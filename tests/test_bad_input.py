"""Every malformed request is an INVALID_ARGUMENT naming the field (never UNKNOWN or INTERNAL), carries
``google.rpc.BadRequest`` field violations, and leaves the server serving the next valid request."""
from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request
from advantage_client.wire import encode_tensor

B, T = 4, 3
IDS = np.array([0, 0, 1, 1], dtype=np.int64)
REWARDS = np.array([1.0, 0.0, 0.5, 0.25], dtype=np.float32)
MASK = np.ones((B, T), dtype=np.float32)
VALUES = np.linspace(-1, 1, B * T, dtype=np.float32).reshape(B, T)
LOGP = -np.linspace(0.1, 2, B * T, dtype=np.float32).reshape(B, T)


@pytest.fixture(scope="module")
def stub(target):
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.AdvantageServiceStub(channel)


def assert_serves_next_request(client: AdvantageClient) -> None:
    res = client.compute("grpo", {"use_leave_one_out_baseline": False, "normalize_rewards": False},
                         prompt_ids=IDS, rewards=REWARDS, mask=MASK, as_numpy=True)
    np.testing.assert_allclose(res.advantages[:, 0], [0.5, -0.5, 0.125, -0.125], rtol=1e-6)


def expect_invalid(client: AdvantageClient, call, *names: str) -> AdvantageServiceError:
    """``call()`` must fail with INVALID_ARGUMENT whose message names every ``names``; then a valid
    request must be served normally."""
    with pytest.raises(AdvantageServiceError) as exc:
        call()
    err = exc.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code}: {err}"
    msg = str(err)
    for name in names:
        assert name in msg, f"message does not name {name!r}: {msg}"
    assert err.field_violations, f"no google.rpc.BadRequest field violations: {msg}"
    fields = " ".join(f for f, _ in err.field_violations)
    assert any(name in fields for name in names), f"violations {err.field_violations} name none of {names}"
    assert_serves_next_request(client)
    return err


def raw_call(stub, request: pb.ComputeAdvantageRequest):
    """Send a hand-built request; return a callable that raises AdvantageServiceError like the client."""
    def call():
        try:
            return stub.ComputeAdvantage(request, timeout=30)
        except grpc.RpcError as err:
            raise AdvantageServiceError.from_rpc_error(err) from None
    return call


def grpo_request(**overrides) -> pb.ComputeAdvantageRequest:
    tensors = dict(prompt_ids=IDS, rewards=REWARDS, mask=MASK)
    tensors.update(overrides)
    return build_request("grpo", None, **tensors)


# ------------------------------------------------------------------------ missing inputs
def test_gae_without_values_names_values_and_the_critic(client):
    err = expect_invalid(client, lambda: client.compute("gae", None, rewards=REWARDS, mask=MASK), "values")
    assert "critic" in str(err), str(err)


@pytest.mark.parametrize("missing", ["teacher_logprobs", "prev_logprobs"])
def test_opd_missing_logprobs(client, missing):
    tensors = {"teacher_logprobs": LOGP, "prev_logprobs": LOGP * 0.5, "mask": MASK}
    del tensors[missing]
    expect_invalid(client, lambda: client.compute("opd", None, **tensors), missing)


def test_reinforce_plus_plus_kl_without_logprobs(client):
    err = expect_invalid(client, lambda: client.compute(
        "reinforce_plus_plus", {"use_kl_in_reward": True}, prompt_ids=IDS, rewards=REWARDS, mask=MASK,
        reference_logprobs=LOGP), "logprobs")
    assert "use_kl_in_reward" in str(err)
    # the same batch without the KL path is fine
    client.compute("reinforce_plus_plus", {"use_kl_in_reward": False}, prompt_ids=IDS, rewards=REWARDS, mask=MASK)


@pytest.mark.parametrize("components", [{}, {"reward/only": REWARDS}], ids=["none", "one"])
def test_gdpo_fewer_than_two_components(client, components):
    expect_invalid(client, lambda: client.compute("gdpo", None, prompt_ids=IDS, mask=MASK, **components), "reward/")


@pytest.mark.parametrize("weights", [[1.0], [1.0, 2.0, 3.0]])
def test_gdpo_wrong_number_of_reward_weights(client, weights):
    comps = {"reward/a": REWARDS, "reward/b": REWARDS[::-1].copy()}
    err = expect_invalid(client, lambda: client.compute("gdpo", {"reward_weights": weights}, prompt_ids=IDS,
                                                        mask=MASK, **comps), "reward_weights")
    assert str(len(weights)) in str(err)


# -------------------------------------------------------------------------- tensor layout
@pytest.mark.parametrize("name,value", [
    ("rewards", np.zeros(B + 1, np.float32)),
    ("rewards", np.zeros((B, T + 1), np.float32)),  # grpo accepts [B] or [B, T] (token-level) rewards
    ("prompt_ids", np.zeros(B - 1, np.int64)),
], ids=["rewards-B+1", "rewards-2d", "prompt_ids-B-1"])
def test_shape_mismatch(client, stub, name, value):
    expect_invalid(client, raw_call(stub, grpo_request(**{name: value})), name)


def test_shape_mismatch_against_mask_in_gae(client):
    expect_invalid(client, lambda: client.compute("gae", None, rewards=REWARDS, mask=MASK,
                                                  values=np.zeros((B, T + 1), np.float32)), "values")


@pytest.mark.parametrize("delta", [-1, 1, -4 * B])
def test_byte_length_not_shape_times_itemsize(client, stub, delta):
    request = grpo_request()
    data = request.inputs["rewards"].data
    request.inputs["rewards"].data = data[:delta] if delta < 0 else data + b"\0" * delta
    err = expect_invalid(client, raw_call(stub, request), "rewards")
    assert "bytes" in str(err)


@pytest.mark.parametrize("dtype", [pb.DTYPE_UNSPECIFIED, 99], ids=["unspecified", "99"])
def test_unsupported_dtype(client, stub, dtype):
    request = grpo_request()
    request.inputs["rewards"].dtype = dtype
    expect_invalid(client, raw_call(stub, request), "rewards")


def test_negative_shape_dimension(client, stub):
    request = grpo_request()
    request.inputs["mask"].shape[:] = [-B, -T]
    err = expect_invalid(client, raw_call(stub, request), "mask")
    assert "negative" in str(err)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_inputs(client, bad):
    rewards = REWARDS.copy()
    rewards[2] = bad
    expect_invalid(client, lambda: client.compute("grpo", None, prompt_ids=IDS, rewards=rewards, mask=MASK),
                   "rewards")
    values = VALUES.copy()
    values[1, 1] = bad
    expect_invalid(client, lambda: client.compute("gae", None, rewards=REWARDS, mask=MASK, values=values), "values")


def test_empty_batch(client):
    expect_invalid(client, lambda: client.compute(
        "grpo", None, prompt_ids=np.zeros(0, np.int64), rewards=np.zeros(0, np.float32),
        mask=np.zeros((0, T), np.float32)), "mask")
    expect_invalid(client, lambda: client.compute(
        "opd", None, mask=np.zeros((B, 0), np.float32), teacher_logprobs=np.zeros((B, 0), np.float32),
        prev_logprobs=np.zeros((B, 0), np.float32)), "mask")


@pytest.mark.parametrize("bad", [2.0, 0.5, -1.0])
def test_mask_values_other_than_zero_and_one(client, bad):
    mask = MASK.copy()
    mask[0, 1] = bad
    expect_invalid(client, lambda: client.compute("raw_reward", None, rewards=REWARDS, mask=mask), "mask")
    int_mask = MASK.astype(np.int64)
    int_mask[3, 0] = 2
    expect_invalid(client, lambda: client.compute("raw_reward", None, rewards=REWARDS, mask=int_mask), "mask")


# ------------------------------------------------------------------------- request shape
def test_no_estimator_chosen(client, stub):
    request = grpo_request()
    request.ClearField("grpo")
    assert request.WhichOneof("estimator") is None
    expect_invalid(client, raw_call(stub, request), "estimator")


def test_unknown_input_name(client):
    err = expect_invalid(client, lambda: client.compute("grpo", None, prompt_ids=IDS, rewards=REWARDS, mask=MASK,
                                                        foo=REWARDS), "foo")
    assert "rewards" in str(err), "the message lists what grpo does read"


def test_input_of_another_estimator_is_unknown(client):
    expect_invalid(client, lambda: client.compute("grpo", None, prompt_ids=IDS, rewards=REWARDS, mask=MASK,
                                                  values=VALUES), "values")


def test_unsupported_output_dtype(client, stub):
    request = grpo_request()
    request.output_dtype = pb.DTYPE_INT64
    expect_invalid(client, raw_call(stub, request), "output_dtype")


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("config,field", [
    ({"gae_gamma": 1.5}, "gae_gamma"),
    ({"gae_gamma": -0.1}, "gae_gamma"),
    ({"gae_lambda": math.nan}, "gae_lambda"),
    ({"gae_lambda": math.inf}, "gae_lambda"),
    ({"gae_lambda_value": 2.0}, "gae_lambda_value"),
    ({"length_adaptive_alpha": -1.0}, "length_adaptive_alpha"),
    ({"reference_policy_kl_penalty": -0.5}, "reference_policy_kl_penalty"),
])
def test_bad_gae_config_values(client, config, field):
    expect_invalid(client, lambda: client.compute("gae", config, rewards=REWARDS, mask=MASK, values=VALUES), field)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_unknown_kl_type_enum(client, stub, estimator):
    tensors = dict(rewards=REWARDS, mask=MASK, values=VALUES) if estimator == "gae" else \
        dict(prompt_ids=IDS, rewards=REWARDS, mask=MASK)
    request = build_request(estimator, None, **tensors)
    getattr(request, estimator).reference_policy_kl_type = 99
    expect_invalid(client, raw_call(stub, request), "reference_policy_kl_type")


def test_unknown_kl_type_name_rejected_by_client_before_sending(client):
    with pytest.raises(ValueError, match="reference_policy_kl_type"):
        client.compute("gae", {"reference_policy_kl_type": "k4"}, rewards=REWARDS, mask=MASK, values=VALUES)


# ------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.bool_])
def test_integer_dtype_for_rewards_is_accepted(client, dtype):
    """Not malformed (issue 21): integer/bool rewards are the float32 values (tests/test_int_inputs.py)."""
    rewards = np.array([1, 0, 1, 1]).astype(dtype)
    got = client.compute("grpo", None, prompt_ids=IDS, rewards=rewards, mask=MASK, as_numpy=True)
    want = client.compute("grpo", None, prompt_ids=IDS, rewards=rewards.astype(np.float32), mask=MASK, as_numpy=True)
    np.testing.assert_array_equal(got.advantages, want.advantages)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_float_dtype_for_prompt_ids(client, dtype):
    err = expect_invalid(client, lambda: client.compute("grpo", None, prompt_ids=IDS.astype(dtype), rewards=REWARDS,
                                                        mask=MASK), "prompt_ids")
    assert "int" in str(err)


# ---------------------------------------------------------------------- client-side checks
class _RecordingChannel:
    """A stand-in channel that records every call the stub would send."""

    def __init__(self):
        self.calls = []

    def unary_unary(self, method, *args, **kwargs):
        def send(request, **kw):
            self.calls.append((method, request))
            raise AssertionError(f"sent {method}")
        return send

    stream_stream = unary_unary  # ComputeAdvantageStream

    def close(self):
        pass


def test_unknown_estimator_raises_value_error_before_sending():
    channel = _RecordingChannel()
    with AdvantageClient("unused:1", channel=channel) as c:
        with pytest.raises(ValueError, match="unknown estimator"):
            c.compute("ppo", None, rewards=REWARDS, mask=MASK)
    assert channel.calls == []


def test_unknown_config_key_raises_value_error_before_sending():
    channel = _RecordingChannel()
    with AdvantageClient("unused:1", channel=channel) as c:
        with pytest.raises(ValueError, match="gae_lambda"):
            c.compute("grpo", {"gae_lambda": 0.9}, prompt_ids=IDS, rewards=REWARDS, mask=MASK)
    assert channel.calls == []


# ---------------------------------------------------------------------------- raw bytes
@pytest.mark.parametrize("payload", [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f"], ids=["ff", "bad-length"])
def test_garbage_bytes_do_not_break_the_server(client, target, payload):
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/advantage.v1.AdvantageService/ComputeAdvantage",
                                   request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as exc:
            call(payload, timeout=10)
    code = exc.value.code()
    # Observed with grpcio 1.85: INTERNAL "Exception deserializing request!" -- gRPC Python answers
    # before the servicer runs, so the service cannot map it. What matters: not UNKNOWN, not OK, and
    # the server keeps serving.
    assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), (code, exc.value.details())
    assert_serves_next_request(client)


def test_empty_message_bytes_are_a_request_without_estimator(client, target):
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/advantage.v1.AdvantageService/ComputeAdvantage",
                                   request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as exc:
            call(b"", timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "estimator" in exc.value.details()
    assert_serves_next_request(client)


def test_a_nan_reward_names_its_entry_and_how_many(client):
    """Issue #37 item 6: a NaN reward's message named the input but neither which entry nor how many."""
    import grpc
    import numpy as np

    from advantage_client import AdvantageServiceError

    rewards = np.array([1.0, np.nan, 0.5, np.inf], np.float32)
    with pytest.raises(AdvantageServiceError) as err:
        client.compute("grpo", None, prompt_ids=np.array([0, 0, 1, 1]), rewards=rewards,
                       mask=np.ones((4, 3), np.float32))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "contains NaN or infinity (2 of 4 values, the first at [1]: nan)" in str(err.value), str(err.value)
