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
  co-located client registers a POSIX shared-memory segment it created and gets a region id and a
  secret key; calls carrying the key read inputs from and write results to the region, every tensor
  bounds-checked against the registered size. The server reaches a POSIX segment through its file
  descriptor (``preadv`` / ``pwritev``), never through a mapping: a segment its client shrinks during a call
  fails that call (INVALID_ARGUMENT) instead of killing the server with SIGBUS (:class:`Region`). A Linux
  ``memfd`` the client sealed against shrinking (``memfd:<pid>:<fd>`` names, :func:`parse_memfd_name`) is
  mapped instead and read and written in place, zero-copy: the kernel refuses to shrink it. Quotas: 256
  regions in all, 4 per segment, ``--max-shm-regions-per-client`` per client connection
  (:func:`client_identity`), and pending challenges capped per client so one client's flood of first
  steps pushes out only its own.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import hmac
import logging
import math
import mmap
import os
import re
import secrets
import stat
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
from advantage_server.estimators import AdvantageResult
from advantage_server.limits import check_batch_elements, checkpoints, grpc_liveness

#: methods with a handler of their own (not the generic unary pipeline)
CUSTOM_HANDLERS = frozenset({"ComputeAdvantageStream"})
#: bytes per chunk the server sends (the client chooses its own)
CHUNK_BYTES = 4 << 20
#: RegisterSharedMemory's challenge (bytes the client must write at offset 0 of its segment), and how many
#: unanswered challenges a server keeps (the oldest go first)
CHALLENGE_BYTES, MAX_CHALLENGES = 32, 1024
#: regions one server keeps registered at most
MAX_REGIONS = 256
#: per segment (the file, whatever name reaches it): regions registered at once; and unanswered challenges
#: per client and segment name (a newer one replaces that client's oldest for the name). One client
#: registering its segment over and over cannot take every region.
MAX_REGIONS_PER_SEGMENT, MAX_CHALLENGES_PER_SEGMENT = 4, 4
#: unanswered challenges one client (:func:`client_identity`) holds at once; a newer one replaces its own
#: oldest, and when all clients together hold MAX_CHALLENGES the oldest of the client holding the most goes:
#: one client's flood of first steps pushes out only its own pending challenges. The regions one client may
#: hold registered are ``--max-shm-regions-per-client`` (``Limits.max_shm_regions_per_client``).
MAX_CHALLENGES_PER_CLIENT = 64
ALIGN = 64
#: bytes per preadv/pwritev call on a segment (Linux moves at most ~2 GiB per call)
_IO_STEP = 1 << 30
#: a registration name that stands for a Linux memfd: descriptor <fd> of process <pid> (decimal, no sign, no
#: leading zeros), reached through /proc/<pid>/fd/<fd>. A POSIX segment of such a name cannot be registered.
MEMFD_NAME = re.compile(r"memfd:([1-9][0-9]{0,9}):(0|[1-9][0-9]{0,9})")
#: server environment variable: "0" turns the mapped (zero-copy) path for sealed memfds off (they are then
#: read and written through the descriptor, like POSIX segments)
MEMFD_MAP_ENV = "ADVANTAGE_SHM_MEMFD_MAP"
log = logging.getLogger("advantage_server")


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
        """The encoded result's pieces (headers and views of the result tensors), for streaming it."""
        adv, ret = self.tensors()
        return codec.result_pieces(adv, ret, {k: float(v) for k, v in self.result.metrics.items()},
                                   self.result.layout, self.result.dense_shape)

    def encode(self) -> bytes:
        return b"".join(self.pieces())


def response_serializer(response_cls: type):
    """Encodes :class:`ResultPayload` with the codec, generated messages with protobuf."""
    def serialize(response: Any) -> bytes:
        if isinstance(response, ResultPayload):
            return response.encode()
        if isinstance(response, (bytes, bytearray)):
            return bytes(response)
        return response.SerializeToString()
    return serialize


