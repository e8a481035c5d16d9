"""Building blocks shared by several estimators: per-prompt group statistics, KL estimators, whitening.

Each vectorized kernel has a readable loop twin (``*_loop``) used as the test oracle.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.registry import EstimatorConfig, InputSpec

# --------------------------------------------------------------------------- shared input specs
MASK = InputSpec(
    "mask", ("[B, T]",), "mask",
    "Token mask over the sequence: 1 where a token is a trained response token, 0 for prompt, "
    "padding and tool-output holes. Defines B and T.",
    fix="send the [B, T] response/token mask",
)
PROMPT_IDS = InputSpec(
    "prompt_ids", ("[B]", "[B, L]"), "integer",
    "Group of each sample: [B] integer group ids, or [B, L] prompt token rows (equal rows = same group).",
    fix="send the prompt of each sample as a group id ([B]) or its token row ([B, L])",
)
REWARDS = InputSpec(
    "rewards", ("[B]",), "float", "Scalar reward of each sample.",
    fix="send one reward per sample",
)

_KL_NEEDED = (lambda cfg: cfg.use_kl_in_reward, "use_kl_in_reward = true")
KL_INPUTS = [
    InputSpec(
        "logprobs", ("[B, T]",), "float", "Per-token log-probabilities of the current policy.",
        required=False, required_when=_KL_NEEDED,
        fix="send the policy logprobs, or set use_kl_in_reward = false",
    ),
    InputSpec(
        "reference_logprobs", ("[B, T]",), "float", "Per-token log-probabilities of the reference policy.",
        required=False, required_when=_KL_NEEDED,
        fix="send the reference policy logprobs, or set use_kl_in_reward = false",
    ),
]


@dataclass(frozen=True)
class KLInRewardConfig(EstimatorConfig):
    """The KL-in-reward fields, with NeMo RL's loss-config names and defaults."""

    use_kl_in_reward: bool = field(default=False, metadata={"doc": "Subtract penalty * KL(policy || reference) from every token's reward."})
    reference_policy_kl_penalty: float = field(default=0.01, metadata={"doc": "KL coefficient.", "range": (0.0, None)})
    reference_policy_kl_type: str = field(default="k3", metadata={"doc": "KL estimator: k1, k2 or k3 (Schulman 2020)."})
    kl_input_clamp_value: float = field(default=20.0, metadata={"doc": "Clamp the log ratio to +-this before the KL estimator.", "range": (0.0, None)})
    kl_output_clamp_value: float = field(default=10.0, metadata={"doc": "Clamp the KL estimate to +-this.", "range": (0.0, None)})

    def validate(self) -> None:
        super().validate()
        if self.reference_policy_kl_type not in ("k1", "k2", "k3"):
            raise InvalidInput("config.reference_policy_kl_type",
                               f"{self.reference_policy_kl_type!r} is not a KL estimator; use k1, k2 or k3")


# --------------------------------------------------------------------------- KL
def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kl_type: str,
               input_clamp: float, output_clamp: float) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (Schulman 2020, http://joschu.net/blog/kl-approx.html).

    With r = clamp(reference_logprobs - logprobs, +-input_clamp):
    k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r; the estimate is clamped to +-output_clamp.
    """
    r = (reference_logprobs - logprobs).clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -r
    elif kl_type == "k2":
        kl = 0.5 * r * r
    else:  # k3, validated by the config
        kl = torch.expm1(r) - r
    return kl.clamp(-output_clamp, output_clamp)


def apply_kl(token_rewards: torch.Tensor, cfg, batch) -> torch.Tensor:
    """``token_rewards - penalty * KL`` when the config folds KL into the reward, else unchanged."""
    if not cfg.use_kl_in_reward or cfg.reference_policy_kl_penalty == 0:
        return token_rewards
    kl = kl_penalty(batch["logprobs"], batch["reference_logprobs"], cfg.reference_policy_kl_type,
                    cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
    return token_rewards - cfg.reference_policy_kl_penalty * kl


# --------------------------------------------------------------------------- masked whitening
def masked_moments(x: torch.Tensor, mask: torch.Tensor, count_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of ``x`` over positions where ``mask`` is 1, accumulated in float64.

    ``count_floor`` keeps the division finite when the mask is empty (mean 0, variance 0 then).
    Returns two 0-d tensors in ``x.dtype``.
    """
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    count = m.sum()
    denom = torch.clamp(count, min=count_floor)
    mean = (xd * m).sum() / denom
    var = ((xd - mean).square() * m).sum() / denom
    return mean.to(x.dtype), var.to(x.dtype)


# --------------------------------------------------------------------------- per-prompt groups
def group_index(prompt_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` ids or ``[B, L]`` token rows -> ``[B]`` int64 group index in ``0..G-1`` (sorted order)."""
    if prompt_ids.dim() == 2:
        return torch.unique(prompt_ids, dim=0, return_inverse=True)[1]
    # sort-and-rank instead of torch.unique: no device-to-host sync on a GPU
    ordered, perm = torch.sort(prompt_ids, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    rank = torch.cumsum(starts, 0) - 1
    return torch.empty_like(rank).scatter_(0, perm, rank)


def group_baseline_and_std(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std of its prompt group, as float64 ``[B]`` tensors.

    group:   ``[B]`` int64 in ``0..G-1``; rewards: ``[B]`` float.
    Without leave-one-out the baseline is the group mean and std the group's sample std (n - 1).
    With leave-one-out (RLOO, arXiv:2402.14740) both are over the *other* members of the group:
    baseline_i = mean_{j != i} r_j, std_i = sample std of {r_j : j != i} (0 when fewer than 2 others).
    A group of one gets baseline = its own reward and std 0 (advantage 0), as in NeMo RL.

    Numerics: float64, two-pass (mean, then centred sum of squares), leave-one-out statistics by
    Welford-style removal. A group whose rewards are all equal gets its common value as baseline
    exactly, so its advantage is exactly 0 (no float cancellation noise).
    """
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


def group_relative(group: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool, normalize: bool,
                   epsilon: float = 1e-6) -> torch.Tensor:
    """GRPO advantage per sample, float64 ``[B]``: (r - baseline), divided by (std + epsilon) where std > 0."""
    baseline, std = group_baseline_and_std(group, rewards, leave_one_out)
    adv = rewards.to(torch.float64) - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + epsilon), adv)
    return adv
