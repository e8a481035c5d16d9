"""On-policy distillation (MOPD, arXiv:2601.02780, Eq. 8), NeMo RL ``OPDAdvantageEstimator``.

Math: A_{i,t} = (log pi_teacher - log pi_student)_{i,t} * mask_{i,t}.
Metrics over the tokens where mask = 1 (0 when there are none):
    on_policy_distillation/teacher_student_logprob_gap_mean   mean of the gap
    on_policy_distillation/adv_mean                           mean of A
    on_policy_distillation/adv_std                            unbiased std of A (0 with < 2 tokens)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from advantage_server.estimators.common import MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, InputSpec, register

METRIC_PREFIX = "on_policy_distillation/"


@dataclass(frozen=True)
class OPDConfig(EstimatorConfig):
    pass


@register(
    "opd", config=OPDConfig,
    inputs=[
        MASK,
        InputSpec("teacher_logprobs", ("[B, T]",), "float", "Teacher log-probabilities of the sampled tokens.",
                  fix="score the student's samples with the teacher and send its logprobs"),
        InputSpec("prev_logprobs", ("[B, T]",), "float", "Student (training engine) log-probabilities of the sampled tokens.",
                  fix="send the student's logprobs from the training engine"),
    ],
    reference="arXiv:2601.02780; NeMo RL OPDAdvantageEstimator",
    metrics=tuple(METRIC_PREFIX + k for k in ("teacher_student_logprob_gap_mean", "adv_mean", "adv_std")),
)
def opd(cfg: OPDConfig, batch: Batch) -> AdvantageResult:
    """Teacher-minus-student log-probability gap on the valid tokens, with three metrics.

    Inputs: mask, teacher_logprobs, prev_logprobs [B, T]. Returns advantages [B, T] (0 where mask = 0);
    no returns; metrics as listed in the module docstring.
    """
    mask = batch["mask"]
    gap = batch["teacher_logprobs"] - batch["prev_logprobs"]
    adv = gap * mask
    m = mask.to(torch.float64)
    n = m.sum()
    count = n.clamp(min=1)
    gap_mean = (gap.to(torch.float64) * m).sum() / count
    adv_mean = (adv.to(torch.float64) * m).sum() / count
    adv_var = ((adv.to(torch.float64) - adv_mean).square() * m).sum() / (n - 1).clamp(min=1)
    adv_std = torch.where(n > 1, adv_var.sqrt(), torch.zeros_like(adv_var))
    values = torch.stack([gap_mean, adv_mean, adv_std]).tolist()  # the one device-to-host copy
    metrics = dict(zip(("teacher_student_logprob_gap_mean", "adv_mean", "adv_std"), values))
    return AdvantageResult(adv, metrics={METRIC_PREFIX + k: v for k, v in metrics.items()})
