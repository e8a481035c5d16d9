"""A tensor codec for the hot messages, byte-compatible with protobuf (like Arrow Flight's data body).

``ComputeAdvantageRequest``, ``AdvantageResult`` and ``Tensor`` are written and read here directly in the
protobuf wire format, so that tensor payloads are never copied through protobuf ``bytes`` fields:

* :func:`encode_request` / :func:`encode_result` build the wire bytes with one copy of each tensor payload
  (``bytes.join`` over the small headers and ``memoryview``\\ s of the tensors: no Python lists, no
  ``tobytes``). The output is exactly ``SerializeToString(deterministic=True)`` of the equivalent
  generated message (map keys sorted), so peers using the plain generated stubs read it unchanged.
* :func:`decode_request` / :func:`decode_result` parse the wire bytes (from any language's stubs) into
  :class:`DecodedRequest` / :class:`DecodedResult`, whose tensors are :class:`TensorView`\\ s: ``data`` is a
  ``memoryview`` slice of the received buffer, so ``numpy.frombuffer`` / ``torch.frombuffer`` on it are
  zero-copy. They duck-type the generated classes where the service reads them (``WhichOneof``,
  ``HasField``, ``inputs``, ``cu_seqlens``, ``output_dtype``, the config oneof), so
  :func:`advantage_client.wire.decode_torch` works on them unchanged.

Decoding follows protobuf's parser: fields in any order, repeated non-repeated fields merged (last scalar
wins, sub-messages merged), packed or unpacked ``shape``, unknown fields (every wire type, groups included)
skipped, a known field with the wrong wire type treated as unknown, map entries with missing key/value.
Bytes that protobuf would reject raise :class:`CodecError` (a ``ValueError``), which the server answers with
INVALID_ARGUMENT.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from advantage_client import wire
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_REQ = pb.ComputeAdvantageRequest.DESCRIPTOR
#: estimator oneof: field number -> (field name, config class)
ONEOF = {f.number: f.name for f in _REQ.oneofs_by_name["estimator"].fields}
ONEOF_NUMBER = {name: number for number, name in ONEOF.items()}
_CONFIG_CLS = {name: cls for _, (name, cls) in wire.ESTIMATOR_FIELDS.items()}


class CodecError(ValueError):
    """Bytes that are not a valid message of the schema."""


class CodecFieldError(CodecError):
    """A request the server refuses for one field (too many inputs, too many dimensions), found while
    parsing: ``field`` names it (``inputs``, ``inputs['x'].shape``), ``description`` says why."""

    def __init__(self, field: str, description: str):
        super().__init__(f"{field}: {description}")
        self.field, self.description = field, description


# Parsing a request costs Python work per protobuf field, not per byte (tensor payloads are sliced, not
# read). These caps bound that work whatever the bytes hold (issue 11 item 9: 30 MB of empty unknown
# fields were 17 s of server CPU, a 5-million-dimension shape 5.5 s, 200k input keys 3 s):
#: fields of every level a request may hold (known, unknown and inside groups): a request with 1,024
#: inputs holds about 6,200
MAX_FIELDS = 1 << 15
#: entries of ``inputs`` (as sent: a repeated key counts each time)
MAX_INPUTS = 1024
#: dimensions of one tensor (numpy's limit; ``wire.MAX_DIMS``)
MAX_DIMS = wire.MAX_DIMS


# ------------------------------------------------------------------------------------------- varints
#: the one-byte varints (0-127: tags, lengths and dimensions of small messages), made once
_SMALL_VARINTS = tuple(bytes((i,)) for i in range(128))


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of ``value`` (negative int64/int32 as 10-byte two's complement)."""
    if 0 <= value < 128:  # most varints of a request: one byte, no loop
        return _SMALL_VARINTS[value]
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    if pos < end:
        b = buf[pos]
        if b < 0x80:  # a one-byte varint (most tags and lengths): no loop
            return b, pos + 1
    result = shift = 0
    for _ in range(10):
        if pos >= end:
            raise CodecError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
    raise CodecError("varint longer than 10 bytes")


