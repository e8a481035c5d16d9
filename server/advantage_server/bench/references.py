"""The comparison points: estimators written the straightforward published way, and the vectorized peer.

These are the benchmark's own code (not copied from any project): the per-time-step GAE loop that
verl, OpenRLHF and NeMo RL write (one step of the recursion per Python iteration, over ``[B]``
vectors), the per-prompt GRPO loop (one boolean mask per prompt, NeMo RL's
``calculate_baseline_and_std_per_prompt`` pattern), and the same per-prompt loops under GDPO and
Reinforce++. Each follows our estimator's semantics for its default config, so the benchmark can
also report how far our kernel is from it numerically.

The peer is torchrl's ``vec_generalized_advantage_estimate``; where torchrl is not installed,
:func:`vec_gae_conv` is the same published algorithm (the discounted sum as a 1-D convolution with
the geometric filter ``(gamma * lambda)^k``, truncated where it falls below 1e-7).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


# ----------------------------------------------------------------------------------------- GAE
def gae_per_step_loop(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                      lam: float) -> torch.Tensor:
    """GAE advantages ``[B, T]``, one time step per iteration, masked steps skipped (carry-forward)."""
    B, T = values.shape
    next_value = torch.zeros(B, dtype=values.dtype)
    last_gae = torch.zeros(B, dtype=values.dtype)
    steps = []
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * m + (1 - m) * next_value
        last_gae = gae_t * m + (1 - m) * last_gae
        steps.append(last_gae)
    return torch.stack(steps[::-1], dim=1)


def vec_gae_conv(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor, gamma: float,
                 lam: float, thr: float = 1e-7) -> torch.Tensor:
    """Vectorized GAE over full rows (no mask): td errors convolved with the truncated geometric filter."""
    B, T = values.shape
    td = rewards + gamma * next_values - values
    gl = gamma * lam
    if gl <= 0:
        return td
    L = T if gl >= 1 else max(1, min(T, int(torch.log(torch.tensor(thr)) / torch.log(torch.tensor(gl))) + 1))
    filt = gl ** torch.arange(L, dtype=values.dtype)
    padded = torch.nn.functional.pad(td[:, None, :], (0, L - 1))
    return torch.nn.functional.conv1d(padded, filt[None, None, :])[:, 0, :]


def torchrl_peer() -> tuple[str, Callable[..., torch.Tensor]]:
    """(label, fn(rewards, values, gamma, lam) -> advantages [B, T]) for full rows: torchrl's vectorized
    GAE where torchrl is installed, else :func:`vec_gae_conv`. The inputs torchrl needs besides
    (next values, done flags) are built outside the timed call."""
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
    except Exception:  # torchrl absent, or not importable next to this torch
        def own(prepared: dict[str, Any]) -> torch.Tensor:
            return vec_gae_conv(prepared["r"], prepared["v"], prepared["nv"], prepared["gamma"], prepared["lam"])

        return "peer: vectorized GAE (torchrl's algorithm, own code; torchrl not installed)", own

    def peer(prepared: dict[str, Any]) -> torch.Tensor:
        adv, _ = vec_generalized_advantage_estimate(
            prepared["gamma"], prepared["lam"], prepared["v3"], prepared["nv3"], prepared["r3"],
            prepared["done"], prepared["done"], time_dim=-2)
        return adv[..., 0]

    return "peer: torchrl vec_generalized_advantage_estimate", peer


def prepare_peer(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> dict[str, Any]:
    """The peer's inputs for full rows ending in a terminal step (not timed)."""
    B, T = values.shape
    nv = torch.nn.functional.pad(values[:, 1:], (0, 1))
    done = torch.zeros(B, T, 1, dtype=torch.bool)
    done[:, -1] = True
    return {"r": rewards, "v": values, "nv": nv, "gamma": gamma, "lam": lam, "done": done,
            "r3": rewards[..., None], "v3": values[..., None], "nv3": nv[..., None]}


# ------------------------------------------------------------------------------------ groups
def per_prompt_baseline_std(prompt_ids: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt baseline and sample std, one prompt per iteration (a boolean mask over the batch each)."""
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for pid in torch.unique(prompt_ids):
        members = prompt_ids == pid
        r = rewards[members]
        n = r.numel()
        if n <= 1:
            baseline[members] = r
            continue
        if leave_one_out:
            b = (r.sum() - r) / (n - 1)
            if n > 2:
                sq = r.square().sum() - r.square()
                s = ((sq - (n - 1) * b.square()) / (n - 2)).clamp(min=0).sqrt()
            else:
                s = torch.zeros_like(r)
        else:
            b = r.mean().expand(n)
            s = r.std().expand(n)
        baseline[members] = b
        std[members] = s
    return baseline, std


def grpo_per_prompt_loop(prompt_ids: torch.Tensor, rewards: torch.Tensor, T: int, leave_one_out: bool = True,
                         normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (leave-one-out baseline, std normalisation where std > 0) -> dense ``[B, T]``."""
    baseline, std = per_prompt_baseline_std(prompt_ids, rewards, leave_one_out)
    adv = rewards - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv[:, None].expand(-1, T).contiguous()


def gdpo_per_prompt_loop(prompt_ids: torch.Tensor, components: list[torch.Tensor], T: int) -> torch.Tensor:
    """GDPO: per-component GRPO (loops as above), summed, standardised over the batch -> ``[B, T]``."""
    total = torch.zeros_like(components[0])
    for r in components:
        baseline, std = per_prompt_baseline_std(prompt_ids, r, leave_one_out=True)
        a = r - baseline
        total = total + torch.where(std > 0, a / (std + 1e-6), a)
    centred = total - total.mean()
    s = total.std()
    adv = centred / s if s > 0 else centred
    return adv[:, None].expand(-1, T).contiguous()


def reinforce_pp_per_prompt_loop(prompt_ids: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reinforce++ with the per-prompt mean baseline (loop), then masked whitening over the tokens."""
    baseline, _ = per_prompt_baseline_std(prompt_ids, rewards, leave_one_out=False)
    adv = (rewards - baseline)[:, None].expand_as(mask)
    n = mask.sum().clamp(min=1)
    mean = (adv * mask).sum() / n
    var = ((adv - mean).square() * mask).sum() / n
    return (adv - mean) * torch.rsqrt(var.clamp(min=1e-8))


def opd_straightforward(teacher: torch.Tensor, prev: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list]:
    """On-policy distillation as written in the reference: masked gap, then masked mean/std metrics."""
    gap = teacher - prev
    adv = gap * mask
    n = mask.sum()
    gap_mean = (gap * mask).sum() / n.clamp(min=1)
    adv_mean = (adv * mask).sum() / n.clamp(min=1)
    adv_std = (((adv - adv_mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)).sqrt()
    return adv, [float(gap_mean), float(adv_mean), float(adv_std)]
