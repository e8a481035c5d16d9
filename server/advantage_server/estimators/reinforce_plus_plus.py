"""Reinforce++ (Hu et al. 2025, arXiv:2501.03262).

Inputs: ``rewards`` [B] or [B, T], ``mask`` [B, T]; ``prompt_ids`` [B] when ``minus_baseline``
(nemo_rl); ``logprobs`` and ``reference_logprobs`` [B, T] when ``use_kl_in_reward``.
KL_t = the k1/k2/k3 estimate of KL(policy || reference) (clamped as configured), penalty =
``reference_policy_kl_penalty``.

``semantics = nemo_rl`` (default; NeMo RL ``ReinforcePlusPlusAdvantageEstimator``). No returns.
    a_i      = r_i - mean of prompt group (``minus_baseline``, default true; a group of one gets 0), else r_i
               (a [B, T] reward is summed over T first)
    A_{i,t}  = a_i - penalty * KL_t                  (``use_kl_in_reward``)
    A        = (A - mu) / sqrt(max(var, 1e-8))       mu, biased var over the tokens where mask = 1
    The whitening is applied at every position, masked ones included (as NeMo RL does). With no valid
    token at all, mu = var = 0 (NeMo raw_reward's count floor of 1), so A = a * 1e4: finite where the
    reference divides by zero.
``semantics = verl`` (verl 0.9.1 ``compute_reinforce_plus_plus_outcome_advantage``). Returns G.
    r_t      = token reward ([B] placed on the row's last mask = 1 position) - penalty * KL_t * mask_t
    G_t      = (r_t + gamma * G_{n(t)}) * mask_t      n(t): the next mask = 1 position after t (G = 0 past
               the row's last one). The running return is carried across mask = 0 spans (tool-output holes)
               undiscounted, rewards on mask = 0 positions are dropped, and the returns are 0 there
               (verl PR #7300, in verl 0.9).
    A        = (G - mu) * rsqrt(var + 1e-8) * mask   mu, unbiased var over the n mask = 1 tokens (verl
               masked_whiten). One valid token: var = 0 (A = 0); none: mu = var = 0 (verl raises there).
    ``reset_returns_at_holes = true`` (verl 0.8 and earlier): G_t = r_t + gamma * mask_{t+1} * G_{t+1}
    at every position, i.e. a mask = 0 position cuts the return (holes reset it) and the returns are not
    masked.
``semantics = openrlhf`` (OpenRLHF 0.11.2 ``reinforce``). Returns G.
    r_t      = (token reward - penalty * KL_t) * mask_t, the token reward clamped to +-10 (OpenRLHF's
               default ``--reward.clip_range``; a [B] reward on the row's last mask = 1 position)
    G_t      = sum_{k >= t} gamma^(k - t) r_k        (no resets)
    A        = (G - mu) / sqrt(max(var, 1e-8))       mu, biased var over the mask = 1 tokens, every position
``semantics = skyrl`` (SkyRL 0.4.0 ``compute_reinforce_plus_plus_outcome_advantage``, ported from verl 0.8).
    Returns G. verl 0.8's rule, always (``reset_returns_at_holes`` does not apply): token rewards ([B] on the
    row's last mask = 1 position; a [B, T] reward as sent, masked positions included), minus the masked KL
    penalty with use_kl_in_reward (SkyRL's trainer, ``apply_reward_kl_penalty``, before the estimator),
    G_t = r_t + gamma * mask_{t+1} * G_{t+1} at every position (returns not masked), A = (G - mu) *
    rsqrt(var + 1e-8) * mask with mu and the unbiased var over the mask = 1 tokens (SkyRL's
    ``masked_whiten``: its masked_mean divides by max(n, 1), which is verl's n; one valid token: var = 0,
    A = 0; none: mu = var = 0, where SkyRL raises).
``semantics = slime`` (slime's ``reinforce_plus_plus``: the trainer's ``compute_advantages_and_returns`` with
    ``get_reinforce_plus_plus_returns``). Returns G (unwhitened).
    r_t      = -penalty * KL_t * mask_t, plus the [B] reward on the row's last mask = 1 position (slime asserts
               that every row has one; here a row without one gets only its KL terms)
    G_t      = sum_{k >= t} gamma^(k - t) r_k   over the whole row (no resets; the returns are not masked)
    A        = G, whitened over the mask = 1 tokens of the batch with ``normalize_advantages`` (slime requires
               ``--normalize-advantages`` for this estimator, so it defaults to true here;
               :func:`~advantage_server.estimators.whitening.whiten_slime`).
    KL: slime's ``compute_approx_kl``: k1 by default, no clamps (its ``low_var_kl`` is k3 with
    ``kl_output_clamp_value = 10``). No reward clamp.
``semantics = roll`` (ROLL's ``adv_estimator = reinforce`` and ``step_reinforce``, which its RLVR
    ``compute_advantage`` treats alike; alibaba/ROLL main@8eb27cc2, ``roll/utils/functionals.py``): the step of
    :mod:`~advantage_server.estimators.roll` with ``norm_mean_type`` / ``norm_std_type`` (unset: none, ROLL's
    default), returns G_t = sum_{k >= t} gamma^(k - t) r_k of the masked token rewards over every column, advantages
    = G whitened with ``normalize_advantages`` (ROLL's ``whiten_advantages``, default false), times the mask,
    clamped to +-``advantage_clip``. KL: ROLL's ``kl_penalty`` (k1 by default, no clamps; abs offered). Returns: G.
    ROLL's agentic ``agentic_compute_advantage`` (``roll/pipeline/agentic/utils.py``) is the same step for its
    reinforce, grpo, step_reinforce and gigpo (from its token rewards). ``segment_returns = true`` is its
    ``agentic_reinforce`` (``compute_agentic_reinforce_return``): G is one value per run of consecutive mask = 1
    positions (a turn), G = r_e + gamma * G of the next run with r_e the token reward at the run's last position
    (the run's other token rewards are not read), 0 on mask = 0 positions (:func:`segment_returns`); the
    advantages as above.
``gamma`` (verl, openrlhf, skyrl, slime, roll) defaults to 1.0 (SkyRL's ``algorithm.gamma``); ``minus_baseline`` applies to
nemo_rl only.

Kernel: nemo_rl without KL on the CPU whitens the per-row values with per-row valid counts (no [B, T]
float64 temporaries; :func:`~advantage_server.estimators.whitening.whiten_rows_clamped`). The verl 0.9
recursion packs each row's mask = 1 rewards to the left, takes their discounted reverse cumulative sum
and gathers it back (float64, no per-step loop); the verl 0.8 one (and skyrl's) is a reverse scan of the
affine steps ``G_t = r_t + c_t G_{t+1}`` (c_t = gamma * mask_{t+1}) by doubling (log2 T passes
over [B, T]), which adds only terms of the same segment: a reward-free segment before a hole keeps its own
returns (its KL penalty) next to a huge reward, where the difference of two cumulative sums lost them.
:func:`verl_returns_loop` is the per-step loop twin of both (test oracle).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from advantage_server.estimators import jit, roll
from advantage_server.estimators.groups import (
    broadcast_rows, exclude_empty_field, exclude_rows, group_relative, nonempty_rows, zero_rows,
)
from advantage_server.estimators.inputs import MASK, PROMPT_IDS
from advantage_server.estimators.kl import KL_INPUTS, KLInRewardConfig, apply_kl, kl_clamp_field, kl_type_field
from advantage_server.estimators.rewards import OpenRLHFRewardConfig, no_std_norm_field, outcome_scores, place_rewards
from advantage_server.estimators.whitening import (
    slime_whiten_field, whiten_clamped, whiten_openrlhf, whiten_rows_clamped, whiten_slime, whiten_unbiased,
)
from advantage_server.estimators.gae import discounted_reverse_cumsum
from advantage_client.layout import BROADCAST
from advantage_server.estimators.registry import AdvantageResult, Batch, InputSpec, register, semantics_field


@dataclass(frozen=True)
class ReinforcePlusPlusConfig(KLInRewardConfig, OpenRLHFRewardConfig, roll.RollStepConfig):
    minus_baseline: bool | None = field(default=None, metadata={
        "doc": "Subtract the per-prompt mean reward. nemo_rl only (use reinforce_plus_plus_baseline otherwise).",
        "per_semantics": {"nemo_rl": True}, "default_text": "true (nemo_rl); not applicable otherwise"})
    semantics: str | None = semantics_field(
        ("nemo_rl", "verl", "openrlhf", "skyrl", "slime", "roll"),
        "Reference reproduced: nemo_rl (NeMo RL ReinforcePlusPlusAdvantageEstimator), verl "
        "(compute_reinforce_plus_plus_outcome_advantage), openrlhf (reinforce), skyrl "
        "(compute_reinforce_plus_plus_outcome_advantage, verl 0.8's reset at holes), slime "
        "(reinforce_plus_plus: get_reinforce_plus_plus_returns), roll (RLVR reinforce / step_reinforce: "
        "reward_postprocess, compute_token_reward and compute_advantage).")
    gamma: float | None = field(default=None, metadata={
        "doc": "Discount of the returns.", "range": (0.0, 1.0),
        "per_semantics": {"verl": 1.0, "openrlhf": 1.0, "skyrl": 1.0, "slime": 1.0, "roll": 1.0},
        "default_text": "1.0 (verl, openrlhf, skyrl, slime, roll); not applicable to nemo_rl"})
    norm_mean_type: str | None = roll.norm_field("mean")
    norm_std_type: str | None = roll.norm_field("std")
    # KL in the reward: NeMo RL's defaults (k3, clamps 20 and 10), slime's compute_approx_kl under slime
    reference_policy_kl_type: str | None = kl_type_field(("nemo_rl", "verl", "openrlhf", "skyrl"), ("slime", "roll"))
    kl_input_clamp_value: float | None = kl_clamp_field("input", 20.0, ("nemo_rl", "verl", "openrlhf", "skyrl"),
                                                        ("slime", "roll"))
    kl_output_clamp_value: float | None = kl_clamp_field("output", 10.0, ("nemo_rl", "verl", "openrlhf", "skyrl"),
                                                         ("slime", "roll"))
    normalize_advantages: bool | None = slime_whiten_field(default=True, roll=True)
    reset_returns_at_holes: bool | None = field(default=None, metadata={
        "doc": "verl 0.8 and earlier: a mask = 0 position inside the response resets the running return, and the "
               "returns there are not zeroed. verl 0.9.1 (the default) carries the return across mask = 0 spans.",
        "per_semantics": {"verl": False}, "default_text": "false (verl); not applicable otherwise"})
    exclude_empty_responses: bool | None = exclude_empty_field(
        {"nemo_rl": False}, extra=" nemo_rl: the row is left out of the minus_baseline group mean and its "
                                  "whitened advantage is 0.")
    no_std_norm: bool | None = no_std_norm_field()
    segment_returns: bool | None = roll._roll(
        "ROLL's agentic adv_estimator = agentic_reinforce (compute_agentic_reinforce_return, "
        "roll/pipeline/agentic/utils.py): one return per run of consecutive mask = 1 positions (a turn), "
        "G = r_end + gamma * G of the next run, r_end the token reward at the run's last position (the run's other "
        "token rewards are not read), 0 on mask = 0 positions; advantages = G whitened with "
        "normalize_advantages, times the mask, clamped to +-advantage_clip.", False, "false")


_PROMPT_IDS = replace(PROMPT_IDS, required=False,
                      required_when=(lambda cfg: bool(cfg.minus_baseline) or roll.needs_groups(cfg),
                                     "semantics = nemo_rl and minus_baseline = true or semantics = roll and "
                                     "norm_mean_type = group or semantics = roll and norm_std_type = group"),
                      fix=PROMPT_IDS.fix + ", or set minus_baseline = false (roll: no group normalisation)")
_REWARDS = InputSpec(
    "rewards", ("[B]", "[B, T]"), "float",
    "Reward of each sample [B], or token-level rewards [B, T]. nemo_rl sums [B, T] over T; verl and openrlhf "
    "place a [B] reward on the row's last mask = 1 position.",
    fix="send one reward per sample [B], or token-level rewards [B, T]",
)


def verl_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                 reset_at_holes: bool = False) -> torch.Tensor:
    """verl's REINFORCE++ returns, float64 ``[B, T]``, without a per-step loop.

    token_rewards: ``[B, T]`` float; mask: ``[B, T]`` 0/1; gamma in [0, 1].
    verl 0.9.1 (default): ``G_t = (r_t + gamma * G_{n(t)}) * mask_t`` with n(t) the next mask = 1 position
    after t: the row's mask = 1 rewards are packed to the left, their discounted reverse cumulative sum
    taken, and gathered back to their positions (0 where mask = 0).
    ``reset_at_holes`` (verl 0.8): ``G_t = r_t + gamma * mask_{t+1} * G_{t+1}`` (G_T = 0) at every position,
    computed by :func:`segmented_returns` (no subtraction: exact next to huge rewards).
    """
    r = token_rewards.to(torch.float64)
    B, T = r.shape
    if not reset_at_holes:
        g = torch.full((B,), gamma, dtype=torch.float64, device=r.device)
        valid = mask.bool()
        before = torch.cumsum(valid, 1) - valid.long()                    # mask = 1 positions before t
        slot = torch.where(valid, before, torch.full_like(before, T))      # holes go to a trash slot T
        packed = torch.zeros(B, T + 1, dtype=torch.float64, device=r.device)
        packed.scatter_(1, slot, torch.where(valid, r, torch.zeros((), dtype=torch.float64, device=r.device)))
        G = discounted_reverse_cumsum(packed[:, :T], g)
        return torch.where(valid, G.gather(1, before.clamp(max=T - 1)), torch.zeros((), dtype=torch.float64,
                                                                                     device=r.device))
    carry = torch.nn.functional.pad(mask[:, 1:].to(torch.float64), (0, 1)) * gamma  # c_t = gamma * mask_{t+1}
    return segmented_returns(r, carry)


def segmented_returns(r: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    """``G_t = r_t + carry_t * G_{t+1}`` along the last axis (G_T = 0), by recursive doubling.

    r, carry: ``[B, T]`` float64 (carry in [0, 1]; 0 cuts the return after t). Returns ``[B, T]`` float64.
    After the pass with shift s, ``(G_t, C_t)`` is the composition of the affine steps t .. t + 2s - 1
    (C_t their carry product), so log2(T) vectorised passes suffice (any device, no per-step loop). Each G_t
    is a sum of r_k * prod(carry) over its own segment only: no cancellation (verl 0.8 and SkyRL's loop
    give the same sums, in another order).
    """
    T = r.shape[-1]
    G, C = r, carry
    s = 1
    while s < T:
        G = torch.cat([G[:, :T - s] + C[:, :T - s] * G[:, s:], G[:, T - s:]], 1)
        C = torch.cat([C[:, :T - s] * C[:, s:], C[:, T - s:]], 1)
        s *= 2
    return G


def segment_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """ROLL's ``agentic_reinforce`` returns, float64 ``[B, T]``: per row, each run of consecutive mask = 1 positions
    (a turn) gets G = r_e + gamma * G' at all its positions, r_e the token reward at the run's last position e and G'
    the next run's value (0 after the last run); mask = 0 positions get 0.

    The affine reverse scan ``S_t = b_t + c_t S_{t+1}`` with b_t = r_t, c_t = gamma at a run's last position
    (mask_t = 1, mask_{t+1} = 0 or t = T - 1) and b_t = 0, c_t = 1 elsewhere (:func:`segmented_returns`), times the
    mask. :func:`segment_returns_loop` is its per-run loop twin (test oracle)."""
    m = mask.to(torch.float64) != 0
    end = m & ~torch.nn.functional.pad(m[:, 1:], (0, 1))                          # a run's last position
    r = torch.where(end, token_rewards.to(torch.float64), 0.0)
    carry = torch.where(end, torch.full_like(r, gamma), torch.ones_like(r))
    return torch.where(m, segmented_returns(r, carry), 0.0)


def segment_returns_loop(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-row, per-run loop twin of :func:`segment_returns` (test oracle)."""
    r, m = token_rewards.to(torch.float64), mask.to(torch.float64) != 0
    out = torch.zeros_like(r)
    for b in range(r.shape[0]):
        runs, t, T = [], 0, r.shape[1]
        while t < T:
            if m[b, t]:
                s = t
                while t < T and m[b, t]:
                    t += 1
                runs.append((s, t))
            else:
                t += 1
        running = 0.0
        for s, e in reversed(runs):
            running = float(r[b, e - 1]) + gamma * running
            out[b, s:e] = running
    return out


