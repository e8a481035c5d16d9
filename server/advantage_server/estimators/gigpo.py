"""GiGPO: group-in-group policy optimisation for multi-turn LLM agents (Feng et al. 2025, arXiv:2505.10978).

One row per agent step (turn). Inputs (all on the step rows):
    prompt_ids      [B] (or [B, L]) int   the episode group: trajectories of the same task (verl-agent ``uid``)
    rewards         [B] or [B, T] float   the step's immediate reward r ([B, T]: summed over all T positions)
    mask            [B, T]                the step's response tokens
    trajectory_ids  [B] (or [B, L]) int   rows with equal prompt_ids and trajectory_ids are one trajectory
                                          (verl-agent ``traj_uid``, Trinity ``eid.run``, ROLL ``traj_id``)
    anchor_ids      [B] (or [B, L]) int   hash of the observation the step acted on: equal ids (rows) = the
                                          same anchor state (verl-agent ``anchor_obs``, Trinity
                                          ``env_state_hash``, ROLL ``state_hash``). int64 is signed: a hash
                                          from 8 digest bytes needs ``int.from_bytes(..., signed=True)``; or
                                          send the whole digest as uint8 rows [B, 32]
    step_index      [B] int, optional     order of the steps within a trajectory (verl-agent: batch order,
                                          Trinity ``eid.step``, ROLL ``step``); absent, and between equal
                                          values, the rows' batch order is the step order
Output: advantages [B, T] float (the compute dtype); no returns (verl-agent and Trinity return the
advantages a second time), no metrics.

Math (Eq. 3 and 5-8 of the paper), per trajectory tau with steps t = 0..n-1 in order:
    R(tau) = sum_t r_t                                     episode return (verl-agent ``episode_rewards``)
    G_t    = sum_{k >= t} gamma^(k - t) r_k               discounted step return (Eq. 5)
    A_E    = norm(R) within the episode group              (Eq. 3)
    A_S    = norm(G) within the step group                 (Eq. 7; rows sharing an anchor state, Eq. 6)
    A      = (A_E + step_advantage_weight * A_S) * mask    (Eq. 8)
    norm(x) = x - mean (mode = mean_norm) or (x - mean) / (std + epsilon) (mode = mean_std_norm), std the
    sample (n - 1) std.

Where the references compute different numbers (``semantics``):
    verl_agent (default; verl-agent main@29e3e8b3e3412aff53b1e4a461dac77a8eec19bd, ``gigpo/core_gigpo.py``:
        ``compute_step_discounted_returns`` + ``compute_gigpo_outcome_advantage`` with
        ``compute_mean_std_cross_steps = True``): episode statistics over the group's step ROWS (each row
        counts its trajectory's R, so a longer trajectory weighs more); an episode group of one row has
        mean 0, std 1 (A_E = R, or R / (1 + epsilon)). Step groups: equal anchor_ids within one prompt
        group; a step group of one has mean G (A_S = 0).
    trinity (Trinity-RFT 0.6.0, ``GiGPOAdvantageFn``, its PR #560): episode statistics over the group's
        TRAJECTORIES (one R each); every normalised value is (x - mean) / (d + epsilon) with d = std
        (fnorm = std) or 1 (fnorm = none, i.e. mean_norm); a group of one trajectory: mean 0, d = 1.
        Step groups: equal anchor_ids across the whole batch (not within the task); a step group of one
        row gets A_S = 0.
    roll (ROLL main@8eb27cc2dc34c4d1310b169d9b86d339004d811a, ``roll/pipeline/agentic/utils.py``
        ``compute_response_level_rewards`` with ``adv_estimator = gigpo`` and ``reward_normalization``
        grouping by ``traj_group_id``): episode statistics over the group's step rows; step groups: equal
        anchor_ids across the whole batch (``build_state_group`` names each state group by the hash
        alone); both normalised by ``agentic_reward_norm``: mean_norm gives x - mean (a group of one: 0),
        mean_std_norm gives (x - mean) / (std + epsilon) where the group has more than one row and
        std > epsilon, else 0 (ROLL hard-codes both constants at 1e-6, this field's default). ROLL then
        puts the value on the response's last token and accumulates it back with its token-level
        ``gamma`` (default 1), which broadcasts it over the response: A * mask here (ROLL's optional
        ``reward_clip``, ``whiten_advantages`` and ``episode_reward_weight`` are not part of it).
    A tied group (all its values equal) has its value as the mean exactly and std 0, so it gets 0 in every
    mode and semantics, also where std + epsilon is 0 (mean_std_norm with epsilon = 0), where the
    references divide 0 by 0 (NaN). Their float32 mean of a tie on a non-dyadic value (0.1, or a
    discounted return) can miss it by an ulp, which mean_std_norm divides by a std of the same size plus
    epsilon: rounding noise there (Trinity-RFT 0.6.0: up to 0.63 seen with epsilon = 1e-6), 0 here
    (docs/references.md, "Where the service and the pinned releases differ").

Defaults: gamma = 0.95 (verl_agent: algorithm.gamma of every GiGPO example script at that commit, the
trainer's config default being 1.0; roll: step_reward_gamma), 1.0 (trinity's default); step_advantage_weight
= 1.0; mode = mean_norm (verl-agent ``algorithm.gigpo.mode``, Trinity ``fnorm = none``, ROLL's example
``method: mean``); epsilon = 1e-6.

Kernel: rows sorted by (trajectory, step_index, row); G by a segmented reverse discounted scan in
ceil(log2(longest trajectory)) vectorised rounds (Hillis-Steele; no loop over steps or trajectories);
group statistics by :func:`~advantage_server.estimators.groups.group_baseline_and_std` (float64, two-pass,
tied groups exact; numba on the CPU, scatter reductions elsewhere). :func:`gigpo_loop` is the readable
per-group loop twin (test oracle).

Checked: against Trinity-RFT 0.6.0 in-process on hypothesis batches (tests/test_diff_gigpo.py); against
verl-agent and ROLL by golden cases computed from their code at the named commits
(tests/golden_gigpo/, tests/test_golden_gigpo.py); the kernel against its loop twin (tests/test_gigpo.py).

Errors: a missing ``trajectory_ids``, ``anchor_ids``, ``prompt_ids``, ``rewards`` or ``mask`` is
INVALID_ARGUMENT naming the input and the fix (checked by the core from the declared inputs), as are a
float id, gamma outside [0, 1], a negative epsilon and a mode or semantics this estimator does not offer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from advantage_client.layout import BROADCAST_TIMES_MASK
from advantage_server.estimators.groups import (
    group_baseline_and_std, group_index, group_sizes, segmented_discounted_returns,
)
from advantage_server.estimators.inputs import ANCHOR_IDS, MASK, PROMPT_IDS, STEP_INDEX, TRAJECTORY_IDS
from advantage_server.estimators.registry import (AdvantageResult, Batch, EstimatorConfig, InputSpec, register,
                                                  semantics_field)
from advantage_server.estimators.rewards import outcome_scores

SEMANTICS = ("verl_agent", "trinity", "roll")
MODES = ("mean_norm", "mean_std_norm")
_GAMMA = {"verl_agent": 0.95, "trinity": 1.0, "roll": 0.95}

STEP_REWARDS = InputSpec(
    "rewards", ("[B]", "[B, T]"), "float",
    "Immediate reward of each step row [B], or token-level rewards [B, T] summed over all T positions. The "
    "episode return is the sum over the trajectory's steps; the step return discounts it with gamma.",
    fix="send one reward per step row [B], or token-level rewards [B, T]",
)


@dataclass(frozen=True)
class GiGPOConfig(EstimatorConfig):
    semantics: str | None = semantics_field(
        SEMANTICS,
        "Reference reproduced: verl_agent (compute_gigpo_outcome_advantage: episode statistics over step rows, "
        "anchor groups within a prompt group), trinity (GiGPOAdvantageFn: episode statistics over trajectories, "
        "anchor groups across the batch, everything divided by std or 1 plus epsilon), roll "
        "(compute_response_level_rewards: groups of one and zero-std groups give 0, anchor groups across the "
        "batch).")
    gamma: float | None = field(default=None, metadata={
        "doc": "Discount of the step returns G_t = sum_{k >= t} gamma^(k - t) r_k over the trajectory's steps.",
        "range": (0.0, 1.0), "per_semantics": dict(_GAMMA),
        "default_text": "0.95 (verl_agent, roll); 1.0 (trinity)"})
    step_advantage_weight: float = field(default=1.0, metadata={
        "doc": "omega: weight of the step-level advantage A_S added to the episode-level A_E (verl-agent "
               "step_advantage_w, Trinity omega, ROLL step_reward_weight)."})
    mode: str = field(default="mean_norm", metadata={
        "doc": "Group normalisation: mean_norm (x - mean; Trinity fnorm = none, ROLL method = mean) or "
               "mean_std_norm ((x - mean) / (std + epsilon); Trinity fnorm = std, ROLL method = mean_std).",
        "enum": "GiGPOMode", "choices": MODES})
    epsilon: float = field(default=1e-6, metadata={
        "doc": "Added to the std (trinity: to the denominator, 1 in mean_norm) before dividing; roll: also the "
               "std at or below which a group gives 0.", "range": (0.0, None)})


# ------------------------------------------------------------------------------------------------ kernel
def _dense1(key: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 ``[B]`` -> dense ids ``0..n-1`` in the order of the values (equal values, equal ids) and n, by a
    stable sort (``torch.unique`` with an inverse is far slower on the CPU)."""
    srt, order = torch.sort(key, stable=True)
    new = torch.ones_like(srt, dtype=torch.bool)
    new[1:] = srt[1:] != srt[:-1]
    dense = torch.empty_like(key).index_copy_(0, order, torch.cumsum(new, 0) - 1)
    return dense, (int(dense.max()) + 1 if dense.numel() else 0)


