"""Client side of the transports: codec unary calls, client streaming, and transport selection.

``AdvantageClient.compute`` describes the request with :mod:`advantage_client.codec` as pieces (small
headers and views of the tensors, nothing copied) and then sends it

* ``"unary"``: as one ``ComputeAdvantage`` message (up to the channel's ``max_message_mb``), the pieces
  joined once (gRPC Python sends ``bytes``);
* ``"stream"``: through ``ComputeAdvantageStream`` in chunks of ``chunk_mb`` MiB, each chunk message built
  with one copy of its slice of the pieces (the whole request is never materialised); the result comes
  back the same way and is reassembled into one numpy buffer: faster for big payloads, and the only way
  past protobuf's 2 GiB message cap;
* ``"shm"``: through shared memory (:mod:`advantage_client.shm`), for a server on the same host;
* ``"auto"`` (default): shared memory when the server accepts a region (probed once per client, the
  answer remembered), else ``"stream"`` at or above ``stream_threshold_mb`` and ``"unary"`` below.

Results are decoded without copying: tensors are views of the received buffer.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import grpc
import numpy as np

from advantage_client import codec, wire

COMPUTE = "/advantage.v1.AdvantageService/ComputeAdvantage"
COMPUTE_STREAM = "/advantage.v1.AdvantageService/ComputeAdvantageStream"
TRANSPORTS = ("auto", "unary", "stream", "shm")
DEFAULT_STREAM_THRESHOLD_MB = 16
DEFAULT_CHUNK_MB = 4
#: how much of a streamed request gRPC keeps for a retry (see ``AdvantageClient``)
STREAM_RETRY_BUFFER_MB = 8
#: transport="auto" thresholds, from runs on 2 cores (GAE, T = 1024; BENCHMARKS.md): unary and stream tie from
#: 8 to 24 MiB (unary 21-35 ms vs stream 22-31 ms at 8 MiB, 42-66 vs 39-66 ms at 16 MiB) and unary falls off a
#: cliff by 32 MiB (175-415 ms vs 80-156 ms): the stream from 16 MiB. Shared memory beats unary from about
#: 128 KiB (at 64 KiB 1.7 vs 1.7 ms, at 2 MiB 4 vs 12 ms). Above shm_max_mb the region would pin the inputs
#: and the outputs (2-3x the request) in /dev/shm for the client's lifetime: such requests stream.
DEFAULT_SHM_MIN_MB = 0.125
DEFAULT_SHM_MAX_MB = 1024


def numel_estimate(value: Any) -> int:
    """Elements of a tensor-like (without converting torch or numpy tensors)."""
    if hasattr(value, "numel") and callable(value.numel):
        return int(value.numel())
    if hasattr(value, "size") and isinstance(getattr(value, "size"), int):
        return int(value.size)
    return int(np.asarray(value).size)


def payload_estimate(tensors: dict[str, Any]) -> int:
    """Bytes the tensors will take on the wire (without encoding them)."""
    total = 0
    for v in tensors.values():
        if v is None:
            continue
        if hasattr(v, "element_size") and hasattr(v, "numel"):
            total += int(v.numel()) * int(v.element_size())
        elif hasattr(v, "nbytes"):
            total += int(v.nbytes)
        else:
            total += int(np.asarray(v).nbytes)
    return total


def _request_args(estimator: str, config: Any, output_dtype: Any, tensors: dict[str, Any]) -> tuple[Any, int, dict]:
    cfg = wire.config_message(estimator, config)  # WireError for an unknown estimator
    code = wire.output_dtype_code(output_dtype) if output_dtype is not None else 0
    inputs = {k: (wire.reduce_prompt_ids(v, k) if k in wire.LABEL_INPUTS else v) for k, v in tensors.items()
              if v is not None}
    return cfg, code, inputs


def build_request_pieces(estimator: str, config: Any = None, output_dtype: Any = None, cu_seqlens: Any = None,
                         *, per_sample: bool = False, mask_columns: int = 0, **tensors: Any) -> list[Any]:
    """The pieces (headers and tensor views) of :func:`build_request_bytes`, nothing joined."""
    cfg, code, inputs = _request_args(estimator, config, output_dtype, tensors)
    return codec.request_pieces(estimator, cfg, inputs, code, cu_seqlens, per_sample, mask_columns)


def build_request_bytes(estimator: str, config: Any = None, output_dtype: Any = None, cu_seqlens: Any = None,
                        *, per_sample: bool = False, mask_columns: int = 0, **tensors: Any) -> bytes:
    """The serialized ``ComputeAdvantageRequest`` that ``client.build_request(...).SerializeToString(
    deterministic=True)`` would give, built with one copy of each tensor."""
    return b"".join(build_request_pieces(estimator, config, output_dtype, cu_seqlens, per_sample=per_sample,
                                         mask_columns=mask_columns, **tensors))


class Request:
    """One encoded call: the request's pieces (headers and tensor views) and its byte length; joined into
    bytes only for a unary call, sliced straight into chunk messages for a stream."""

    def __init__(self, pieces: list[Any]):
        self.pieces = pieces
        self.nbytes = codec.pieces_size(pieces)

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        return b"".join(self.pieces)

    def chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        return codec.iter_chunks(self.pieces, chunk_bytes, self.nbytes)


def _as_request(data: Any) -> Request:
    return data if isinstance(data, Request) else Request([data])


class Reassembler:
    """Chunks ``(total_size, data)`` fed one at a time -> one ``uint8`` numpy buffer allocated once from the
    first chunk's total (numpy backs large buffers with transparent huge pages: a fresh 256 MiB buffer costs
    ~35 ms of page faults instead of ~150 ms for a ``bytearray``). Used by :func:`reassemble` and by the
    asyncio client, which receives the chunks with ``async for``. Raises ``codec.CodecError`` for chunks
    holding more, or (at :meth:`finish`) fewer, bytes than announced."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.pos = 0

    def feed(self, total: int, data: memoryview) -> int:
        """Copy one chunk in; returns its byte count."""
        if self.buf is None:
            self.buf = np.empty(total, np.uint8)
        n = data.nbytes
        if self.pos + n > self.buf.size:
            raise codec.CodecError(f"the result chunks hold more than the announced {self.buf.size} bytes")
        if n:
            self.buf[self.pos:self.pos + n] = np.frombuffer(data, np.uint8)
        self.pos += n
        return n

    def finish(self) -> np.ndarray:
        if self.buf is None or self.pos != self.buf.size:
            size = 0 if self.buf is None else self.buf.size
            raise codec.CodecError(f"the result stream ended after {self.pos} of {size} bytes")
        return self.buf


