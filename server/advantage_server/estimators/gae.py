"""Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438) with carry-forward masking.

Math, per row, over the positions where mask = 1 only (prompt tokens, padding and tool-output holes are
skipped: the recursion jumps over them, NeMo RL's "carry-forward" masking):
    delta_t = r_t + gamma * V_next(t) - V_t          V_next(t) = value at the next valid position,
                                                      or bootstrap_values (default 0) after the last one
    A_t     = delta_t + gamma * lambda * A_next(t)
At a masked position the advantage carries the value of the next valid position (0 after the last).
Token rewards r: a [B] terminal reward sits on the last mask = 1 position of its row; a [B, T] reward
is used per step. With use_kl_in_reward, -penalty * KL_t is added at every token. Rewards at masked
positions are ignored.

Lambdas (VAPO decoupled GAE, arXiv:2504.05118): returns use gae_lambda_value (default gae_lambda);
advantages use length_adaptive_alpha's per-row lambda 1 - 1/max(alpha * len, 1) if alpha > 0, else
gae_lambda_policy, else gae_lambda.

Outputs: returns = A(lambda_value) + values at every position (un-whitened); advantages =
A(lambda_policy), whitened over the valid tokens when normalize_advantages
((A - mu) / sqrt(var + 1e-8), mu and var the masked mean and unbiased variance; with a single valid
token the variance is taken as 0 where NeMo RL divides by zero), then set to 0 where mask = 0. An all-zero mask row gets advantages 0 and returns = values + bootstrap carry.

Kernel: the valid positions of each row are packed to the left (one scatter), the recursion becomes a
constant-coefficient discounted reverse cumulative sum, computed in blocks of ``_CHUNK`` steps as a
small matrix product per block, with block carries solved by the same routine on the coarser grid
(recursively: log-depth, no per-step loop). :func:`gae_loop` is the per-step loop twin (test oracle).
Reference: NeMo RL ``GeneralizedAdvantageEstimator``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.estimators.common import KL_INPUTS, MASK, KLInRewardConfig, apply_kl, masked_moments
from advantage_server.estimators.registry import AdvantageResult, Batch, InputSpec, register

_CHUNK = 64


@dataclass(frozen=True)
class GAEConfig(KLInRewardConfig):
    gae_lambda: float = field(default=0.95, metadata={"doc": "GAE lambda.", "range": (0.0, 1.0)})
    gae_gamma: float = field(default=1.0, metadata={"doc": "Discount factor gamma.", "range": (0.0, 1.0)})
    normalize_advantages: bool = field(default=True, metadata={"doc": "Whiten the advantages over the valid tokens."})
    gae_lambda_value: float | None = field(default=None, metadata={"doc": "Lambda for the returns (VAPO); unset = gae_lambda.", "range": (0.0, 1.0)})
    gae_lambda_policy: float | None = field(default=None, metadata={"doc": "Lambda for the advantages (VAPO); unset = gae_lambda.", "range": (0.0, 1.0)})
    length_adaptive_alpha: float = field(default=0.0, metadata={"doc": "Per-row lambda_policy = 1 - 1/max(alpha*len, 1); 0 = off.", "range": (0.0, None)})


# --------------------------------------------------------------------------- kernel
def discounted_reverse_cumsum(d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``A_j = sum_{k >= j} g^(k - j) d_k`` along the last axis.

    d: ``[B, N]``; g: ``[B]`` discount per row (0 <= g <= 1). Returns ``[B, N]`` in d's dtype.
    Blocks of ``_CHUNK`` positions are solved with one batched matmul against the Toeplitz matrix
    ``W[k, j] = g^(j - k)`` (j >= k); the value entering each block from the right solves the same
    problem on the block grid with discount ``g^_CHUNK``.
    """
    B, N = d.shape
    C = min(_CHUNK, N)
    nc = -(-N // C)
    if nc * C != N:
        d = torch.nn.functional.pad(d, (0, nc * C - N))
    x = d.view(B, nc, C)
    steps = torch.arange(C, device=d.device)
    lag = steps[None, :] - steps[:, None]                                     # [C, C]: j - k
    gb = g.to(d.dtype)[:, None, None]
    W = torch.where(lag >= 0, gb ** lag.clamp(min=0).to(d.dtype), torch.zeros((), dtype=d.dtype, device=d.device))
    local = torch.matmul(x, W.transpose(1, 2))                                # [B, nc, C]
    if nc > 1:
        starts = discounted_reverse_cumsum(local[:, :, 0], g.to(d.dtype) ** C)  # A at each block start
        carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))                # value entering block i
        decay = gb[:, :, 0] ** (C - steps).to(d.dtype)                        # [B, C]: g^(C - k)
        local = local + carry[:, :, None] * decay[:, None, :]
    return local.reshape(B, nc * C)[:, :N]


