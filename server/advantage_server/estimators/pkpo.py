"""PKPO: the unbiased pass@k reward transformation of a prompt group (Walder & Karkhanis 2025, "Pass@k
Policy Optimization", arXiv:2505.15201), then centred on the group mean.

Reference: rLLM PR #743 (rllm-org/rllm, commit 6b3b2da5d57f9b0a941f518568df8d889d8d8e21,
``rllm/trainer/algorithms/rl_algo.py`` ``calculate_pkpo_advantages_per_group``; rLLM's config key is
``algorithm.pass_at_k``, default 1; here it is ``k``). The paper's leave-one-out baseline variants
(s^(loo), s^(loo-1)) are not in the reference and not offered here; neither is a std normalisation
(the reference has none).

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions, or over the
mask = 1 positions with ``sum_rewards_over_mask``), ``mask`` [B, T]. Output: advantages [B, T]; no
returns (rLLM returns the advantages twice), no metrics.

Math, per prompt group g with n samples and rewards r, k' = min(max(k, 1), n) (the reference clamps k):
    sort the group's rewards ascending: x_1 <= ... <= x_n (1-indexed ranks)
    s_p = [ C(p-1, k'-1) x_p + sum_{q > p} C(q-2, k'-2) x_q ] / C(n, k')
        = (1 / C(n, k')) * sum over the k'-subsets of the group that contain sample p of the subset's max
        (the paper's continuous-reward transformation; for 0/1 rewards it equals Theorem 2's form:
        a correct sample gets k/n, an incorrect one (k/n) rho(n-1, c, k-1), c = the correct count)
    tied rewards share their credit equally: s_p = mean of s over the samples with the same reward
    A_i = s_i - mean_g(s)
    A_{i,t} = A_i * mask_{i,t}
Edge cases (as the reference): a group of one gets 0. k = 1 gives s_i = r_i / n, so A_i = (r_i - mean_g) / n:
the mean-centred reward scaled by 1/n (the estimator is a sum over the group's samples, not a mean).
k >= n gives s_i = max_g for every sample, so A = 0 for the whole group (use k < n for a signal);
k > n is not an error, it is clamped to n per group. k < 1 is INVALID_ARGUMENT on ``config.k``.
Defaults: k = 1.

Kernel: samples sorted within their groups (two stable sorts), the binomials from a table of correctly
rounded values for groups of up to 256 samples (the reference's exact-integer arithmetic, divided by
C(n, k) once at the end) and as log-gamma ratios for larger groups, the suffix sums by a segmented scan within each group (ceil(log2(largest group)) vectorised rounds:
no sum runs across groups, so a small group beside groups of large rewards keeps its float64
precision), the tie and group means by
:func:`~advantage_server.estimators.groups.group_baseline_and_std` (per group, tied values exact),
no loop over groups; k >= n gives exactly 0. :func:`pkpo_loop` is the per-group loop twin (test oracle)
with exact integer binomials.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from advantage_server.estimators.groups import (
    exclude_empty_field, group_baseline_and_std, group_index, groups_of, segmented_discounted_returns,
)
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.estimators.rewards import outcome_scores, sum_over_mask_field
from advantage_client.layout import BROADCAST_TIMES_MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class PKPOConfig(EstimatorConfig):
    k: int = field(default=1, metadata={
        "doc": "The k of pass@k the transformation targets (rLLM algorithm.pass_at_k). Clamped to the group "
               "size n per group as rLLM does; k >= n gives a group 0; k = 1 is the mean-centred reward / n.",
        "range": (1, None)})
    exclude_empty_responses: bool = exclude_empty_field()
    sum_rewards_over_mask: bool = sum_over_mask_field()


def _log_comb(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log C(a, b), valid) elementwise for float64 ``a``, ``b``; ``valid`` is ``a >= b >= 0`` (else C = 0)."""
    valid = (b >= 0) & (a >= b)
    a_, b_ = torch.where(valid, a, 0.0), torch.where(valid, b, 0.0)
    return torch.lgamma(a_ + 1) - torch.lgamma(b_ + 1) - torch.lgamma(a_ - b_ + 1), valid


#: largest group whose binomials come from :func:`_comb_table` (larger groups: log-gamma ratios)
_COMB_TABLE_MAX = 256


@functools.cache
def _comb_table(device: str) -> torch.Tensor:
    """float64 ``[M + 1, M + 1]`` on ``device`` (M = :data:`_COMB_TABLE_MAX`): ``C(a, b)`` correctly rounded
    from the exact integer (``math.comb``; exact below 2^53), 0 for b > a. Built once per device (20 ms)."""
    m = _COMB_TABLE_MAX
    return torch.tensor([[float(math.comb(a, b)) for b in range(m + 1)] for a in range(m + 1)],
                        dtype=torch.float64, device=device)