def reassemble(chunks: Iterator[tuple[int, memoryview]], on_chunk: Any = None) -> np.ndarray:
    """Chunks ``(total_size, data)`` -> one ``uint8`` numpy buffer (see :class:`Reassembler`).
    ``on_chunk(nbytes)`` is called after each chunk."""
    out = Reassembler()
    for total, data in chunks:
        n = out.feed(total, data)
        if on_chunk is not None:
            on_chunk(n)
    return out.finish()


def _chunks(data: Any, chunk_bytes: int) -> Iterator[bytes]:
    return _as_request(data).chunks(chunk_bytes)


#: initial-metadata key of the server's timing for a streamed call (seconds, see :func:`parse_timing`)
TIMING_KEY = "advantage-timing"


def parse_timing(value: str | None) -> dict[str, float]:
    """``"recv=0.41;compute=0.12"`` -> ``{"recv": 0.41, "compute": 0.12}`` (unknown or bad entries skipped)."""
    out: dict[str, float] = {}
    for item in (value or "").split(";"):
        key, _, number = item.partition("=")
        try:
            out[key.strip()] = float(number)
        except ValueError:
            continue
    return out


def decode_writable(data: bytes) -> codec.DecodedResult:
    """A unary reply -> its result, decoded from a writable copy of the reply: gRPC hands the reply over as
    immutable ``bytes``, and results must be writable whichever transport brought them (the streamed and
    shared-memory results are). One copy of the reply, into a numpy buffer (huge pages when large)."""
    buf = np.empty(len(data), np.uint8)
    buf[:] = np.frombuffer(data, np.uint8)
    return codec.decode_result(memoryview(buf))


class Calls:
    """The raw-bytes calls on one channel (a :class:`Request` or bytes in, :class:`codec.DecodedResult` out).

    ``last_timing`` (per thread) describes the calling thread's latest streamed call: ``start``, ``first``
    (first result chunk received), ``end`` (``time.perf_counter`` values), ``request_bytes``,
    ``response_bytes``, ``first_chunk_bytes`` and the server's ``server_recv`` / ``server_compute`` seconds
    when it sent them."""

    def __init__(self, channel: grpc.Channel, chunk_mb: float = DEFAULT_CHUNK_MB, stream_channel: Any = None):
        """``stream_channel``: a function returning the channel for streamed calls (made on first use and
        closed by :meth:`close`); None: ``channel``."""
        self.chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
        self._unary = channel.unary_unary(COMPUTE, request_serializer=None, response_deserializer=decode_writable)
        self._channel = channel
        self._make_stream_channel = stream_channel
        self._stream_channel: grpc.Channel | None = None
        self._stream_callable: Any = None
        self._lock = threading.Lock()
        self._local = threading.local()

    def channel_of(self, transport: str) -> grpc.Channel:
        """The channel a ``"unary"`` or ``"stream"`` call went on (the streams' own once made): whether it is
        connected tells a DEADLINE_EXCEEDED error's hint (``errors.connected``)."""
        return (self._stream_channel or self._channel) if transport == "stream" else self._channel

    def _stream(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream_callable is None:
            with self._lock:
                if self._stream_callable is None:
                    channel = self._channel
                    if self._make_stream_channel is not None:
                        channel = self._stream_channel = self._make_stream_channel()
                    self._stream_callable = channel.stream_stream(COMPUTE_STREAM, request_serializer=None,
                                                                  response_deserializer=codec.decode_chunk)
        return self._stream_callable(*args, **kwargs)

    def close(self) -> None:
        with self._lock:
            if self._stream_channel is not None:
                self._stream_channel.close()
                self._stream_channel = None

    @property
    def last_timing(self) -> dict[str, float]:
        return getattr(self._local, "timing", {})

    def unary(self, data: Any, **kwargs: Any) -> codec.DecodedResult:
        if isinstance(data, Request):
            data = data.tobytes()
        return self._unary(data, **kwargs)

    def stream(self, data: Any, **kwargs: Any) -> codec.DecodedResult:
        request = _as_request(data)
        timing: dict[str, float] = {"start": time.perf_counter(), "request_bytes": request.nbytes}
        call = self._stream(request.chunks(self.chunk_bytes), **kwargs)

        def on_chunk(n: int) -> None:
            if "first" not in timing:
                timing["first"] = time.perf_counter()
                timing["first_chunk_bytes"] = n

        buf = reassemble(call, on_chunk)
        timing["end"] = time.perf_counter()
        timing["response_bytes"] = buf.size
        try:
            server = parse_timing(dict(call.initial_metadata() or ()).get(TIMING_KEY))
        except Exception:  # noqa: BLE001 - timing is informational
            server = {}
        timing.update({f"server_{k}": v for k, v in server.items()})
        self._local.timing = timing
        return codec.decode_result(memoryview(buf))
