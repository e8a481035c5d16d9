"""``advantage-demo lm``: a small language model trained with group estimators computed by the service.

    advantage-demo lm                                   # GRPO, embedded server on 127.0.0.1
    advantage-demo lm --estimator rloo                  # or reinforce_plus_plus_baseline, gdpo, grpo_passk, opd, maxrl
    advantage-demo lm --server host:50051               # use a running advantage-server instead
    advantage-demo lm --csv runs/lm.csv --plot runs/lm.png           # what `make demo` writes
    advantage-demo lm --compare grpo,rloo,gdpo --plot runs/compare.png   # same seed, one PNG

The task: multi-digit addition written as tokens. A prompt is two zero-padded ``n_digits``-digit numbers,
``"042+917="``; the answer is their sum written least significant digit first and zero-padded to
``n_digits + 1`` digits, then an end token: ``"9590<eos>"`` (042 + 917 = 0959). Writing the answer
backwards lets a left-to-right model produce each digit after the digits it depends on (the carry comes
from the previous position). The verifier is exact: reward 1 when the response is exactly the right
digits followed by the end token, else 0. GDPO gets two components: that correctness and a partial
credit, the fraction of the ``n_digits + 1`` answer positions holding the right digit.

The policy is a decoder-only transformer written here in plain PyTorch (learned position embeddings,
pre-norm blocks, causal attention), about 0.2M parameters, randomly initialised: nothing is downloaded.
A short supervised warm start (teacher forcing on correct answers) leaves it weak: it stops as soon as
greedy accuracy on a dev set reaches ``warm_accuracy`` (20%; supervised learning of this task jumps from
a few percent to nearly 100% within a hundred steps, so a fixed step count would land anywhere), which
leaves held-out greedy accuracy around 20%. Reinforcement learning then does the
rest: each step samples ``group_size`` completions for each of ``prompts_per_step`` prompts, scores
them with the verifier and asks the service for advantages, one call per prompt group, sent as soon as
that group has been sampled (from a small thread pool, so the calls overlap the sampling of the next
groups), and takes a clipped policy-gradient step over the response tokens under the mask. ``opd``
(on-policy distillation) instead takes per-token advantages from a teacher: a copy of the warm-start
policy trained ``teacher_steps`` more supervised steps. An optional KL to the warm-start policy (k1, k2
or k3) goes into the loss, or into the reward where the service computes it (``--kl-in reward`` with
``reinforce_plus_plus``, ``reinforce_plus_plus_baseline`` or ``rloo``).

The file reads top to bottom as a reference for an LLM trainer that calls the service: config, task and
verifier, policy, sampler, the advantage call for one group, the RL step, the training loop, the
comparison and the CLI. ``advantages_for_group`` is the only function that talks to the service;
``AdvantageRequests`` is the only place that knows the calls are made from threads (an asyncio client
would replace it alone).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import copy
import csv
import dataclasses
import pathlib
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from advantage_client import AdvantageClient, AdvantageServiceError, wire
from advantage_server.core import config_from_dict
from advantage_server.demo.options import add_config_arguments
from advantage_server.estimators import REGISTRY
from advantage_server.demo.service import connect

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gdpo", "grpo_passk", "opd", "reinforce_plus_plus",
              "maxrl")
KL_IN_REWARD = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")  # take use_kl_in_reward
HELD_OUT_SEED = 20_260_101  # the held-out problems are the same for every run seed


# --------------------------------------------------------------------------- config
@dataclass
class LMConfig:
    """Everything a run depends on; the CLI exposes the fields that have a ``flag``."""

    estimator: str = field(default="grpo", metadata={
        "flag": "--estimator", "help": "the service's estimator: " + ", ".join(ESTIMATORS)})
    semantics: str | None = field(default=None, metadata={
        "flag": "--semantics", "help": "the estimator's semantics (nemo_rl, verl, openrlhf, trl, skyrl) where it has "
                                       "several; default: the estimator's own default"})
    compare: str | None = field(default=None, metadata={
        "flag": "--compare", "help": "comma-separated estimators to run one after another from the same warm "
                                     "start and seed; --plot then shows all of them in one PNG"})
    seed: int = field(default=1, metadata={"flag": "--seed", "help": "seed of torch and numpy (training prompts, "
                                                                     "initialisation, sampling)"})
    server: str | None = field(default=None, metadata={
        "flag": "--server", "help": "HOST:PORT of a running advantage-server (default: start one in-process)"})
    rl_seconds: float = field(default=600.0, metadata={
        "flag": "--rl-seconds", "help": "wall-time budget of the RL phase of one run (warm start not included)"})
    max_steps: int = field(default=10_000, metadata={"flag": "--max-steps", "help": "RL steps at most"})
    target_accuracy: float = field(default=0.9, metadata={
        "flag": "--target-accuracy", "help": "stop once held-out greedy accuracy reaches this (inf: use the "
                                             "whole budget)"})
    kl_coef: float = field(default=0.0, metadata={
        "flag": "--kl-coef", "help": "weight of the KL to the warm-start policy (0: no KL)"})
    kl_type: str = field(default="k3", metadata={"flag": "--kl-type", "help": "KL estimator: k1, k2 or k3"})
    kl_in: str = field(default="loss", metadata={
        "flag": "--kl-in", "help": "where the KL goes: loss (added to the policy loss) or reward (sent to the "
                                  "service: use_kl_in_reward of " + ", ".join(KL_IN_REWARD) + ")"})
    quiet: bool = field(default=False, metadata={"flag": "--quiet", "help": "no per-step progress lines"})
    csv: str | None = field(default=None, metadata={
        "flag": "--csv", "help": "write one row per RL step (see TrainResult.curve) to this file"})
    plot: str | None = field(default=None, metadata={
        "flag": "--plot", "help": "write held-out accuracy against wall time and samples to this PNG at the "
                                  "end; needs matplotlib (the demo extra)"})
    # task
    n_digits: int = field(default=3, metadata={"flag": "--digits", "help": "digits of each operand"})
    eval_size: int = field(default=500, metadata={"help": "held-out problems (never used for training)"})
    eval_every: int = field(default=5, metadata={"help": "RL steps between held-out evaluations"})
    # policy
    d_model: int = field(default=96, metadata={"help": "transformer width"})
    n_layers: int = field(default=2, metadata={"help": "transformer blocks"})
    n_heads: int = field(default=4, metadata={"help": "attention heads"})
    # warm start (supervised)
    warm_accuracy: float = field(default=0.2, metadata={
        "flag": "--warm-accuracy", "help": "the warm start stops once greedy accuracy on a dev set (not the "
                                           "held-out one) reaches this"})
    warm_check_every: int = field(default=5, metadata={"help": "supervised steps between dev-set checks"})
    warm_max_steps: int = field(default=3000, metadata={"help": "supervised steps of the warm start at most"})
    teacher_steps: int = field(default=400, metadata={
        "flag": "--teacher-steps", "help": "further supervised steps that turn a copy of the warm start into the "
                                           "opd teacher"})
    warm_batch: int = field(default=128, metadata={"help": "problems per supervised step"})
    warm_lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate of the warm start"})
    # RL
    prompts_per_step: int = field(default=64, metadata={"help": "prompts sampled per RL step"})
    group_size: int = field(default=8, metadata={"help": "completions sampled per prompt (G)"})
    prompts_per_chunk: int = field(default=8, metadata={
        "help": "prompts sampled together; each of their groups is sent to the service as soon as the chunk is "
                "done"})
    lr: float = field(default=5e-4, metadata={"help": "AdamW learning rate of the RL phase"})
    lr_warmup_steps: int = field(default=10, metadata={"help": "RL steps over which the learning rate ramps up "
                                                                "linearly from 0 (a fresh Adam's first steps are "
                                                                "full-size whatever the gradient's noise)"})
    clip: float = field(default=0.2, metadata={"help": "ratio clip epsilon of the policy-gradient loss"})
    epochs: int = field(default=2, metadata={"help": "passes over each step's samples"})
    minibatches: int = field(default=2, metadata={"help": "minibatches per pass"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "global gradient norm clip"})
    rpc_threads: int = field(default=4, metadata={"help": "threads calling the service"})
    rpc_timeout: float = field(default=30.0, metadata={"help": "deadline of one advantage call, seconds"})
    threads: int = field(default=1, metadata={"help": "torch intra-op threads (tiny matrices: more threads cost "
                                                      "more than they save)"})


@dataclass
class TrainResult:
    """What a run produced.

    warm_accuracy: held-out greedy accuracy after the warm start; final_accuracy: at the end.
    curve: one row per RL step: (step, samples, wall_s, samples_per_s, accuracy, mean_reward, rpc_share,
    wait_share). wall_s counts the RL phase only; accuracy is the latest held-out evaluation.
    rpc_seconds: wall time during which at least one advantage call was in flight (calls overlap the
    sampling of later groups); wait_seconds: time the trainer was blocked waiting for advantages.
    """

    estimator: str
    warm_accuracy: float
    final_accuracy: float
    steps: int
    samples: int
    wall_seconds: float
    rpc_seconds: float
    wait_seconds: float
    seconds_to_90: float | None  # RL wall time when held-out accuracy first reached 0.9 (None: never)
    curve: list[tuple] = field(default_factory=list)
    #: the run was stopped by Ctrl-C (SIGINT) after ``steps`` steps; what it measured is kept
    interrupted: bool = False


CSV_HEADER = ["step", "samples", "wall_s", "samples_per_s", "heldout_accuracy", "mean_reward", "rpc_share",
              "wait_share"]


# --------------------------------------------------------------------------- task and verifier
PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13  # tokens 0..9 are the digits
VOCAB = 14


def prompt_len(n_digits: int) -> int:
    """Tokens in a prompt: ``a + b =``."""
    return 2 * n_digits + 2


def response_len(n_digits: int) -> int:
    """Tokens in a correct response: ``n_digits + 1`` answer digits and the end token."""
    return n_digits + 2


def digits_of(x: np.ndarray, width: int) -> np.ndarray:
    """``[N]`` int64 -> ``[N, width]`` int64 decimal digits, most significant first."""
    return (x[:, None] // 10 ** np.arange(width - 1, -1, -1)) % 10


def make_problems(rng: np.random.Generator, count: int, n_digits: int,
                  exclude: set[tuple[int, int]] | None = None) -> np.ndarray:
    """``[count, 2]`` int64 operand pairs drawn uniformly from [0, 10**n_digits), none of them in ``exclude``."""
    high = 10 ** n_digits
    pairs = rng.integers(0, high, size=(count, 2))
    if exclude:
        for i in range(count):
            while (int(pairs[i, 0]), int(pairs[i, 1])) in exclude:
                pairs[i] = rng.integers(0, high, size=2)
    return pairs


def encode_prompts(pairs: np.ndarray, n_digits: int) -> torch.Tensor:
    """``[N, 2]`` operands -> ``[N, 2 * n_digits + 2]`` int64 prompt tokens ``a + b =``."""
    n = len(pairs)
    tokens = np.concatenate([digits_of(pairs[:, 0], n_digits), np.full((n, 1), PLUS),
                             digits_of(pairs[:, 1], n_digits), np.full((n, 1), EQUALS)], axis=1)
    return torch.from_numpy(tokens.astype(np.int64))


def answers(pairs: np.ndarray, n_digits: int) -> torch.Tensor:
    """``[N, 2]`` operands -> ``[N, n_digits + 2]`` int64 correct responses: the sum's digits least
    significant first, zero-padded to ``n_digits + 1``, then EOS."""
    digits = digits_of(pairs.sum(1), n_digits + 1)[:, ::-1]
    return torch.from_numpy(np.concatenate([digits, np.full((len(pairs), 1), EOS)], axis=1).astype(np.int64))


def verify(responses: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Score ``[N, R]`` int64 responses against ``[N, R]`` correct ones.

    Returns ``correct`` ``[N]`` float32 (1 when the response is exactly the answer digits and EOS) and
    ``partial`` ``[N]`` float32 (the fraction of the answer's digit positions holding the right digit).
    """
    correct = (responses == target).all(dim=1).float()
    partial = (responses[:, :-1] == target[:, :-1]).float().mean(dim=1)
    return correct, partial


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """``[N, R]`` float32: 1 up to and including the first EOS (every position if there is none), else 0."""
    is_eos = (responses == EOS).long()
    before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before each position
    return (before == 0).float()


