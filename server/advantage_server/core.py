"""The transport-agnostic core: request in, result out, no gRPC.

``AdvantageCore.compute(request)`` takes a ``ComputeAdvantageRequest`` message and returns an
``AdvantageResult`` message; ``AdvantageCore.run(name, config, tensors)`` does the same on Python
objects. Both validate every input against the estimator's declared ``InputSpec``s before any math
runs, and raise :class:`~advantage_server.errors.InvalidInput` (one violation per bad field) for a
malformed request. The gRPC servicer (``advantage_server.server``) is a thin layer over this.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import typing
from typing import Any, Mapping

import torch

from advantage_client import layout as layout_mod
from advantage_client import wire
from advantage_client.references import REFERENCES
from advantage_client.proto import advantage_pb2 as pb
from advantage_server import validate
from advantage_server.errors import InvalidInput, ResourceLimit
from advantage_server.estimators import REGISTRY, AdvantageResult, Batch, EstimatorSpec, InputSpec
from advantage_server.estimators.registry import OutputProvider
from advantage_server.estimators.groups import group_index
from advantage_server.limits import checkpoint  # reliability hook: a cancelled/expired call stops between stages

log = logging.getLogger("advantage_server")

_FLOAT = {torch.float32, torch.float64, torch.bfloat16, torch.float16}
_INTEGER = {torch.int64, torch.int32, torch.uint8}
#: integer and bool dtypes a float input may have too (a 0/1 verifier's rewards): converted to the compute
#: dtype exactly (see prepare): float32 holds every integer up to FLOAT32_EXACT_INTEGER, float64 up to
#: FLOAT64_EXACT_INTEGER
_INT_AS_FLOAT = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
_KINDS = {"float": _FLOAT | _INT_AS_FLOAT, "integer": _INTEGER, "mask": _FLOAT | _INTEGER | {torch.bool}}
FLOAT32_EXACT_INTEGER = 2 ** 24
FLOAT64_EXACT_INTEGER = 2 ** 53
#: inputs of larger magnitude are refused (INVALID_ARGUMENT naming the input): 2^150 ~ 1.4e45. Squares
#: and products of up to six such values (2^900), summed over up to 2^100 elements, stay below float64's
#: 2^1024, so no statistic overflows to infinity (which used to turn every advantage into a silent 0).
#: Only float64 inputs can exceed it (float32 ends at 3.4e38 ~ 2^128).
MAX_INPUT_MAGNITUDE = 2.0 ** 150
#: float32 (and float16/bfloat16) inputs of larger magnitude are computed in float64 and the results cast
#: back: 2^40 ~ 1.1e12, from where a float32 sum of squares over a large batch could overflow
#: (float32 statistics of 1e19..1e20 rewards used to come out as silent zeros). Below it nothing changes.
FLOAT32_PROMOTE_MAGNITUDE = 2.0 ** 40
_OUTPUT = {pb.DTYPE_UNSPECIFIED: torch.float32, pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_FLOAT64: torch.float64,
           pb.DTYPE_BFLOAT16: torch.bfloat16, pb.DTYPE_FLOAT16: torch.float16}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's message lists its own device types (mps, xla, ...), not what the server runs on
        raise ValueError(f"--device {device!r} is not a device: choose auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible to this process")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


class AdvantageCore:
    """Runs registered estimators on ``device`` (a ``torch.device`` or string, ``"auto"`` allowed)."""

    def __init__(self, device: str | torch.device = "cpu", max_batch_elements: int | None = None):
        self.device = resolve_device(device) if isinstance(device, str) else device
        #: the server's --max-batch-elements: also bounds every size the packed layout implies (see unpack)
        self.max_batch_elements = max_batch_elements
        #: check every per-sample answer against the dense result (3 passes over [B, T]; off by default:
        #: tests/test_per_sample.py checks each estimator's declaration against its dense results instead)
        self.verify_per_sample = False

    # ------------------------------------------------------------------ entry points
    def compute(self, request: pb.ComputeAdvantageRequest) -> pb.AdvantageResult:
        """Validate and run one request. Raises ``InvalidInput`` for a malformed request."""
        result, dtype = self.compute_result(request)
        return encode_result(result, dtype, consume=True)

    def compute_result(self, request: Any, output_provider: OutputProvider | None = None,
                       max_result_bytes: int | None = None) -> tuple[AdvantageResult, torch.dtype]:
        """:meth:`compute` before encoding: the result tensors and the requested output dtype. ``request``
        is a ``ComputeAdvantageRequest`` or anything shaped like one (``codec.DecodedRequest``).
        ``output_provider``: see :meth:`run` (ignored for the packed layout, whose results are gathered).
        ``max_result_bytes``: the most result bytes one response message may carry (the unary method's
        ``--max-message-mb``); a request whose declared shapes give a larger result is refused before computing
        (``ResourceLimit``: RESOURCE_EXHAUSTED naming the flag and the streaming transport)."""
        name = request.WhichOneof("estimator")
        if name is None:
            raise InvalidInput("estimator", f"no estimator chosen: set one of {', '.join(REGISTRY)} "
                                            "in ComputeAdvantageRequest.estimator")
        if request.output_dtype not in _OUTPUT:
            got = pb.DType.Name(request.output_dtype) if request.output_dtype in pb.DType.values() \
                else str(request.output_dtype)
            raise InvalidInput("output_dtype", f"{got} is not a dtype results are returned in: set "
                                               "DTYPE_FLOAT32 (the default), DTYPE_FLOAT64, DTYPE_BFLOAT16 or "
                                               "DTYPE_FLOAT16, and cast the result for another dtype")
        violations, tensors = [], {}
        for key, msg in request.inputs.items():
            try:
                tensors[key] = wire.decode_torch(msg, f"inputs[{key!r}]")
            except wire.WireError as err:
                violations.append((err.field, err.description))
        cu_seqlens = None
        if request.HasField("cu_seqlens"):
            try:
                cu_seqlens = wire.decode_torch(request.cu_seqlens, "cu_seqlens")
            except wire.WireError as err:
                violations.append((err.field, err.description))
        if violations:
            raise InvalidInput(violations)
        checkpoint("after decoding")
        result = self.run(name, config_from_proto(REGISTRY[name], getattr(request, name)), tensors,
                          cu_seqlens=cu_seqlens, output_provider=output_provider,
                          per_sample=bool(getattr(request, "per_sample", False)),
                          mask_columns=int(getattr(request, "mask_columns", 0)),
                          keep_float64=_OUTPUT[request.output_dtype] == torch.float64,
                          max_result_bytes=max_result_bytes,
                          result_itemsize=_OUTPUT[request.output_dtype].itemsize)
        checkpoint("before encoding")
        dtype = _OUTPUT[request.output_dtype]
        result.advantages = cast_output(result.advantages, dtype, "advantages")
        if result.returns is not None:
            result.returns = cast_output(result.returns, dtype, "returns")
        return result, dtype

    def run(self, name: str, config: Any, tensors: Mapping[str, Any], cu_seqlens: Any = None,
            output_provider: OutputProvider | None = None, per_sample: bool = False,
            mask_columns: int = 0, keep_float64: bool = False, max_result_bytes: int | None = None,
            result_itemsize: int = 4) -> AdvantageResult:
        """Run estimator ``name`` in-process. ``config``: its config dataclass, a dict, or None.

        ``cu_seqlens`` ([B + 1] row offsets) selects the packed layout: token-level inputs are flat
        ``[N]`` and so are the result's advantages and returns (see :func:`unpack`).
        ``output_provider(name, shape, dtype, device)``: memory for the ``[B, T]`` results the estimator
        writes densely (:meth:`Batch.output`), or None to let it allocate; the caller compares the
        result tensors with what it handed out (not used with ``cu_seqlens``).
        ``tensors["lengths"]`` ([B] integer) may stand for ``mask``: the prefix mask ``t < lengths[b]`` of
        ``mask_columns`` columns (0: ``max(lengths)``); see :func:`lengths_to_mask`.
        ``per_sample``: where the estimator declares per-sample results for this config
        (``EstimatorSpec.per_sample_for``) and not packed, the result is ``[B]`` values with its ``layout``
        set (see :func:`to_per_sample`); otherwise dense. Raises ``InvalidInput`` for a malformed request.
        ``keep_float64``: results computed in float64 for inputs that are not float64 (integers beyond 2^24,
        huge float32 values: see :meth:`prepare`) stay float64 instead of being rounded to float32 here (the
        caller asked for ``output_dtype=float64``: rounding them first would lose the exactness it asked for).
        ``max_result_bytes``: refuse (``ResourceLimit``) before computing when the result, ``result_itemsize``
        bytes per value, would be larger (:func:`check_result_size`).
        """
        spec = REGISTRY.get(name)
        if spec is None:
            raise InvalidInput("estimator", wire.unknown_estimator(
                name, [n for n in REGISTRY if not n.startswith("_")]))
        if not isinstance(config, spec.config):
            config = config_from_dict(spec, config or {})
        config.validate()
        config = config.resolved()  # semantics-dependent defaults; rejects fields the semantics does not use
        layout = None
        if "lengths" in tensors or mask_columns:
            if cu_seqlens is not None:
                raise InvalidInput("inputs['lengths']", "does not go with cu_seqlens: the packed layout's row "
                                                        "lengths are cu_seqlens; send a flat [N] mask or none")
            tensors = lengths_to_mask(tensors, mask_columns, self.max_batch_elements)
        if cu_seqlens is not None:
            tensors, layout = unpack(spec, cu_seqlens, tensors, max_elements=self.max_batch_elements)
        batch = Batch(self.prepare(spec, config, tensors))
        if layout is not None:
            batch.row_lengths = layout.lengths
        if max_result_bytes is not None:
            check_result_size(spec, config, tuple(batch._tensors["mask"].shape), layout, per_sample,
                              result_itemsize, max_result_bytes)
        if layout is None:  # packed results are gathered from the padded ones: nothing to write in place
            batch.output_provider = output_provider
        checkpoint("before computing")
        result = spec.fn(config, batch)
        if not keep_float64 and batch._tensors["mask"].dtype == torch.float64 and not any(
                torch.as_tensor(t).dtype == torch.float64 for t in tensors.values()):
            # float32 inputs of huge magnitude computed in float64 (prepare): results in the callers' dtype
            result.advantages = validate.cast(result.advantages, torch.float32)
            if result.returns is not None:
                result.returns = validate.cast(result.returns, torch.float32)
            result.finite = False  # the narrowing may overflow: checked below
        if (result.returns is not None) != spec.returns_for(config):
            raise RuntimeError(f"{name} {'set' if result.returns is not None else 'did not set'} returns, "
                               "contrary to its registration")
        if layout is not None:
            result = layout.repack(result)
        elif per_sample and spec.per_sample:
            rule = spec.per_sample_for(config)
            if rule:
                result = to_per_sample(result, rule, batch._tensors["mask"], name, self.verify_per_sample)
        for label, t in (("advantages", result.advantages), ("returns", result.returns)):
            if t is not None and not result.finite and not validate.all_finite(t):
                # every input is finite (checked above): only magnitudes near the dtype's limit get here
                raise InvalidInput(_largest_input(batch), f"{name} overflowed {str(t.dtype).replace('torch.', '')} arithmetic "
                                             f"computing {label}: input magnitudes are too large; rescale the "
                                             "rewards/values or send float64 inputs")
        return result

    # ------------------------------------------------------------------ validation
    def prepare(self, spec: EstimatorSpec, cfg: Any, raw: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Check every input against ``spec`` and move it to the compute device and dtype.

        Collects all violations and raises them together as one ``InvalidInput``. The compute dtype is
        float64 when any input is float64, or when a float input holds a magnitude beyond
        :data:`FLOAT32_PROMOTE_MAGNITUDE` (:meth:`run` casts such results back to float32); else float32.
        A float input beyond :data:`MAX_INPUT_MAGNITUDE` is a violation naming it. A float input may also be
        integer or bool (``_INT_AS_FLOAT``): converted exactly, in float32 up to :data:`FLOAT32_EXACT_INTEGER`
        (2^24), in float64 beyond (results cast back to float32 as above); beyond
        :data:`FLOAT64_EXACT_INTEGER` (2^53) a violation naming it.
        """
        tensors = {k: torch.as_tensor(v) for k, v in raw.items()}
        owners: dict[str, InputSpec] = {}
        violations: list[tuple[str, str]] = []
        for key in tensors:
            owner = next((s for s in spec.inputs if s.matches(key)), None)
            if owner is None:
                violations.append((f"inputs[{key!r}]", f"{spec.name} does not read {key!r}; it reads "
                                   f"{', '.join(s.name for s in spec.inputs)}"))
            else:
                owners[key] = owner
        for s in spec.inputs:
            if s.needed(cfg) and not any(s.matches(k) for k in tensors):
                when = f" (required when {s.required_when[1]})" if s.required_when else ""
                violations.append((f"inputs[{s.name!r}]", f"{spec.name} needs `{s.name}` {s.shapes[0]}{when}: {s.fix}"))
        if violations:
            raise InvalidInput(violations)

        mask = tensors["mask"]
        if mask.dim() != 2 or 0 in mask.shape:
            why = ("an empty batch has nothing to compute" if mask.dim() == 2
                   else "send the token mask as a 2-D [B, T] tensor")
            raise InvalidInput("inputs['mask']", f"must be a non-empty [B, T] tensor, got shape {list(mask.shape)}: {why}")
        dims = {"B": mask.shape[0], "T": mask.shape[1]}
        for key, t in tensors.items():
            violations += _check(key, t, owners[key], dims, cfg)
            checkpoint("while checking the inputs")  # each check is a pass over the tensor (~0.1 s at 2**27)
        if violations:
            raise InvalidInput(violations)

        compute_dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors.values()) else torch.float32
        for key, t in tensors.items():  # huge but finite values (issue 11 item 7): refuse, or compute in float64
            if owners[key].kind != "float":
                continue
            if not t.is_floating_point():  # integers/bools (issue 21): exact in float32 up to 2^24, float64 2^53
                biggest = validate.max_abs_int_over(t, FLOAT32_EXACT_INTEGER)
                checkpoint("while checking the inputs")
                if biggest is not None and biggest > FLOAT64_EXACT_INTEGER:
                    violations.append((f"inputs[{key!r}]", f"holds an integer of magnitude {biggest}, beyond "
                                       f"2^53 = {FLOAT64_EXACT_INTEGER}: integer inputs are computed as floats, and "
                                       "float64 holds integers exactly only up to 2^53. Rescale the input, or send "
                                       "it as float64 if rounding it is acceptable"))
                if biggest is not None:
                    compute_dtype = torch.float64
                continue
            biggest = validate.max_abs_over(t, FLOAT32_PROMOTE_MAGNITUDE)
            if biggest is not None and math.isinf(biggest) and _clamped_infinities(t, owners[key], cfg):
                biggest = validate.max_abs_over(t[torch.isfinite(t)], FLOAT32_PROMOTE_MAGNITUDE)  # checked above
            checkpoint("while checking the inputs")
            if biggest is None:
                continue
            if biggest > MAX_INPUT_MAGNITUDE:
                violations.append((f"inputs[{key!r}]", f"holds a value of magnitude {biggest:.3g}, beyond the "
                                   f"{MAX_INPUT_MAGNITUDE:.3g} (2^150) this service computes with: its statistics "
                                   "would overflow float64 arithmetic. Rescale the input (e.g. divide the rewards "
                                   "by a constant)"))
            compute_dtype = torch.float64
        if violations:
            raise InvalidInput(violations)
        out = {}
        for key, t in tensors.items():
            # casts on the CPU before a move (the smaller dtype crosses to the GPU) are rare; a tensor that
            # already has the device and dtype is passed on as it is (no copy)
            if t.device != self.device:
                t = t.to(self.device, non_blocking=True)
            if owners[key].kind == "integer":
                t = validate.cast(t, torch.int64)
                out[key] = group_index(t) if key == "prompt_ids" else t
            else:
                out[key] = validate.cast(t, compute_dtype)
            checkpoint("while moving the inputs to the compute device and dtype")
        return out


