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

Coalescing (opt-in, ``coalesce_ms > 0``; issue #12): a trainer that awaits one small ``compute`` per prompt
group as groups finish pays gRPC's per-call CPU cost (about 1 ms across client and server) per group. With
``coalesce_ms`` set, a call is held up to that long and sent together with the other compatible calls waiting
then, as ONE request: their rows concatenated, each call's ``prompt_ids`` reduced to group ids and offset so
that groups of different calls never merge; the result is split back into each call's rows. Only estimators
and configs the server declares group-local (``EstimatorInfo.group_local``, read once with
:meth:`AsyncAdvantageClient.list_estimators`: each row's result depends on its own prompt group only, so the
split is bit-identical to calls sent alone; ``tests/test_coalesce.py``) are merged; others go alone.
"""
from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import re
import time
from typing import Any, Coroutine, Sequence

import numpy as np

import grpc

from advantage_client import codec, masks, streaming, wire
from advantage_client import conditions as conditions_mod
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.channel import (
    auth_metadata, cached_replica_count, channel_target, make_channel, replica_count, replica_targets,
    warn_plaintext_token,
)
from advantage_client.client import (
    CLIENT_TIMEOUT, AdvantageResult, AdvantageServiceError, Failover, admission_refused, call_timeout, check_inputs,
    check_timeout, finish_result, lengths_refused, not_ready, prepare_call, stream_refused,
)
from advantage_client.errors import hint

#: the transports :class:`AsyncAdvantageClient` offers
TRANSPORTS = ("auto", "unary", "stream")
#: calls of one :class:`AsyncAdvantageClient` on the wire at once (the server's default --max-concurrent-requests)
DEFAULT_MAX_IN_FLIGHT = 32
#: rows of one coalesced request at most (``coalesce_max_rows``)
DEFAULT_COALESCE_MAX_ROWS = 4096
#: errors of a coalesced request that say nothing about its inputs: every caller gets them as they are
#: (so does an admission refusal, see :func:`_shared_error`; any other error, INVALID_ARGUMENT above all, makes
#: each call go again alone to get its own answer)
_SHARED_ERRORS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.CANCELLED})

_last_transport: contextvars.ContextVar[str | None] = contextvars.ContextVar("advantage_last_transport", default=None)

#: the rule :class:`EventLoopError` states
LOOP_RULE = ("create AsyncAdvantageClient inside the event loop that awaits it (e.g. inside your async main, or "
             "`async with AsyncAdvantageClient(...)`)")



def status_lost(err: grpc.RpcError) -> bool:
    """Whether a streamed call's ``err`` is grpc.aio's own INTERNAL "Internal error from Core": its request
    writer's send failed because the server had ended the call (a refusal before the body is read), and grpc.aio
    set this status in place of the server's (grpc/aio/_call.py, ``_write``: ``set_internal_error``). Measured
    against a server refusing at once: 2 of 20 one-chunk calls, 5 of 10 calls of 16 chunks. The server sends
    INTERNAL with a message of its own, never this one."""
    return err.code() == grpc.StatusCode.INTERNAL and (err.details() or "") == "Internal error from Core"

class EventLoopError(RuntimeError):
    """An :class:`AsyncAdvantageClient` used from an event loop other than the one its channel belongs to: it was
    created outside the loop that awaits it (at import time, in another thread, or in an earlier
    ``asyncio.run``). asyncio's own words for it ("attached to a different loop") name no fix; this error does."""


class AsyncAdvantageClient:
    """Connection to the advantage service for asyncio code; use ``async with`` or ``await client.close()``.

    target, timeout, max_message_mb, tls, tls_ca, tls_cert, tls_key, tls_server_name, token, token_file,
    retry, wait_for_ready, stream_threshold_mb, chunk_mb, compact, failover: as
    :class:`advantage_client.AdvantageClient` (failover: an admission refusal with the server's retry pushback
    sent again after it, to another replica when there are several; with several, an attempt whose connection
    failed, e.g. a hung replica found by the keepalive, sent once more to another; every attempt has the whole
    deadline left; ``advantage_client.client.Failover``; a coalesced request is sent again as one request).
    channel: a ``grpc.aio.Channel`` to use instead of making one (closed by :meth:`close`).
    channel_options: more gRPC channel arguments, added to the client's own on every channel it makes.
    transport: ``"auto"`` (default), ``"unary"`` or ``"stream"``; ``"shm"`` raises ``ValueError`` (see the
             module docstring).
    max_in_flight: at most this many calls of this client on the wire at once (default 32, the server's
             default ``--max-concurrent-requests``); more (an ``asyncio.gather`` over many groups) wait
             their turn here, in arrival order, instead of being refused (RESOURCE_EXHAUSTED). None: no limit.
             A call's deadline (``timeout``) starts when it is sent.
    coalesce_ms: 0 (default): every ``compute`` is its own request. > 0: a call that can be coalesced (see
             the module docstring: ``prompt_ids`` and a ``[B, T]`` ``mask``, no ``cu_seqlens``, every input with
             ``B`` leading rows, numpy/torch/list tensors, an estimator and config the server declares
             group-local) waits at most this many milliseconds for compatible calls, then all go as one
             request. Compatible: same estimator, config, output_dtype, per_sample, as_numpy and transport,
             same input names and dtypes and trailing shapes (so the same mask width T); ``prompt_ids`` may
             differ in kind (they are reduced to group ids first). Each caller gets what it would get alone:
             its rows of the advantages/returns (row views of the merged result), the same layout, no
             metrics (estimators with metrics are never group-local). If the merged request fails with an
             error about its inputs (INVALID_ARGUMENT, RESOURCE_EXHAUSTED for a size limit or out of memory,
             ..., or an encoding ValueError), each call is sent again alone, so each caller gets its own
             answer or error; UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, PERMISSION_DENIED, CANCELLED
             and the server's admission refusal (RESOURCE_EXHAUSTED with a retry pushback, answered before
             the request is read; the merged request is first sent again after the pushback, as one request)
             reach every caller as they are, once: the server saw one request and refused it once (sending N
             calls into a full server would multiply the load that made it refuse). The config and the
             tensors are captured when ``compute`` is called (a later change to the caller's dict or buffers
             changes nothing, see :meth:`compute`). A cancelled waiting caller is left out of the request.
             ``last_transport`` is not set for coalesced calls.
    coalesce_max_rows: a batch is sent at once when it reaches this many rows (default 4096); a call that
             would take it past the cap sends the waiting batch first; a call with more rows goes alone.
    Raises ``ValueError`` for bad options (unknown transport, half a client certificate, an unreadable
    token file, a target without a port, ...). Create it inside the event loop that will await its calls: a
    client made where no loop runs belongs to the thread's current loop (``asyncio.get_event_loop()``, made
    there and then at import time), and awaiting it from another loop (``asyncio.run`` makes a new one each
    time) raises :class:`EventLoopError` (a ``RuntimeError``) saying so, at the first call; so does creating
    it in a thread that has no event loop at all.
    """

    def __init__(self, target: str | Sequence[str], timeout: float | None = 60.0, *, max_message_mb: int = 1024,
                 channel: Any = None, tls: bool = False, tls_ca: Any = None, tls_cert: Any = None,
                 tls_key: Any = None, tls_server_name: str | None = None, token: str | None = None,
                 token_file: Any = None, retry: bool = True, wait_for_ready: bool = False,
                 transport: str = "auto", stream_threshold_mb: float = streaming.DEFAULT_STREAM_THRESHOLD_MB,
                 chunk_mb: float = streaming.DEFAULT_CHUNK_MB, compact: bool = True,
                 max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT, coalesce_ms: float = 0.0,
                 coalesce_max_rows: int = DEFAULT_COALESCE_MAX_ROWS, channel_options: Sequence[tuple[str, Any]] = (),
                 failover: bool = True):
        if not (isinstance(coalesce_ms, (int, float)) and not isinstance(coalesce_ms, bool)
                and 0 <= coalesce_ms < float("inf")):
            raise ValueError(f"coalesce_ms={coalesce_ms!r}: give a finite number of milliseconds >= 0 (0 = off)")
        if isinstance(coalesce_max_rows, bool) or not isinstance(coalesce_max_rows, int) or coalesce_max_rows < 1:
            raise ValueError(f"coalesce_max_rows={coalesce_max_rows!r}: give an integer >= 1")
        self.coalesce_ms = float(coalesce_ms)
        self.failover = bool(failover)
        #: called when an attempt whose connection failed is sent again (``advantage_client.client.Failover``; the
        #: Ray client's look-up)
        self._on_timeout: Any = None
        self._replicas: dict[str, _Replica] = {}  # failover resends to one replica of a list target
        self._closed = False  # close() was called: no new replica channels
        self.coalesce_max_rows = coalesce_max_rows
        self._group_local: dict[str, tuple[list[str], dict[str, str]]] | None = None
        self._group_local_task: asyncio.Future | None = None
        self._batches: dict[tuple, _Batch] = {}
        self._batch_tasks: set[asyncio.Task] = set()
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
        if channel is None:  # a caller's own channel: its credentials are not known here
            warn_plaintext_token(self.target, self._metadata, bool(tls) or tls_ca is not None or tls_cert is not None)
        self._channel_args = dict(max_message_mb=max_message_mb, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                                  tls_key=tls_key, tls_server_name=tls_server_name, retry=retry,
                                  wait_for_ready=wait_for_ready, aio=True, options=tuple(channel_options))
        self._own_stream_channel = channel is None
        self._steerable = channel is None  # a channel given by the caller: its options are not known here
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            self._channel = channel or make_channel(self.target, **self._channel_args)
        except RuntimeError as err:
            if running is not None or "event loop" not in str(err):
                raise
            # no running loop and none current in this thread (grpc.aio asks asyncio.get_event_loop())
            raise EventLoopError(f"AsyncAdvantageClient was created where no event loop runs ({err}): "
                                 f"{LOOP_RULE}") from None
        #: the loop every call must run in: the one grpc.aio bound the channel to (the running loop, else the
        #: thread's current one, e.g. for loop.run_until_complete code); None where that cannot be told
        loop = getattr(self._channel, "_loop", None)
        self._loop = loop if isinstance(loop, asyncio.AbstractEventLoop) else running
        self._stream_channel: Any = None if channel is None else channel
        self._stub = pb_grpc.AdvantageServiceStub(self._channel)
        self._unary = self._channel.unary_unary(streaming.COMPUTE, request_serializer=None,
                                                response_deserializer=streaming.decode_writable)
        self._stream: Any = None
        self._lengths_ok = True

    @staticmethod
    def capture(estimator: str, config: Any, cu_seqlens: Any, tensors: dict[str, Any]) -> tuple[Any, Any, dict]:
        """:func:`capture`: a call's inputs copied now (used by :meth:`compute`, and by the Ray client's)."""
        return capture(estimator, config, cu_seqlens, tensors)

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
                self._stream_channel = _stream_channel(self.target, self._channel_args)
            self._stream = _compute_stream(self._stream_channel)
        return self._stream

    def _check_loop(self) -> None:
        """:class:`EventLoopError` when the running loop is not the one this client belongs to."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise EventLoopError("this AsyncAdvantageClient belongs to another event loop than the one awaiting "
                                 "it (it was created at import time, in another thread, or in an earlier "
                                 f"asyncio.run): {LOOP_RULE}")

    async def _send(self, transport: str, data: streaming.Request, timeout: float | None,
                    via: _Replica | None = None) -> codec.DecodedResult:
        """One call on the client's channels, or on ``via``'s (a failover resend to one replica)."""
        _last_transport.set(transport)
        if transport == "unary":
            unary = self._unary if via is None else via.unary
            return await unary(data.tobytes(), timeout=timeout, metadata=self._metadata)
        started = time.monotonic()
        stream = self._stream_callable() if via is None else via.stream_callable()
        call = stream(data.chunks(self.chunk_bytes), timeout=timeout, metadata=self._metadata)
        out = streaming.Reassembler()
        try:
            async for total, chunk in call:
                out.feed(total, chunk)
        except grpc.RpcError as err:
            # grpc.aio ends a stream whose request writer was still sending when the deadline passed with
            # INTERNAL "Internal error from Core" (Failed "execute_batch": SendMessageOperation) about half the
            # time, DEADLINE_EXCEEDED otherwise: past the deadline, it is DEADLINE_EXCEEDED
            if not (err.code() == grpc.StatusCode.INTERNAL and timeout is not None
                    and time.monotonic() - started >= timeout):
                raise
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Deadline Exceeded", err.debug_error_string()) from None
        return codec.decode_result(memoryview(out.finish()))

    def compute(self, estimator: str, config: Any = None, *, output_dtype: Any = None, as_numpy: bool = False,
                cu_seqlens: Any = None, transport: str | None = None, per_sample: bool = False,
                timeout: Any = CLIENT_TIMEOUT, **tensors: Any) -> Coroutine[Any, Any, AdvantageResult]:
        """``await`` one estimator run: arguments, result and errors as
        :meth:`advantage_client.AdvantageClient.compute` (``rewards`` ``[B]`` or ``[B, T]``, ``mask``
        ``[B, T]``, ...; advantages ``[B, T]`` float32 by default, ``[B]`` with ``per_sample=True`` where the
        estimator gives one value per row), without shared memory.

        ``timeout``: this call's deadline in seconds, in place of the client's ``timeout`` (default: the
        client's; None: no deadline), as for the sync client: it bounds the call once it is sent (not its wait
        for a ``max_in_flight`` slot). A call held to be coalesced (``coalesce_ms``) with a ``timeout`` of its
        own is bounded by it from the moment ``compute`` is awaited (its wait to be coalesced included); one
        whose ``timeout`` is longer than the client's, or None while the client has one, is sent alone under
        its own deadline (the coalesced request runs under the client's ``timeout``).

        Raises ``wire.WireError`` (a ``ValueError``) for arguments that cannot be encoded and for keywords that
        cannot be inputs (``retry=``, ``deadline=``, a scalar such as ``timout=5.0``: see
        :func:`advantage_client.client.check_inputs`), ``ValueError`` for an unknown transport or a bad
        ``timeout`` and once the client is closed, :class:`EventLoopError` when awaited from another event loop than
        the client's, and :class:`AdvantageServiceError` for every error the server reports (:class:`InvalidArgumentError`,
        also a ``ValueError``, for INVALID_ARGUMENT; UNAVAILABLE after the retries; DEADLINE_EXCEEDED after
        ``timeout``). Cancelling the awaiting task cancels the call.

        The call's inputs are captured when ``compute`` is called, before anything is awaited (:func:`capture`:
        a copy of each tensor, on the device it is on, and of the config): the caller may write its next batch
        into the same buffers as soon as ``compute(...)`` has returned its coroutine (``asyncio.create_task``,
        ``asyncio.gather``), whatever path the call then takes (unary, stream, coalesced, a resend). ``compute``
        is therefore a plain method returning a coroutine; every error is raised when it is awaited.
        """
        config, cu_seqlens, tensors = capture(estimator, config, cu_seqlens, tensors)
        return self._compute_call(estimator, config, output_dtype, as_numpy, cu_seqlens, transport, per_sample,
                                  timeout, tensors)

    async def _compute_call(self, estimator: str, config: Any, output_dtype: Any, as_numpy: bool, cu_seqlens: Any,
                            transport: str | None, per_sample: bool, timeout: Any,
                            tensors: dict[str, Any]) -> AdvantageResult:
        """:meth:`compute` on its captured inputs."""
        self._check_loop()
        if self._closed:
            raise ValueError("this AsyncAdvantageClient is closed (close(), or the end of its async with block): make "
                             "a new one")
        deadline = call_timeout(timeout, self.timeout)
        check_inputs(tensors, self)
        transport = self._checked_transport(transport or self.transport)
        if self.coalesce_ms > 0 and cu_seqlens is None and self._may_coalesce(deadline):
            entry = await self._coalescible(estimator, config, output_dtype, as_numpy, transport, per_sample, tensors)
            if entry is not None:
                return await self._await_coalesced(entry, timeout, deadline)
        args = (estimator, config, output_dtype, as_numpy, cu_seqlens, transport, per_sample, tensors)
        if timeout is CLIENT_TIMEOUT:
            return await self._compute_direct(*args)
        return await self._compute_direct(*args, deadline)

    def _may_coalesce(self, deadline: float | None) -> bool:
        """Whether a call with this deadline may join a coalesced request, which runs under the client's
        ``timeout``: when that cannot end it before its own deadline (the same or a shorter one)."""
        return deadline == self.timeout or (deadline is not None and self.timeout is not None
                                            and deadline < self.timeout)

    async def _await_coalesced(self, entry: Any, timeout: Any, deadline: float | None) -> AdvantageResult:
        """A coalesced call's result, within the call's own ``timeout`` when it gave one (counted from now, its
        wait to be coalesced included): past it, DEADLINE_EXCEEDED for this caller alone, who leaves the batch
        (or the request goes on for the others)."""
        if timeout is CLIENT_TIMEOUT:
            return await self._enqueue(entry)
        try:
            return await asyncio.wait_for(self._enqueue(entry), deadline)
        except asyncio.TimeoutError:
            raise AdvantageServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, hint(
                grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", self.target, deadline)) from None

    async def _compute_direct(self, estimator: str, config: Any, output_dtype: Any, as_numpy: bool, cu_seqlens: Any,
                              transport: str, per_sample: bool, tensors: dict[str, Any],
                              timeout: Any = CLIENT_TIMEOUT) -> AdvantageResult:
        timeout = call_timeout(timeout, self.timeout)
        prepared = prepare_call(estimator, config, output_dtype, cu_seqlens, per_sample, tensors,
                                compact=self.compact, as_lengths=self._lengths_ok)
        args = (estimator, config, output_dtype, cu_seqlens, per_sample, tensors)
        if self._in_flight is None:
            return await self._compute_failover(prepared, transport, as_numpy, args, timeout)
        async with self._in_flight:  # queued here beyond max_in_flight calls at once
            return await self._compute_failover(prepared, transport, as_numpy, args, timeout)

    async def _compute_failover(self, prepared: Any, transport: str, as_numpy: bool, args: tuple,
                                timeout: float | None) -> AdvantageResult:
        """The call's attempts: one (``failover=False``), or those :class:`advantage_client.client.Failover`
        allows (an admission refusal with pushback sent again after it, to another replica when there are
        several; with several, an attempt whose connection failed once more)."""
        if not self.failover:
            return await self._compute_prepared(prepared, transport, as_numpy, *args, timeout)
        replicas = cached_replica_count(self.target)
        if replicas is None:  # a DNS name not resolved lately: resolve it off the event loop
            replicas = await asyncio.to_thread(replica_count, self.target)
        plan = Failover(replicas, timeout, self._on_timeout, replica_targets(self.target) if self._steerable else ())
        while True:
            via = None if plan.via is None else self._replica(plan.via)
            try:
                return await self._compute_prepared(prepared, transport, as_numpy, *args, plan.attempt_timeout(), via)
            except AdvantageServiceError as err:
                pause = plan.after(err, self.target)  # raises the call's error when not sent again
            await asyncio.sleep(pause)  # then the next attempt, on plan.via (else round_robin's next replica)

    def _replica(self, target: str) -> "_Replica":
        """The channels to the one replica ``target`` (made on first use, closed by :meth:`close`); after
        :meth:`close`, :class:`AdvantageServiceError` (CANCELLED): a resend never outlives its client."""
        if self._closed:
            raise AdvantageServiceError(grpc.StatusCode.CANCELLED, "the client was closed while the call was in flight")
        if target not in self._replicas:
            self._replicas[target] = _Replica(target, self._channel_args)
        return self._replicas[target]

    async def _compute_prepared(self, prepared: Any, transport: str, as_numpy: bool, estimator: str, config: Any,
                                output_dtype: Any, cu_seqlens: Any, per_sample: bool,
                                tensors: dict[str, Any], timeout: float | None,
                                via: _Replica | None = None) -> AdvantageResult:
        try:
            return await self._send_prepared(prepared, transport, as_numpy, timeout, via)
        except AdvantageServiceError as err:
            if not lengths_refused(err, prepared):
                raise
            self._lengths_ok = False  # a server that predates `lengths`: masks go as bytes from now on
            prepared = prepare_call(estimator, config, output_dtype, cu_seqlens, per_sample, tensors,
                                    compact=self.compact, as_lengths=False)
            return await self._send_prepared(prepared, transport, as_numpy, timeout, via)

    async def _send_prepared(self, prepared: Any, transport: str, as_numpy: bool,
                             timeout: float | None, via: _Replica | None = None) -> AdvantageResult:
        data = prepared.request
        auto = transport == "auto"
        if auto:
            transport = "stream" if data.nbytes >= self.stream_threshold_bytes else "unary"
        try:
            reply = await self._send(transport, data, timeout, via)
        except grpc.RpcError as err:
            if transport == "stream":
                channel = self._stream_channel if via is None else via._stream_channel
            else:
                channel = self._channel if via is None else via.channel
            error = AdvantageServiceError.from_rpc_error(err, self.target, timeout, channel)
            if transport == "stream" and status_lost(err):
                error = AdvantageServiceError(error.code, (
                    f"{error} (grpc.aio's own status: the server ended the streamed call while its request was still "
                    "being sent, and grpc.aio reported this in place of the server's status, most often an admission "
                    "refusal with a pushback; the client sent the call again up to its pushback retries)"))
                error.status_lost = True  # Failover.retry sends it again
            if not (auto and transport == "stream" and stream_refused(error, data.nbytes, self.max_message_bytes)):
                raise error from None
            try:
                reply = await self._send("unary", data, timeout, via)
            except grpc.RpcError as err2:
                raise AdvantageServiceError.from_rpc_error(err2, self.target, timeout,
                                                           self._channel if via is None else via.channel) from None
        return finish_result(reply, prepared, as_numpy=as_numpy)

    # ------------------------------------------------------------------------------------------ coalescing
    async def _group_local_rules(self) -> dict[str, tuple[list[str], dict[str, str]]] | None:
        """``{estimator: (group_local conditions, {config field: default text})}`` from ListEstimators, read
        once (concurrent first callers share the one call); None while it cannot be read (no coalescing)."""
        if self._group_local is not None:
            return self._group_local
        if self._group_local_task is None:
            self._group_local_task = asyncio.ensure_future(self.list_estimators())
        task = self._group_local_task
        try:
            listing = await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the server's error reaches the caller by its own call
            if self._group_local_task is task:
                self._group_local_task = None  # try again with a later call
            return None
        self._group_local = {e.name: (list(e.group_local), {f.name: f.default_value for f in e.config_fields})
                             for e in listing.estimators}
        return self._group_local

    async def _coalescible(self, estimator: str, config: Any, output_dtype: Any, as_numpy: bool, transport: str,
                           per_sample: bool, tensors: dict[str, Any]) -> _Entry | None:
        """The call as a batch entry (its key and a copy of its inputs), or None where it must go alone."""
        tensors = {k: v for k, v in tensors.items() if v is not None}
        if "prompt_ids" not in tensors or "mask" not in tensors or "lengths" in tensors or "mask_columns" in tensors:
            return None
        rules = await self._group_local_rules()
        if rules is None or estimator not in rules or not rules[estimator][0]:
            return None
        try:
            msg = wire.config_message(estimator, config)
        except ValueError:
            return None  # the direct path raises the error
        if not group_local(rules[estimator][0], wire.config_to_dict(msg), rules[estimator][1]):
            return None
        mask = tensors["mask"]
        shape = tuple(getattr(mask, "shape", ()))
        if len(shape) != 2:
            return None
        rows, columns = int(shape[0]), int(shape[1])
        # the mask compacted now, as prepare_call would for this call alone (lengths, or one byte per token):
        # the copy kept until the batch goes is small, and the merged request needs no second pass
        small = masks.compact_mask(mask, tensors, prefix=self._lengths_ok) if self.compact else None
        arrays: dict[str, np.ndarray] = {}
        for name, value in tensors.items():
            if name == "prompt_ids" or (name == "mask" and small is not None):
                continue
            arr = _numpy_copy(value, copy=False)  # the call's own capture: no second copy
            if arr is None:
                return None
            arrays[name] = arr
        form = "as given"
        if small is not None:
            if small.lengths is not None:
                arrays["lengths"], form = np.asarray(small.lengths), "lengths"
            else:
                bool_mask = small.bool_mask
                arrays["mask"] = bool_mask.cpu().numpy() if hasattr(bool_mask, "cpu") else np.asarray(bool_mask)
                form = "bool"
        if rows < 1 or rows > self.coalesce_max_rows or any(a.ndim < 1 or a.shape[0] != rows for a in arrays.values()):
            return None
        try:
            ids = wire.reduce_prompt_ids(tensors["prompt_ids"])
        except ValueError:
            return None
        if ids.ndim != 1 or ids.shape[0] != rows or ids.dtype.kind not in "iu":
            return None
        arrays["prompt_ids"] = np.unique(ids, return_inverse=True)[1].reshape(-1).astype(np.int64)
        key = (estimator, msg.SerializeToString(deterministic=True), str(output_dtype), bool(per_sample),
               bool(as_numpy), transport, form, columns, str(getattr(mask, "dtype", type(mask))),
               tuple(sorted((k, a.dtype.str, a.shape[1:]) for k, a in arrays.items() if k != "prompt_ids")))
        args = (estimator, config, output_dtype, as_numpy, None, transport, per_sample)
        return _Entry(key, args, arrays, rows, asyncio.get_running_loop().create_future(),
                      columns if form == "lengths" else 0)

    async def _enqueue(self, entry: _Entry) -> AdvantageResult:
        batch = self._batches.get(entry.key)
        if batch is not None and batch.rows + entry.rows > self.coalesce_max_rows:
            self._flush(entry.key, batch)
            batch = None
        if batch is None:
            batch = self._batches[entry.key] = _Batch()
            batch.timer = asyncio.get_running_loop().call_later(self.coalesce_ms / 1000.0, self._flush, entry.key,
                                                                 batch)
        batch.entries.append(entry)
        batch.rows += entry.rows
        if batch.rows >= self.coalesce_max_rows:
            self._flush(entry.key, batch)
        return await entry.future  # cancelling the caller cancels its future: the batch leaves it out

    def _flush(self, key: tuple, batch: _Batch) -> None:
        if self._batches.get(key) is batch:
            del self._batches[key]
        if batch.timer is not None:
            batch.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._run_batch(batch.entries))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_alone(self, entry: _Entry) -> None:
        try:
            result = await self._compute_direct(*entry.args, _with_columns(dict(entry.arrays), entry.columns))
        except Exception as err:  # noqa: BLE001 - handed to the caller
            if not entry.future.done():
                entry.future.set_exception(err)
        else:
            if not entry.future.done():
                entry.future.set_result(result)

    async def _run_batch(self, entries: list[_Entry]) -> None:
        live = [e for e in entries if not e.future.done()]
        if len(live) <= 1:
            if live:
                await self._run_alone(live[0])
            return
        merged: dict[str, np.ndarray] = {}
        offset = 0
        ids = []
        for e in live:
            ids.append(e.arrays["prompt_ids"] + offset)
            offset += int(e.arrays["prompt_ids"].max()) + 1
        merged["prompt_ids"] = np.concatenate(ids)
        for name in live[0].arrays:
            if name != "prompt_ids":
                merged[name] = np.concatenate([e.arrays[name] for e in live])
        try:
            result = await self._compute_direct(*live[0].args, _with_columns(merged, live[0].columns))
        except AdvantageServiceError as err:
            if _shared_error(err):
                for e in live:
                    if not e.future.done():
                        e.future.set_exception(err)
                return
            await asyncio.gather(*(self._run_alone(e) for e in live))
            return
        except ValueError:  # an input that cannot be encoded: each call finds out its own
            await asyncio.gather(*(self._run_alone(e) for e in live))
            return
        except BaseException as err:  # cancelled by close(), or a bug: no caller waits forever
            for e in live:
                if not e.future.done():
                    e.future.set_exception(err if isinstance(err, Exception) else AdvantageServiceError(
                        grpc.StatusCode.CANCELLED, "the client was closed while the call was in flight"))
            if not isinstance(err, Exception):
                raise
            return
        start = 0
        for e in live:
            stop = start + e.rows
            part = dataclasses.replace(
                result, advantages=result.advantages[start:stop],
                returns=None if result.returns is None else result.returns[start:stop], metrics=dict(result.metrics))
            start = stop
            if not e.future.done():
                e.future.set_result(part)

    async def list_estimators(self) -> pb.ListEstimatorsResponse:
        """Every estimator the server runs, with its config fields, inputs and per-sample layouts.
        Raises :class:`AdvantageServiceError` (UNAVAILABLE, UNAUTHENTICATED, ...) when the call fails,
        :class:`EventLoopError` when awaited from another event loop than the client's."""
        self._check_loop()
        try:
            return await self._stub.ListEstimators(pb.ListEstimatorsRequest(), timeout=self.timeout,
                                                   metadata=self._metadata)
        except grpc.RpcError as err:
            raise AdvantageServiceError.from_rpc_error(err, self.target, self.timeout, self._channel) from None

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the channel is connected; raises :class:`AdvantageServiceError` (UNAVAILABLE) after
        ``timeout`` seconds; :class:`EventLoopError` when awaited from another event loop than the client's."""
        self._check_loop()
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise not_ready(self.target, timeout) from None

    @property
    def last_transport(self) -> str | None:
        """The transport the current task's latest :meth:`compute` used (``"unary"`` or ``"stream"``)."""
        return _last_transport.get()

    async def close(self) -> None:
        """Close the channels (calls in flight are cancelled; calls still waiting to be coalesced fail with
        CANCELLED). :class:`EventLoopError` when awaited from another event loop than the client's."""
        self._check_loop()
        self._closed = True
        for batch in list(self._batches.values()):
            if batch.timer is not None:
                batch.timer.cancel()
            for e in batch.entries:
                if not e.future.done():
                    e.future.set_exception(AdvantageServiceError(
                        grpc.StatusCode.CANCELLED, "the client was closed before the call was sent"))
        self._batches.clear()
        replicas, self._replicas = list(self._replicas.values()), {}
        for replica in replicas:
            await replica.close()
        if self._own_stream_channel and self._stream_channel is not None:
            await self._stream_channel.close()
            self._stream_channel = None
        await self._channel.close()

    async def __aenter__(self) -> "AsyncAdvantageClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _stream_channel(target: str, channel_args: dict[str, Any]) -> Any:
    """A channel of its own for ``ComputeAdvantageStream`` calls: ``channel_args`` with the small retry buffer."""
    return make_channel(target, **{**channel_args, "retry_buffer_mb": streaming.STREAM_RETRY_BUFFER_MB})


