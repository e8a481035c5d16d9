"""Input specs several estimators share: the token mask, prompt groups and the reward shapes."""
from __future__ import annotations

from advantage_server.estimators.registry import InputSpec

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
OUTCOME_REWARDS = InputSpec(
    "rewards", ("[B]", "[B, T]"), "float",
    "Reward of each sample [B], or token-level rewards [B, T] (verl's token_level_rewards), summed over "
    "all T positions (masked ones included, as verl does).",
    fix="send one reward per sample [B], or token-level rewards [B, T]",
)
TOKEN_REWARDS = InputSpec(
    "rewards", ("[B]", "[B, T]"), "float",
    "Token-level rewards [B, T] (verl's token_level_rewards), or one reward per sample [B], placed on the "
    "last mask = 1 position of its row.",
    fix="send token-level rewards [B, T], or one reward per sample [B]",
)
TRAJECTORY_IDS = InputSpec(
    "trajectory_ids", ("[B]", "[B, L]"), "integer",
    "Trajectory of each step row (multi-turn: one row per step): rows with equal prompt_ids and equal "
    "trajectory_ids are the steps of one trajectory, so ids need only be unique within a prompt group. "
    "[B] integer ids, or [B, L] integer rows (equal rows = the same trajectory).",
    fix="send one integer trajectory id per row ([B]; e.g. the index of the rollout within its task)",
)
STEP_INDEX = InputSpec(
    "step_index", ("[B]",), "integer",
    "Order of each step row within its trajectory (0, 1, ...; only the order matters). Optional: without "
    "it, and between equal values, the rows' order in the batch is the step order.",
    required=False,
)
ANCHOR_IDS = InputSpec(
    "anchor_ids", ("[B]", "[B, L]"), "integer",
    "Anchor state of each step row: equal ids = the same environment state. [B] int64: a hash of the "
    "observation the step acted on (without history); or [B, L] integer rows, equal rows = the same state "
    "(e.g. the observation's whole sha256 digest as uint8 [B, 32]).",
    fix="send int64 hashes [B], e.g. int.from_bytes(sha256(obs).digest()[:8], 'big', signed=True) (int64 is "
        "signed), or the digests as uint8 rows [B, 32]",
)
