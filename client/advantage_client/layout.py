"""Per-sample results: ``[B]`` values that stand for a ``[B, T]`` advantage (or return) tensor.

Where an estimator gives one value per row (GRPO, RLOO, OPO, ...; ``ListEstimators`` lists where, in
``EstimatorInfo.per_sample``), a request with ``per_sample = true`` gets ``[B]`` values back and an
``AdvantageResult.layout`` (``advantage.v1.ResultLayout``) saying how the documented ``[B, T]`` tensor
follows from them and the request's mask:

* ``RESULT_LAYOUT_BROADCAST``: ``A[b, t] = a[b]`` for every ``t``;
* ``RESULT_LAYOUT_BROADCAST_TIMES_MASK``: ``A[b, t] = a[b]`` where ``mask[b, t] = 1``, else 0;
* ``RESULT_LAYOUT_UP_TO_LAST_VALID``: ``A[b, t] = a[b]`` for ``t`` up to the row's last ``mask = 1``
  position, 0 after it (and in a row without one).

The server takes the values from its dense result with :func:`row_values` and answers per-sample only when
:func:`rebuild` gives that dense result back exactly (``torch.equal``: every value equal, where a zero the
dense answer holds as -0.0 comes back as +0.0); the clients rebuild with the same :func:`rebuild`, so what
they return is what a dense answer would have held.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from advantage_client._proto.advantage.v1 import advantage_pb2 as pb

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

DENSE = pb.RESULT_LAYOUT_UNSPECIFIED
BROADCAST = pb.RESULT_LAYOUT_BROADCAST
BROADCAST_TIMES_MASK = pb.RESULT_LAYOUT_BROADCAST_TIMES_MASK
UP_TO_LAST_VALID = pb.RESULT_LAYOUT_UP_TO_LAST_VALID
#: the layouts a per-sample result may have
PER_SAMPLE_LAYOUTS = (BROADCAST, BROADCAST_TIMES_MASK, UP_TO_LAST_VALID)


def layout_name(layout: int) -> str:
    """``RESULT_LAYOUT_BROADCAST`` -> ``"broadcast"`` (``"dense"`` for 0)."""
    return "dense" if layout == DENSE else pb.ResultLayout.Name(layout)[len("RESULT_LAYOUT_"):].lower()


def _is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def bool_mask(mask: Any, like: Any = None) -> Any:
    """A ``[B, T]`` 0/1 mask (any dtype, torch or numpy or nested lists) as a bool tensor on the CPU: torch
    when ``like`` is a torch tensor (or ``like`` is None and ``mask`` is one), numpy otherwise."""
    want_torch = _is_torch(like) if like is not None else _is_torch(mask)
    if _is_torch(mask):
        m = mask.detach().to("cpu")
        m = m if m.dtype == torch.bool else m != 0
        return m if want_torch else m.numpy()
    m = np.asarray(mask)
    m = m if m.dtype == np.bool_ else m != 0
    return torch.from_numpy(m) if want_torch else m


def prefix_mask(lengths: Any, columns: int, like: Any = None) -> Any:
    """The ``[B, columns]`` bool mask ``t < lengths[b]`` (torch when ``like`` or ``lengths`` is torch)."""
    want_torch = _is_torch(like) if like is not None else _is_torch(lengths)
    n = lengths.detach().to("cpu").numpy() if _is_torch(lengths) else np.asarray(lengths)
    m = np.arange(columns)[None, :] < n.astype(np.int64)[:, None]
    return torch.from_numpy(m) if want_torch else m


def _last_valid(mask: Any) -> Any:
    """``[B]`` index of each row's last True (-1 for a row with none): max of ``mask * (t + 1)`` minus 1."""
    T = mask.shape[1]
    if _is_torch(mask):
        pos = torch.arange(1, T + 1, dtype=torch.int32 if T < 2 ** 31 else torch.int64, device=mask.device)
        return (mask * pos).amax(1) - 1
    return (mask * np.arange(1, T + 1)).max(1) - 1


def row_values(dense: Any, layout: int, mask: Any = None) -> Any:
    """``[B]`` values of a ``[B, T]`` tensor under ``layout`` (torch): column 0 for BROADCAST and
    UP_TO_LAST_VALID, the row's first ``mask = 1`` column for BROADCAST_TIMES_MASK (column 0, which is
    then 0, for a row without one; ``mask``: ``[B, T]`` 0/1 of any dtype, needed for this layout only).
    Meaningful only where :func:`rebuild` gives ``dense`` back (``tests/test_per_sample.py``)."""
    if layout == BROADCAST_TIMES_MASK:
        first = (mask.to(torch.uint8) if mask.dtype == torch.bool else mask).argmax(1)  # first 1 of the row
        return dense.gather(1, first[:, None]).squeeze(1)
    if layout in (BROADCAST, UP_TO_LAST_VALID):
        return dense[:, 0].contiguous()
    raise ValueError(f"not a per-sample layout: {layout}")


