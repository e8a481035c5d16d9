"""ROLL's RLVR advantage step (``semantics = roll`` on grpo, reinforce_plus_plus and gae): the stages its estimators
share, as fields and functions the three estimator modules call.

Source: alibaba/ROLL main@8eb27cc2dc34c4d1310b169d9b86d339004d811a, ``roll/utils/functionals.py``
(``reward_postprocess`` with ``reward_norm``, ``compute_token_reward`` with ``expand_to_token_level`` and
``compute_approx_kl``, ``compute_advantage`` with ``masked_whiten``), called in that order for each domain by
``roll/pipeline/rlvr/rlvr_pipeline.py``. Written from those semantics, not copied.

The step, for ``rewards`` [B] (ROLL's ``response_level_rewards``) and ``mask`` [B, T] (ROLL's ``final_response_mask``,
its ``response_mask[:, 1:]`` times the sample-level mask), float64 here:

1. reward_postprocess: a_i = (r_i - mean) / (std + 1e-6), mean by ``norm_mean_type`` (batch: all B rewards; group: the
   prompt group's; unset: 0), std by ``norm_std_type`` (batch or group: the unbiased std; unset: no division). ROLL's
   grpo forces both to group. Then clamp(a, +-reward_clip) when ``reward_clip`` is set and not 0.
2. compute_token_reward: a_i on the row's last ``attention_mask`` = 1 position (ROLL's last attended token, shifted
   by one as its ``[:, 1:]`` slice; the last mask = 1 position when ``attention_mask`` is not sent), minus
   ``reference_policy_kl_penalty`` (ROLL's ``kl_ctrl.value``, fixed or adaptive: send the value its controller holds
   for this step) times KL_t on the mask = 1 tokens with ``use_kl_in_reward`` (ROLL's ``add_token_level_kl``); KL_t by
   ROLL's ``kl_penalty``: kl = k1, mse = k2, abs = ``abs``, k3 = k3 with ``kl_output_clamp_value = 10``. Then the
   token rewards are clamped to +-reward_clip again.
3. compute_advantage: token rewards whitened over the mask with ``whiten_rewards``, times the mask; the estimator's
   returns over EVERY column (grpo, reinforce: the discounted sum G_t = sum_{k >= t} gamma^(k - t) r_k through mask
   holes; gae: the recursion over every column with the values unmasked, returns = A + V); the advantages (G, or
   GAE's A) whitened over the mask with ``normalize_advantages`` (ROLL's ``whiten_advantages``), times the mask,
   clamped to +-advantage_clip when set (0 included). The returns are never masked, whitened or clipped.

Whitening is ROLL's ``masked_whiten``: (x - mu) * rsqrt(var + 1e-8), mu and the unbiased var over the mask = 1
positions with its float32 Bessel factor (:func:`~advantage_server.estimators.whitening.whiten_unbiased`); with at
most one mask = 1 token in the batch ROLL turns both whitenings off, and so does this.

``rewards`` [B, T] are token rewards as step 2 places them: the normalisation of step 1 is rejected there
(``norm_mean_type`` / ``norm_std_type``), the KL and the clip of step 2 apply. ROLL's ``token_level_rewards`` (what its
``compute_token_reward`` left), sent with ``use_kl_in_reward`` off, give step 3 alone: what the ``advantage_client.roll``
drop-in sends (its ``reward_clip`` may stay set: clamping twice is clamping once).

Where ROLL's arithmetic is not finite the results here are: a group of one (ROLL: NaN, the std of one value) gets 0;
a tied group gets exactly 0 (ROLL's float32 mean can miss a non-dyadic tied value by an ulp and divides that by 1e-6).
Not served: ROLL's ``running`` normalisation (its ``reward_postprocess`` looks the running moments up under the
literal key ``"domain"``, so it raises KeyError unless a domain is named so), ``kl_penalty = full`` (a sum over the
last axis meant for vocabulary distributions: on ``[B, T]`` log-probs it fails to broadcast), and OPD (``use_opd``,
``is_pure_opd``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.groups import group_baseline_and_std
from advantage_server.estimators.kl import kl_penalty
from advantage_server.estimators.registry import EstimatorConfig, InputSpec
from advantage_server.estimators.rewards import last_valid_index
from advantage_server.estimators.whitening import whiten_unbiased

#: ROLL's reward_norm epsilon (added to the std)
NORM_EPS = 1e-6

ATTENTION_MASK = InputSpec(
    "attention_mask", ("[B, T]",), "mask",
    "roll only: ROLL's attention_mask[:, 1:]; a [B] reward goes on the row's last 1 (ROLL's last attended token). "
    "Absent: the row's last mask = 1 position.", required=False)


def _roll(doc: str, default: Any, default_text: str, **meta: Any) -> Any:
    return field(default=None, metadata={"doc": f"{doc} roll only.", "per_semantics": {"roll": default},
                                         "default_text": f"{default_text} (roll); not applicable otherwise", **meta})


def norm_field(which: str) -> Any:
    """``norm_mean_type`` (``which = "mean"``) or ``norm_std_type``: ROLL's reward normalisation, batch or group."""
    what = "subtracted from" if which == "mean" else "(unbiased, plus 1e-6) dividing"
    return _roll(f"ROLL's norm_{which}_type: the {which} {what} the [B] rewards, over the batch or the prompt group "
                 "(prompt_ids), or none (ROLL's None). ROLL's running is not served.", "none", "none",
                 enum="RollRewardNorm", choices=("batch", "group", "none"))


