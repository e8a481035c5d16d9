"""The estimator registry: every estimator registers its name, typed config, inputs and kernel here.

An estimator module does::

    @dataclass(frozen=True)
    class GRPOConfig(EstimatorConfig):
        normalize_rewards: bool = field(default=True, metadata={"doc": "..."})

    @register("grpo", config=GRPOConfig, inputs=[InputSpec("rewards", ("[B]",), "float", ...)], ...)
    def grpo(cfg: GRPOConfig, batch: Batch) -> AdvantageResult: ...

The core looks an estimator up by name, validates the request against its ``InputSpec``s, builds the
config from the typed proto message and calls the function: no per-estimator code outside the
estimator's own module. ``ListEstimators`` is generated from the same records, and a test checks that
each estimator reads exactly the inputs it declares.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from advantage_server.errors import InvalidInput


@dataclass
class AdvantageResult:
    """What every estimator returns.

    advantages: ``[B, T]`` tensor, always.
    returns:    ``[B, T]`` tensor for estimators that produce value targets (GAE), else ``None``.
    metrics:    scalar diagnostics (OPD reports three), else empty.
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EstimatorConfig:
    """Base of the typed estimator configs. Field ``metadata["doc"]`` documents each field."""

    def validate(self) -> None:
        """Raise :class:`InvalidInput` naming ``config.<field>`` for out-of-range values."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidInput(f"config.{f.name}", f"must be finite, got {value}")
            lo, hi = f.metadata.get("range", (None, None))
            if value is None or isinstance(value, (bool, str, tuple)):
                continue
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise InvalidInput(f"config.{f.name}", f"must be in [{lo}, {hi}], got {value}")


@dataclass(frozen=True)
class InputSpec:
    """One input tensor an estimator reads.

    name:          key in ``ComputeAdvantageRequest.inputs``; ``"reward/<name>"`` is a prefix pattern.
    shapes:        accepted symbolic shapes; ``B`` and ``T`` are bound by ``mask``, other letters are free.
    kind:          ``"float"``, ``"integer"`` or ``"mask"``.
    required:      always required.
    required_when: ``(predicate(cfg), text)``: required only when the predicate holds.
    fix:           what the user should do when it is missing (shown in the error).
    """

    name: str
    shapes: tuple[str, ...]
    kind: str
    description: str
    required: bool = True
    required_when: tuple[Callable[[Any], bool], str] | None = None
    fix: str = ""

    @property
    def is_pattern(self) -> bool:
        return self.name.endswith("<name>")

    @property
    def prefix(self) -> str:
        return self.name[: -len("<name>")]

    def matches(self, key: str) -> bool:
        return key.startswith(self.prefix) and len(key) > len(self.prefix) if self.is_pattern else key == self.name

    def needed(self, cfg: Any) -> bool:
        return self.required or (self.required_when is not None and self.required_when[0](cfg))


class Batch:
    """Validated input tensors on the compute device, by name. Records which names were read.

    ``mask`` is ``[B, T]`` in the compute dtype (0.0/1.0); float inputs are in the compute dtype;
    ``prompt_ids`` has been reduced to ``[B]`` int64 group ids ``0..G-1``.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = dict(tensors)
        self.read: set[str] = set()
        mask = self._tensors["mask"]
        self.B, self.T = mask.shape

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self._tensors[name]  # presence of needed inputs is checked before the estimator runs

    def get(self, name: str) -> torch.Tensor | None:
        self.read.add(name)
        return self._tensors.get(name)

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """Inputs whose name starts with ``prefix``, in sorted (code point) order of their names."""
        keys = sorted(k for k in self._tensors if k.startswith(prefix))
        self.read.update(keys)
        return {k: self._tensors[k] for k in keys}


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable[[Any, Batch], AdvantageResult]
    config: type
    inputs: tuple[InputSpec, ...]
    description: str
    reference: str
    produces_returns: bool
    metrics: tuple[str, ...]


REGISTRY: dict[str, EstimatorSpec] = {}


def register(
    name: str,
    *,
    config: type,
    inputs: list[InputSpec],
    reference: str,
    produces_returns: bool = False,
    metrics: tuple[str, ...] = (),
) -> Callable:
    """Register an estimator function under ``name``. Registering a name twice is a ``ValueError``."""

    def deco(fn: Callable[[Any, Batch], AdvantageResult]) -> Callable:
        if name in REGISTRY:
            raise ValueError(f"estimator {name!r} is already registered by {REGISTRY[name].fn.__module__}")
        if not any(i.name == "mask" for i in inputs):
            raise ValueError(f"estimator {name!r} must declare `mask`: it defines B and T")
        REGISTRY[name] = EstimatorSpec(
            name=name,
            fn=fn,
            config=config,
            inputs=tuple(inputs),
            description=(fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
            reference=reference,
            produces_returns=produces_returns,
            metrics=tuple(metrics),
        )
        return fn

    return deco
