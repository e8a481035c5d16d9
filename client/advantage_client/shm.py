"""Shared memory for a trainer on the same host as the server (like Triton's system shared-memory extension).

    with AdvantageClient("localhost:50051") as client, client.shared_memory(256 << 20) as region:
        values = region.empty((B, T), torch.float32)      # a tensor living in the region: no copy at all
        values.copy_(...)                                  # or pass ordinary tensors: copied in once
        result = region.compute("gae", cfg, rewards=rewards, mask=mask, values=values)

The client creates a segment and registers it (``RegisterSharedMemory``); the server answers with a
region id and a secret key, and only calls carrying that key may use the region. Each call then sends
names and offsets instead of bytes: the server reads the inputs from the region and writes the results
into it (after the inputs), everything bounds-checked on the server.
``AdvantageClient.compute(..., transport="shm")`` does the same with regions the client manages.

The segment is, on Linux (Python 3.8+), a ``memfd`` sealed against shrinking (:class:`MemfdSegment`,
registered as ``memfd:<pid>:<fd>``): the server maps it and reads the inputs and writes the results in
place, zero-copy (a sealed file cannot shrink under the server's mapping). Where the server cannot open
it (another PID namespace or user, an older server: PERMISSION_DENIED or INVALID_ARGUMENT), the region is
a POSIX shared-memory segment (``multiprocessing.shared_memory``) instead, and so are the client's later
regions; the server then copies through the segment's descriptor. ``ADVANTAGE_SHM_MEMFD=0`` in the client's
environment, or ``SharedMemoryRegion(..., memfd=False)``, always uses POSIX segments.

A server whose region table was full may evict an idle region; it also forgets every region when it restarts.
A call naming such a region is answered NOT_FOUND with a ``google.rpc.ErrorInfo`` (domain ``advantage.v1``,
reason ``SHM_REGION_EVICTED`` or ``SHM_REGION_UNKNOWN``; an older server: INVALID_ARGUMENT "no shared-memory
region"): :meth:`SharedMemoryRegion.compute` then registers the same segment again (a new region id and key;
the inputs already in it stay where they are) and resends the call once, so the caller never sees it.
"""
from __future__ import annotations

import math
import mmap
import os
import random
import sys
import time
from multiprocessing import shared_memory
from typing import Any

import grpc
import numpy as np

from advantage_client import codec, wire
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client.errors import AdvantageServiceError
from advantage_client.result import AdvantageResult

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

ALIGN = 64
#: call outcomes after which the server may still be running the call (it has not answered)
ABANDONED = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
                       grpc.StatusCode.UNKNOWN})
PREFIX = "/advantage.v1.AdvantageService/"
#: client environment variable: "0" makes every region a POSIX shared-memory segment (no memfd)
MEMFD_ENV = "ADVANTAGE_SHM_MEMFD"
#: the registration answers after which a memfd region is retried as a POSIX segment (and the client's later
#: regions are POSIX ones): the server cannot open the memfd (another PID namespace or user) or does not know
#: the ``memfd:`` names (an older server looks for a /dev/shm segment of that name)
MEMFD_REFUSED = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT})
#: the server's ``google.rpc.ErrorInfo`` for a call naming a region it does not hold (``regions.RegionGone``)
ERROR_DOMAIN = "advantage.v1"
REASON_EVICTED, REASON_UNKNOWN = "SHM_REGION_EVICTED", "SHM_REGION_UNKNOWN"


#: a registration's call refused by admission (RESOURCE_EXHAUSTED with a retry pushback: the server's few places
#: for registrations were all taken, as when many client processes start at once) is sent again after the
#: pushback (times a random factor in [1, 1.5]) for as long as the call's timeout lasts (this many seconds
#: without one); so is a ``ComputeAdvantageShm`` call refused by admission
REGISTER_PUSHBACK_S = 60.0


def _gone_reason(err: grpc.RpcError) -> str | None:
    """REASON_EVICTED or REASON_UNKNOWN when the failed call ``err`` was answered NOT_FOUND with the server's
    ErrorInfo for a region it does not hold; None for any other error."""
    if not hasattr(err, "code") or err.code() != grpc.StatusCode.NOT_FOUND:
        return None
    try:
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status
        status = rpc_status.from_call(err)
    except (ImportError, ValueError):
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == ERROR_DOMAIN and info.reason in (REASON_EVICTED, REASON_UNKNOWN):
            return info.reason
    return None