def gamma_field() -> Any:
    return _roll("ROLL's gamma: discount of the returns.", 1.0, "1.0", range=(0.0, 1.0))


@dataclass(frozen=True)
class RollStepConfig(EstimatorConfig):
    """ROLL's clip and whitening options (its pipeline config names), ``semantics = roll`` only."""

    reward_clip: float | None = _roll(
        "ROLL's reward_clip: clamp the normalised [B] rewards, and the token rewards after the KL, to +-this "
        "(0: off, as ROLL); unset: off.", None, "unset", range=(0.0, None))
    advantage_clip: float | None = _roll(
        "ROLL's advantage_clip: clamp the advantages to +-this, last; unset: off.", None, "unset", range=(0.0, None))
    whiten_rewards: bool | None = _roll("ROLL's whiten_rewards: whiten the token rewards over the mask.", False,
                                        "false")


def needs_groups(cfg: Any) -> bool:
    """Whether a roll config reads ``prompt_ids`` (a group normalisation)."""
    return cfg.semantics == "roll" and "group" in (getattr(cfg, "norm_mean_type", None),
                                                   getattr(cfg, "norm_std_type", None))


def response_rewards(cfg: Any, batch: Any, mean_type: str | None, std_type: str | None) -> torch.Tensor:
    """Step 1 (``reward_postprocess``): the ``[B]`` rewards normalised and clipped, float64 ``[B]``.

    Raises InvalidInput on ``config.norm_std_type`` for a group std without the group mean (ROLL divides the [B]
    rewards by a [G, 1] std there: a [G, B] result its batch cannot hold)."""
    r = batch["rewards"].to(torch.float64)
    mean_type, std_type = (None if t == "none" else t for t in (mean_type, std_type))
    if std_type == "group" and mean_type != "group":
        raise InvalidInput("config.norm_std_type", "group needs norm_mean_type = group (ROLL broadcasts the [G, 1] "
                                                   "group std against the [B] rewards otherwise, and fails)")
    if "group" in (mean_type, std_type):
        g_mean, g_std = group_baseline_and_std(batch["prompt_ids"], r, leave_one_out=False)  # one: mean r, std 0
    zero = torch.zeros((), dtype=torch.float64, device=r.device)
    mean = g_mean if mean_type == "group" else r.mean() if mean_type == "batch" else zero
    a = r - mean
    if std_type is not None:
        std = g_std if std_type == "group" else (r.std() if r.numel() > 1 else zero)
        a = torch.where(a == 0, a, a / (std + NORM_EPS))  # a tied group's 0 stays 0 (module docstring)
    return clip(a, cfg.reward_clip)


def clip(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    """ROLL's reward clip: ``x`` clamped to +-bound, unchanged for None or 0 (ROLL's ``if reward_clip:``)."""
    return x.clamp(-bound, bound) if bound else x


def token_rewards(cfg: Any, batch: Any, mean_type: str | None = None, std_type: str | None = None
                  ) -> tuple[torch.Tensor, int]:
    """Steps 1 to 3's first half: the masked token rewards ROLL's estimators read, float64 ``[B, T]``, and the
    number of mask = 1 tokens (ROLL's ``valid_token_count``).

    ``[B]`` rewards go through steps 1 and 2; ``[B, T]`` rewards are token rewards as placed (step 2's KL and clip
    apply; InvalidInput naming ``norm_mean_type`` / ``norm_std_type`` when set)."""
    rewards, mask = batch["rewards"], batch["mask"]
    m = mask.to(torch.float64)
    if rewards.dim() == 2:  # token rewards as placed: step 1 does not apply
        for name in ("norm_mean_type", "norm_std_type"):
            if getattr(cfg, name, None) not in (None, "none"):
                raise InvalidInput(f"config.{name}", "applies to [B] rewards (ROLL's reward_postprocess); [B, T] "
                                                     "rewards are token rewards, normalised before they were placed")
        tokens = rewards.to(torch.float64)
    else:
        a = response_rewards(cfg, batch, mean_type, std_type)
        ends = batch.get("attention_mask")
        last = last_valid_index(mask if ends is None else ends)
        tokens = torch.zeros(batch.B, batch.T, dtype=torch.float64, device=mask.device)
        tokens.scatter_(1, last.clamp(min=0)[:, None], torch.where(last >= 0, a, 0.0)[:, None])
    if cfg.use_kl_in_reward and cfg.reference_policy_kl_penalty != 0:
        kl = kl_penalty(batch["logprobs"], batch["reference_logprobs"], cfg.reference_policy_kl_type,
                        cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
        tokens = tokens - cfg.reference_policy_kl_penalty * (kl * m)
    tokens = clip(tokens, cfg.reward_clip)
    n = int(m.sum().round().item())
    if cfg.whiten_rewards and n > 1:
        tokens = whiten_unbiased(tokens, mask)
    return tokens * m, n


def finish(adv: torch.Tensor, mask: torch.Tensor, n: int, cfg: Any) -> torch.Tensor:
    """Step 3's end: ``adv`` whitened over the mask (``normalize_advantages``, more than one valid token), times the
    mask, clamped to +-advantage_clip (when set). float64 ``[B, T]``."""
    if cfg.normalize_advantages and n > 1:
        adv = whiten_unbiased(adv, mask)
    adv = adv * mask.to(torch.float64)
    return adv if cfg.advantage_clip is None else adv.clamp(-cfg.advantage_clip, cfg.advantage_clip)
