"""Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438) with carry-forward masking.

Math, per row, over the positions where mask = 1 only (prompt tokens, padding and tool-output holes are
skipped: the recursion jumps over them, NeMo RL's "carry-forward" masking):
    delta_t = r_t + gamma * V_next(t) - V_t          V_next(t) = value at the next valid position,
                                                      or bootstrap_values (default 0) after the last one
    A_t     = delta_t + gamma * lambda * A_next(t)
At a masked position the advantage carries the value of the next valid position (0 after the last).
Token rewards r: a [B] terminal reward sits on the last mask = 1 position of its row; a [B, T] reward
is used per step. With use_kl_in_reward, -penalty * KL_t is added at every token. Rewards at masked
positions are ignored.

Lambdas (VAPO decoupled GAE, arXiv:2504.05118): returns use gae_lambda_value (default gae_lambda);
advantages use length_adaptive_alpha's per-row lambda 1 - 1/max(alpha * len, 1) if alpha > 0, else
gae_lambda_policy, else gae_lambda.

Outputs: returns = A(lambda_value) + values at every position (un-whitened); advantages =
A(lambda_policy), whitened over the valid tokens when normalize_advantages
((A - mu) / sqrt(var + 1e-8), mu and var the masked mean and unbiased variance; with a single valid
token the variance is taken as 0 where NeMo RL divides by zero), then set to 0 where mask = 0. An all-zero mask row gets advantages 0 and returns = values (its bootstrap value is not used).

Defaults: gae_gamma = 1.0, gae_lambda = 0.95 (nemo_rl) or 1.0 (verl), normalize_advantages = true,
length_adaptive_alpha = 0 (off), gae_lambda_value / gae_lambda_policy unset (= gae_lambda), no KL in the
reward (use_kl_in_reward = false; penalty 0.01, k3, clamps 20 / 10 when on).

Semantics (``semantics``): ``nemo_rl`` (default) is NeMo RL ``GeneralizedAdvantageEstimator`` as above.
``verl`` reproduces verl ``compute_gae_advantage_return``: the same recursion (verl skips values and
TD errors on mask = 0 tokens the same way; its rewards are ``token_level_rewards`` [B, T]), returns =
advantages + values, the whitening applied at every position and masked positions NOT zeroed (they
keep the next valid position's advantage, whitened). Under verl ``gae_lambda`` defaults to 1.0 (verl's
``algorithm.lam``) and the NeMo-only fields ``gae_lambda_value``, ``gae_lambda_policy`` and
``length_adaptive_alpha`` are rejected. Where verl divides by zero (one valid token, or none) the
whitening uses variance 0 (and mean 0 with none), so the result stays finite. Under verl the unbiased
correction n / (n - 1) is rounded to float32 as verl's ``masked_var`` computes it from an integer mask
(:func:`~advantage_server.estimators.whitening.whiten_unbiased`).

``skyrl`` reproduces SkyRL 0.4.0 ``compute_gae_advantage_return`` (TRL's loop, which ignores the mask):
    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lambda * A_{t+1}   at EVERY position t,
    V_T = A_T = 0 after the last column; r = a [B, T] reward as sent (masked positions included) or a [B]
    reward on the row's last mask = 1 position. So with gamma * lambda < 1 and a mask that is not right-aligned,
    values and rewards at padding and holes reach the valid positions (SkyRL's trainer sends right-aligned
    masks, where this equals the masked recursion only when gamma = lambda = 1 or padding carries V = r = 0).
    returns = A + values (every position); advantages = A whitened over the mask = 1 tokens as verl (SkyRL's
    ``masked_whiten``, unbiased variance, its masked_mean divides by max(n, 1) = verl's n), masked positions
    NOT zeroed. ``gae_lambda`` defaults to 1.0 (SkyRL's ``algorithm.lambd``); the nemo_rl-only fields are
    rejected. ``bootstrap_values`` (optional; SkyRL has none) is V after the last column, T, not after the
    row's last valid position, since this recursion ignores the mask; unset = 0, SkyRL's. Where SkyRL
    raises (fewer than two valid tokens) the whitening uses variance 0, as under verl. Kernel: the returns
    are the lambda-returns G_t = A_t + V_t = r_t + gamma (1 - lambda) V_{t+1} + gamma lambda G_{t+1} (G_T = V_T),
    :func:`discounted_reverse_cumsum` of r_t + gamma (1 - lambda) V_{t+1} (float64, no per-step loop), and
    A = G - V: the same sums as SkyRL's loop without adding and then subtracting each V (with lambda = 1 the
    returns do not read the values at all), so a return that is 0 (padding after the row's reward) is 0
    exactly, not rounding noise of the values' size.

``slime`` reproduces slime's ``ppo`` (the trainer's ``compute_advantages_and_returns`` with
``get_advantages_and_returns_batch``, one process): the token rewards are -penalty * KL_t at EVERY position
(the KL is not masked; slime's ``compute_approx_kl``: k1 by default, no clamps) and the [B] reward is added on
the row's LAST position: a packed request's row length - 1 (``cu_seqlens``: the response's last token, whatever
the loss mask says there, as slime does), and in a dense request, whose padding cannot be told apart from a masked
end, the row's last mask = 1 position (the same wherever the response ends with a mask = 1 token; send slime's
batches packed, as its ragged lists are, for the exact placement). Past the row's end (the padding) values, rewards
and KL count as 0, as in slime's padded batch. Then SkyRL's recursion above over the row (V = 0 after its last
position), returns = A + values, and with ``normalize_advantages`` (slime's ``--normalize-advantages``; off by
default, as in slime) A whitened over the mask = 1 tokens of the batch
(:func:`~advantage_server.estimators.whitening.whiten_slime`), masked positions not zeroed. ``gae_lambda`` is
slime's ``--lambd`` (default 1.0), ``gae_gamma`` its ``--gamma``. ``bootstrap_values`` (slime has none: 0) is V
after the row's last position: gamma times it joins the reward there, which is the same TD error.

``roll`` reproduces ROLL's RLVR ``gae`` (alibaba/ROLL main@8eb27cc2, ``roll/utils/functionals.py``): the step of
:mod:`~advantage_server.estimators.roll` (``norm_mean_type`` / ``norm_std_type``, ``reward_clip``, the reward on the
last attended token, KL, ``whiten_rewards``) gives the masked token rewards r; then SkyRL's recursion above over
every column with the values NOT masked (ROLL masks the copy it stores, not the one its recursion reads), V = 0 after
the last column, returns = A + V (not masked); advantages = A whitened with ``normalize_advantages`` (ROLL's
``whiten_advantages``, default false; none with one valid token or fewer, as ROLL), times the mask, clamped to
+-``advantage_clip``. ``gae_lambda`` is ROLL's ``lambd`` (default 0.95), ``gae_gamma`` its ``gamma``.
``bootstrap_values`` (ROLL has none: 0) is V after the last column, as under skyrl.

Kernel, CPU (numba, :mod:`~advantage_server.estimators.jit`): one backward pass per row over memory
(:func:`_gae_rows`, float64 accumulation), rows split over the cores with the GIL released; the
estimator fuses both lambdas, the returns and per-row moments into that pass and whitens in a second
one (:func:`_gae_fused`). Kernel, GPU and without numba (:func:`gae_kernel_torch`): the valid positions
of each row are packed to the left (one scatter), the recursion becomes a constant-coefficient
discounted reverse cumulative sum, computed in blocks of ``_CHUNK`` steps as a small matrix product per
block, with block carries solved by the same routine on the coarser grid (recursively: log-depth, no
per-step loop). :func:`gae_loop` is the per-step loop twin (test oracle) of both.
Reference: NeMo RL ``GeneralizedAdvantageEstimator`` (nemo_rl); verl ``compute_gae_advantage_return`` (verl).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from advantage_server.estimators import jit, roll
from advantage_server.estimators.inputs import MASK, PROMPT_IDS
from advantage_server.estimators.kl import KL_INPUTS, KLInRewardConfig, apply_kl, kl_clamp_field, kl_type_field
from advantage_server.estimators.rewards import OpenRLHFRewardConfig, last_valid_index, no_std_norm_field, place_rewards
from advantage_server.estimators.whitening import masked_moments, whiten_openrlhf, whiten_slime, whiten_unbiased
from advantage_server.estimators.registry import AdvantageResult, Batch, InputSpec, register, semantics_field

_CHUNK = 64


_NEMO_ONLY = "nemo_rl only"


@dataclass(frozen=True)
class GAEConfig(KLInRewardConfig, OpenRLHFRewardConfig, roll.RollStepConfig):
    gae_lambda: float | None = field(default=None, metadata={
        "doc": "GAE lambda.", "range": (0.0, 1.0),
        "per_semantics": {"nemo_rl": 0.95, "verl": 1.0, "skyrl": 1.0, "openrlhf": 1.0, "slime": 1.0, "roll": 0.95},
        "default_text": "0.95 (nemo_rl, roll); 1.0 (verl, skyrl, openrlhf, slime)"})
    gae_gamma: float = field(default=1.0, metadata={"doc": "Discount factor gamma.", "range": (0.0, 1.0)})
    normalize_advantages: bool | None = field(default=None, metadata={
        "doc": "Whiten the advantages over the valid tokens.",
        "per_semantics": {"nemo_rl": True, "verl": True, "skyrl": True, "openrlhf": True, "slime": False,
                          "roll": False},
        "default_text": "true (nemo_rl, verl, skyrl, openrlhf); false (slime: --normalize-advantages is off by "
                        "default; roll: ROLL's whiten_advantages)"})
    # KL in the reward: NeMo RL's defaults (k3, clamps 20 and 10), slime's compute_approx_kl under slime
    reference_policy_kl_type: str | None = kl_type_field(("nemo_rl", "verl", "skyrl", "openrlhf"), ("slime", "roll"))
    kl_input_clamp_value: float | None = kl_clamp_field("input", 20.0, ("nemo_rl", "verl", "skyrl", "openrlhf"),
                                                        ("slime", "roll"))
    kl_output_clamp_value: float | None = kl_clamp_field("output", 10.0, ("nemo_rl", "verl", "skyrl", "openrlhf"),
                                                         ("slime", "roll"))
    norm_mean_type: str | None = roll.norm_field("mean")
    norm_std_type: str | None = roll.norm_field("std")
    gae_lambda_value: float | None = field(default=None, metadata={
        "doc": f"Lambda for the returns (VAPO); unset = gae_lambda. {_NEMO_ONLY}.", "range": (0.0, 1.0),
        "per_semantics": {"nemo_rl": None}, "default_text": "unset"})
    gae_lambda_policy: float | None = field(default=None, metadata={
        "doc": f"Lambda for the advantages (VAPO); unset = gae_lambda. {_NEMO_ONLY}.", "range": (0.0, 1.0),
        "per_semantics": {"nemo_rl": None}, "default_text": "unset"})
    length_adaptive_alpha: float | None = field(default=None, metadata={
        "doc": f"Per-row lambda_policy = 1 - 1/max(alpha*len, 1); 0 = off. {_NEMO_ONLY}.", "range": (0.0, None),
        "per_semantics": {"nemo_rl": 0.0}, "default_text": "0.0 (nemo_rl); not applicable otherwise"})
    semantics: str | None = semantics_field(
        ("nemo_rl", "verl", "skyrl", "openrlhf", "slime", "roll"),
        "Reference reproduced: nemo_rl (NeMo RL GeneralizedAdvantageEstimator: advantages 0 where mask = 0), "
        "verl (compute_gae_advantage_return: masked positions whitened, not zeroed), skyrl "
        "(compute_gae_advantage_return: the recursion ignores the mask; masked positions whitened, not zeroed) or "
        "openrlhf (gae: values and rewards times the mask, skyrl's recursion, the batch whitening with the "
        "biased variance) or slime (ppo: the reward on the row's last position, unmasked KL, skyrl's recursion) or "
        "roll (RLVR gae: reward_postprocess, compute_token_reward, compute_advantage; unmasked values).")
    no_std_norm: bool | None = no_std_norm_field()


# --------------------------------------------------------------------------- kernel
def discounted_reverse_cumsum(d: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``A_j = sum_{k >= j} g^(k - j) d_k`` along the last axis.

    d: ``[B, N]``; g: ``[B]`` discount per row (0 <= g <= 1). Returns ``[B, N]`` in d's dtype.
    Blocks of ``_CHUNK`` positions are solved with one batched matmul against the Toeplitz matrix
    ``W[k, j] = g^(j - k)`` (j >= k); the value entering each block from the right solves the same
    problem on the block grid with discount ``g^_CHUNK``.
    """
    B, N = d.shape
    C = min(_CHUNK, N)
    nc = -(-N // C)
    if nc * C != N:
        d = torch.nn.functional.pad(d, (0, nc * C - N))
    x = d.view(B, nc, C)
    steps = torch.arange(C, device=d.device)
    lag = steps[None, :] - steps[:, None]                                     # [C, C]: j - k
    gb = g.to(d.dtype)[:, None, None]
    W = torch.where(lag >= 0, gb ** lag.clamp(min=0).to(d.dtype), torch.zeros((), dtype=d.dtype, device=d.device))
    local = torch.matmul(x, W.transpose(1, 2))                                # [B, nc, C]
    if nc > 1:
        starts = discounted_reverse_cumsum(local[:, :, 0], g.to(d.dtype) ** C)  # A at each block start
        carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))                # value entering block i
        decay = gb[:, :, 0] ** (C - steps).to(d.dtype)                        # [B, C]: g^(C - k)
        local = local + carry[:, :, None] * decay[:, None, :]
    return local.reshape(B, nc * C)[:, :N]


