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