def _table_comb(table: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``C(a, b)`` elementwise from :func:`_comb_table` for int64 ``a``, ``b`` <= its size (0 unless
    ``a >= b >= 0``)."""
    valid = (b >= 0) & (a >= b)
    m = table.shape[0] - 1
    got = table[a.clamp(0, m), b.clamp(0, m)]
    return torch.where(valid, got, torch.zeros_like(got))


def sort_within_groups(group: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, rank, size)``: ``order`` [B] sorts the batch by group, then by ascending ``s`` (index order
    among ties); ``rank`` [B] (int64, 0-based) and ``size`` [B] (int64) are each sorted sample's position in
    its group and its group's size."""
    by_value = torch.sort(s, stable=True).indices
    order = by_value[torch.sort(group[by_value], stable=True).indices]
    g = group[order]
    counts = torch.zeros(int(group.max()) + 1 if group.numel() else 0, dtype=torch.int64,
                         device=group.device).index_add_(0, group, torch.ones_like(group))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(g.shape[0], device=g.device) - starts[g]
    return order, rank, counts[g]


def pkpo_scalars(group: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per-sample PKPO advantage, float64 ``[B]`` (see the module docstring). ``group``: [B] int64 group
    ids (any values; equal ids = one group); ``scores``: [B] rewards; ``k`` >= 1.

    Every sum is within one group (a segmented scan, per-group and per-tie-run means), so a group's
    values never pass through running totals of other groups; a group with k >= n, or with all its
    credits equal, gets exactly 0."""
    s = scores.to(torch.float64)
    B = s.shape[0]
    if B == 0:
        return s
    group = group_index(group)  # dense 0..G-1 (the group statistics' id range)
    order, rank, size = sort_within_groups(group, s)
    x = s[order]
    n = size.to(torch.float64)
    p = rank.to(torch.float64)  # 0-based rank
    kk = torch.clamp(torch.full_like(n, float(k)), min=1.0, max=None).minimum(n)
    pos = torch.arange(B, device=s.device)
    last = pos - rank + size - 1  # index of the group's last sorted sample
    largest = int(size.max())
    if largest <= _COMB_TABLE_MAX:
        # binomials from a table of correctly rounded values (exact up to 2^53), divided once at the end:
        # credit_p = (C(p, k-1) x_p + sum_{q > p} C(q-1, k-2) x_q) / C(n, k)
        table = _comb_table(str(s.device))
        ki = kk.to(torch.int64)
        own = _table_comb(table, rank, ki - 1) * x
        w = _table_comb(table, rank - 1, ki - 2) * x
        den = _table_comb(table, size, ki)
    else:
        # the sample as the subset max: C(p, k-1) subsets of smaller samples, over C(n, k) (log-gamma)
        log_cnk, _ = _log_comb(n, kk)
        log_self, ok_self = _log_comb(p, kk - 1)
        own = torch.where(ok_self, torch.exp(log_self - log_cnk), 0.0) * x
        # the sample as a non-max member of a subset whose max is the q-th sample (q > p): C(q-1, k-2) each
        log_w, ok_w = _log_comb(p - 1, kk - 2)
        w = torch.where(ok_w, torch.exp(log_w - log_cnk), 0.0) * x
        den = None
    # sum_{q > p} w_q within the group: a segmented suffix scan over the group's own samples only
    upto = segmented_discounted_returns(w, last, 1.0)  # sum_{p <= q <= last} w_q
    after = torch.where(pos < last, upto[(pos + 1).clamp(max=B - 1)], 0.0)
    credit = own + after if den is None else (own + after) / den
    # ties: samples with the same reward in a group share their credit equally (the run's mean; a run of
    # equal credits keeps that credit exactly)
    g = group[order]
    new_run = torch.ones(B, dtype=torch.bool, device=s.device)
    new_run[1:] = (g[1:] != g[:-1]) | (x[1:] != x[:-1])
    run = torch.cumsum(new_run, 0) - 1
    credit, _ = group_baseline_and_std(run, credit, leave_one_out=False)
    mean, _ = group_baseline_and_std(g, credit, leave_one_out=False)  # a tied group: its credit exactly
    adv_sorted = torch.where((size > 1) & (kk < n), credit - mean, 0.0)  # k >= n: every credit is the max
    return torch.empty_like(adv_sorted).scatter_(0, order, adv_sorted)


def pkpo_loop(group: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Loop twin of :func:`pkpo_scalars` (test oracle): one group at a time, the sorted-rank formula with
    exact integer binomials (``math.comb``), ties averaged, centred on the group mean."""
    s = scores.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    out = [0.0] * len(s)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        n = len(members)
        if n < 2:
            continue
        kk = max(1, min(k, n))
        ranked = sorted(members, key=lambda i: s[i])
        total = math.comb(n, kk)
        credit = {}
        for p, i in enumerate(ranked, start=1):  # 1-based rank
            c = math.comb(p - 1, kk - 1) * s[i] if p - 1 >= kk - 1 else 0.0
            for q in range(p + 1, n + 1):
                if kk >= 2 and q - 2 >= kk - 2:
                    c += math.comb(q - 2, kk - 2) * s[ranked[q - 1]]
            credit[i] = c / total
        for i in members:
            tied = [j for j in members if s[j] == s[i]]
            out[i] = sum(credit[j] for j in tied) / len(tied)
        mean = sum(out[i] for i in members) / n
        for i in members:
            out[i] -= mean
    return torch.tensor(out, dtype=torch.float64)


@register("pkpo", config=PKPOConfig, inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK],
          reference="arXiv:2505.15201; rLLM PR #743 calculate_pkpo_advantages_per_group (commit 6b3b2da5)",
          per_sample=(("", BROADCAST_TIMES_MASK),),
          group_local=("",))  # statistics of the prompt group only
def pkpo(cfg: PKPOConfig, batch: Batch) -> AdvantageResult:
    """PKPO pass@k advantage: each sample's unbiased pass@k credit minus its prompt group's mean credit.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T]. Returns advantages [B, T] (0 where mask = 0).
    Raises INVALID_ARGUMENT on ``config.k`` for k < 1 (before the kernel runs).
    """
    rewards, mask = batch["rewards"], batch["mask"]
    group, _ = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own (A = 0 there)
    scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
    adv = pkpo_scalars(group, scores, cfg.k)
    return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(rewards.dtype))
