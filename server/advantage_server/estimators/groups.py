"""Per-prompt group statistics: group ids, baselines and stds (plain and leave-one-out), group-relative
advantages, rows left out of their group, verl's group conventions, and per-sample advantages broadcast
to ``[B, T]``.

Each vectorized kernel has a readable loop twin (``*_loop``) used as the test oracle. On the CPU with
numba, :func:`group_index` and :func:`group_baseline_and_std` run compiled kernels (one pass over the
batch, GIL released; :mod:`~advantage_server.estimators.jit`); the torch code is the GPU path and the
fallback without numba, and tests check both against the loop twins.
"""
from __future__ import annotations

import math
from dataclasses import field
from typing import Any

import numpy as np
import torch

from advantage_server.estimators import jit
from advantage_server.limits import checkpoint

@jit.njit
def _dense_rank(ids, lo, span, out):  # pragma: no cover - compiled; tested through group_index
    """out[i] = rank of ids[i] among the distinct values (ascending), for ids in [lo, lo + span). Returns
    False, ``out`` partly written, when an id lies outside that range (the ids changed after their min and
    max were read: memory another process writes): every index is checked before it is used."""
    seen = np.zeros(span, dtype=np.int64)
    for i in range(ids.shape[0]):
        k = ids[i] - lo
        if k < 0 or k >= span:
            return False
        seen[k] = 1
    rank = 0
    for k in range(span):
        if seen[k]:
            seen[k] = rank
            rank += 1
    for i in range(ids.shape[0]):
        k = ids[i] - lo
        if k < 0 or k >= span:
            return False
        out[i] = seen[k]
    return True


# ------------------------------------------------------------------------ [B, L] rows -> [B] ids
#: elements of ``[B, L]`` id rows hashed and grouped between two deadline checkpoints (~10 ms of CPU)
ROW_CHUNK_ELEMENTS = 1 << 21
#: the row hash's key: random per process, so that rows whose hashes collide cannot be crafted (colliding
#: rows stay apart, they only cost probes; crafted ones could make the grouping quadratic)
_ROW_KEY = tuple(int(v) for v in np.random.SeedSequence().generate_state(2, dtype=np.uint64))
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finalizer


@jit.njit
def _row_hashes(rows, lo, hi, a, b, out):  # pragma: no cover - compiled; tested through row_index
    """out[i] = sum over j of mix(rows[i, j] ^ (a * j + b)) (mod 2**64) for rows lo..hi-1; mix: splitmix64's
    finalizer (a bijection). The same hash as :func:`_row_hashes_torch`."""
    for i in range(lo, hi):
        h = np.uint64(0)
        for j in range(rows.shape[1]):
            z = np.uint64(rows[i, j]) ^ (a * np.uint64(j) + b)
            z = (z ^ (z >> np.uint64(30))) * _MIX1
            z = (z ^ (z >> np.uint64(27))) * _MIX2
            h += z ^ (z >> np.uint64(31))
        out[i] = h


@jit.njit
def _row_groups(rows, hashes, lo, hi, table, ids, n):  # pragma: no cover - compiled; tested through row_index
    """Rows lo..hi-1 into the open-addressing ``table`` (power-of-two size, -1 = free, else the first row
    of a group): ids[i] = the id of the equal row seen first, or n, the next new id. Equal hashes are
    confirmed by comparing the rows, so the ids are exact. Returns the new n."""
    mask = np.uint64(table.shape[0] - 1)
    for i in range(lo, hi):
        h = hashes[i]
        s = np.int64(h & mask)
        while True:
            r = table[s]
            if r < 0:
                table[s] = i
                ids[i] = n
                n += 1
                break
            if hashes[r] == h:
                same = True
                for j in range(rows.shape[1]):
                    if rows[r, j] != rows[i, j]:
                        same = False
                        break
                if same:
                    ids[i] = ids[r]
                    break
            s = np.int64((np.uint64(s) + np.uint64(1)) & mask)
    return n


@jit.njit
def _row_table_grow(table, hashes, bigger):  # pragma: no cover - compiled; tested through row_index
    """Move the groups of ``table`` into the free table ``bigger`` (twice or more its size)."""
    mask = np.uint64(bigger.shape[0] - 1)
    for k in range(table.shape[0]):
        r = table[k]
        if r >= 0:
            s = np.int64(hashes[r] & mask)
            while bigger[s] >= 0:
                s = np.int64((np.uint64(s) + np.uint64(1)) & mask)
            bigger[s] = r


