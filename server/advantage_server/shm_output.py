"""The output room of a ``ComputeAdvantageShm`` call: where the results go in the client's region.

The client reserves ``[output_offset, output_offset + output_byte_size)`` of its registered region for
the results. :class:`OutputRoom` is the output provider the shared-memory handler passes to
``AdvantageCore.compute_result``: an estimator that writes its ``[B, T]`` result densely asks
:meth:`Batch.output <advantage_server.estimators.registry.Batch.output>` for memory and gets a buffer
that stands for a place in the room, so the result needs no copy afterwards. :meth:`OutputRoom.place`
then records where each result lies (an estimator that did not use the provider, a compute dtype other
than the requested output dtype, the packed layout: the next free place). Every place is bounds-checked
against the room and the region, and never overlaps an input read from the same region.

The server maps a client's segment only when it is a Linux memfd sealed against shrinking
(``F_SEAL_SHRINK``: it can never end before the mapped bytes, so no SIGBUS; see ``regions.Region``).
Then the room is given ``buf``, a ``uint8`` numpy array over that mapping (also in-process use, tests),
and the results are written straight into the client's memory: zero-copy. Any other segment (a POSIX
one, an unsealed memfd) may shrink during a call, which would kill a process touching a mapping of it
with SIGBUS, so there the room is *staged*: ``buf=None``, the handed-out buffers are the server's own
memory, and :attr:`OutputRoom.pending` lists what :meth:`Region.write
<advantage_server.regions.Region.write>` then writes into the segment, once the call has computed.

:func:`region_lock` serialises the calls that write into one region, so a client's next call never has
its results overwritten by the tail of an abandoned one (and two concurrent calls sharing a room do not
interleave their writes).
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import numpy as np
import torch

from advantage_server.errors import InvalidInput

ALIGN = 64
#: torch dtypes a view of the room may have (the wire dtypes of the results; bfloat16 has no numpy twin)
_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


_LOCKS: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def region_lock(region: Any) -> threading.Lock:
    """The lock held by the call writing results into ``region`` (one per registered region)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(region)
        if lock is None:
            lock = _LOCKS[region] = threading.Lock()
        return lock


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class OutputRoom:
    """Output provider over region bytes ``[start, limit)``.

    buf:    the region's bytes as a numpy uint8 array (written in place), or None: staged (``size`` = the
            region's size; the results are listed in :attr:`pending` for the caller to write).
    dtype:  the requested output dtype; only results computed in it use the handed-out memory.
    inputs: ``(begin, end)`` byte ranges of the inputs read from this region: never handed out.
    """

    def __init__(self, buf: np.ndarray | None, start: int, limit: int, dtype: torch.dtype,
                 inputs: list[tuple[int, int]] = (), size: int | None = None):
        self.buf, self.start, self.limit, self.dtype = buf, int(start), int(limit), dtype
        self.size = int(buf.size if buf is not None else size)
        self.inputs = list(inputs)
        #: staged: ``(offset, uint8 array)`` of each placed result, to be written into the region
        self.pending: list[tuple[int, np.ndarray]] = []
        self.next = _align(self.start)  # first free byte for the next view
        self.handed: dict[str, tuple[torch.Tensor, int, int]] = {}  # name -> (view, offset, nbytes)
        self.cursor: int | None = None  # where the next copied result goes

    def __call__(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A view of the room for result ``name``, or None (the estimator then allocates its own)."""
        if dtype != self.dtype or dtype not in _NP or torch.device(device).type != "cpu" or name in self.handed:
            return None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        begin, end = self.next, self.next + nbytes
        if nbytes == 0 or end > self.limit or end > self.size:
            return None
        if any(begin < hi and lo < end for lo, hi in self.inputs):
            return None
        raw = self.buf[begin:end] if self.buf is not None else np.empty(nbytes, np.uint8)
        view = torch.from_numpy(raw.view(_NP[dtype]).reshape(tuple(shape)))
        self.handed[name] = (view, begin, nbytes)
        self.next = _align(end)
        return view

    def place(self, name: str, t: torch.Tensor) -> int:
        """Where result ``name`` (already in the output dtype) lies in the region: its own view when
        the estimator wrote it there, else copied into the room. A room too small for the result is an
        ``InvalidInput`` on ``output_byte_size``."""
        entry = self.handed.get(name)
        if entry is not None:
            view, offset, nbytes = entry
            if (t.data_ptr() == view.data_ptr() and t.dtype == view.dtype and tuple(t.shape) == tuple(view.shape)
                    and t.is_contiguous()):
                if self.buf is None:
                    self.pending.append((offset, view.numpy().reshape(-1).view(np.uint8)))
                return offset  # written in place
        t = t.contiguous()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1).view(np.uint8)
        if entry is not None and raw.nbytes == entry[2]:
            pos = entry[1]  # the room set aside for this result, unused by the estimator
        else:
            if self.cursor is None:  # after the views handed out; at the room's start when there are none
                self.cursor = self.next if self.handed else self.start
            pos = self.cursor
            limit = min(self.limit, self.size)
            if pos + raw.nbytes > limit:
                raise InvalidInput("output_byte_size", f"the result needs {raw.nbytes} bytes for {name} at offset "
                                                       f"{pos}, but the output room ends at {limit}")
            self.cursor = pos + _align(raw.nbytes)
        if self.buf is None:
            self.pending.append((pos, raw))
        else:
            self.buf[pos:pos + raw.nbytes] = raw
        return pos

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"OutputRoom([{self.start}, {self.limit}), handed={list(self.handed)})"


def input_spans(request: Any, region_id: str) -> list[tuple[int, int]]:
    """Byte ranges of the request's inputs that lie in region ``region_id``."""
    from advantage_client import wire

    spans = []
    for t in request.inputs.values():
        if t.region_id == region_id:
            itemsize = wire.NUMPY_DTYPES[t.dtype].itemsize if t.dtype in wire.NUMPY_DTYPES else 8
            spans.append((int(t.offset), int(t.offset) + math.prod(int(d) for d in t.shape) * itemsize))
    return spans