# -------------------------------------------------------------------------------- shared memory
def parse_memfd_name(name: str) -> tuple[int, int] | None:
    """``(pid, fd)`` of a ``memfd:<pid>:<fd>`` registration name, None for any other name (a POSIX segment's).

    A name that starts with ``memfd:`` but is not exactly two decimal integers (pid > 0, fd >= 0, no sign, no
    leading zeros, at most 10 digits each) is ``InvalidInput`` on ``name`` (INVALID_ARGUMENT), before anything
    is opened."""
    if not name.startswith("memfd:"):
        return None
    m = MEMFD_NAME.fullmatch(name)
    if m is None:
        raise InvalidInput("name", f"{name!r} is not a memfd name: write memfd:<pid>:<fd> with the creating "
                                   "process's id (> 0) and the descriptor's number (>= 0), both decimal")
    return int(m.group(1)), int(m.group(2))


_MEMFD_MOUNT: list[str | None] = []


def _mount_id(fdinfo_path: str) -> str | None:
    """The ``mnt_id`` line of a ``/proc/.../fdinfo/<fd>`` file (None when the kernel does not show it)."""
    with open(fdinfo_path, "rb") as f:
        for line in f.read(4096).splitlines():
            if line.startswith(b"mnt_id:"):
                return line.split(b":", 1)[1].strip().decode("ascii", "replace")
    return None


def _memfd_mount() -> str | None:
    """The mount id every memfd of this kernel has (the kernel's internal shmem mount), read once from a
    memfd of the server's own; None when fdinfo shows none."""
    if not _MEMFD_MOUNT:
        probe = os.memfd_create("advantage-probe", os.MFD_CLOEXEC)
        try:
            _MEMFD_MOUNT.append(_mount_id(f"/proc/self/fdinfo/{probe}"))
        finally:
            os.close(probe)
    return _MEMFD_MOUNT[0]


def _open_memfd(pid: int, fd: int) -> int:
    """A new read-write descriptor of the memfd that is descriptor ``fd`` of process ``pid``, opened through
    ``/proc/<pid>/fd/<fd>`` (same user and PID namespace only: the kernel checks the caller may inspect
    ``pid``). ``O_NOFOLLOW`` cannot be used (those entries are links the kernel resolves itself: ELOOP), so
    before the target is touched at all, the descriptor's ``fdinfo`` must name the kernel's internal shmem
    mount (where every memfd lives) and its link must read ``/memfd:...`` (neither looks into the file, so
    no file of another filesystem, a FUSE one say, is ever stat'ed or opened); then the target must stat as
    a regular file (no FIFO or device is ever opened, and ``O_NONBLOCK | O_NOCTTY`` in case one is swapped
    in meanwhile), and the opened file must again be a regular file whose link reads ``/memfd:...``, on that
    mount, and support file seals (shmem). ``OSError`` for all of it, alike (a hugetlbfs memfd lives on
    another mount: refused too). A client in the server's own process (an embedded server) names the
    server's pid: its memfd is reached the same way. What keeps a caller from registering a memfd it
    cannot write, the server's own included, is the challenge it must write at offset 0, as for POSIX
    segments."""
    path, mount = f"/proc/{pid}/fd/{fd}", _memfd_mount()
    if _mount_id(f"/proc/{pid}/fdinfo/{fd}") != mount or not os.readlink(path).startswith("/memfd:"):
        raise PermissionError("not a memfd")
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise PermissionError("not a regular file")
    own = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if (not stat.S_ISREG(os.fstat(own).st_mode) or not os.readlink(f"/proc/self/fd/{own}").startswith("/memfd:")
                or _mount_id(f"/proc/self/fdinfo/{own}") != mount):
            raise PermissionError("not a memfd")
        fcntl.fcntl(own, fcntl.F_GET_SEALS)  # EINVAL for any file that is not shmem
        os.set_blocking(own, True)
        return own
    except BaseException:
        os.close(own)
        raise


