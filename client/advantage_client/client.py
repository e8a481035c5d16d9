"""The Python client: call the advantage service as if the estimator ran in-process.

    from advantage_client import AdvantageClient

    with AdvantageClient("localhost:50051", timeout=30.0) as client:
        result = client.compute("gae", {"gae_gamma": 0.99, "gae_lambda": 0.95},
                                rewards=rewards, mask=mask, values=values)
        result.advantages, result.returns, result.metrics

Tensors go in as ``torch.Tensor`` or ``numpy.ndarray`` and come back as ``torch.Tensor`` when torch is
installed (``numpy.ndarray`` otherwise). Every server error is raised as :class:`AdvantageServiceError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from grpc_status import rpc_status

from advantage_client import wire
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc

try:
    from google.rpc import error_details_pb2
except ImportError:  # pragma: no cover
    error_details_pb2 = None


class AdvantageServiceError(Exception):
    """A call to the service failed.

    code:             the ``grpc.StatusCode`` (INVALID_ARGUMENT for bad input, UNAVAILABLE when no server
                      answers, DEADLINE_EXCEEDED after ``timeout``, ...).
    field_violations: ``[(field, description), ...]`` from the ``google.rpc.BadRequest`` detail, if any.
    ``str(error)`` is the server's message.
    """

    def __init__(self, code: grpc.StatusCode, message: str, field_violations: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.code = code
        self.field_violations = field_violations or []

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> "AdvantageServiceError":
        violations = []
        status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
        if status is not None and error_details_pb2 is not None:
            for detail in status.details:
                bad = error_details_pb2.BadRequest()
                if detail.Unpack(bad):
                    violations += [(v.field, v.description) for v in bad.field_violations]
        return cls(err.code(), err.details() or "", violations)


@dataclass
class AdvantageResult:
    """What every estimator returns (NeMo RL's result type).

    advantages: ``[B, T]``; returns: ``[B, T]`` for GAE, else ``None``; metrics: OPD's three, else ``{}``.
    """

    advantages: Any
    returns: Any = None
    metrics: dict[str, float] = field(default_factory=dict)


def decode_result(msg: pb.AdvantageResult, as_numpy: bool = False) -> AdvantageResult:
    """``advantage.v1.AdvantageResult`` -> :class:`AdvantageResult` of torch tensors (numpy if asked or no torch)."""
    decode = wire.decode_numpy if (as_numpy or wire.torch is None) else wire.decode_torch
    returns = decode(msg.returns, "returns") if msg.HasField("returns") else None
    return AdvantageResult(decode(msg.advantages, "advantages"), returns, dict(msg.metrics))


def reduce_prompt_ids(prompt_ids: Any) -> np.ndarray:
    """``[B, L]`` prompt token rows -> ``[B]`` int64 group ids (equal rows share an id); ``[B]`` passes through."""
    arr = prompt_ids.detach().cpu().numpy() if hasattr(prompt_ids, "detach") else np.asarray(prompt_ids)
    if arr.ndim == 2:
        return np.unique(arr, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return arr


def build_request(estimator: str, config: Any = None, output_dtype: Any = None, **tensors: Any
                  ) -> pb.ComputeAdvantageRequest:
    """Encode one call. ``prompt_ids`` given as ``[B, L]`` rows is reduced to ``[B]`` ids first."""
    request = pb.ComputeAdvantageRequest()
    field_name, _ = wire.ESTIMATOR_FIELDS.get(estimator, (None, None))
    cfg = wire.config_message(estimator, config)
    getattr(request, field_name).CopyFrom(cfg)
    if output_dtype is not None:
        request.output_dtype = wire.dtype_code(output_dtype)
    for name, value in tensors.items():
        if value is None:
            continue
        if name == "prompt_ids":
            value = reduce_prompt_ids(value)
        request.inputs[name].CopyFrom(wire.encode_tensor(value, f"inputs[{name!r}]"))
    return request


class AdvantageClient:
    """Connection to one advantage server. Thread-safe; use as a context manager or call :meth:`close`.

    target:  ``"host:port"`` (any gRPC target string).
    timeout: deadline per call in seconds (None = no deadline).
    max_message_mb: largest request/response this client sends or accepts.
    """

    def __init__(self, target: str, timeout: float | None = 60.0, *, max_message_mb: int = 1024,
                 channel: grpc.Channel | None = None):
        limit = max_message_mb * 1024 * 1024
        self.target = target
        self.timeout = timeout
        self._channel = channel or grpc.insecure_channel(
            target, options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])
        self._stub = pb_grpc.AdvantageServiceStub(self._channel)

    def compute(self, estimator: str, config: Any = None, *, output_dtype: Any = None, as_numpy: bool = False,
                **tensors: Any) -> AdvantageResult:
        """Run ``estimator`` (grpo, gdpo, reinforce_plus_plus, raw_reward, gae, opd) on the given tensors.

        config: None (defaults), a dict with NeMo RL key names, or the typed config message
                (``advantage_client.GAEConfig(...)``).
        tensors: the estimator's inputs by name (see :meth:`list_estimators`); GDPO components as
                ``**{"reward/correctness": ..., "reward/format": ...}``. ``None`` values are skipped.
        output_dtype: "float32" (default), "float64", "bfloat16" or "float16".
        Raises ``wire.WireError`` (a ValueError) for arguments that cannot be encoded, and
        :class:`AdvantageServiceError` for every error the server reports.
        """
        request = build_request(estimator, config, output_dtype, **tensors)
        try:
            reply = self._stub.ComputeAdvantage(request, timeout=self.timeout)
        except grpc.RpcError as err:
            raise AdvantageServiceError.from_rpc_error(err) from None
        return decode_result(reply, as_numpy=as_numpy)

    def list_estimators(self) -> pb.ListEstimatorsResponse:
        """Every estimator the server runs, with its config fields and inputs (the service contract)."""
        try:
            return self._stub.ListEstimators(pb.ListEstimatorsRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            raise AdvantageServiceError.from_rpc_error(err) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel is connected; raises AdvantageServiceError(UNAVAILABLE) after ``timeout``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise AdvantageServiceError(grpc.StatusCode.UNAVAILABLE, f"no server answered at {self.target} "
                                                                     f"within {timeout}s") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "AdvantageClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
