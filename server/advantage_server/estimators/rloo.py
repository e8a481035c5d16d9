"""RLOO, REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

Inputs: ``prompt_ids`` [B] (or [B, L]), ``rewards`` [B] or [B, T] (summed over all T positions), ``mask``
[B, T]; ``logprobs`` and ``reference_logprobs`` [B, T] when ``use_kl_in_reward`` (KL_t as in
reinforce_plus_plus).

Math, per sample i of a prompt group of n samples:
    a_i = s_i - (sum_{j != i} s_j) / (n - 1)  =  (s_i - mean_g) * n / (n - 1)

``semantics = verl`` (default; verl ``compute_rloo_outcome_advantage``). No returns (verl returns the
advantages twice).
    s_i = r_i - penalty * sum_t KL_t mask_t; a group of one keeps a = s (baseline 0);
    A_{i,t} = a_i * mask_{i,t}.
    verl's ``rloo_vectorized`` computes the same numbers except for a group of one, which it gives 0.
``semantics = openrlhf`` (OpenRLHF 0.11.2 ``rloo``). Returns G.
    s_i = r_i; a group of one keeps a = s (baseline 0; OpenRLHF divides by n - 1 = 0 there);
    a_i clamped to [reward_clip_min, reward_clip_max] (OpenRLHF's ``--reward.clip_range``, default +-10) on the row's last mask = 1 position
    minus penalty * KL_t * mask_t, G = reverse cumulative sum (gamma 1), A = G (OpenRLHF 0.11.2 does not
    whiten rloo advantages; releases that did are not reproduced).
``semantics = skyrl`` (SkyRL 0.4.0 ``compute_rloo_outcome_advantage``). No returns.
    verl's rule (s = sum over all T of the token rewards, minus penalty * sum_t KL_t mask_t with
    use_kl_in_reward: SkyRL's trainer subtracts the masked KL from the rewards in ``apply_reward_kl_penalty``
    before the estimator; not part of the differential tests), except that a group of one gets
    0 (SkyRL logs a warning and sets it to 0); SkyRL's (s_i - mean) * n / (n - 1) is the same number.
``semantics = trl`` (TRL 1.16.0 ``RLOOTrainer._generate_and_score_completions``). No returns.
    s_i = clamp(r_i, reward_clip_min, reward_clip_max) (TRL's ``reward_clip_range``; an unset end: no clamp
    there) minus penalty * sum_t KL_t mask_t with use_kl_in_reward (TRL's ``beta``; its KL is k1 without clamps,
    the defaults of ``reference_policy_kl_type`` and the KL clamps under trl).
    ``exclude_empty_responses`` does not apply (TRL scores an all-0 mask row like any other). A NaN reward is an
    unscorable completion (TRL: every reward function returned None): it is left out of its group, and its advantage
    is 0. The baseline is the mean of the group's *other scorable* members; a row with none (the only scorable one
    of its group, or a group of one) has no advantage. With ``normalize_advantages`` the advantages that exist
    are standardised over the whole batch: (a - mean) / (std + 1e-4), std with Bessel's correction (no
    advantage with fewer than two of them). Rows without an advantage get 0. Broadcast over every column
    (TRL's advantage is one number per sequence, applied whatever its completion mask).

Numerics: the leave-one-out mean is computed in float64 by removal from the group mean
(:func:`~advantage_server.estimators.groups.group_baseline_and_std`), exact when the others are tied.
:func:`rloo_scalars_loop` is the per-group loop twin (test oracle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.groups import (
    broadcast_rows, group_baseline_and_std, group_sizes, exclude_empty_field, groups_of, zero_rows,
)
from advantage_server.estimators.inputs import MASK, PROMPT_IDS
from advantage_server.estimators.kl import KL_INPUTS, KLInRewardConfig, kl_total
from advantage_server.estimators.rewards import (
    OPENRLHF_REWARD_CLIP, OpenRLHFRewardConfig, openrlhf_outcome, outcome_scores, sum_over_mask_field,
)
from advantage_client.layout import BROADCAST, BROADCAST_TIMES_MASK, UP_TO_LAST_VALID
from advantage_server.estimators.registry import (
    AdvantageResult, Batch, EstimatorConfig, InputSpec, register, semantics_field,
)


#: TRL 1.16.0 RLOOTrainer's constant added to the batch std when it normalises the advantages
TRL_NORMALIZE_EPSILON = 1e-4


@dataclass(frozen=True)
class RLOOConfig(KLInRewardConfig, OpenRLHFRewardConfig):
    semantics: str | None = semantics_field(
        ("verl", "openrlhf", "skyrl", "trl"),
        "Reference reproduced: verl (compute_rloo_outcome_advantage), openrlhf (rloo), skyrl "
        "(compute_rloo_outcome_advantage), trl (RLOOTrainer).")
    # not under trl: TRL scores a completion whose mask is all 0 (mask_truncated_completions) like any other; its
    # unscorable completions are NaN rewards
    exclude_empty_responses: bool | None = exclude_empty_field({"verl": False, "openrlhf": False, "skyrl": False})
    sum_rewards_over_mask: bool | None = sum_over_mask_field({"verl": False})
    # OpenRLHF's --reward.clip_range (default +-10), or TRL's reward_clip_range (default: none)
    reward_clip_min: float | None = field(default=None, metadata={
        "doc": "Low end of the reward clamp: OpenRLHF --reward.clip_range (openrlhf), TRL reward_clip_range (trl; "
               "an unset end: no clamp there).", "per_semantics": {"openrlhf": -OPENRLHF_REWARD_CLIP, "trl": None},
        "default_text": "-10.0 (openrlhf); none (trl); not applicable otherwise"})
    reward_clip_max: float | None = field(default=None, metadata={
        "doc": "High end of the reward clamp: OpenRLHF --reward.clip_range (openrlhf), TRL reward_clip_range (trl).",
        "per_semantics": {"openrlhf": OPENRLHF_REWARD_CLIP, "trl": None},
        "default_text": "10.0 (openrlhf); none (trl); not applicable otherwise"})
    # KL in the reward: NeMo RL's defaults (k3, clamps 20 and 10), TRL's under trl (k1, no clamp)
    reference_policy_kl_type: str | None = field(default=None, metadata={
        "doc": "KL estimator: k1, k2 or k3 (Schulman 2020).", "enum": "KLType", "choices": ("k1", "k2", "k3"),
        "per_semantics": {"verl": "k3", "openrlhf": "k3", "skyrl": "k3", "trl": "k1"},
        "default_text": "k3 (verl, openrlhf, skyrl); k1 (trl: RLOOTrainer's log-prob difference)"})
    kl_input_clamp_value: float | None = field(default=None, metadata={
        "doc": "Clamp the log ratio to +-this before the KL estimator.", "range": (0.0, None),
        "per_semantics": {"verl": 20.0, "openrlhf": 20.0, "skyrl": 20.0, "trl": None},
        "default_text": "20.0 (verl, openrlhf, skyrl); none (trl)"})
    kl_output_clamp_value: float | None = field(default=None, metadata={
        "doc": "Clamp the KL estimate to +-this.", "range": (0.0, None),
        "per_semantics": {"verl": 10.0, "openrlhf": 10.0, "skyrl": 10.0, "trl": None},
        "default_text": "10.0 (verl, openrlhf, skyrl); none (trl)"})
    normalize_advantages: bool | None = field(default=None, metadata={
        "doc": "TRL RLOOConfig.normalize_advantages: standardise the advantages over the batch, "
               "(a - mean) / (std + 1e-4). trl only.",
        "per_semantics": {"trl": False}, "default_text": "false (trl); not applicable otherwise"})

    def validate(self) -> None:
        if self.semantics != "trl":
            super().validate()
            return
        # TRL's own rules: a clamp end may be None (torch's clamp), min <= max is not asserted (min == max is a
        # constant reward)
        lo, hi = self.reward_clip_min, self.reward_clip_max
        if lo is not None and hi is not None and lo > hi:
            raise InvalidInput("config.reward_clip_min", f"must be at most reward_clip_max, got {lo} and {hi} "
                                                         "(TRL's reward_clip_range is (min, max))")
        EstimatorConfig.validate(self)


def rloo_scalars(group: torch.Tensor, scores: torch.Tensor, single: str = "keep") -> torch.Tensor:
    """Per-sample ``s_i - mean of the others``, float64 ``[B]``; a group of one keeps ``s``
    (``single = "keep"``) or gets 0 (``single = "zero"``, SkyRL's rule)."""
    s = scores.to(torch.float64)
    baseline, _ = group_baseline_and_std(group, s, leave_one_out=True)
    return torch.where(group_sizes(group) > 1, s - baseline, s if single == "keep" else torch.zeros_like(s))


def rloo_scalars_loop(group: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Loop twin of :func:`rloo_scalars` (test oracle)."""
    s = scores.to(torch.float64).cpu().tolist()
    g = group.cpu().tolist()
    out = list(s)
    for gid in set(g):
        members = [i for i, x in enumerate(g) if x == gid]
        if len(members) == 1:
            continue
        for i in members:
            others = [s[j] for j in members if j != i]
            base = others[0] if all(v == others[0] for v in others) else sum(others) / len(others)
            out[i] = s[i] - base
    return torch.tensor(out, dtype=torch.float64)


#: OUTCOME_REWARDS, where NaN is TRL's unscorable completion under semantics = trl
REWARDS = InputSpec(
    "rewards", ("[B]", "[B, T]"), "float",
    "Reward of each sample [B], or token-level rewards [B, T] (verl's token_level_rewards), summed over all T "
    "positions (masked ones included, as verl does). With semantics = trl a NaN reward is an unscorable "
    "completion (TRL: every reward function returned None); +-infinity is accepted where TRL's reward_clip_range "
    "clamps it (reward_clip_max set: +inf; reward_clip_min set: -inf).",
    fix="send one reward per sample [B], or token-level rewards [B, T]",
    nan_allowed_when=(lambda cfg: cfg.semantics == "trl", "semantics = trl"),
    inf_allowed_when=(lambda cfg: (cfg.semantics == "trl" and cfg.reward_clip_max is not None,
                                   cfg.semantics == "trl" and cfg.reward_clip_min is not None),
                      "semantics = trl and reward_clip_max (+inf) / reward_clip_min (-inf) set"))


@register("rloo", config=RLOOConfig, inputs=[PROMPT_IDS, REWARDS, MASK, *KL_INPUTS],
          reference="arXiv:2402.14740; verl compute_rloo_outcome_advantage; OpenRLHF rloo; TRL RLOOTrainer",
          produces_returns=(lambda cfg: cfg.semantics == "openrlhf", "semantics = openrlhf"),
          # openrlhf: a on the last valid token, reverse cumsum (returns = advantages); KL makes it per token
          per_sample=(("semantics = verl or semantics = skyrl", BROADCAST_TIMES_MASK),
                      ("semantics = openrlhf and use_kl_in_reward = false", UP_TO_LAST_VALID),
                      ("semantics = trl", BROADCAST)),
          # leave-one-out means within the group; KL and returns per row; trl's normalize_advantages is batch-wide
          group_local=("semantics = verl or semantics = openrlhf or semantics = skyrl or "
                       "semantics = trl and normalize_advantages = false",))
def rloo(cfg: RLOOConfig, batch: Batch) -> AdvantageResult:
    """Reward minus the mean reward of the other samples of the same prompt.

    Inputs: prompt_ids [B], rewards [B] or [B, T] (NaN: unscorable, trl only), mask [B, T]; logprobs and
    reference_logprobs [B, T] when use_kl_in_reward. Returns advantages [B, T]; returns [B, T] under openrlhf
    semantics; no metrics.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    group, keep = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own
    dtype = rewards.dtype
    if cfg.semantics == "trl":
        return AdvantageResult(broadcast_rows(trl_rloo(cfg, batch, group), batch.B, batch.T, dtype, batch))
    if cfg.semantics in ("verl", "skyrl"):
        scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
        a = rloo_scalars(group, scores - kl_total(cfg, batch, mask), "keep" if cfg.semantics == "verl" else "zero")
        return AdvantageResult((a[:, None] * mask.to(torch.float64)).to(dtype))
    adv, returns = openrlhf_outcome(zero_rows(rloo_scalars(group, outcome_scores(rewards)), keep), mask, cfg, batch,
                                    whiten=False)
    return AdvantageResult(zero_rows(adv, keep).to(dtype), returns=returns.to(dtype))


def trl_rloo(cfg: RLOOConfig, batch: Batch, group: torch.Tensor) -> torch.Tensor:
    """TRL 1.16.0 ``RLOOTrainer``'s per-sequence advantages, float64 ``[B]`` (``semantics = trl`` in the module
    docstring): scorable rows only in the leave-one-out means, optional batch standardisation, 0 where TRL's
    NaN is zeroed."""
    rewards, mask = batch["rewards"], batch["mask"]
    scores = outcome_scores(rewards)  # NaN: unscorable
    if cfg.reward_clip_min is not None or cfg.reward_clip_max is not None:
        scores = cfg.clip(scores)  # TRL clamps the summed reward before the KL (an end may be open); NaN stays NaN
    scores = scores - kl_total(cfg, batch, mask)
    scorable = ~torch.isnan(scores)
    a = torch.zeros_like(scores)
    defined = torch.zeros_like(scorable)
    if bool(scorable.any()):
        _, members = torch.unique(group[scorable], return_inverse=True)  # the scorable rows' groups, 0..G'-1
        a[scorable] = rloo_scalars(members, scores[scorable], "zero")
        defined[scorable] = group_sizes(members) > 1  # the only scorable row of its group: TRL's 0 / 0
    if cfg.normalize_advantages:
        values = a[defined]
        if values.numel() < 2:  # TRL's Bessel factor count / (count - 1) makes these NaN, then 0
            return torch.zeros_like(a)
        a = (a - values.mean()) / (values.std() + TRL_NORMALIZE_EPSILON)
    return torch.where(defined, a, torch.zeros((), dtype=a.dtype, device=a.device))


def trl_rloo_loop(prompt_ids, rewards, kl=None, clip=None, normalize=False) -> list[float]:
    """Loop twin of :func:`trl_rloo` (test oracle): one group and one row at a time in Python floats.
    rewards: per-row floats (NaN: unscorable); kl: per-row penalty * sum_t KL_t mask_t (None: 0);
    clip: (lo, hi) or None."""
    s = [float(r) for r in rewards]
    if clip is not None:
        s = [x if x != x else min(max(x, clip[0]), clip[1]) for x in s]
    if kl is not None:
        s = [x - float(k) for x, k in zip(s, kl)]
    a: list[float | None] = [None] * len(s)
    for gid in set(prompt_ids):
        members = [i for i, g in enumerate(prompt_ids) if g == gid and s[i] == s[i]]
        for i in members:
            others = [s[j] for j in members if j != i]
            if others:
                a[i] = s[i] - sum(others) / len(others)
    if normalize:
        d = [x for x in a if x is not None]
        if len(d) < 2:
            return [0.0] * len(s)
        mean = sum(d) / len(d)
        std = (sum((x - mean) ** 2 for x in d) / (len(d) - 1)) ** 0.5
        a = [None if x is None else (x - mean) / (std + TRL_NORMALIZE_EPSILON) for x in a]
    return [0.0 if x is None else x for x in a]
