"""Errors a Python trainer already catches: INVALID_ARGUMENT from the service is an AdvantageServiceError and a
ValueError (advantage_client.InvalidArgumentError) on every transport, through failover, and through the NeMo RL
drop-in, as NeMo RL's own estimator tests expect (tests/unit/algorithms/test_grpo.py,
test_gdpo_advantage_estimator_single_reward: GDPO with one reward component raises ValueError). Every other
status stays a plain AdvantageServiceError; client-side argument errors (WireError) were ValueErrors already."""
from __future__ import annotations

import grpc
import pytest
import torch

from advantage_client import (AdvantageClient, AdvantageServiceError, InvalidArgumentError, RemoteAdvantageEstimator,
                              WireError)

# NeMo RL's test input: two samples of one prompt, one reward component
PROMPT_IDS = torch.tensor([[0], [0]])
MASK = torch.ones(2, 3)
ONE_COMPONENT = {"reward/correctness": torch.tensor([1.0, 3.0])}


def assert_invalid_argument(err: BaseException) -> None:
    assert isinstance(err, ValueError) and isinstance(err, AdvantageServiceError)
    assert type(err) is InvalidArgumentError
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "reward" in str(err)  # the server's message names what is wrong


@pytest.mark.parametrize("transport", ["unary", "stream", "shm", "auto"])
def test_gdpo_with_one_component_is_a_value_error_on_every_transport(transport, target):
    with AdvantageClient(target, timeout=30.0, transport=transport, chunk_mb=1) as client:
        with pytest.raises(ValueError) as exc:
            client.compute("gdpo", {"normalize_rewards": True}, prompt_ids=PROMPT_IDS, mask=MASK, **ONE_COMPONENT)
        assert_invalid_argument(exc.value)
        if transport != "auto":
            assert client.last_transport == transport
        # the client still works after the error
        ok = client.compute("gdpo", None, prompt_ids=PROMPT_IDS, mask=MASK,
                            **ONE_COMPONENT, **{"reward/format": torch.tensor([0.0, 1.0])})
        assert ok.advantages.shape == (2, 3)


def test_shared_memory_region_call_is_a_value_error(target):
    with AdvantageClient(target, timeout=30.0) as client, client.shared_memory(1 << 20) as region:
        with pytest.raises(ValueError) as exc:
            region.compute("gdpo", None, prompt_ids=PROMPT_IDS, mask=MASK, **ONE_COMPONENT)
        assert_invalid_argument(exc.value)
        assert not region.abandoned  # an answered call: the region stays usable


def test_failover_client_raises_the_value_error_not_unavailable(target):
    """Two replicas, one down: UNAVAILABLE is retried on the live one, whose INVALID_ARGUMENT comes back."""
    with AdvantageClient([target, "127.0.0.1:1"], timeout=30.0) as client:
        for _ in range(3):
            with pytest.raises(ValueError) as exc:
                client.compute("gdpo", None, prompt_ids=PROMPT_IDS, mask=MASK, **ONE_COMPONENT)
            assert_invalid_argument(exc.value)


@pytest.mark.parametrize("result_format", ["legacy", "advantage_result"])
def test_nemo_rl_dropin_raises_value_error_like_nemo_rl(result_format, target):
    estimator = RemoteAdvantageEstimator(target, "gdpo", {"use_leave_one_out_baseline": False,
                                                          "normalize_rewards": True}, result_format=result_format)
    with pytest.raises(ValueError) as exc:
        estimator.compute_advantage(PROMPT_IDS, None, MASK, ONE_COMPONENT)
    assert_invalid_argument(exc.value)


def test_other_codes_are_not_value_errors():
    with AdvantageClient("127.0.0.1:1", timeout=5.0, retry=False) as client:
        with pytest.raises(AdvantageServiceError) as exc:
            client.compute("grpo", None, prompt_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]),
                           mask=MASK)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    assert not isinstance(exc.value, ValueError) and type(exc.value) is AdvantageServiceError
    err = AdvantageServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too big")
    assert type(err) is AdvantageServiceError and not isinstance(err, ValueError)