# --------------------------------------------------------------------------- policy
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a GELU MLP, both residual."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, d]`` float32 -> ``[B, L, d]``."""
        B, L, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, L, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Decoder-only transformer over the task's 14 tokens: ``[B, L]`` int64 -> ``[B, L, VOCAB]`` logits
    (position i predicts token i + 1)."""

    def __init__(self, max_len: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def response_logprobs(model: TinyLM, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """log pi(response token | prefix): ``[N, P]`` and ``[N, R]`` int64 -> ``[N, R]`` float32."""
    logits = model(torch.cat([prompts, responses], dim=1))[:, prompts.shape[1] - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------- sampler
@torch.no_grad()
def generate(model: TinyLM, prompts: torch.Tensor, length: int, temperature: float = 1.0,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete ``[N, P]`` int64 prompts with ``length`` tokens each, sampled at ``temperature`` (0: greedy).

    Returns ``responses`` ``[N, length]`` int64 (every token after a sequence's first EOS is PAD) and
    ``logprobs`` ``[N, length]`` float32, log pi(token | prefix) of each generated token under the model
    (the sampling policy's log-probabilities, PPO's "old" ones, at temperature 1).
    """
    seqs, done = prompts, torch.zeros(len(prompts), dtype=torch.bool)
    logprobs = []
    for _ in range(length):
        logits = model(seqs)[:, -1].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(dim=-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        logprobs.append(torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1))
        done |= nxt == EOS
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
    return seqs[:, prompts.shape[1]:], torch.stack(logprobs, dim=1)