def _spend(budget: list[int] | None) -> None:
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise CodecError(f"more than {budget[1]} protobuf fields in one message (unknown ones and group "
                             "contents included), more than the server reads; a request holds a few per input")


def _fields(buf: memoryview, pos: int, end: int, budget: list[int] | None = None
            ) -> Iterable[tuple[int, int, Any, int, int]]:
    """(field number, wire type, value or None, start, stop) for each field in ``buf[pos:end]``;
    for LEN fields the value is None and ``[start, stop)`` is the payload. ``budget``:
    ``[fields left, cap]``, shared by a whole message's parse (each field, skipped ones included, spends one;
    CodecError past the cap)."""
    while pos < end:
        _spend(budget)
        key, pos = _read_varint(buf, pos, end)
        number, wt = key >> 3, key & 7
        if number == 0 or number > 536870911:
            raise CodecError(f"invalid field number {number}")
        if wt == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            yield number, wt, value, pos, pos
        elif wt == _I64:
            if pos + 8 > end:
                raise CodecError("truncated fixed64")
            yield number, wt, None, pos, pos + 8
            pos += 8
        elif wt == _I32:
            if pos + 4 > end:
                raise CodecError("truncated fixed32")
            yield number, wt, None, pos, pos + 4
            pos += 4
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos, end)
            if n > end - pos:
                raise CodecError(f"field {number}: length {n} runs past the end of the message")
            yield number, wt, None, pos, pos + n
            pos += n
        elif wt == _SGROUP:
            pos = _skip_group(buf, pos, end, number, budget=budget)
        else:
            raise CodecError(f"field {number}: unexpected wire type {wt}")


def _skip_group(buf: memoryview, pos: int, end: int, number: int, depth: int = 0,
                budget: list[int] | None = None) -> int:
    if depth > 100:
        raise CodecError("groups nested too deeply")
    while True:
        if pos >= end:
            raise CodecError(f"group {number} is not closed")
        _spend(budget)
        key, pos = _read_varint(buf, pos, end)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise CodecError("invalid field number 0")
        if wt == _EGROUP:
            if num != number:
                raise CodecError(f"group {number} closed by end-group {num}")
            return pos
        if wt == _VARINT:
            _, pos = _read_varint(buf, pos, end)
        elif wt in (_I64, _I32):
            pos += 8 if wt == _I64 else 4
            if pos > end:
                raise CodecError("truncated fixed field")
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos, end)
            if n > end - pos:
                raise CodecError("length runs past the end of the message")
            pos += n
        elif wt == _SGROUP:
            pos = _skip_group(buf, pos, end, num, depth + 1, budget)
        else:
            raise CodecError(f"unexpected wire type {wt}")


def _upb_map_order(a: bytes, b: bytes) -> int:
    """The order upb's deterministic serializer writes string map keys in: byte-wise ascending, but a
    key that is a prefix of another comes after it (upb sorts descending and encodes backwards)."""
    n = min(len(a), len(b))
    if a[:n] != b[:n]:
        return -1 if a[:n] < b[:n] else 1
    return len(b) - len(a)


def _sorted_keys(keys: Iterable[str]) -> list[str]:
    keys = tuple(keys)
    return list(keys) if len(keys) < 2 else list(_sorted_key_tuple(keys))


@functools.lru_cache(maxsize=256)  # a caller sends the same input names call after call
def _sorted_key_tuple(keys: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(keys, key=functools.cmp_to_key(
        lambda x, y: _upb_map_order(x.encode("utf-8"), y.encode("utf-8")))))


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


# ------------------------------------------------------------------------------------------ tensors
@dataclass
class TensorView:
    """An ``advantage.v1.Tensor`` whose ``data`` is a view (``memoryview``) of the buffer it came from."""

    dtype: int = 0
    shape: list[int] = field(default_factory=list)
    data: Any = b""
    #: dimensions sent beyond those kept in ``shape`` (a request decoded with a dimension cap: the request is
    #: refused, and the count is only for its message)
    more_dims: int = 0

    def numpy(self, name: str = "tensor") -> np.ndarray:
        return wire.decode_numpy(self, name)  # type: ignore[arg-type]

    def torch(self, name: str = "tensor") -> "torch.Tensor":
        return wire.decode_torch(self, name)  # type: ignore[arg-type]

    def to_message(self) -> pb.Tensor:
        return pb.Tensor(dtype=self.dtype, shape=self.shape, data=bytes(self.data))


