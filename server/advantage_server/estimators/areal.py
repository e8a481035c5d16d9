"""AReaL's advantage pipeline: AReaL 1.0.4 ``PPOActor._compute_advantages`` (``areal/trainer/ppo/actor.py``)
with its ``Normalization`` and ``KLEstimator`` (``areal/utils/data.py``), reproduced as released.

Why an estimator of its own (``areal``) and not ``semantics = areal`` on ``gae`` and ``grpo``: AReaL has one
function for both. Its PPO and its GRPO are the same pipeline (GRPO = group-level reward normalisation, no
critic values, discount 1, lambda 1), and that pipeline shares little with the service's ``gae`` or ``grpo``:
it reads an input neither has (``attention_mask``: the sequence lengths, and whether a row reached the padded
width), shifts the loss mask and the log-probs by one position (circularly), puts the reward on the token
before the last one rather than on the last trained token, groups rows by fixed contiguous blocks of
``group_size`` rather than by ``prompt_ids``, and has a dozen config fields (reward bias, scaling and clip, two
``NormConfig``s, ``kl_ctl``, ``mask_no_eos_with_zero``, ...) that would apply to no other semantics of those
estimators. One estimator with AReaL's config names keeps AReaL's configuration one-to-one; its ``semantics``
field has one value, ``areal``, which names the release. Reachable "as gae": send ``values``; "as grpo": the
configuration below.

Pipeline, per batch (B rows, padded width T; position t of every output scores token t + 1, AReaL's frame):

1. ``r = clip((rewards + reward_bias) * reward_scaling, -reward_clip, reward_clip)`` [B], then
   ``reward_norm`` (:func:`normalize`, no mask) when set.
2. ``lm = roll(mask, -1)`` along T, circular: ``lm[t] = mask[t + 1]`` and ``lm[T - 1] = mask[0]``.
3. ``seqlen = sum_t attention_mask``; a row with ``seqlen = T`` has no end token (``no_eos``).
4. Token rewards ``[B, T]`` (float32): ``-kl_ctl * KL(old * lm, ref * lm)`` with ``old = roll(logprobs, -1)``
   (``logprobs`` itself when ``recompute_logprob`` and not ``use_decoupled_loss``: AReaL's ``prox_logp``,
   already shifted), ``ref = reference_logprobs`` (0 when absent), KL ``k1 = old - ref``, ``k2 = k1^2 / 2``,
   ``k3 = exp(-k1) - 1 + k1``, in float32 whatever the inputs' dtype, clamped to +-10; then set to 0 at
   ``seqlen - 1`` (the last column for ``seqlen = 0``) and ``r`` added at ``max(seqlen - 2, 0)`` (not for
   ``no_eos`` rows when ``mask_no_eos_with_zero``). So a row whose last token has ``mask`` 0 has
   ``lm[seqlen - 2] = 0`` and loses its reward (the GAE step skips it).
5. GAE backwards over ``t = T - 2 .. 0``, skipping ``lm = 0`` positions (they carry the running advantage):
   ``delta_t = tr_t + discount * V_next - V_t``, ``A_t = delta_t + discount * gae_lambda * A_next``, ``V_next``
   starting at ``values[:, T - 1]`` for ``no_eos`` rows (bootstrapped) and 0 otherwise; ``A[:, T - 1] = 0``.
   ``values`` absent: 0 (AReaL's GRPO). In the values' dtype (float32 without values).
6. ``returns = A + values``; advantages = ``adv_norm(A, lm)`` when set (masked positions 0; A unchanged when
   ``lm`` is all 0), else A (masked positions NOT zeroed: they carry the running advantage).

Normalization (:func:`normalize`, AReaL's ``NormConfig``): ``(x - mean) / (std + eps)``, as float32.
``mean_level`` / ``std_level``: ``batch`` (over every element of the batch sent: AReaL all-reduces over the
data-parallel batch, so send the whole batch in one call), ``group`` (fixed contiguous blocks of
``group_size`` rows; rows after the last full block keep mean 0 and std 0, i.e. ``x / eps``) or ``none``
(mean 0; std 1 with eps 0). With a mask, sums and counts are over mask = 1 elements. Leave-one-out mean:
``(sum - x) / max(n - mask, 1)`` at mask = 1 elements, the plain mean elsewhere, 0 for a block with n <= 1
and for group_size 1. Std around those (per-element) means: ``sqrt(sum (x m - mean m)^2 / (n - 1))``
(unbiased; 1 when n <= 1 and for group_size 1) or ``/ n`` (1 when n = 0). Statistics in float64; group-level
ones stored in a buffer of x's dtype (float32 for float32 inputs), batch-level ones kept in float64.

Where AReaL is not finite the service answers: ``eps`` must be > 0 (AReaL divides by zero with eps = 0 and a
zero std); everything else in this pipeline is finite in AReaL for finite inputs. Not covered: AReaL's
``overlong_reward_penalty`` (apply it to ``rewards`` before the call).

No ``group_local`` declaration (batch-level statistics, and groups are row blocks, not ``prompt_ids``) and no
per-sample layout (advantages vary along T under KL, discount < 1 or values, and masked positions carry
values). Reference: AReaL 1.0.4 (``areal==1.0.4``), differential-tested in tests/test_diff_areal.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from advantage_server.errors import InvalidInput
from advantage_server.estimators.registry import AdvantageResult, Batch, EstimatorConfig, InputSpec, register, \
    semantics_field

_LEVELS = ("batch", "group", "none")


@dataclass(frozen=True)
class ArealNormConfig:
    """AReaL ``NormConfig`` (``areal/api/cli_args.py``), the ``ArealNormConfig`` proto message."""

    #: the proto message this dataclass reads (ListEstimators shows it as the field's type)
    MESSAGE = "ArealNormConfig"

    mean_level: str = field(default="batch", metadata={"doc": "batch, group or none.", "choices": _LEVELS})
    mean_leave1out: bool = field(default=False, metadata={"doc": "Leave-one-out mean."})
    std_level: str = field(default="batch", metadata={"doc": "batch, group or none.", "choices": _LEVELS})
    std_unbiased: bool = field(default=True, metadata={"doc": "Unbiased (n - 1) std."})
    eps: float = field(default=1e-5, metadata={"doc": "Added to the std; > 0.", "range": (0.0, None), "open": True})
    group_size: int = field(default=1, metadata={"doc": "Rows per group block; >= 1.", "range": (1, None)})

    def validate(self, name: str) -> None:
        """Raise :class:`InvalidInput` naming ``config.<name>.<field>`` for an out-of-range value."""
        try:
            EstimatorConfig.validate(self)  # the same field checks as a top-level config
        except InvalidInput as err:
            raise InvalidInput([(f.replace("config.", f"config.{name}.", 1), d) for f, d in err.violations]) from None


def _norm_field(doc: str) -> object:
    return field(default=None, metadata={"doc": doc, "message": ArealNormConfig, "default_text": "unset (none)"})


@dataclass(frozen=True)
class ArealConfig(EstimatorConfig):
    reward_bias: float = field(default=0.0, metadata={"doc": "Added to each reward first."})
    reward_scaling: float = field(default=1.0, metadata={"doc": "Multiplies (reward + reward_bias)."})
    reward_clip: float = field(default=20.0, metadata={"doc": "Clip the scaled reward to +-reward_clip."})
    reward_norm: ArealNormConfig | None = _norm_field(
        "Normalise the [B] rewards (AReaL NormConfig); unset = none. AReaL's GRPO: mean_level and std_level group, "
        "group_size = samples per prompt (rows of a prompt contiguous).")
    kl_ctl: float = field(default=0.1, metadata={"doc": "KL coefficient in the token rewards (0 = no KL)."})
    kl_estimator: str = field(default="k1", metadata={
        "doc": "KL estimator: k1, k2 or k3 (float32, clamped to +-10).", "enum": "KLType", "choices": ("k1", "k2", "k3")})
    discount: float = field(default=1.0, metadata={"doc": "GAE discount.", "range": (0.0, 1.0)})
    gae_lambda: float = field(default=1.0, metadata={"doc": "GAE lambda.", "range": (0.0, 1.0)})
    adv_norm: ArealNormConfig | None = _norm_field(
        "Normalise the advantages over the shifted loss mask (AReaL NormConfig); unset = none.")
    mask_no_eos_with_zero: bool = field(default=False, metadata={
        "doc": "Drop the reward of rows without an end token (sum(attention_mask) = T)."})
    recompute_logprob: bool = field(default=False, metadata={
        "doc": "With use_decoupled_loss false: logprobs is AReaL's prox_logp (already shifted; not rolled)."})
    use_decoupled_loss: bool = field(default=False, metadata={"doc": "AReaL's decoupled loss (logprobs rolled)."})
    semantics: str | None = semantics_field(
        ("areal",), "Reference reproduced: areal (PPOActor._compute_advantages with Normalization and KLEstimator).")

    def validate(self) -> None:
        super().validate()
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ArealNormConfig):
                value.validate(f.name)


_LOGPROBS_DOC = ("AReaL's data['logprobs'] [B, T] as in its batch (the service rolls it by -1), or its prox_logp "
                 "(not rolled) with recompute_logprob and not use_decoupled_loss.")


# --------------------------------------------------------------------------- normalisation
def _block_mean(x: torch.Tensor, m: torch.Tensor | None, loo: bool) -> torch.Tensor:
    """Per block mean of ``x`` ``[G, K]`` (float64) over ``m``'s 1-elements (all without a mask):
    ``[G, 1]``, or ``[G, K]`` per element for the leave-one-out mean (module docstring)."""
    n = torch.full((x.shape[0], 1), float(x.shape[1]), dtype=torch.float64, device=x.device) if m is None \
        else m.sum(1, keepdim=True)
    xm = x if m is None else x * m
    total = xm.sum(1, keepdim=True)
    if loo:
        if m is None:
            out = (total - x) / (n - 1).clamp(min=1)
        else:
            out = torch.where(m > 0, (total - xm) / (n - m).clamp(min=1.0), total / n.clamp(min=1))
        return torch.where(n <= 1, torch.zeros_like(out), out)
    return torch.where(n == 0, torch.zeros_like(total), total / n.clamp(min=1))


def _block_std(x: torch.Tensor, m: torch.Tensor | None, mean: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Per block std ``[G, 1]`` (float64) of ``x`` ``[G, K]`` around ``mean`` (``[G, 1]`` or ``[G, K]``)."""
    if m is None:
        n = torch.full((x.shape[0], 1), float(x.shape[1]), dtype=torch.float64, device=x.device)
        d = x - mean
    else:
        n = m.sum(1, keepdim=True)
        d = x * m - mean * m
    ss = (d * d).sum(1, keepdim=True)
    one = torch.ones_like(ss)
    if unbiased:
        return torch.where(n <= 1, one, (ss / (n - 1).clamp(min=1)).sqrt())
    return torch.where(n == 0, one, (ss / n.clamp(min=1)).sqrt())


