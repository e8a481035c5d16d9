"""Multi-turn (tool-integrated) optimal token baseline: OTB with each row's valid tokens compacted.

Reference: verl ``compute_multi_turn_optimal_token_baseline_advantage`` (registered in verl as
``tir_optimal_token_baseline``). Inputs, outputs and the per-token terms G (returns), w and W are those of
:mod:`advantage_server.estimators.optimal_token_baseline`; what differs is the alignment:

    k(i, t)  = number of mask = 1 positions of row i before t       (the k-th valid token of the row)
    B_{g,k}  = sum_{i in g} G_{i,t_i(k)} W_{i,t_i(k)} / (sum_{i in g} W_{i,t_i(k)} + epsilon)
               over the members i that have a k-th valid token (t_i(k) its position)
    A_{i,t}  = (G_{i,t} - B_{g(i),k(i,t)}) m_{i,t}

so the k-th assistant token of every row shares one baseline whatever the length of the tool-output
holes before it. Rows with no valid token are left out of their group (their advantages are 0); a
group with one remaining row has B = 0. ``handle_zero_tail`` (default true): when a group's longest
row is unique, its baseline is 0 from valid-token index (second-longest length) on. Defaults:
epsilon = 1e-8. Where the denominator is exactly 0 (impossible for W >= 0) the baseline is 0.

Kernel: the valid tokens are packed to the left with one scatter (as the GAE kernel does), the
baseline is computed on the packed grid with the OTB group sums and gathered back; no loop over rows,
groups or steps. :func:`tir_otb_loop` is the row-by-row loop twin (test oracle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.estimators.optimal_token_baseline import (
    OTB_INPUTS, group_baseline, otb_loop, otb_terms, zero_tail,
)
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, register


@dataclass(frozen=True)
class TIROptimalTokenBaselineConfig(EstimatorConfig):
    handle_zero_tail: bool = field(default=True, metadata={
        "doc": "Zero the baseline of a group's unique longest row from the second-longest row's length on "
               "(in valid-token index)."})
    epsilon: float = field(default=1e-8, metadata={"doc": "Added to the baseline's denominator.", "range": (0.0, None)})


def pack_left(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid entries to the left (zeros after them); also return each position's rank."""
    B, T = x.shape
    rank = torch.cumsum(valid.long(), 1) - valid.long()
    slot = torch.where(valid, rank, torch.full_like(rank, T))
    out = torch.zeros(B, T + 1, dtype=x.dtype, device=x.device).scatter_(1, slot, torch.where(valid, x, 0))
    return out[:, :T], rank


def tir_otb_loop(group, rewards, mask, logprobs, sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon):
    """Row-by-row loop twin of the ``tir_optimal_token_baseline`` kernel (test oracle): (advantages, returns)."""
    _, G = otb_loop(group, rewards, mask, logprobs, sum_pi_squared, rollout_is_weights, False, epsilon)
    m = mask.to(torch.float64)
    B, T = m.shape
    w = 1 - 2 * torch.exp(logprobs.to(torch.float64)) + sum_pi_squared.to(torch.float64)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(torch.float64) ** 2
    W = torch.cumsum(w * m, dim=-1)
    lengths = [int(m[i].sum()) for i in range(B)]
    width = max(lengths) if lengths else 0
    Wc = torch.zeros(B, width, dtype=torch.float64)
    Gc = torch.zeros(B, width, dtype=torch.float64)
    for i in range(B):
        sel = m[i].bool()
        Wc[i, :lengths[i]] = W[i, sel]
        Gc[i, :lengths[i]] = G[i, sel]
    base = torch.zeros(B, width, dtype=torch.float64)
    for gid in sorted(set(group.tolist())):
        rows = [i for i in range(B) if int(group[i]) == gid and lengths[i] > 0]
        if len(rows) < 2:
            continue
        for k in range(width):
            num = sum(float(Gc[i, k] * Wc[i, k]) for i in rows)
            den = sum(float(Wc[i, k]) for i in rows) + epsilon
            for i in rows:
                base[i, k] = num / den if den != 0 else 0.0
        if handle_zero_tail:
            ls = sorted(lengths[i] for i in rows)
            longest = [i for i in rows if lengths[i] == ls[-1]]
            if len(longest) == 1 and ls[-1] > ls[-2]:
                base[longest[0], ls[-2]:] = 0.0
    adv = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        sel = m[i].bool()
        adv[i, sel] = Gc[i, :lengths[i]] - base[i, :lengths[i]]
    return adv * m, G


@register("tir_optimal_token_baseline", config=TIROptimalTokenBaselineConfig, inputs=OTB_INPUTS,
          reference="verl compute_multi_turn_optimal_token_baseline_advantage; optimal baseline, Weaver & Tao (UAI 2001)",
          produces_returns=True)
def tir_optimal_token_baseline(cfg: TIROptimalTokenBaselineConfig, batch: Batch) -> AdvantageResult:
    """Optimal token baseline aligned on each row's k-th valid token (tool-output holes compacted).

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask, logprobs, sum_pi_squared [B, T], optional
    rollout_is_weights [B, T]. Returns advantages [B, T] (0 where mask = 0) and returns [B, T].
    """
    dtype = batch["rewards"].dtype
    group = batch["prompt_ids"]
    G, W, m = otb_terms(batch)
    valid = m.bool()
    Gc, rank = pack_left(G, valid)
    Wc, _ = pack_left(W, valid)
    lengths = m.sum(-1)
    member = lengths > 0
    in_row = torch.arange(G.shape[1], device=G.device)[None, :] < lengths[:, None]
    base = group_baseline(group, Gc, Wc, in_row.to(torch.float64), member, cfg.epsilon)
    if cfg.handle_zero_tail:
        base = zero_tail(base, group, lengths, member)
    adv_c = Gc - base
    adv = adv_c.gather(1, rank.clamp(max=G.shape[1] - 1))
    return AdvantageResult((adv * m).to(dtype), returns=G.to(dtype))