def _add_int64s(out: list[int], buf: memoryview, wt: int, value: Any, start: int, stop: int) -> None:
    """A ``repeated int64`` field occurrence, unpacked (one varint) or packed (a LEN run of varints)."""
    if wt == _VARINT:
        out.append(_int64(value))
        return
    p = start
    while p < stop:
        v, p = _read_varint(buf, p, stop)
        out.append(_int64(v))


def _add_dims(t: TensorView, buf: memoryview, wt: int, value: Any, start: int, stop: int) -> None:
    """:func:`_add_int64s` into ``t.shape`` keeping at most ``MAX_DIMS + 1`` dimensions: the others are
    counted in ``t.more_dims`` without decoding them one by one (a packed run holds one varint per byte
    below 0x80), so a shape of millions of dimensions costs no Python loop over them."""
    if len(t.shape) > MAX_DIMS:
        if wt == _VARINT:
            t.more_dims += 1
            return
        rest = np.frombuffer(buf[start:stop], np.uint8)
        if rest.size and rest[-1] & 0x80:
            raise CodecError("truncated varint")
        t.more_dims += int(np.count_nonzero(rest < 0x80))
        return
    if wt == _VARINT:
        t.shape.append(_int64(value))
        return
    p = start
    while p < stop and len(t.shape) <= MAX_DIMS:
        v, p = _read_varint(buf, p, stop)
        t.shape.append(_int64(v))
    if p < stop:
        _add_dims(t, buf, wt, None, p, stop)


def _merge_tensor(t: TensorView, buf: memoryview, pos: int, end: int, budget: list[int] | None = None
                  ) -> TensorView:
    for number, wt, value, start, stop in _fields(buf, pos, end, budget):
        if number == 1 and wt == _VARINT:
            t.dtype = _int32(value)
        elif number == 2 and wt in (_VARINT, _LEN):
            if budget is None:
                _add_int64s(t.shape, buf, wt, value, start, stop)
            else:  # a request (the server's side): the dimension cap applies
                _add_dims(t, buf, wt, value, start, stop)
        elif number == 3 and wt == _LEN:
            t.data = buf[start:stop]
    return t


def tensor_parts(value: Any, name: str = "tensor") -> tuple[int, tuple[int, ...], memoryview]:
    """(dtype code, shape, payload bytes view) of a tensor-like, with at most one copy (to make it
    contiguous, move it to the CPU, or widen an integer dtype the wire lacks: :func:`wire.tensor_array`).
    Accepts ``torch.Tensor``, ``numpy.ndarray``, nested lists, and ``Tensor`` messages or
    :class:`TensorView`\\ s (written as they are). Raises ``wire.WireError`` naming ``name`` for a dtype
    the schema does not have."""
    if isinstance(value, (TensorView, pb.Tensor)):
        return int(value.dtype), tuple(int(d) for d in value.shape), memoryview(value.data)
    code, shape, arr = wire.tensor_array(value, name)
    return code, shape, memoryview(arr.reshape(-1).view(np.uint8))


def _tensor_pieces(code: int, shape: Iterable[int], payload: memoryview) -> tuple[list[Any], int]:
    """The pieces of one serialized Tensor (body only) and its byte length."""
    head = bytearray()
    if code:
        head += b"\x08" + varint(code)
    shape = list(shape)
    if shape:
        packed = b"".join(varint(d) for d in shape)
        head += b"\x12" + varint(len(packed)) + packed
    n = payload.nbytes
    if n:
        head += b"\x1a" + varint(n)
        return [bytes(head), payload], len(head) + n
    return [bytes(head)], len(head)


def _message_field(number: int, pieces: list[Any], size: int) -> tuple[list[Any], int]:
    head = _tag(number, _LEN) + varint(size)
    return [head, *pieces], len(head) + size


def encode_tensor(value: Any, name: str = "tensor") -> bytes:
    """One serialized ``Tensor`` (= ``encode_tensor(...).SerializeToString()`` of :mod:`wire`)."""
    pieces, _ = _tensor_pieces(*tensor_parts(value, name))
    return b"".join(pieces)