def region_gone(err: BaseException) -> str | None:
    """Why the server did not hold the region a shared-memory call named: REASON_EVICTED (its table was full),
    REASON_UNKNOWN (it never registered it or forgot it: restarted, another replica answered; also an older
    server's INVALID_ARGUMENT "no shared-memory region"); None when ``err`` is another error."""
    reason = getattr(err, "region_gone", None)
    if reason is not None:
        return reason
    if (isinstance(err, AdvantageServiceError) and err.code == grpc.StatusCode.INVALID_ARGUMENT
            and "no shared-memory region" in str(err)):
        return REASON_UNKNOWN
    return None


def memfd_supported() -> bool:
    """Whether regions may be sealed memfds here: Linux, ``os.memfd_create`` and ``fcntl.F_ADD_SEALS``
    (Python 3.8+), and ``ADVANTAGE_SHM_MEMFD`` is not ``0``."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return False
    import fcntl
    return hasattr(fcntl, "F_ADD_SEALS") and os.environ.get(MEMFD_ENV, "1") != "0"


class MemfdSegment:
    """A Linux ``memfd`` of ``size`` bytes, every page backed (``posix_fallocate``) and sealed with
    ``F_SEAL_SHRINK | F_SEAL_SEAL``: nobody (this process included) can make it shorter nor remove the seal,
    so the server may map it. Duck-types what :class:`SharedMemoryRegion` uses of
    ``multiprocessing.shared_memory.SharedMemory``: ``name`` (the registration name ``memfd:<pid>:<fd>``),
    ``size``, ``buf``, ``close()``, ``unlink()``.

    ``seal=False`` leaves it unsealed (the server then copies through its descriptor, as for a POSIX segment:
    for tests). Raises ``OSError`` when the kernel refuses (no memfd or seals: ENOSYS/EINVAL; no memory:
    ENOMEM/ENOSPC)."""

    def __init__(self, size: int, seal: bool = True):
        import fcntl
        fd = os.memfd_create("advantage-shm", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            try:  # back every page now: running out of memory is an OSError here, not a fault later
                os.posix_fallocate(fd, 0, size)
            except AttributeError:  # pragma: no cover - no posix_fallocate
                pass
            if seal:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            self._mmap: Any = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.size, self._buf = fd, size, None
        self.name = f"memfd:{os.getpid()}:{fd}"

    @property
    def buf(self) -> Any:
        return self._buf

    def close(self) -> None:
        """Close the descriptor (the memory goes with the last view of the mapping, see :func:`map_segment`)."""
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mmap is not None:
            self._mmap.close()  # BufferError while views of it exist, as SharedMemory.close
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """The name goes: a memfd's name is its descriptor in this process, so it is closed (the server forgets
        a region whose name no longer reaches its file at its next registration, as for a POSIX segment
        unlinked from /dev/shm)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def map_segment(shm: shared_memory.SharedMemory, size: int) -> np.ndarray:
    """A ``uint8`` view of the first ``size`` bytes of ``shm`` that takes its mapping over: from now on the mapping
    is unmapped when the last view of it goes (this array, slices of it, tensors made from them), never by
    ``shm.close()`` or ``SharedMemory.__del__``, which only close the file descriptor.

    A view made from ``shm.buf`` instead leaves the mapping to ``SharedMemory``, whose ``close()`` raises
    ``BufferError: cannot close exported pointers exist`` while any view is alive, and whose ``__del__`` then
    prints it as an unraisable exception (the server's regions dropped at shutdown, a client region collected
    while a result tensor from it is still in use)."""
    mapping = getattr(shm, "_mmap", None)
    if mapping is None:  # pragma: no cover - a SharedMemory without the attribute: the plain view
        return np.frombuffer(shm.buf, dtype=np.uint8, count=size)
    view = np.frombuffer(mapping, dtype=np.uint8, count=size)
    if shm._buf is not None:
        shm._buf.release()  # SharedMemory's own memoryview: nothing has been made from it
    shm._buf = None
    shm._mmap = None
    return view


