"""On-policy distillation (MOPD, arXiv:2601.02780, Eq. 8), NeMo RL ``OPDAdvantageEstimator``.

Math: A_{i,t} = (log pi_teacher - log pi_student)_{i,t} * mask_{i,t}.
Metrics over the tokens where mask = 1 (0 when there are none):
    on_policy_distillation/teacher_student_logprob_gap_mean   mean of the gap
    on_policy_distillation/adv_mean                           mean of A
    on_policy_distillation/adv_std                            unbiased std of A (0 with < 2 tokens)

Kernel: on the CPU with numba, :func:`_opd_rows` writes A and per-row moments in one pass over memory;
elsewhere the torch expression below it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from advantage_server.estimators import jit
from advantage_server.estimators.inputs import MASK
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, InputSpec, register

METRIC_PREFIX = "on_policy_distillation/"


@dataclass(frozen=True)
class OPDConfig(EstimatorConfig):
    pass


@jit.njit(reassoc=True)
def _opd_rows(lo, hi, teacher, prev, mask, adv, stats):  # pragma: no cover - compiled; tested through opd
    """Rows ``lo..hi-1``: adv = (teacher - prev) * mask in the input dtype; stats[b] = (valid count, sum
    of adv, centred sum of squares of adv about the row mean), sums in float64 over the valid tokens.
    adv is 0 where mask = 0 and the mask is 0/1, so the sums run over every position, branch-free (SIMD);
    the gap's masked sum is adv's sum."""
    T = teacher.shape[1]
    for b in range(lo, hi):
        n = 0.0
        adv_sum = 0.0
        for t in range(T):
            a = (teacher[b, t] - prev[b, t]) * mask[b, t]
            adv[b, t] = a
            n += np.float64(mask[b, t])
            adv_sum += np.float64(a)
        m2 = 0.0
        if n > 0:
            mu = adv_sum / n
            for t in range(T):
                d = (np.float64(adv[b, t]) - mu) * np.float64(mask[b, t])
                m2 += d * d
        stats[b, 0] = n
        stats[b, 1] = adv_sum
        stats[b, 2] = m2


@jit.njit(reassoc=True)
def _combine_rows(stats):  # pragma: no cover - compiled; tested through opd
    """Per-row (count, sum, centred sum of squares) -> the batch's (count, sum, centred sum of squares),
    float64, two passes (Chan et al.): one compiled pass each instead of a handful of numpy temporaries
    (those cost more than the kernel itself at small T)."""
    n = 0.0
    total = 0.0
    for b in range(stats.shape[0]):
        n += stats[b, 0]
        total += stats[b, 1]
    mean = total / max(n, 1.0)
    m2 = 0.0
    for b in range(stats.shape[0]):
        m2 += stats[b, 2]
        if stats[b, 0] > 0:
            d = stats[b, 1] / stats[b, 0] - mean
            m2 += stats[b, 0] * d * d
    return n, total, m2


def _opd_numba(teacher: torch.Tensor, prev: torch.Tensor, mask: torch.Tensor, batch: Batch | None = None
               ) -> AdvantageResult:
    """CPU OPD in one pass over memory (numba); the three metrics from per-row moments combined in
    float64 (Chan et al.), equal to the torch path's float64 two-pass values up to rounding."""
    B, T = mask.shape
    adv = batch.output("advantages", teacher.dtype) if batch is not None else torch.empty((B, T), dtype=teacher.dtype)
    stats = np.zeros((B, 3), dtype=np.float64)
    jit.parallel_rows(_opd_rows, B, T, jit.as_numpy(teacher), jit.as_numpy(prev), jit.as_numpy(mask),
                      adv.numpy(), stats)
    n, adv_total, m2_all = _combine_rows(stats)
    gap_total = adv_total  # gap * mask = adv exactly (0/1 mask): the torch path's two sums are equal
    count = max(n, 1.0)
    adv_mean = adv_total / count
    adv_std = math.sqrt(m2_all / max(n - 1.0, 1.0)) if n > 1 else 0.0
    metrics = {"teacher_student_logprob_gap_mean": gap_total / count, "adv_mean": adv_mean, "adv_std": adv_std}
    return AdvantageResult(adv, metrics={METRIC_PREFIX + k: v for k, v in metrics.items()})


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
    teacher, prev = batch["teacher_logprobs"], batch["prev_logprobs"]
    if jit.applies(mask, teacher, prev) and teacher.dtype == prev.dtype == mask.dtype:
        return _opd_numba(teacher, prev, mask, batch)
    gap = teacher - prev
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