def check_result_size(spec: EstimatorSpec, config: Any, dense: tuple[int, ...], layout: Any, per_sample: bool,
                      itemsize: int, limit: int) -> None:
    """Refuse, before computing, a result that one response message could not carry (issue #35 item 6: it was
    computed in full, logged OK, then dropped by gRPC, whose RESOURCE_EXHAUSTED named no flag).

    The result holds advantages, and returns where the estimator sets them (``spec.returns_for``), each ``[N]``
    for the packed layout (``N = cu_seqlens[-1]``), ``[B]`` for a per-sample result, else ``[B, T]`` (``dense``,
    the mask's shape), at ``itemsize`` bytes a value; the encoding adds well under 1 KiB. Raises
    ``ResourceLimit`` (RESOURCE_EXHAUSTED) naming ``--max-message-mb`` and the streaming transport."""
    if layout is not None:
        values = int(layout.cu[-1])
    elif per_sample and spec.per_sample and spec.per_sample_for(config):
        values = int(dense[0]) if dense else 1
    else:
        values = math.prod(int(d) for d in dense)
    tensors = 2 if spec.returns_for(config) else 1
    nbytes = tensors * values * itemsize + 1024
    if nbytes > limit:
        raise ResourceLimit(f"the result of this request would be about {nbytes} bytes ({tensors} x {values} values "
                            f"of {itemsize} bytes), more than one response message carries "
                            f"(--max-message-mb={limit >> 20}): send it with transport='stream' "
                            "(ComputeAdvantageStream returns results of any size in chunks), or split the batch")