def _dense(*keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 ``[B]`` keys -> dense ids ``0..n-1`` of their tuples (equal tuples, equal ids) and n."""
    ids, n = _dense1(keys[0])
    for key in keys[1:]:
        d, m = _dense1(key)
        ids, n = _dense1(ids * m + d)  # < B^2: no overflow for any batch that fits in memory
    return ids, n


def _stats(key: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``x`` (float64 [N]): (its group's size, mean, sample std), float64 [N] each; ``key``: int64
    [N] group ids in ``0..N-1``. A group of one has mean x and std 0.

    By :func:`~advantage_server.estimators.groups.group_baseline_and_std` (two-pass float64): a tied group
    (min == max) gets its common value as the mean exactly, so its deviations are exactly 0 and its std is
    0 (a mean taken as sum / n can miss the tied value by an ulp, and mean_std_norm with epsilon = 0 would
    then divide that ulp by a std of the same size: +-sqrt((n - 1) / n) instead of 0)."""
    mean, std = group_baseline_and_std(key, x, leave_one_out=False)
    return group_sizes(key), mean, std


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, torch.ones_like(den), den))


def _normalise(sem: str, which: str, x: torch.Tensor, key: torch.Tensor, std_norm: bool,
               epsilon: float) -> torch.Tensor:
    """x normalised within its group (``key``: int64 ids in ``0..len(x)-1``) under ``sem``; ``which`` is
    ``"episode"`` or ``"step"``."""
    n, mean, std = _stats(key, x)
    one = n == 1
    if sem == "roll":
        if not std_norm:
            return x - mean  # a group of one: x - x = 0
        ok = (n > 1) & (std > epsilon)
        return torch.where(ok, _safe_div(x - mean, std + epsilon), torch.zeros_like(x))
    if sem == "trinity":
        if which == "step":
            out = _safe_div(x - mean, (std if std_norm else torch.ones_like(std)) + epsilon)
            return torch.where(one, torch.zeros_like(x), out)
        den = torch.where(one, torch.ones_like(std), std if std_norm else torch.ones_like(std))
        return _safe_div(x - torch.where(one, torch.zeros_like(mean), mean), den + epsilon)
    # verl_agent: a group of one has std 1; episode mean 0 there, step mean x there (so A_S = 0)
    if which == "episode":
        mean = torch.where(one, torch.zeros_like(mean), mean)
    if not std_norm:
        return x - mean
    return _safe_div(x - mean, torch.where(one, torch.ones_like(std), std) + epsilon)