def _compute_stream(channel: Any) -> Any:
    """The ``ComputeAdvantageStream`` callable on ``channel`` (chunks in as bytes, decoded chunks out)."""
    return channel.stream_stream(streaming.COMPUTE_STREAM, request_serializer=None,
                                 response_deserializer=codec.decode_chunk)


class _Replica:
    """The channels to one replica of a list target (``advantage_client.channel.replica_targets``): where a
    failover resend goes. Retry policy off: a replica not serving answers UNAVAILABLE at once and the resend
    moves on to the next one. The stream channel is made on first use, with the small retry buffer."""

    def __init__(self, target: str, channel_args: dict[str, Any]):
        self.target, self._args = target, {**channel_args, "retry": False}
        self.channel = make_channel(target, **self._args)
        self.unary = self.channel.unary_unary(streaming.COMPUTE, request_serializer=None,
                                              response_deserializer=streaming.decode_writable)
        self._stream_channel: Any = None
        self._stream: Any = None

    def stream_callable(self) -> Any:
        if self._stream is None:
            self._stream_channel = _stream_channel(self.target, self._args)
            self._stream = _compute_stream(self._stream_channel)
        return self._stream

    async def close(self) -> None:
        if self._stream_channel is not None:
            await self._stream_channel.close()
        await self.channel.close()


