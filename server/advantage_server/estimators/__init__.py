"""The estimators. Importing this package registers every estimator in :data:`REGISTRY`.

One module per estimator: its math (docstring), typed config, declared inputs and kernel.
"""
from advantage_server.estimators import (  # noqa: F401
    areal, gae, gdpo, gigpo, gpg, grpo, grpo_passk, maxrl, opd, opo, optimal_token_baseline, pkpo, qae, raw_reward,
    reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo, tir_optimal_token_baseline,
)
from advantage_server.estimators.registry import REGISTRY, AdvantageResult, Batch, EstimatorSpec, InputSpec

__all__ = ["REGISTRY", "AdvantageResult", "Batch", "EstimatorSpec", "InputSpec"]