def gigpo_scalars(group: torch.Tensor, traj: torch.Tensor, step: torch.Tensor | None, anchor: torch.Tensor,
                  rewards: torch.Tensor, gamma: float, weight: float, mode: str, epsilon: float,
                  semantics: str) -> torch.Tensor:
    """Per-row GiGPO advantage A_E + weight * A_S, float64 ``[B]`` (see the module docstring).

    group, traj, anchor: int64 [B]; step: int64 [B] or None (batch order); rewards: float [B].
    """
    r = rewards.to(torch.float64)
    B = r.shape[0]
    if B == 0:
        return r
    rows = torch.arange(B, device=r.device)
    tid, n_traj = _dense(group, traj)               # trajectory = (prompt group, id)
    # sort by (trajectory, step, row): stable sorts from the least significant key
    order = rows
    if step is not None:
        order = torch.sort(step, stable=True).indices
    order = order[torch.sort(tid[order], stable=True).indices]
    tid_sorted = tid[order]
    length = torch.bincount(tid, minlength=n_traj)
    seg_end = (torch.cumsum(length, 0) - 1)[tid_sorted]
    g_sorted = segmented_discounted_returns(r[order], seg_end, gamma)
    G = torch.empty_like(r).index_copy_(0, order, g_sorted)           # back to row order
    R_traj = torch.zeros(n_traj, dtype=torch.float64, device=r.device).index_add_(0, tid, r)
    std_norm = mode == "mean_std_norm"
    gid, _ = _dense1(group)  # 0..G-1 with G <= the number of trajectories (the statistics' id range)
    if semantics == "trinity":                                        # one value per trajectory
        traj_group = torch.zeros(n_traj, dtype=torch.int64, device=r.device).index_copy_(0, tid, gid)
        a_e = _normalise(semantics, "episode", R_traj, traj_group, std_norm, epsilon)[tid]
    else:                                                             # one value per step row
        a_e = _normalise(semantics, "episode", R_traj[tid], gid, std_norm, epsilon)
    sid, _ = _dense(anchor) if semantics in ("trinity", "roll") else _dense(group, anchor)
    a_s = _normalise(semantics, "step", G, sid, std_norm, epsilon)
    return a_e + weight * a_s