@dataclasses.dataclass
class _Entry:
    """One caller's call waiting to be coalesced: its compatibility key, the arguments of the direct path,
    its inputs (numpy copies; ``prompt_ids`` as group ids 0..G-1; the mask compacted to ``lengths`` or bool as
    the direct path would send it), its rows and the future it awaits."""
    key: tuple
    args: tuple
    arrays: dict
    rows: int
    future: asyncio.Future
    columns: int = 0  # the mask width T when the mask is held as ``lengths``, else 0


@dataclasses.dataclass
class _Batch:
    """Compatible calls waiting together; sent when ``coalesce_ms`` has passed since the first or at the cap."""
    entries: list = dataclasses.field(default_factory=list)
    rows: int = 0
    timer: Any = None


def _with_columns(tensors: dict[str, Any], columns: int) -> dict[str, Any]:
    if columns:
        tensors["mask_columns"] = columns  # lengths [B] stand for a [B, T] mask (see prepare_call)
    return tensors


def _shared_error(error: AdvantageServiceError) -> bool:
    """Whether a merged request's error is every merged caller's as it is (not sent again call by call): a code
    of :data:`_SHARED_ERRORS`, or the server's admission refusal (:func:`advantage_client.client.admission_refused`:
    it says nothing about any caller's inputs; the other
    RESOURCE_EXHAUSTED, a size limit or out of memory, may not hold for one call alone)."""
    return error.code in _SHARED_ERRORS or admission_refused(error)