# ------------------------------------------------------------------------------------------ requests
def encode_request(estimator: str | None, config: Any = None, inputs: Mapping[str, Any] | None = None,
                   output_dtype: int = 0, cu_seqlens: Any = None, *, tensors_as_is: bool = False,
                   per_sample: bool = False, mask_columns: int = 0) -> bytes:
    """Serialized ``ComputeAdvantageRequest``, byte-identical to the generated class's
    ``SerializeToString(deterministic=True)``. ``config``: the typed config message (or a dict / None,
    see :func:`wire.config_message`); ``inputs``: name -> tensor-like (``None`` values skipped);
    ``per_sample`` / ``mask_columns``: the request fields of those names (13, 14)."""
    return b"".join(request_pieces(estimator, config, inputs, output_dtype, cu_seqlens, per_sample, mask_columns))


def request_pieces(estimator: str | None, config: Any = None, inputs: Mapping[str, Any] | None = None,
                   output_dtype: int = 0, cu_seqlens: Any = None, per_sample: bool = False,
                   mask_columns: int = 0) -> list[Any]:
    """The pieces whose concatenation is :func:`encode_request`'s output: small headers (``bytes``) and
    ``memoryview``\\ s of the tensor payloads (nothing copied but what ``tensor_parts`` must: a
    non-contiguous or GPU tensor). :func:`iter_chunks` streams them without joining them first."""
    parts: list[tuple[int, list[Any]]] = []  # (field number, pieces), sorted by number at the end
    if estimator is not None:
        cfg = config if (config is not None and hasattr(config, "SerializeToString")) else \
            wire.config_message(estimator, config)
        body = cfg.SerializeToString(deterministic=True)
        number = ONEOF_NUMBER[wire.ESTIMATOR_FIELDS[estimator][0]] if estimator in wire.ESTIMATOR_FIELDS \
            else ONEOF_NUMBER[estimator]
        parts.append((number, [_tag(number, _LEN), varint(len(body)), body]))
    entries: list[Any] = []
    for key in _sorted_keys(inputs or {}):
        value = inputs[key]  # type: ignore[index]
        if value is None:
            continue
        tpieces, tsize = _tensor_pieces(*tensor_parts(value, f"inputs[{key!r}]"))
        kb = key.encode("utf-8")
        entry_head = b"\x0a" + varint(len(kb)) + kb
        vpieces, vsize = _message_field(2, tpieces, tsize)
        entry_size = len(entry_head) + vsize
        entries += [b"\x52" + varint(entry_size), entry_head, *vpieces]
    if entries:
        parts.append((10, entries))
    if output_dtype:
        parts.append((11, [b"\x58" + varint(output_dtype)]))
    if cu_seqlens is not None:
        tpieces, tsize = _tensor_pieces(*tensor_parts(cu_seqlens, "cu_seqlens"))
        parts.append((12, _message_field(12, tpieces, tsize)[0]))
    if per_sample:
        parts.append((13, [b"\x68\x01"]))
    if mask_columns:
        parts.append((14, [b"\x70" + varint(int(mask_columns))]))
    parts.sort(key=lambda p: p[0])
    return [piece for _, pieces in parts for piece in pieces]


def request_from_message(msg: pb.ComputeAdvantageRequest) -> bytes:
    """:func:`encode_request` of a generated message (for tests and tools)."""
    name = msg.WhichOneof("estimator")
    return encode_request(name, getattr(msg, name) if name else None, dict(msg.inputs), msg.output_dtype,
                          msg.cu_seqlens if msg.HasField("cu_seqlens") else None, per_sample=msg.per_sample,
                          mask_columns=msg.mask_columns)