def _largest_input(batch: Batch) -> str:
    """``inputs['<key>']`` of the float input with the largest magnitude (the one to rescale when the
    arithmetic overflowed), or ``inputs`` when there is none."""
    best, field = -1.0, "inputs"
    for key, t in batch._tensors.items():
        if key == "mask" or not t.is_floating_point() or t.numel() == 0:
            continue
        m = float(torch.nan_to_num(t.detach(), nan=0.0).abs().amax())
        if m > best:
            best, field = m, f"inputs[{key!r}]"
    return field


def lengths_to_mask(tensors: Mapping[str, Any], columns: int = 0, max_elements: int | None = None
                    ) -> dict[str, Any]:
    """``tensors`` with ``lengths`` [B] (any integer dtype) replaced by the bool ``mask`` [B, T] it stands
    for: ``mask[b, t] = t < lengths[b]``, ``T = columns`` or, when 0, ``max(lengths)``.

    Raises ``InvalidInput`` naming ``inputs['lengths']`` / ``mask_columns`` for: both mask and lengths,
    mask_columns without lengths, lengths not a 1-D integer tensor, a length below 0 or above T, a negative
    T; ``ResourceLimit`` when B x T passes ``max_elements`` (checked before allocating)."""
    out = dict(tensors)
    if "lengths" not in out:
        raise InvalidInput("mask_columns", f"= {columns} is only read with inputs['lengths'] [B] (a prefix mask); "
                                           "send lengths, or leave mask_columns unset")
    if "mask" in out:
        raise InvalidInput("inputs['lengths']", "stands for `mask`: send one of mask [B, T] and lengths [B], not both")
    lengths = torch.as_tensor(out.pop("lengths"))
    if lengths.dtype not in _INTEGER or lengths.dim() != 1:
        raise InvalidInput("inputs['lengths']", f"must be [B] integers (the valid-token count of each row), got "
                                                f"{str(lengths.dtype).replace('torch.', '')} of shape {list(lengths.shape)}")
    if columns < 0:
        raise InvalidInput("mask_columns", f"must be >= 0 (0 = the longest length), got {columns}")
    lengths = lengths.to("cpu", torch.int64)
    low = int(lengths.min()) if lengths.numel() else 0
    high = int(lengths.max()) if lengths.numel() else 0
    T = columns or high
    if low < 0 or high > T:
        bad = int(torch.nonzero((lengths < 0) | (lengths > T))[0, 0])
        raise InvalidInput("inputs['lengths']", f"lengths[{bad}] = {int(lengths[bad])} is outside [0, T = {T}] "
                                                "(T = mask_columns when set)")
    B = lengths.numel()
    limit = min(max_elements or MAX_PADDED_ELEMENTS, MAX_PADDED_ELEMENTS)
    if B * T > limit:
        raise ResourceLimit(f"inputs['lengths']: a [{B}, {T}] mask has {B * T} elements, more than the server's "
                            f"--max-batch-elements={limit}; split the batch into smaller requests")
    out["mask"] = torch.arange(T)[None, :] < lengths[:, None]
    return out


