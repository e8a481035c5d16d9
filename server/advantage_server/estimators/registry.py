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

# SEMANTICS: the ``Semantics`` enum's short names; REFERENCES: the release each one reproduces
from advantage_client import conditions
from advantage_client.references import REFERENCES, SEMANTICS  # noqa: F401  (re-exported)
from advantage_server.errors import InvalidInput


@dataclass
class AdvantageResult:
    """What every estimator returns.

    advantages: ``[B, T]`` tensor, always.
    returns:    ``[B, T]`` tensor where the estimator computes returns (see ``EstimatorSpec.returns_for``),
                else ``None``.
    metrics:    scalar diagnostics (OPD reports three), else empty.
    finite:     the estimator has checked every value of ``advantages`` and ``returns`` is finite (a
                kernel that does it on the way); the core then skips its own overflow check.
    layout:     0 (dense), or the ``ResultLayout`` of per-sample ``[B]`` advantages/returns standing for
                ``dense_shape`` ``(B, T)`` (set by the core for ``per_sample`` requests, never by estimators).
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    finite: bool = False
    layout: int = 0
    dense_shape: tuple[int, ...] = ()



@dataclass(frozen=True)
class EstimatorConfig:
    """Base of the typed estimator configs.

    Field metadata:

    ``doc``           what the field does (shown by ``ListEstimators``).
    ``range``         ``(lo, hi)`` inclusive bounds for a number (``None`` = unbounded).
    ``open``          ``True``: the ``range`` bounds themselves are excluded (``lo < value < hi``).
    ``choices``       allowed values of an enum field (its short names, e.g. ``("verl", "openrlhf")``).
    ``enum``          the proto enum type name of an enum field (``"Semantics"``).
    ``default_text``  the default as ``ListEstimators`` shows it, where the dataclass default is
                      ``None`` because the real default depends on ``semantics``.
    ``per_semantics`` ``{semantics: default}`` for a field whose default depends on the ``semantics``
                      field; the field does not apply under a semantics missing from the mapping, and
                      setting it there is an error.
    ``default``       for the ``semantics`` field itself: the semantics an unset field means.
    """

    def validate(self) -> None:
        """Raise :class:`InvalidInput` naming ``config.<field>`` for out-of-range values."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidInput(f"config.{f.name}", f"must be finite, got {value}")
            choices = f.metadata.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise InvalidInput(f"config.{f.name}", f"{value!r} is not offered by this estimator "
                                                       f"({type(self).__name__}); use "
                                                       f"{' or '.join(map(str, choices))}")
            lo, hi = f.metadata.get("range", (None, None))
            if value is None or isinstance(value, (bool, str, tuple)):
                continue
            if f.metadata.get("open"):
                if (lo is not None and value <= lo) or (hi is not None and value >= hi):
                    raise InvalidInput(f"config.{f.name}", f"must be in the open interval ({lo}, {hi}) (the "
                                                           f"bounds excluded), got {value}")
            elif (lo is not None and value < lo) or (hi is not None and value > hi):
                bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
                raise InvalidInput(f"config.{f.name}", f"must be {bounds}, got {value}")

    def resolved(self) -> "EstimatorConfig":
        """This config with its ``semantics`` and the semantics-dependent defaults filled in.

        Raises :class:`InvalidInput` naming ``config.<field>`` for a field that was set although it
        does not apply under the chosen semantics (``use_leave_one_out_baseline`` with verl, ...).
        Configs without a ``semantics`` field come back unchanged.
        """
        fields = {f.name: f for f in dataclasses.fields(self)}
        if "semantics" not in fields:
            return self
        changes: dict[str, Any] = {}
        semantics = self.semantics if self.semantics is not None else fields["semantics"].metadata["default"]
        if self.semantics is None:
            changes["semantics"] = semantics
        for f in fields.values():
            per = f.metadata.get("per_semantics")
            if per is None:
                continue
            value = getattr(self, f.name)
            if semantics not in per:
                if value is not None:
                    raise InvalidInput(f"config.{f.name}",
                                       f"does not apply with semantics = {semantics}; it applies with "
                                       f"{' or '.join(per)}. Leave it unset, or choose another semantics")
            elif value is None:
                changes[f.name] = per[semantics]
        return dataclasses.replace(self, **changes) if changes else self