def verl_returns_loop(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                      reset_at_holes: bool = False) -> torch.Tensor:
    """Per-step loop twin of :func:`verl_returns` (test oracle), backwards over t as verl does."""
    r = token_rewards.to(torch.float64)
    m = mask.to(torch.float64)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in reversed(range(r.shape[1])):
        new = r[:, t] + gamma * running
        if reset_at_holes:  # verl 0.8: the return at a hole is kept, and the hole cuts it
            out[:, t] = new
            running = new * m[:, t]
        else:  # verl 0.9: a hole keeps the running return as it is and gets 0
            out[:, t] = new * m[:, t]
            running = torch.where(m[:, t] != 0, new, running)
    return out


@register("reinforce_plus_plus", config=ReinforcePlusPlusConfig,
          inputs=[_PROMPT_IDS, _REWARDS, MASK, *KL_INPUTS, roll.ATTENTION_MASK],
          reference="arXiv:2501.03262; NeMo RL ReinforcePlusPlusAdvantageEstimator; verl "
                    "compute_reinforce_plus_plus_outcome_advantage; OpenRLHF reinforce",
          produces_returns=(lambda cfg: cfg.semantics in ("verl", "openrlhf", "skyrl", "slime", "roll"),
                            "semantics = verl or semantics = openrlhf or semantics = skyrl or semantics = slime or "
                            "semantics = roll"),
          # whitening keeps a row-constant matrix row-constant; the KL penalty is per token
          per_sample=(("semantics = nemo_rl and use_kl_in_reward = false", BROADCAST),))