def to_per_sample(result: AdvantageResult, layout: int, mask: torch.Tensor, name: str = "",
                  verify: bool = True) -> AdvantageResult:
    """The per-sample form of a dense ``[B, T]`` result: advantages (and returns) as ``[B]`` values under
    ``layout`` (``advantage_client.layout``), ``layout`` and ``dense_shape`` set. ``verify``: check each
    tensor, and when rebuilding it from its values does not give it back exactly (``torch.equal``) keep the
    result dense (and log the mismatch as a declaration bug). ``mask``: the batch's ``[B, T]`` 0/1 mask."""
    dense = [t for t in (result.advantages, result.returns) if t is not None]
    values = []
    for t in dense:
        if t.dim() != 2:
            return result
        v = layout_mod.row_values(t, layout, mask)
        if verify and not torch.equal(layout_mod.rebuild(v, layout, (mask != 0).to(t.device), t.shape[1]), t):
            log.error("%s: declared per-sample layout %s does not hold for this batch; answered dense",
                      name, layout_mod.layout_name(layout))
            return result
        values.append(v)
    adv = values[0]
    ret = values[1] if result.returns is not None else None
    return AdvantageResult(adv, ret, dict(result.metrics), finite=result.finite, layout=layout,
                           dense_shape=tuple(result.advantages.shape))