def semantics_field(choices: tuple[str, ...], doc: str) -> Any:
    """The ``semantics`` field of a config: ``choices[0]`` is the default (an unset field).

    Its ``doc`` ends with the release each choice reproduces, from :data:`REFERENCES`.
    """
    assert all(c in SEMANTICS for c in choices), choices
    releases = "; ".join(f"{c} = {REFERENCES[c].label}" for c in choices)
    return field(default=None, metadata={
        "doc": f"{doc} Releases: {releases}.", "choices": choices, "enum": "Semantics", "default": choices[0], "default_text": choices[0]})


@dataclass(frozen=True)
class InputSpec:
    """One input tensor an estimator reads.

    name:          key in ``ComputeAdvantageRequest.inputs``; ``"reward/<name>"`` is a prefix pattern.
    shapes:        accepted symbolic shapes; ``B`` and ``T`` are bound by ``mask``, other letters are free.
    kind:          ``"float"``, ``"integer"`` or ``"mask"``.
    required:      always required.
    required_when: ``(predicate(cfg), text)``: required only when the predicate holds.
    fix:           what the user should do when it is missing (shown in the error).
    nan_allowed_when: ``(predicate(cfg), text)``: NaN values are accepted (they mean "no value for this
                   sample") when the predicate holds; infinity is still rejected. Otherwise every value
                   must be finite.
    inf_allowed_when: ``(predicate(cfg) -> (+inf accepted, -inf accepted), text)``: infinities the estimator
                   clamps to a finite bound (TRL's ``reward_clip_range``) are accepted on the sides the predicate
                   names; any other infinity is rejected.
    """

    name: str
    shapes: tuple[str, ...]
    kind: str
    description: str
    required: bool = True
    required_when: tuple[Callable[[Any], bool], str] | None = None
    fix: str = ""
    nan_allowed_when: tuple[Callable[[Any], bool], str] | None = None
    inf_allowed_when: tuple[Callable[[Any], tuple[bool, bool]], str] | None = None

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


#: ``provider(name, shape, dtype, device)`` -> a writable contiguous tensor of that shape, dtype and device
#: to write the result ``name`` into, or None (then the estimator allocates its own)
OutputProvider = Callable[[str, tuple, torch.dtype, torch.device], "torch.Tensor | None"]


class Batch:
    """Validated input tensors on the compute device, by name. Records which names were read.

    ``mask`` is ``[B, T]`` in the compute dtype (0.0/1.0); float inputs are in the compute dtype;
    ``prompt_ids`` has been reduced to ``[B]`` int64 group ids ``0..G-1``.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], output_provider: OutputProvider | None = None):
        self._tensors = dict(tensors)
        self.read: set[str] = set()
        mask = self._tensors["mask"]
        self.B, self.T = mask.shape
        #: where :meth:`output` takes result memory from first (None: ``torch.empty``); settable
        self.output_provider = output_provider
        #: outputs handed out by the caller's provider, by name (see :meth:`output`)
        self.provided: dict[str, torch.Tensor] = {}
        #: ``[B]`` int64 (CPU) row lengths of a packed request (the ``cu_seqlens`` differences), set by the core;
        #: None for a dense request, whose rows span all T columns. An estimator whose reference places something
        #: at the end of the response, whatever its loss mask says there (slime's ``ppo``), reads it.
        self.row_lengths: torch.Tensor | None = None

    def output(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised ``[B, T]`` tensor of ``dtype`` on the mask's device for the result ``name``
        (``"advantages"`` or ``"returns"``), for an estimator that writes its result densely.

        When the caller passed an output provider (the shared-memory transport: the response room of
        the client's region) and it has room for it, the tensor is the caller's memory and the result
        needs no copy afterwards; otherwise it is a fresh ``torch.empty``. Ask once per name.
        """
        mask = self._tensors["mask"]  # not self.B/T: asking for memory is not reading an input
        shape, device = tuple(mask.shape), mask.device
        if self.output_provider is not None and name not in self.provided:
            t = self.output_provider(name, shape, dtype, device)
            if t is not None:
                if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
                    raise RuntimeError(f"output provider returned {tuple(t.shape)} {t.dtype} on {t.device} "
                                       f"for {name}, wanted contiguous {shape} {dtype} on {device}")
                self.provided[name] = t
                return t
        return torch.empty(shape, dtype=dtype, device=device)

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
    """One registered estimator.

    produces_returns: always fills ``AdvantageResult.returns``.
    returns_when:     ``(predicate(cfg), text)`` when it fills returns only under some configs.
    """

    name: str
    fn: Callable[[Any, Batch], AdvantageResult]
    config: type
    inputs: tuple[InputSpec, ...]
    description: str
    reference: str
    produces_returns: bool
    metrics: tuple[str, ...]
    returns_when: tuple[Callable[[Any], bool], str] | None = None
    #: ``(when, layout)`` rules (see :func:`register`): where the results are one value per row
    per_sample: tuple[tuple[str, int], ...] = ()
    #: conditions (see :func:`register`) under which rows of different prompt groups do not interact
    group_local: tuple[str, ...] = ()

    def returns_for(self, cfg: Any) -> bool:
        """Whether the estimator fills ``returns`` under the (resolved) config ``cfg``."""
        return self.produces_returns or (self.returns_when is not None and bool(self.returns_when[0](cfg)))

    def per_sample_for(self, cfg: Any) -> int:
        """The ``ResultLayout`` of the first ``per_sample`` rule whose condition holds for the resolved
        config ``cfg``, or 0 (dense) when none does."""
        for when, layout in self.per_sample:
            if condition_holds(when, cfg):
                return layout
        return 0

    def group_local_for(self, cfg: Any) -> bool:
        """Whether, under the resolved config ``cfg``, every row's advantages (and returns) depend only on
        the rows of its own prompt group: then a batch of whole groups split anywhere between groups and
        computed piece by piece gives bit-identical results (what client-side coalescing relies on)."""
        return any(condition_holds(when, cfg) for when in self.group_local)