def capture(estimator: str, config: Any, cu_seqlens: Any, tensors: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """A call's inputs as they are now, owned by the call (``(config, cu_seqlens, tensors)``): the config as a
    message of its own (:func:`_config_snapshot`) and a copy of every tensor (:func:`_tensor_snapshot`). Taken
    when :meth:`AsyncAdvantageClient.compute` is called, so the caller may reuse its buffers at once; the
    coroutine, and every path it takes after its awaits, reads only these copies. Costs one copy of the inputs
    (on their device); never raises (a value it cannot copy is kept as given, and the call reports it)."""
    return (_config_snapshot(estimator, config), _tensor_snapshot(cu_seqlens),
            {name: _tensor_snapshot(value) for name, value in tensors.items()})


def _tensor_snapshot(value: Any) -> Any:
    """A copy of one input nobody else holds: a torch tensor cloned on its own device (detached), a numpy array
    copied (same dtype, C order), a list or tuple deep-copied; anything else (None, a scalar, a string, an
    object the encoder refuses) as given."""
    try:
        if hasattr(value, "detach") and hasattr(value, "clone"):
            return value.detach().clone()
        if isinstance(value, np.ndarray):
            return np.array(value, copy=True, order="C")
        if isinstance(value, (list, tuple)):
            return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - the call encodes the value as given and reports what is wrong with it
        return value
    return value


def _config_snapshot(estimator: str, config: Any) -> Any:
    """``config`` (a dict, a config message or None) as a config message of its own, built now: the caller may
    change or reuse its dict or message once ``compute`` has started, the request (sent later when coalesced,
    and then with other callers' rows) carries the values of the call. A config that cannot be converted is
    returned as given: the direct path raises its ``WireError`` naming the field."""
    try:
        msg = wire.config_message(estimator, config)
    except ValueError:
        return config
    if msg is config:  # the caller's own message object: copy it
        msg = type(config)()
        msg.CopyFrom(config)
    return msg


def _numpy_copy(value: Any, copy: bool = True) -> np.ndarray | None:
    """A numpy copy of a numpy array, a CPU/GPU torch tensor (not bfloat16) or a list; None for anything else.
    ``copy=False``: a view where one can be had (for a value nobody else holds, such as a :func:`capture`)."""
    try:
        if hasattr(value, "detach"):
            arr = value.detach().cpu().numpy()
            return np.array(arr, copy=True) if copy else arr
        arr = np.array(value, copy=True) if copy else np.asarray(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return arr if arr.dtype.kind in "biuf" else None


_PER_SEMANTICS = re.compile(r"^(.*?) \(([^)]*)\)$")
_UNKNOWN = conditions_mod.UNKNOWN


def _default(text: str, semantics: Any) -> Any:
    """A config field's default from its ``ConfigField.default_value`` text: a plain value, or the entry of
    ``"v1 (s1, s2); v2 (s3)"`` for ``semantics``; ``_UNKNOWN`` where the text does not say."""
    if "(" not in text:
        return None if text == "unset" else conditions_mod.value_of(text)
    for part in text.split(";"):
        m = _PER_SEMANTICS.match(part.strip())
        if m and semantics in [s.strip() for s in m.group(2).split(",")]:
            return conditions_mod.value_of(m.group(1))
    return _UNKNOWN


def group_local(conditions: Sequence[str], config: dict[str, Any], defaults: dict[str, str]) -> bool:
    """Whether one of the server's ``EstimatorInfo.group_local`` conditions holds for ``config`` (the fields the
    caller set, as :func:`advantage_client.wire.config_to_dict` gives them; unset fields take their listed
    defaults, per ``semantics`` where they depend on it). A field whose value cannot be told counts as not
    matching: the call then goes alone (never a wrong merge)."""
    semantics = config.get("semantics", defaults.get("semantics"))

    def lookup(name: str) -> Any:
        if name in config:
            return config[name]
        return _default(defaults[name], semantics) if name in defaults else _UNKNOWN
    return any(conditions_mod.holds(when, lookup) for when in conditions)