@torch.no_grad()
def heldout_accuracy(model: TinyLM, prompts: torch.Tensor, target: torch.Tensor) -> float:
    """Greedy exact-match accuracy on ``[N, P]`` prompts against ``[N, R]`` correct responses."""
    correct, _ = verify(generate(model, prompts, target.shape[1], temperature=0.0)[0], target)
    return float(correct.mean())


# --------------------------------------------------------------------------- warm start (supervised)
def supervised(model: TinyLM, rng: np.random.Generator, cfg: LMConfig, steps: int,
               exclude: set[tuple[int, int]], until=None) -> int:
    """Up to ``steps`` AdamW steps of teacher-forced cross-entropy on the response tokens of fresh problems;
    every ``cfg.warm_check_every`` steps, stop early if ``until()`` is true. Returns the steps taken."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warm_lr, weight_decay=0.0)
    for step in range(1, steps + 1):
        pairs = make_problems(rng, cfg.warm_batch, cfg.n_digits, exclude)
        prompts, target = encode_prompts(pairs, cfg.n_digits), answers(pairs, cfg.n_digits)
        loss = -response_logprobs(model, prompts, target).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if until is not None and step % cfg.warm_check_every == 0 and until():
            return step
    return steps


# --------------------------------------------------------------------------- advantages from the service
@dataclass
class Group:
    """One prompt's ``G`` sampled completions and everything the service may need for them.

    prompt: ``[P]`` int64; responses, mask ``[G, R]`` (int64, float32); correct, partial ``[G]`` float32
    (the verifier's components; the scalar reward is ``correct``); logprobs ``[G, R]`` float32 (the
    sampling policy's), ref_logprobs / teacher_logprobs ``[G, R]`` float32 or None.
    """

    prompt: torch.Tensor
    responses: torch.Tensor
    mask: torch.Tensor
    correct: torch.Tensor
    partial: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None


def estimator_config(cfg: LMConfig) -> dict:
    """The config dict sent with every call (NeMo RL key names; see the README's estimator table)."""
    config: dict = {}
    if cfg.semantics:
        config["semantics"] = cfg.semantics
    if cfg.kl_coef > 0 and cfg.kl_in == "reward":
        config.update(use_kl_in_reward=True, reference_policy_kl_penalty=cfg.kl_coef,
                      reference_policy_kl_type=cfg.kl_type)
    return config


def advantages_for_group(client: AdvantageClient, estimator: str, config: dict, group: Group) -> np.ndarray:
    """One ``compute`` call for one prompt group: ``[G, R]`` float32 advantages. Positions where the mask is
    0 may hold values (NeMo RL's semantics broadcast a row's advantage to all of them); the loss masks them.

    What each estimator is sent: the group estimators the scalar reward ``[G]`` with the prompt's token
    row as ``prompt_ids`` (identical rows are one group); gdpo two ``reward/<name>`` components instead;
    opd the teacher's and the sampling policy's log-probabilities; with KL in the reward, the sampling
    policy's and the warm-start policy's log-probabilities.
    """
    G = len(group.responses)
    tensors: dict = {"mask": group.mask}
    if estimator == "opd":
        tensors.update(teacher_logprobs=group.teacher_logprobs, prev_logprobs=group.logprobs)
    else:
        tensors["prompt_ids"] = group.prompt.expand(G, -1)
        if estimator == "gdpo":
            tensors.update({"reward/correct": group.correct, "reward/partial": group.partial})
        else:
            tensors["rewards"] = group.correct
        if config.get("use_kl_in_reward"):
            tensors.update(logprobs=group.logprobs, reference_logprobs=group.ref_logprobs)
    return client.compute(estimator, config, as_numpy=True, **tensors).advantages


class AdvantageRequests:
    """Sends each group to the service as soon as it is sampled and hands back the results in order.

    A thread pool around the synchronous client: ``submit`` returns at once, ``results`` blocks until
    every submitted group is answered. An asyncio client would replace this class only (``submit``
    creates a task, ``results`` gathers them).
    """

    def __init__(self, client: AdvantageClient, estimator: str, config: dict, threads: int):
        self.client, self.estimator, self.config = client, estimator, config
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="advantage-rpc")
        self.pending: list[concurrent.futures.Future] = []
        self.rpc_seconds = 0.0  # wall time during which at least one call was in flight
        self.wait_seconds = 0.0  # time ``results`` blocked
        self._lock, self._in_flight, self._busy_since = threading.Lock(), 0, 0.0

    def _call(self, group: Group) -> np.ndarray:
        with self._lock:
            self._in_flight += 1
            if self._in_flight == 1:
                self._busy_since = time.perf_counter()
        try:
            return advantages_for_group(self.client, self.estimator, self.config, group)
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.rpc_seconds += time.perf_counter() - self._busy_since

    def submit(self, group: Group) -> None:
        self.pending.append(self.pool.submit(self._call, group))

    def results(self) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = [f.result() for f in self.pending]
        self.wait_seconds += time.perf_counter() - t0
        self.pending = []
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- RL step
@dataclass
class Batch:
    """A step's samples, groups stacked: prompts ``[N, P]``, responses ``[N, R]`` int64; mask, logprobs,
    ref_logprobs (or None), advantages ``[N, R]`` float32; correct ``[N]`` float32."""

    prompts: torch.Tensor
    responses: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    correct: torch.Tensor


def rollout(policy: TinyLM, reference: TinyLM | None, teacher: TinyLM | None, requests: AdvantageRequests,
            pairs: np.ndarray, cfg: LMConfig, generator: torch.Generator) -> Batch:
    """Sample ``group_size`` completions for each of the ``[M, 2]`` problems, ``prompts_per_chunk`` prompts
    at a time; after each chunk, score it and send each of its groups to the service."""
    G, R = cfg.group_size, response_len(cfg.n_digits)
    pieces = []
    for start in range(0, len(pairs), cfg.prompts_per_chunk):
        chunk = pairs[start:start + cfg.prompts_per_chunk]
        prompts = encode_prompts(chunk, cfg.n_digits).repeat_interleave(G, dim=0)  # [C*G, P], groups contiguous
        responses, logprobs = generate(policy, prompts, R, 1.0, generator)
        mask = response_mask(responses)
        logprobs = logprobs * mask
        correct, partial = verify(responses, answers(chunk, cfg.n_digits).repeat_interleave(G, dim=0))
        with torch.no_grad():
            ref = response_logprobs(reference, prompts, responses) * mask if reference is not None else None
            teach = response_logprobs(teacher, prompts, responses) * mask if teacher is not None else None
        for g in range(len(chunk)):
            rows = slice(g * G, (g + 1) * G)
            requests.submit(Group(prompt=prompts[g * G], responses=responses[rows], mask=mask[rows],
                                  correct=correct[rows], partial=partial[rows], logprobs=logprobs[rows],
                                  ref_logprobs=None if ref is None else ref[rows],
                                  teacher_logprobs=None if teach is None else teach[rows]))
        pieces.append((prompts, responses, mask, logprobs, ref, correct))
    advantages = torch.from_numpy(np.concatenate(requests.results()))  # blocks until every group is answered

    def cat(i: int) -> torch.Tensor | None:
        return None if pieces[0][i] is None else torch.cat([p[i] for p in pieces])
    return Batch(prompts=cat(0), responses=cat(1), mask=cat(2), logprobs=cat(3), ref_logprobs=cat(4),
                 advantages=advantages, correct=cat(5))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from ``[N, R]`` log-probabilities of the sampled tokens:
    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with log r = logprobs - ref_logprobs."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    return torch.exp(-log_ratio) - 1 + log_ratio


def policy_update(policy: TinyLM, optimizer: torch.optim.Optimizer, batch: Batch, cfg: LMConfig,
                  rng: np.random.Generator) -> None:
    """Clipped policy-gradient loss over the response tokens under the mask, averaged over the minibatch's
    valid tokens; plus ``kl_coef`` times the KL to the warm-start policy when ``kl_in == "loss"``."""
    n = len(batch.prompts)
    size = n // cfg.minibatches
    for _ in range(cfg.epochs):
        order = torch.from_numpy(rng.permutation(n))
        for start in range(0, size * cfg.minibatches, size):
            idx = order[start:start + size]
            mask, adv = batch.mask[idx], batch.advantages[idx]
            logprobs = response_logprobs(policy, batch.prompts[idx], batch.responses[idx])
            ratio = torch.exp(logprobs - batch.logprobs[idx])
            per_token = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
            if cfg.kl_coef > 0 and cfg.kl_in == "loss":
                per_token = per_token + cfg.kl_coef * kl_penalty(logprobs, batch.ref_logprobs[idx], cfg.kl_type)
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()


# --------------------------------------------------------------------------- training loop
@dataclass
class WarmStart:
    """The warm-start policy (and the opd teacher, when one was trained), the held-out set, the training
    problems to avoid and the RNG state after the warm start."""

    policy: TinyLM
    teacher: TinyLM | None
    heldout_prompts: torch.Tensor
    heldout_target: torch.Tensor
    exclude: set[tuple[int, int]]
    steps: int
    accuracy: float
    teacher_accuracy: float | None


def warm_start(cfg: LMConfig, with_teacher: bool) -> WarmStart:
    """Build the policy from ``cfg.seed`` and run the supervised warm start (and the teacher's, if asked)."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    heldout = make_problems(np.random.default_rng(HELD_OUT_SEED), cfg.eval_size, cfg.n_digits)
    exclude = {(int(a), int(b)) for a, b in heldout}
    prompts, target = encode_prompts(heldout, cfg.n_digits), answers(heldout, cfg.n_digits)
    dev = make_problems(np.random.default_rng(HELD_OUT_SEED + 1), cfg.eval_size, cfg.n_digits, exclude)
    dev_prompts, dev_target = encode_prompts(dev, cfg.n_digits), answers(dev, cfg.n_digits)
    policy = TinyLM(prompt_len(cfg.n_digits) + response_len(cfg.n_digits), cfg.d_model, cfg.n_layers, cfg.n_heads)
    steps = supervised(policy, rng, cfg, cfg.warm_max_steps, exclude,
                       until=lambda: heldout_accuracy(policy, dev_prompts, dev_target) >= cfg.warm_accuracy)
    teacher, teacher_acc = None, None
    if with_teacher:
        teacher = copy.deepcopy(policy)
        supervised(teacher, np.random.default_rng(cfg.seed + 1), cfg, cfg.teacher_steps, exclude)
        teacher_acc = heldout_accuracy(teacher, prompts, target)
    return WarmStart(policy=policy, teacher=teacher, heldout_prompts=prompts, heldout_target=target,
                     exclude=exclude, steps=steps, accuracy=heldout_accuracy(policy, prompts, target),
                     teacher_accuracy=teacher_acc)


def compared_estimators(cfg: LMConfig) -> list[str]:
    """The estimators a run trains with: ``--compare``'s comma-separated names, else ``--estimator``. Raises
    ValueError naming ``--compare`` for an empty or unknown name there (with a suggestion and the names this
    demo runs)."""
    if not cfg.compare:
        return [cfg.estimator]
    names = [e.strip() for e in cfg.compare.split(",")]
    for name in names:
        if not name:
            raise ValueError(f"--compare {cfg.compare!r} has an empty name: give comma-separated estimators, "
                             f"e.g. --compare grpo,rloo (this demo runs {', '.join(ESTIMATORS)})")
        if name not in ESTIMATORS:
            raise ValueError(f"--compare {cfg.compare!r}: {name!r} is not an estimator this demo runs."
                             f"{wire.did_you_mean(name, ESTIMATORS, wire.ESTIMATOR_ALIASES)} Choose from "
                             f"{', '.join(ESTIMATORS)}")
    return names


def check_config(cfg: LMConfig) -> None:
    """Raise ValueError for an estimator, KL option or ``--semantics`` this demo does not run, before any
    training (``--semantics`` is checked as the server checks the config: an unknown name, or one that
    ``cfg.estimator`` does not offer)."""
    if cfg.estimator not in ESTIMATORS:
        raise ValueError(f"--estimator {cfg.estimator!r} is not an estimator this demo runs."
                         f"{wire.did_you_mean(cfg.estimator, ESTIMATORS, wire.ESTIMATOR_ALIASES)} "
                         f"Choose one of {', '.join(ESTIMATORS)}")
    if cfg.kl_type not in ("k1", "k2", "k3") or cfg.kl_in not in ("loss", "reward"):
        raise ValueError(f"--kl-type {cfg.kl_type!r} --kl-in {cfg.kl_in!r}: choose k1, k2 or k3 and loss or reward")
    if cfg.kl_coef > 0 and cfg.kl_in == "reward" and cfg.estimator not in KL_IN_REWARD:
        raise ValueError(f"--kl-in reward needs one of {', '.join(KL_IN_REWARD)}, not {cfg.estimator}")
    spec = REGISTRY[cfg.estimator]
    if cfg.semantics and "semantics" not in {f.name for f in dataclasses.fields(spec.config)}:
        raise ValueError(f"--semantics {cfg.semantics!r}: {cfg.estimator} has one semantics only; drop "
                         f"--semantics{' (or run ' + cfg.estimator + ' apart from --compare)' if cfg.compare else ''}")
    try:
        config = config_from_dict(spec, estimator_config(cfg))
        config.validate()
        config.resolved()
    except ValueError as exc:
        flag = f"--semantics {cfg.semantics!r}" if cfg.semantics and "semantics" in str(exc) else "the options"
        raise ValueError(f"{flag} with {cfg.estimator}: {exc}") from None


def train_rl(cfg: LMConfig, client: AdvantageClient, start: WarmStart) -> TrainResult:
    """The RL phase from ``start`` (copied, not changed) with ``cfg.estimator``; deterministic for a seed."""
    check_config(cfg)
    if cfg.estimator == "opd" and start.teacher is None:
        raise ValueError("opd needs a warm start with a teacher")
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed + 7)
    generator = torch.Generator().manual_seed(cfg.seed)
    policy = copy.deepcopy(start.policy)
    reference = start.policy if cfg.kl_coef > 0 else None
    teacher = start.teacher if cfg.estimator == "opd" else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    requests = AdvantageRequests(client, cfg.estimator, estimator_config(cfg), cfg.rpc_threads)
    accuracy, samples, step, seconds_to_90 = start.accuracy, 0, 0, None
    curve: list[tuple] = []
    with ExitStack() as stack:
        stack.callback(requests.close)
        writer = None
        if cfg.csv:
            writer = csv.writer(stack.enter_context(open(cfg.csv, "w", newline="")))
            writer.writerow(CSV_HEADER)
        if not cfg.quiet:
            print(f"[{cfg.estimator}] RL from the warm start ({100 * accuracy:.1f}%), one line a step; rpc: the share of "
                  "wall time with an advantage call in flight, waiting: the share the trainer spent blocked on one",
                  flush=True)
        t0 = time.perf_counter()
        interrupted = False
        try:
            while step < cfg.max_steps and time.perf_counter() - t0 < cfg.rl_seconds:
                step += 1
                for group in optimizer.param_groups:
                    group["lr"] = cfg.lr * min(1.0, step / max(cfg.lr_warmup_steps, 1))
                pairs = make_problems(rng, cfg.prompts_per_step, cfg.n_digits, start.exclude)
                batch = rollout(policy, reference, teacher, requests, pairs, cfg, generator)
                policy_update(policy, optimizer, batch, cfg, rng)
                samples += len(batch.prompts)
                if step % cfg.eval_every == 0:
                    accuracy = heldout_accuracy(policy, start.heldout_prompts, start.heldout_target)
                wall = time.perf_counter() - t0
                if seconds_to_90 is None and accuracy >= 0.9:
                    seconds_to_90 = wall
                row = (step, samples, wall, samples / wall, accuracy, float(batch.correct.mean()),
                       requests.rpc_seconds / wall, requests.wait_seconds / wall)
                curve.append(row)
                if writer is not None:
                    writer.writerow([step, samples, f"{wall:.2f}", f"{row[3]:.1f}", f"{accuracy:.4f}", f"{row[5]:.4f}",
                                     f"{row[6]:.4f}", f"{row[7]:.4f}"])
                if not cfg.quiet:
                    print(f"[{cfg.estimator}] step {step:4d} | samples {samples:7d} | {row[3]:5.0f} samples/s | "
                          f"held-out {100 * accuracy:5.1f}% | mean reward {row[5]:.3f} | rpc {100 * row[6]:4.1f}% "
                          f"(waiting {100 * row[7]:4.1f}%) | {wall:5.1f}s", flush=True)
                if accuracy >= cfg.target_accuracy:
                    break
        except KeyboardInterrupt:  # Ctrl-C: keep the steps measured so far (CSV rows, the plot)
            interrupted = True
            print(f"[{cfg.estimator}] stopped by Ctrl-C after {len(curve)} RL steps: keeping what they measured",
                  flush=True)
    wall = time.perf_counter() - t0
    return TrainResult(estimator=cfg.estimator, warm_accuracy=start.accuracy, final_accuracy=accuracy, steps=step,
                       samples=samples, wall_seconds=wall, rpc_seconds=requests.rpc_seconds,
                       wait_seconds=requests.wait_seconds, seconds_to_90=seconds_to_90, curve=curve,
                       interrupted=interrupted)


def run_csv(csv_path: str | None, estimator: str, runs: int) -> str | None:
    """The CSV file of ``estimator``'s run: ``csv_path`` itself for a single run, ``lm.<estimator>.csv`` beside it
    when ``runs`` estimators are compared (``--compare``)."""
    if not csv_path or runs == 1:
        return csv_path
    return str(pathlib.Path(csv_path).with_suffix(f".{estimator}.csv"))


def train(cfg: LMConfig) -> list[TrainResult]:
    """Warm start once, then one RL run per estimator (``cfg.compare`` or ``cfg.estimator``), each from the
    same warm start and seed, through an in-process server unless ``cfg.server`` names one."""
    estimators = compared_estimators(cfg)
    for name in estimators:  # every name and option before the warm start (25-60 s)
        check_config(replace(cfg, estimator=name))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    with ExitStack() as stack:
        stack.callback(torch.set_num_threads, threads)
        client = connect(stack, cfg.server, cfg.rpc_timeout, announce=not cfg.quiet)
        t0 = time.perf_counter()
        start = warm_start(cfg, with_teacher="opd" in estimators)
        if not cfg.quiet:
            teacher = "" if start.teacher_accuracy is None else \
                f"; opd teacher ({cfg.teacher_steps} more steps) {100 * start.teacher_accuracy:.1f}%"
            print(f"warm start: {start.steps} supervised steps in {time.perf_counter() - t0:.1f}s, held-out "
                  f"greedy accuracy {100 * start.accuracy:.1f}%{teacher}", flush=True)
        results = []
        for name in estimators:
            csv_path = run_csv(cfg.csv, name, len(estimators))
            results.append(train_rl(replace(cfg, estimator=name, csv=csv_path), client, start))
            if results[-1].interrupted:  # Ctrl-C stops the comparison too
                break
    return results


# --------------------------------------------------------------------------- plots
def thousands(x: float, _pos: object = None) -> str:
    """A tick label for a count: ``0``, ``500``, ``50k``, ``175k``, ``1.2M`` (short, so the ticks of a panel do not
    run together as ``175000200000`` did)."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:.3g}M"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.3g}k"
    return f"{x:.0f}"