def _row_index_numba(rows: np.ndarray) -> np.ndarray:
    """CPU: hash each row, then an open-addressing table of the groups' first rows; linear in the elements,
    a deadline checkpoint every :data:`ROW_CHUNK_ELEMENTS`. Ids in order of first appearance."""
    B, L = rows.shape
    a, b = np.uint64(_ROW_KEY[0]), np.uint64(_ROW_KEY[1])
    hashes, ids = np.empty(B, dtype=np.uint64), np.empty(B, dtype=np.int64)
    table = np.full(1024, -1, dtype=np.int64)
    step, n = max(1, ROW_CHUNK_ELEMENTS // L), 0
    for lo in range(0, B, step):
        hi = min(B, lo + step)
        _row_hashes(rows, lo, hi, a, b, hashes)
        if 2 * (n + hi - lo) > table.shape[0]:  # at most half full: a few probes per row
            bigger = np.full(1 << (2 * (n + hi - lo) - 1).bit_length(), -1, dtype=np.int64)
            _row_table_grow(table, hashes, bigger)
            table = bigger
        n = _row_groups(rows, hashes, lo, hi, table, ids, n)
        checkpoint("while grouping the [B, L] id rows")
    return ids


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _row_hashes_torch(rows: torch.Tensor) -> torch.Tensor:
    """The hash of :func:`_row_hashes` in int64 torch arithmetic (wrapping; logical shifts by masking), by
    chunks of rows with a deadline checkpoint between them."""
    B, L = rows.shape
    key = _signed(_ROW_KEY[0]) * torch.arange(L, device=rows.device, dtype=torch.int64) + _signed(_ROW_KEY[1])
    m1, m2 = _signed(int(_MIX1)), _signed(int(_MIX2))
    out = torch.empty(B, dtype=torch.int64, device=rows.device)
    step = max(1, ROW_CHUNK_ELEMENTS // L)
    for lo in range(0, B, step):
        z = rows[lo:lo + step] ^ key
        z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * m1
        z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * m2
        out[lo:lo + step] = (z ^ ((z >> 31) & ((1 << 33) - 1))).sum(1)
        checkpoint("while grouping the [B, L] id rows")
    return out


def _row_index_torch(rows: torch.Tensor) -> torch.Tensor:
    """GPU, or CPU without numba: group the row hashes (:func:`group_index` on ``[B]``), then check every row
    against its group's first row, by chunks; rows that differ under one hash (a collision: never seen with
    the random key) send the whole batch to the exact ``torch.unique``."""
    B, L = rows.shape
    group = group_index(_row_hashes_torch(rows))
    first = torch.full((B,), B, dtype=torch.int64, device=rows.device).scatter_reduce_(
        0, group, torch.arange(B, device=rows.device), "amin")[group]
    step = max(1, ROW_CHUNK_ELEMENTS // L)
    for lo in range(0, B, step):
        if not bool((rows[lo:lo + step] == rows[first[lo:lo + step]]).all()):
            return torch.unique(rows, dim=0, return_inverse=True)[1]
        checkpoint("while grouping the [B, L] id rows")
    return group


def row_index(rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, L]`` id rows (prompt token rows; gigpo's trajectory/anchor rows) -> ``[B]`` int64 ids,
    equal rows sharing one, different rows never: dense ``0..G-1`` in order of first appearance (CPU with
    numba) or of the rows' hashes (elsewhere); only the partition is defined.

    Linear in the ``B * L`` elements (a hash per row; before, ``torch.unique(dim=0)``'s row sort took 12.7 s
    of CPU for uint8 ``[4M, 1]``, which no deadline could stop) and it calls
    :func:`advantage_server.limits.checkpoint` every :data:`ROW_CHUNK_ELEMENTS` elements, so an expired
    or cancelled call stops here (DEADLINE_EXCEEDED / CANCELLED). Size: bounded by ``--max-batch-elements``
    (checked on the declared shape before decoding)."""
    B, L = rows.shape
    if B == 0 or L == 0:
        return torch.zeros(B, dtype=torch.int64, device=rows.device)  # empty rows are all equal
    if jit.applies(rows):
        return torch.from_numpy(_row_index_numba(jit.as_numpy(rows.to(torch.int64))))
    return _row_index_torch(rows.to(torch.int64))


def group_index(prompt_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` ids -> ``[B]`` int64 group index in ``0..G-1`` (sorted order); ``[B, L]`` token rows -> the
    ids of :func:`row_index` (equal rows, one group). ``InvalidInput`` on ``inputs['prompt_ids']``
    (INVALID_ARGUMENT) when ``[B]`` ids change while they are read: another process writing their memory
    (the server snapshots shared-memory ids before validation; this is the second line of defence)."""
    if prompt_ids.dim() == 2:
        return row_index(prompt_ids)
    if jit.applies(prompt_ids) and prompt_ids.numel() > 0:
        # CPU: a counting rank when the ids span a range comparable to B (the usual 0..G-1 or uid
        # hashes folded by the client), O(B) instead of a sort
        ids = jit.as_numpy(prompt_ids.to(torch.int64))
        lo, hi = int(ids.min()), int(ids.max())
        if hi - lo < 4 * ids.shape[0] + 1024:
            out = np.empty(ids.shape[0], dtype=np.int64)
            if not _dense_rank(ids, lo, hi - lo + 1, out):  # never a write out of bounds
                from advantage_server.errors import InvalidInput
                raise InvalidInput("inputs['prompt_ids']", f"changed while the server read it (a value left "
                                   f"[{lo}, {hi}], the range read moments before): do not write the ids of a "
                                   "call in flight")
            return torch.from_numpy(out)
    # sort-and-rank instead of torch.unique: no device-to-host sync on a GPU
    ordered, perm = torch.sort(prompt_ids, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    rank = torch.cumsum(starts, 0) - 1
    return torch.empty_like(rank).scatter_(0, perm, rank)


@jit.njit
def _group_layout(group, r):  # pragma: no cover - compiled; tested through group_baseline_and_std
    """Members of each group gathered contiguously by a counting sort (index order kept within a group).

    Returns (start [G + 1] offsets, order [B] (empty when the ids are already non-decreasing, as
    trainers lay groups out: then nothing moves), rs [B] the rewards in that order)."""
    B = group.shape[0]
    G = 0
    in_order = True
    for i in range(B):
        if group[i] >= G:
            G = group[i] + 1
        if i > 0 and group[i] < group[i - 1]:
            in_order = False
    start = np.zeros(G + 1, dtype=np.int64)
    for i in range(B):
        start[group[i] + 1] += 1
    for g in range(G):
        start[g + 1] += start[g]
    if in_order:
        return start, np.empty(0, dtype=np.int64), r
    fill = start[:G].copy()
    order = np.empty(B, dtype=np.int64)
    rs = np.empty(B, dtype=np.float64)
    for i in range(B):
        k = fill[group[i]]
        order[k] = i
        rs[k] = r[i]
        fill[group[i]] = k + 1
    return start, order, rs


@jit.njit
def _group_stats_chunk(g_lo, g_hi, start, rs, leave_one_out, out_b, out_s):  # pragma: no cover - compiled
    """Groups ``g_lo..g_hi-1`` of :func:`_group_baseline_and_std_torch`, each in one go on its contiguous
    members ``rs[start[g]:start[g + 1]]``; writes out_b, out_s at the same positions. The same
    arithmetic in the same order as the torch path, except divisions by a group's n - 1 and n - 2,
    done as multiplications by their reciprocals (a few ulp)."""
    for g in range(g_lo, g_hi):
        s = start[g]
        e = start[g + 1]
        n = e - s
        if n == 0:
            continue
        if n == 1:
            out_b[s] = rs[s]
            out_s[s] = 0.0
            continue
        nf = np.float64(n)
        total = 0.0
        lo = np.inf
        hi = -np.inf
        for k in range(s, e):
            x = rs[k]
            total += x
            lo = min(lo, x)
            hi = max(hi, x)
        tied = lo == hi
        mean = lo if tied else total / nf
        m2g = 0.0
        top = -1.0
        n_top = 0
        k_top = -1
        n_lo = 0
        n_hi = 0
        for k in range(s, e):
            x = rs[k]
            c = x - mean
            m2g += c * c
            dev = abs(c)
            if dev > top:
                top = dev
                n_top = 1
                k_top = k
            elif dev == top:
                n_top += 1
            n_lo += x == lo
            n_hi += x == hi
        if tied:
            m2g = 0.0
        if not leave_one_out:
            sd = 0.0 if tied else math.sqrt(m2g / (nf - 1.0))
            for k in range(s, e):
                out_b[k] = mean
                out_s[k] = sd
            continue
        others = nf - 1.0
        dof = others - 1.0
        # branch-free per member with per-group reciprocals; the lone dominant member is redone below
        lo_others = n_lo == n - 1
        hi_others = n_hi == n - 1
        pos_dof = 1.0 if dof > 0 else 0.0
        inv_others = 1.0 / others
        n_over_others = nf / others
        inv_dof = 1.0 / max(dof, 1.0)
        for k in range(s, e):
            x = rs[k]
            c = x - mean
            b = mean - c * inv_others
            m2 = max(m2g - c * c * n_over_others, 0.0)
            others_tied = tied | ((x == hi) & lo_others) | ((x == lo) & hi_others)
            sd = math.sqrt(m2 * inv_dof) * pos_dof
            out_b[k] = (lo if x == hi else hi) if others_tied else b
            out_s[k] = 0.0 if others_tied else sd
        if n_top == 1:
            # the group's lone dominant member: re-sum its others directly (no cancellation)
            x = rs[k_top]
            acc = 0.0
            for q in range(s, e):
                if q != k_top:
                    acc += rs[q]
            mean_x = acc / others
            m2x = 0.0
            for q in range(s, e):
                if q != k_top:
                    d = rs[q] - mean_x
                    m2x += d * d
            others_tied = tied | ((x == hi) & lo_others) | ((x == lo) & hi_others)
            sd = math.sqrt(m2x * inv_dof) * pos_dof
            out_b[k_top] = (lo if x == hi else hi) if others_tied else mean_x
            out_s[k_top] = 0.0 if others_tied else sd


#: groups per block of the uniform-size kernel (its per-block temporaries stay in L1)
_GROUP_BLOCK = 128
#: largest group size the uniform-size kernel takes (larger groups amortise the per-group work anyway)
_UNIFORM_MAX = 64


@jit.njit
def _uniform_size(start):  # pragma: no cover - compiled
    """n when every group of the layout has n members (trainers send G samples per prompt), else 0."""
    G = start.shape[0] - 1
    if G < 1:
        return 0
    n = start[1] - start[0]
    for g in range(1, G):
        if start[g + 1] - start[g] != n:
            return 0
    return n


@jit.njit
def _group_stats_uniform(g_lo, g_hi, n, rs, leave_one_out, out_b, out_s):  # pragma: no cover - compiled
    """:func:`_group_stats_chunk` for a layout whose groups all have ``n`` members (group g is
    ``rs[g * n:(g + 1) * n]``): the same arithmetic in the same order, bit for bit, but a block of
    groups at a time with the loop over the block's groups innermost. Each group's sums are then
    independent chains the CPU overlaps (and LLVM vectorizes), instead of one short dependent chain
    per group; the branches of the generic kernel become selects."""
    if n == 1:
        for k in range(g_lo, g_hi):
            out_b[k] = rs[k]
            out_s[k] = 0.0
        return
    nf = np.float64(n)
    others = nf - 1.0
    dof = others - 1.0
    pos_dof = 1.0 if dof > 0 else 0.0
    inv_others = 1.0 / others
    n_over_others = nf / others
    inv_dof = 1.0 / max(dof, 1.0)
    nm1 = nf - 1.0
    BW = _GROUP_BLOCK
    X = np.empty((n, BW))
    Y = np.empty((n, BW))
    total = np.empty(BW)
    lo = np.empty(BW)
    hi = np.empty(BW)
    mean = np.empty(BW)
    m2g = np.empty(BW)
    top = np.empty(BW)
    n_top = np.empty(BW)
    n_lo = np.empty(BW)
    n_hi = np.empty(BW)
    acc = np.empty(BW)
    m2x = np.empty(BW)
    for g0 in range(g_lo, g_hi, BW):
        bw = min(BW, g_hi - g0)
        base = g0 * n
        for j in range(bw):
            total[j] = 0.0
            lo[j] = np.inf
            hi[j] = -np.inf
        for j in range(bw):  # transpose the block: contiguous reads here, contiguous rows of X below
            for k in range(n):
                X[k, j] = rs[base + j * n + k]
        for k in range(n):
            for j in range(bw):
                x = X[k, j]
                total[j] += x
                lo[j] = min(lo[j], x)
                hi[j] = max(hi[j], x)
        for j in range(bw):
            mean[j] = lo[j] if lo[j] == hi[j] else total[j] / nf
            m2g[j] = 0.0
            top[j] = -1.0
            n_top[j] = 0.0
            n_lo[j] = 0.0
            n_hi[j] = 0.0
            acc[j] = 0.0
            m2x[j] = 0.0
        for k in range(n):
            for j in range(bw):
                c = X[k, j] - mean[j]
                m2g[j] += c * c
                top[j] = max(top[j], abs(c))
        if not leave_one_out:
            for j in range(bw):
                tied = lo[j] == hi[j]
                sd = 0.0 if tied else math.sqrt(m2g[j] / nm1)
                for k in range(n):
                    out_b[base + j * n + k] = mean[j]
                    out_s[base + j * n + k] = sd
            continue
        for k in range(n):
            for j in range(bw):
                x = X[k, j]
                dev = abs(x - mean[j])
                n_top[j] += 1.0 if dev == top[j] else 0.0
                n_lo[j] += 1.0 if x == lo[j] else 0.0
                n_hi[j] += 1.0 if x == hi[j] else 0.0
                acc[j] += 0.0 if dev == top[j] else x
        for j in range(bw):
            if lo[j] == hi[j]:
                m2g[j] = 0.0
            acc[j] = acc[j] / others  # the others' mean of the lone dominant member
        for k in range(n):
            for j in range(bw):
                x = X[k, j]
                d = x - acc[j]
                m2x[j] += 0.0 if abs(x - mean[j]) == top[j] else d * d
        for k in range(n):  # per member, branch-free over the block; results in X (b) and Y (sd)
            for j in range(bw):
                x = X[k, j]
                c = x - mean[j]
                lone = (n_top[j] == 1.0) & (abs(c) == top[j])
                b = acc[j] if lone else mean[j] - c * inv_others
                m2 = m2x[j] if lone else max(m2g[j] - c * c * n_over_others, 0.0)
                others_tied = (lo[j] == hi[j]) | ((x == hi[j]) & (n_lo[j] == others)) | (
                    (x == lo[j]) & (n_hi[j] == others))
                sd = math.sqrt(m2 * inv_dof) * pos_dof
                X[k, j] = (lo[j] if x == hi[j] else hi[j]) if others_tied else b
                Y[k, j] = 0.0 if others_tied else sd
        for j in range(bw):
            for k in range(n):
                out_b[base + j * n + k] = X[k, j]
                out_s[base + j * n + k] = Y[k, j]


def _group_stats_run(start, rs, leave_one_out, out_b, out_s) -> None:
    """The group statistics of a layout: the uniform-size kernel when every group has the same (small)
    size, else the generic one. Split over the cores from 2^17 rewards on (``parallel_rows``'s threshold
    counts rewards here: below it a hand-off costs about what it saves, and far more when another
    process holds the other core)."""
    G = start.shape[0] - 1
    B = rs.shape[0]
    n = _uniform_size(start) if G > 1 else 0
    if 0 < n <= _UNIFORM_MAX:
        jit.parallel_rows(_group_stats_uniform, G, n, n, rs, bool(leave_one_out), out_b, out_s)
    else:  # T = the mean group size for the parallel threshold
        jit.parallel_rows(_group_stats_chunk, G, max(1, B // max(G, 1)) * 8, start, rs, bool(leave_one_out),
                          out_b, out_s)


@jit.njit
def _weighted_relative_uniform(g_lo, g_hi, n, rs2, weights, leave_one_out, normalize, epsilon, tmp_b, tmp_s,
                               total):  # pragma: no cover - compiled; tested through gdpo
    """:func:`_weighted_relative_chunk` for groups that all have ``n`` members (:func:`_group_stats_uniform`)."""
    lo = g_lo * n
    hi = g_hi * n
    for c in range(rs2.shape[0]):
        _group_stats_uniform(g_lo, g_hi, n, rs2[c], leave_one_out, tmp_b, tmp_s)
        w = weights[c]
        for k in range(lo, hi):
            a = rs2[c, k] - tmp_b[k]
            if normalize and tmp_s[k] > 0:
                a = a / (tmp_s[k] + epsilon)
            total[k] = w * a if c == 0 else total[k] + w * a


@jit.njit
def _in_order_size(group):  # pragma: no cover - compiled
    """n when ``group`` is 0 (n times), 1 (n times), ... G - 1 (n times), else 0."""
    B = group.shape[0]
    n = 0
    while n < B and group[n] == 0:
        n += 1
    if n == 0 or B % n != 0:
        return 0
    g = 0
    c = 0
    for i in range(B):
        if group[i] != g:
            return 0
        c += 1
        if c == n:
            c = 0
            g += 1
    return n


@jit.njit
def _relative_rows_uniform(g_lo, g_hi, n, r, leave_one_out, normalize, epsilon, out):  # pragma: no cover - compiled
    """Groups ``g_lo..g_hi-1`` (all of ``n`` members, in order) straight to the ``[B, T]`` output: the
    statistics of :func:`_group_stats_uniform` and the advantage of :func:`_relative` on an L2-sized
    float64 copy of a slice of the rewards, each row written once (the value cast to ``out``'s dtype as
    ``astype`` does). Bit for bit :func:`group_relative` + :func:`broadcast_rows`, without their three
    ``[B]`` float64 temporaries (at small T those cost more than the output)."""
    T = out.shape[1]
    step = 1024  # groups per slice
    m_max = min(step, g_hi - g_lo) * n
    loc = np.empty(m_max)
    ob = np.empty(m_max)
    os_ = np.empty(m_max)
    for g0 in range(g_lo, g_hi, step):
        bw = min(step, g_hi - g0)
        base = g0 * n
        m = bw * n
        for i in range(m):
            loc[i] = r[base + i]
        _group_stats_uniform(0, bw, n, loc, leave_one_out, ob, os_)
        for i in range(m):
            a = loc[i] - ob[i]
            if normalize and os_[i] > 0:
                a = a / (os_[i] + epsilon)
            for t in range(T):
                out[base + i, t] = a


def group_relative_rows(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool, normalize: bool,
                        epsilon: float, T: int, dtype: torch.dtype, batch=None) -> torch.Tensor | None:
    """:func:`group_relative` broadcast to the ``[B, T]`` result (:func:`broadcast_rows`) in one compiled
    pass, for the layout trainers send: CPU with numba, ``[B]`` rewards, each prompt's samples back to
    back, every group of the same size (<= 64). None where that does not apply (the caller then takes
    the general path). The output comes from ``batch.output`` when a batch is given."""
    if not (jit.applies(group, rewards) and group.numel() > 1 and rewards.dim() == 1 and rewards.dtype in
            (torch.float32, torch.float64) and dtype in (torch.float32, torch.float64)):
        return None
    n = _in_order_size(np.ascontiguousarray(jit.numpy_as(group, torch.int64)))
    if not 0 < n <= _UNIFORM_MAX:
        return None
    B = group.shape[0]
    G = B // n
    out = batch.output("advantages", dtype) if batch is not None else torch.empty((B, T), dtype=dtype)
    jit.parallel_rows(_relative_rows_uniform, G, n * T, n, jit.as_numpy(rewards), bool(leave_one_out),
                      bool(normalize), float(epsilon), out.numpy())
    return out


def _stacked(components: list[torch.Tensor]) -> np.ndarray:
    """The ``[B]`` CPU components as one C-contiguous ``[C, B]`` numpy array of their (common) dtype.

    The numba kernels take the components in this form so that one compiled variant per dtype serves
    every component count C (a tuple of arrays would be a new type, and a new compilation, per C). One
    copy of C * B elements in the input dtype (small next to the ``[B, T]`` result)."""
    first = components[0]
    out = np.empty((len(components), first.shape[0]), dtype=jit.np_dtype(first.dtype))
    for i, c in enumerate(components):
        out[i] = c.detach().numpy()
    return out


@jit.njit
def _weighted_relative_rows_uniform(g_lo, g_hi, n, comps, weights, leave_one_out, normalize, epsilon,
                                    total):  # pragma: no cover - compiled; tested through gdpo
    """:func:`_weighted_relative_uniform` read straight from the components (one ``[C, B]`` array of
    float32 or float64, groups of ``n`` back to back in each row) on L2-sized float64 slices: bit for
    bit the same ``total``. One compiled variant per dtype, whatever C is."""
    step = 1024  # groups per slice
    m_max = min(step, g_hi - g_lo) * n
    loc = np.empty(m_max)
    ob = np.empty(m_max)
    os_ = np.empty(m_max)
    for g0 in range(g_lo, g_hi, step):
        bw = min(step, g_hi - g0)
        base = g0 * n
        m = bw * n
        for c in range(comps.shape[0]):
            for i in range(m):
                loc[i] = comps[c, base + i]
            _group_stats_uniform(0, bw, n, loc, leave_one_out, ob, os_)
            w = weights[c]
            for i in range(m):
                a = loc[i] - ob[i]
                if normalize and os_[i] > 0:
                    a = a / (os_[i] + epsilon)
                total[base + i] = w * a if c == 0 else total[base + i] + w * a


@jit.njit
def _weighted_relative_chunk(g_lo, g_hi, start, rs2, weights, leave_one_out, normalize, epsilon, tmp_b, tmp_s,
                             total):  # pragma: no cover - compiled; tested through gdpo
    """Groups ``g_lo..g_hi-1``: total = sum_c weights[c] * A_c with A_c the group-relative advantage of
    component c (rs2[c], in layout order): :func:`_group_stats_chunk` and :func:`_relative` per
    component, accumulated in place (GDPO's weighted sum, without a [B] temporary per component)."""
    lo = start[g_lo]
    hi = start[g_hi]
    for c in range(rs2.shape[0]):
        _group_stats_chunk(g_lo, g_hi, start, rs2[c], leave_one_out, tmp_b, tmp_s)
        w = weights[c]
        for k in range(lo, hi):
            a = rs2[c, k] - tmp_b[k]
            if normalize and tmp_s[k] > 0:
                a = a / (tmp_s[k] + epsilon)
            total[k] = w * a if c == 0 else total[k] + w * a


def weighted_group_relative(group: torch.Tensor, components: list[torch.Tensor], weights: tuple[float, ...],
                            leave_one_out: bool, normalize: bool, epsilon: float = 1e-6) -> torch.Tensor | None:
    """``sum_c weights[c] * group_relative(group, components[c], ...)`` as float64 ``[B]``, on the CPU with
    numba in one pass over the groups (the group layout built once); None where that path does not
    apply (the caller then sums :func:`group_relative` itself)."""
    if not (jit.applies(group, *components) and group.numel() > 0 and components):
        return None
    B = group.shape[0]
    ids = np.ascontiguousarray(jit.numpy_as(group, torch.int64))
    n = _in_order_size(ids) if B > 1 else 0
    if 0 < n <= _UNIFORM_MAX and len({c.dtype for c in components}) == 1 and all(c.dim() == 1 for c in components):
        # prompts back to back in equal groups: no [B] temporaries. The components go in as one [C, B]
        # array of their own dtype (not a tuple of C arrays: numba compiles, and keeps, one machine-code
        # variant per tuple length, ~1 s of CPU and tens of MiB per new component count; issue 11 item 3)
        total = np.empty(B)
        jit.parallel_rows(_weighted_relative_rows_uniform, B // n, n * len(components), n,
                          _stacked(components), np.asarray(weights, dtype=np.float64),
                          bool(leave_one_out), bool(normalize), float(epsilon), total)
        return torch.from_numpy(total)
    rs2 = np.empty((len(components), B))  # the components as float64 rows, cast straight into place
    for c, comp in enumerate(components):
        rs2[c] = comp.detach().numpy()
    start, order, _ = _group_layout(np.ascontiguousarray(jit.numpy_as(group, torch.int64)), rs2[0])
    in_order = order.shape[0] == 0
    if not in_order:
        rs2 = rs2[:, order]
    G = start.shape[0] - 1
    tmp_b, tmp_s, total = np.empty(B), np.empty(B), np.empty(B)
    w = np.asarray(weights, dtype=np.float64)
    n = _uniform_size(start) if G > 1 else 0
    if 0 < n <= _UNIFORM_MAX:
        jit.parallel_rows(_weighted_relative_uniform, G, n * len(components), n, rs2, w, bool(leave_one_out),
                          bool(normalize), float(epsilon), tmp_b, tmp_s, total)
    else:
        jit.parallel_rows(_weighted_relative_chunk, G, max(1, B // max(G, 1)) * 8 * len(components), start, rs2,
                          w, bool(leave_one_out), bool(normalize), float(epsilon), tmp_b, tmp_s, total)
    if in_order:
        return torch.from_numpy(total)
    out = np.empty(B)
    out[order] = total
    return torch.from_numpy(out)


@jit.njit
def _scatter_back(order, out_b, out_s, baseline, std):  # pragma: no cover - compiled
    for k in range(order.shape[0]):
        baseline[order[k]] = out_b[k]
        std[order[k]] = out_s[k]


def group_baseline_and_std(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std of its prompt group, as float64 ``[B]`` tensors.

    group:   ``[B]`` int64 in ``0..G-1``; rewards: ``[B]`` float.
    Without leave-one-out the baseline is the group mean and std the group's sample std (n - 1).
    With leave-one-out (RLOO, arXiv:2402.14740) both are over the *other* members of the group:
    baseline_i = mean_{j != i} r_j, std_i = sample std of {r_j : j != i} (0 when fewer than 2 others).
    A group of one gets baseline = its own reward and std 0 (advantage 0), as in NeMo RL.

    Numerics: float64, two-pass (mean, then centred sum of squares), leave-one-out statistics by
    Welford-style removal, except for a group's single dominant member, whose others are re-summed
    directly (removal would cancel catastrophically there). A group whose rewards are all equal gets its common value as baseline
    exactly, so its advantage is exactly 0 (no float cancellation noise).

    On the CPU with numba this runs :func:`_group_layout` (a counting sort, skipped for ids in order)
    and :func:`_group_stats_chunk` (each group at once, groups split over the cores); elsewhere
    :func:`_group_baseline_and_std_torch`.
    """
    if jit.applies(group, rewards) and group.numel() > 0:
        _, baseline, std = _group_stats_numpy(group, rewards, leave_one_out)
        return torch.from_numpy(baseline), torch.from_numpy(std)
    return _group_baseline_and_std_torch(group, rewards, leave_one_out)


def _group_stats_numpy(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CPU (numba) group statistics as numpy float64 arrays: (rewards, baseline, std)."""
    r = np.ascontiguousarray(jit.numpy_as(rewards, torch.float64))
    baseline, std = np.empty_like(r), np.empty_like(r)
    start, order, rs = _group_layout(np.ascontiguousarray(jit.numpy_as(group, torch.int64)), r)
    in_order = order.shape[0] == 0
    out_b, out_s = (baseline, std) if in_order else (np.empty_like(r), np.empty_like(r))
    _group_stats_run(start, rs, leave_one_out, out_b, out_s)  # groups split over the cores, GIL released
    if not in_order:
        _scatter_back(order, out_b, out_s, baseline, std)
    return r, baseline, std


def _group_baseline_and_std_torch(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`group_baseline_and_std` (any device, no device-to-host sync)."""
    r = rewards.to(torch.float64)
    G = group.shape[0]  # group ids are < B; sizing by B avoids a device-to-host sync for max()
    n = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, group, torch.ones_like(r))
    total = torch.zeros_like(n).index_add_(0, group, r)
    mean_g = total / n
    lo = torch.full_like(n, float("inf")).scatter_reduce_(0, group, r, "amin")
    hi = torch.full_like(n, float("-inf")).scatter_reduce_(0, group, r, "amax")
    tied = lo == hi
    mean_g = torch.where(tied, lo, mean_g)
    centred = r - mean_g[group]
    m2_g = torch.zeros_like(n).index_add_(0, group, centred.square())
    m2_g = torch.where(tied, torch.zeros_like(m2_g), m2_g)
    n_i = n[group]
    if leave_one_out:
        others = n_i - 1
        # mean of the others = mean + (mean - r_i) / (n - 1); their centred sum of squares by removal
        baseline = mean_g[group] - centred / others.clamp(min=1)
        m2 = (m2_g[group] - centred.square() * n_i / others.clamp(min=1)).clamp(min=0)
        # Removing the one member that dominates the group's spread cancels catastrophically
        # ({1e6, 0, 1e-3} seen from 1e6): for that member, the others' statistics are recomputed
        # directly by a second two-pass over the group without it.
        dev = centred.abs()
        top = torch.full_like(n, -1.0).scatter_reduce_(0, group, dev, "amax")
        is_top = dev == top[group]
        n_top = torch.zeros_like(n).index_add_(0, group, is_top.to(r.dtype))
        lone_top = is_top & (n_top[group] == 1) & (others >= 1)
        keep = (~lone_top).to(r.dtype)
        mean_x = torch.zeros_like(n).index_add_(0, group, r * keep) / (n - 1).clamp(min=1)
        m2_x = torch.zeros_like(n).index_add_(0, group, (r - mean_x[group]).square() * keep)
        baseline = torch.where(lone_top, mean_x[group], baseline)
        m2 = torch.where(lone_top, m2_x[group], m2)
        dof = others - 1
        # the others can be tied although the group is not ({0.7, 0.7, 0.7, 1.0} seen from 1.0):
        # they are when every other member sits at the group's opposite extreme
        lo_i, hi_i = lo[group], hi[group]
        n_lo = torch.zeros_like(n).index_add_(0, group, (r == lo_i).to(r.dtype))[group]
        n_hi = torch.zeros_like(n).index_add_(0, group, (r == hi_i).to(r.dtype))[group]
        others_tied = tied[group] | ((r == hi_i) & (n_lo == others)) | ((r == lo_i) & (n_hi == others))
        baseline = torch.where(others_tied, torch.where(r == hi_i, lo_i, hi_i), baseline)
    else:
        baseline = mean_g[group]
        m2 = m2_g[group]
        dof = n_i - 1
        others_tied = tied[group]
    std = torch.where(dof > 0, (m2 / dof.clamp(min=1)).sqrt(), torch.zeros_like(m2))
    std = torch.where(others_tied, torch.zeros_like(std), std)
    single = n_i <= 1
    baseline = torch.where(single, r, baseline)
    std = torch.where(single, torch.zeros_like(std), std)
    return baseline, std


def group_baseline_and_std_loop(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop twin of :func:`group_baseline_and_std` (test oracle): one prompt and one sample at a time."""
    r = rewards.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    baseline, std = list(r), [0.0] * len(r)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        if len(members) <= 1:
            continue
        for i in members:
            pool = [r[j] for j in members if not (leave_one_out and j == i)]
            mu = sum(pool) / len(pool)
            if all(v == pool[0] for v in pool):
                mu = pool[0]
            baseline[i] = mu
            std[i] = (sum((v - mu) ** 2 for v in pool) / (len(pool) - 1)) ** 0.5 if len(pool) > 1 else 0.0
    return torch.tensor(baseline, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)


@jit.njit
def _relative(r, baseline, std, normalize, epsilon):  # pragma: no cover - compiled
    """baseline[i] <- r[i] - baseline[i], divided by (std[i] + epsilon) where std[i] > 0 when normalize
    (in place: ``r`` may be a view of an input and is left alone)."""
    for i in range(r.shape[0]):
        a = r[i] - baseline[i]
        if normalize and std[i] > 0:
            a = a / (std[i] + epsilon)
        baseline[i] = a


def group_relative(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool, normalize: bool,
                   epsilon: float = 1e-6, std_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO advantage per sample, float64 ``[B]``: (r - baseline), divided by (std + epsilon) where std > 0.

    ``std_rewards`` (DAPO): compute the std on these values instead of on ``rewards``.
    """
    if jit.applies(group, rewards, std_rewards) and group.numel() > 0:  # CPU: no torch thread pool on [B]
        r, baseline, std = _group_stats_numpy(group, rewards, leave_one_out)
        if std_rewards is not None:
            std = _group_stats_numpy(group, std_rewards, leave_one_out)[2]
        _relative(r, baseline, std, bool(normalize), float(epsilon))  # baseline becomes the advantage
        return torch.from_numpy(baseline)
    baseline, std = group_baseline_and_std(group, rewards, leave_one_out)
    if std_rewards is not None:
        _, std = group_baseline_and_std(group, std_rewards, leave_one_out)
    adv = rewards.to(torch.float64) - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + epsilon), adv)
    return adv


# --------------------------------------------------------------------------- rows left out of their group
EXCLUDE_EMPTY_DOC = (
    "Leave a row whose mask is all 0 (a rejected or empty response) out of its prompt group: the group's "
    "baseline, std (and leave-one-out statistics) are over its other rows, and the empty row's own "
    "advantage is 0 at every position. A group whose rows are all empty gives 0 everywhere; a group left "
    "with one row is a group of one (the semantics' convention for it). Off (default): empty rows count as "
    "members, as the reference computes (verl PR #6452, OpenRLHF PR #1239).")


def exclude_empty_field(per_semantics: dict[str, bool] | None = None, extra: str = "") -> Any:
    """The ``exclude_empty_responses`` config field of a group estimator (off by default)."""
    meta: dict[str, Any] = {"doc": EXCLUDE_EMPTY_DOC + extra}
    if per_semantics is None:
        return field(default=False, metadata=meta)
    which = ", ".join(per_semantics)
    return field(default=None, metadata={**meta, "per_semantics": per_semantics,
                                         "default_text": f"false ({which}); not applicable otherwise"})


def nonempty_rows(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the rows with at least one mask = 1 position."""
    return mask.bool().any(-1) if mask.dtype != torch.bool else mask.any(-1)


def exclude_rows(group: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[B]`` group index in ``0..G'-1`` in which every row with ``keep`` false is a group of its own.

    Every group statistic computed on the result (:func:`group_baseline_and_std` and its numba, uniform and
    torch kernels, :func:`group_sizes`, :func:`group_sum`, scatter reductions) is then over the kept rows
    of each prompt only; what a left-out row gets is its group-of-one value, which callers overwrite.
    """
    B = group.shape[0]
    rows = torch.arange(B, dtype=torch.int64, device=group.device)
    return group_index(torch.where(keep, group.to(torch.int64), B + rows))


def groups_of(cfg: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(group index, kept rows)`` of a batch: ``prompt_ids`` as is and None, or, when
    ``cfg.exclude_empty_responses``, with each empty row (mask all 0) on its own and the ``[B]`` bool of
    the non-empty rows."""
    group = batch["prompt_ids"]
    if not getattr(cfg, "exclude_empty_responses", False):
        return group, None
    keep = nonempty_rows(batch["mask"])
    return exclude_rows(group, keep), keep


def zero_rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``x`` (``[B]`` or ``[B, T]``) with the rows where ``keep`` is false set to 0 (unchanged for None)."""
    if keep is None:
        return x
    k = keep if x.dim() == 1 else keep[:, None]
    return torch.where(k, x, torch.zeros((), dtype=x.dtype, device=x.device))


def group_sizes(group: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64: the size of each sample's group."""
    ones = torch.ones(group.shape[0], dtype=torch.float64, device=group.device)
    return torch.zeros_like(ones).index_add_(0, group, ones)[group]


def group_sum(group: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B]`` (or ``[B, ...]``) float64: the sum of ``x`` over each sample's group."""
    xd = x.to(torch.float64)
    return torch.zeros_like(xd).index_add_(0, group, xd)[group]


def group_max(group: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64: the largest ``x`` of each sample's group (``group``: ``[B]`` int64 index 0..G-1)."""
    xd = x.to(torch.float64)
    out = torch.full((int(group.max()) + 1 if group.numel() else 0,), -torch.inf, dtype=torch.float64,
                     device=xd.device)
    return out.scatter_reduce_(0, group, xd, reduce="amax", include_self=True)[group]


def verl_group_stats(group: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's per-group mean and sample std (``torch.std``) of ``scores``, float64 ``[B]`` each, with verl's
    convention for a group of one: mean 0, std 1. Tied groups get their exact value and std 0."""
    mean, std = group_baseline_and_std(group, scores, leave_one_out=False)
    single = group_sizes(group) <= 1
    return torch.where(single, torch.zeros_like(mean), mean), torch.where(single, torch.ones_like(std), std)


def verl_std_plus_eps(group: torch.Tensor, std: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``std + epsilon`` float64 ``[B]`` as verl's ``compute_grpo_outcome_advantage`` computes it: a group
    of one has ``std = torch.tensor(1.0)``, a float32 scalar, so there ``1 + epsilon`` is rounded to
    float32 (1 + 1e-6 -> 1.00000095...) whatever the rewards' dtype. ``std``: from :func:`verl_group_stats`."""
    one_plus_eps = float(torch.tensor(1.0) + epsilon)
    single = group_sizes(group) <= 1
    return torch.where(single, torch.full_like(std, one_plus_eps), std + epsilon)


def verl_group_stats_loop(group: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop twin of :func:`verl_group_stats` (test oracle), one group at a time like verl's dict loop."""
    s = scores.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    mean, std = [0.0] * len(s), [1.0] * len(s)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        if len(members) == 1:
            continue
        vals = [s[i] for i in members]
        mu = vals[0] if all(v == vals[0] for v in vals) else sum(vals) / len(vals)
        sd = (sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
        for i in members:
            mean[i], std[i] = mu, sd
    return torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)


# --------------------------------------------------------------------------- segmented scans
def segmented_discounted_returns(x: torch.Tensor, seg_end: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_i = sum_{i <= k <= seg_end[i]} gamma^(k - i) x_k`` for float64 ``x`` [N] laid out in contiguous
    segments (``seg_end[i]``: the last position of i's segment, int64 [N]): GiGPO's step returns, and with
    gamma = 1 the within-group suffix sums of PKPO (each sum over its own segment only: no running total
    of other segments enters it, so a segment's precision does not depend on what lies before it).

    Hillis-Steele scan: after round j, ``G_i`` holds the first ``2^j`` terms; round j adds
    ``gamma^(2^j) * G_{i + 2^j}`` where ``i + 2^j`` is still in the segment. ceil(log2(longest segment))
    rounds of whole-tensor operations; exact for gamma = 0 and 1, no ``gamma^-k`` rescaling (no overflow).
    """
    n = x.shape[0]
    g = x.clone()
    if n == 0:
        return g
    pos = torch.arange(n, device=x.device)
    longest = int((seg_end - pos).max()) + 1
    d = 1
    while d < longest:
        j = pos + d
        inside = j <= seg_end
        g = g + torch.where(inside, g[j.clamp(max=n - 1)] * (gamma ** d), torch.zeros_like(g))
        d *= 2
    return g


# --------------------------------------------------------------------------- per-row outputs
def broadcast_rows(adv: torch.Tensor, B: int, T: int, dtype: torch.dtype, batch: Any = None) -> torch.Tensor:
    """A per-sample ``[B]`` advantage as the ``[B, T]`` result in ``dtype``, the same value in every column.

    On the CPU with numba the ``[B, T]`` tensor is written here, densely and in parallel (the response
    needs those bytes anyway), into ``batch.output("advantages", dtype)`` when a ``Batch`` is given (the
    caller's memory, when it offers some); elsewhere it is an ``expand`` view of the ``[B]`` values.
    """
    if jit.applies(adv):
        if batch is None:
            return jit.broadcast_rows(jit.numpy_as(adv, dtype), T, dtype)
        out = batch.output("advantages", dtype)
        jit.parallel_rows(jit._fill_rows, B, T, np.ascontiguousarray(jit.numpy_as(adv, dtype)), out.numpy())
        return out
    return adv.to(dtype)[:, None].expand(B, T)


def slime_group_norm_field(divides: bool) -> Any:
    """``rewards_normalization``: slime's rollout reward post-processing (``_post_process_rewards``; slime only,
    default true). ``divides``: the estimator also divides by the group's std (grpo, with ``normalize_rewards``)."""
    also = ", and divide by the group's std + epsilon with normalize_rewards" if divides else ""
    return field(default=None, metadata={
        "doc": "slime's reward post-processing (its --disable-rewards-normalization turns it off): subtract the "
               f"prompt group's mean{also}. Off: the rewards are used as sent (what slime's trainer does with "
               "rewards its rollout already normalised). slime only.",
        "per_semantics": {"slime": True}, "default_text": "true (slime); not applicable otherwise"})
