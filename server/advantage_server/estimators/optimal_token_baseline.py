"""Optimal token baseline (OTB): a per-timestep, variance-weighted baseline from the prompt group.

Reference: verl ``compute_optimal_token_baseline_advantage``: the variance-minimising baseline
E[G W] / E[W] of policy-gradient theory (Weaver & Tao, "The optimal reward baseline for gradient-based
reinforcement learning", UAI 2001), taken per token with a cumulative path-variance proxy as the weight W.
Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] (placed on the row's last mask = 1 position) or
[B, T] token-level rewards, ``mask`` [B, T], ``logprobs`` [B, T] (verl ``old_log_probs``: log pi of the
sampled token), ``sum_pi_squared`` [B, T] (sum over the vocabulary of pi^2), optional
``rollout_is_weights`` [B, T] (truncated importance weights rho).
Output: advantages [B, T] and returns [B, T]; no metrics.

Math, per row i and position t (m = mask):
    G_{i,t} = sum_{k >= t} r_{i,k} m_{i,k}                              (reward-to-go; the returns)
    w_{i,t} = (1 - 2 exp(logprobs_{i,t}) + sum_pi_squared_{i,t}) * rho_{i,t}^2   (rho = 1 when not sent)
    W_{i,t} = sum_{j <= t} w_{i,j} m_{i,j}                              (cumulative path-variance proxy)
    B_{g,t} = sum_{i in g} G_{i,t} W_{i,t} m_{i,t} / (sum_{i in g} W_{i,t} m_{i,t} + epsilon)
    A_{i,t} = (G_{i,t} - B_{g(i),t}) m_{i,t}
The baseline is aligned on absolute position t. A group of one has B = 0 (A = G on its valid tokens);
rows with no valid token still count as group members. ``handle_zero_tail`` (default true, as verl
0.9.1's function, whose trainer never passes it): when a group's longest row (by sum of mask) is
unique, its baseline is 0 from position ``second-longest length`` on (verl compares that length with
the absolute position). Defaults: epsilon = 1e-8.
Where sum W m + epsilon is exactly 0 (only possible with inputs outside their real range, W >= 0)
the baseline is 0 instead of verl's division by zero.

The multi-turn variant (``tir_optimal_token_baseline``) shares these kernels: see
:mod:`advantage_server.estimators.tir_optimal_token_baseline`.

Kernel: group sums over ``[B, T]`` by ``index_add`` (float64), zero-tail rows by per-group scatter
reductions; no loop over groups or steps. :func:`otb_loop` is the per-group loop twin (test oracle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.estimators.groups import exclude_empty_field
from advantage_server.estimators.inputs import MASK, PROMPT_IDS, TOKEN_REWARDS
from advantage_server.estimators.rewards import place_rewards, reverse_cumsum
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, InputSpec, register


@dataclass(frozen=True)
class OptimalTokenBaselineConfig(EstimatorConfig):
    handle_zero_tail: bool = field(default=True, metadata={
        "doc": "Zero the baseline of a group's unique longest row from the second-longest row's length on "
               "(verl 0.9.1's default)."})
    epsilon: float = field(default=1e-8, metadata={"doc": "Added to the baseline's denominator.", "range": (0.0, None)})
    exclude_empty_responses: bool = exclude_empty_field(
        extra=" Here: the empty row is not a group member (the sums are over valid tokens already, so "
              "what changes is the group size: a row whose peers are all empty gets baseline 0); with "
              "handle_zero_tail = true that row's baseline is 0 anyway. tir_optimal_token_baseline always "
              "leaves such rows out.")


OTB_INPUTS = [
    PROMPT_IDS, TOKEN_REWARDS, MASK,
    InputSpec("logprobs", ("[B, T]",), "float",
              "Log-probability of each sampled token under the rollout policy (verl old_log_probs).",
              fix="send the rollout policy's per-token logprobs"),
    InputSpec("sum_pi_squared", ("[B, T]",), "float",
              "Sum over the vocabulary of the squared token probabilities at each position.",
              fix="compute sum(softmax(logits)^2) per position in the actor (verl actor.calculate_sum_pi_squared)"),
    InputSpec("rollout_is_weights", ("[B, T]",), "float",
              "Truncated importance weights of the rollout; w is scaled by their square.", required=False),
]


def otb_terms(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(returns G, cumulative weights W, mask m), float64 ``[B, T]`` each, from the batch."""
    mask = batch["mask"]
    m = mask.to(torch.float64)
    G = reverse_cumsum(place_rewards(batch["rewards"], mask).to(torch.float64) * m)
    w = 1.0 - 2.0 * torch.exp(batch["logprobs"].to(torch.float64)) + batch["sum_pi_squared"].to(torch.float64)
    isw = batch.get("rollout_is_weights")
    if isw is not None:
        w = w * isw.to(torch.float64).square()
    return G, torch.cumsum(w * m, dim=-1), m


