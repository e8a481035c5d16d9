"""Compact masks: a 0/1 mask sent as one byte per token, or as one length per row.

Trainers keep their token masks as float32 (verl's ``response_mask``, NeMo RL's ``token_mask``): 4 bytes
for one bit. :func:`compact_mask` finds, without the caller doing anything, what the same mask costs less
as on the wire:

* a prefix mask (every row's 1s come first: the usual right-padded response) -> ``lengths`` ``[B]`` int32
  plus the column count T (``ComputeAdvantageRequest.mask_columns``): 4 B bytes instead of 4 B T;
* any other 0/1 mask -> ``bool`` ``[B, T]``: B T bytes instead of 4 B T.

The server computes the same numbers from either (it reads every mask as ``mask != 0`` in the compute
dtype). What is not sent compact: a mask holding anything but 0 and 1 (NaN included: the server then
answers INVALID_ARGUMENT about the mask as sent), a float64 mask when no other input is float64 (the
server computes in float64 when any input is float64, so dropping the mask's float64 would change the
compute dtype), and masks already one byte per token (bool, uint8).

Cost (numpy, also for torch tensors on the CPU): one comparison pass and two counting passes over the
mask, plus one pass over the bool copy for the prefix test: about 0.1 ms for 16 x 8192 and 4 ms for
512 x 8192 on 2 loaded cores, against 3 of every 4 mask bytes not encoded, sent, received and checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


@dataclass
class CompactMask:
    """What :func:`compact_mask` decided.

    bool_mask: the mask as ``bool`` ``[B, T]`` (torch, on the mask's device, or numpy): what is sent when
               ``lengths`` is None, and what the client rebuilds per-sample results with.
    lengths:   ``[B]`` int32 (numpy) when the mask is a prefix mask (and ``prefix`` was allowed), else None.
    columns:   T (the mask's width).
    """

    bool_mask: Any
    lengths: Any
    columns: int


def _is_float64(value: Any) -> bool:
    if torch is not None and isinstance(value, torch.Tensor):
        return value.dtype == torch.float64
    return isinstance(value, np.ndarray) and value.dtype == np.float64


def compact_mask(mask: Any, others: Mapping[str, Any] = {}, prefix: bool = True) -> CompactMask | None:
    """The compact form of ``mask`` (a torch tensor or numpy array of a float or wide integer dtype holding
    only 0 and 1), or None when it should be sent as it is (see the module docstring).

    others: the call's other inputs (a float64 mask is only compacted when one of them is float64).
    prefix: look for a prefix mask (only for a 2-D mask; the packed layout's flat ``[N]`` mask has none).
    Never raises for a bad mask: it returns None and the server reports what is wrong with it.
    """
    is_torch = torch is not None and isinstance(mask, torch.Tensor)
    if not is_torch and not isinstance(mask, np.ndarray):
        return None  # lists: encoded as float32 by the codec; not worth a conversion here
    if is_torch:
        dtype_ok = mask.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
        is_f64 = mask.dtype == torch.float64
    else:
        dtype_ok = mask.dtype.name in ("float32", "float16", "float64", "int64", "int32")
        is_f64 = mask.dtype == np.float64
    if not dtype_ok or mask.ndim not in (1, 2) or 0 in mask.shape:
        return None
    if is_f64 and not any(_is_float64(v) for k, v in others.items() if k != "mask"):
        return None
    columns = int(mask.shape[-1])
    if is_torch and mask.device.type == "cpu" and mask.dtype != torch.bfloat16:
        out = _compact_numpy(mask.detach().numpy(), prefix, columns)  # numpy's counting is 10x torch's here
        if out is not None:
            out.bool_mask = torch.from_numpy(out.bool_mask)
        return out
    if is_torch:  # on the GPU (or bfloat16): the same passes in torch, one small bool mask comes back
        m = mask.detach()
        ones = m == 1
        if int(torch.count_nonzero(m)) != int(torch.count_nonzero(ones)):
            return None  # a value other than 0 and 1 (or NaN): sent as it is
        lengths = None
        if prefix and m.ndim == 2 and not bool((ones[:, 1:] & ~ones[:, :-1]).any()):  # no 0 before a 1
            lengths = ones.sum(1).to("cpu", torch.int32).numpy()
        return CompactMask(ones, lengths, columns)
    return _compact_numpy(mask, prefix, columns)


def _compact_numpy(mask: np.ndarray, prefix: bool, columns: int) -> CompactMask | None:
    ones = mask == 1
    # counting a bool array is ~20x faster than counting a float one's non-zeros (the test it replaces)
    if np.count_nonzero(ones) + np.count_nonzero(mask == 0) != mask.size:
        return None  # a value other than 0 and 1 (or NaN): sent as it is
    lengths = None
    if prefix and mask.ndim == 2 and not np.any(ones[:, 1:] > ones[:, :-1]):  # no 0 followed by a 1
        lengths = np.count_nonzero(ones, axis=1).astype(np.int32)
    return CompactMask(ones, lengths, columns)