def close_mapping(shm: shared_memory.SharedMemory) -> None:
    """``shm.close()``, or, while views of the segment are still alive (tensors from :meth:`SharedMemoryRegion.empty`,
    results read with ``copy=False``), let go of it quietly: the file descriptor is closed now and the mapping
    goes with the last view (``SharedMemory.close`` would raise BufferError, and again, printed, at exit)."""
    try:
        shm.close()
    except BufferError:
        shm._buf = None  # the views keep the mapping alive through the memoryview they were made from
        shm._mmap = None
        if getattr(shm, "_fd", -1) >= 0:
            os.close(shm._fd)
            shm._fd = -1


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SharedMemoryRegion:
    """A shared-memory segment registered with the server. Use as a context manager or call :meth:`close`
    (unregisters, then unlinks the segment).

    ``memfd``: None (default) makes the segment a sealed memfd where :func:`memfd_supported` and this client
    has not seen the server refuse one, else a POSIX segment; False: a POSIX segment; True: a memfd or an
    error (``OSError`` from the kernel, :class:`AdvantageServiceError` from the server). :attr:`memfd` tells
    which it is; :attr:`shm` is the segment (``SharedMemory`` or :class:`MemfdSegment`). Raises what
    registration raises (:class:`AdvantageServiceError`), ``OSError`` when no segment can be made."""

    def __init__(self, client: Any, byte_size: int, memfd: bool | None = None):
        self._client = client
        self._buf = None
        size = max(int(byte_size), ALIGN)
        #: set when a call was given up (deadline, cancel, lost connection) while the server may still run it
        self.abandoned: str | None = None
        #: times the segment was registered again after the server answered that it did not hold the region
        self.reregistered = 0
        try_memfd = memfd if memfd is not None else (memfd_supported()
                                                     and not getattr(client, "_shm_memfd_refused", False))
        if try_memfd:
            try:
                self._create(MemfdSegment(size))
                reply = self._register()
            except AdvantageServiceError as err:
                self._release()
                if memfd or err.code not in MEMFD_REFUSED:
                    raise
                try:  # this server cannot use memfds: POSIX segments from now on, for this client
                    client._shm_memfd_refused = True
                except AttributeError:  # pragma: no cover - a client object with __slots__
                    pass
                try_memfd = False
            except OSError:
                self._release()
                if memfd:
                    raise
                try_memfd = False
            except BaseException:
                self._release()
                raise
        if not try_memfd:
            try:
                self._create(shared_memory.SharedMemory(create=True, size=size))
                reply = self._register()
            except BaseException:
                self._release()
                raise
        #: whether the segment is a sealed memfd (the server reads and writes it in place) or a POSIX segment
        self.memfd = bool(try_memfd)
        self.region_id, self.key = reply.region_id, reply.key

    def _create(self, shm: Any) -> None:
        self.shm = shm
        self.size = shm.size
        if isinstance(shm, shared_memory.SharedMemory):
            # back every page now: on a full /dev/shm a later write would be SIGBUS, here it is an OSError
            try:
                os.posix_fallocate(shm._fd, 0, self.size)
            except AttributeError:  # pragma: no cover - no posix_fallocate on this platform
                pass
        self._buf = map_segment(shm, self.size)  # the mapping lives as long as views of it
        self._next = 0  # bump allocator for empty()

    def _register_call(self, request: Any) -> Any:
        """One ``RegisterSharedMemory`` step, sent again after the server's retry pushback when admission
        refused it, while the call's timeout (``_call_timeout`` of the client, else REGISTER_PUSHBACK_S) lasts;
        any other error, and the refusal past that, is raised."""
        timeout = getattr(self._client, "_call_timeout", None)
        deadline = time.monotonic() + (timeout if timeout is not None else REGISTER_PUSHBACK_S)
        while True:
            try:
                return self._client._call("RegisterSharedMemory", request, pb.RegisterSharedMemoryResponse)
            except AdvantageServiceError as err:
                pushback = getattr(err, "pushback_s", None)
                pause = None if pushback is None else pushback * random.uniform(1.0, 1.5)
                if (err.code != grpc.StatusCode.RESOURCE_EXHAUSTED or pause is None
                        or time.monotonic() + pause >= deadline):
                    raise
            time.sleep(pause)

    def _register(self) -> Any:
        request = pb.RegisterSharedMemoryRequest(name=self.shm.name, byte_size=self.size)
        reply = self._register_call(request)
        if reply.challenge:  # show the server this process writes the segment (see the proto)
            n = len(reply.challenge)
            if n > self.size:
                raise MemoryError(f"the region's {self.size} bytes cannot hold the server's {n}-byte challenge")
            kept = self._buf[:n].copy()  # what the challenge covers (a registration again: inputs may lie there)
            self._buf[:n] = np.frombuffer(reply.challenge, np.uint8)
            request.proof = reply.challenge
            try:
                reply = self._register_call(request)
            finally:
                self._buf[:n] = kept
        return reply

    # ------------------------------------------------------------------ allocation
    def empty(self, shape: Any, dtype: Any = "float32") -> Any:
        """A tensor (torch if installed, else numpy) living in the region; pass it to :meth:`compute`
        and it is read in place."""
        code = wire.dtype_code(dtype)
        np_dtype = wire._NP[code]
        nbytes = math.prod(shape) * np_dtype.itemsize
        if self._next + nbytes > self.size:
            raise MemoryError(f"the region has {self.size - self._next} free bytes, {nbytes} needed")
        arr = self._buf[self._next:self._next + nbytes].view(np_dtype).reshape(shape)
        self._next = _align(self._next + nbytes)
        if torch is not None:
            t = torch.from_numpy(arr)
            return t.view(torch.bfloat16) if code == pb.DTYPE_BFLOAT16 else t
        return arr

    def reset(self) -> None:
        """Forget every :meth:`empty` allocation (their memory is reused)."""
        self._next = 0

    def _offset_of(self, arr: np.ndarray) -> int | None:
        """Offset of ``arr`` in the region when it is a C-contiguous view into it, else None."""
        if not arr.flags.c_contiguous or arr.nbytes == 0:
            return None
        base = self._buf.__array_interface__["data"][0]
        addr = arr.__array_interface__["data"][0]
        if base <= addr and addr + arr.nbytes <= base + self.size:
            return addr - base
        return None

    # ------------------------------------------------------------------ compute
    def compute(self, estimator: str, config: Any = None, *, output_dtype: Any = None, as_numpy: bool = False,
                copy: bool = True, cu_seqlens: Any = None, mask_columns: int | None = None, **tensors: Any) -> Any:
        """Like ``AdvantageClient.compute``. Inputs already in the region (from :meth:`empty`) are read in
        place; others are copied in once. ``copy=False`` returns result tensors that are views of the
        region (valid until the next call on it).

        A call that ends without the server's answer (DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE, or an
        exception such as KeyboardInterrupt while waiting) may still be running on the server, which would
        then write its results into this region's output room later, over whatever the region holds by then.
        The region is therefore marked :attr:`abandoned` and refuses further calls (RuntimeError): close it
        and register a new one (``AdvantageClient`` does that by itself for the region it manages).

        A server that does not hold the region (NOT_FOUND, :func:`region_gone`: its table evicted it, or it
        restarted) gets the segment registered again (:attr:`region_id` and :attr:`key` change,
        :attr:`reregistered` counts it) and the call once more, transparently. When that registration fails,
        the NOT_FOUND is raised with the registration's error in its message (the error keeps its
        ``region_gone`` reason), and the next call tries again.
        """
        if self.abandoned:
            raise RuntimeError(f"a call on this shared-memory region was abandoned ({self.abandoned}) and the server "
                               "may still write its results here: close the region and register a new one")

        request = pb.ComputeAdvantageShmRequest(key=self.key, output_region_id=self.region_id)
        inner = request.request
        cfg = wire.config_message(estimator, config)  # WireError for an unknown estimator
        getattr(inner, wire.ESTIMATOR_FIELDS[estimator][0]).CopyFrom(cfg)
        if output_dtype is not None:
            inner.output_dtype = wire.output_dtype_code(output_dtype)
        if cu_seqlens is not None:
            inner.cu_seqlens.CopyFrom(wire.encode_tensor(cu_seqlens, "cu_seqlens"))
        if mask_columns is not None:  # the width of the mask `lengths` stands for: a request field, not an input
            wire.check_mask_columns({k: v for k, v in {**tensors, "mask_columns": mask_columns}.items() if v is not None})
            inner.mask_columns = int(mask_columns)
        pos = self._next
        for name, value in tensors.items():
            if value is None:
                continue
            if name in wire.LABEL_INPUTS:
                value = wire.reduce_prompt_ids(value, name)
            code, shape, payload = codec.tensor_parts(value, f"inputs[{name!r}]")
            raw = np.frombuffer(payload, dtype=np.uint8) if payload.nbytes else np.zeros(0, np.uint8)
            offset = self._offset_of(raw)
            if offset is None:
                if pos + raw.nbytes > self.size:
                    raise MemoryError(f"inputs need more than the region's {self.size} bytes")
                self._buf[pos:pos + raw.nbytes] = raw
                offset, pos = pos, _align(pos + raw.nbytes)
            request.inputs[name].CopyFrom(pb.SharedMemoryTensor(dtype=code, shape=shape, region_id=self.region_id,
                                                                offset=offset))
        request.output_offset = pos
        request.output_byte_size = self.size - pos
        try:
            reply = self._send(request)
        except AdvantageServiceError as err:
            if region_gone(err) is None:
                raise
            self._register_again(err)  # the inputs stay in the segment: only the id and key change
            request.key = self.key
            request.output_region_id = self.region_id
            for tensor in request.inputs.values():
                tensor.region_id = self.region_id
            reply = self._send(request)
        out = []
        for name in ("advantages", "returns"):
            if not reply.HasField(name):
                out.append(None)
                continue
            t = reply.__getattribute__(name)
            np_dtype = wire._NP[t.dtype]
            n = math.prod(t.shape) * np_dtype.itemsize
            arr = self._buf[t.offset:t.offset + n].view(np_dtype).reshape(tuple(t.shape))
            if copy:
                arr = arr.copy()
            if not as_numpy and torch is not None:
                arr = torch.from_numpy(arr)
                arr = arr.view(torch.bfloat16) if t.dtype == pb.DTYPE_BFLOAT16 else arr
            out.append(arr)
        return AdvantageResult(out[0], out[1], dict(reply.metrics))

    def _send(self, request: Any) -> Any:
        """One ``ComputeAdvantageShm`` call; marks the region :attr:`abandoned` when it ends without the
        server's answer (it may still write the results). An admission refusal (RESOURCE_EXHAUSTED with a
        retry pushback: the server did not start the call) is sent again after the pushback (times a random
        factor in [1, 1.5]) while the call's timeout lasts (REGISTER_PUSHBACK_S without one): a shared-memory
        call has one replica, the one on this host, and the server's pushback paces the resends."""
        timeout = getattr(self._client, "_call_timeout", None)
        deadline = time.monotonic() + (timeout if timeout is not None else REGISTER_PUSHBACK_S)
        while True:
            try:
                return self._client._call("ComputeAdvantageShm", request, pb.ComputeAdvantageShmResponse)
            except AdvantageServiceError as err:
                if err.code in ABANDONED:
                    self.abandoned = err.code.name
                pushback = getattr(err, "pushback_s", None)
                pause = None if pushback is None else pushback * random.uniform(1.0, 1.5)
                if (err.code != grpc.StatusCode.RESOURCE_EXHAUSTED or pause is None
                        or time.monotonic() + pause >= deadline):
                    raise
            except BaseException as exc:  # interrupted while waiting: the server may still be computing
                self.abandoned = type(exc).__name__
                raise
            time.sleep(pause)

    def _register_again(self, gone: AdvantageServiceError) -> None:
        """Register this segment again after the server answered ``gone`` (it does not hold the region): a new
        :attr:`region_id` and :attr:`key`. Raises ``gone`` (its message extended by why) when the registration
        fails; the region keeps its old id, so its next call finds it gone again and retries."""
        try:
            reply = self._register()
        except Exception as exc:  # noqa: BLE001 - any failure: the caller sees the NOT_FOUND, with the reason
            failed = AdvantageServiceError(gone.code, f"{gone}; registering the segment again failed: {exc}",
                                           gone.field_violations, getattr(exc, "pushback_s", None))
            failed.region_gone = region_gone(gone)
            raise failed from exc
        self.region_id, self.key = reply.region_id, reply.key
        self.reregistered += 1

    # ------------------------------------------------------------------ lifetime
    def _release(self) -> None:
        self._buf = None
        shm = getattr(self, "shm", None)
        if shm is None:  # the segment could not be made
            return
        close_mapping(shm)
        try:
            shm.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unregister the region and unlink its segment. After an abandoned call only the segment is unlinked
        (no call to a server that may be gone; it forgets the region at its next registration)."""
        if self._buf is None:
            return
        if self.abandoned:
            self._release()
            return
        try:
            self._client._call("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(
                region_id=self.region_id, key=self.key), pb.UnregisterSharedMemoryResponse)
        except Exception:  # noqa: BLE001 - the server may be gone; the segment is ours to remove anyway
            pass
        self._release()

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def room_for(nbytes: int, path: str = "/dev/shm") -> bool:
    """Whether ``path`` (where POSIX shared memory lives) has ``nbytes`` free: a segment larger than the free
    space is created fine but kills the process with SIGBUS when written past it."""
    import os
    try:
        st = os.statvfs(path)
    except OSError:
        return True  # no such directory (not Linux): let SharedMemory decide
    return nbytes <= st.f_bavail * st.f_frsize


def call(channel: grpc.Channel, method: str, request: Any, response_cls: type, **kwargs: Any) -> Any:
    """One call of the service's ``method``. Raises ``grpc.RpcError``, except for a NOT_FOUND answer naming a
    region the server does not hold (:func:`_gone_reason`): an :class:`AdvantageServiceError` whose
    ``region_gone`` attribute is the reason (see :func:`region_gone`)."""
    try:
        return channel.unary_unary(PREFIX + method, request_serializer=type(request).SerializeToString,
                                   response_deserializer=response_cls.FromString)(request, **kwargs)
    except grpc.RpcError as err:
        reason = _gone_reason(err)
        if reason is None:
            raise
        gone = AdvantageServiceError.from_rpc_error(err)
        gone.region_gone = reason
        raise gone from None
