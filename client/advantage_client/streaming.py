"""Client side of the transports: codec unary calls, client streaming, and transport selection.

``AdvantageClient.compute`` encodes the request once with :mod:`advantage_client.codec` and then sends it

* ``"unary"``: as one ``ComputeAdvantage`` message (up to the channel's ``max_message_mb``);
* ``"stream"``: through ``ComputeAdvantageStream`` in chunks of ``chunk_mb`` MiB, the result coming back
  the same way: faster for big payloads, and the only way past protobuf's 2 GiB message cap;
* ``"shm"``: through shared memory (:mod:`advantage_client.shm`), for a server on the same host;
* ``"auto"`` (default): ``"stream"`` at or above ``stream_threshold_mb``, else ``"unary"``.

Results are decoded without copying: tensors are views of the received buffer.
"""
from __future__ import annotations

from typing import Any, Iterator

import grpc

from advantage_client import codec, wire

COMPUTE = "/advantage.v1.AdvantageService/ComputeAdvantage"
COMPUTE_STREAM = "/advantage.v1.AdvantageService/ComputeAdvantageStream"
TRANSPORTS = ("auto", "unary", "stream", "shm")
DEFAULT_STREAM_THRESHOLD_MB = 64
DEFAULT_CHUNK_MB = 4


def build_request_bytes(estimator: str, config: Any = None, output_dtype: Any = None, cu_seqlens: Any = None,
                        **tensors: Any) -> bytes:
    """The serialized ``ComputeAdvantageRequest`` that ``client.build_request(...).SerializeToString(
    deterministic=True)`` would give, built with one copy of each tensor."""
    from advantage_client.client import reduce_prompt_ids

    cfg = wire.config_message(estimator, config)  # WireError for an unknown estimator
    code = wire.dtype_code(output_dtype) if output_dtype is not None else 0
    inputs = {k: (reduce_prompt_ids(v) if k == "prompt_ids" else v) for k, v in tensors.items() if v is not None}
    return codec.encode_request(estimator, cfg, inputs, code, cu_seqlens)


def _chunks(data: Any, chunk_bytes: int) -> Iterator[bytes]:
    view = memoryview(data).cast("B")
    total = view.nbytes
    for i in range(0, max(total, 1), chunk_bytes):
        yield codec.encode_chunk(total if i == 0 else 0, view[i:i + chunk_bytes])


def reassemble(chunks: Iterator[tuple[int, memoryview]]) -> bytearray:
    """Chunks ``(total_size, data)`` -> one buffer allocated once from the first chunk's total."""
    buf: bytearray | None = None
    pos = 0
    for total, data in chunks:
        if buf is None:
            buf = bytearray(total)
        n = data.nbytes
        if pos + n > len(buf):
            raise codec.CodecError(f"the result chunks hold more than the announced {len(buf)} bytes")
        buf[pos:pos + n] = data
        pos += n
    if buf is None or pos != len(buf):
        raise codec.CodecError(f"the result stream ended after {pos} of {0 if buf is None else len(buf)} bytes")
    return buf


class Calls:
    """The raw-bytes calls on one channel (request bytes in, :class:`codec.DecodedResult` out)."""

    def __init__(self, channel: grpc.Channel, chunk_mb: int = DEFAULT_CHUNK_MB):
        self.chunk_bytes = chunk_mb << 20
        self._unary = channel.unary_unary(COMPUTE, request_serializer=None, response_deserializer=codec.decode_result)
        self._stream = channel.stream_stream(COMPUTE_STREAM, request_serializer=None,
                                             response_deserializer=codec.decode_chunk)

    def unary(self, data: bytes, **kwargs: Any) -> codec.DecodedResult:
        return self._unary(data, **kwargs)

    def stream(self, data: Any, **kwargs: Any) -> codec.DecodedResult:
        return codec.decode_result(reassemble(self._stream(_chunks(data, self.chunk_bytes), **kwargs)))
