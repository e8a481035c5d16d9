"""Benchmark inputs shaped like real RL batches, and the bytes each estimator must move at the least.

Masks: each row is a prompt (mask 0, up to T/8 tokens), a response (mask 1, from T/4 tokens to the end of
the row) and right padding (mask 0): one contiguous block of valid tokens per row, as trainers send
them. Groups: each prompt's G samples back to back (``prompt_ids = arange(B) // G``), as trainers lay
them out. Rewards: a 0/1 outcome plus a little noise (no exactly tied groups). float32 throughout.
"""
from __future__ import annotations

import torch

#: estimator -> its config (the estimator's defaults, NeMo RL semantics), and the estimators: defined beside
#: advantage-bench's flags (advantage_server.bench.options), which name them
from advantage_server.bench.options import CONFIGS, ESTIMATORS  # noqa: E402,F401 - re-exported


def response_mask(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    prompt = torch.randint(0, max(1, T // 8), (B,), generator=gen)
    length = torch.randint(max(1, T // 4), T + 1, (B,), generator=gen)
    end = torch.minimum(prompt + length, torch.full_like(prompt, T))
    t = torch.arange(T)[None, :]
    return ((t >= prompt[:, None]) & (t < end[:, None])).to(torch.float32)


def inputs(estimator: str, B: int, T: int, G: int, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) for one batch of ``estimator`` at B rows, T tokens, groups of G."""
    gen = torch.Generator().manual_seed(seed)
    mask = response_mask(B, T, gen)
    ids = torch.arange(B, dtype=torch.int64) // max(1, G)

    def outcome() -> torch.Tensor:
        return (torch.rand(B, generator=gen) < 0.5).float() + 0.1 * torch.randn(B, generator=gen)

    if estimator == "gae":
        tensors = {"rewards": outcome(), "mask": mask, "values": torch.randn(B, T, generator=gen)}
    elif estimator in ("grpo", "reinforce_plus_plus"):
        tensors = {"prompt_ids": ids, "rewards": outcome(), "mask": mask}
    elif estimator == "gdpo":
        tensors = {"prompt_ids": ids, "mask": mask, "reward/correctness": (torch.rand(B, generator=gen) < 0.5).float(),
                   "reward/format": 0.1 * torch.randn(B, generator=gen)}
    elif estimator == "opd":
        tensors = {"mask": mask, "teacher_logprobs": -torch.rand(B, T, generator=gen) * 3,
                   "prev_logprobs": -torch.rand(B, T, generator=gen) * 3}
    else:
        raise SystemExit(f"no benchmark workload for {estimator!r}; choose from {', '.join(ESTIMATORS)}")
    return dict(CONFIGS[estimator]), tensors


def floor_bytes(estimator: str, B: int, T: int, n_components: int = 2) -> int:
    """Bytes read once + written once by the estimator's default config (float32 data, int64 ids).

    gae: rewards [B], values and mask [B, T] in; advantages and returns [B, T] out.
    grpo: prompt_ids and rewards [B] in (the mask's values are not read); advantages [B, T] out.
    gdpo: prompt_ids and the components [B] in; advantages [B, T] out.
    reinforce_plus_plus: prompt_ids, rewards [B] and the mask [B, T] in (whitening counts the valid
    tokens); advantages [B, T] out.
    opd: teacher and student logprobs and the mask [B, T] in; advantages [B, T] out.
    """
    f, i = 4, 8
    return {
        "gae": B * f + 2 * B * T * f + 2 * B * T * f,
        "grpo": B * (i + f) + B * T * f,
        "gdpo": B * (i + n_components * f) + B * T * f,
        "reinforce_plus_plus": B * (i + f) + B * T * f + B * T * f,
        "opd": 3 * B * T * f + B * T * f,
    }[estimator]


def gae_kernel_floor_bytes(B: int, T: int) -> int:
    """``gae_kernel`` alone: token rewards, values, mask [B, T] in, advantages [B, T] out."""
    return 4 * B * T * 4


def payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
