"""The asyncio client: :class:`AsyncAdvantageClient`, on ``grpc.aio``.

    from advantage_client import AsyncAdvantageClient

    async with AsyncAdvantageClient("localhost:50051", timeout=30.0) as client:
        result = await client.compute("grpo", {"normalize_rewards": True},
                                      prompt_ids=ids, rewards=rewards, mask=mask)
        results = await asyncio.gather(*(client.compute("grpo", None, **group) for group in groups))

The same constructor options, requests, results and errors as :class:`advantage_client.AdvantageClient`
(one address, a list of replicas or a DNS name; TLS, mutual TLS, a bearer token; a deadline; UNAVAILABLE
retried with backoff on another replica; per-sample results and compact masks), built by the same code
(:func:`advantage_client.client.prepare_call`, :func:`~advantage_client.client.finish_result`,
:func:`advantage_client.channel.make_channel`). Every call runs on the event loop the client was created
in: create and use it inside one loop (``asyncio.run``), many calls at once from that loop
(``asyncio.gather``) share one HTTP/2 connection per replica.

Transports: ``"unary"``, ``"stream"`` (chunked ``ComputeAdvantageStream``) and ``"auto"`` (stream from
``stream_threshold_mb`` up, unary below). Shared memory is not offered here (``transport="shm"`` raises
``ValueError``): its regions are the sync client's, one call at a time each; a trainer on the server's
host that wants it uses :class:`~advantage_client.AdvantageClient` (from a thread: ``asyncio.to_thread``).
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Sequence

import grpc

from advantage_client import codec, streaming
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.channel import auth_metadata, channel_target, make_channel
from advantage_client.client import (
    AdvantageResult, AdvantageServiceError, check_timeout, finish_result, lengths_refused, not_ready, prepare_call,
    stream_refused,
)

#: the transports :class:`AsyncAdvantageClient` offers
TRANSPORTS = ("auto", "unary", "stream")
#: calls of one :class:`AsyncAdvantageClient` on the wire at once (the server's default --max-concurrent-requests)
DEFAULT_MAX_IN_FLIGHT = 32

_last_transport: contextvars.ContextVar[str | None] = contextvars.ContextVar("advantage_last_transport", default=None)


class AsyncAdvantageClient:
    """Connection to the advantage service for asyncio code; use ``async with`` or ``await client.close()``.

    target, timeout, max_message_mb, tls, tls_ca, tls_cert, tls_key, tls_server_name, token, token_file,
    retry, wait_for_ready, stream_threshold_mb, chunk_mb, compact: as :class:`advantage_client.AdvantageClient`.
    channel: a ``grpc.aio.Channel`` to use instead of making one (closed by :meth:`close`).
    transport: ``"auto"`` (default), ``"unary"`` or ``"stream"``; ``"shm"`` raises ``ValueError`` (see the
             module docstring).
    max_in_flight: at most this many calls of this client on the wire at once (default 32, the server's
             default ``--max-concurrent-requests``); more (an ``asyncio.gather`` over many groups) wait
             their turn here, in arrival order, instead of being refused (RESOURCE_EXHAUSTED). None: no limit.
             A call's deadline (``timeout``) starts when it is sent.
    Raises ``ValueError`` for bad options (unknown transport, half a client certificate, an unreadable
    token file, ...). Create it inside the event loop that will await its calls.
    """

    def __init__(self, target: str | Sequence[str], timeout: float | None = 60.0, *, max_message_mb: int = 1024,
                 channel: Any = None, tls: bool = False, tls_ca: Any = None, tls_cert: Any = None,
                 tls_key: Any = None, tls_server_name: str | None = None, token: str | None = None,
                 token_file: Any = None, retry: bool = True, wait_for_ready: bool = False,
                 transport: str = "auto", stream_threshold_mb: float = streaming.DEFAULT_STREAM_THRESHOLD_MB,
                 chunk_mb: float = streaming.DEFAULT_CHUNK_MB, compact: bool = True,
                 max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT):
        if max_in_flight is not None and (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
                                          or max_in_flight < 1):
            raise ValueError(f"max_in_flight={max_in_flight!r}: give an integer >= 1, or None for no limit")
        self.max_in_flight = max_in_flight
        self._in_flight = asyncio.Semaphore(max_in_flight) if max_in_flight is not None else None
        self.compact = bool(compact)
        self.transport = self._checked_transport(transport)
        self.target = channel_target(target)
        self.timeout = check_timeout(timeout)
        self.max_message_bytes = int(max_message_mb * (1 << 20))
        self.stream_threshold_bytes = int(stream_threshold_mb * (1 << 20))
        self.chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
        self._metadata = auth_metadata(token, token_file)
        self._channel_args = dict(max_message_mb=max_message_mb, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                                  tls_key=tls_key, tls_server_name=tls_server_name, retry=retry,
                                  wait_for_ready=wait_for_ready, aio=True)
        self._own_stream_channel = channel is None
        self._channel = channel or make_channel(self.target, **self._channel_args)
        self._stream_channel: Any = None if channel is None else channel
        self._stub = pb_grpc.AdvantageServiceStub(self._channel)
        self._unary = self._channel.unary_unary(streaming.COMPUTE, request_serializer=None,
                                                response_deserializer=streaming.decode_writable)
        self._stream: Any = None
        self._lengths_ok = True

    @classmethod
    async def from_ray(cls, name: str = "advantage", namespace: str = "advantage", *, address: str | None = None,
                       refresh_s: float | None = 10.0, lookup_timeout: float = 5.0, wait_s: float = 30.0,
                       **kwargs: Any) -> Any:
        """``await AsyncAdvantageClient.from_ray(namespace=...)``: the asyncio twin of
        :meth:`advantage_client.AdvantageClient.from_ray` (same arguments; ``kwargs`` are this class's options).
        Returns an :class:`advantage_client.ray_discovery.AsyncRayClient`; the look-ups run in a thread, the
        periodic one as a task of the running loop. ``ray`` is imported only here."""
        from advantage_client import ray_discovery
        return await ray_discovery.AsyncRayClient.create(
            cls, name=name, namespace=namespace, address=address, refresh_s=refresh_s,
            lookup_timeout=lookup_timeout, wait_s=wait_s, **kwargs)

    @staticmethod
    def _checked_transport(transport: str) -> str:
        if transport == "shm":
            raise ValueError("transport='shm': the asyncio client does not use shared memory; choose 'auto', "
                             "'unary' or 'stream', or use AdvantageClient (from a thread) for shared memory")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: choose one of {TRANSPORTS}")
        return transport

    def _stream_callable(self) -> Any:
        # streams get a channel of their own with a small retry buffer, as in the sync client (see there)
        if self._stream is None:
            if self._stream_channel is None:
                self._stream_channel = make_channel(
                    self.target, **{**self._channel_args, "retry_buffer_mb": streaming.STREAM_RETRY_BUFFER_MB})
            self._stream = self._stream_channel.stream_stream(streaming.COMPUTE_STREAM, request_serializer=None,
                                                              response_deserializer=codec.decode_chunk)
        return self._stream

    async def _send(self, transport: str, data: streaming.Request) -> codec.DecodedResult:
        _last_transport.set(transport)
        if transport == "unary":
            return await self._unary(data.tobytes(), timeout=self.timeout, metadata=self._metadata)
        call = self._stream_callable()(data.chunks(self.chunk_bytes), timeout=self.timeout, metadata=self._metadata)
        out = streaming.Reassembler()
        async for total, chunk in call:
            out.feed(total, chunk)
        return codec.decode_result(memoryview(out.finish()))

    async def compute(self, estimator: str, config: Any = None, *, output_dtype: Any = None, as_numpy: bool = False,
                      cu_seqlens: Any = None, transport: str | None = None, per_sample: bool = False,
                      **tensors: Any) -> AdvantageResult:
        """``await`` one estimator run: arguments, result and errors as
        :meth:`advantage_client.AdvantageClient.compute` (``rewards`` ``[B]`` or ``[B, T]``, ``mask``
        ``[B, T]``, ...; advantages ``[B, T]`` float32 by default, ``[B]`` with ``per_sample=True`` where the
        estimator gives one value per row), without shared memory.

        Raises ``wire.WireError`` (a ``ValueError``) for arguments that cannot be encoded, ``ValueError`` for
        an unknown transport, and :class:`AdvantageServiceError` for every error the server reports
        (:class:`InvalidArgumentError`, also a ``ValueError``, for INVALID_ARGUMENT; UNAVAILABLE after the
        retries; DEADLINE_EXCEEDED after ``timeout``). Cancelling the awaiting task cancels the call.
        """
        transport = self._checked_transport(transport or self.transport)
        prepared = prepare_call(estimator, config, output_dtype, cu_seqlens, per_sample, tensors,
                                compact=self.compact, as_lengths=self._lengths_ok)
        if self._in_flight is None:
            return await self._compute_prepared(prepared, transport, as_numpy, estimator, config, output_dtype,
                                                cu_seqlens, per_sample, tensors)
        async with self._in_flight:  # queued here beyond max_in_flight calls at once
            return await self._compute_prepared(prepared, transport, as_numpy, estimator, config, output_dtype,
                                                cu_seqlens, per_sample, tensors)

    async def _compute_prepared(self, prepared: Any, transport: str, as_numpy: bool, estimator: str, config: Any,
                                output_dtype: Any, cu_seqlens: Any, per_sample: bool,
                                tensors: dict[str, Any]) -> AdvantageResult:
        try:
            return await self._send_prepared(prepared, transport, as_numpy)
        except AdvantageServiceError as err:
            if not lengths_refused(err, prepared):
                raise
            self._lengths_ok = False  # a server that predates `lengths`: masks go as bytes from now on
            prepared = prepare_call(estimator, config, output_dtype, cu_seqlens, per_sample, tensors,
                                    compact=self.compact, as_lengths=False)
            return await self._send_prepared(prepared, transport, as_numpy)

    async def _send_prepared(self, prepared: Any, transport: str, as_numpy: bool) -> AdvantageResult:
        data = prepared.request
        auto = transport == "auto"
        if auto:
            transport = "stream" if data.nbytes >= self.stream_threshold_bytes else "unary"
        try:
            reply = await self._send(transport, data)
        except grpc.RpcError as err:
            error = AdvantageServiceError.from_rpc_error(err, self.target, self.timeout)
            if not (auto and transport == "stream" and stream_refused(error, data.nbytes, self.max_message_bytes)):
                raise error from None
            try:
                reply = await self._send("unary", data)
            except grpc.RpcError as err2:
                raise AdvantageServiceError.from_rpc_error(err2, self.target, self.timeout) from None
        return finish_result(reply, prepared, as_numpy=as_numpy)

    async def list_estimators(self) -> pb.ListEstimatorsResponse:
        """Every estimator the server runs, with its config fields, inputs and per-sample layouts.
        Raises :class:`AdvantageServiceError` (UNAVAILABLE, UNAUTHENTICATED, ...) when the call fails."""
        try:
            return await self._stub.ListEstimators(pb.ListEstimatorsRequest(), timeout=self.timeout,
                                                   metadata=self._metadata)
        except grpc.RpcError as err:
            raise AdvantageServiceError.from_rpc_error(err, self.target, self.timeout) from None

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the channel is connected; raises :class:`AdvantageServiceError` (UNAVAILABLE) after
        ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise not_ready(self.target, timeout) from None

    @property
    def last_transport(self) -> str | None:
        """The transport the current task's latest :meth:`compute` used (``"unary"`` or ``"stream"``)."""
        return _last_transport.get()

    async def close(self) -> None:
        """Close the channels (calls in flight are cancelled)."""
        if self._own_stream_channel and self._stream_channel is not None:
            await self._stream_channel.close()
            self._stream_channel = None
        await self._channel.close()

    async def __aenter__(self) -> "AsyncAdvantageClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