def _blocks(t: torch.Tensor | None, rows: int, size: int) -> torch.Tensor | None:
    """The first ``rows`` rows of ``t`` as float64 blocks ``[rows / size, size * rest]``."""
    return None if t is None else t[:rows].to(torch.float64).reshape(rows // size, -1)


def normalize(x: torch.Tensor, mask: torch.Tensor | None, cfg: ArealNormConfig) -> torch.Tensor:
    """AReaL ``Normalization(cfg)(x, mask)``: ``x`` ``[B]`` or ``[B, T]``, ``mask`` None or ``[B, T]``.

    Returns float32 ``(x - mean) * mask / (std + eps)`` (module docstring); ``x`` as float32 when ``mask`` is
    all 0. Group statistics are rounded to x's dtype as AReaL stores them, batch ones stay float64.
    """
    if mask is not None and not bool(mask.any()):
        return x.float()
    B = x.shape[0]
    gs = cfg.group_size
    full = (B // gs) * gs
    shape = x[:full].shape

    if cfg.mean_level == "batch":
        mean = _block_mean(_blocks(x, B, B), _blocks(mask, B, B), cfg.mean_leave1out).expand(1, x.numel())
        mean = mean.reshape(x.shape)
    else:
        mean = torch.zeros_like(x)
        if cfg.mean_level == "group" and full and not (gs == 1 and cfg.mean_leave1out):
            g = _block_mean(_blocks(x, full, gs), _blocks(mask, full, gs), cfg.mean_leave1out)
            mean[:full] = g.expand(full // gs, x[:full].numel() // max(full // gs, 1)).reshape(shape).to(x.dtype)
    centred = x - mean
    if mask is not None:
        centred = centred * mask

    eps = cfg.eps
    if cfg.std_level == "batch":
        std = _block_std(_blocks(x, B, B), _blocks(mask, B, B), _blocks(mean, B, B), cfg.std_unbiased)
        std = std.reshape((1,) * x.dim())
    elif cfg.std_level == "group":
        std = torch.zeros_like(x)
        if full and gs == 1 and cfg.std_unbiased:
            std[:full] = 1.0
        elif full:
            s = _block_std(_blocks(x, full, gs), _blocks(mask, full, gs), _blocks(mean, full, gs), cfg.std_unbiased)
            std[:full] = s.expand(full // gs, x[:full].numel() // (full // gs)).reshape(shape).to(x.dtype)
    else:
        std = torch.ones_like(x)
        eps = 0.0
    return (centred / (std + eps)).float()


# --------------------------------------------------------------------------- KL and GAE
def kl_estimate(old: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """AReaL ``KLEstimator(kind)(old, ref)``: float32 ``[B, T]``, clamped to +-10 (module docstring)."""
    log_ratio = old.float() - ref.float()
    if kind == "k2":
        log_ratio = log_ratio ** 2 / 2.0
    elif kind == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    return log_ratio.clamp(min=-10, max=10)


def gae_shifted(token_rewards: torch.Tensor, values: torch.Tensor, lm: torch.Tensor, no_eos: torch.Tensor,
                discount: float, lam: float) -> torch.Tensor:
    """AReaL's GAE loop (step 5): advantages ``[B, T]`` in ``values``' dtype, column T - 1 zero.

    token_rewards ``[B, T]`` float32, values ``[B, T]``, lm ``[B, T]`` 0/1 (the shifted loss mask), no_eos
    ``[B]`` bool. Each step is AReaL's arithmetic in the values' dtype (the float32 loop rounds as AReaL's does:
    the coefficients are rounded to it, one operation at a time), on numpy column vectors.
    """
    B, T = values.shape
    dt = np.dtype(str(values.dtype).replace("torch.", ""))
    r = token_rewards.to(values.dtype).T.contiguous().cpu().numpy()
    v = values.T.contiguous().cpu().numpy()
    keep = lm.T.contiguous().cpu().numpy() != 0
    g, gl = dt.type(discount), dt.type(discount * lam)
    out = np.zeros((T, B), dtype=dt)
    next_v = np.where(no_eos.cpu().numpy(), v[T - 1], dt.type(0))
    running = np.zeros(B, dtype=dt)
    for t in range(T - 2, -1, -1):
        step = (r[t] + g * next_v - v[t]) + gl * running
        next_v = np.where(keep[t], v[t], next_v)
        running = np.where(keep[t], step, running)
        out[t] = running
    return torch.from_numpy(np.ascontiguousarray(out.T)).to(values.device)


@register(
    "areal", config=ArealConfig,
    inputs=[
        InputSpec("rewards", ("[B]",), "float", "AReaL's data['rewards']: one reward per row.",
                  fix="send one reward per sample (AReaL's data['rewards'])"),
        InputSpec("mask", ("[B, T]",), "mask",
                  "AReaL's data['loss_mask'] as in its batch (before the shift): 1 on trained tokens. Defines B and "
                  "T; T is the padded width (a row with sum(attention_mask) = T has no end token).",
                  fix="send AReaL's [B, T] loss_mask"),
        InputSpec("attention_mask", ("[B, T]",), "mask",
                  "AReaL's data['attention_mask']: its row sums are the sequence lengths.",
                  fix="send AReaL's [B, T] attention_mask"),
        InputSpec("logprobs", ("[B, T]",), "float", _LOGPROBS_DOC,
                  fix="send AReaL's data['logprobs'] (they are multiplied by kl_ctl; any values with kl_ctl = 0)"),
        InputSpec("reference_logprobs", ("[B, T]",), "float",
                  "AReaL's data['ref_logp'] (already shifted); absent = 0 as in AReaL.", required=False),
        InputSpec("values", ("[B, T]",), "float", "AReaL's data['values'] (critic); absent = 0 (AReaL's GRPO).",
                  required=False),
    ],
    reference="AReaL 1.0.4 PPOActor._compute_advantages (areal/trainer/ppo/actor.py), Normalization and "
              "KLEstimator (areal/utils/data.py)",
    produces_returns=True,
)
def areal(cfg: ArealConfig, batch: Batch) -> AdvantageResult:
    """AReaL's whole advantage pipeline (reward scaling and normalisation, KL, shifted GAE, advantage normalisation).

    Inputs: rewards [B], mask [B, T] (AReaL's loss_mask), attention_mask [B, T], logprobs [B, T], optional
    reference_logprobs and values [B, T]. Returns advantages and returns [B, T] in AReaL's shifted frame, in the
    compute dtype (AReaL's float32 values, widened exactly, where AReaL returns float32); no metrics. Raises INVALID_ARGUMENT (config.<field>)
    for out-of-range config values, e.g. config.reward_norm.eps <= 0.
    """
    rewards, mask, attention = batch["rewards"], batch["mask"], batch["attention_mask"]
    B, T = mask.shape
    rows = torch.arange(B, device=mask.device)

    score = ((rewards + cfg.reward_bias) * cfg.reward_scaling).clip(min=-cfg.reward_clip, max=cfg.reward_clip)
    if cfg.reward_norm is not None:
        score = normalize(score, None, cfg.reward_norm)

    lm = torch.roll(mask.float(), shifts=-1, dims=-1)
    logprobs = batch["logprobs"]
    old = logprobs if cfg.recompute_logprob and not cfg.use_decoupled_loss else torch.roll(logprobs, -1, dims=-1)
    ref = batch.get("reference_logprobs")
    ref = torch.zeros_like(old) if ref is None else ref
    seqlens = attention.sum(-1).long()
    no_eos = seqlens == T
    token_rewards = -cfg.kl_ctl * kl_estimate(old * lm, ref * lm, cfg.kl_estimator)
    token_rewards[rows, seqlens - 1] = 0
    placed = torch.where(no_eos, 0, score) if cfg.mask_no_eos_with_zero else score
    token_rewards[rows, torch.clip(seqlens - 2, min=0)] += placed

    values = batch.get("values")
    values = torch.zeros_like(token_rewards) if values is None else values
    advantages = gae_shifted(token_rewards, values, lm, no_eos, cfg.discount, cfg.gae_lambda)
    returns = advantages + values
    if cfg.adv_norm is not None:
        advantages = normalize(advantages, lm, cfg.adv_norm)
    # AReaL's float32 results (its float32 steps) widened exactly to the compute dtype, the service's contract
    return AdvantageResult(advantages.to(mask.dtype), returns=returns.to(mask.dtype))
