"""KL(policy || reference) in the reward: the config fields (NeMo RL's loss-config names and defaults),
the optional log-prob inputs and the k1/k2/k3 estimators (Schulman 2020)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.registry import EstimatorConfig, InputSpec

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
    reference_policy_kl_type: str = field(default="k3", metadata={
        "doc": "KL estimator: k1, k2 or k3 (Schulman 2020).", "enum": "KLType", "choices": ("k1", "k2", "k3")})
    kl_input_clamp_value: float = field(default=20.0, metadata={"doc": "Clamp the log ratio to +-this before the KL estimator.", "range": (0.0, None)})
    kl_output_clamp_value: float = field(default=10.0, metadata={"doc": "Clamp the KL estimate to +-this.", "range": (0.0, None)})

    def validate(self) -> None:
        super().validate()
        # None: a config whose default depends on its semantics (rloo: k1 under trl), filled in after validate
        kinds = ("k1", "k2", "k3", "abs") if getattr(self, "semantics", None) == "roll" else ("k1", "k2", "k3")
        if self.reference_policy_kl_type is not None and self.reference_policy_kl_type not in kinds:
            extra = " (abs: semantics = roll only, ROLL's kl_penalty = abs)" if self.reference_policy_kl_type == "abs" else ""
            raise InvalidInput("config.reference_policy_kl_type",
                               f"{self.reference_policy_kl_type!r} is not a KL estimator; use {', '.join(kinds)}{extra}")


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kl_type: str,
               input_clamp: float, output_clamp: float) -> torch.Tensor:
    """Per-token KL estimate, float64 ``[B, T]`` (Schulman 2020, http://joschu.net/blog/kl-approx.html).

    With r = clamp(reference_logprobs - logprobs, +-input_clamp):
    k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r, abs = |r| (ROLL's ``kl_penalty = abs``); the estimate is clamped to +-output_clamp (a clamp of None:
    none). Computed in
    float64 whatever the log-probs' dtype: the log ratio of two close float32 log-probs and k3's
    ``expm1(r) - r`` cancel, so the references' float32 arithmetic loses digits the float64 answer keeps
    (the differential tests compare against the references run in float64).
    """
    r = reference_logprobs.to(torch.float64) - logprobs.to(torch.float64)
    if input_clamp is not None:  # None: no clamp (TRL's RLOO KL)
        r = r.clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -r
    elif kl_type == "k2":
        kl = 0.5 * r * r
    elif kl_type == "abs":
        kl = r.abs()
    else:  # k3, validated by the config
        kl = torch.expm1(r) - r
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


def apply_kl(token_rewards: torch.Tensor, cfg, batch, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``token_rewards - penalty * KL`` when the config folds KL into the reward, else unchanged.

    With ``mask`` the KL is counted only where mask = 1 (verl's ``apply_kl_penalty``, OpenRLHF's
    ``compute_reward``). The result has the dtype of ``token_rewards``.
    """
    if not cfg.use_kl_in_reward or cfg.reference_policy_kl_penalty == 0:
        return token_rewards
    kl = kl_penalty(batch["logprobs"], batch["reference_logprobs"], cfg.reference_policy_kl_type,
                    cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
    if mask is not None:
        kl = kl * mask
    return token_rewards - cfg.reference_policy_kl_penalty * kl.to(token_rewards.dtype)


def kl_total(cfg, batch, mask: torch.Tensor) -> torch.Tensor | float:
    """``penalty * sum_t KL_t * mask_t`` per row (float64 ``[B]``) when the config folds KL into the reward,
    else 0: what the KL penalty takes off an outcome score (verl sums its KL-penalised token rewards)."""
    if not cfg.use_kl_in_reward or cfg.reference_policy_kl_penalty == 0:
        return 0.0
    kl = kl_penalty(batch["logprobs"], batch["reference_logprobs"], cfg.reference_policy_kl_type,
                    cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
    return cfg.reference_policy_kl_penalty * (kl.to(torch.float64) * mask.to(torch.float64)).sum(-1)


def kl_type_field(k3: tuple[str, ...], k1: tuple[str, ...] = ()) -> Any:
    """``reference_policy_kl_type`` for a config whose default depends on its semantics: k3 (NeMo RL's default)
    under ``k3``, k1 under ``k1`` (slime's ``--kl-loss-type`` default, ROLL's ``kl_penalty = kl``; TRL's RLOO).
    With ``roll`` among them, ``abs`` is offered too (ROLL's ``kl_penalty = abs``; roll only, checked by
    :meth:`KLInRewardConfig.validate`)."""
    per = {**{s: "k3" for s in k3}, **{s: "k1" for s in k1}}
    text = "; ".join(f"{v} ({', '.join(s for s in per if per[s] == v)})" for v in dict.fromkeys(per.values()))
    roll = "roll" in per
    return field(default=None, metadata={
        "doc": "KL estimator: k1, k2 or k3 (Schulman 2020)" + ("; abs = |log ratio| (roll only)." if roll else "."),
        "enum": "KLType", "choices": ("k1", "k2", "k3", "abs") if roll else ("k1", "k2", "k3"),
        "per_semantics": per, "default_text": text})


def kl_clamp_field(which: str, value: float, clamped: tuple[str, ...], unclamped: tuple[str, ...] = ()) -> Any:
    """``kl_input_clamp_value`` (``which = "input"``) or ``kl_output_clamp_value`` (``"output"``) whose default
    depends on the semantics: ``value`` (NeMo RL's) under ``clamped``, none under ``unclamped`` (slime clamps
    nothing but its ``low_var_kl``, which is k3 with ``kl_output_clamp_value = 10``)."""
    doc = ("Clamp the log ratio to +-this before the KL estimator." if which == "input"
           else "Clamp the KL estimate to +-this.")
    per = {**{s: value for s in clamped}, **{s: None for s in unclamped}}
    text = f"{value} ({', '.join(clamped)})" + (f"; none ({', '.join(unclamped)})" if unclamped else "")
    return field(default=None, metadata={"doc": doc, "range": (0.0, None), "per_semantics": per,
                                         "default_text": text})