class DecodedRequest:
    """A parsed ``ComputeAdvantageRequest`` whose tensors are :class:`TensorView`\\ s into the buffer.
    Duck-types the generated class where the service reads it."""

    def __init__(self) -> None:
        self.estimator: str | None = None
        self._config_bytes: list[Any] = []
        self._config: Any = None
        self.inputs: dict[str, TensorView] = {}
        self.output_dtype: int = 0
        self.cu_seqlens: TensorView | None = None
        self.per_sample: bool = False
        self.mask_columns: int = 0
        self.nbytes = 0

    def WhichOneof(self, name: str) -> str | None:  # noqa: N802 - protobuf's name
        return self.estimator if name == "estimator" else None

    def HasField(self, name: str) -> bool:  # noqa: N802
        if name == "cu_seqlens":
            return self.cu_seqlens is not None
        return name == self.estimator

    def config(self) -> Any:
        """The typed config message (parsed on first use; config messages are a few bytes)."""
        if self._config is None and self.estimator is not None:
            cls = _CONFIG_CLS[self.estimator]
            try:
                self._config = cls.FromString(b"".join(bytes(b) for b in self._config_bytes))
            except Exception as err:  # protobuf's DecodeError
                raise CodecError(f"{self.estimator}: not a valid {cls.DESCRIPTOR.full_name} ({err})") from None
        return self._config

    def __getattr__(self, name: str) -> Any:
        if name in ONEOF_NUMBER:
            return self.config() if name == self.estimator else _CONFIG_CLS[name]()
        raise AttributeError(name)

    def tensor_fields(self) -> dict[str, TensorView]:
        out: dict[str, Any] = {f"inputs[{k!r}]": v for k, v in self.inputs.items()}
        if self.cu_seqlens is not None:
            out["cu_seqlens"] = self.cu_seqlens
        return out

    def to_message(self) -> pb.ComputeAdvantageRequest:
        msg = pb.ComputeAdvantageRequest(output_dtype=self.output_dtype, per_sample=self.per_sample,
                                         mask_columns=self.mask_columns)
        if self.estimator is not None:
            getattr(msg, self.estimator).CopyFrom(self.config())
        for k, v in self.inputs.items():
            msg.inputs[k].CopyFrom(v.to_message())
        if self.cu_seqlens is not None:
            msg.cu_seqlens.CopyFrom(self.cu_seqlens.to_message())
        return msg


def _map_entry(buf: memoryview, start: int, stop: int, budget: list[int] | None = None
               ) -> tuple[str, TensorView] | None:
    """(key, value) of one ``map<string, Tensor>`` entry; None for an entry protobuf (upb) moves to the
    unknown fields because it holds a field other than key and value (it is then ignored)."""
    key: Any = b""
    value = TensorView()
    unknown = False
    for number, wt, _, s, e in _fields(buf, start, stop, budget):
        if number == 1 and wt == _LEN:
            key = buf[s:e]
        elif number == 2 and wt == _LEN:
            _merge_tensor(value, buf, s, e, budget)
        else:
            unknown = True
    try:
        text = bytes(key).decode("utf-8")
    except UnicodeDecodeError:
        raise CodecError("a map key is not valid UTF-8") from None
    return None if unknown else (text, value)