def gae_kernel(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
               lam: float | torch.Tensor, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """GAE advantages ``[B, T]`` with carry-forward masking (see module docstring).

    token_rewards, values: ``[B, T]`` float; mask: ``[B, T]`` 0/1; lam: float or ``[B]``;
    bootstrap: ``[B]`` value after each row's last valid step, or None for 0.
    On the CPU with numba: :func:`gae_kernel_numba` (one backward pass per row); otherwise
    :func:`gae_kernel_torch` (packed blocked scan, the GPU path).
    """
    if jit.applies(token_rewards, values, mask, bootstrap, lam if isinstance(lam, torch.Tensor) else None) \
            and values.dtype in (torch.float32, torch.float64) and token_rewards.dtype == values.dtype:
        return gae_kernel_numba(token_rewards, values, mask, gamma, lam, bootstrap)
    return gae_kernel_torch(token_rewards, values, mask, gamma, lam, bootstrap)


def gae_kernel_torch(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                     lam: float | torch.Tensor, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch :func:`gae_kernel` (any device): valid positions packed left, then a blocked
    discounted reverse cumulative sum (:func:`discounted_reverse_cumsum`), then gathered back."""
    B, T = values.shape
    dt = values.dtype
    valid = mask.bool()
    n_valid = valid.sum(1)                                                    # [B]
    before = torch.cumsum(valid, 1) - valid.long()                            # valid positions before t
    trash = T + 1
    slot = torch.where(valid, before, torch.full_like(before, trash))
    packed_r = torch.zeros(B, T + 2, dtype=dt, device=values.device)
    packed_v = torch.zeros(B, T + 2, dtype=dt, device=values.device)
    packed_r.scatter_(1, slot, torch.where(valid, token_rewards, 0))
    packed_v.scatter_(1, slot, torch.where(valid, values, 0))
    if bootstrap is not None:
        packed_v.scatter_(1, n_valid[:, None], bootstrap.to(dt)[:, None])
    in_row = torch.arange(T, device=values.device)[None, :] < n_valid[:, None]
    delta = torch.where(in_row, packed_r[:, :T] + gamma * packed_v[:, 1:T + 1] - packed_v[:, :T], 0)
    g = gamma * (lam if isinstance(lam, torch.Tensor) else torch.full((B,), lam, dtype=dt, device=values.device))
    adv_packed = torch.nn.functional.pad(discounted_reverse_cumsum(delta, g), (0, 1))  # A after the end = 0
    return adv_packed.gather(1, before)


def gae_loop(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
             lam: float | torch.Tensor, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """Per-step loop twin of :func:`gae_kernel` (test oracle), backwards over t like the paper's recursion."""
    B, T = values.shape
    next_value = torch.zeros(B, dtype=values.dtype) if bootstrap is None else bootstrap.to(values.dtype).clone()
    running = torch.zeros(B, dtype=values.dtype)
    out = torch.zeros_like(values)
    for t in reversed(range(T)):
        m = mask[:, t].bool()
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        running = torch.where(m, candidate, running)
        next_value = torch.where(m, values[:, t], next_value)
        out[:, t] = running
    return out


# --------------------------------------------------------------------------- CPU kernel (numba)
@jit.njit(contract=True)
def _gae_rows(lo, hi, rewards2, rewards1, values, mask, boot, gamma, lam_p, lam_v, adv, ret,
              stats, fin):  # pragma: no cover - compiled; tested through gae_kernel_numba and gae
    """Rows ``lo..hi-1`` of GAE in one backward pass each (float64 accumulation).

    rewards2 [B, T] per-step rewards, or None and rewards1 [B] terminal rewards (added at the row's
    last valid step); boot [B]; lam_p [B]; lam_v [B], or None when it equals lam_p. Writes adv
    (lambda_p) and, unless ret is None, ret = A(lambda_v) + values. Unless stats is None, stats[b] =
    (valid count, sum of adv over valid steps, centred sum of squares about the row mean, first
    valid t, last valid t), over the stored (rounded) advantages. Unless fin is None, fin[b] =
    (every stored advantage of row b finite, every stored return finite): the core's overflow check,
    done here while the row is still in cache (:func:`_row_finite`). The
    ``is None`` tests are resolved at compile time: each combination is its own specialised loop.
    """
    T = values.shape[1]
    for b in range(lo, hi):
        nv = np.float64(boot[b])
        run_p = 0.0
        run_v = 0.0
        glp = gamma * lam_p[b]
        glv = glp
        if lam_v is not None:
            glv = gamma * lam_v[b]
        pending = 0.0
        if rewards1 is not None:
            pending = np.float64(rewards1[b])
        for t in range(T - 1, -1, -1):
            vt = np.float64(values[b, t])
            valid = mask[b, t] != 0
            if valid:
                rt = 0.0
                if rewards2 is not None:
                    rt = np.float64(rewards2[b, t])
                if rewards1 is not None:
                    rt = pending
                    pending = 0.0
                delta = rt + gamma * nv - vt
                run_p = delta + glp * run_p
                if lam_v is not None:
                    run_v = delta + glv * run_v
                nv = vt
            adv[b, t] = run_p
            if ret is not None:
                if lam_v is not None:
                    ret[b, t] = run_v
                    ret[b, t] += values[b, t]
                else:
                    ret[b, t] = adv[b, t] + values[b, t]
        if fin is not None:  # separate passes over the cached row: the recurrence above stays lean
            fin[b, 0] = _row_finite(adv[b])
            fin[b, 1] = True if ret is None else _row_finite(ret[b])
        if stats is not None:
            _row_moments(adv[b], mask[b], stats[b])


@jit.njit
def _row_finite(a):  # pragma: no cover - compiled
    """Every value of the row ``a`` is finite: ``x - x`` is 0 except for NaN and infinity (an OR
    reduction, so it runs on SIMD lanes without fast-math)."""
    bad = False
    for t in range(a.shape[0]):
        x = a[t]
        bad = bad | ((x - x) != 0)
    return not bad


@jit.njit(reassoc=True)
def _row_moments(a, m, out):  # pragma: no cover - compiled
    """out = (valid count, sum, centred sum of squares, first valid t, last valid t) of one row ``a``
    over the positions where ``m`` != 0, float64, while the row is still in cache: two branch-free
    passes over the whole row (the sums run on SIMD lanes; a loop from first to last does not
    vectorise here), then short scans for the ends."""
    T = a.shape[0]
    count = 0.0
    total = 0.0
    for t in range(T):
        w = 1.0 if m[t] != 0 else 0.0
        count += w
        total += np.float64(a[t]) * w
    m2 = 0.0
    if count > 0:
        mean = total / count
        for t in range(T):
            d = (np.float64(a[t]) - mean) * (1.0 if m[t] != 0 else 0.0)
            m2 += d * d
    first = 0
    while first < T and m[first] == 0:
        first += 1
    last = T - 1
    while last >= first and m[last] == 0:
        last -= 1
    out[0] = count
    out[1] = total
    out[2] = m2
    out[3] = first if count > 0 else -1
    out[4] = last if count > 0 else -1


@jit.njit
def _whiten_rows(lo, hi, adv, mask, stats, mean, scale, zero_masked, fin):  # pragma: no cover - compiled
    """Rows ``lo..hi-1``: adv = (adv - mean) * scale, then 0 where mask = 0 when zero_masked. A row
    whose valid steps form one block (stats: count = last - first + 1) skips reading the mask.
    fin[b, 0] = every stored value of row b is finite (see :func:`_gae_rows`)."""
    T = adv.shape[1]
    for b in range(lo, hi):
        count = int(stats[b, 0])
        first = int(stats[b, 3])
        last = int(stats[b, 4])
        if zero_masked:
            if count == 0:
                for t in range(T):
                    adv[b, t] = 0.0
                fin[b, 0] = True
            elif count == last - first + 1:
                for t in range(first):
                    adv[b, t] = 0.0
                for t in range(first, last + 1):
                    adv[b, t] = (np.float64(adv[b, t]) - mean) * scale
                for t in range(last + 1, T):
                    adv[b, t] = 0.0
                fin[b, 0] = _row_finite(adv[b, first:last + 1])  # while the row is in cache
            else:
                for t in range(T):
                    if mask[b, t] != 0:
                        adv[b, t] = (np.float64(adv[b, t]) - mean) * scale
                    else:
                        adv[b, t] = 0.0
                fin[b, 0] = _row_finite(adv[b])
        else:
            for t in range(T):
                adv[b, t] = (np.float64(adv[b, t]) - mean) * scale
            fin[b, 0] = _row_finite(adv[b])


def _row_lambdas(lam: float | torch.Tensor, B: int) -> np.ndarray:
    if isinstance(lam, torch.Tensor):
        return np.ascontiguousarray(lam.detach().to("cpu", torch.float64).numpy().reshape(B))
    return np.full(B, float(lam), dtype=np.float64)


def _gae_numba(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
               lam_p: float | torch.Tensor, lam_v: float | torch.Tensor, bootstrap: torch.Tensor | None,
               want_ret: bool, want_stats: bool, batch: Batch | None = None, want_fin: bool = False):
    """Run :func:`_gae_rows` on all rows. Returns (adv, ret or None, stats or None, mask as numpy, fin or
    None: the per-row finiteness flags). With ``batch`` the outputs come from :meth:`Batch.output` (the
    caller's memory when it offers some)."""
    B, T = values.shape
    v = jit.as_numpy(values)
    m = jit.as_numpy(mask)
    per_step = rewards.dim() == 2
    r2 = jit.as_numpy(rewards.to(values.dtype)) if per_step else None
    r1 = None if per_step else jit.as_numpy(rewards.to(torch.float64))
    boot = (np.zeros(B, dtype=np.float64) if bootstrap is None
            else np.ascontiguousarray(bootstrap.detach().to("cpu", torch.float64).numpy().reshape(B)))
    lp = _row_lambdas(lam_p, B)
    same = lam_v is lam_p or (not isinstance(lam_p, torch.Tensor) and not isinstance(lam_v, torch.Tensor)
                              and float(lam_p) == float(lam_v))
    lv = None if same or not want_ret else _row_lambdas(lam_v, B)
    if batch is not None:
        adv = batch.output("advantages", values.dtype)
        ret = batch.output("returns", values.dtype) if want_ret else None
    else:
        adv = torch.empty((B, T), dtype=values.dtype)
        ret = torch.empty((B, T), dtype=values.dtype) if want_ret else None
    stats = np.zeros((B, 5), dtype=np.float64) if want_stats else None
    fin = np.zeros((B, 2), dtype=np.bool_) if want_fin else None
    jit.parallel_rows(_gae_rows, B, T, r2, r1, v, m, boot, float(gamma), lp, lv, adv.numpy(),
                      None if ret is None else ret.numpy(), stats, fin)
    return adv, ret, stats, m, fin


def gae_kernel_numba(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                     lam: float | torch.Tensor, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """CPU :func:`gae_kernel` compiled with numba: one backward pass per row (no packing), rows split
    over the cores with the GIL released. Same arguments and result as :func:`gae_kernel_torch`."""
    return _gae_numba(token_rewards, values, mask, gamma, lam, lam, bootstrap, False, False)[0]


def _gae_fused(cfg: "GAEConfig", rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               bootstrap: torch.Tensor | None, lam_value: float, lam_policy: float | torch.Tensor,
               batch: Batch | None = None) -> AdvantageResult:
    """The whole GAE estimator on the CPU in two passes over memory (numba): pass 1 computes both
    lambdas' advantages, the returns and per-row moments; pass 2 whitens in place and zeroes masked
    positions. Same results as the torch path of :func:`gae` (float tolerance)."""
    zero_masked = cfg.semantics != "verl"
    whiten = bool(cfg.normalize_advantages)
    adv, ret, stats, m, fin = _gae_numba(rewards, values, mask, cfg.gae_gamma, lam_policy, lam_value, bootstrap,
                                         True, whiten or zero_masked, batch, want_fin=True)
    if whiten:
        # Chan et al.'s pairwise combination of the per-row (count, sum, centred M2), in float64
        count, total, m2 = stats[:, 0], stats[:, 1], stats[:, 2]
        n = float(count.sum())
        mean64 = float(total.sum()) / max(n, 1.0)
        rows = count > 0
        row_mean = total[rows] / count[rows]
        var64 = (float(m2.sum()) + float((count[rows] * (row_mean - mean64) ** 2).sum())) / max(n, 1.0)
        # the scalar arithmetic of the torch path, in the compute dtype
        dt = values.dtype
        f64 = torch.float64
        mean, var = torch.tensor(mean64, dtype=f64).to(dt), torch.tensor(var64, dtype=f64).to(dt)
        nt = torch.tensor(n, dtype=f64).to(dt)
        if cfg.semantics == "verl":  # verl's Bessel factor from its int64 mask: float32 n / (n - 1)
            n32 = torch.tensor(n, dtype=torch.float32)
            var = torch.where(nt > 1, var * (n32 / (n32 - 1).clamp(min=1)).to(dt), var)
        else:
            var = torch.where(nt > 1, var * nt / (nt - 1).clamp(min=1), var)
        scale = torch.rsqrt(var + 1e-8)
        jit.parallel_rows(_whiten_rows, adv.shape[0], adv.shape[1], adv.numpy(), m, stats, float(mean),
                          float(scale), zero_masked, fin)
    elif zero_masked:  # (a - 0) * 1 = a: only the zeroing
        jit.parallel_rows(_whiten_rows, adv.shape[0], adv.shape[1], adv.numpy(), m, stats, 0.0, 1.0, True, fin)
    # fin: both outputs checked for overflow on the way (the core then skips its own pass over them)
    return AdvantageResult(adv, returns=ret, finite=bool(fin.all()))


def unmasked_gae(r: torch.Tensor, v: torch.Tensor, gamma: float, lam: float,
                 bootstrap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's loop, which ignores the mask (SkyRL's and OpenRLHF's ``gae``), as (returns, advantages), float64
    ``[B, T]`` each: token rewards ``r`` and values ``v`` float64 ``[B, T]``; ``bootstrap`` ``[B]`` is V after the
    last column (None: 0). The returns are the lambda-returns, a :func:`discounted_reverse_cumsum`, and A = G - V
    (module docstring, Kernel), so no value is added and subtracted again."""
    # x_t = r_t + gamma (1 - lambda) V_{t+1} (t < T - 1); x_{T-1} = r_{T-1} + gamma V_T (G_T = V_T: A_T = 0)
    x = r.clone()
    if lam != 1.0:
        x[:, :-1] += (gamma * (1.0 - lam)) * v[:, 1:]
    if bootstrap is not None:                                               # V after the last column (else 0)
        x[:, -1] += gamma * bootstrap.to(torch.float64)
    g = torch.full((r.shape[0],), gamma * lam, dtype=torch.float64, device=v.device)
    returns = discounted_reverse_cumsum(x, g)
    return returns, returns - v


def skyrl_gae(cfg: "GAEConfig", batch: Batch) -> AdvantageResult:
    """``semantics = skyrl`` (module docstring): SkyRL's unmasked recursion, float64, whitened over the mask.

    Inputs as :func:`gae`; ``bootstrap_values`` [B], when sent, is V after the last column (SkyRL: 0).
    Returns advantages and returns ``[B, T]`` in the values' dtype (:func:`unmasked_gae`).
    """
    mask, values, raw = batch["mask"], batch["values"], batch["rewards"]
    r = apply_kl(place_rewards(raw, mask).to(torch.float64), cfg, batch, mask=mask)
    returns, adv = unmasked_gae(r, values.to(torch.float64), cfg.gae_gamma, cfg.gae_lambda,
                                batch.get("bootstrap_values"))
    if cfg.normalize_advantages:
        adv = whiten_unbiased(adv, mask)
    return AdvantageResult(adv.to(values.dtype), returns=returns.to(values.dtype))


def slime_gae(cfg: "GAEConfig", batch: Batch) -> AdvantageResult:
    """``semantics = slime`` (module docstring): slime's ``ppo``: the [B] reward on each row's last position
    (``Batch.row_lengths`` - 1 for a packed request, the last mask = 1 position for a dense one), -penalty * KL_t
    at every position,
    :func:`unmasked_gae`, and slime's whitening with ``normalize_advantages``.

    Inputs as :func:`gae`; ``bootstrap_values`` [B] (slime has none: 0) is V after the row's last position, so
    gamma times it joins the reward there. Returns advantages and returns ``[B, T]`` in the values' dtype.
    """
    mask, values, raw = batch["mask"], batch["values"], batch["rewards"]
    if batch.row_lengths is not None:  # packed: the response's last token, whatever its loss mask
        last = batch.row_lengths.to(mask.device) - 1
    else:  # dense: the padding is not told apart from a masked end, so the last mask = 1 position
        last = last_valid_index(mask)
    at_end = torch.zeros(batch.B, dtype=torch.float64, device=mask.device)
    if raw.dim() == 1:
        at_end = at_end + raw.to(torch.float64)
    bootstrap = batch.get("bootstrap_values")
    if bootstrap is not None:  # V after the last position enters only its TD error: gamma * V there
        at_end = at_end + cfg.gae_gamma * bootstrap.to(torch.float64)
    r = raw.to(torch.float64) if raw.dim() == 2 else torch.zeros(batch.B, batch.T, dtype=torch.float64,
                                                                 device=mask.device)
    r = r.scatter_add(1, last.clamp(min=0)[:, None], torch.where(last >= 0, at_end, 0.0)[:, None])
    r = apply_kl(r, cfg, batch)  # every position: slime does not mask it
    # past the row's end (padding) nothing enters the recursion: V = r = KL = 0 there, as slime pads its rows
    beyond = torch.arange(batch.T, device=mask.device)[None, :] > last[:, None]
    r = r.masked_fill(beyond, 0.0)
    v = values.to(torch.float64).masked_fill(beyond, 0.0)
    returns, adv = unmasked_gae(r, v, cfg.gae_gamma, cfg.gae_lambda, None)
    if cfg.normalize_advantages:
        adv = whiten_slime(adv, mask)
    return AdvantageResult(adv.to(values.dtype), returns=returns.to(values.dtype))


def roll_gae(cfg: "GAEConfig", batch: Batch) -> AdvantageResult:
    """``semantics = roll`` (module docstring): ROLL's RLVR gae. Inputs as :func:`gae`, plus prompt_ids [B] for a
    group normalisation and the optional attention_mask [B, T]. Returns advantages and returns ``[B, T]`` in the
    values' dtype. ``bootstrap_values`` [B], when sent, is V after the last column (ROLL has none: 0)."""
    tokens, n = roll.token_rewards(cfg, batch, cfg.norm_mean_type, cfg.norm_std_type)
    values = batch["values"]
    returns, adv = unmasked_gae(tokens, values.to(torch.float64), cfg.gae_gamma, cfg.gae_lambda,
                                batch.get("bootstrap_values"))
    return AdvantageResult(roll.finish(adv, batch["mask"], n, cfg).to(values.dtype),
                           returns=returns.to(values.dtype))


def openrlhf_gae(cfg: "GAEConfig", batch: Batch) -> AdvantageResult:
    """``semantics = openrlhf`` (OpenRLHF 0.11.2 ``gae``: ``compute_reward``, ``get_advantages_and_returns`` and the
    batch whitening of ``compute_advantages_and_returns``). A [B] reward (a [B, T] one elementwise) is clamped to
    ``[reward_clip_min, reward_clip_max]`` and placed on the row's last mask = 1 position, minus penalty * KL_t on
    the mask = 1 tokens with ``use_kl_in_reward``; rewards and values are multiplied by the mask, then
    :func:`unmasked_gae` (OpenRLHF's loop over every position, V after the last column 0, or ``bootstrap_values``);
    returns = A + the masked values; A whitened over the mask = 1 tokens of the batch with the biased variance,
    ``(A - mean) * rsqrt(max(var, 1e-8))`` at every position, or ``A - mean`` with ``no_std_norm``
    (:func:`~advantage_server.estimators.whitening.whiten_openrlhf`; none with ``normalize_advantages = false``).

    Inputs as :func:`gae`. Returns advantages and returns ``[B, T]`` in the values' dtype.
    """
    mask, values = batch["mask"], batch["values"]
    m = mask.to(torch.float64)
    r = apply_kl(place_rewards(cfg.clip(batch["rewards"]), mask), cfg, batch, mask=mask) * m
    returns, adv = unmasked_gae(r, values.to(torch.float64) * m, cfg.gae_gamma, cfg.gae_lambda,
                                batch.get("bootstrap_values"))
    if cfg.normalize_advantages:
        adv = whiten_openrlhf(adv, mask, cfg.no_std_norm)
    return AdvantageResult(adv.to(values.dtype), returns=returns.to(values.dtype))


def token_level_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` terminal rewards -> ``[B, T]`` with each reward on its row's last mask = 1 position.

    ``[B, T]`` per-step rewards pass through. Rows with no valid position get no reward.
    """
    if rewards.dim() == 2:
        return rewards * mask
    B, T = mask.shape
    valid = mask.bool()
    last = T - 1 - valid.flip(1).int().argmax(1)                              # last valid index per row
    out = torch.zeros(B, T, dtype=rewards.dtype, device=rewards.device)
    out.scatter_(1, last[:, None], torch.where(valid.any(1), rewards, 0)[:, None])
    return out


@register(
    "gae", config=GAEConfig,
    inputs=[
        InputSpec("rewards", ("[B]", "[B, T]"), "float",
                  "[B] terminal reward (placed on the last mask = 1 position) or [B, T] per-step rewards.",
                  fix="send one reward per sample, or per-step rewards [B, T]"),
        MASK,
        InputSpec("values", ("[B, T]",), "float", "Critic value estimate V(s_t) at every position.",
                  fix="per-token `values` come from a critic: enable the critic, or choose an estimator without a value "
                      "model (grpo, reinforce_plus_plus, raw_reward)"),
        InputSpec("bootstrap_values", ("[B]",), "float",
                  "Value of the state after each row's last step, for rows cut before their episode ended "
                  "(time limit, end of rollout); 0 = the episode terminated.", required=False),
        *KL_INPUTS,
        replace(PROMPT_IDS, required=False, required_when=(roll.needs_groups,
                "semantics = roll and norm_mean_type = group or semantics = roll and norm_std_type = group"),
                fix=PROMPT_IDS.fix + " (roll's group normalisation), or use a batch norm_mean_type / norm_std_type"),
        roll.ATTENTION_MASK,
    ],
    reference="arXiv:1506.02438; VAPO arXiv:2504.05118; NeMo RL GeneralizedAdvantageEstimator; "
              "verl compute_gae_advantage_return; SkyRL compute_gae_advantage_return; OpenRLHF gae",
    produces_returns=True,
)
def gae(cfg: GAEConfig, batch: Batch) -> AdvantageResult:
    """Generalized Advantage Estimation with carry-forward masking, decoupled and length-adaptive lambda.

    Inputs: rewards [B] or [B, T], mask [B, T], values [B, T], optional bootstrap_values [B]; logprobs
    and reference_logprobs [B, T] when use_kl_in_reward. Returns advantages [B, T] (0 where mask = 0)
    and returns [B, T]; no metrics.
    """
    if cfg.semantics == "skyrl":
        return skyrl_gae(cfg, batch)
    if cfg.semantics == "openrlhf":
        return openrlhf_gae(cfg, batch)
    if cfg.semantics == "slime":
        return slime_gae(cfg, batch)
    if cfg.semantics == "roll":
        return roll_gae(cfg, batch)
    mask, values = batch["mask"], batch["values"]
    bootstrap = batch.get("bootstrap_values")
    raw = batch["rewards"]
    fused = jit.applies(raw, values, mask, bootstrap) and values.dtype in (torch.float32, torch.float64)
    if fused and not (cfg.use_kl_in_reward and cfg.reference_policy_kl_penalty != 0):
        rewards = raw  # the fused kernel places a [B] reward itself and reads rewards only where mask = 1
    elif fused:
        rewards = apply_kl(token_level_rewards(raw, mask), cfg, batch)
    else:
        rewards = apply_kl(token_level_rewards(raw, mask), cfg, batch) * mask
    lam_value = cfg.gae_lambda if cfg.gae_lambda_value is None else cfg.gae_lambda_value
    if cfg.length_adaptive_alpha:
        lengths = mask.sum(1)
        lam_policy = (1.0 - 1.0 / (cfg.length_adaptive_alpha * lengths).clamp(min=1.0)).clamp(0.0, 1.0)
    else:
        lam_policy = cfg.gae_lambda if cfg.gae_lambda_policy is None else cfg.gae_lambda_policy
    if fused:
        return _gae_fused(cfg, rewards, values, mask, bootstrap, lam_value, lam_policy, batch)
    adv_value = gae_kernel(rewards, values, mask, cfg.gae_gamma, lam_value, bootstrap)
    if isinstance(lam_policy, float) and lam_policy == lam_value:
        advantages = adv_value
    else:
        advantages = gae_kernel(rewards, values, mask, cfg.gae_gamma, lam_policy, bootstrap)
    returns = adv_value + values
    if cfg.normalize_advantages and cfg.semantics == "verl":
        advantages = whiten_unbiased(advantages, mask)  # verl masked_whiten's own scalars (float32 Bessel factor)
    elif cfg.normalize_advantages:
        mean, var = masked_moments(advantages, mask, count_floor=1.0)
        n = mask.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), var)  # unbiased, as NeMo RL; one token: 0
        advantages = (advantages - mean) * torch.rsqrt(var + 1e-8)
    if cfg.semantics == "verl":
        return AdvantageResult(advantages, returns=returns)
    return AdvantageResult(torch.where(mask.bool(), advantages, 0), returns=returns)
