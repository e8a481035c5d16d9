"""The Python client: call the advantage service as if the estimator ran in-process.

    from advantage_client import AdvantageClient

    with AdvantageClient("localhost:50051", timeout=30.0) as client:
        result = client.compute("gae", {"gae_gamma": 0.99, "gae_lambda": 0.95},
                                rewards=rewards, mask=mask, values=values)
        result.advantages, result.returns, result.metrics

Tensors go in as ``torch.Tensor`` or ``numpy.ndarray`` and come back as ``torch.Tensor`` when torch is
installed (``numpy.ndarray`` otherwise). Every server error is raised as :class:`AdvantageServiceError`;
INVALID_ARGUMENT as its subclass :class:`InvalidArgumentError`, which is also a ``ValueError``.
"""
from __future__ import annotations

import collections
import errno
import functools
import inspect
import math
import numbers
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import grpc
import numpy as np

from advantage_client import layout, masks, streaming, wire
from advantage_client.channel import (
    auth_metadata, channel_target, make_channel, replica_count, replica_targets, warn_plaintext_token,
)
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
# defined with the modules that own them (shm and streaming use them too), and importable from here as before
from advantage_client.errors import AdvantageServiceError, InvalidArgumentError, hint  # noqa: F401
from advantage_client.result import AdvantageResult
from advantage_client.wire import LABEL_INPUTS, check_mask_columns, reduce_prompt_ids


#: transport="auto": how many times the server may forget this client's region before shared memory is off
MAX_SHM_FORGOTTEN = 3
#: transport="auto": seconds after a refused registration before shared memory is tried again (the refusal may
#: pass: another client's regions freed, a token set on the server); and before the pool tries to grow again
#: after a refused growth (its regions keep working meanwhile)
SHM_RETRY_S = 60.0
#: regions the shared-memory pool of one client grows to (one call per region at a time)
DEFAULT_SHM_REGIONS = 8


#: failover (a target naming several replicas) for a server that sends no retry pushback (an older one): an
#: admission refusal recognised by its message is sent again at most this many times (and at most once per other
#: replica)
FAILOVER_MAX_RETRIES = 3
#: seconds before the first resend of such a refused call (doubled for each further one, jittered +-50 %)
FAILOVER_BACKOFF_S = 0.05
#: an admission refusal carrying a retry pushback (``grpc-retry-pushback-ms``) is sent again at most this many
#: times, with one replica or several
PUSHBACK_MAX_RETRIES = 5
#: the wait before such a resend: the pushback times a factor drawn uniformly from [1, 1 + PUSHBACK_JITTER]
#: (never sooner than the server asked; callers refused together do not all come back at once)
PUSHBACK_JITTER = 0.5
#: seconds (jittered as a pushback) before a streamed call whose status grpc.aio lost is sent again: the least
#: pushback the server gives (``admission.ADMISSION_PUSHBACK_MS``, 50-200 ms); see :meth:`Failover.retry`
LOST_STATUS_PAUSE_S = 0.05
#: the start of the server's message for a call whose upload it cut to give the call's place to a waiting client
#: (``advantage_server.uploads``: the call's body had not arrived, nothing of it was kept or computed)
CUT_FOR_ANOTHER = "cut to give its place to another client"
#: seconds (jittered as a pushback) before such a cut call is sent again; see :meth:`Failover.retry`
CUT_PAUSE_S = 0.1
#: an attempt that ended UNAVAILABLE on the round_robin rotation (its connection failed: a replica killed, or
#: hung and found by the HTTP/2 keepalive, after gRPC's own retries) is sent again at most this many times
LOST_MAX_RESENDS = 1
#: a resend needs at least this many seconds of the caller's deadline left
FAILOVER_MIN_ATTEMPT_S = 0.05
#: the flags a RESOURCE_EXHAUSTED of the server's admission names (``advantage_server.limits``): every place
#: taken, or this client beyond its share of calls waiting for their request body
ADMISSION_FLAGS = ("--max-concurrent-requests", "--max-pending-per-connection", "--max-pending-per-peer")


#: what a failover resend's replica answers when it did not take the call (the resend's channel to that one replica
#: has no retry policy): UNAVAILABLE (draining, down) or CANCELLED (its gRPC dropped the call as it shut down);
#: the resend moves on to the next replica
NOT_TAKEN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def admission_refused(error: AdvantageServiceError) -> bool:
    """Whether ``error`` is the server's admission refusal, which says nothing about the request: another
    replica (or the same one later) may take it. RESOURCE_EXHAUSTED with a retry pushback (trailing metadata
    ``grpc-retry-pushback-ms``, :attr:`AdvantageServiceError.pushback_s`: the server sends it on admission
    refusals only); or, from a server that sends no pushback (older ones), RESOURCE_EXHAUSTED naming
    ``--max-concurrent-requests`` (every place taken: answered before the request is read) or
    ``--max-pending-per-connection`` / ``--max-pending-per-peer`` (more calls waiting for their body than the
    client's share), unless the message says the upload was cut. Every other RESOURCE_EXHAUSTED (a size limit
    such as ``--max-message-mb``, out of memory, an upload cut) is about the request and is not sent to another
    replica as a refusal is (:meth:`Failover.retry` sends a call cut to give its place to another client again)."""
    if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    if getattr(error, "pushback_s", None) is not None:
        return True
    text = str(error)
    return any(f in text for f in ADMISSION_FLAGS) and not _upload_cut(text)


_CUT = re.compile(r"\bcut\b", re.IGNORECASE)


def _upload_cut(text: str) -> bool:
    """A RESOURCE_EXHAUSTED message saying the call's upload was cut (its place given to another client, or it
    stalled): the server read part of the request; the call is not sent again."""
    return _CUT.search(text) is not None