def decode_request(data: Any) -> DecodedRequest:
    """Parse a serialized ``ComputeAdvantageRequest`` without copying tensor payloads.

    The work is bounded whatever the bytes hold: at most :data:`MAX_FIELDS` fields (else ``CodecError``),
    :data:`MAX_INPUTS` input entries and :data:`MAX_DIMS` dimensions per tensor (else
    :class:`CodecFieldError` naming the field), each refused as soon as it is passed."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    req = DecodedRequest()
    req.nbytes = buf.nbytes
    cu: list[tuple[int, int]] = []
    budget = [MAX_FIELDS, MAX_FIELDS]
    entries = 0
    for number, wt, value, start, stop in _fields(buf, 0, buf.nbytes, budget):
        if number in ONEOF and wt == _LEN:
            name = ONEOF[number]
            if name != req.estimator:
                req.estimator, req._config_bytes = name, []
            segment = bytes(buf[start:stop])
            try:  # protobuf parses every occurrence, including those a later oneof member replaces
                parsed = _CONFIG_CLS[name].FromString(segment)
            except Exception as err:  # protobuf's DecodeError
                raise CodecError(f"{name}: not a valid {_CONFIG_CLS[name].DESCRIPTOR.full_name} ({err})") from None
            req._config_bytes.append(segment)
            # the config when this segment is its only one (the usual case): req.config() need not parse again
            req._config = parsed if len(req._config_bytes) == 1 else None
        elif number == 10 and wt == _LEN:
            entries += 1
            if entries > MAX_INPUTS:
                raise CodecFieldError("inputs", f"holds more than {MAX_INPUTS} entries; send at most {MAX_INPUTS} "
                                                "input tensors (each name once)")
            entry = _map_entry(buf, start, stop, budget)
            if entry is not None:
                req.inputs[entry[0]] = entry[1]  # a repeated key: the last entry wins
        elif number == 11 and wt == _VARINT:
            req.output_dtype = _int32(value)
        elif number == 12 and wt == _LEN:
            cu.append((start, stop))
        elif number == 13 and wt == _VARINT:
            req.per_sample = bool(value)
        elif number == 14 and wt == _VARINT:
            req.mask_columns = _int64(value)
    if cu:
        req.cu_seqlens = TensorView()
        for s, e in cu:
            _merge_tensor(req.cu_seqlens, buf, s, e, budget)
    for name, t in req.tensor_fields().items():
        if t.more_dims:
            raise CodecFieldError(f"{name}.shape", f"has {len(t.shape) + t.more_dims} dimensions; at most "
                                                   f"{MAX_DIMS} are supported")
    req.config()  # invalid config bytes are an invalid request
    return req


# ------------------------------------------------------------------------------------------- results
def encode_result(advantages: Any, returns: Any = None, metrics: Mapping[str, float] | None = None,
                  layout: int = 0, dense_shape: Iterable[int] = ()) -> bytes:
    """Serialized ``AdvantageResult`` (= ``SerializeToString(deterministic=True)``); ``layout`` (a
    ``ResultLayout``) and ``dense_shape`` describe per-sample ``[B]`` tensors (see the .proto)."""
    return b"".join(result_pieces(advantages, returns, metrics, layout, dense_shape))


def result_pieces(advantages: Any, returns: Any = None, metrics: Mapping[str, float] | None = None,
                  layout: int = 0, dense_shape: Iterable[int] = ()) -> list[Any]:
    """The pieces whose concatenation is :func:`encode_result`'s output (headers and tensor views)."""
    pieces: list[Any] = []
    if advantages is not None:
        pieces += _message_field(1, *_tensor_pieces(*tensor_parts(advantages, "advantages")))[0]
    if returns is not None:
        pieces += _message_field(2, *_tensor_pieces(*tensor_parts(returns, "returns")))[0]
    for key in _sorted_keys(metrics or {}):
        v = float(metrics[key])  # type: ignore[index]
        kb = key.encode("utf-8")
        entry = b"\x0a" + varint(len(kb)) + kb + b"\x11" + np.float64(v).astype("<f8").tobytes()
        pieces += [b"\x1a" + varint(len(entry)), entry]
    if layout:
        pieces.append(b"\x20" + varint(layout))
    dims = list(dense_shape)
    if dims:
        packed = b"".join(varint(d) for d in dims)
        pieces.append(b"\x2a" + varint(len(packed)) + packed)
    return pieces


def result_from_message(msg: pb.AdvantageResult) -> bytes:
    return encode_result(msg.advantages if msg.HasField("advantages") else None,
                         msg.returns if msg.HasField("returns") else None, dict(msg.metrics), msg.layout,
                         msg.dense_shape)


@dataclass
class DecodedResult:
    """A parsed ``AdvantageResult`` (tensors as :class:`TensorView`\\ s into the buffer); ``layout``: the
    ``ResultLayout`` (0 = dense), ``dense_shape``: the ``[B, T]`` shape per-sample values stand for."""

    advantages: TensorView | None = None
    returns: TensorView | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    layout: int = 0
    dense_shape: list[int] = field(default_factory=list)

    def HasField(self, name: str) -> bool:  # noqa: N802
        return getattr(self, name) is not None

    def to_message(self) -> pb.AdvantageResult:
        msg = pb.AdvantageResult()
        if self.advantages is not None:
            msg.advantages.CopyFrom(self.advantages.to_message())
        if self.returns is not None:
            msg.returns.CopyFrom(self.returns.to_message())
        msg.metrics.update(self.metrics)
        msg.layout = self.layout
        msg.dense_shape.extend(self.dense_shape)
        return msg