class Region:
    """A registered segment: a POSIX shared-memory segment or a Linux memfd (``memfd:<pid>:<fd>``).

    **Through the descriptor** (POSIX segments, memfds not sealed against shrinking): a client may shrink
    its segment (``ftruncate``) at any moment, also while a call reads it; a page of a mapping past the
    file's new end kills the reading process with SIGBUS, and no Python code can catch that. So the server
    never maps such a segment: inputs are read with ``preadv`` into the server's own memory (a segment that
    shrank gives a short read: INVALID_ARGUMENT for that call) and results written with ``pwritev`` once
    computed, after the segment's size was checked again. One trainer's bug fails its own call, never the
    server.

    **Mapped** (:attr:`mapped`, set by :meth:`map_if_sealed`): a memfd whose seals include
    ``F_SEAL_SHRINK`` (``fcntl(2)``, Linux 3.17+) cannot become shorter, by anyone, for as long as it
    exists, so a mapping of its registered bytes can never fault past its end: the server maps it once and
    reads inputs from it and writes results into it in place (no copy either way, no staging memory). A
    client that changes its inputs during its own call gets a meaningless result for that call; nothing
    else. ``F_SEAL_GROW`` is not needed (growing leaves the mapped bytes valid); a memfd sealed against
    writes, or a failed ``mmap``, keeps the descriptor path (hugetlbfs memfds are not registered at all)."""

    def __init__(self, name: str, size: int, key: str):
        self._lock = threading.Lock()
        self._fd = -1
        #: the whole registered region as a ``uint8`` array over a shared mapping (mapped regions), else None.
        #: Views of it (inputs, result rooms of calls under way) keep the mapping alive after close().
        self._map: np.ndarray | None = None
        memfd = parse_memfd_name(name)
        #: ``(pid, fd)`` for a memfd region, else None
        self.memfd = memfd
        try:
            if memfd is not None:
                self._fd = _open_memfd(*memfd)
            else:
                import _posixshmem  # what multiprocessing.shared_memory opens segments with (O_NOFOLLOW, O_CLOEXEC)
                self._fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            st = os.fstat(self._fd)
        except (FileNotFoundError, ValueError, OSError) as err:
            self.close()
            raise InvalidInput("name", f"cannot open shared-memory segment {name!r} on the server's host "
                                       f"({err}); shared memory works only with a server on the same host") from None
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise InvalidInput("name", f"{name!r} is not a shared-memory segment")
        if size > st.st_size:
            self.close()
            raise InvalidInput("byte_size", f"{size} bytes registered but segment {name!r} has {st.st_size}")
        self.size = size or st.st_size
        self.key = key
        self.name = name
        self.inode = (st.st_dev, st.st_ino)
        self.owner = ""  # the client that registered it (client_identity), for --max-shm-regions-per-client

    @property
    def mapped(self) -> bool:
        """Whether the region is read and written in place (a sealed memfd, see the class)."""
        return self._map is not None

    def map_if_sealed(self) -> bool:
        """Map the region's ``size`` registered bytes when it is a memfd sealed against shrinking (and the
        server's ``ADVANTAGE_SHM_MEMFD_MAP`` is not ``0``); returns :attr:`mapped`. The seals are read before
        the size: once ``F_SEAL_SHRINK`` is seen, the size read after it can only grow."""
        if self.memfd is None or self._fd < 0 or os.environ.get(MEMFD_MAP_ENV, "1") == "0" or not self.size:
            return False
        try:
            seals = fcntl.fcntl(self._fd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK or seals & (fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0)):
                return False
            st = os.fstat(self._fd)
            if st.st_size < self.size or st.st_blksize != mmap.PAGESIZE:  # hugetlbfs: keep the descriptor path
                return False
            mapping = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return False
        self._map = np.frombuffer(mapping, np.uint8)  # the mapping goes with the last view of it
        return True

    def buffer(self) -> np.ndarray | None:
        """The mapped region's bytes (a ``uint8`` array) for the output room to write in place, else None."""
        return self._map

    @contextlib.contextmanager
    def fd(self, field: str) -> Iterator[int]:
        """A descriptor of the segment for the block (a duplicate: unregistering the region meanwhile cannot
        hand its number to another file)."""
        with self._lock:
            if self._fd < 0:
                raise InvalidInput(field, f"shared-memory region of segment {self.name!r} was unregistered")
            fd = os.dup(self._fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def current_size(self, fd: int) -> int:
        try:
            return os.fstat(fd).st_size
        except (OSError, ValueError, TypeError):
            return -1

    def shrunk(self, field: str, size: int) -> InvalidInput:
        return InvalidInput(field, f"shared-memory segment {self.name!r} now has {max(size, 0)} bytes, fewer than "
                                   f"the {self.size} registered; register the region again")

    def check_size(self, field: str) -> None:
        """INVALID_ARGUMENT when the segment has shrunk below the registered size since registration (a
        mapped region cannot: it is sealed against shrinking)."""
        if self._map is not None:
            return
        with self.fd(field) as fd:
            size = self.current_size(fd)
        if size < self.size:
            raise self.shrunk(field, size)

    def read(self, offset: int, nbytes: int, field: str) -> np.ndarray:
        """``nbytes`` bytes at ``offset`` as a ``uint8`` array: a view of the mapping (mapped regions: no copy),
        else a new array of the server's (INVALID_ARGUMENT naming ``field`` when the segment ends before
        them: it shrank)."""
        mapping = self._map
        if mapping is not None:
            if offset < 0 or offset + nbytes > mapping.size:
                raise InvalidInput(field, f"[{offset}, {offset + nbytes}) is outside the region's {mapping.size} "
                                          "registered bytes")
            return mapping[offset:offset + nbytes]
        out = np.empty(nbytes, np.uint8)
        view = memoryview(out)
        with self.fd(field) as fd:
            done = 0
            while done < nbytes:
                try:
                    n = os.preadv(fd, [view[done:done + _IO_STEP]], offset + done)
                except OSError as err:
                    raise InvalidInput(field, f"cannot read shared-memory segment {self.name!r} ({err})") from None
                if n <= 0:
                    raise self.shrunk(field, self.current_size(fd))
                done += n
        return out

    def write(self, pieces: list[tuple[int, Any]], field: str) -> None:
        """Each ``(offset, bytes-like)`` of ``pieces`` written into the segment, which must still have its
        registered size (a shrunk segment is not grown back: INVALID_ARGUMENT naming ``field``). A mapped
        region: copied into the mapping."""
        mapping = self._map
        if mapping is not None:
            for offset, data in pieces:
                view = np.frombuffer(memoryview(data).cast("B"), np.uint8)
                if offset < 0 or offset + view.size > mapping.size:
                    raise InvalidInput(field, f"[{offset}, {offset + view.size}) is outside the region's "
                                              f"{mapping.size} registered bytes")
                mapping[offset:offset + view.size] = view
            return
        with self.fd(field) as fd:
            size = self.current_size(fd)
            if size < self.size:
                raise self.shrunk(field, size)
            for offset, data in pieces:
                view = memoryview(data).cast("B")
                done = 0
                while done < view.nbytes:
                    try:
                        done += os.pwritev(fd, [view[done:done + _IO_STEP]], offset + done)
                    except OSError as err:
                        raise InvalidInput(field, f"cannot write the results into shared-memory segment "
                                                  f"{self.name!r} ({err})") from None

    def stale(self) -> bool:
        """True when the segment's name no longer reaches it: a POSIX name gone from /dev/shm or naming another
        segment, a memfd whose process closed that descriptor (or exited) or reuses its number for another file
        (the client went away without unregistering, e.g. it exited or was killed: Python's resource tracker
        unlinks its segments)."""
        follow = self.memfd is not None
        if self.memfd is not None:
            pid, fd = self.memfd
            try:  # the descriptor must still be a memfd before its target is looked at (under the regions'
                # lock: a file of a filesystem that can stall, FUSE say, is never stat'ed)
                if _mount_id(f"/proc/{pid}/fdinfo/{fd}") != _memfd_mount():
                    return True
            except OSError:  # no such process or descriptor, or the pid is now another user's process
                return True
            path = f"/proc/{pid}/fd/{fd}"
        elif not os.path.isdir("/dev/shm"):
            return False  # no way to tell on this platform
        else:
            path = os.path.join("/dev/shm", self.name.lstrip("/"))
        try:  # a POSIX name is not followed (shm_open opened it with O_NOFOLLOW): a symlink there is another file
            st = os.stat(path, follow_symlinks=follow)
        except (FileNotFoundError, ProcessLookupError, ValueError):  # ValueError: a name no file can have
            return True
        except OSError:
            return self.memfd is not None
        return (st.st_dev, st.st_ino) != self.inode

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            self._map = None  # unmapped when the last call using a view of it is done
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:  # a region dropped without close() (e.g. a server collected) keeps no descriptor
        if getattr(self, "_fd", -1) >= 0:
            self.close()


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


def region_cap(limits: Any) -> int:
    """The most bytes one registered shared-memory region may span: 4 x ``--max-stream-mb`` (a call's inputs
    are bounded by it, its outputs by a few times that). With at most 256 regions, the server's mappings stay
    far below the address space (256 x 32 GiB = 8 TiB at the defaults)."""
    return 4 * limits.max_stream_bytes


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


def region_owner(connection: str, name: str) -> str:
    """Whom a region of segment ``name`` counts against for ``--max-shm-regions-per-client``: for a memfd
    (``memfd:<pid>:<fd>``) the process holding it, ``pid:<pid>`` (a client opening many connections is still
    one process: its memfds all carry its pid; the registration's proof shows the caller can write that
    process's memfd, which only that process, or one of the same user, can); for a POSIX segment the
    connection (:func:`client_identity`). A malformed memfd name counts against the connection (it is
    refused before anything is opened). Pending challenges always count against the connection, since the
    pid in a first step's name is not yet proven."""
    try:
        memfd = parse_memfd_name(name)
    except InvalidInput:
        memfd = None
    return f"pid:{memfd[0]}" if memfd is not None else connection


def client_identity(context: Any) -> str:
    """The client a shared-memory quota is charged to: gRPC's peer string of the call's connection.

    For TCP it is ``ipv4:ADDRESS:PORT`` or ``ipv6:[ADDRESS]:PORT``: the client's end of one connection, so
    one channel (one trainer process: a process's channels to the same target with the same options share
    a connection) is one client, and two trainers on the same host are two. The address alone would not
    do: shared memory only works for co-located clients, so every one of them comes from the same
    (loopback or host) address. For a Unix-socket client gRPC reports a bare ``unix:`` whatever the
    connection (the client's socket has no name), so all such clients share one quota (this server only
    listens on TCP today). A client that opens many connections gets a quota for each; the server-wide
    MAX_REGIONS stays the hard bound. A peer string gRPC cannot give becomes ``unknown`` (one shared quota)."""
    try:
        peer = context.peer()
    except Exception:  # noqa: BLE001 - a context without a peer (in-process tests)
        peer = None
    return peer if isinstance(peer, str) and peer else "unknown"


class TransportMethods:
    """The transport RPCs; expects ``self.core``, ``self.limits``, ``self.gate``, ``self._status`` of the
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
        what, status, pieces = "ComputeAdvantageStream", None, []
        t0 = t1 = t2 = time.perf_counter()
        try:
            with self.gate.admit(True, context.add_callback):
                alive = grpc_liveness(context)
                # a stalled (--stream-idle-timeout) or crawling (--min-upload-rate-kib) upload is cut
                with self.uploads.watch(context, self.limits.min_upload_rate_bytes,
                                        self.limits.upload_rate_window) as touch:
                    data = self._reassemble(self._chunks(request_iterator, touch), alive)
                t1 = time.perf_counter()
                request = decode_request(memoryview(data))
                what = f"ComputeAdvantageStream {request.estimator}"
                _label_call(request.estimator)
                pieces = self.compute_payload(request, context).pieces()
                del request, data  # the request buffer goes before the result is sent
                t2 = time.perf_counter()
        except grpc.RpcError as exc:  # reading the request failed: the client cancelled or its deadline passed
            log.debug("%s: the client went away during the upload (%s)", what, exc)
            return
        except Exception as exc:  # noqa: BLE001 - every error gets a deliberate status
            status = self._status(exc, what)
        if status is not None:
            from grpc_status import rpc_status
            context.abort_with_status(rpc_status.to_status(status))
        try:  # how long receiving and computing took, for clients that split a call's time (informational)
            context.send_initial_metadata(((TIMING_KEY, f"recv={t1 - t0:.6f};compute={t2 - t1:.6f}"),))
        except Exception:  # noqa: BLE001 - e.g. metadata already sent by an interceptor
            pass
        # the result is sliced straight from its tensors into chunk messages (one copy per chunk)
        yield from codec.iter_chunks(pieces, CHUNK_BYTES)

    # ------------------------------------------------------------------ shared memory
    def _regions(self) -> tuple[dict[str, Region], threading.Lock]:
        if not hasattr(self, "_shm_regions"):
            self._shm_regions: dict[str, Region] = {}
            # challenge -> (client, segment name), insertion ordered (oldest first)
            self._challenges: dict[bytes, tuple[str, str]] = {}
            self._shm_lock = threading.Lock()
        return self._shm_regions, self._shm_lock

    def _region(self, region_id: str, key: str, field: str, check: bool = True) -> Region:
        regions, lock = self._regions()
        with lock:
            region = regions.get(region_id)
        if region is None or not hmac.compare_digest(region.key.encode(), key.encode()):
            raise InvalidInput(field, f"no shared-memory region {region_id!r} is registered for this key; "
                                      "register it with RegisterSharedMemory and send the key it returned")
        if check:
            region.check_size(field)
        return region

    def _sweep_regions(self) -> int:
        """Forget the regions whose segment its client has unlinked without unregistering (a client that
        exited without ``close()`` or was killed); returns how many. Run at each (un)registration, so leaked
        regions neither pin memory for long nor use up ``MAX_REGIONS``."""
        regions, lock = self._regions()
        with lock:
            gone = [rid for rid, r in regions.items() if r.stale()]
            dropped = [regions.pop(rid) for rid in gone]
        for region in dropped:
            region.close()
        return len(dropped)

    def _client_quota_error(self, client: str, held: int) -> ResourceLimit:
        quota = self.limits.max_shm_regions_per_client
        return ResourceLimit(f"this client ({client}) holds {held} shared-memory regions, the most one "
                             f"client may: the server's --max-shm-regions-per-client={quota}; unregister the regions "
                             "it no longer uses (AdvantageClient.close() does), or ask the operator to raise the flag")

    def _issue_challenge(self, client: str, name: str) -> bytes:
        """A new challenge for ``client``'s segment ``name``, making room within the per-client caps (the
        client's own oldest challenges go) and MAX_CHALLENGES (the oldest of the client holding the most)."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        with self._shm_lock:
            mine = [c for c, (who, _) in self._challenges.items() if who == client]
            same = [c for c in mine if self._challenges[c][1] == name]
            drop = set(same[:max(0, len(same) - MAX_CHALLENGES_PER_SEGMENT + 1)])
            rest = [c for c in mine if c not in drop]
            drop.update(rest[:max(0, len(rest) - MAX_CHALLENGES_PER_CLIENT + 1)])
            for old in drop:
                del self._challenges[old]
            self._challenges[challenge] = (client, name)
            while len(self._challenges) > MAX_CHALLENGES:
                held = collections.Counter(who for who, _ in self._challenges.values())
                top = max(held, key=held.__getitem__)
                del self._challenges[next(c for c, (who, _) in self._challenges.items() if who == top)]
        return challenge

    def RegisterSharedMemory(self, request: pb.RegisterSharedMemoryRequest, context: Any):  # noqa: N802
        """Two steps: without ``proof``, a challenge to write at offset 0 of the segment; with it, a region
        id and key. RESOURCE_EXHAUSTED when the server holds MAX_REGIONS regions, the segment
        MAX_REGIONS_PER_SEGMENT, or this client (:func:`client_identity`) ``--max-shm-regions-per-client``.
        INVALID_ARGUMENT for a name with ``/`` or NUL, or a malformed ``memfd:<pid>:<fd>``, before anything is
        opened; PERMISSION_DENIED, one message, for every second step that fails (no such segment or process,
        not a memfd, cannot be opened, no challenge at offset 0). A memfd sealed against shrinking is mapped
        (:meth:`Region.map_if_sealed`): later calls on it read and write in place."""
        self._sweep_regions()
        regions, lock = self._regions()
        connection = client_identity(context)
        client = region_owner(connection, request.name)  # memfd regions count against their process
        with lock:
            if len(regions) >= MAX_REGIONS:
                raise ResourceLimit(f"{MAX_REGIONS} shared-memory regions are registered already; unregister some")
            held = sum(r.owner == client for r in regions.values())
        if held >= self.limits.max_shm_regions_per_client:
            raise self._client_quota_error(client, held)
        if not request.name or "/" in request.name or "\x00" in request.name:
            raise InvalidInput("name", "give the segment's name (SharedMemory.name), without '/' or NUL bytes")
        parse_memfd_name(request.name)  # a malformed memfd:<pid>:<fd> is INVALID_ARGUMENT, before anything opens
        proof = bytes(request.proof)
        if not proof:  # step 1: a challenge the caller must write into the segment (proof of write access)
            # for any well-formed name, without looking the segment up: the answer tells nothing about which
            # names exist in /dev/shm
            return pb.RegisterSharedMemoryResponse(challenge=self._issue_challenge(connection, request.name))
        with lock:  # step 2: the challenge this server issued for this segment, now at its offset 0
            issued_for = self._challenges.pop(proof, (None, None))[1]
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
        region_id = secrets.token_hex(8)
        region.owner = client
        with lock:
            held = sum(r.owner == client for r in regions.values())
            full = (len(regions) >= MAX_REGIONS or held >= self.limits.max_shm_regions_per_client
                    or sum(r.inode == region.inode for r in regions.values()) >= MAX_REGIONS_PER_SEGMENT)
            if not full:
                regions[region_id] = region
        if full:  # checked again: other calls may have registered regions since the first check
            region.close()
            if held >= self.limits.max_shm_regions_per_client:
                raise self._client_quota_error(client, held)
            if len(regions) >= MAX_REGIONS:
                raise ResourceLimit(f"{MAX_REGIONS} shared-memory regions are registered already; unregister some")
            raise ResourceLimit(f"segment {request.name!r} is registered {MAX_REGIONS_PER_SEGMENT} times already "
                                "(the most per segment); unregister a region of it, or use another segment")
        return pb.RegisterSharedMemoryResponse(region_id=region_id, key=region.key)

    def UnregisterSharedMemory(self, request: pb.UnregisterSharedMemoryRequest, context: Any):  # noqa: N802
        region = self._region(request.region_id, request.key, "region_id", check=False)
        regions, lock = self._regions()
        with lock:
            regions.pop(request.region_id, None)
        region.close()
        self._sweep_regions()
        return pb.UnregisterSharedMemoryResponse()

    def ComputeAdvantageShm(self, request: pb.ComputeAdvantageShmRequest, context: Any):  # noqa: N802
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
        alive = grpc_liveness(context)
        placed: list[tuple[str, pb.SharedMemoryTensor, int, tuple[int, ...], Region]] = []
        for key, t in request.inputs.items():
            field = f"inputs[{key!r}]"
            nbytes, shape = _shm_layout(t, field)
            region = self._region(t.region_id, request.key, f"{field}.region_id")
            if t.offset + nbytes > region.size:
                raise InvalidInput(f"{field}.offset", f"[{t.offset}, {t.offset + nbytes}) is outside the region's "
                                                      f"{region.size} registered bytes")
            placed.append((key, t, nbytes, shape, region))
        # every size is checked before a byte is read into the server's memory
        check_batch_elements({f"inputs[{key!r}]": t for key, t, *_ in placed}, self.limits.max_batch_elements)
        total, cap = sum(p[2] for p in placed), self.max_stream_bytes or self.limits.max_stream_bytes
        if total > cap:
            raise ResourceLimit(f"the shared-memory inputs hold {total} bytes, more than the server's "
                                f"--max-stream-mb={cap >> 20} ({cap} bytes: the most request bytes it takes in for one "
                                "call); split the batch into smaller requests")
        for key, t, nbytes, shape, region in placed:
            # a sealed memfd: a view of its mapping (zero-copy); else read through the descriptor into the
            # server's memory (never a mapping of a segment that may shrink)
            data = region.read(int(t.offset), nbytes, f"inputs[{key!r}]")
            decoded.inputs[key] = codec.TensorView(t.dtype, list(shape), memoryview(data))
            alive("while reading the inputs from shared memory")
        del placed
        out_region = self._region(request.output_region_id, request.key, "output_region_id")
        # a mapped region: results are written in place (an estimator that writes densely gets views of the
        # output room); else computed into the server's memory (OutputRoom staged: buffers that stand for
        # places in the room) and written into the region at the end
        from advantage_server.core import _OUTPUT
        from advantage_server.shm_output import OutputRoom, input_spans, region_lock
        room = OutputRoom(out_region.buffer(), request.output_offset,
                          min(out_region.size, request.output_offset + request.output_byte_size),
                          _OUTPUT.get(inner.output_dtype, torch.float32),
                          input_spans(request, request.output_region_id), size=out_region.size)
        lock = region_lock(out_region)  # one call writes into a region at a time (see shm_output)
        while not lock.acquire(timeout=0.05):
            alive("waiting for another call writing into this shared-memory region")
        try:
            payload = self.compute_payload(decoded, context, output_provider=room)
            del decoded
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
        regions, lock = self._regions()
        with lock:
            items = list(regions.values())
            regions.clear()
        for region in items:
            region.close()