def _check(key: str, t: torch.Tensor, spec: InputSpec, dims: dict[str, int], cfg: Any = None
           ) -> list[tuple[str, str]]:
    """Violations of one tensor against its spec: dtype kind, symbolic shape, finiteness (NaN allowed where
    the spec's ``nan_allowed_when`` holds for ``cfg``), 0/1 mask."""
    field = f"inputs[{key!r}]"
    if t.dtype not in _KINDS[spec.kind]:
        allowed = sorted(str(d).replace("torch.", "") for d in _KINDS[spec.kind])
        return [(field, f"dtype {str(t.dtype).replace('torch.', '')} is not accepted for {spec.kind} input "
                        f"{key!r}; send one of {allowed}")]
    if not any(_shape_matches(pattern, tuple(t.shape), dims) for pattern in spec.shapes):
        want = " or ".join(re.sub(r"\b([BT])\b", lambda m: str(dims[m.group(1)]), p) for p in spec.shapes)
        mask = [dims["B"], dims["T"]]
        if any(len(_pattern_symbols(p)) == t.dim() for p in spec.shapes):  # right rank, sizes disagree with mask
            return [(field, f"{key} has shape {list(t.shape)} but mask has {mask}: every input must match mask, "
                            f"which sets B and T ({key} must be {' or '.join(spec.shapes)} = {want}); fix "
                            "whichever of the two is wrong")]
        return [(field, f"has shape {list(t.shape)} but must be {' or '.join(spec.shapes)} = {want} "
                        f"(B and T come from `mask` {mask})")]
    if spec.kind == "mask" and t.dtype != torch.bool:
        if validate.is_binary(t):  # 0/1 values are finite: one pass checks both
            return []
        if t.is_floating_point() and not validate.all_finite(t):
            return [(field, f"contains NaN or infinity ({_not_finite(t)}); every input value must be finite")]
        return [(field, "holds values other than 0 and 1; send a 0/1 (or bool) mask")]
    if t.is_floating_point() and not validate.all_finite(t):
        if _clamped_infinities(t, spec, cfg):
            t = t[~torch.isinf(t)]  # the estimator clamps them; the rest as below
            if validate.all_finite(t):
                return []
        allowed = spec.nan_allowed_when
        if allowed is not None and cfg is not None and allowed[0](cfg):
            if bool(torch.isinf(t).any()):
                clamp = f"; +-infinity is accepted with {spec.inf_allowed_when[1]}" if spec.inf_allowed_when else ""
                return [(field, f"contains infinity; NaN (no value) is accepted with {allowed[1]}, infinity is not"
                                + clamp)]
            return []
        return [(field, f"contains NaN or infinity ({_not_finite(t)}); every input value must be finite"
                        + (f" (NaN = no value is accepted with {allowed[1]})" if allowed is not None else ""))]
    return []


def _clamped_infinities(t: torch.Tensor, spec: InputSpec, cfg: Any) -> bool:
    """Whether ``t`` holds infinities and every one of them is on a side ``spec.inf_allowed_when`` accepts under
    ``cfg`` (the estimator clamps it to a finite bound: TRL's ``reward_clip_range``)."""
    if spec.inf_allowed_when is None or cfg is None:
        return False
    pos, neg = spec.inf_allowed_when[0](cfg)
    has_pos, has_neg = bool(torch.isposinf(t).any()), bool(torch.isneginf(t).any())
    return (has_pos or has_neg) and (pos or not has_pos) and (neg or not has_neg)


def _not_finite(t: torch.Tensor) -> str:
    """Which values of ``t`` are NaN or infinite, for an error message (issue #37 item 6: the message named the
    input but neither the entry nor how many): ``"2 of 12 values, the first at [1, 3]: nan"``. Only on the error
    path: one pass to find them."""
    bad = ~torch.isfinite(t)
    n = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0]) if n and t.dim() else ()
    where = f"[{', '.join(map(str, first))}]" if t.dim() else "the scalar"
    return f"{n} of {t.numel()} value{'s' if t.numel() != 1 else ''}, the first at {where}: {float(t[first])}"


@functools.lru_cache(maxsize=None)  # the registered patterns: a few dozen
def _pattern_symbols(pattern: str) -> tuple[str, ...]:
    """``"[B, T]"`` -> ``("B", "T")``."""
    return tuple(s.strip() for s in pattern.strip("[]").split(",") if s.strip())


def _shape_matches(pattern: str, shape: tuple[int, ...], dims: dict[str, int]) -> bool:
    symbols = _pattern_symbols(pattern)
    if len(symbols) != len(shape):
        return False
    return all(dims.get(sym, size) == size and size > 0 for sym, size in zip(symbols, shape))


# ---------------------------------------------------------------------- packed (ragged) layout
#: largest padded batch (B x longest row) the packed layout unpacks to; a request beyond it is
#: RESOURCE_EXHAUSTED (a few long rows among many short ones would otherwise allocate B x T_max).
MAX_PADDED_ELEMENTS = 1 << 28


def _symbols(pattern: str) -> list[str]:
    return [s.strip() for s in pattern.strip("[]").split(",") if s.strip()]