def group_baseline(group: torch.Tensor, G: torch.Tensor, W: torch.Tensor, valid: torch.Tensor,
                   member: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``B_{g,t} = sum G W valid / (sum W valid + eps)`` over the members of each row's group, float64
    ``[B, T]`` per row; 0 for rows whose group has one member (``member``: ``[B]`` bool, rows counted)."""
    memb = member.to(torch.float64)[:, None]
    num = torch.zeros_like(G).index_add_(0, group, G * W * valid * memb)
    den = torch.zeros_like(G).index_add_(0, group, W * valid * memb) + epsilon
    base = torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(den))
    n = torch.zeros(G.shape[0], dtype=torch.float64, device=G.device).index_add_(0, group, memb[:, 0])
    return torch.where((n[group] > 1)[:, None], base[group], torch.zeros_like(G))


def zero_tail(baseline: torch.Tensor, group: torch.Tensor, lengths: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """Zero the baseline of each group's unique longest member from index (second-longest length) on."""
    B, T = baseline.shape
    L = torch.where(member, lengths.to(torch.float64), torch.full_like(lengths, -1, dtype=torch.float64))
    longest = torch.full((B,), -1.0, dtype=torch.float64, device=L.device).scatter_reduce_(0, group, L, "amax")
    at_max = member & (L == longest[group])
    n_max = torch.zeros(B, dtype=torch.float64, device=L.device).index_add_(0, group, at_max.to(torch.float64))
    second = torch.full_like(longest, -1.0).scatter_reduce_(0, group, torch.where(at_max, -1.0, L), "amax")
    n = torch.zeros(B, dtype=torch.float64, device=L.device).index_add_(0, group, member.to(torch.float64))
    unique = at_max & (n_max[group] == 1) & (n[group] > 1)
    cut = torch.arange(T, device=L.device)[None, :] >= second[group][:, None]
    return torch.where(unique[:, None] & cut, torch.zeros_like(baseline), baseline)


def otb_loop(group, rewards, mask, logprobs, sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon):
    """Per-group loop twin of the ``optimal_token_baseline`` kernel (test oracle): (advantages, returns)."""
    m = mask.to(torch.float64)
    r = place_rewards(rewards, mask).to(torch.float64) * m
    B, T = m.shape
    G = torch.zeros(B, T, dtype=torch.float64)
    for t in reversed(range(T)):
        G[:, t] = r[:, t] + (G[:, t + 1] if t + 1 < T else 0.0)
    w = 1 - 2 * torch.exp(logprobs.to(torch.float64)) + sum_pi_squared.to(torch.float64)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(torch.float64) ** 2
    W = torch.zeros(B, T, dtype=torch.float64)
    acc = torch.zeros(B, dtype=torch.float64)
    for t in range(T):
        acc = acc + w[:, t] * m[:, t]
        W[:, t] = acc
    base = torch.zeros(B, T, dtype=torch.float64)
    for gid in sorted(set(group.tolist())):
        rows = [i for i in range(B) if int(group[i]) == gid]
        if len(rows) == 1:
            continue
        for t in range(T):
            num = sum(float(G[i, t] * W[i, t] * m[i, t]) for i in rows)
            den = sum(float(W[i, t] * m[i, t]) for i in rows) + epsilon
            for i in rows:
                base[i, t] = num / den if den != 0 else 0.0
        if handle_zero_tail:
            lengths = sorted(float(m[i].sum()) for i in rows)
            longest = [i for i in rows if float(m[i].sum()) == lengths[-1]]
            if len(longest) == 1 and lengths[-1] > lengths[-2]:
                base[longest[0], int(lengths[-2]):] = 0.0
    return (G - base) * m, G


@register("optimal_token_baseline", config=OptimalTokenBaselineConfig, inputs=OTB_INPUTS,
          reference="verl compute_optimal_token_baseline_advantage; optimal baseline, Weaver & Tao (UAI 2001)",
          produces_returns=True)
def optimal_token_baseline(cfg: OptimalTokenBaselineConfig, batch: Batch) -> AdvantageResult:
    """Reward-to-go minus a per-timestep baseline weighted by each row's cumulative path variance.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask, logprobs, sum_pi_squared [B, T], optional
    rollout_is_weights [B, T]. Returns advantages [B, T] (0 where mask = 0) and returns [B, T].
    """
    dtype = batch["rewards"].dtype
    group = batch["prompt_ids"]
    G, W, m = otb_terms(batch)
    everyone = torch.ones(G.shape[0], dtype=torch.bool, device=G.device)
    if cfg.exclude_empty_responses:  # empty rows are not members: group sizes and zero tails without them
        everyone = m.sum(-1) > 0
    base = group_baseline(group, G, W, m, everyone, cfg.epsilon)
    if cfg.handle_zero_tail:
        base = zero_tail(base, group, m.sum(-1), everyone)
    return AdvantageResult(((G - base) * m).to(dtype), returns=G.to(dtype))