def gae_kernel(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
               lam: float | torch.Tensor, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """GAE advantages ``[B, T]`` with carry-forward masking (see module docstring).

    token_rewards, values: ``[B, T]`` float; mask: ``[B, T]`` 0/1; lam: float or ``[B]``;
    bootstrap: ``[B]`` value after each row's last valid step, or None for 0.
    """
    B, T = values.shape
    dt = values.dtype
    valid = mask.bool()
    n_valid = valid.sum(1)                                                    # [B]
    before = torch.cumsum(valid, 1) - valid.long()                            # valid positions before t
    trash = T + 1
    slot = torch.where(valid, before, torch.full_like(before, trash))
    packed_r = torch.zeros(B, T + 2, dtype=dt, device=values.device)
    packed_v = torch.zeros(B, T + 2, dtype=dt, device=values.device)
    packed_r.scatter_(1, slot, torch.where(valid, token_rewards, 0))
    packed_v.scatter_(1, slot, torch.where(valid, values, 0))
    if bootstrap is not None:
        packed_v.scatter_(1, n_valid[:, None], bootstrap.to(dt)[:, None])
    in_row = torch.arange(T, device=values.device)[None, :] < n_valid[:, None]
    delta = torch.where(in_row, packed_r[:, :T] + gamma * packed_v[:, 1:T + 1] - packed_v[:, :T], 0)
    g = gamma * (lam if isinstance(lam, torch.Tensor) else torch.full((B,), lam, dtype=dt, device=values.device))
    adv_packed = torch.nn.functional.pad(discounted_reverse_cumsum(delta, g), (0, 1))  # A after the end = 0
    return adv_packed.gather(1, before)


def gae_loop(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
             lam: float | torch.Tensor, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """Per-step loop twin of :func:`gae_kernel` (test oracle), backwards over t like the paper's recursion."""
    B, T = values.shape
    next_value = torch.zeros(B, dtype=values.dtype) if bootstrap is None else bootstrap.to(values.dtype).clone()
    running = torch.zeros(B, dtype=values.dtype)
    out = torch.zeros_like(values)
    for t in reversed(range(T)):
        m = mask[:, t].bool()
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        running = torch.where(m, candidate, running)
        next_value = torch.where(m, values[:, t], next_value)
        out[:, t] = running
    return out


def token_level_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` terminal rewards -> ``[B, T]`` with each reward on its row's last mask = 1 position.

    ``[B, T]`` per-step rewards pass through. Rows with no valid position get no reward.
    """
    if rewards.dim() == 2:
        return rewards * mask
    B, T = mask.shape
    valid = mask.bool()
    last = T - 1 - valid.flip(1).int().argmax(1)                              # last valid index per row
    out = torch.zeros(B, T, dtype=rewards.dtype, device=rewards.device)
    out.scatter_(1, last[:, None], torch.where(valid.any(1), rewards, 0)[:, None])
    return out


@register(
    "gae", config=GAEConfig,
    inputs=[
        InputSpec("rewards", ("[B]", "[B, T]"), "float",
                  "[B] terminal reward (placed on the last mask = 1 position) or [B, T] per-step rewards.",
                  fix="send one reward per sample, or per-step rewards [B, T]"),
        MASK,
        InputSpec("values", ("[B, T]",), "float", "Critic value estimate V(s_t) at every position.",
                  fix="gae needs per-token `values`: enable the critic, or choose an estimator without a value "
                      "model (grpo, reinforce_plus_plus, raw_reward)"),
        InputSpec("bootstrap_values", ("[B]",), "float",
                  "Value of the state after each row's last step, for rows cut before their episode ended "
                  "(time limit, end of rollout); 0 = the episode terminated.", required=False),
        *KL_INPUTS,
    ],
    reference="arXiv:1506.02438; VAPO arXiv:2504.05118; NeMo RL GeneralizedAdvantageEstimator",
    produces_returns=True,
)
def gae(cfg: GAEConfig, batch: Batch) -> AdvantageResult:
    """Generalized Advantage Estimation with carry-forward masking, decoupled and length-adaptive lambda.

    Inputs: rewards [B] or [B, T], mask [B, T], values [B, T], optional bootstrap_values [B]; logprobs
    and reference_logprobs [B, T] when use_kl_in_reward. Returns advantages [B, T] (0 where mask = 0)
    and returns [B, T]; no metrics.
    """
    mask, values = batch["mask"], batch["values"]
    bootstrap = batch.get("bootstrap_values")
    rewards = apply_kl(token_level_rewards(batch["rewards"], mask), cfg, batch) * mask
    lam_value = cfg.gae_lambda if cfg.gae_lambda_value is None else cfg.gae_lambda_value
    if cfg.length_adaptive_alpha > 0:
        lengths = mask.sum(1)
        lam_policy = (1.0 - 1.0 / (cfg.length_adaptive_alpha * lengths).clamp(min=1.0)).clamp(0.0, 1.0)
    else:
        lam_policy = cfg.gae_lambda if cfg.gae_lambda_policy is None else cfg.gae_lambda_policy
    adv_value = gae_kernel(rewards, values, mask, cfg.gae_gamma, lam_value, bootstrap)
    if isinstance(lam_policy, float) and lam_policy == lam_value:
        advantages = adv_value
    else:
        advantages = gae_kernel(rewards, values, mask, cfg.gae_gamma, lam_policy, bootstrap)
    returns = adv_value + values
    if cfg.normalize_advantages:
        mean, var = masked_moments(advantages, mask, count_floor=1.0)
        n = mask.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), var)  # unbiased, as NeMo RL; one token: 0
        advantages = (advantages - mean) * torch.rsqrt(var + 1e-8)
    return AdvantageResult(torch.where(mask.bool(), advantages, 0), returns=returns)