class Failover:
    """The attempts of one ``compute`` call within its deadline ``timeout`` (seconds, None: none), on a target
    naming ``replicas`` replicas, shared by the sync and asyncio clients. Every attempt gets the whole deadline
    left (a healthy slow call is never cut short, nor run twice).

    * An admission refusal with a retry pushback (RESOURCE_EXHAUSTED carrying ``grpc-retry-pushback-ms``:
      :func:`admission_refused`) is sent again after the pushback, jittered (``PUSHBACK_JITTER``), at most
      ``PUSHBACK_MAX_RETRIES`` times and only while the wait and ``FAILOVER_MIN_ATTEMPT_S`` fit in the deadline
      left; then the refusal is raised. With one replica the resend goes to the same replica; with several,
      to another (below).
    * A streamed call of the asyncio client whose status grpc.aio lost (``status_lost``: its INTERNAL "Internal
      error from Core", the server having ended the call while its request was being sent) is sent again as an
      admission refusal is, after ``LOST_STATUS_PAUSE_S`` (jittered), within the same bounds.
    * A call the server cut to give its place to another client (RESOURCE_EXHAUSTED, ``CUT_FOR_ANOTHER``: its
      body had not arrived for a while, as when a loaded client machine starts 64 processes at once) is sent
      again as an admission refusal is, after ``CUT_PAUSE_S`` (jittered), within the same bounds: the server kept
      and computed nothing of it. An upload cut for its own rate or idleness is not.
    * With several replicas, a refusal recognised by its message from a server that sends no pushback (an older
      one) is sent again after a short jittered backoff (``FAILOVER_BACKOFF_S``, doubled each time), at most
      ``min(replicas, FAILOVER_MAX_RETRIES)`` times.
    * Where a refusal's resend goes: with ``targets`` (one gRPC target per replica,
      :func:`advantage_client.channel.replica_targets`: a list of replicas, the Ray client's) to the replicas one
      after another in an order of this call's own (a random rotation over all of them: the client does not know
      which replica refused, so with ``replicas`` resends every other replica is tried once); a resend that finds
      its replica not serving (UNAVAILABLE: draining, down; or CANCELLED: dropped by its gRPC as it shut down)
      moves on to the next at once. Without ``targets`` (a DNS name) through the channel's round_robin picker:
      the next replica in the rotation for a caller alone; under concurrency another replica with probability
      (replicas - 1) / replicas.
    * With several replicas, an attempt that ended UNAVAILABLE on the round_robin rotation (after gRPC's own
      retries: its connection failed, a replica killed, or hung and found dead by the HTTP/2 keepalive PINGs of
      :func:`advantage_client.channel.make_channel`) is sent once more (``LOST_MAX_RESENDS``) through the
      rotation, which no longer holds the failed connection, under the deadline left. Every compute call is
      idempotent, so a resend is safe; a shared-memory call's region is dropped after the lost attempt (the old
      replica may still write into it) and the resend takes a fresh one.

    DEADLINE_EXCEEDED is never sent again (the attempt had the whole deadline). Any other error, or one past
    those bounds, is raised. ``on_timeout``: called (no arguments) when a lost attempt is sent again (the Ray
    client starts its look-up there, which drops a dead or hung replica)."""

    def __init__(self, replicas: int, timeout: float | None, on_timeout: Any = None, targets: Sequence[str] = ()):
        self.replicas, self.timeout, self.on_timeout = int(replicas), timeout, on_timeout
        self.end = None if timeout is None else time.monotonic() + timeout
        self.refusals = 0  # resends after a refusal, or of a steered resend that found its replica not serving
        self.pushbacks = 0  # resends after a refusal with pushback
        self.lost = 0  # resends after an UNAVAILABLE on the rotation
        self.attempts = 0  # attempt_timeout() calls: attempts made
        self._refusal: AdvantageServiceError | None = None  # the first admission refusal
        start = random.randrange(len(targets)) if targets else 0
        self._order = [targets[(start + i) % len(targets)] for i in range(len(targets))]
        #: the replica's target the next attempt goes to (None: the round_robin channel)
        self.via: str | None = None

    def attempt_timeout(self) -> float | None:
        """The deadline of the next attempt in seconds (None: none): the caller's deadline, then what is left
        of it."""
        self.attempts += 1
        if self.end is None:
            return None
        if self.attempts == 1:
            return self.timeout  # the whole deadline, as given (errors name it)
        # a resend is made only with FAILOVER_MIN_ATTEMPT_S left: the floor only keeps the value valid
        return max(self.end - time.monotonic(), 1e-3)

    def _next_replica(self) -> None:
        """Steer the next attempt: to the next replica of this call's order (None: the rotation)."""
        self.via = self._order[(self.refusals - 1) % len(self._order)] if self._order else None

    def retry(self, error: AdvantageServiceError) -> float | None:
        """After an attempt failed with ``error``: seconds to wait before sending the call again (to
        :attr:`via`), or None when ``error`` is the call's (see the class docstring)."""
        left = math.inf if self.end is None else self.end - time.monotonic()
        pushback = getattr(error, "pushback_s", None) if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        if pushback is not None:
            self._refusal = self._refusal or error
        elif getattr(error, "status_lost", False):
            # grpc.aio ended a streamed call with its own INTERNAL "Internal error from Core" in place of the
            # server's status: the server ended the call while the request was still being sent, before reading
            # it, most often an admission refusal whose pushback is lost with it (aio._send_prepared). Sent again
            # as a refusal is, within the same bounds; a server error repeats and is raised once they are spent.
            pushback = LOST_STATUS_PAUSE_S
        elif error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and CUT_FOR_ANOTHER in str(error):
            pushback = CUT_PAUSE_S
        if pushback is not None:
            if self.pushbacks >= PUSHBACK_MAX_RETRIES:
                return None
            pause = pushback * random.uniform(1.0, 1.0 + PUSHBACK_JITTER)
            if pause + FAILOVER_MIN_ATTEMPT_S > left:
                return None
            self.pushbacks += 1
            if self.replicas >= 2:
                self.refusals += 1
                self._next_replica()
            return pause
        if self.replicas < 2:
            return None
        steered_away = self.via is not None and error.code in NOT_TAKEN
        if admission_refused(error) or steered_away:
            self._refusal = self._refusal or (None if steered_away else error)
            if self.refusals >= min(self.replicas, FAILOVER_MAX_RETRIES) or left < FAILOVER_MIN_ATTEMPT_S:
                return None
            self.refusals += 1
            self._next_replica()
            if steered_away:
                return 0.0
            pause = FAILOVER_BACKOFF_S * 2 ** (self.refusals - 1) * random.uniform(0.5, 1.5)
            return pause if pause + FAILOVER_MIN_ATTEMPT_S <= left else None
        if error.code == grpc.StatusCode.UNAVAILABLE and self.via is None and self.lost < LOST_MAX_RESENDS:
            if left < FAILOVER_MIN_ATTEMPT_S:
                return None
            self.lost += 1
            if self.on_timeout is not None:
                self.on_timeout()
            return 0.0
        return None

    def after(self, error: AdvantageServiceError, target: str) -> float:
        """:meth:`retry`'s pause before the next attempt; raises the call's error (:meth:`error`) when there is
        none (``target``: the client's, for the error's hint)."""
        pause = self.retry(error)
        if pause is None:
            final = self.error(error, target)
            if final is error:
                raise error
            raise final from None
        return pause

    def error(self, error: AdvantageServiceError, target: str) -> AdvantageServiceError:
        """The error the call raises: ``error``; the first admission refusal when the last resend found its
        replica not serving; a DEADLINE_EXCEEDED after a resend names the caller's whole deadline (the
        attempt's own hint named what was left of it)."""
        if error.code in NOT_TAKEN and self.via is not None and self._refusal is not None:
            return self._refusal
        if error.code != grpc.StatusCode.DEADLINE_EXCEEDED or self.attempts < 2 or self.timeout is None:
            return error
        return AdvantageServiceError(error.code, hint(
            error.code, "Deadline Exceeded", target, self.timeout) + f" [{self.attempts} attempts within it: "
            f"{self.pushbacks + self.refusals} after a refusal, {self.lost} after a lost connection]",
            error.field_violations)


def decode_result(msg: pb.AdvantageResult, as_numpy: bool = False) -> AdvantageResult:
    """``advantage.v1.AdvantageResult`` -> :class:`AdvantageResult` of torch tensors (numpy if asked or no torch),
    as the message holds them: a per-sample message gives ``[B]`` tensors with ``layout`` set (see
    :func:`finish_result` for the dense rebuild)."""
    decode = wire.decode_numpy if (as_numpy or wire.torch is None) else wire.decode_torch
    returns = decode(msg.returns, "returns") if msg.HasField("returns") else None
    return AdvantageResult(decode(msg.advantages, "advantages"), returns, dict(msg.metrics),
                           layout.layout_name(getattr(msg, "layout", 0)))


