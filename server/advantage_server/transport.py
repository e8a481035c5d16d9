"""Server side of the fast transports (mixed into :class:`~advantage_server.server.AdvantageServicer`).

* **Codec** (``ComputeAdvantage``): the request bytes are parsed by :mod:`advantage_client.codec` (tensor
  payloads stay views of the received buffer, no protobuf ``bytes`` copies) and the result is written
  by it (one copy of each result tensor). The bytes on the wire are exactly protobuf's, so clients using
  the plain generated stubs are unaffected.
* **Client streaming** (``ComputeAdvantageStream``): the serialized request in chunks of a few MiB,
  reassembled into one buffer allocated once from the declared total size (capped by
  ``max_stream_bytes``: RESOURCE_EXHAUSTED beyond it); the serialized result goes back in chunks.
  No 2 GiB cap: the codec reads and writes any length.
* **Shared memory** (``RegisterSharedMemory`` / ``UnregisterSharedMemory`` / ``ComputeAdvantageShm``): a
  co-located client registers a POSIX shared-memory segment or a Linux memfd it created and gets a region
  id and a secret key; calls carrying the key read inputs from and write results to the region, every
  tensor bounds-checked against the registered size. The regions themselves (how a segment is opened,
  read and written, the snapshots of a mapped region's ids and masks, the quotas, the LRU eviction and
  the sweep of dead owners' regions) live in :mod:`advantage_server.regions`; the handlers here only use
  its :class:`~advantage_server.regions.RegionTable`.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import grpc
import numpy as np
import torch

from advantage_client import codec, wire
from advantage_client.streaming import TIMING_KEY
from advantage_client.proto import advantage_pb2 as pb
from advantage_server import logs
from advantage_server.errors import InvalidInput, NotPermitted, ResourceLimit
from advantage_server.estimators import REGISTRY, AdvantageResult
from advantage_server.admission import refusal_metadata
from advantage_server.identity import call_peer
from advantage_server.uploads import EarlyStream, early_stream_cap
from advantage_server.limits import check_batch_elements, checkpoints, grpc_liveness
# the region table and what reaches a segment; re-exported here for the code and tests that name them so
from advantage_server.regions import (MAX_REGIONS, MAX_REGIONS_PER_SEGMENT, Region, RegionTable,  # noqa: F401
                                      client_identity, parse_memfd_name, read_in_place, region_cap, region_owner)

#: methods with a handler of their own (not the generic unary pipeline)
CUSTOM_HANDLERS = frozenset({"ComputeAdvantageStream"})
#: bytes per chunk the server sends (the client chooses its own)
CHUNK_BYTES = 4 << 20
#: guards the first use of a servicer's region table (:meth:`TransportMethods.region_table`)
_TABLE_GUARD = threading.Lock()
log = logging.getLogger("advantage_server")


def abort(context: grpc.ServicerContext, status: Any, metadata: tuple[tuple[str, str], ...] = ()) -> None:
    """End the call with ``status`` (a ``google.rpc.Status``: its details go in ``grpc-status-details-bin``) and
    ``metadata`` added to the trailing metadata (``advantage_server.admission.refusal_metadata``: the retry pushback of an admission
    refusal)."""
    grpc_status = _rpc_status().to_status(status)
    if metadata:
        grpc_status = _WithTrailers(grpc_status.code, grpc_status.details,
                                    tuple(grpc_status.trailing_metadata or ()) + tuple(metadata))
    context.abort_with_status(grpc_status)


class _WithTrailers(grpc.Status):
    """A ``grpc.Status`` with the given trailing metadata (``rpc_status``'s own carries only the details)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, Any], ...]):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def _rpc_status() -> Any:
    from grpc_status import rpc_status
    return rpc_status


def _label_call(estimator: str | None) -> None:
    """Tell the observability interceptor which estimator this call runs (known only after decoding)."""
    call = logs.CALL.get()
    if call is not None and estimator:
        call["estimator"] = estimator


def decode_request(data: Any) -> codec.DecodedRequest:
    """Request bytes -> :class:`codec.DecodedRequest`; bytes protobuf would reject are ``InvalidInput``."""
    try:
        return codec.decode_request(data)
    except codec.CodecFieldError as err:  # too many inputs or dimensions: refused as soon as they were passed
        raise InvalidInput(err.field, err.description) from None
    except codec.CodecError as err:
        raise InvalidInput("request", f"the {memoryview(data).nbytes} request bytes are not a valid "
                                      f"advantage.v1.ComputeAdvantageRequest message ({err}); serialize the "
                                      "request with the advantage.v1 schema") from None


@dataclass
class ResultPayload:
    """A computed result not yet encoded (the response serializer encodes it with the codec)."""

    result: AdvantageResult
    dtype: torch.dtype

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        adv = self.result.advantages.to(self.dtype)
        ret = self.result.returns.to(self.dtype) if self.result.returns is not None else None
        return adv, ret

    def pieces(self) -> list[Any]:
        """The encoded result's pieces (headers and views of the result tensors), for streaming it; made once."""
        made = self.__dict__.get("_pieces")
        if made is None:
            adv, ret = self.tensors()
            made = self.__dict__["_pieces"] = codec.result_pieces(
                adv, ret, {k: float(v) for k, v in self.result.metrics.items()}, self.result.layout,
                self.result.dense_shape)
        return made

    def nbytes(self) -> int:
        """The encoded result's length in bytes (what gRPC will hold until the client has read it)."""
        return codec.pieces_size(self.pieces())

    def encode(self) -> bytes:
        pieces = self.pieces()
        self.__dict__.pop("_pieces", None)  # the views go with the payload's last use
        return b"".join(pieces)


def response_serializer(response_cls: type):
    """Encodes :class:`ResultPayload` with the codec, generated messages with protobuf."""
    def serialize(response: Any) -> bytes:
        if isinstance(response, ResultPayload):
            return response.encode()
        if isinstance(response, (bytes, bytearray)):
            return bytes(response)
        return response.SerializeToString()
    return serialize


def _shm_layout(t: pb.SharedMemoryTensor, field: str) -> tuple[int, tuple[int, ...]]:
    if t.dtype not in wire.NUMPY_DTYPES:
        raise InvalidInput(f"{field}.dtype", f"dtype {t.dtype} is not supported")
    shape = tuple(int(d) for d in t.shape)
    if any(d < 0 for d in shape):
        raise InvalidInput(f"{field}.shape", f"negative dimension in shape {list(shape)}")
    return math.prod(shape) * wire.NUMPY_DTYPES[t.dtype].itemsize, shape


def _check_counts(request: pb.ComputeAdvantageShmRequest) -> None:
    """The codec's caps on a ``ComputeAdvantageShmRequest`` (protobuf parsed it, in C): at most
    ``codec.MAX_INPUTS`` inputs and ``codec.MAX_DIMS`` dimensions per tensor, checked on the containers'
    lengths before anything iterates over them."""
    inner = request.request
    for field, inputs in (("inputs", request.inputs), ("request.inputs", inner.inputs)):
        if len(inputs) > codec.MAX_INPUTS:
            raise InvalidInput(field, f"holds {len(inputs)} entries; send at most {codec.MAX_INPUTS} input tensors")
    tensors = [(f"inputs[{k!r}]", t) for k, t in request.inputs.items()]
    tensors += [(f"request.inputs[{k!r}]", t) for k, t in inner.inputs.items()]
    if inner.HasField("cu_seqlens"):
        tensors.append(("request.cu_seqlens", inner.cu_seqlens))
    for field, t in tensors:
        if len(t.shape) > codec.MAX_DIMS:
            raise InvalidInput(f"{field}.shape", f"has {len(t.shape)} dimensions; at most {codec.MAX_DIMS} are "
                                                 "supported")


def tensor_fields(msg: Any) -> dict[str, Any]:
    """Every ``advantage.v1.Tensor`` at the top level of ``msg`` (fields and map values), by field path."""
    if hasattr(msg, "tensor_fields"):  # a codec-decoded request (codec.DecodedRequest)
        return msg.tensor_fields()
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            if fd.message_type.fields_by_name["value"].message_type is pb.Tensor.DESCRIPTOR:
                out.update({f"{fd.name}[{k!r}]": v for k, v in value.items()})
        elif fd.message_type is pb.Tensor.DESCRIPTOR and not fd.is_repeated:
            out[fd.name] = value
    return out


class TransportMethods:
    """The transport RPCs; expects ``self.core``, ``self.limits``, ``self.gate``, ``self._status``, ``self._wait_results`` and ``self._hold_result`` of the
    servicer it is mixed into."""

    #: overrides ``limits.max_stream_bytes`` when set (tests)
    max_stream_bytes: int | None = None

    # ------------------------------------------------------------------ codec unary
    def compute_payload(self, request: Any, context: Any, output_provider: Any = None) -> ResultPayload:
        """check_batch_elements, a compute slot, the core; the result left for the codec to encode (or, with
        ``output_provider``, written where the provider put it: see ``AdvantageCore.run``)."""
        check_batch_elements(tensor_fields(request), self.limits.max_batch_elements)
        alive = grpc_liveness(context)
        with self.gate.compute_slot(alive), checkpoints(alive):
            return ResultPayload(*self.core.compute_result(request, output_provider=output_provider))

    # ------------------------------------------------------------------ client streaming
    def custom_handler(self, method: Any) -> grpc.RpcMethodHandler:
        # raw chunk bytes (decoded in _chunks), so a malformed chunk is an INVALID_ARGUMENT, not gRPC's INTERNAL
        return grpc.stream_stream_rpc_method_handler(self._stream, request_deserializer=None,
                                                     response_serializer=None)

    @staticmethod
    def _chunks(raw: Iterator[bytes], touch: Any) -> Iterator[tuple[int, memoryview]]:
        """Serialized ``ComputeAdvantageChunk`` messages -> (total_size, data view); each one that carries
        data bytes restarts the upload's idle clock (``touch``)."""
        for i, data in enumerate(raw):
            try:
                chunk = codec.decode_chunk(data)
            except (codec.CodecError, ValueError, TypeError, IndexError) as err:
                raise InvalidInput("chunk", f"stream message {i} is not a valid advantage.v1.ComputeAdvantageChunk "
                                            f"({err}); send serialized ComputeAdvantageChunk messages") from None
            if chunk[1].nbytes:  # only request bytes are progress: a trickle of empty chunks is still idle
                touch(chunk[1].nbytes)
            yield chunk

    def _reassemble(self, chunks: Iterator[tuple[int, memoryview]], alive: Any) -> np.ndarray:
        """The request's chunks -> one ``uint8`` numpy buffer allocated once from the declared total (numpy
        backs large buffers with transparent huge pages: far fewer page faults than a ``bytearray``)."""
        buf: np.ndarray | None = None
        total = pos = 0
        for declared, data in chunks:
            if buf is None:
                total = declared
                cap = self.max_stream_bytes or self.limits.max_stream_bytes
                if total > cap:
                    raise ResourceLimit(f"the streamed request declares {total} bytes, more than the server's "
                                        f"limit --max-stream-mb={cap >> 20} ({cap} bytes); split the batch into smaller "
                                        "requests")
                buf = np.empty(total, np.uint8)
            elif declared and declared != total:
                raise InvalidInput("total_size", f"chunk says {declared} bytes, the first chunk said {total}")
            n = data.nbytes
            if pos + n > total:
                raise InvalidInput("data", f"the chunks hold more than the declared total_size of {total} bytes; "
                                           "set total_size on the first chunk to the request's byte length")
            if n:
                buf[pos:pos + n] = np.frombuffer(data, np.uint8)
            pos += n
            alive("while receiving the request")
        if buf is None:
            buf = np.empty(0, np.uint8)
        if pos != total:
            alive("while receiving the request")  # a stream cut by the client's deadline or cancel is not malformed
            raise InvalidInput("data", f"the stream ended after {pos} of the declared {total} bytes")
        return buf

    def _stream(self, request_iterator: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        what, status, pieces, pushback = "ComputeAdvantageStream", None, [], ()
        t0 = t1 = t2 = time.perf_counter()
        peer = call_peer(context)  # now: once the call has ended, gRPC names no peer
        # read while the call waits for a place, when the waiting room asks: a whole stream (or its first 16 MiB) is
        # this call's proof, for its rank (gate.poke: its wait looks again)
        early = EarlyStream(request_iterator, lambda: self.gate.poke(peer),
                            early_stream_cap(self.limits.max_message_bytes))
        try:
            # the caller's unread results first (shares.ResultLedger); counted as running once its body is here
            counting = self._wait_results(context, peer)
            with self.gate.admit(True, context.add_callback, lambda held: self._make_room(context, held),
                                 self._caller(context, early)), contextlib.ExitStack() as running:
                alive = grpc_liveness(context)
                # a stalled (--stream-idle-timeout) or crawling (--min-upload-rate-kib) upload is cut
                with self.uploads.watch(context, self.limits.min_upload_rate_bytes,
                                        self.limits.upload_rate_window) as touch:
                    data = self._reassemble(self._chunks(early, touch), alive)
                running.enter_context(counting)
                t1 = time.perf_counter()
                request = decode_request(memoryview(data))
                what = f"ComputeAdvantageStream {request.estimator}"
                _label_call(request.estimator)
                pieces = self.compute_payload(request, context).pieces()
                del request, data  # the request buffer goes before the result is sent
                self._hold_result(context, codec.pieces_size(pieces), peer)
                t2 = time.perf_counter()
        except grpc.RpcError as exc:  # reading the request failed: the client cancelled or its deadline passed
            log.debug("%s: the client went away during the upload (%s)", what, exc)
            return
        except Exception as exc:  # noqa: BLE001 - every error gets a deliberate status
            status, pushback = self._status(exc, what), refusal_metadata(exc)
        finally:
            early.drop()  # chunks read while the call waited, when it got no place (its thread stops reading)
        if status is not None:
            abort(context, status, pushback)
        try:  # how long receiving and computing took, for clients that split a call's time (informational)
            context.send_initial_metadata(((TIMING_KEY, f"recv={t1 - t0:.6f};compute={t2 - t1:.6f}"),))
        except Exception:  # noqa: BLE001 - e.g. metadata already sent by an interceptor
            pass
        # the result is sliced straight from its tensors into chunk messages (one copy per chunk)
        yield from codec.iter_chunks(pieces, CHUNK_BYTES)

    # ------------------------------------------------------------------ shared memory
    def region_table(self) -> RegionTable:
        """This server's :class:`~advantage_server.regions.RegionTable` (made at first use)."""
        table = getattr(self, "_region_table", None)
        if table is None:
            with _TABLE_GUARD:
                table = getattr(self, "_region_table", None)
                if table is None:
                    table = self._region_table = RegionTable(self.limits.max_shm_regions_per_client)
        return table

    def RegisterSharedMemory(self, request: pb.RegisterSharedMemoryRequest, context: Any):  # noqa: N802
        """Two steps: without ``proof``, a challenge to write at offset 0 of the segment; with it, a region
        id and key. RESOURCE_EXHAUSTED when this client's process or connection (:func:`region_owner`,
        :func:`client_identity`) holds ``--max-shm-regions-per-client`` regions, the segment
        MAX_REGIONS_PER_SEGMENT, or the server's table all in use by calls (else an idle region of the owner
        holding the most is evicted: see :class:`~advantage_server.regions.RegionTable`).
        INVALID_ARGUMENT for a name with ``/`` or NUL, or a malformed ``memfd:<pid>:<fd>``, before anything is
        opened; PERMISSION_DENIED, one message, for every second step that fails (no such segment or process,
        not a memfd, cannot be opened, no challenge at offset 0). A memfd sealed against shrinking is mapped
        (:meth:`Region.map_if_sealed`): later calls on it read and write in place."""
        table = self.region_table()
        connection = client_identity(context)
        client = region_owner(connection, request.name)  # memfd regions count against their process too
        table.sweep(client, connection)  # this caller's dead regions (every region's when the table is full)
        table.check_room(client, connection)
        if not request.name or "/" in request.name or "\x00" in request.name:
            raise InvalidInput("name", "give the segment's name (SharedMemory.name), without '/' or NUL bytes")
        parse_memfd_name(request.name)  # a malformed memfd:<pid>:<fd> is INVALID_ARGUMENT, before anything opens
        proof = bytes(request.proof)
        if not proof:  # step 1: a challenge the caller must write into the segment (proof of write access)
            # for any well-formed name, without looking the segment up: the answer tells nothing about which
            # names exist in /dev/shm
            return pb.RegisterSharedMemoryResponse(challenge=table.issue_challenge(connection, request.name))
        issued_for = table.take_challenge(proof)  # step 2: a challenge this server issued, now at offset 0
        region = None
        if issued_for == request.name:  # the segment is opened only for a challenge issued for it
            try:
                region = Region(request.name, 0, secrets.token_urlsafe(24))  # all of it; byte_size checked below
            except InvalidInput:
                region = None
        proven = False
        if region is not None and region.size >= len(proof):
            try:
                proven = hmac.compare_digest(region.read(0, len(proof), "proof").tobytes(), proof)
            except InvalidInput:  # shrank meanwhile
                proven = False
        if not proven:
            # one answer whether the segment does not exist, cannot be opened by the server or does not hold
            # the challenge: a caller that cannot write a segment learns nothing about it
            if region is not None:
                region.close()
            raise NotPermitted(f"segment {request.name!r} does not hold a challenge this server issued for it at "
                               "offset 0, or the server cannot open it (shared memory works only with a server on "
                               "the same host): call RegisterSharedMemory without proof, write the returned "
                               "challenge at offset 0 of the segment, then call again with proof = that challenge")
        size = int(request.byte_size)
        if size > region.size:  # the caller proved it writes the segment: its size is no secret to it
            region.close()
            raise InvalidInput("byte_size", f"{size} bytes registered but segment {request.name!r} has {region.size}")
        if size:
            region.size = size
        # no call can use more than its inputs (--max-stream-mb) and its outputs: a larger region only costs the
        # server address space (a sealed memfd is mapped whole; sparse ones of many TiB cost their client
        # nothing, and 128 TiB of mappings left the server unable to serve anyone), so it is refused
        cap = region_cap(self.limits)
        if region.size > cap:
            region.close()
            raise ResourceLimit(f"a shared-memory region holds at most {cap} bytes (4 x --max-stream-mb="
                                f"{self.limits.max_stream_mb}), this one {region.size}: register byte_size <= "
                                f"{cap}, or a smaller segment")
        region.map_if_sealed()  # a memfd sealed against shrinking: read and written in place from now on
        # the bounds again (other calls may have registered meanwhile); a full table evicts its LRU idle region
        region_id = table.add(region, client, connection)
        return pb.RegisterSharedMemoryResponse(region_id=region_id, key=region.key)

    def UnregisterSharedMemory(self, request: pb.UnregisterSharedMemoryRequest, context: Any):  # noqa: N802
        table = self.region_table()
        table.remove(request.region_id, request.key, "region_id")
        table.sweep(client_identity(context))
        return pb.UnregisterSharedMemoryResponse()

    def ComputeAdvantageShm(self, request: pb.ComputeAdvantageShmRequest, context: Any):  # noqa: N802
        """Inputs read from registered regions, results written into ``output_region_id``'s room. Every
        region the call names is held in use (never evicted) until it is answered. Of a mapped region only
        the float inputs the estimator reads as values are read in place; ids, masks and lengths are
        snapshotted first (:func:`~advantage_server.regions.read_in_place`), so what is validated is what
        is computed on, whatever the client writes meanwhile."""
        inner = request.request
        _check_counts(request)  # before any Python loop over the inputs or their shapes
        decoded = codec.DecodedRequest()
        decoded.estimator = inner.WhichOneof("estimator")
        _label_call(decoded.estimator)
        decoded._config = getattr(inner, decoded.estimator) if decoded.estimator else None
        decoded.output_dtype = inner.output_dtype
        decoded.mask_columns = inner.mask_columns  # per_sample is not offered here: results go to the region dense
        decoded.inputs = {k: codec.TensorView(v.dtype, list(v.shape), v.data) for k, v in inner.inputs.items()}
        if inner.HasField("cu_seqlens"):
            c = inner.cu_seqlens
            decoded.cu_seqlens = codec.TensorView(c.dtype, list(c.shape), c.data)
        spec = REGISTRY.get(decoded.estimator) if decoded.estimator else None
        table = self.region_table()
        alive = grpc_liveness(context)
        with contextlib.ExitStack() as held:
            placed: list[tuple[str, pb.SharedMemoryTensor, int, tuple[int, ...], Region]] = []
            for key, t in request.inputs.items():
                field = f"inputs[{key!r}]"
                nbytes, shape = _shm_layout(t, field)
                region = held.enter_context(table.hold(t.region_id, request.key, f"{field}.region_id"))
                if t.offset + nbytes > region.size:
                    raise InvalidInput(f"{field}.offset", f"[{t.offset}, {t.offset + nbytes}) is outside the "
                                                          f"region's {region.size} registered bytes")
                placed.append((key, t, nbytes, shape, region))
            # every size is checked before a byte is read into the server's memory
            check_batch_elements({f"inputs[{key!r}]": t for key, t, *_ in placed}, self.limits.max_batch_elements)
            total, cap = sum(p[2] for p in placed), self.max_stream_bytes or self.limits.max_stream_bytes
            if total > cap:
                raise ResourceLimit(f"the shared-memory inputs hold {total} bytes, more than the server's "
                                    f"--max-stream-mb={cap >> 20} ({cap} bytes: the most request bytes it takes in for "
                                    "one call); split the batch into smaller requests")
            for key, t, nbytes, shape, region in placed:
                # a sealed memfd: a view of its mapping (zero-copy) for float values, a snapshot of ids and
                # masks; else read through the descriptor into the server's memory (never a mapping of a
                # segment that may shrink)
                owner = next((s for s in spec.inputs if s.matches(key)), None) if spec is not None else None
                private = not read_in_place(owner.kind if owner is not None else None, t.dtype)
                data = region.read(int(t.offset), nbytes, f"inputs[{key!r}]", private=private)
                decoded.inputs[key] = codec.TensorView(t.dtype, list(shape), memoryview(data))
                alive("while reading the inputs from shared memory")
            del placed
            out_region = held.enter_context(table.hold(request.output_region_id, request.key, "output_region_id"))
            job = [decoded]  # handed over whole: the inputs go before the results are written
            del decoded
            return self._compute_into(request, job, out_region, context, alive)

    def _compute_into(self, request: pb.ComputeAdvantageShmRequest, job: list[codec.DecodedRequest],
                      out_region: Region, context: Any, alive: Any) -> pb.ComputeAdvantageShmResponse:
        """Compute ``job``'s one request (taken out of the list) with its results placed in ``out_region``'s output room. A mapped region: the
        results are written in place (an estimator that writes densely gets views of the output room); else
        computed into the server's memory (OutputRoom staged: buffers that stand for places in the room) and
        written into the region at the end."""
        from advantage_server.core import _OUTPUT
        from advantage_server.shm_output import OutputRoom, input_spans, region_lock
        inner = request.request
        room = OutputRoom(out_region.buffer(), request.output_offset,
                          min(out_region.size, request.output_offset + request.output_byte_size),
                          _OUTPUT.get(inner.output_dtype, torch.float32),
                          input_spans(request, request.output_region_id), size=out_region.size)
        lock = region_lock(out_region)  # one call writes into a region at a time (see shm_output)
        while not lock.acquire(timeout=0.05):
            alive("waiting for another call writing into this shared-memory region")
        try:
            payload = self.compute_payload(job.pop(), context, output_provider=room)
            adv, ret = payload.tensors()
            response = pb.ComputeAdvantageShmResponse()
            response.metrics.update({k: float(v) for k, v in payload.result.metrics.items()})
            for name, t in (("advantages", adv), ("returns", ret)):
                if t is None:
                    continue
                pos = room.place(name, t)
                getattr(response, name).CopyFrom(pb.SharedMemoryTensor(
                    dtype=wire.TORCH_DTYPE_CODES[t.dtype], shape=list(t.shape), region_id=request.output_region_id,
                    offset=pos))
            alive("before writing the results into shared memory")  # nobody waits for them: leave the region be
            out_region.write(room.pending, "output_region_id")
        finally:
            lock.release()
        return response

    def close_regions(self) -> None:
        """Unregister every region of this server (and stop its sweeps)."""
        self.region_table().close()