def reinforce_plus_plus(cfg: ReinforcePlusPlusConfig, batch: Batch) -> AdvantageResult:
    """Reward minus the per-prompt mean (or discounted returns), minus an optional token-level KL, whitened.

    Inputs: prompt_ids [B] (read when minus_baseline), rewards [B] or [B, T], mask [B, T]; logprobs and
    reference_logprobs [B, T] when use_kl_in_reward. Returns advantages [B, T]; returns [B, T] under verl
    and openrlhf semantics; no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    dtype = rewards.dtype
    if cfg.semantics == "nemo_rl":
        scores = outcome_scores(rewards)
        keep = nonempty_rows(mask) if cfg.exclude_empty_responses else None  # empty rows: out of groups, A = 0
        if cfg.minus_baseline:
            group = batch["prompt_ids"] if keep is None else exclude_rows(batch["prompt_ids"], keep)
            a = group_relative(group, scores, leave_one_out=False, normalize=False)
        else:
            a = scores
        kl_active = cfg.use_kl_in_reward and cfg.reference_policy_kl_penalty != 0
        if not kl_active and jit.applies(a, mask):
            # CPU: A is constant along each row, so its masked whitening needs only per-row valid counts
            w = whiten_rows_clamped(jit.numpy_as(a, dtype).astype(np.float64), mask)
            w = zero_rows(torch.from_numpy(w), keep)
            return AdvantageResult(broadcast_rows(w, batch.B, batch.T, dtype, batch))
        a = a.to(dtype)
        adv = apply_kl(a[:, None].expand(batch.B, batch.T), cfg, batch)
        return AdvantageResult(zero_rows(whiten_clamped(adv, mask), keep))
    if cfg.semantics == "roll":  # ROLL's RLVR step (module docstring), discounted returns of its token rewards
        tokens, n = roll.token_rewards(cfg, batch, cfg.norm_mean_type, cfg.norm_std_type)
        if cfg.segment_returns:  # ROLL's agentic_reinforce
            returns = segment_returns(tokens, mask, cfg.gamma)
        else:
            returns = discounted_reverse_cumsum(tokens, torch.full((batch.B,), cfg.gamma, dtype=torch.float64,
                                                                   device=tokens.device))
        return AdvantageResult(roll.finish(returns, mask, n, cfg).to(dtype), returns=returns.to(dtype))
    if cfg.semantics == "openrlhf":
        rewards = cfg.clip(rewards)  # --reward.clip_range
    tokens = apply_kl(place_rewards(rewards, mask).to(torch.float64), cfg, batch, mask=mask)
    if cfg.semantics == "slime":  # the whole row's discounted returns, not masked; A = G, whitened by slime
        g = torch.full((batch.B,), cfg.gamma, dtype=torch.float64, device=mask.device)
        returns = discounted_reverse_cumsum(tokens, g)
        adv = whiten_slime(returns, mask) if cfg.normalize_advantages else returns
        return AdvantageResult(adv.to(dtype), returns=returns.to(dtype))
    if cfg.semantics in ("verl", "skyrl"):  # skyrl: verl 0.8's recursion, always
        reset = cfg.semantics == "skyrl" or bool(cfg.reset_returns_at_holes)
        returns = verl_returns(tokens, mask, cfg.gamma, reset_at_holes=reset)
        adv = whiten_unbiased(returns, mask) * mask
    else:  # openrlhf
        g = torch.full((batch.B,), cfg.gamma, dtype=torch.float64, device=mask.device)
        returns = discounted_reverse_cumsum(tokens * mask, g)
        adv = whiten_openrlhf(returns, mask, cfg.no_std_norm)
    return AdvantageResult(adv.to(dtype), returns=returns.to(dtype))