# ------------------------------------------------------------------------------------------- loop twin
def gigpo_loop(group, traj, step, anchor, rewards, gamma: float, weight: float, mode: str, epsilon: float,
               semantics: str) -> torch.Tensor:
    """Loop twin of :func:`gigpo_scalars` (test oracle): trajectories, returns and groups one at a time, in
    Python floats, following each reference's structure."""
    g, tr, an = (x.tolist() for x in (group, traj, anchor))
    st = step.tolist() if step is not None else list(range(len(g)))
    r = [float(v) for v in rewards.tolist()]
    B = len(r)
    std_norm = mode == "mean_std_norm"

    def mean_std(vals):
        m = vals[0] if min(vals) == max(vals) else sum(vals) / len(vals)  # a tied group: its value exactly
        s = (sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
        return m, s

    def div(a, b):
        return 0.0 if b == 0 else a / b

    # trajectories: discounted returns over each one's steps in order
    trajs: dict = {}
    for i in range(B):
        trajs.setdefault((g[i], tr[i]), []).append(i)
    G, R = [0.0] * B, {}
    for key, members in trajs.items():
        members = sorted(members, key=lambda i: (st[i], i))
        running = 0.0
        for i in reversed(members):
            running = r[i] + gamma * running
            G[i] = running
        R[key] = sum(r[i] for i in members)

    def norm(vals, which):
        """normalised values of one group, in order"""
        n = len(vals)
        m, s = mean_std(vals)
        if semantics == "roll":
            if not std_norm:
                return [v - m for v in vals]
            return [div(v - m, s + epsilon) if n > 1 and s > epsilon else 0.0 for v in vals]
        if semantics == "trinity":
            if n == 1:
                return [0.0] if which == "step" else [div(vals[0], 1.0 + epsilon)]
            d = s if std_norm else 1.0
            return [div(v - m, d + epsilon) for v in vals]
        if n == 1:  # verl_agent: mean 0 (episode) or the value itself (step), std 1
            m, s = (0.0 if which == "episode" else vals[0]), 1.0
        return [div(v - m, s + epsilon) if std_norm else v - m for v in vals]

    a_e = [0.0] * B
    for gid in sorted(set(g)):
        if semantics == "trinity":
            keys = [k for k in trajs if k[0] == gid]
            for k, a in zip(keys, norm([R[k] for k in keys], "episode")):
                for i in trajs[k]:
                    a_e[i] = a
        else:
            rows = [i for i in range(B) if g[i] == gid]
            for i, a in zip(rows, norm([R[(g[i], tr[i])] for i in rows], "episode")):
                a_e[i] = a
    a_s = [0.0] * B
    buckets: dict = {}
    for i in range(B):
        buckets.setdefault(an[i] if semantics in ("trinity", "roll") else (g[i], an[i]), []).append(i)
    for members in buckets.values():
        for i, a in zip(members, norm([G[i] for i in members], "step")):
            a_s[i] = a
    return torch.tensor([a_e[i] + weight * a_s[i] for i in range(B)], dtype=torch.float64)


# ------------------------------------------------------------------------------------------- estimator
def _ids(t: torch.Tensor) -> torch.Tensor:
    """int64 ids ``[B]`` as they are; int64 rows ``[B, L]`` -> ``[B]`` ids, equal rows sharing one."""
    return group_index(t) if t.dim() == 2 else t


@register("gigpo", config=GiGPOConfig,
          inputs=[PROMPT_IDS, STEP_REWARDS, MASK, TRAJECTORY_IDS, ANCHOR_IDS, STEP_INDEX],
          reference="arXiv:2505.10978; verl-agent compute_gigpo_outcome_advantage (main@29e3e8b); "
                    "Trinity-RFT 0.6.0 GiGPOAdvantageFn; ROLL compute_response_level_rewards (main@8eb27cc)",
          per_sample=(("", BROADCAST_TIMES_MASK),))
def gigpo(cfg: GiGPOConfig, batch: Batch) -> AdvantageResult:
    """GiGPO: episode-level group advantage plus a weighted step-level advantage within anchor-state groups.

    Inputs: prompt_ids [B], rewards [B] or [B, T] (one step's reward), mask [B, T], trajectory_ids [B] or
    [B, L], anchor_ids [B] or [B, L] (integer rows: equal rows, equal ids), optional step_index [B].
    Returns advantages [B, T] (0 where mask = 0); no returns.
    """
    rewards, mask = batch["rewards"], batch["mask"]
    step = batch.get("step_index")
    adv = gigpo_scalars(batch["prompt_ids"], _ids(batch["trajectory_ids"]), step, _ids(batch["anchor_ids"]),
                        outcome_scores(rewards), cfg.gamma, cfg.step_advantage_weight, cfg.mode, cfg.epsilon,
                        cfg.semantics)
    return AdvantageResult((adv[:, None] * mask.to(torch.float64)).to(rewards.dtype))