def test_constructed_and_converted_errors_pick_the_type_by_code():
    err = AdvantageServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad mask", [("inputs['mask']", "not 0/1")])
    assert type(err) is InvalidArgumentError and isinstance(err, ValueError)
    assert (err.code, str(err), err.field_violations) == (grpc.StatusCode.INVALID_ARGUMENT, "bad mask",
                                                          [("inputs['mask']", "not 0/1")])

    class FakeRpcError(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "message"
    assert type(AdvantageServiceError.from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT))) is \
        InvalidArgumentError
    # the subclass's from_rpc_error does not force its own type onto another code
    other = InvalidArgumentError.from_rpc_error(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert type(other) is AdvantageServiceError and other.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_client_side_argument_errors_are_value_errors(client):
    with pytest.raises(ValueError) as exc:
        client.compute("grpo", {"no_such_field": 1}, prompt_ids=torch.tensor([0]), rewards=torch.tensor([1.0]),
                       mask=torch.ones(1, 2))
    assert isinstance(exc.value, WireError) and not isinstance(exc.value, AdvantageServiceError)
    with pytest.raises(ValueError):
        client.compute("grpo", None, output_dtype="int8", prompt_ids=torch.tensor([0]), rewards=torch.tensor([1.0]),
                       mask=torch.ones(1, 2))


def test_verl_dropin_raises_value_error(client):
    """verl's estimators raise ValueError/AssertionError on bad input; through the verl drop-in the service's
    INVALID_ARGUMENT (here a response mask holding 2) is a ValueError too."""
    from advantage_client.verl import get_adv_estimator_fn
    fn = get_adv_estimator_fn("grpo", target=client)
    with pytest.raises(ValueError) as exc:
        fn(token_level_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]]), response_mask=torch.tensor([[1.0, 2.0],
                                                                                                  [1.0, 1.0]]),
           index=["a", "a"])
    assert type(exc.value) is InvalidArgumentError and exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_errors_survive_pickling():
    """Raised in another process (a Ray worker), the error arrives with its type, code and violations."""
    import pickle
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE):
        err = pickle.loads(pickle.dumps(AdvantageServiceError(code, "msg", [("f", "d")])))
        assert type(err) is (InvalidArgumentError if code == grpc.StatusCode.INVALID_ARGUMENT else AdvantageServiceError)
        assert (err.code, str(err), err.field_violations) == (code, "msg", [("f", "d")])


def test_a_file_path_given_as_the_token_names_token_file(tmp_path):
    """Issue #37 item 6: a token file's path given as ``token=`` reached the server as the token and came back as
    "missing or wrong bearer token" with no hint. The client now refuses it at once, naming ``token_file=``; a
    token that merely contains a slash but names no file is sent as given."""
    from advantage_client import AdvantageClient

    path = tmp_path / "token"
    path.write_text("s3cret\n")
    with pytest.raises(ValueError) as err:
        AdvantageClient("localhost:50051", token=str(path))
    assert f"token_file={str(path)!r}" in str(err.value) and "s3cret" not in str(err.value)
    from advantage_client.channel import auth_metadata
    assert auth_metadata(token="a/b-not-a-file") == (("authorization", "Bearer a/b-not-a-file"),)
    assert auth_metadata(token_file=path) == (("authorization", "Bearer s3cret"),)


def test_a_private_key_given_as_tls_ca_is_refused_before_grpc_sees_it(tmp_path):
    """Issue #37 item 6: a private key given as ``tls_ca`` printed 8 lines of gRPC core errors before the refusal.
    The client now refuses it itself, naming the option and what belongs there, and never echoes the key."""
    from advantage_client import AdvantageClient

    key = tmp_path / "client.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ValueError) as err:
        AdvantageClient("localhost:50051", tls_ca=str(key))
    assert "tls_ca" in str(err.value) and "a private key, not a certificate" in str(err.value)
    assert "MIIEvQ" not in str(err.value)
    cert = tmp_path / "client.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="tls_key: .* holds no private key"):
        AdvantageClient("localhost:50051", tls_ca=str(cert), tls_cert=str(cert), tls_key=str(cert))