def decode_result(data: Any) -> DecodedResult:
    """Parse a serialized ``AdvantageResult`` without copying tensor payloads."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    out = DecodedResult()
    for number, wt, value, start, stop in _fields(buf, 0, buf.nbytes):
        if number in (1, 2) and wt == _LEN:
            name = "advantages" if number == 1 else "returns"
            t = getattr(out, name) or TensorView()
            setattr(out, name, _merge_tensor(t, buf, start, stop))
        elif number == 3 and wt == _LEN:
            key, value, unknown = b"", 0.0, False
            for n, w, _, s, e in _fields(buf, start, stop):
                if n == 1 and w == _LEN:
                    key = buf[s:e]
                elif n == 2 and w == _I64:
                    value = float(np.frombuffer(buf[s:e], dtype="<f8")[0])
                else:
                    unknown = True
            try:
                text = bytes(key).decode("utf-8")
            except UnicodeDecodeError:
                raise CodecError("a metrics key is not valid UTF-8") from None
            if not unknown:
                out.metrics[text] = value
        elif number == 4 and wt == _VARINT:
            out.layout = _int32(value)
        elif number == 5 and wt in (_VARINT, _LEN):
            _add_int64s(out.dense_shape, buf, wt, value, start, stop)
    return out


# -------------------------------------------------------------------------------------- chunk messages
def encode_chunk(total_size: int, data: Any) -> bytes:
    """A serialized ``ComputeAdvantageChunk`` / ``AdvantageResultChunk`` (same layout)."""
    n = memoryview(data).nbytes
    head = (b"\x08" + varint(total_size) if total_size else b"") + (b"\x12" + varint(n) if n else b"")
    return b"".join((head, data)) if n else head


def pieces_size(pieces: Iterable[Any]) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def iter_chunks(pieces: list[Any], chunk_bytes: int, total: int | None = None) -> Iterator[bytes]:
    """Serialized chunk messages carrying the concatenation of ``pieces`` (``total`` bytes; computed when
    None) in ``chunk_bytes`` slices: ``total_size`` on the first chunk. Each chunk is built with one copy
    of its slice of the pieces (``bytes.join`` over memoryview slices); the concatenation itself is never
    built. The same messages as ``encode_chunk`` over ``b"".join(pieces)`` sliced every ``chunk_bytes``."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    views = [memoryview(p).cast("B") for p in pieces]
    views = [v for v in views if v.nbytes]
    if total is None:
        total = sum(v.nbytes for v in views)
    if total == 0:
        yield b""  # one empty chunk: total_size 0, no data
        return
    i = off = sent = 0
    while sent < total:
        n = min(chunk_bytes, total - sent)
        parts: list[Any] = [(b"\x08" + varint(total) if sent == 0 else b"") + b"\x12" + varint(n)]
        need = n
        while need:
            if i >= len(views):
                raise ValueError(f"the pieces hold {sent + n - need} bytes, fewer than the announced {total}")
            v = views[i]
            take = min(need, v.nbytes - off)
            parts.append(v[off:off + take])
            off += take
            need -= take
            if off == v.nbytes:
                i, off = i + 1, 0
        sent += n
        yield b"".join(parts)
    if i < len(views):
        raise ValueError(f"the pieces hold more than the announced {total} bytes")


#: fields one chunk message may hold (it has two; unknown ones count): a chunk of megabytes of empty fields
#: is refused after these instead of costing a Python loop over them
MAX_CHUNK_FIELDS = 1024


def decode_chunk(data: Any) -> tuple[int, memoryview]:
    """(total_size, data view) of a serialized chunk message."""
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    total, payload = 0, buf[0:0]
    for number, wt, value, start, stop in _fields(buf, 0, buf.nbytes, [MAX_CHUNK_FIELDS, MAX_CHUNK_FIELDS]):
        if number == 1 and wt == _VARINT:
            total = value
        elif number == 2 and wt == _LEN:
            payload = buf[start:stop]
    return total, payload