def plot_curves(results: list[TrainResult], path: str, n_digits: int = 3, target: float = 0.9) -> None:
    """Held-out greedy accuracy against RL wall time (left) and samples (right), one line per run. Each run
    starts at 0 from its supervised warm start (marked, with its accuracy); the dashed line is the ``target``
    accuracy, labelled. Counts are written ``50k``. Needs matplotlib (``pip install 'advantage-service[demo]'``)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'advantage-service[demo]'") from None
    matplotlib.use("Agg")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100, sharey=True)
    for r in results:
        wall = [0.0] + [row[2] for row in r.curve]
        samples = [0] + [row[1] for row in r.curve]
        acc = [100 * r.warm_accuracy] + [100 * row[4] for row in r.curve]
        line, = axes[0].plot(wall, acc, lw=1.8, label=r.estimator)
        axes[1].plot(samples, acc, lw=1.8, label=r.estimator, color=line.get_color())
    warm = 100 * results[0].warm_accuracy if results else 0.0
    for ax, label in zip(axes, ("RL wall time (s)", "sampled completions")):
        ax.axhline(100 * target, color="grey", ls="--", lw=1)
        ax.text(0.01, 100 * target + 1.5, f"target {100 * target:.0f}%", transform=ax.get_yaxis_transform(),
                color="grey", fontsize=8)
        ax.plot([0], [warm], marker="o", color="black", ms=5, zorder=3)
        ax.annotate(f"supervised warm start ({warm:.0f}%)", (0, warm), xytext=(8, -14), textcoords="offset points",
                    fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylim(0, 100)
        ax.set_xlim(left=0)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.grid(alpha=0.3)
    axes[1].xaxis.set_major_formatter(FuncFormatter(thousands))
    axes[0].set_ylabel("held-out greedy accuracy (%)")
    axes[1].legend(loc="lower right", fontsize=8)
    names = ", ".join(r.estimator for r in results)
    fig.suptitle(f"Tiny transformer on {n_digits}-digit addition, advantages from the service ({names})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flag`` fields of :class:`LMConfig` as options."""
    add_config_arguments(parser, LMConfig)


