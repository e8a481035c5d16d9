"""GRPO: group-relative advantages (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

Inputs: ``prompt_ids`` [B] (or [B, L] token rows), ``rewards`` [B] or [B, T] (token-level rewards are
summed over all T positions, masked ones included), ``mask`` [B, T], optional ``std_rewards`` [B]
(DAPO, arXiv:2503.14476: the std is computed on these values instead of on the rewards).
Output: advantages [B, T]; returns [B, T] under openrlhf and slime semantics only; no metrics.

Math, per sample i of prompt group g (n samples), r = reward, s = the values the std is taken on
(``std_rewards`` when sent, else r), eps = ``epsilon``:

``semantics = nemo_rl`` (default; NeMo RL ``GRPOAdvantageEstimator``)
    baseline_i = mean of the group's rewards (``use_leave_one_out_baseline``, default true: of the others,
    RLOO arXiv:2402.14740); std_i = sample std of s over the same set (0 for fewer than 2);
    A_i = r_i - baseline_i, then A_i / (std_i + eps) where std_i > 0 (``normalize_rewards``).
    A group of one gets 0. A_i is broadcast over every column, masked ones included. eps = 1e-6.
``semantics = verl`` (verl ``compute_grpo_outcome_advantage``; ``normalize_rewards`` is verl's
    ``norm_adv_by_std_in_grpo``, false = Dr. GRPO arXiv:2503.20783)
    A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g; std = sample std of s; a group of one has
    mean 0 and std 1 (so A = r / (1 + eps)). A_{i,t} = A_i * mask_{i,t}. eps = 1e-6. A tied group gets
    0, also with eps = 0, where verl divides 0 by 0 (NaN) or, where its mean misses a non-dyadic tied
    value by an ulp, reports +-sqrt((n - 1) / n) (e.g. -0.8165 for three float64 rewards of 0.1).
    verl's ``grpo_vectorized`` floors the group variance at eps (std >= sqrt(eps)): it differs only for
    groups whose sample variance is below eps without being 0; this estimator follows verl's ``grpo``.
``semantics = openrlhf`` (OpenRLHF 0.11.2 ``group_norm``; ``dr_grpo`` with ``normalize_rewards = false``)
    A_i = (r_i - mean_g) / (std_g + eps), eps = 1e-9, std = sample std of s, clamped to
    [reward_clip_min, reward_clip_max] (OpenRLHF's ``--reward.clip_range``, default +-10; group_norm reaches
    +-10 only from 102 samples a prompt). OpenRLHF puts A_i on the row's last mask = 1 token, minus
    penalty * KL_t on every mask = 1 token with ``use_kl_in_reward`` (``compute_reward``), and takes the
    cumulative return (gamma 1): returns = advantages = G_t = sum_{k >= t} of those token rewards times the
    mask; without KL, A_i for t up to the row's last mask = 1 position and 0 after it (all 0 for a row with no
    valid token). A group of one gets 0 (OpenRLHF divides 0 by a NaN std). Returns: G (openrlhf only).
``semantics = trl`` (TRL 1.16.0 ``GRPOTrainer``, ``multi_objective_aggregation = sum_then_normalize``)
    A_i = (r_i - mean_g) / (std_i + eps), eps = 1e-4 (TRL's constant), std by ``scale_rewards``:
    ``group`` (default) the group's sample std of s (0 for a group of one), ``batch`` the sample std of
    all B values of s (0 for B = 1), ``none`` no division. Broadcast over every column. TRL's
    unscorable completions (every reward function returned None; left out of the group statistics,
    advantage 0) are rows with an all-zero mask under ``exclude_empty_responses = true``.
``semantics = slime`` (slime's ``grpo``, ``gspo`` and ``cispo``, which share their advantages: the rollout's
    ``_post_process_rewards``, then the trainer's ``compute_advantages_and_returns``)
    a_i = (r_i - mean_g) / (std_g + eps) with ``rewards_normalization`` (slime's default; its
    ``--disable-rewards-normalization`` turns it off, and then a_i = r_i), or r_i - mean_g with
    ``normalize_rewards = false`` (slime's ``--disable-grpo-std-normalization``, Dr. GRPO); std = sample std;
    eps = 1e-6. A_{i,t} = a_i at EVERY position of the row (the loss mask is not applied), returns = advantages.
    With ``normalize_advantages`` (slime's ``--normalize-advantages``, default off) the advantages are then
    whitened over the mask = 1 tokens of the batch (:func:`~advantage_server.estimators.whitening.whiten_slime`);
    the returns stay unwhitened. slime groups ``n_samples_per_prompt`` consecutive samples (the whole batch as one
    group when the count differs): send that grouping as ``prompt_ids``. A group of one gets 0 (slime: NaN, the
    std of one value). A tied group gets exactly 0, where slime's float32 mean can miss a non-dyadic tied value by
    an ulp and divides that by (a tiny std + 1e-6): e.g. +0.0596 for seven rewards of 0.7 (as verl's above).
    Returns: a (every position).
``semantics = roll`` (ROLL's ``adv_estimator = grpo`` in its RLVR pipeline, alibaba/ROLL main@8eb27cc2,
    ``roll/utils/functionals.py``; the step is :mod:`~advantage_server.estimators.roll`'s): ROLL forces
    ``norm_mean_type = norm_std_type = group``, so a_i = (r_i - mean_g) / (std_g + 1e-6) (sample std; ``epsilon`` does
    not apply), clamped to +-``reward_clip``, placed on the row's last attended token (``attention_mask``), minus
    penalty * KL_t on the mask = 1 tokens with ``use_kl_in_reward`` (ROLL's ``add_token_level_kl``, its KL
    controller's value as the penalty), clamped again, times the mask; returns G_t = sum_{k >= t} gamma^(k - t) r_k
    over every column (``gamma``, default 1); advantages = G whitened with ``normalize_advantages`` (ROLL's
    ``whiten_advantages``), times the mask, clamped to +-``advantage_clip``. [B, T] rewards are ROLL's
    ``token_level_rewards`` (the step from ``compute_advantage`` on). ``normalize_rewards = false`` is rejected (ROLL
    always divides). Returns: G.
``semantics = skyrl`` (SkyRL 0.4.0 ``compute_grpo_outcome_advantage``; ``normalize_rewards`` is SkyRL's
    ``grpo_norm_by_std``) is verl's code ported unchanged, so it computes verl's numbers above: a [B, T]
    reward summed over all T, a group of one with mean 0 and std 1 (A = r / (1 + eps), 1 + eps in float32),
    eps = 1e-6, A_{i,t} = A_i * mask_{i,t}. ``sum_rewards_over_mask`` is verl's only.
``semantics = prime_rl`` (prime-rl main@559b447, ``src/prime_rl/orchestrator/algo/grpo.py``
    ``GRPOAlgorithm.score_group``, which its ``echo`` inherits; ``hierarchical_grpo.py`` computes the same numbers
    over its peer sets: send one prompt id per peer set, as ``advantage_client.prime_rl`` does)
    A_i = r_i - mean_g, never divided (``normalize_rewards`` and ``epsilon`` are not read: prime-rl has no std).
    With ``length_penalty`` (prime-rl's ``[orchestrator.algo.length_penalty]``, type ``linear``), from the
    inputs ``num_output_tokens`` o, ``num_total_tokens`` n and ``num_turns`` u ([B], the trace's counts) and
    the weights w_o, w_i, w_u (``num_output_tokens_weight`` 0.25, ``num_input_tokens_weight`` 0.1,
    ``num_turns_weight`` 0.1), with i = n - o the input tokens and max_g(x) = max(1, the group's largest x):
    f_i = w_o o_i / max_g(o) + w_i i_i / max_g(i) + w_u u_i / max_g(u); r'_i = r_i - mean_g(r) f_i (the
    unshaped mean: prime-rl's pass rate); A_i = r'_i - mean_g(r'). A_{i,t} = A_i * mask_{i,t} (prime-rl puts the
    value on the sampled tokens only). A group of one and a tied group (without the penalty) get exactly 0.
    prime-rl computes in float32 (it casts the rewards and counts to float32): send float32 rewards for its
    numbers; prime-rl's ``hierarchical_grpo`` keeps Python floats: send float64 there. prime-rl scores only the
    traces ``iter_trainable_traces`` keeps (no error, a trainable agent, a sampled token): send those, or
    send traces without a sampled token as all-zero mask rows with ``exclude_empty_responses``.

Numerics: group statistics in float64, two-pass, tied groups exact (A = 0), so where the reference's
float32 arithmetic loses the answer this matches the float64 answer. Where a reference divides by
zero the results above are finite by construction: an advantage of exactly 0 (a tied group, a group of
one) is not divided, so it stays 0 also with epsilon = 0, where the references give NaN (0 / 0).
Kernel: :func:`~advantage_server.estimators.groups.group_baseline_and_std` (loop twin beside it; numba
on the CPU). On the CPU the broadcast [B, T] result is written densely by
:func:`~advantage_server.estimators.groups.broadcast_rows`, elsewhere it is an ``expand`` view.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_server.estimators.groups import (
    broadcast_rows, group_baseline_and_std, group_max, group_relative, group_relative_rows, exclude_empty_field, groups_of,
    slime_group_norm_field,
    verl_group_stats, verl_std_plus_eps, zero_rows,
)
from advantage_server.estimators.inputs import MASK, OUTCOME_REWARDS, PROMPT_IDS
from advantage_server.errors import InvalidInput
from advantage_server.estimators import roll
from advantage_server.estimators.gae import discounted_reverse_cumsum
from advantage_server.estimators.kl import KL_INPUTS, KLInRewardConfig, kl_clamp_field, kl_type_field
from advantage_server.estimators.rewards import (
    OpenRLHFRewardConfig, openrlhf_outcome, outcome_scores, sum_over_mask_field,
)
from advantage_server.estimators.whitening import slime_whiten_field, whiten_slime
from advantage_client.layout import BROADCAST, BROADCAST_TIMES_MASK, UP_TO_LAST_VALID
from advantage_server.estimators.registry import (
    AdvantageResult, Batch, InputSpec, register, semantics_field,
)

_EPSILON = {"nemo_rl": 1e-6, "verl": 1e-6, "openrlhf": 1e-9, "trl": 1e-4, "skyrl": 1e-6, "slime": 1e-6}
#: prime-rl's LinearLengthPenaltyConfig defaults (packages/prime-rl-configs/src/prime_rl/configs/algorithm.py)
_LENGTH_WEIGHTS = {"num_output_tokens_weight": 0.25, "num_input_tokens_weight": 0.1, "num_turns_weight": 0.1}
_LENGTH_NEEDED = (lambda cfg: bool(cfg.length_penalty), "length_penalty = true")


def _length_weight_field(name: str, what: str) -> object:
    return field(default=None, metadata={
        "doc": f"prime-rl's length_penalty.{name}: the weight of the {what} term (0 turns it off). prime_rl with "
               "length_penalty only.", "range": (0.0, None),
        "per_semantics": {"prime_rl": _LENGTH_WEIGHTS[name]},
        "default_text": f"{_LENGTH_WEIGHTS[name]} (prime_rl); not applicable otherwise"})


@dataclass(frozen=True)
class GRPOConfig(KLInRewardConfig, OpenRLHFRewardConfig, roll.RollStepConfig):
    normalize_rewards: bool = field(default=True, metadata={
        "doc": "Divide by the group std + epsilon (nemo_rl: groups with std 0 stay unscaled). verl's "
               "norm_adv_by_std_in_grpo; false = Dr. GRPO (OpenRLHF dr_grpo)."})
    use_leave_one_out_baseline: bool | None = field(default=None, metadata={
        "doc": "Baseline and std over the other samples of the prompt (RLOO). nemo_rl only.",
        "per_semantics": {"nemo_rl": True}, "default_text": "true (nemo_rl); not applicable otherwise"})
    semantics: str | None = semantics_field(
        ("nemo_rl", "verl", "openrlhf", "trl", "skyrl", "slime", "roll", "prime_rl"),
        "Reference reproduced: nemo_rl (NeMo RL GRPOAdvantageEstimator), verl (compute_grpo_outcome_advantage), "
        "openrlhf (group_norm / dr_grpo), trl (GRPOTrainer), skyrl (compute_grpo_outcome_advantage), slime "
        "(grpo / gspo / cispo: _post_process_rewards and compute_advantages_and_returns), roll (RLVR grpo: "
        "reward_postprocess, compute_token_reward and compute_advantage), prime_rl (grpo, echo "
        "and hierarchical_grpo: GRPOAlgorithm.score_group).")
    epsilon: float | None = field(default=None, metadata={
        "doc": "Added to the std before dividing.", "range": (0.0, None),
        "per_semantics": dict(_EPSILON),
        "default_text": "1e-06 (nemo_rl, verl, skyrl, slime); 1e-09 (openrlhf); 0.0001 (trl)"})
    scale_rewards: str | None = field(default=None, metadata={
        "doc": "TRL scale_rewards: divide by the group std (group), the batch std (batch) or not at all (none).",
        "enum": "ScaleRewards", "choices": ("group", "batch", "none"),
        "per_semantics": {"trl": "group"}, "default_text": "group (trl); not applicable otherwise"})
    exclude_empty_responses: bool = exclude_empty_field(
        extra=" trl with scale_rewards = batch: the batch std is over the non-empty rows too.")
    sum_rewards_over_mask: bool | None = sum_over_mask_field({"verl": False})
    use_kl_in_reward: bool | None = field(default=None, metadata={
        "doc": "Subtract penalty * KL(policy || reference) from every token's reward (OpenRLHF's compute_reward for "
               "group_norm / dr_grpo); roll: ROLL's add_token_level_kl (compute_token_reward). openrlhf and roll "
               "only: NeMo RL, verl, TRL, SkyRL and slime put GRPO's KL in the loss.",
        "per_semantics": {"openrlhf": False, "roll": False},
        "default_text": "false (openrlhf, roll); not applicable otherwise"})
    # KL in the reward: NeMo RL's defaults (k3, clamps 20 and 10); ROLL's compute_approx_kl (kl = k1, no clamps)
    reference_policy_kl_type: str | None = kl_type_field(("nemo_rl", "verl", "openrlhf", "trl", "skyrl", "slime"),
                                                         ("roll",))
    kl_input_clamp_value: float | None = kl_clamp_field(
        "input", 20.0, ("nemo_rl", "verl", "openrlhf", "trl", "skyrl", "slime"), ("roll",))
    kl_output_clamp_value: float | None = kl_clamp_field(
        "output", 10.0, ("nemo_rl", "verl", "openrlhf", "trl", "skyrl", "slime"), ("roll",))
    rewards_normalization: bool | None = slime_group_norm_field(divides=True)
    normalize_advantages: bool | None = slime_whiten_field(default=False, roll=True)
    gamma: float | None = roll.gamma_field()
    length_penalty: bool | None = field(default=None, metadata={
        "doc": "prime-rl's linear length penalty ([orchestrator.algo.length_penalty]): shape each reward by the "
               "group's mean reward times the weighted output-token, input-token and turn fractions of the group's "
               "largest, then centre. Needs num_output_tokens, num_total_tokens and num_turns. prime_rl only.",
        "per_semantics": {"prime_rl": False}, "default_text": "false (prime_rl); not applicable otherwise"})
    num_output_tokens_weight: float | None = _length_weight_field("num_output_tokens_weight", "output-token")
    num_input_tokens_weight: float | None = _length_weight_field("num_input_tokens_weight", "input-token")
    num_turns_weight: float | None = _length_weight_field("num_turns_weight", "turns")

    def validate(self) -> None:
        """The fields' checks, and, with ``semantics = roll``: ROLL's grpo cannot leave the std out
        (``config.normalize_rewards`` = false: InvalidInput naming the option that gives the mean alone)."""
        super().validate()
        if self.semantics == "roll" and self.normalize_rewards is False:
            raise InvalidInput("config.normalize_rewards", "ROLL's grpo always divides by the group std (it forces "
                                                           "norm_mean_type = norm_std_type = group); for the mean alone "
                                                           "use reinforce_plus_plus with semantics = roll and "
                                                           "norm_mean_type = group")


def prime_rl_scalars(cfg: GRPOConfig, group: torch.Tensor, rewards: torch.Tensor, batch: Batch) -> torch.Tensor:
    """prime-rl's GRPO advantage per sample, float64 ``[B]`` (module docstring, ``semantics = prime_rl``).

    group: ``[B]`` int64 group index; rewards: ``[B]`` float. With ``cfg.length_penalty`` reads the batch's
    ``num_output_tokens``, ``num_total_tokens`` and ``num_turns`` (``[B]``). A tied group gives exactly 0 without
    the penalty. Source: prime-rl main@559b447 ``src/prime_rl/orchestrator/algo/grpo.py``.
    """
    r = rewards.to(torch.float64)
    mean, _ = group_baseline_and_std(group, r, leave_one_out=False)
    if not cfg.length_penalty:
        return r - mean
    out = batch["num_output_tokens"].to(torch.float64)
    inp = batch["num_total_tokens"].to(torch.float64) - out
    turns = batch["num_turns"].to(torch.float64)
    frac = torch.zeros_like(r)
    for weight, x in ((cfg.num_output_tokens_weight, out), (cfg.num_input_tokens_weight, inp),
                      (cfg.num_turns_weight, turns)):
        frac = frac + weight * (x / group_max(group, x).clamp(min=1.0))
    shaped = r - mean * frac
    shaped_mean, _ = group_baseline_and_std(group, shaped, leave_one_out=False)
    return shaped - shaped_mean


@register("grpo", config=GRPOConfig,
          inputs=[PROMPT_IDS, OUTCOME_REWARDS, MASK,
                  InputSpec("std_rewards", ("[B]",), "float",
                            "DAPO: per-sample values the std is computed on instead of the rewards.",
                            required=False), *KL_INPUTS, roll.ATTENTION_MASK,
                  InputSpec("num_output_tokens", ("[B]",), "float",
                            "prime_rl length_penalty: the tokens each trace sampled (prime-rl's num_output_tokens).",
                            required=False, required_when=_LENGTH_NEEDED,
                            fix="send each trace's num_output_tokens, or set length_penalty = false"),
                  InputSpec("num_total_tokens", ("[B]",), "float",
                            "prime_rl length_penalty: every token of each trace, prompt and tool output included "
                            "(prime-rl's num_total_tokens; input tokens = num_total_tokens - num_output_tokens).",
                            required=False, required_when=_LENGTH_NEEDED,
                            fix="send each trace's num_total_tokens, or set length_penalty = false"),
                  InputSpec("num_turns", ("[B]",), "float",
                            "prime_rl length_penalty: the turns of each trace (prime-rl's num_turns).",
                            required=False, required_when=_LENGTH_NEEDED,
                            fix="send each trace's num_turns, or set length_penalty = false")],
          reference="arXiv:2402.03300; NeMo RL GRPOAdvantageEstimator; verl compute_grpo_outcome_advantage; "
                    "OpenRLHF group_norm/dr_grpo; TRL GRPOTrainer; prime-rl GRPOAlgorithm",
          produces_returns=(lambda cfg: cfg.semantics in ("openrlhf", "slime", "roll"),
                            "semantics = openrlhf or semantics = slime or semantics = roll"),
          per_sample=(("semantics = nemo_rl", BROADCAST), ("semantics = verl or semantics = skyrl", BROADCAST_TIMES_MASK),
                      ("semantics = openrlhf and use_kl_in_reward = false", UP_TO_LAST_VALID),
                      ("semantics = trl", BROADCAST), ("semantics = slime", BROADCAST),
                      ("semantics = prime_rl", BROADCAST_TIMES_MASK)),
          # group statistics only; trl's scale_rewards = batch divides by the std of the whole batch, slime's
          # normalize_advantages whitens over the whole batch
          group_local=("semantics = nemo_rl or semantics = verl or semantics = skyrl or semantics = openrlhf or "
                       "semantics = trl and scale_rewards = group or semantics = trl and scale_rewards = none or "
                       "semantics = slime and normalize_advantages = false or semantics = prime_rl",))
def grpo(cfg: GRPOConfig, batch: Batch) -> AdvantageResult:
    """Group-relative advantage: reward minus the per-prompt baseline, optionally over the per-prompt std.

    Inputs: prompt_ids [B], rewards [B] or [B, T], mask [B, T], optional std_rewards [B].
    Returns advantages [B, T]; no returns, no metrics.
    """
    if cfg.semantics == "roll":
        return roll_grpo(cfg, batch)
    rewards, mask = batch["rewards"], batch["mask"]
    group, keep = groups_of(cfg, batch)  # exclude_empty_responses: empty rows each on their own
    std_rewards = batch.get("std_rewards")
    dtype = rewards.dtype
    if cfg.semantics == "nemo_rl" and std_rewards is None and rewards.dim() == 1:
        # CPU (numba), prompts' samples back to back in equal groups: statistics and the [B, T] rows in one pass
        out = group_relative_rows(group, rewards, cfg.use_leave_one_out_baseline, cfg.normalize_rewards,
                                  cfg.epsilon, batch.T, dtype, batch)
        if out is not None:
            return AdvantageResult(out)
    scores = outcome_scores(rewards, mask if cfg.sum_rewards_over_mask else None)
    if cfg.semantics == "prime_rl":
        adv = zero_rows(prime_rl_scalars(cfg, group, scores, batch), keep)
        return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(dtype))
    if cfg.semantics == "nemo_rl":
        adv = group_relative(group, scores, cfg.use_leave_one_out_baseline, cfg.normalize_rewards,
                             cfg.epsilon, std_rewards)
        return AdvantageResult(broadcast_rows(zero_rows(adv, keep), batch.B, batch.T, dtype, batch))
    if cfg.semantics in ("verl", "skyrl"):  # SkyRL's compute_grpo_outcome_advantage is verl's code
        mean, std = verl_group_stats(group, scores)
        if std_rewards is not None:
            _, std = verl_group_stats(group, std_rewards)
        adv = scores - mean
        if cfg.normalize_rewards:  # a tied group (mean exact, so adv = 0) stays 0 with epsilon = 0 too
            adv = torch.where(adv == 0, adv, adv / verl_std_plus_eps(group, std, cfg.epsilon))
        return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(dtype))
    if cfg.semantics == "slime" and not cfg.rewards_normalization:  # normalised by slime's rollout already
        adv = scores.to(torch.float64)
    else:
        mean, std = group_baseline_and_std(group, scores, leave_one_out=False)  # group of one: mean = r, std = 0
        if std_rewards is not None:
            _, std = group_baseline_and_std(group, std_rewards, leave_one_out=False)
        adv = scores - mean
    if cfg.semantics == "slime":
        if cfg.rewards_normalization and cfg.normalize_rewards:  # a tied group's 0 stays 0 (see the docstring)
            adv = torch.where(adv == 0, adv, adv / (std + cfg.epsilon))
        adv = zero_rows(adv, keep)
        if cfg.normalize_advantages:  # the returns are the advantages before slime's whitening
            full = adv[:, None].expand(batch.B, batch.T)
            return AdvantageResult(whiten_slime(full, batch["mask"]).to(dtype), returns=full.to(dtype))
        out = broadcast_rows(adv, batch.B, batch.T, dtype, batch)
        return AdvantageResult(out, returns=out.clone())
    if cfg.semantics == "openrlhf":
        if cfg.normalize_rewards:  # a tied group's 0 stays 0 with epsilon = 0 too (OpenRLHF: 0 / 0)
            adv = torch.where(adv == 0, adv, adv / (std + cfg.epsilon))
        # compute_reward (clip range, KL) and get_cumulative_returns with gamma 1; advantages = returns
        adv, returns = openrlhf_outcome(adv, mask, cfg, batch, whiten=False)
        return AdvantageResult(adv.to(dtype), returns=returns.to(dtype))
    # trl
    if cfg.scale_rewards == "batch":
        s = (std_rewards if std_rewards is not None else scores).to(torch.float64)
        s = s if keep is None else s[keep]
        std = s.std() if s.numel() > 1 else torch.zeros((), dtype=torch.float64, device=s.device)
        std = std.expand_as(adv)
    if cfg.normalize_rewards and cfg.scale_rewards != "none":  # 0 stays 0 with epsilon = 0 (TRL: 0 / 0)
        adv = torch.where(adv == 0, adv, adv / (std + cfg.epsilon))
    return AdvantageResult(broadcast_rows(zero_rows(adv, keep), batch.B, batch.T, dtype, batch))


def roll_grpo(cfg: GRPOConfig, batch: Batch) -> AdvantageResult:
    """``semantics = roll`` (module docstring): ROLL's RLVR grpo, the group normalisation forced, then the discounted
    returns of its token rewards (:mod:`~advantage_server.estimators.roll`).

    Inputs: prompt_ids [B], rewards [B] (or ROLL's token_level_rewards [B, T]), mask [B, T] (ROLL's
    final_response_mask), optional attention_mask [B, T], logprobs and reference_logprobs with use_kl_in_reward.
    Returns advantages and returns [B, T] in the rewards' dtype (``config.normalize_rewards`` = false is refused
    with InvalidInput by the config's validation, before any input is read)."""
    tokens, n = roll.token_rewards(cfg, batch, "group", "group")
    g = torch.full((batch.B,), cfg.gamma, dtype=torch.float64, device=tokens.device)
    returns = discounted_reverse_cumsum(tokens, g)
    dtype = batch["rewards"].dtype
    return AdvantageResult(roll.finish(returns, batch["mask"], n, cfg).to(dtype), returns=returns.to(dtype))