@dataclass
class PreparedCall:
    """One ``compute`` call encoded (:func:`prepare_call`), and what :func:`finish_result` needs to answer it.

    request:    the encoded request (pieces; joined for unary, chunked for stream).
    per_sample: the caller wants ``[B]`` values (where the server gives them) rather than ``[B, T]``.
    mask:       a bool numpy copy of the mask that was sent, to rebuild a per-sample answer (never the
                caller's object, which it may reuse while the call is in flight); None when the server is
                not asked for one (packed layout, no mask).
    lengths:    the caller's own ``lengths`` [B] (sent in place of a mask), from which the mask is made when
                a per-sample answer needs it; ``columns``: the mask's width (``mask_columns``).
    """

    request: streaming.Request
    per_sample: bool
    mask: Any
    columns: int | None = None
    lengths: Any = None
    #: the mask went out as ``lengths`` made by the compaction (a server that predates them refuses it)
    sent_lengths: bool = False


def prepare_call(estimator: str, config: Any, output_dtype: Any, cu_seqlens: Any, per_sample: bool,
                 tensors: dict[str, Any], compact: bool = True, as_lengths: bool = True) -> PreparedCall:
    """Encode one ``compute`` call: the shared request building of the sync and asyncio clients.

    * the server is asked for per-sample results (``per_sample = true`` on the wire) whenever the call has
      a ``[B, T]`` mask and no ``cu_seqlens``: where the estimator gives them, ``[B]`` values come back
      instead of ``[B, T]`` (``ResultLayout``), and :func:`finish_result` rebuilds the dense tensor unless
      the caller asked for ``per_sample``;
    * ``compact`` (default True; False: the tensors go as given and a dense result comes back unless the caller
      asked for ``per_sample``): a float (or int32/int64) mask holding only 0 and 1 is sent as ``lengths``
      ``[B]`` when it is a prefix mask (and ``as_lengths``), else as one byte per token
      (:func:`advantage_client.masks.compact_mask`).
    Raises ``wire.WireError`` (a ValueError) for arguments that cannot be encoded.
    """
    tensors = {k: v for k, v in tensors.items() if v is not None}
    check_mask_columns(tensors)
    mask = tensors.get("mask")
    columns, mask_columns = None, 0
    own_mask = None  # a bool mask this call made itself (the compaction's): the rebuild may keep it uncopied
    if compact and mask is not None and "lengths" not in tensors:
        small = masks.compact_mask(mask, tensors, prefix=cu_seqlens is None and as_lengths)
        if small is not None:
            mask = own_mask = small.bool_mask
            if small.lengths is not None:
                del tensors["mask"]
                tensors["lengths"] = small.lengths
                columns = mask_columns = small.columns
            else:
                tensors["mask"] = small.bool_mask
    own_lengths = None
    if mask is None and "lengths" in tensors:  # the caller sends lengths (and mask_columns) themselves
        mask_columns = int(tensors.pop("mask_columns", 0) or 0)
        value = tensors["lengths"]
        # a copy: the caller may reuse its buffer while the call is in flight (asyncio, threads)
        own_lengths = np.array(value.detach().cpu() if hasattr(value, "detach") else value, copy=True)
        columns = mask_columns or (int(own_lengths.max(initial=0)) if own_lengths.size else 0)
    ask = (compact or per_sample) and cu_seqlens is None and (mask is not None or own_lengths is not None)
    pieces = streaming.build_request_pieces(estimator, config, output_dtype, cu_seqlens, per_sample=ask,
                                            mask_columns=mask_columns, **tensors)
    # the rebuild of a per-sample answer reads the mask that was sent, never the caller's object, which the
    # caller may reuse (write the next batch into) while the call is in flight: a bool snapshot of it (the
    # compaction's bool mask is a new array already, nobody else's)
    snapshot = None
    if ask and mask is not None:
        snapshot = layout.bool_mask(own_mask, like=np.empty(0)) if own_mask is not None else _mask_snapshot(mask)
    return PreparedCall(streaming.Request(pieces), per_sample, snapshot, columns, own_lengths,
                        sent_lengths=own_lengths is None and "lengths" in tensors)


def _mask_snapshot(mask: Any) -> np.ndarray:
    """A bool numpy copy of ``mask`` (a copy also when the mask is bool already: it is the caller's)."""
    m = layout.bool_mask(mask, like=np.empty(0))
    return np.array(m, dtype=np.bool_, copy=True)


def finish_result(reply: Any, call: PreparedCall, as_numpy: bool = False) -> AdvantageResult:
    """The server's reply (``codec.DecodedResult`` or ``AdvantageResult`` message) -> :class:`AdvantageResult`:
    a per-sample reply is rebuilt to the documented ``[B, T]`` tensors (:func:`advantage_client.layout.rebuild`:
    new writable tensors, equal to what a dense reply would hold) unless the call asked for ``per_sample``.
    A dense reply is returned as it is, also to a ``per_sample`` call (``layout == "dense"``: the estimator
    gives no per-sample result under this config)."""
    result = decode_result(reply, as_numpy=as_numpy)
    code = getattr(reply, "layout", 0)
    if code == layout.DENSE or call.per_sample:
        return result
    if call.mask is None and call.lengths is None:
        raise RuntimeError("the server answered per-sample to a call that did not ask for it")
    dense_shape = list(getattr(reply, "dense_shape", ()))
    columns = dense_shape[1] if len(dense_shape) == 2 else call.columns
    mask = None
    if code != layout.BROADCAST:  # the server accepted the call: the mask the lengths stand for is that small
        mask = (layout.bool_mask(call.mask, like=result.advantages) if call.mask is not None
                else layout.prefix_mask(call.lengths, columns, like=result.advantages))
    result.advantages = layout.rebuild(result.advantages, code, mask, columns)
    if result.returns is not None:
        result.returns = layout.rebuild(result.returns, code, mask, columns)
    result.layout = "dense"
    return result


def lengths_refused(error: AdvantageServiceError, call: PreparedCall) -> bool:
    """A server that predates ``lengths`` refused the one the compaction sent (it "does not read" it): the
    client then sends the mask as bytes, this call and every later one."""
    return call.sent_lengths and error.code == grpc.StatusCode.INVALID_ARGUMENT and any(
        f == "inputs['lengths']" and "does not read" in d for f, d in error.field_violations)


def not_ready(target: str, timeout: float) -> AdvantageServiceError:
    """The UNAVAILABLE error ``wait_ready`` raises when no server answered within ``timeout`` seconds."""
    return AdvantageServiceError(grpc.StatusCode.UNAVAILABLE, f"no server answered at {target} within {timeout}s: "
                                 "start advantage-server there, or check the address and port and that it is running")


def check_timeout(timeout: Any) -> Any:
    """``timeout``: None (no deadline) or a finite number of seconds > 0; anything else is a ``ValueError``
    (gRPC would take a negative or zero deadline as already expired, and NaN as no deadline)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout={timeout!r}: give the deadline per call in seconds, a finite number > 0, "
                         "or None for no deadline")
    return timeout


class _ClientTimeout:
    """The default of ``compute(timeout=...)``: the client's own ``timeout``."""

    def __repr__(self) -> str:
        return "<the client's timeout>"


