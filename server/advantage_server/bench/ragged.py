"""Bytes on the wire for a slime-shaped batch (issue #38): ragged responses sent packed versus padded.

slime keeps a rollout as per-sample lists of ``[T_i]`` tensors; its drop-in (``advantage_client.slime``) sends
them in the packed layout (``cu_seqlens`` and flat ``[N]`` inputs). This prints, for slime-shaped batches (response
lengths drawn log-normally with a mean of about 1k tokens, one row of 16k), the encoded request of each of slime's
trainer requests (``gae`` for ``ppo`` with values and KL; ``reinforce_plus_plus`` with KL; ``grpo``), the bytes its
tokens need (each token-level input's itemsize per token, the mask as one byte, plus 4 bytes per sample for the
reward and 8 per row offset), and the same batch padded to ``[B, max(T)]``::

    python -m advantage_server.bench.ragged            # B = 64 and 256
    python -m advantage_server.bench.ragged --rows 512

The request is what :meth:`advantage_client.AdvantageClient.compute` sends (``prepare_call``, the mask compacted to
one byte per token), measured with protobuf's ``ByteSize``; nothing is sent.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from advantage_client.client import prepare_call

#: slime's trainer requests: estimator, config, the token-level float inputs, per-sample inputs
REQUESTS = {
    "ppo (gae)": ("gae", {"semantics": "slime", "use_kl_in_reward": True, "reference_policy_kl_penalty": 0.01},
                  ("values", "logprobs", "reference_logprobs"), ("rewards",)),
    "reinforce_plus_plus": ("reinforce_plus_plus", {"semantics": "slime", "use_kl_in_reward": True,
                                                    "reference_policy_kl_penalty": 0.01, "normalize_advantages": False},
                            ("logprobs", "reference_logprobs"), ("rewards",)),
    "grpo": ("grpo", {"semantics": "slime", "rewards_normalization": False}, (), ("rewards", "prompt_ids")),
}


def slime_lengths(rows: int, seed: int = 0, mean: float = 1000.0, longest: int = 16384) -> np.ndarray:
    """``rows`` response lengths, log-normal with about ``mean`` tokens on average (1 to ``longest``), one of them
    ``longest``: a long-tailed rollout where padding to the longest row would cost ~16x the tokens."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    lengths = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, rows).round().clip(1, longest).astype(np.int64)
    lengths[0] = longest
    return lengths


def request_bytes(name: str, lengths: np.ndarray, packed: bool, seed: int = 0) -> int:
    """Encoded bytes of slime's trainer request ``name`` (a key of :data:`REQUESTS`) for ``lengths``, in the packed
    layout or padded to ``[B, max(T)]``."""
    estimator, config, token_inputs, sample_inputs = REQUESTS[name]
    rng = np.random.default_rng(seed)
    B, N, T = len(lengths), int(lengths.sum()), int(lengths.max())
    flat_mask = (rng.random(N) < 0.9).astype(np.float32)
    tensors: dict[str, Any] = {}
    for key in sample_inputs:
        tensors[key] = np.zeros(B, np.int64) if key == "prompt_ids" else rng.standard_normal(B).astype(np.float32)
    if packed:
        tensors["mask"] = flat_mask
        for key in token_inputs:
            tensors[key] = rng.standard_normal(N).astype(np.float32)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        call = prepare_call(estimator, config, "float32", cu, False, tensors)
    else:
        rows = np.repeat(np.arange(B), lengths)
        cols = np.arange(N) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        mask = np.zeros((B, T), np.float32)
        mask[rows, cols] = flat_mask
        tensors["mask"] = mask
        for key in token_inputs:
            full = np.zeros((B, T), np.float32)
            full[rows, cols] = rng.standard_normal(N).astype(np.float32)
            tensors[key] = full
        call = prepare_call(estimator, config, "float32", None, False, tensors)
    return sum(len(piece) for piece in call.request.pieces)


def needed_bytes(name: str, lengths: np.ndarray) -> int:
    """What the tokens need: 4 bytes per token-level float input and 1 for the mask per token, 4 (8 for ids) per
    sample input and 8 per row offset."""
    _, _, token_inputs, sample_inputs = REQUESTS[name]
    B, N = len(lengths), int(lengths.sum())
    per_sample = sum(8 if k == "prompt_ids" else 4 for k in sample_inputs)
    return N * (4 * len(token_inputs) + 1) + B * per_sample + 8 * (B + 1)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[64, 256])
    args = parser.parse_args(argv)
    out = []
    print("request              | B   | tokens N  | max T | needed MB | packed MB | packed / needed | padded MB | "
          "padded / packed")
    for rows in args.rows:
        lengths = slime_lengths(rows)
        for name in REQUESTS:
            need, packed = needed_bytes(name, lengths), request_bytes(name, lengths, True)
            padded = request_bytes(name, lengths, False)
            row = {"request": name, "B": rows, "N": int(lengths.sum()), "T": int(lengths.max()), "needed": need,
                   "packed": packed, "padded": padded}
            out.append(row)
            print(f"{name:20s} | {rows:<3d} | {row['N']:<9d} | {row['T']:<5d} | {need / 1e6:9.2f} | "
                  f"{packed / 1e6:9.2f} | {packed / need:15.4f} | {padded / 1e6:9.2f} | {padded / packed:15.1f}")
    return out


if __name__ == "__main__":
    main()