def main(argv: list[str] | None = None) -> int:
    """``advantage-demo lm [options]``; returns the exit code (0 done, 2 bad option or service error)."""
    parser = argparse.ArgumentParser(prog="advantage-demo lm", description=__doc__.split("\n\n")[0].strip("` "))
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm"]:
        argv = argv[1:]
    cfg = LMConfig(**vars(parser.parse_args(argv)))
    try:
        results = train(cfg)
    except AdvantageServiceError as exc:
        print(f"advantage-demo: advantage service error ({exc.code.name}): {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"advantage-demo: {exc}", file=sys.stderr)
        return 2
    for r in results:
        reached = "never" if r.seconds_to_90 is None else f"{r.seconds_to_90:.0f}s"
        print(f"[{r.estimator}] held-out greedy accuracy {100 * r.warm_accuracy:.1f}% -> {100 * r.final_accuracy:.1f}% "
              f"| 90% reached: {reached} | steps {r.steps} | samples {r.samples} | RL wall {r.wall_seconds:.1f}s | "
              f"rpc {100 * r.rpc_seconds / r.wall_seconds:.1f}% (waiting {100 * r.wait_seconds / r.wall_seconds:.1f}%)",
              flush=True)
    if cfg.plot:
        plot_curves(results, cfg.plot, cfg.n_digits, cfg.target_accuracy)
        print(f"learning curve written to {cfg.plot}", flush=True)
    if cfg.csv and not cfg.quiet:
        print(f"per-step figures written to {run_csv(cfg.csv, '<estimator>', len(results))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