#: ``compute(timeout=CLIENT_TIMEOUT)`` (the default): the call's deadline is the client's ``timeout``
CLIENT_TIMEOUT: Any = _ClientTimeout()


def call_timeout(timeout: Any, client_timeout: float | None) -> float | None:
    """The deadline of one ``compute`` call in seconds: the client's ``client_timeout`` for
    :data:`CLIENT_TIMEOUT`, else ``timeout`` checked as :func:`check_timeout` does (None: no deadline)."""
    return client_timeout if timeout is CLIENT_TIMEOUT else check_timeout(timeout)


#: options of ``compute`` (keywords that are never input tensors)
CALL_OPTIONS = ("config", "output_dtype", "as_numpy", "cu_seqlens", "transport", "per_sample", "timeout")
#: keywords of gRPC's calls that are neither options of ``compute`` nor inputs: what to do instead
_GRPC_CALL_OPTIONS = {
    "deadline": "compute takes timeout= (this call's deadline in seconds, None for none), not deadline=",
    "metadata": "the client sends its own call metadata (the bearer token: token= or token_file= when creating "
                "the client)",
    "credentials": "TLS is an option of the client (tls=, tls_ca=, tls_cert=, tls_key= when creating it)",
    "compression": "the client does not compress its calls",
}
#: request fields given as keywords beside the tensors (not tensors themselves)
_REQUEST_FIELDS = frozenset({"mask_columns"})


@functools.lru_cache(maxsize=None)
def _client_options(cls: type) -> frozenset[str]:
    """The keyword options of ``cls``'s constructor (``retry``, ``wait_for_ready``, ``compact``, ...)."""
    return frozenset(inspect.signature(cls.__init__).parameters) - {"self", "timeout"}


def check_inputs(tensors: dict[str, Any], client: Any) -> None:
    """Refuse, before anything is encoded, the keywords of a ``compute`` call that cannot be input tensors:
    an option of ``client``'s constructor (``retry=``, ``wait_for_ready=``, ``compact=``, ...), an option of a
    gRPC call (``deadline=``, ``metadata=``, ...), whatever their value; and any other keyword whose value is a
    scalar (``float``, ``int``, ``bool``, ``str``, ``bytes``, a numpy scalar: a misspelt option such as
    ``timout=5.0``), since every input is a ``[B]`` or ``[B, T]`` tensor. Raises ``wire.WireError`` (a
    ``ValueError``) naming the keyword and the fix; ``None`` values pass (they are skipped)."""
    cls = type(client)
    for name, value in tensors.items():
        if name in _REQUEST_FIELDS:
            continue
        if name in _GRPC_CALL_OPTIONS:
            raise wire.WireError(name, f"not an input tensor, nor an option of compute: {_GRPC_CALL_OPTIONS[name]}")
        if name in _client_options(cls):
            raise wire.WireError(name, f"{name}= is an option of the client, not of a call nor an input tensor: "
                                       f"set it when creating the client ({cls.__name__}(target, {name}=...))")
        if value is not None and isinstance(value, (numbers.Number, str, bytes, np.generic)):
            raise wire.WireError(name, f"{name}={value!r}: compute has no option {name!r} (its options: "
                                       f"{', '.join(CALL_OPTIONS)}), and a {type(value).__name__} is not an input "
                                       "tensor: inputs are [B] or [B, T] tensors (torch, numpy or lists), named as "
                                       "list_estimators() gives them")


def stream_refused(error: AdvantageServiceError, nbytes: int, max_message_bytes: int) -> bool:
    """A stream the server refused for its ``--max-stream-mb`` although the request (``nbytes``) fits one
    message: ``transport="auto"`` then sends it unary (an explicit ``"stream"`` is not second-guessed)."""
    return (error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-stream-mb" in str(error)
            and nbytes < max_message_bytes)


def build_request(estimator: str, config: Any = None, output_dtype: Any = None, cu_seqlens: Any = None,
                  *, per_sample: bool = False, mask_columns: int = 0, **tensors: Any) -> pb.ComputeAdvantageRequest:
    """Encode one call. ``prompt_ids`` given as ``[B, L]`` rows or as string labels is reduced to ``[B]`` ids
    first; ``cu_seqlens`` (``[B + 1]`` row offsets) selects the packed layout; ``per_sample`` and
    ``mask_columns`` set the request fields of those names (see the .proto). Tensors are sent as given
    (no mask compaction: :func:`prepare_call` does that for ``compute``)."""
    request = pb.ComputeAdvantageRequest(per_sample=per_sample, mask_columns=mask_columns)
    if cu_seqlens is not None:
        request.cu_seqlens.CopyFrom(wire.encode_tensor(cu_seqlens, "cu_seqlens"))
    field_name, _ = wire.ESTIMATOR_FIELDS.get(estimator, (None, None))
    cfg = wire.config_message(estimator, config)
    getattr(request, field_name).CopyFrom(cfg)
    if output_dtype is not None:
        request.output_dtype = wire.output_dtype_code(output_dtype)
    for name, value in tensors.items():
        if value is None:
            continue
        if name in LABEL_INPUTS:
            value = reduce_prompt_ids(value, name)
        request.inputs[name].CopyFrom(wire.encode_tensor(value, f"inputs[{name!r}]"))
    return request


def _no_room(need: int) -> bool:
    """``fits`` while the pool's growth is paused: no new region."""
    return False


class _Waiter:
    """A call waiting for a shared-memory region: handed a region, or leave to register one (``may_create``)."""

    __slots__ = ("ready", "region", "may_create")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.region: Any = None
        self.may_create = False


