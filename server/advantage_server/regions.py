"""The server's table of registered shared-memory regions: one room of its own beneath the servicer.

* :class:`Region`: one registered segment, a POSIX shared-memory segment (read and written through its
  descriptor, never mapped) or a Linux memfd (``memfd:<pid>:<fd>``; mapped and read in place when sealed
  against shrinking), every access bounds-checked against its registered size.
* **Snapshots**: a mapped region's bytes are the client's memory, which it (or another process mapping it)
  may change at any moment, also between two reads of one call. :meth:`Region.read` with ``private=True``
  returns a private copy: the servicer takes one of every input that validation and indexing read (integer
  ids, masks, lengths: see :func:`read_in_place`), so the values validated are the values computed on. Float
  inputs (rewards, values, logprobs) stay zero-copy views: a client that changes them during its own call
  gets a meaningless result for that call, never a fault (no kernel uses a float input's value as an index
  or a size).
* :class:`RegionTable`: the regions a server holds and the challenges it issued, with their bounds:
  at most :data:`MAX_REGIONS` regions, :data:`MAX_REGIONS_PER_SEGMENT` per segment, and
  ``--max-shm-regions-per-client`` per owner (the process of a memfd, the connection of a POSIX segment)
  **and** per connection (so a client that registers the memfds of its forked children is still one
  share); when the table is full, an idle region (no call is using it, none used it in the last
  :data:`RECENT_USE_S` seconds) is evicted to make room: one no call has ever used first, of the user (the
  segment's owner UID) holding the most regions, then of its owner holding the most, its least recently used; so a
  process within its fair share keeps its regions while another holds more, and a region a call used in the last
  5 s is never the one to go (a trainer calling less often than that is protected only by its fair share and by
  the regions no call has used going first; the user level helps only between clients of different users); and a
  sweep every :data:`SWEEP_PERIOD` seconds (and at every (un)registration) forgets the regions
  whose owner is gone (a memfd whose process exited or was killed, a POSIX name unlinked), so a killed
  client's memory is released within that bound.
* :class:`RegionGone`: a call naming a region the table does not hold (evicted, or never registered here: the
  server restarted, another replica) ends NOT_FOUND with a ``google.rpc.ErrorInfo`` detail (domain
  :data:`ERROR_DOMAIN`, reason :data:`REASON_EVICTED` or :data:`REASON_UNKNOWN`, metadata ``region_id``) in
  the status details (trailing metadata ``grpc-status-details-bin``): the client registers its segment again
  and sends the call once more (``advantage_client.shm``).
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import hmac
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from typing import Any, Iterator

import numpy as np

from advantage_client import wire
from advantage_server.admission import Overloaded
from advantage_server.errors import InvalidInput, ResourceLimit

#: RegisterSharedMemory's challenge (bytes the client must write at offset 0 of its segment), and how many
#: unanswered challenges a server keeps (the oldest go first)
CHALLENGE_BYTES, MAX_CHALLENGES = 32, 1024
#: regions one server keeps registered at most (when full, an idle one is evicted: see RegionTable.add). Each
#: holds one descriptor (and, for a sealed memfd, a mapping of at most region_cap() bytes of address space):
#: 1,024 is 128 client processes x the client's default pool of 8 regions. Fewer when the descriptor limit
#: is low (:func:`default_max_regions`).
MAX_REGIONS = 1024
#: region ids the table remembers as evicted (with a digest of their key), so a call naming one is answered
#: REASON_EVICTED rather than REASON_UNKNOWN: this many times the table's size (~100 bytes each)
GONE_MEMORY = 4
#: the ``google.rpc.ErrorInfo`` of a NOT_FOUND answer to a call naming a region the table does not hold
ERROR_DOMAIN = "advantage.v1"
REASON_EVICTED, REASON_UNKNOWN = "SHM_REGION_EVICTED", "SHM_REGION_UNKNOWN"
#: per segment (the file, whatever name reaches it): regions registered at once; and unanswered challenges
#: per client and segment name (a newer one replaces that client's oldest for the name). One client
#: registering its segment over and over cannot take every region.
MAX_REGIONS_PER_SEGMENT, MAX_CHALLENGES_PER_SEGMENT = 4, 4
#: unanswered challenges one client (:func:`client_identity`) holds at once; a newer one replaces its own
#: oldest, and when all clients together hold MAX_CHALLENGES the oldest of the client holding the most goes:
#: one client's flood of first steps pushes out only its own pending challenges. The regions one client may
#: hold registered are ``--max-shm-regions-per-client`` (``Limits.max_shm_regions_per_client``).
MAX_CHALLENGES_PER_CLIENT = 64
#: bytes per preadv/pwritev call on a segment (Linux moves at most ~2 GiB per call)
_IO_STEP = 1 << 30
#: a registration name that stands for a Linux memfd: descriptor <fd> of process <pid> (decimal, no sign, no
#: leading zeros), reached through /proc/<pid>/fd/<fd>. A POSIX segment of such a name cannot be registered.
MEMFD_NAME = re.compile(r"memfd:([1-9][0-9]{0,9}):(0|[1-9][0-9]{0,9})")
#: server environment variable: "0" turns the mapped (zero-copy) path for sealed memfds off (they are then
#: read and written through the descriptor, like POSIX segments)
MEMFD_MAP_ENV = "ADVANTAGE_SHM_MEMFD_MAP"
#: seconds after a call used a region during which a full table never evicts it (issue #35 item 5): a trainer's
#: regions, which its calls use every step, stay registered whatever another client registers
RECENT_USE_S = 5.0
#: registrations a second one user (the segment's owner UID) may make, in bursts of ``REGISTRATION_BURST``; past
#: it a registration is refused with an admission refusal's retry pushback (the client registers again after it).
#: The burst fills the default table at once (64 client processes starting together register their pools of 8
#: without a wait); a client registering and unregistering in a loop is held to the rate
REGISTRATIONS_PER_S = 256.0
REGISTRATION_BURST = MAX_REGIONS
#: seconds between two sweeps of the regions whose owner is gone (:meth:`RegionTable.sweep`): a killed
#: client's region is released within about this long (plus one sweep's time)
SWEEP_PERIOD = 5.0


class RegionGone(InvalidInput):
    """A call named a region this server does not hold: NOT_FOUND (``status()``; the servicer's
    ``status_for`` maps it), not INVALID_ARGUMENT, since the request was right when the client made it.
    ``reason``: :data:`REASON_EVICTED` (the table was full and evicted it, key checked against the
    evicted region's) or :data:`REASON_UNKNOWN` (never registered here, forgotten long ago, or swept: its
    segment was gone). Either way the client's answer is to register its segment again and resend the call;
    the status detail says so machine-readably (a ``google.rpc.ErrorInfo``, see the module docstring)."""

    def __init__(self, field: str, region_id: str, reason: str, description: str):
        super().__init__(field, description)
        self.region_id, self.reason = region_id, reason

    def status(self) -> Any:
        """The ``google.rpc.Status`` this error ends a call with: NOT_FOUND, the message, an ErrorInfo."""
        from google.protobuf import any_pb2
        from google.rpc import code_pb2, error_details_pb2, status_pb2
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN,
                                                metadata={"region_id": self.region_id[:64]}))
        return status_pb2.Status(code=code_pb2.NOT_FOUND, message=str(self)[:2000], details=[detail])


def default_max_regions() -> int:
    """The table's size when none is given: :data:`MAX_REGIONS`, or fewer when the process may not open that
    many more descriptors (one per region). The soft ``RLIMIT_NOFILE`` is first raised towards the hard limit
    (to at most 65,536), as servers do; then at most half of what is left above 256 descriptors (for the
    connections, the listening sockets, the libraries' files) holds regions, and at least 16."""
    want = MAX_REGIONS
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 2 * want + 256
        if soft != resource.RLIM_INFINITY and soft < need:
            target = need if hard == resource.RLIM_INFINITY else min(hard, max(need, min(hard, 65536)))
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
        if soft != resource.RLIM_INFINITY:
            want = min(want, max(16, (soft - 256) // 2))
    except (ImportError, OSError, ValueError):  # pragma: no cover - no resource module (not Linux)
        pass
    return want


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
        #: the user owning the segment (a memfd: its creating process's): what a client cannot multiply, however
        #: many connections or processes it opens (:meth:`RegionTable._victim` evicts from the user holding the most)
        self.uid = st.st_uid
        #: whom it counts against for --max-shm-regions-per-client (:func:`region_owner`), and the connection
        #: that registered it (:func:`client_identity`), charged too
        self.owner = self.connection = ""
        #: calls using it now (:meth:`RegionTable.hold`): such a region is never evicted to make room
        self.in_use = 0
        self.calls = 0  # calls that have used it (RegionTable.hold): a region no call has used is evicted first
        self.used_at = -1e18  # time.monotonic() of the last call that used it (RegionTable.hold)

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

    def read(self, offset: int, nbytes: int, field: str, private: bool = False) -> np.ndarray:
        """``nbytes`` bytes at ``offset`` as a ``uint8`` array: a view of the mapping (mapped regions: no copy),
        or with ``private`` a snapshot (a copy the client can no longer change), else a new array of the
        server's (INVALID_ARGUMENT naming ``field`` when the segment ends before them: it shrank)."""
        mapping = self._map
        if mapping is not None:
            if offset < 0 or offset + nbytes > mapping.size:
                raise InvalidInput(field, f"[{offset}, {offset + nbytes}) is outside the region's {mapping.size} "
                                          "registered bytes")
            view = mapping[offset:offset + nbytes]
            return view.copy() if private else view
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


def region_cap(limits: Any) -> int:
    """The most bytes one registered shared-memory region may span: 4 x ``--max-stream-mb`` (a call's inputs
    are bounded by it, its outputs by a few times that). With at most 1,024 regions, the server's mappings stay
    well below the address space (1,024 x 32 GiB = 32 TiB of 128 TiB at the defaults)."""
    return 4 * limits.max_stream_bytes


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



def read_in_place(kind: str | None, dtype: int) -> bool:
    """Whether an input of a mapped region is read in place (a view of the client's memory) instead of from a
    snapshot (:meth:`Region.read` ``private``). ``kind``: the estimator's ``InputSpec.kind`` for the input
    (None: an input it does not read, refused later anyway); ``dtype``: its wire dtype code. Only float data
    read as values stays in place; integer ids (prompt_ids, trajectory_ids, anchor_ids, step_index, lengths),
    masks of any dtype and everything else are copied, since validation and indexing read them more than
    once and a value changed between two reads must never reach an index."""
    np_dtype = wire.NUMPY_DTYPES.get(dtype)
    return kind == "float" and np_dtype is not None and np_dtype.kind == "f"


class RegionTable:
    """The regions one server holds (region id -> :class:`Region`, least recently used first) and the
    registration challenges it issued, with every bound on them (see the module docstring). Thread-safe.

    ``quota``: ``--max-shm-regions-per-client``, charged to a region's owner and to its connection alike.
    ``max_regions``: the table's size (default :func:`default_max_regions`, :data:`MAX_REGIONS` where the
    descriptor limit allows); ``sweep_period``: seconds between the background sweeps (:data:`SWEEP_PERIOD`),
    which run only while the table holds regions.

    Memory: each region holds one descriptor and, for a sealed memfd, one shared mapping of at most
    :func:`region_cap` bytes (the client's pages: address space, not server memory; a POSIX region is read
    per call into memory the call's own bound covers); the table adds ~200 bytes per region and the evicted
    ids it remembers (:data:`GONE_MEMORY` x ``max_regions``, ~100 bytes each). So regions cost the server at
    most ``max_regions`` descriptors, ``max_regions x region_cap`` bytes of address space and
    ``max_regions x ~600`` bytes of memory.
    """

    def __init__(self, quota: int, max_regions: int | None = None, sweep_period: float | None = None,
                 recent_use: float | None = None):
        self.quota = quota
        #: seconds after its last use during which a region is never evicted (:data:`RECENT_USE_S`)
        self.recent_use = RECENT_USE_S if recent_use is None else recent_use
        self.max_regions = default_max_regions() if max_regions is None else max_regions
        self.sweep_period = SWEEP_PERIOD if sweep_period is None else sweep_period
        self._regions: collections.OrderedDict[str, Region] = collections.OrderedDict()
        #: challenge -> (client, segment name), insertion ordered (oldest first)
        self._challenges: dict[bytes, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()
        #: regions evicted to make room, and forgotten by a sweep (their owner gone); registrations refused for their
        #: user's rate (:data:`REGISTRATIONS_PER_S`)
        self.evicted = self.swept = self.rate_refused = 0
        self._rates: dict[int, tuple[float, float]] = {}  # uid -> (tokens, when counted)
        #: evicted region id -> sha256 of its key, the newest last (at most GONE_MEMORY x max_regions)
        self._gone: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._regions)

    # ------------------------------------------------------------------ challenges
    def issue_challenge(self, client: str, name: str) -> bytes:
        """A new challenge for ``client``'s segment ``name``, making room within the per-client caps (the
        client's own oldest challenges go) and MAX_CHALLENGES (the oldest of the client holding the most)."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        with self._lock:
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

    def take_challenge(self, proof: bytes) -> str | None:
        """The segment name ``proof`` was issued for (the challenge is used up), or None."""
        with self._lock:
            return self._challenges.pop(proof, (None, None))[1]

    # ------------------------------------------------------------------ quotas
    def _quota_error(self, owner: str, connection: str) -> ResourceLimit | None:
        """RESOURCE_EXHAUSTED when ``owner`` or ``connection`` holds ``quota`` regions (under the lock)."""
        for who in dict.fromkeys((owner, connection)):
            held = sum(who in (r.owner, r.connection) for r in self._regions.values())
            if held >= self.quota:
                return ResourceLimit(
                    f"this client ({who}) holds {held} shared-memory regions, the most one client may: the "
                    f"server's --max-shm-regions-per-client={self.quota}, charged to each process and each "
                    "connection; unregister the regions it no longer uses (AdvantageClient.close() does), or ask "
                    "the operator to raise the flag")
        return None

    def _rate_error(self, uid: int) -> ResourceLimit | None:
        """Take one registration of user ``uid`` from its budget (:data:`REGISTRATIONS_PER_S`, a token bucket of
        :data:`REGISTRATION_BURST`); when it is spent, an :class:`~advantage_server.admission.Overloaded` with a retry pushback
        (under the lock)."""
        now = time.monotonic()
        tokens, at = self._rates.get(uid, (float(REGISTRATION_BURST), now))
        tokens = min(float(REGISTRATION_BURST), tokens + (now - at) * REGISTRATIONS_PER_S)
        if tokens < 1:
            self._rates[uid] = (tokens, now)
            self.rate_refused += 1
            return Overloaded(f"this user's shared-memory registrations exceed {REGISTRATIONS_PER_S:g} a second (the "
                              "most one user may make); retry after the server's pushback (AdvantageClient does), "
                              "and keep regions registered rather than registering them again",
                              pushback_ms=int(1000 * (1 - tokens) / REGISTRATIONS_PER_S) + 1)
        self._rates[uid] = (tokens - 1, now)
        if len(self._rates) > MAX_CHALLENGES:
            self._rates.pop(next(iter(self._rates)))
        return None

    def _full_error(self) -> ResourceLimit:
        return ResourceLimit(f"{self.max_regions} shared-memory regions are registered already and every one is "
                             f"in use by a call or was used in the last {self.recent_use:g} s; retry when a call is "
                             "done, or unregister some")

    def check_room(self, owner: str, connection: str) -> None:
        """A registration's first step: RESOURCE_EXHAUSTED when ``owner`` or ``connection`` holds its quota,
        or the table is full of regions in use (an idle one would be evicted)."""
        with self._lock:
            err = self._quota_error(owner, connection)
            if err is None and len(self._regions) >= self.max_regions and all(
                    r.in_use for r in self._regions.values()):
                err = self._full_error()
        if err is not None:
            raise err

    def add(self, region: Region, owner: str, connection: str) -> str:
        """Register ``region`` for ``owner`` on ``connection``; returns its new region id. RESOURCE_EXHAUSTED
        (``region`` closed) beyond a quota, beyond MAX_REGIONS_PER_SEGMENT regions of its segment, or when
        the table is full and every region is in use; a full table otherwise evicts an idle region
        (:meth:`_victim`; closed: a later call naming it gets NOT_FOUND with REASON_EVICTED, and the client
        registers its segment anew and resends the call)."""
        region.owner, region.connection = owner, connection
        evicted = None
        with self._lock:
            err = self._rate_error(region.uid)
            if err is None:
                err = self._quota_error(owner, connection)
            if err is None and sum(r.inode == region.inode for r in self._regions.values()) >= MAX_REGIONS_PER_SEGMENT:
                err = ResourceLimit(f"segment {region.name!r} is registered {MAX_REGIONS_PER_SEGMENT} times already "
                                    "(the most per segment); unregister a region of it, or use another segment")
            if err is None and len(self._regions) >= self.max_regions:
                idle = self._victim()
                if idle is None:
                    err = self._full_error()
                else:
                    evicted = self._regions.pop(idle)
                    self.evicted += 1
                    self._gone[idle] = _digest(evicted.key)
                    while len(self._gone) > GONE_MEMORY * max(self.max_regions, 1):
                        self._gone.popitem(last=False)
            if err is None:
                region_id = secrets.token_hex(8)
                self._regions[region_id] = region
                self._start_sweeper()
        if evicted is not None:
            evicted.close()
        if err is not None:
            region.close()
            raise err
        return region_id

    def _victim(self) -> str | None:
        """The region a full table evicts (under the lock), or None: an idle one (no call holds it) that no call
        used in the last ``recent_use`` seconds (:data:`RECENT_USE_S`); from those **no call has ever used** if there is one; of the
        user (the segment's owner UID) holding the most regions, then, within it, of the owner (process or
        connection) holding the most; its least recently used. Among owners holding as many, the one whose idle
        region was used least recently. None when every region is in use or recently used: the registration is
        refused (RESOURCE_EXHAUSTED), not a region a trainer's calls are using.

        Issue #35 item 5: one process registering a region on each of 1,024 connections filled the table, made the
        trainer "the owner holding the most", and its register/unregister loop evicted the trainer's regions (shm
        goodput 41-55%, NOT_FOUND at the caller). Connections and processes can be multiplied, a user cannot; and a
        region in use, or used in the last seconds, is never the one to go."""
        now = time.monotonic()
        users = collections.Counter(r.uid for r in self._regions.values())
        held = collections.Counter(r.owner for r in self._regions.values())
        for unused_only in (True, False):
            best, most = None, (-1, -1)
            for rid, r in self._regions.items():  # least recently used first
                if r.in_use or now - r.used_at < self.recent_use or (unused_only and r.calls):
                    continue
                if (users[r.uid], held[r.owner]) > most:
                    best, most = rid, (users[r.uid], held[r.owner])
            if best is not None:
                return best
        return None

    # ------------------------------------------------------------------ lookups
    def get(self, region_id: str, key: str, field: str, check: bool = True) -> Region:
        """The region ``region_id`` when ``key`` is its key, made the most recently used; ``check``: its
        segment must still have its registered size. :class:`RegionGone` (NOT_FOUND) when the table holds no
        such region (REASON_EVICTED when it evicted it and ``key`` was its key); INVALID_ARGUMENT naming
        ``field`` for a region held under another key."""
        with self._lock:
            region = self._regions.get(region_id)
            if region is not None:
                self._regions.move_to_end(region_id)
            gone = self._gone.get(region_id) if region is None else None
        if region is None:
            if gone is not None and hmac.compare_digest(gone, _digest(key)):
                raise RegionGone(field, region_id, REASON_EVICTED, (
                    f"shared-memory region {region_id!r} was evicted: the server's table of {self.max_regions} "
                    "regions was full and this one was idle; register the segment again with "
                    "RegisterSharedMemory and resend the call (AdvantageClient does both by itself)"))
            raise RegionGone(field, region_id, REASON_UNKNOWN, (
                f"no shared-memory region {region_id!r} is registered on this server (it restarted, another "
                "replica registered it, or its segment was gone); register the segment again with "
                "RegisterSharedMemory and resend the call (AdvantageClient does both by itself)"))
        if not hmac.compare_digest(region.key.encode(), key.encode()):
            raise InvalidInput(field, f"no shared-memory region {region_id!r} is registered for this key; "
                                      "register it with RegisterSharedMemory and send the key it returned")
        if check:
            region.check_size(field)
        return region

    @contextlib.contextmanager
    def hold(self, region_id: str, key: str, field: str) -> Iterator[Region]:
        """:meth:`get`, with the region marked in use for the block (never evicted meanwhile)."""
        region = self.get(region_id, key, field, check=False)
        with self._lock:
            region.in_use += 1
            region.calls += 1
            region.used_at = time.monotonic()
        try:
            region.check_size(field)
            yield region
        finally:
            with self._lock:
                region.in_use -= 1

    def remove(self, region_id: str, key: str, field: str) -> None:
        """Unregister ``region_id`` (INVALID_ARGUMENT naming ``field`` for an unknown id or a wrong key)."""
        region = self.get(region_id, key, field, check=False)
        with self._lock:
            self._regions.pop(region_id, None)
        region.close()

    # ------------------------------------------------------------------ sweeps
    def sweep(self, *whose: str) -> int:
        """Forget the regions whose owner is gone (:meth:`Region.stale`: a memfd whose process closed it,
        exited or was killed; a POSIX segment its client unlinked); returns how many. ``whose``: only the
        regions of these owners or connections (a registration sweeps its caller's own: a few checks, not one
        per region of the table), unless the table is full (then every region, before one is evicted). Run
        at each (un)registration and, over every region, every ``sweep_period`` seconds while regions are
        registered."""
        with self._lock:
            every = not whose or len(self._regions) >= self.max_regions
            gone = [rid for rid, r in self._regions.items()
                    if (every or r.owner in whose or r.connection in whose) and r.stale()]
            dropped = [self._regions.pop(rid) for rid in gone]
            self.swept += len(dropped)
        for region in dropped:
            region.close()
        return len(dropped)

    def _start_sweeper(self) -> None:
        """Start the background sweep (under the lock) unless it runs; it ends once the table is empty."""
        if self._sweeper is not None or self._stop.is_set():
            return
        self._sweeper = threading.Thread(target=_sweep_loop, args=(weakref.ref(self), self._stop, self.sweep_period),
                                         name="advantage-shm-sweep", daemon=True)
        self._sweeper.start()

    def _sweeper_done(self) -> bool:
        """Called by the sweep thread after each sweep: True (and the thread forgotten) when nothing is left."""
        with self._lock:
            if self._regions and not self._stop.is_set():
                return False
            self._sweeper = None
            return True

    def close(self) -> None:
        """Unregister every region and stop the sweeps."""
        self._stop.set()
        with self._lock:
            items = list(self._regions.values())
            self._regions.clear()
        for region in items:
            region.close()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _sweep_loop(table_ref: "weakref.ref[RegionTable]", stop: threading.Event, period: float) -> None:
    """The background sweep of one :class:`RegionTable` (held weakly: a table nobody uses any more goes)."""
    while not stop.wait(period):
        table = table_ref()
        if table is None:
            return
        try:
            table.sweep()
        except Exception:  # noqa: BLE001 - a sweep that failed is retried at the next period
            pass
        if table._sweeper_done():
            return
        del table