#: elements of the padded batch one step of the packed layout's unpack / repack moves; the call's checkpoint
#: (deadline, cancellation: :func:`~advantage_server.limits.checkpoint`) runs between steps, so a call that
#: expires while a large packed batch is unpacked stops within one step (a few ms), not after all of it
PACK_STEP = 1 << 22


def _pack_steps(cu: torch.Tensor, lengths: torch.Tensor, T: int):
    """``(r0, r1, c0, c1, a)`` steps over the padded ``[B, T]`` batch, each at most :data:`PACK_STEP`
    elements: rows ``r0:r1`` whole (several short rows), or columns ``c0:c1`` of one long row ``r0``
    (``r1 = r0 + 1``); ``a`` = the flat position of the step's first token. A checkpoint after each."""
    B = lengths.numel()
    rows = max(1, PACK_STEP // max(T, 1))
    for r0 in range(0, B, rows):
        r1 = min(B, r0 + rows)
        a = int(cu[r0])
        if r1 - r0 > 1 or T <= PACK_STEP:
            yield r0, r1, 0, T, a
            checkpoint("while unpacking the packed layout (cu_seqlens)")
        else:
            n = int(lengths[r0])
            for c0 in range(0, max(n, 1), PACK_STEP):
                yield r0, r1, c0, min(n, c0 + PACK_STEP), a + c0
                checkpoint("while unpacking the packed layout (cu_seqlens)")


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where the N flat positions sit in the padded ``[B, T]`` batch: row ``b`` holds ``lengths[b]`` tokens
    in columns ``0 .. lengths[b] - 1``, rows one after the other (row-major order of the valid positions)."""

    cu: torch.Tensor       # [B + 1] int64 row offsets (CPU)
    lengths: torch.Tensor  # [B] int64 (CPU)
    T: int

    def scatter(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Flat ``[N]`` -> zero-padded ``[B, T]``; ``t`` None: the all-ones mask (``dtype`` bool)."""
        B, T = self.lengths.numel(), self.T
        padded = torch.zeros((B, T), dtype=t.dtype if t is not None else dtype)
        cols = torch.arange(T) if T <= PACK_STEP else None  # only steps of several rows use it (then T is small)
        for r0, r1, c0, c1, a in _pack_steps(self.cu, self.lengths, T):
            if r1 - r0 == 1:  # one row, or columns of a long one: a contiguous copy
                n = max(0, min(c1, int(self.lengths[r0])) - c0)
                padded[r0, c0:c0 + n] = True if t is None else t[a:a + n]
            else:
                valid = cols[None, :] < self.lengths[r0:r1, None]
                if t is None:
                    padded[r0:r1] = valid
                else:  # the step's tokens, in row-major order of its valid positions
                    padded[r0:r1].masked_scatter_(valid, t[a:int(self.cu[r1])])
        return padded

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, T]`` -> flat ``[N]`` (the valid positions, row-major), on ``t``'s device."""
        out = torch.empty(int(self.cu[-1]), dtype=t.dtype, device=t.device)
        lengths = self.lengths.to(t.device)
        cols = torch.arange(self.T, device=t.device) if self.T <= PACK_STEP else None
        for r0, r1, c0, c1, a in _pack_steps(self.cu, self.lengths, self.T):
            if r1 - r0 == 1:
                n = max(0, min(c1, int(self.lengths[r0])) - c0)
                out[a:a + n] = t[r0, c0:c0 + n]
            else:  # the valid positions' flat indices, then one index_select (faster than boolean indexing)
                where = (cols[None, :] < lengths[r0:r1, None]).view(-1).nonzero().squeeze(1)
                out[a:int(self.cu[r1])] = t[r0:r1].reshape(-1).index_select(0, where)
        return out

    def repack(self, result: AdvantageResult) -> AdvantageResult:
        """Padded ``[B, T]`` advantages/returns -> flat ``[N]`` (the valid positions, row-major)."""
        def gather(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else self.gather(t)
        return AdvantageResult(gather(result.advantages), gather(result.returns), dict(result.metrics))


def unpack(spec: EstimatorSpec, cu_seqlens: Any, raw: Mapping[str, Any], max_elements: int | None = None
           ) -> tuple[dict[str, torch.Tensor], PackedLayout]:
    """Packed inputs -> padded ``[B, T_max]`` inputs, generically from the estimator's ``InputSpec``s.

    Every input whose declared shapes include ``T`` is expected flat ``[N]`` (``N = cu_seqlens[B]``)
    and is scattered into a zero-filled ``[B, T_max]`` tensor; an input that also accepts ``[B]`` and
    has length ``B`` stays per-sample. ``mask`` defaults to all ones over the N tokens, so the
    padding is always mask 0. Per-sample inputs pass through. Raises ``InvalidInput`` naming
    ``cu_seqlens`` (or the input) for a malformed layout.
    """
    cu = torch.as_tensor(cu_seqlens)
    if cu.dtype not in (torch.int32, torch.int64):
        raise InvalidInput("cu_seqlens", f"dtype {str(cu.dtype).replace('torch.', '')} is not accepted; "
                                         "send the [B + 1] row offsets as int32 or int64")
    if cu.dim() != 1 or cu.numel() < 2:
        raise InvalidInput("cu_seqlens", f"must be [B + 1] row offsets with B >= 1, got shape {list(cu.shape)}: "
                                         "send [0, len_0, len_0 + len_1, ...]")
    stage = "while unpacking the packed layout (cu_seqlens)"  # checked between the steps below (cu_seqlens
    cu = cu.to("cpu", torch.int64)                          # may hold up to --max-batch-elements offsets)
    checkpoint(stage)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0:
        raise InvalidInput("cu_seqlens", f"must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    checkpoint(stage)
    if bool((lengths < 0).any()):
        row = int(torch.nonzero(lengths < 0)[0, 0])
        raise InvalidInput("cu_seqlens", f"must be non-decreasing, but cu_seqlens[{row + 1}] = {int(cu[row + 1])} < "
                                         f"cu_seqlens[{row}] = {int(cu[row])}")
    B, N = cu.numel() - 1, int(cu[-1])
    checkpoint(stage)
    T = max(int(lengths.max()), 1)
    # Every size this request implies is checked before anything is allocated: the flat [N] inputs and
    # results (N = cu_seqlens[B], e.g. the all-ones mask made when none is sent) and the padded [B, T]
    # inputs and results (N <= B x T, so one check of B x T covers both).
    if max_elements is not None and B * T > max_elements:
        raise ResourceLimit(f"cu_seqlens: {B} rows padded to the longest row ({T}) need {B * T} elements "
                            f"(cu_seqlens[-1] = N = {N} tokens), more than the server's --max-batch-elements="
                            f"{max_elements}; split the batch into smaller requests")
    if B * T > MAX_PADDED_ELEMENTS:
        raise ResourceLimit(f"cu_seqlens: {B} rows padded to the longest row ({T}) need {B * T} elements, more "
                            f"than the server's {MAX_PADDED_ELEMENTS}; split the batch or send it padded")

    tensors = {k: torch.as_tensor(v) for k, v in raw.items()}
    default_mask = "mask" not in tensors
    if default_mask:  # all ones over the N tokens: made padded below, never as an [N] tensor
        tensors["mask"] = torch.ones(1, dtype=torch.bool).expand(N)
    violations: list[tuple[str, str]] = []
    flat: list[str] = []
    for key, t in tensors.items():
        owner = next((s for s in spec.inputs if s.matches(key)), None)
        if owner is None:
            continue  # prepare() reports inputs the estimator does not read
        shapes = [_symbols(p) for p in owner.shapes]
        if not any("T" in s for s in shapes):
            continue  # per-sample input: same shape in both layouts
        if ["B"] in shapes and t.dim() == 1 and t.shape[0] == B:
            continue  # the per-sample form of an input that accepts [B] or [B, T]
        if t.dim() != 1:
            violations.append((f"inputs[{key!r}]", f"has shape {list(t.shape)}, but with cu_seqlens set a token-level "
                                                   f"input is sent flat [N] = [{N}] (rows concatenated, no padding)"))
        elif t.shape[0] != N:
            also = f" (or [B] = [{B}] per-sample values)" if ["B"] in shapes else ""
            violations.append(("cu_seqlens", f"ends at N = {N} but inputs[{key!r}] holds {t.shape[0]} values: "
                                             f"cu_seqlens[B] must equal the length of every flat [N] input{also}"))
        else:
            flat.append(key)
    if violations:
        raise InvalidInput(violations)

    # scattered step by step, with the call's checkpoint between steps (PACK_STEP)
    layout = PackedLayout(cu, lengths, T)
    checkpoint(stage)
    for key in flat:
        tensors[key] = layout.scatter(None if key == "mask" and default_mask else tensors[key], torch.bool)
    return tensors, layout


# ---------------------------------------------------------------------- configs
#: values a repeated config field may hold (GDPO's reward_weights: one per reward input, and a request has
#: at most codec.MAX_INPUTS inputs)
MAX_CONFIG_ITEMS = 1024


@functools.lru_cache(maxsize=None)
def _config_fields(config_cls: type, descriptor: Any) -> tuple[tuple[Any, Any], ...]:
    """(dataclass field, proto field descriptor) of each field of ``config_cls``, looked up once per class."""
    return tuple((f, descriptor.fields_by_name[f.name]) for f in dataclasses.fields(config_cls))


def config_from_proto(spec: EstimatorSpec, msg: Any) -> Any:
    """Typed proto config message -> the estimator's config dataclass (unset fields take defaults)."""
    return _dataclass_from_proto(spec.config, msg)


def _dataclass_from_proto(config_cls: type, msg: Any) -> Any:
    """``config_cls`` from the message ``msg``; a message-typed field (AReaL's ``reward_norm``) becomes the
    dataclass its field's ``message`` metadata names, built the same way, or None when unset."""
    values: dict[str, Any] = {}
    for f, fd in _config_fields(config_cls, msg.DESCRIPTOR):
        if fd.is_repeated:
            if len(getattr(msg, f.name)) > MAX_CONFIG_ITEMS:  # bounded work before any loop over it
                raise InvalidInput(f"config.{f.name}", f"holds {len(getattr(msg, f.name))} values; at most "
                                                       f"{MAX_CONFIG_ITEMS} (one per input) are read")
            items = tuple(getattr(msg, f.name))
            for i, v in enumerate(items):  # the config's own validate() checks scalars, not lists
                if isinstance(v, float) and not math.isfinite(v):
                    raise InvalidInput(f"config.{f.name}[{i}]", f"must be finite, got {v}")
            if items:
                values[f.name] = items
        elif fd.enum_type is not None:
            code = getattr(msg, f.name)
            names = wire.enum_names(fd.enum_type)
            if code not in names:
                choices = f.metadata.get("choices")  # the values this estimator offers, when it says
                known = ", ".join(v.name for v in fd.enum_type.values
                                  if v.number != 0 and (not choices or names.get(v.number) in choices))
                raise InvalidInput(f"config.{f.name}", f"unknown enum value {code}; use {known}")
            if names[code] is not None:
                values[f.name] = names[code]
        elif fd.message_type is not None:
            if msg.HasField(f.name):
                values[f.name] = _dataclass_from_proto(f.metadata["message"], getattr(msg, f.name))
        elif msg.HasField(f.name):
            values[f.name] = getattr(msg, f.name)
    return config_cls(**values)


def config_from_dict(spec: EstimatorSpec, config: Mapping[str, Any]) -> Any:
    """Dict with NeMo RL key names -> config dataclass, through the same typed message as the wire."""
    try:
        msg = wire.config_message(spec.name, config)
    except wire.WireError as err:
        raise InvalidInput.from_wire(err) from None
    return config_from_proto(spec, msg)


def cast_output(t: torch.Tensor, dtype: torch.dtype, label: str) -> torch.Tensor:
    """``t`` in the requested output dtype; values beyond its range are an ``InvalidInput`` on
    ``output_dtype`` (a float16 result of 1e5 would otherwise arrive as infinity)."""
    out = validate.cast(t, dtype)
    if out.dtype != t.dtype and not validate.all_finite(out):
        biggest = float(t.abs().max())
        wider = " or ".join(f'output_dtype="{name}"' for name, d in (("float32", torch.float32),
                                                                      ("float64", torch.float64))
                            if torch.finfo(d).max > torch.finfo(dtype).max)
        raise InvalidInput("output_dtype", f"{label} reach {biggest:.3g}, beyond the range of "
                                           f"{str(dtype).replace('torch.', '')}; request {wider}")
    return out


def encode_result(result: AdvantageResult, dtype: torch.dtype, consume: bool = False) -> pb.AdvantageResult:
    """The ``AdvantageResult`` message of ``result`` in ``dtype``.

    Each tensor's bytes are copied twice on the way (a Python ``bytes``, then protobuf's own copy:
    protobuf takes no buffer views); they are assigned to the field in place (building a ``Tensor`` and
    ``CopyFrom`` would copy a third time). ``consume=True`` (the caller gives ``result`` up) drops each
    result tensor as soon as its bytes are taken, so its memory is free for protobuf's copy.
    """
    msg = pb.AdvantageResult()
    for label in ("advantages", "returns"):
        t = getattr(result, label)
        if t is None:
            continue
        if consume:
            setattr(result, label, None)
        t = t.to(dtype)
        code, shape = wire.TORCH_DTYPE_CODES[t.dtype], list(t.shape)
        t = t.detach().to("cpu").contiguous()
        data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        del t  # with consume: the result tensor's last reference
        field = getattr(msg, label)
        field.dtype = code
        field.shape.extend(shape)
        field.data = data
        del data
    msg.metrics.update({k: float(v) for k, v in result.metrics.items()})
    msg.layout = result.layout
    msg.dense_shape.extend(result.dense_shape)
    return msg


# ---------------------------------------------------------------------- ListEstimators
def _type_name(annotation: Any, metadata: Mapping[str, Any]) -> str:
    if "enum" in metadata:
        return metadata["enum"]
    if "message" in metadata:  # a nested config message (AReaL's NormConfig): its proto message name
        return metadata["message"].MESSAGE
    text = str(annotation)
    if "tuple" in text:
        return "repeated double"
    if "bool" in text:
        return "bool"
    if "str" in text:
        return "KLType"
    if "int" in text:
        return "int32"
    return "double"


def describe(spec: EstimatorSpec) -> pb.EstimatorInfo:
    """The ``EstimatorInfo`` record of one registered estimator."""
    hints = typing.get_type_hints(spec.config)
    _, cls = wire.ESTIMATOR_FIELDS[spec.name]
    info = pb.EstimatorInfo(
        name=spec.name, config_field=spec.name, config_message=cls.DESCRIPTOR.full_name,
        description=spec.description, reference=spec.reference,
        produces_returns=spec.produces_returns, metrics=list(spec.metrics),
        returns_when=spec.returns_when[1] if spec.returns_when else "",
        per_sample=[pb.PerSampleRule(when=when, layout=layout) for when, layout in spec.per_sample],
        group_local=list(spec.group_local),
    )
    for f in dataclasses.fields(spec.config):
        default = "unset" if f.default is None else (str(f.default).lower() if isinstance(f.default, bool) else str(f.default))
        default = f.metadata.get("default_text", default)
        info.config_fields.add(name=f.name, type=_type_name(hints[f.name], f.metadata), default_value=default,
                               description=f.metadata.get("doc", ""),
                               allowed_values=list(f.metadata.get("choices", ())))
    for s in spec.inputs:
        info.inputs.add(name=s.name, shapes=list(s.shapes), required=s.required,
                        required_when=s.required_when[1] if s.required_when else "", kind=s.kind,
                        description=s.description)
    return info


def list_estimators() -> pb.ListEstimatorsResponse:
    """The ``ListEstimators`` answer: every registered estimator's contract, and the release each
    ``semantics`` value reproduces (from :data:`advantage_client.references.REFERENCES`)."""
    return pb.ListEstimatorsResponse(
        estimators=[describe(s) for s in REGISTRY.values()],
        references=[pb.ReferenceRelease(semantics=r.semantics, project=r.project, release=r.release,
                                        package=r.package or "", code=r.code) for r in REFERENCES.values()])