def layout_code(layout: int | str) -> int:
    """A ``ResultLayout`` value from itself or from its name as results carry it (``"broadcast"``, see
    :func:`layout_name`); ``ValueError`` for an unknown name."""
    if isinstance(layout, str):
        try:
            return pb.ResultLayout.Value("RESULT_LAYOUT_" + layout.upper()) if layout != "dense" else DENSE
        except ValueError:
            names = ", ".join(layout_name(v) for v in PER_SAMPLE_LAYOUTS)
            raise ValueError(f"unknown layout {layout!r}; per-sample layouts are {names}") from None
    return layout


def rebuild(values: Any, layout: int | str, mask: Any = None, columns: int | None = None, view: bool = False) -> Any:
    """The ``[B, T]`` tensor that ``[B]`` ``values`` stand for under ``layout`` (torch or numpy, as
    ``values``; same dtype; bfloat16 as numpy's raw ``uint16`` works too, 0 being +0.0).

    layout:  a ``ResultLayout`` value, or its name as ``AdvantageResult.layout`` carries it (``"broadcast"``).
    mask:    ``[B, T]`` 0/1 mask (bool, or any dtype: made bool by :func:`bool_mask`), needed for
             BROADCAST_TIMES_MASK and UP_TO_LAST_VALID; T is its width.
    columns: T for BROADCAST when no mask is given.
    view:    BROADCAST only: an ``expand`` view of ``values`` (no copy; read-only: in-place writes
             raise) instead of a new writable tensor.
    Raises ``ValueError`` for a layout that is not per-sample or a missing mask / width.
    """
    layout = layout_code(layout)
    if layout not in PER_SAMPLE_LAYOUTS:
        raise ValueError(f"not a per-sample layout: {layout_name(layout) if layout == DENSE else layout}")
    if mask is not None and getattr(mask, "dtype", None) not in (np.bool_, getattr(torch, "bool", None)):
        mask = bool_mask(mask)
    is_torch = _is_torch(values)
    if (is_torch and values.device.type == "cpu" and not (view and layout == BROADCAST)
            and (mask is None or not _is_torch(mask) or mask.device.type == "cpu")):
        # CPU tensors are rebuilt in numpy (the same selection, bit for bit): torch splits ops above 32768
        # elements over its intra-op threads, which then spin waiting for more work, and on a small machine
        # that starves the process's other threads (measured on 2 cores: grpc.aio's poller, 30 ms per call
        # with 4 concurrent calls of one group at T >= 4096, against 1-2 ms with this)
        bf16 = values.dtype == torch.bfloat16
        v = (values.detach().view(torch.int16) if bf16 else values.detach()).numpy()
        m = mask.detach().numpy() if _is_torch(mask) else mask
        out = torch.from_numpy(rebuild(v, layout, m, columns))
        return out.view(torch.bfloat16) if bf16 else out
    B = values.shape[0]
    if layout == BROADCAST:
        T = mask.shape[1] if mask is not None else columns
        if T is None:
            raise ValueError("rebuild(BROADCAST) needs the mask or the column count")
        if is_torch:
            out = values[:, None].expand(B, T)
            return out if view else out.contiguous()
        out = np.broadcast_to(values[:, None], (B, T))
        # a copy always (ascontiguousarray would hand back the read-only view itself when T = 1)
        return out if view else np.array(out, copy=True)
    if mask is None:
        raise ValueError(f"rebuild({layout_name(layout)}) needs the request's mask")
    if layout == UP_TO_LAST_VALID:
        T = mask.shape[1]
        last = _last_valid(mask)
        if is_torch:
            keep = torch.arange(T, device=last.device)[None, :] <= last[:, None]
        else:
            keep = np.arange(T)[None, :] <= last[:, None]
    else:
        keep = mask
    if is_torch:
        keep = keep.to(values.device)
        return torch.where(keep, values[:, None], torch.zeros((), dtype=values.dtype, device=values.device))
    return np.where(keep, values[:, None], np.zeros((), dtype=values.dtype))