def condition_holds(when: str, cfg: Any) -> bool:
    """Whether a listing condition (:mod:`advantage_client.conditions`: ``field = value`` terms joined by
    ``and``, clauses joined by ``or``) holds for a resolved config. The text ``ListEstimators`` shows is the
    one evaluated, so the two cannot disagree. Raises ``ValueError`` for a field the config lacks."""
    def lookup(name: str) -> Any:
        if not hasattr(cfg, name):
            raise ValueError(f"condition {when!r}: {type(cfg).__name__} has no field {name!r}")
        return getattr(cfg, name)
    return conditions.holds(when, lookup)


REGISTRY: dict[str, EstimatorSpec] = {}


def register(
    name: str,
    *,
    config: type,
    inputs: list[InputSpec],
    reference: str,
    produces_returns: bool | tuple[Callable[[Any], bool], str] = False,
    metrics: tuple[str, ...] = (),
    per_sample: tuple[tuple[str, int], ...] = (),
    group_local: tuple[str, ...] = (),
) -> Callable:
    """Register an estimator function under ``name``. Registering a name twice is a ``ValueError``.

    ``produces_returns`` is ``True`` (always fills ``returns``), ``False``, or a
    ``(predicate(cfg), text)`` pair like ``InputSpec.required_when`` when it depends on the config.
    ``per_sample``: ``(when, layout)`` rules, first match wins: under a config where ``when`` holds (see
    :func:`condition_holds`; ``""`` = always) the advantages, and the returns when filled, are one value
    per row laid out as ``layout`` (an ``advantage.v1.ResultLayout``; see ``advantage_client.layout``).
    ``tests/test_per_sample.py`` checks every rule against the dense results.
    ``group_local``: conditions (same syntax; any one holding suffices; ``""`` = always) under which rows
    of different prompt groups (``prompt_ids``) do not interact: no batch-level whitening, std, scalar or
    metric, no grouping input other than ``prompt_ids``. Published as ``EstimatorInfo.group_local``; the
    asyncio client's coalescing (``AsyncAdvantageClient(coalesce_ms=...)``) merges only such calls.
    An estimator with ``metrics`` cannot declare it (its metrics are batch values; a ``ValueError``).
    ``tests/test_coalesce.py`` checks every declaration: whole groups computed apart and merged agree bit
    for bit.
    """

    def deco(fn: Callable[[Any, Batch], AdvantageResult]) -> Callable:
        if name in REGISTRY:
            raise ValueError(f"estimator {name!r} is already registered by {REGISTRY[name].fn.__module__}")
        if not any(i.name == "mask" for i in inputs):
            raise ValueError(f"estimator {name!r} must declare `mask`: it defines B and T")
        if group_local and (metrics or not any(i.name == "prompt_ids" for i in inputs)):
            raise ValueError(f"estimator {name!r}: group_local needs a prompt_ids input and no metrics "
                             "(batch metrics cannot be split per call)")
        REGISTRY[name] = EstimatorSpec(
            name=name,
            fn=fn,
            config=config,
            inputs=tuple(inputs),
            description=(fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
            reference=reference,
            produces_returns=produces_returns is True,
            metrics=tuple(metrics),
            returns_when=produces_returns if isinstance(produces_returns, tuple) else None,
            per_sample=tuple(per_sample),
            group_local=tuple(group_local),
        )
        return fn

    return deco