class AdvantageClient:
    """Connection to the advantage service. Thread-safe; use as a context manager or call :meth:`close`.

    target:  ``"host:port"`` (any gRPC target string, e.g. ``"dns:///advantage.svc:50051"``), or a list of
             replica addresses (``["10.0.0.1:50051", "10.0.0.2:50051"]``). Calls are spread over the
             replicas (round_robin) and a call that fails with UNAVAILABLE (replica down, restarting or
             draining) is retried with backoff on another one (see ``advantage_client.channel``). A target
             without a port (``"localhost"``) or that is not a string (``50051``) is a
             ``advantage_client.channel.TargetError`` (a ``ValueError``) saying how to write it.
    timeout: deadline per call in seconds (None = no deadline); ``compute(..., timeout=)`` overrides it for
             one call.
    max_message_mb: largest request/response this client sends or accepts.
    tls_ca:  PEM bytes or path of the CA that signed the server certificate (TLS); ``tls=True`` with no
             ``tls_ca`` uses the system roots. ``tls_cert``/``tls_key``: client certificate (mutual TLS).
             ``tls_server_name``: the name to check the server certificate against, when it is not the target's.
    token / token_file: bearer token sent with every call (``authorization: Bearer <token>``).
    retry:   retry UNAVAILABLE and a server's CANCELLED (default True; ``advantage_client.channel.RETRY_POLICY``).
             ``wait_for_ready``: when no replica is up, wait for one (until the deadline) instead of failing fast.
    transport: how ``compute`` sends a batch (see ``advantage_client.streaming``): ``"auto"`` (default: the
             fastest that works, see below), ``"unary"``, ``"stream"`` (chunked ComputeAdvantageStream, no 2 GiB
             cap) or ``"shm"`` (shared memory, server on the same host; see :meth:`shared_memory`).
             ``"auto"`` uses shared memory when the server is on this host: the first call registers a region
             (RegisterSharedMemory); if that fails (a server on another host or in another container,
             UNIMPLEMENTED, no token) the client remembers it for ``SHM_RETRY_S`` (60) seconds and then tries
             again (several replicas: never; a refused growth of a working pool only pauses the growth; a
             /dev/shm too small for one request only sends that request another way). Otherwise, and for requests above ``shm_max_mb`` or while every region of the
             pool is busy (``shm_regions``), it sends requests of ``stream_threshold_mb`` MiB or more with ``"stream"`` and smaller
             ones with ``"unary"``. ``shm_min_mb``: smaller requests go unary even when shared memory works.
    shm_regions: concurrent calls over shared memory each take a region of their own from a pool the client
             grows on demand up to this many regions (default 8; each sized for the largest request it has
             carried and kept until :meth:`close`, which unregisters and unlinks them). When all are busy,
             ``transport="shm"`` waits for one and ``"auto"`` sends the call another way.
    compact: send 0/1 masks as one byte per token or as ``lengths`` and ask for per-sample results, rebuilt
             to the dense tensors here (default True); False sends the tensors as given and gets the dense
             result over the wire (the behaviour of clients before per-sample results; for comparisons).
    channel_options: more gRPC channel arguments (``[("grpc.use_local_subchannel_pool", 1)]``), added to the
             client's own (``advantage_client.channel.make_channel``) on every channel it makes.
    failover: resend what another attempt may get through (default True; see :class:`Failover`): an admission
             refusal of a full server (RESOURCE_EXHAUSTED with a retry pushback) after the pushback, to the
             same replica when the target names one, else to another; and with several replicas (a list, a DNS
             name resolving to several addresses, the Ray client's replicas) an attempt whose connection failed
             (UNAVAILABLE: a replica killed, or hung and found by the HTTP/2 keepalive) once more to another.
             Every attempt has the whole deadline left. False: one attempt per call, its error raised.
    """

    def __init__(self, target: str | Sequence[str], timeout: float | None = 60.0, *, max_message_mb: int = 1024,
                 channel: grpc.Channel | None = None, tls: bool = False, tls_ca: Any = None, tls_cert: Any = None,
                 tls_key: Any = None, tls_server_name: str | None = None, token: str | None = None,
                 token_file: Any = None, retry: bool = True, wait_for_ready: bool = False,
                 transport: str = "auto", stream_threshold_mb: float = streaming.DEFAULT_STREAM_THRESHOLD_MB,
                 chunk_mb: float = streaming.DEFAULT_CHUNK_MB, shm_min_mb: float = streaming.DEFAULT_SHM_MIN_MB,
                 shm_max_mb: float = streaming.DEFAULT_SHM_MAX_MB, compact: bool = True,
                 shm_regions: int = DEFAULT_SHM_REGIONS, channel_options: Sequence[tuple[str, Any]] = (),
                 failover: bool = True):
        self.compact = bool(compact)
        self.failover = bool(failover)
        #: called when an attempt whose connection failed is sent again (:class:`Failover`; the Ray client's look-up)
        self._on_timeout: Any = None
        self.target = channel_target(target)
        self.timeout = check_timeout(timeout)
        self.max_message_bytes = int(max_message_mb * (1 << 20))
        self._metadata = auth_metadata(token, token_file)
        if channel is None:  # a caller's own channel: its credentials are not known here
            warn_plaintext_token(self.target, self._metadata, bool(tls) or tls_ca is not None or tls_cert is not None)
        channel_args = dict(max_message_mb=max_message_mb, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                            tls_server_name=tls_server_name, retry=retry, wait_for_ready=wait_for_ready,
                            options=tuple(channel_options))
        self._channel = channel or make_channel(self.target, **channel_args)
        # failover resends to a replica of a list target chosen per call (_replica_calls); not on a channel
        # given by the caller (its options are not known here)
        self._channel_args, self._chunk_mb, self._steerable = channel_args, chunk_mb, channel is None
        self._replicas: dict[str, tuple[grpc.Channel, streaming.Calls]] = {}
        # Streams go on a channel of their own whose retry buffer is small: gRPC keeps every message of a call
        # it may retry (here up to max_message_mb) until the server answers, so a streamed 256 MiB request
        # would stay in memory twice and every chunk would land in fresh pages. A stream that has sent more
        # than the buffer is no longer retried (one that failed UNAVAILABLE before that still is).
        stream_channel = None if channel is not None else (lambda: make_channel(
            self.target, retry_buffer_mb=streaming.STREAM_RETRY_BUFFER_MB, **channel_args))
        self._stub = pb_grpc.AdvantageServiceStub(self._channel)
        if transport not in streaming.TRANSPORTS:
            raise ValueError(f"transport={transport!r}: choose one of {streaming.TRANSPORTS}")
        self.transport, self.stream_threshold_bytes = transport, int(stream_threshold_mb * (1 << 20))
        self._calls = streaming.Calls(self._channel, chunk_mb, stream_channel)
        # the regions transport="shm" / "auto" use: a pool grown on demand, one call per region at a time
        if int(shm_regions) < 1:
            raise ValueError(f"shm_regions={shm_regions!r}: at least 1")
        self.shm_regions = int(shm_regions)
        self._shm_free: list[Any] = []  # idle regions, the most recently used last
        self._shm_count = 0  # regions in use, idle or being registered
        self._shm_waiters: collections.deque[_Waiter] = collections.deque()  # calls waiting for a region, in order
        self._shm_lock = threading.Lock()
        self._shm_closed = False
        self.shm_min_bytes, self.shm_max_bytes = int(shm_min_mb * (1 << 20)), int(shm_max_mb * (1 << 20))
        # transport="auto": does shared memory work with this server? None = not tried yet
        self._shm_works: bool | None = False if "," in self.target else None
        self._shm_forgotten = 0  # answers "no such region" so far (see MAX_SHM_FORGOTTEN)
        # _shm_works False: not before this time.monotonic() (inf: never again); growth: not before _shm_grow_at
        self._shm_retry_at = math.inf if self._shm_works is False else 0.0
        self._shm_grow_at = 0.0
        self._lengths_ok = True  # False once a server refused `lengths` (it predates them): masks go as bytes
        self._local = threading.local()  # .timeout: the deadline of this thread's compute(timeout=...) call

    @classmethod
    def from_ray(cls, name: str = "advantage", namespace: str = "advantage", *, address: str | None = None,
                 refresh_s: float | None = 10.0, lookup_timeout: float = 5.0, wait_s: float = 30.0,
                 **kwargs: Any) -> Any:
        """A client on the replicas that ``advantage-ray up`` started on a Ray cluster (deployment ``name`` in Ray
        namespace ``namespace``), balanced over them as a list of replicas is (round_robin, UNAVAILABLE retried
        on another one), that follows them when Ray restarts one elsewhere: the addresses are looked up again
        every ``refresh_s`` seconds and at once when a call fails with UNAVAILABLE (then sent once more on the
        new set). Returns an :class:`advantage_client.ray_discovery.RayClient` (``compute``,
        ``list_estimators``, ``close``, context manager, as this class).

        Uses the process's Ray connection (a trainer's driver or actor), else ``ray.init(address=address)``
        (None: ``$RAY_ADDRESS`` or ``"auto"``). ``kwargs``: this class's options (timeout, TLS, token,
        transport, ...). ``ray`` is imported only here. Raises ``ImportError`` without Ray,
        :class:`AdvantageServiceError` (UNAVAILABLE) when no replica answered within ``wait_s`` seconds."""
        from advantage_client import ray_discovery
        return ray_discovery.RayClient(cls, name=name, namespace=namespace, address=address, refresh_s=refresh_s,
                                       lookup_timeout=lookup_timeout, wait_s=wait_s, **kwargs)

    def compute(self, estimator: str, config: Any = None, *, output_dtype: Any = None, as_numpy: bool = False,
                cu_seqlens: Any = None, transport: str | None = None, per_sample: bool = False,
                timeout: Any = CLIENT_TIMEOUT, **tensors: Any) -> AdvantageResult:
        """Run ``estimator`` (any name :meth:`list_estimators` returns: grpo, gae, rloo, ...) on the given tensors.

        config: None (defaults), a dict with NeMo RL key names, or the typed config message
                (``advantage_client.GAEConfig(...)``).
        tensors: the estimator's inputs by name (see :meth:`list_estimators`); GDPO components as
                ``**{"reward/correctness": ..., "reward/format": ...}``. ``None`` values are skipped.
        output_dtype: "float32" (default), "float64", "bfloat16" or "float16" (or the torch/NumPy dtype);
                any other is a ``WireError`` (a ``ValueError``) naming these four, raised before sending.
        prompt_ids: ``[B]`` integer group ids, ``[B]`` labels (NumPy str/object array or list of strings,
                equal labels = one group), or ``[B, L]`` prompt token rows.
        cu_seqlens: packed (ragged) layout: ``[B + 1]`` int row offsets; every token-level input is then
                flat ``[N]`` (``N = cu_seqlens[-1]``, no padding), ``mask`` may be omitted (all ones) or flat
                ``[N]`` with holes, and the result's advantages/returns come back flat ``[N]``.
        transport: overrides the client's ``transport`` for this call.
        per_sample: return ``[B]`` advantages (and returns) where the estimator gives one value per row under
                this config (``ListEstimators``' ``per_sample``), with ``result.layout`` saying how they stand
                for the ``[B, T]`` tensors; elsewhere the dense result (``layout == "dense"``). Default: the
                dense ``[B, T]`` tensors, rebuilt here from the per-sample answer the client asks the server
                for whenever it has a mask (unary and stream; shared memory answers dense), so fewer bytes
                travel and the values are exactly the dense answer's. Not with ``transport="shm"``.
        mask:   a float (or int32/int64) mask holding only 0 and 1 is sent as one byte per token, or as
                ``lengths`` ``[B]`` when every row's 1s come first (unary and stream). ``lengths=`` ``[B]``
                integers (and ``mask_columns=`` T, default ``max(lengths)``) may be sent in place of ``mask``.
        timeout: this call's deadline in seconds, in place of the client's ``timeout`` (default: the client's;
                None: no deadline). It bounds each RPC the call makes (the compute call on every transport, and
                the registration of a shared-memory region the call needs); past it the call raises
                :class:`AdvantageServiceError` DEADLINE_EXCEEDED. A bad value (<= 0, NaN, inf, a string) is a
                ``ValueError``.
        Raises ``wire.WireError`` (a ValueError) for arguments that cannot be encoded and for keywords that
        cannot be inputs (an option of the client such as ``retry=`` or ``wait_for_ready=``, ``deadline=``,
        ``metadata=``, or a scalar such as a misspelt ``timout=5.0``: see :func:`check_inputs`), and
        :class:`AdvantageServiceError` for every error the server reports: :class:`InvalidArgumentError`
        (also a ``ValueError``) for INVALID_ARGUMENT, on every transport; ``ValueError`` once the client is closed.

        Failover (``failover=True``, see :class:`Failover`): an admission refusal (RESOURCE_EXHAUSTED with
        the server's retry pushback, ``grpc-retry-pushback-ms``) is sent again after the pushback (jittered), at
        most ``PUSHBACK_MAX_RETRIES`` times within ``timeout``: to the same replica when the target names one,
        else to another; past those bounds the refusal is raised. A RESOURCE_EXHAUSTED without pushback (a size
        limit, out of memory, an upload cut) is raised at once. With several replicas, an attempt that ended
        UNAVAILABLE because its connection failed (a replica killed, or hung: found by the keepalive PINGs
        within about 4 s) is sent once more to another (a shared-memory call on a fresh region). Every attempt
        has the whole deadline left: a slow call is never cut short or run twice.
        """
        if self._shm_closed:
            raise ValueError("this AdvantageClient is closed (close(), or the end of its with block): make a new one")
        deadline = call_timeout(timeout, self.timeout)
        check_inputs(tensors, self)
        args = (estimator, config, output_dtype, as_numpy, cu_seqlens, transport, per_sample, tensors)
        if not self.failover and deadline == self.timeout:
            return self._compute(*args)
        # the shared-memory path (shm.py) makes its RPCs through _call, which reads this thread's deadline
        outer = getattr(self._local, "timeout", CLIENT_TIMEOUT)
        if not self.failover:
            self._local.timeout = deadline
            try:
                return self._compute(*args)
            finally:
                self._local.timeout = outer
        replicas = replica_count(self.target)
        plan = Failover(replicas, deadline, self._on_timeout, replica_targets(self.target) if self._steerable else ())
        try:
            while True:
                self._local.timeout = plan.attempt_timeout()
                self._local.calls = None if plan.via is None else self._replica_calls(plan.via)
                try:
                    return self._compute(*args)
                except AdvantageServiceError as err:
                    pause = plan.after(err, self.target)  # raises the call's error when not sent again
                time.sleep(pause)  # then the next attempt, on plan.via (else round_robin's next replica)
        finally:
            self._local.timeout, self._local.calls = outer, None

    def _replica_calls(self, target: str) -> streaming.Calls:
        """The calls on a channel to the one replica ``target`` (:func:`replica_targets`), made on first use and
        kept until :meth:`close`: where a failover resend goes (:class:`Failover`). Its retry policy is off (a
        replica not serving answers UNAVAILABLE at once and the resend moves on to the next)."""
        with self._shm_lock:
            if self._shm_closed:
                raise ValueError("the client is closed")
            if target not in self._replicas:
                args = {**self._channel_args, "retry": False}
                channel = make_channel(target, **args)
                self._replicas[target] = (channel, streaming.Calls(channel, self._chunk_mb, lambda: make_channel(
                    target, retry_buffer_mb=streaming.STREAM_RETRY_BUFFER_MB, **args)))
            return self._replicas[target][1]

    @property
    def _call_timeout(self) -> float | None:
        """The deadline of the calling thread's current ``compute`` (the client's ``timeout`` outside one)."""
        return call_timeout(getattr(self._local, "timeout", CLIENT_TIMEOUT), self.timeout)

    def _compute(self, estimator: str, config: Any, output_dtype: Any, as_numpy: bool, cu_seqlens: Any,
                 transport: str | None, per_sample: bool, tensors: dict[str, Any]) -> AdvantageResult:
        transport = transport or self.transport
        if transport not in streaming.TRANSPORTS:
            raise ValueError(f"transport={transport!r}: choose one of {streaming.TRANSPORTS}")
        if per_sample and transport == "shm":
            raise ValueError("per_sample=True is not available over shared memory (its results are written "
                             "dense into the region): use transport='auto', 'unary' or 'stream'")
        check_mask_columns({k: v for k, v in tensors.items() if v is not None})  # on every transport
        shm_kwargs = dict(output_dtype=output_dtype, as_numpy=as_numpy, cu_seqlens=cu_seqlens, **tensors)
        if transport == "shm":
            return self._compute_shm(estimator, config, **shm_kwargs)
        if (transport == "auto" and (self._shm_works is not False or time.monotonic() >= self._shm_retry_at)
                and not per_sample and "lengths" not in tensors):
            size = streaming.payload_estimate(tensors)
            if self.shm_min_bytes <= size <= self.shm_max_bytes:
                result = self._auto_shm(estimator, config, shm_kwargs)
                if result is not None:
                    return result
        prepared = prepare_call(estimator, config, output_dtype, cu_seqlens, per_sample, tensors,
                                compact=self.compact, as_lengths=self._lengths_ok)
        try:
            return self._send_prepared(prepared, transport, as_numpy)
        except AdvantageServiceError as err:
            if not lengths_refused(err, prepared):
                raise
            self._lengths_ok = False
            prepared = prepare_call(estimator, config, output_dtype, cu_seqlens, per_sample, tensors,
                                    compact=self.compact, as_lengths=False)
            return self._send_prepared(prepared, transport, as_numpy)

    def _send_prepared(self, prepared: PreparedCall, transport: str, as_numpy: bool) -> AdvantageResult:
        data = prepared.request
        auto = transport == "auto"
        if auto:
            transport = "stream" if data.nbytes >= self.stream_threshold_bytes else "unary"
        self.last_transport = transport
        calls = getattr(self._local, "calls", None) or self._calls  # a failover resend's replica, if any
        call = calls.stream if transport == "stream" else calls.unary
        timeout = self._call_timeout
        try:
            reply = call(data, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            error = AdvantageServiceError.from_rpc_error(err, self.target, timeout, calls.channel_of(transport))
            if not (auto and transport == "stream" and stream_refused(error, data.nbytes, self.max_message_bytes)):
                raise error from None
            # the server takes smaller streams than this; one message may still be within its limit
            self.last_transport = "unary"
            try:
                reply = calls.unary(data, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as err2:
                raise AdvantageServiceError.from_rpc_error(err2, self.target, timeout,
                                                           calls.channel_of("unary")) from None
        return finish_result(reply, prepared, as_numpy=as_numpy)

    def shared_memory(self, byte_size: int) -> Any:
        """A new shared-memory region of ``byte_size`` bytes registered with the server (same host only):
        an ``advantage_client.shm.SharedMemoryRegion``; close it (or use ``with``) when done."""
        from advantage_client.shm import SharedMemoryRegion
        return SharedMemoryRegion(self, byte_size)

    @staticmethod
    def _shm_need(kwargs: dict[str, Any]) -> int:
        """Region bytes for the inputs and the results: advantages and returns are at most as many elements
        as the largest input (``[B, T]`` or packed ``[N]``), float32 unless a wider ``output_dtype`` is asked
        for (a bool mask's result is 4x its bytes)."""
        tensors = [v for k, v in kwargs.items()
                   if k not in ("output_dtype", "as_numpy", "cu_seqlens", "mask_columns") and v is not None]
        inputs = sum(streaming.payload_estimate({"x": v}) + 64 for v in tensors)
        out_dtype = kwargs.get("output_dtype")
        itemsize = 8 if out_dtype is not None and wire.output_dtype_code(out_dtype) == pb.DTYPE_FLOAT64 else 4
        elems = max((streaming.numel_estimate(v) for v in tensors), default=0)
        return inputs + 2 * (elems * itemsize + 64) + (1 << 20)

    @property
    def _shm(self) -> Any:
        """The idle region used last (None when the pool holds no idle region)."""
        with self._shm_lock:
            return self._shm_free[-1] if self._shm_free else None

    @property
    def shm_region_count(self) -> int:
        """Shared-memory regions this client holds now (in use or idle)."""
        return self._shm_count

    def _shm_take(self, need: int, wait: bool = True, fits: Any = None) -> Any:
        """A region of at least ``need`` bytes for one call, for this caller alone until :meth:`_shm_give`:
        an idle one that is large enough, else a larger one in place of an idle smaller one, else a new one
        while the pool has fewer than ``shm_regions``. When every region is busy: wait for one (``wait``; the
        waiters are served in arrival order, each region handed over as it is given back), or None.
        ``fits(need)``: whether a new region of ``need`` bytes can be made now (else None). Registration
        errors propagate."""
        replace, waiter = None, None
        with self._shm_lock:
            if self._shm_closed:
                raise ValueError("the client is closed")
            if not self._shm_waiters:
                for i in range(len(self._shm_free) - 1, -1, -1):
                    if self._shm_free[i].size >= need:
                        return self._shm_free.pop(i)
            if not self._shm_waiters and (self._shm_free or self._shm_count < self.shm_regions):
                if fits is not None and not fits(need):
                    return None
                if self._shm_free:  # an idle one too small: a larger one replaces it (the pool stays as large
                    replace = self._shm_free.pop(0)  # as the calls at once need); the least recently used
                else:
                    self._shm_count += 1
            elif not wait:
                return None
            else:
                waiter = _Waiter()
                self._shm_waiters.append(waiter)
        if waiter is not None:
            waiter.ready.wait()
            if waiter.region is None and not waiter.may_create:
                raise ValueError("the client is closed")
            if waiter.region is not None:
                if waiter.region.size >= need:
                    return waiter.region
                replace = waiter.region
        if replace is not None:
            replace.close()
        try:
            return self.shared_memory(need)
        except BaseException:
            self._shm_forget_one()
            raise

    def _shm_forget_one(self) -> None:
        """One region fewer in the pool: the first waiter, if any, may register one in its place."""
        with self._shm_lock:
            if self._shm_waiters and not self._shm_closed:
                waiter = self._shm_waiters.popleft()
                waiter.may_create = True
                waiter.ready.set()
            else:
                self._shm_count -= 1

    def _shm_give(self, region: Any, drop: bool = False) -> None:
        """Return a region taken with :meth:`_shm_take` to the pool (to the first waiter, if any); ``drop``
        (or an abandoned call on it, or a closed client): close it instead."""
        drop = drop or bool(region.abandoned)
        if not drop:
            with self._shm_lock:
                if not self._shm_closed:
                    if self._shm_waiters:
                        waiter = self._shm_waiters.popleft()
                        waiter.region = region
                        waiter.ready.set()
                    else:
                        self._shm_free.append(region)
                    return
        self._shm_forget_one()
        # After an abandoned call the server may still write that call's results into the region: it is never
        # used again. No Unregister call then (the server may be gone: it must not block); the server forgets
        # a region whose segment is unlinked at its next registration.
        region.close()

    def _shm_drop_idle(self) -> None:
        """Close every idle region (the server forgot one: it restarted, or another replica answered)."""
        with self._shm_lock:
            idle, self._shm_free = self._shm_free, []
            self._shm_count -= len(idle)
        for region in idle:
            region.close()

    def _compute_shm(self, estimator: str, config: Any, region: Any = None, **kwargs: Any) -> AdvantageResult:
        self.last_transport = "shm"
        if region is None:
            region = self._shm_take(self._shm_need(kwargs))
        try:
            return region.compute(estimator, config, **kwargs)
        finally:
            self._shm_give(region)

    def _auto_shm(self, estimator: str, config: Any, kwargs: dict[str, Any]) -> AdvantageResult | None:
        """transport="auto" through shared memory; None when it cannot be used (then the caller streams or
        sends one message). A failed registration is remembered for ``SHM_RETRY_S`` seconds (shared memory is
        off meanwhile, then tried again) unless it was a transient UNAVAILABLE / DEADLINE_EXCEEDED /
        CANCELLED; one that only failed to grow the pool (other regions of it work) pauses the growth alone
        for as long; a region the server no longer holds (NOT_FOUND: evicted, or the server restarted) is
        registered again and the call resent within the call (``SharedMemoryRegion.compute``); when that fails
        the call goes another way and the next one registers a new region. Only a region the server never knew
        (another replica answered) counts: after ``MAX_SHM_FORGOTTEN`` of those shared memory stays off for the
        client; evictions never turn it off."""
        from advantage_client import shm as shm_mod
        need = self._shm_need(kwargs)
        # every region busy: this call does not wait for one; /dev/shm too small for a new region of this
        # size (writing past it would be SIGBUS): not this time either
        # (a sealed memfd does not live in /dev/shm: Docker's 64 MiB default does not bound it)
        if time.monotonic() < self._shm_grow_at:
            fits = _no_room
        elif shm_mod.memfd_supported() and not getattr(self, "_shm_memfd_refused", False):
            fits = None
        else:
            fits = shm_mod.room_for
        try:
            region = self._shm_take(need, wait=False, fits=fits)
        except AdvantageServiceError as err:
            if err.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.CANCELLED):
                self._shm_refused()
            return None
        except OSError as err:  # no /dev/shm (remembered a while), or no room now (ENOSPC: tried again later)
            if err.errno != errno.ENOSPC:
                self._shm_refused()
            return None
        except ValueError:  # the client is closed
            self._shm_works, self._shm_retry_at = False, math.inf
            return None
        if region is None:
            return None
        forgotten = False
        try:
            result = self._compute_shm(estimator, config, region=region, **kwargs)
        except AdvantageServiceError as err:
            gone = shm_mod.region_gone(err)  # the region could not be registered again (shm.py tried once)
            if gone is not None:
                # the server forgot the region (restarted, or another replica answered): register anew on the
                # next call, but after MAX_SHM_FORGOTTEN such answers (replicas behind one address) stop trying;
                # an evicted region (a full table: ordinary load) never turns shared memory off
                if gone != shm_mod.REASON_EVICTED:
                    self._shm_forgotten += 1
                    self._shm_works = False if self._shm_forgotten >= MAX_SHM_FORGOTTEN else None
                    if self._shm_works is False:
                        self._shm_retry_at = math.inf
                forgotten = True
                return None
            if err.code == grpc.StatusCode.INVALID_ARGUMENT and any(
                    f.startswith("output_") for f, _ in err.field_violations):
                return None  # the result did not fit the region (a larger output than estimated): not via shm
            raise
        except MemoryError:  # the inputs did not fit the region
            return None
        finally:
            if forgotten:  # this region and the idle ones were registered with a server that forgot them
                self._shm_drop_idle()
        self._shm_works = True
        return result

    def _shm_refused(self) -> None:
        """A region could not be registered: with other regions in the pool that work, the pool stops growing
        for ``SHM_RETRY_S`` seconds; else shared memory is off that long (then tried again)."""
        now = time.monotonic()
        if self._shm_works is True and self._shm_count > 0:
            self._shm_grow_at = now + SHM_RETRY_S
        else:
            self._shm_works = False
            self._shm_retry_at = now + SHM_RETRY_S

    def _call(self, method: str, request: Any, response_cls: type) -> Any:
        """One shared-memory RPC (the region API's compute, register, unregister). A call the server cut to give its
        place to another client (``CUT_FOR_ANOTHER``: it had sent no body yet, nothing was computed) is sent again
        after ``CUT_PAUSE_S`` jittered, at most ``PUSHBACK_MAX_RETRIES`` times within the deadline, as
        :class:`Failover` does for ``compute``: a busy loop found 1 of 64 shared-memory processes' calls cut and
        raised (tests/test_shm_many_processes.py). Raises :class:`AdvantageServiceError` otherwise."""
        from advantage_client.shm import call
        timeout = self._call_timeout
        policy = Failover(1, timeout)  # one channel: only the bounds of a resend (count, pause, deadline)
        while True:
            try:
                return call(self._channel, method, request, response_cls, timeout=policy.attempt_timeout(),
                            metadata=self._metadata)
            except grpc.RpcError as err:
                error = AdvantageServiceError.from_rpc_error(err, self.target, timeout, self._channel)
            cut = error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and CUT_FOR_ANOTHER in str(error)
            pause = policy.retry(error) if cut else None  # other refusals are the caller's (the region API's)
            if pause is None:
                raise error from None
            time.sleep(pause)

    def list_estimators(self) -> pb.ListEstimatorsResponse:
        """Every estimator the server runs, with its config fields and inputs (the service contract)."""
        try:
            return self._stub.ListEstimators(pb.ListEstimatorsRequest(), timeout=self.timeout,
                                             metadata=self._metadata)
        except grpc.RpcError as err:
            raise AdvantageServiceError.from_rpc_error(err, self.target, self.timeout, self._channel) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel is connected; raises AdvantageServiceError(UNAVAILABLE) after ``timeout``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise not_ready(self.target, timeout) from None

    @property
    def last_transport(self) -> str | None:
        """The transport the calling thread's latest :meth:`compute` used ("unary", "stream" or "shm")."""
        return getattr(self._calls._local, "transport", None)

    @last_transport.setter
    def last_transport(self, value: str | None) -> None:
        self._calls._local.transport = value

    @property
    def last_timing(self) -> dict[str, float]:
        """The calling thread's latest streamed call, split (see ``advantage_client.streaming.Calls``)."""
        return self._calls.last_timing

    def close(self) -> None:
        """Unregister and unlink the shared-memory regions (a region still in use by a call is closed when
        that call ends), then close the channels."""
        with self._shm_lock:
            self._shm_closed = True
            idle, self._shm_free = self._shm_free, []
            self._shm_count -= len(idle)
            waiters, self._shm_waiters = self._shm_waiters, collections.deque()
        for waiter in waiters:  # they raise ValueError: the client is closed
            waiter.ready.set()
        for region in idle:
            region.close()
        with self._shm_lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        for channel, calls in replicas:
            calls.close()
            channel.close()
        self._calls.close()
        self._channel.close()

    def __enter__(self) -> "AdvantageClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
