"""The output room of a ``ComputeAdvantageShm`` call: results written straight into the client's region.

The client reserves ``[output_offset, output_offset + output_byte_size)`` of its registered region for
the results. :class:`OutputRoom` is the output provider the shared-memory handler passes to
``AdvantageCore.compute_result``: an estimator that writes its ``[B, T]`` result densely asks
:meth:`Batch.output <advantage_server.estimators.registry.Batch.output>` for memory and gets a view of
the room, so the result needs no copy afterwards. :meth:`OutputRoom.place` then records where each
result lies, and copies the ones that were not written in place (an estimator that does not use the
provider, a compute dtype other than the requested output dtype, the packed layout) into the room as
before. Every view is bounds-checked against the room and the region, and never overlaps an input
read from the same region (the inputs must stay intact while the estimator reads them).

Writing in place means a call writes into the room while it computes, not only at its end; a call
whose client gave up (deadline, cancel) cannot stop a running kernel. :func:`region_lock` serialises
the calls that write into one region, so a client's next call never has its results overwritten by
the tail of an abandoned one (and two concurrent calls sharing a room no longer interleave their
writes).
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
    """Output provider over ``buf[start:limit]`` (``buf``: the region's bytes as a numpy uint8 array).

    dtype:  the requested output dtype; only results computed in it are written in place.
    inputs: ``(begin, end)`` byte ranges of the inputs read from this region: never handed out.
    """

    def __init__(self, buf: np.ndarray, start: int, limit: int, dtype: torch.dtype,
                 inputs: list[tuple[int, int]] = ()):
        self.buf, self.start, self.limit, self.dtype = buf, int(start), int(limit), dtype
        self.inputs = list(inputs)
        self.next = _align(self.start)  # first free byte for the next view
        self.handed: dict[str, tuple[torch.Tensor, int, int]] = {}  # name -> (view, offset, nbytes)
        self.cursor: int | None = None  # where the next copied result goes

    def __call__(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A view of the room for result ``name``, or None (the estimator then allocates its own)."""
        if dtype != self.dtype or dtype not in _NP or torch.device(device).type != "cpu" or name in self.handed:
            return None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        begin, end = self.next, self.next + nbytes
        if nbytes == 0 or end > self.limit or end > self.buf.size:
            return None
        if any(begin < hi and lo < end for lo, hi in self.inputs):
            return None
        view = torch.from_numpy(self.buf[begin:end].view(_NP[dtype]).reshape(tuple(shape)))
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
                return offset  # written in place
        t = t.contiguous()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1).view(np.uint8)
        if entry is not None and raw.nbytes == entry[2]:
            pos = entry[1]  # the room set aside for this result, unused by the estimator
        else:
            if self.cursor is None:  # after the views handed out; at the room's start when there are none
                self.cursor = self.next if self.handed else self.start
            pos = self.cursor
            limit = min(self.limit, self.buf.size)
            if pos + raw.nbytes > limit:
                raise InvalidInput("output_byte_size", f"the result needs {raw.nbytes} bytes for {name} at offset "
                                                       f"{pos}, but the output room ends at {limit}")
            self.cursor = pos + _align(raw.nbytes)
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
            itemsize = wire._NP[t.dtype].itemsize if t.dtype in wire._NP else 8
            spans.append((int(t.offset), int(t.offset) + math.prod(int(d) for d in t.shape) * itemsize))
    return spans
