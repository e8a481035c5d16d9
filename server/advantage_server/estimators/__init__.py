"""The estimators. Importing this package registers every estimator in :data:`REGISTRY`.

One module per estimator: its math (docstring), typed config, declared inputs and kernel.
"""
from advantage_server.estimators import gae, gdpo, grpo, opd, raw_reward, reinforce_plus_plus  # noqa: F401
from advantage_server.estimators.registry import REGISTRY, AdvantageResult, Batch, EstimatorSpec, InputSpec

__all__ = ["REGISTRY", "AdvantageResult", "Batch", "EstimatorSpec", "InputSpec"]
