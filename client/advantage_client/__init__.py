"""advantage_client: generated ``advantage.v1`` stubs plus a Python client for the advantage service.

    from advantage_client import AdvantageClient
    with AdvantageClient("localhost:50051") as client:
        result = client.compute("grpo", {"normalize_rewards": True}, prompt_ids=ids, rewards=r, mask=m)

    async with AsyncAdvantageClient("localhost:50051") as client:   # asyncio (grpc.aio)
        result = await client.compute("grpo", None, prompt_ids=ids, rewards=r, mask=m)

Typed configs are the generated messages: ``GRPOConfig``, ``GDPOConfig``, ``ReinforcePlusPlusConfig``,
``RawRewardConfig``, ``GAEConfig``, ``OPDConfig``, ``GRPOPassKConfig``, ``ReinforcePlusPlusBaselineConfig``,
``RLOOConfig``, ``OPOConfig``, ``ReMaxConfig``, ``GPGConfig``, ``OptimalTokenBaselineConfig``,
``TIROptimalTokenBaselineConfig`` (enums ``Semantics``, ``ScaleRewards``, ``KLType``; a config dict takes
their short names: ``{"semantics": "verl"}``). Needs grpcio, protobuf and numpy; torch is optional.
"""
from advantage_client._proto.advantage.v1.advantage_pb2 import (
    GAEConfig,
    GDPOConfig,
    GPGConfig,
    GRPOConfig,
    GRPOPassKConfig,
    KLType,
    OPDConfig,
    OPOConfig,
    OptimalTokenBaselineConfig,
    RawRewardConfig,
    ReinforcePlusPlusBaselineConfig,
    ReinforcePlusPlusConfig,
    ReMaxConfig,
    RLOOConfig,
    ScaleRewards,
    Semantics,
    TIROptimalTokenBaselineConfig,
)
from advantage_client.aio import AsyncAdvantageClient, EventLoopError
from advantage_client.channel import PlaintextTokenWarning, TargetError
from advantage_client.client import AdvantageClient, AdvantageResult, AdvantageServiceError, InvalidArgumentError
from advantage_client.nemo import RemoteAdvantageEstimator
from advantage_client.wire import WireError

__all__ = [
    "AdvantageClient", "AsyncAdvantageClient", "AdvantageResult", "AdvantageServiceError", "InvalidArgumentError", "RemoteAdvantageEstimator",
    "WireError", "TargetError", "EventLoopError", "PlaintextTokenWarning",
    "GRPOConfig", "GDPOConfig", "ReinforcePlusPlusConfig", "RawRewardConfig", "GAEConfig", "OPDConfig",
    "GRPOPassKConfig", "ReinforcePlusPlusBaselineConfig", "RLOOConfig", "OPOConfig", "ReMaxConfig", "GPGConfig",
    "OptimalTokenBaselineConfig", "TIROptimalTokenBaselineConfig", "Semantics", "ScaleRewards", "KLType",
]
