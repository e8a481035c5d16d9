"""``advantage-demo cartpole``: PPO on gymnasium CartPole-v1, with every advantage computed by the service.

    advantage-demo cartpole                      # embedded server on 127.0.0.1, 500k env steps at most
    advantage-demo cartpole --server host:50051  # use a running advantage-server instead
    advantage-demo cartpole --csv runs/cartpole.csv --plot runs/cartpole.png   # what `make demo` writes

One file that reads top to bottom: the config, the actor-critic, the rollout, the split of the rollout
into episode segments for the service's ``gae`` estimator, the PPO update, the training loop and the CLI.
The trainer never computes an advantage itself: on every update it sends the rollout to the service as
``[S, T]`` rows (one row per episode segment, right-padded with mask 0) and gets back advantages and
returns. A segment that ended by termination bootstraps with 0, one cut by CartPole's 500-step time limit
with V(final observation), one cut by the end of the rollout with V(next observation).

Training stops once the mean return of the last 20 episodes reaches ``target_return`` (475 by default,
the CartPole-v1 "solved" threshold) or after ``total_steps`` env steps.
"""
from __future__ import annotations

import argparse
import csv
import math
import pathlib
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

try:
    import gymnasium as gym
except ModuleNotFoundError:  # the demo extra is not installed: main() says so (exit 2) instead of a traceback
    gym = None
import numpy as np
import torch
from torch import nn

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_server.demo.options import add_config_arguments
from advantage_server.demo.service import connect

RETURN_WINDOW = 20  # episodes averaged in "mean return"
NOT_ENDED, TERMINATED, TRUNCATED = 0, 1, 2  # how a step ended its episode


# --------------------------------------------------------------------------- config
@dataclass
class PPOConfig:
    """Everything a run depends on; the CLI exposes the fields that have a ``flag``."""

    total_steps: int = field(default=500_000, metadata={
        "flag": "--total-steps", "help": "env steps budget (all envs together)"})
    seed: int = field(default=1, metadata={
        "flag": "--seed", "help": "seed of torch, numpy and the envs (env i resets with seed + i)"})
    target_return: float = field(default=475.0, metadata={
        "flag": "--target-return", "help": "stop once the mean return of the last 20 episodes reaches this "
                                           "(inf: always use the whole budget)"})
    server: str | None = field(default=None, metadata={
        "flag": "--server", "help": "HOST:PORT of a running advantage-server (default: start one in-process)"})
    num_envs: int = field(default=4, metadata={"flag": "--num-envs", "help": "CartPole-v1 envs stepped in turn"})
    quiet: bool = field(default=False, metadata={"flag": "--quiet", "help": "no per-update progress lines"})
    csv: str | None = field(default=None, metadata={
        "flag": "--csv", "help": "write update, env_steps, mean_return, rpc_share, wall_s per update to this file"})
    plot: str | None = field(default=None, metadata={
        "flag": "--plot", "help": "write the learning curve (mean return of the last 20 episodes against env steps) "
                                  "to this PNG at the end; needs matplotlib (the demo extra)"})
    num_steps: int = field(default=128, metadata={"help": "steps per env in one rollout"})
    learning_rate: float = field(default=2.5e-4, metadata={"help": "Adam learning rate, annealed linearly to 0"})
    epochs: int = field(default=4, metadata={"help": "passes over each rollout"})
    minibatches: int = field(default=4, metadata={"help": "minibatches per pass"})
    clip: float = field(default=0.2, metadata={"help": "PPO ratio clip epsilon"})
    ent_coef: float = field(default=0.01, metadata={"help": "entropy bonus weight"})
    vf_coef: float = field(default=0.5, metadata={"help": "value loss weight"})
    max_grad_norm: float = field(default=0.5, metadata={"help": "global gradient norm clip"})
    gamma: float = field(default=0.99, metadata={"help": "discount (sent to the service as gae_gamma)"})
    gae_lambda: float = field(default=0.95, metadata={"help": "GAE lambda (sent to the service)"})
    hidden: int = field(default=64, metadata={"help": "width of the two tanh layers of actor and critic"})
    rpc_timeout: float = field(default=30.0, metadata={"help": "deadline of one advantage call, seconds"})


@dataclass
class TrainResult:
    """What a run produced.

    episode_returns: undiscounted return of every finished episode, in the order they ended.
    final_mean_return: mean of the last 20 of them (nan if none finished).
    rpc_seconds: wall time spent inside ``client.compute``; wall_seconds: the whole run (server start included).
    curve: one ``(env steps, mean return, share of wall time in the RPC)`` per update (the CSV's rows).
    """

    episode_returns: list[float]
    env_steps: int
    final_mean_return: float
    rpc_seconds: float
    wall_seconds: float
    updates: int
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (env steps, mean return, rpc share)


def mean_return(episode_returns: list[float]) -> float:
    """Mean of the last ``RETURN_WINDOW`` episode returns; nan before the first episode ends."""
    window = episode_returns[-RETURN_WINDOW:]
    return float(np.mean(window)) if window else math.nan


# --------------------------------------------------------------------------- actor-critic
def init_linear(n_in: int, n_out: int, gain: float) -> nn.Linear:
    """A linear layer with orthogonal weights of the given gain and zero bias."""
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """Separate tanh MLPs: the actor maps ``[B, obs_dim]`` float32 to ``[B, n_actions]`` logits, the critic
    maps it to ``[B]`` values. Small output gains (0.01 actor, 1 critic) start near a uniform policy."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int):
        super().__init__()
        g = math.sqrt(2.0)
        self.actor = nn.Sequential(init_linear(obs_dim, hidden, g), nn.Tanh(), init_linear(hidden, hidden, g),
                                   nn.Tanh(), init_linear(hidden, n_actions, 0.01))
        self.critic = nn.Sequential(init_linear(obs_dim, hidden, g), nn.Tanh(), init_linear(hidden, hidden, g),
                                    nn.Tanh(), init_linear(hidden, 1, 1.0))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``[B, obs_dim]`` -> ``[B]`` V(s)."""
        return self.critic(obs).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor | None = None):
        """Policy at ``obs`` ``[B, obs_dim]``: sample ``actions`` ``[B]`` int64 if not given, then return
        ``(actions [B], log pi(actions) [B], entropy [B], V(s) [B])``."""
        dist = torch.distributions.Categorical(logits=self.actor(obs))
        if actions is None:
            actions = dist.sample()
        return actions, dist.log_prob(actions), dist.entropy(), self.value(obs)


# --------------------------------------------------------------------------- rollout
@dataclass
class Rollout:
    """``num_steps`` steps of ``num_envs`` envs, time-major.

    obs [N, E, obs_dim] float32; actions [N, E] int64; logprobs, rewards, values [N, E] float32;
    ends [N, E] int8 (NOT_ENDED, TERMINATED or TRUNCATED: how step t ended env e's episode);
    cut_values [N, E] float32: the bootstrap value if a segment ends at (t, e): 0 after termination,
    V(final observation) after truncation, V(next observation) on the last step of the rollout.
    """

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    rewards: np.ndarray
    values: np.ndarray
    ends: np.ndarray
    cut_values: np.ndarray


def collect(envs: list[gym.Env], agent: ActorCritic, next_obs: np.ndarray, num_steps: int,
            running_returns: np.ndarray, episode_returns: list[float]) -> tuple[Rollout, np.ndarray]:
    """Step every env ``num_steps`` times with the current policy, resetting an env when its episode ends.

    next_obs: ``[E, obs_dim]`` float32, the observation each env is in now. ``running_returns`` ``[E]``
    float64 (the return of each env's unfinished episode) is updated in place and each finished
    episode's return appended to ``episode_returns``. Returns the rollout and the new ``next_obs``.
    """
    E, obs_dim = next_obs.shape
    ro = Rollout(obs=np.zeros((num_steps, E, obs_dim), np.float32), actions=np.zeros((num_steps, E), np.int64),
                 logprobs=np.zeros((num_steps, E), np.float32), rewards=np.zeros((num_steps, E), np.float32),
                 values=np.zeros((num_steps, E), np.float32), ends=np.zeros((num_steps, E), np.int8),
                 cut_values=np.zeros((num_steps, E), np.float32))
    next_obs = next_obs.copy()
    for t in range(num_steps):
        ro.obs[t] = next_obs
        with torch.no_grad():
            actions, logprobs, _, values = agent.evaluate(torch.from_numpy(next_obs))
        ro.actions[t], ro.logprobs[t], ro.values[t] = actions.numpy(), logprobs.numpy(), values.numpy()
        for e, env in enumerate(envs):
            obs, reward, terminated, truncated, _ = env.step(int(actions[e]))
            ro.rewards[t, e] = reward
            running_returns[e] += reward
            if terminated or truncated:
                episode_returns.append(float(running_returns[e]))
                running_returns[e] = 0.0
                ro.ends[t, e] = TERMINATED if terminated else TRUNCATED
                if not terminated:
                    with torch.no_grad():
                        ro.cut_values[t, e] = agent.value(torch.from_numpy(np.asarray(obs, np.float32))[None])[0]
                obs, _ = env.reset()
            next_obs[e] = obs
    with torch.no_grad():
        last_values = agent.value(torch.from_numpy(next_obs)).numpy()
    ro.cut_values[-1] = np.where(ro.ends[-1] == NOT_ENDED, last_values, ro.cut_values[-1])
    return ro, next_obs


# --------------------------------------------------------------------------- advantages from the service
def segment_rows(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Place every step of an ``[N, E]`` rollout in a row of episode segments.

    A segment is a run of consecutive steps of one env that ends where an episode ended (``ends != 0``)
    or at the rollout's last step. Returns ``row`` and ``col`` ``[N, E]`` int64 (step (t, e) goes to
    ``[row, col]`` of the ``[S, T]`` padded batch, segments of env 0 first) and ``last`` ``[S]``: the
    flat env-major index ``e * N + t`` of each segment's final step.
    """
    N, E = ends.shape
    cut = (ends != NOT_ENDED).T.copy()                     # [E, N], env-major
    cut[:, -1] = True
    cut = cut.reshape(-1)
    row = np.cumsum(cut) - cut                             # segments finished before this step
    starts = np.flatnonzero(np.concatenate(([True], cut[:-1])))
    col = np.arange(N * E) - starts[row]
    return row.reshape(E, N).T, col.reshape(E, N).T, np.flatnonzero(cut)


def service_gae(client: AdvantageClient, ro: Rollout, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns ``[N, E]`` float32 for a rollout, from one ``gae`` call on the service.

    Sends rewards, values and mask ``[S, T]`` float32 (one episode segment per row, right-padded with
    mask 0) and ``bootstrap_values`` ``[S]`` (the rollout's ``cut_values`` at each segment's last step).
    """
    row, col, last = segment_rows(ro.ends)
    S, T = int(row.max()) + 1, int(col.max()) + 1
    rewards, values, mask = (np.zeros((S, T), np.float32) for _ in range(3))
    rewards[row, col], values[row, col], mask[row, col] = ro.rewards, ro.values, 1.0
    bootstrap = ro.cut_values.T.reshape(-1)[last]
    res = client.compute("gae", {"gae_gamma": gamma, "gae_lambda": lam, "normalize_advantages": False},
                         rewards=rewards, mask=mask, values=values, bootstrap_values=bootstrap, as_numpy=True)
    return res.advantages[row, col], res.returns[row, col]


# --------------------------------------------------------------------------- PPO update
def ppo_update(agent: ActorCritic, optimizer: torch.optim.Optimizer, ro: Rollout, advantages: np.ndarray,
               returns: np.ndarray, cfg: PPOConfig, rng: np.random.Generator) -> None:
    """``cfg.epochs`` passes of clipped-surrogate PPO over the rollout flattened to ``[N * E]`` samples,
    in ``cfg.minibatches`` shuffled minibatches; advantages are whitened per minibatch."""
    obs = torch.from_numpy(ro.obs.reshape(-1, ro.obs.shape[-1]))
    actions = torch.from_numpy(ro.actions.reshape(-1))
    old_logprobs = torch.from_numpy(ro.logprobs.reshape(-1))
    adv_all = torch.from_numpy(np.ascontiguousarray(advantages, np.float32).reshape(-1))
    ret_all = torch.from_numpy(np.ascontiguousarray(returns, np.float32).reshape(-1))
    n = obs.shape[0]
    size = n // cfg.minibatches
    for _ in range(cfg.epochs):
        order = torch.from_numpy(rng.permutation(n))
        for start in range(0, size * cfg.minibatches, size):
            idx = order[start:start + size]
            _, logprobs, entropy, values = agent.evaluate(obs[idx], actions[idx])
            adv = adv_all[idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            ratio = torch.exp(logprobs - old_logprobs[idx])
            policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv).mean()
            value_loss = 0.5 * (values - ret_all[idx]).pow(2).mean()
            loss = policy_loss - cfg.ent_coef * entropy.mean() + cfg.vf_coef * value_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()


# --------------------------------------------------------------------------- training loop
def train(cfg: PPOConfig) -> TrainResult:
    """Train PPO on CartPole-v1 with the service's GAE; deterministic for a given ``cfg.seed`` on one device.

    Starts an in-process server (device "auto") unless ``cfg.server`` names one. Prints one progress
    line per update unless ``cfg.quiet``; writes the per-update CSV if ``cfg.csv``.
    """
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: threading costs more than it saves
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    batch = cfg.num_envs * cfg.num_steps
    num_updates = max(cfg.total_steps // batch, 1)
    with ExitStack() as stack:
        stack.callback(torch.set_num_threads, threads)
        client = connect(stack, cfg.server, cfg.rpc_timeout)
        envs = [gym.make("CartPole-v1") for _ in range(cfg.num_envs)]
        for env in envs:
            stack.callback(env.close)
        next_obs = np.stack([env.reset(seed=cfg.seed + i)[0] for i, env in enumerate(envs)]).astype(np.float32)
        agent = ActorCritic(next_obs.shape[1], int(envs[0].action_space.n), cfg.hidden)
        optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5)
        writer = None
        if cfg.csv:
            writer = csv.writer(stack.enter_context(open(cfg.csv, "w", newline="")))
            writer.writerow(["update", "env_steps", "mean_return", "rpc_share", "wall_s"])
        running_returns = np.zeros(cfg.num_envs)
        episode_returns: list[float] = []
        curve: list[tuple[int, float, float]] = []
        rpc_seconds, env_steps, update = 0.0, 0, 0
        while update < num_updates:
            update += 1
            for group in optimizer.param_groups:
                group["lr"] = cfg.learning_rate * (1.0 - (update - 1) / num_updates)
            ro, next_obs = collect(envs, agent, next_obs, cfg.num_steps, running_returns, episode_returns)
            env_steps += batch
            t_rpc = time.perf_counter()
            advantages, returns = service_gae(client, ro, cfg.gamma, cfg.gae_lambda)
            rpc_seconds += time.perf_counter() - t_rpc
            ppo_update(agent, optimizer, ro, advantages, returns, cfg, rng)
            wall = time.perf_counter() - t0
            recent = mean_return(episode_returns)
            curve.append((env_steps, recent, rpc_seconds / wall))
            if writer is not None:
                writer.writerow([update, env_steps, f"{recent:.2f}", f"{rpc_seconds / wall:.4f}", f"{wall:.2f}"])
            if not cfg.quiet:
                print(f"update {update:4d}/{num_updates} | env steps {env_steps:7d} | mean return {recent:6.1f} "
                      f"| rpc {100 * rpc_seconds / wall:4.1f}% | fps {env_steps / wall:5.0f}", flush=True)
            if recent >= cfg.target_return:
                break
    return TrainResult(episode_returns=episode_returns, env_steps=env_steps,
                       final_mean_return=mean_return(episode_returns), rpc_seconds=rpc_seconds,
                       wall_seconds=time.perf_counter() - t0, updates=update, curve=curve)


# --------------------------------------------------------------------------- learning curve
def plot_learning_curve(result: TrainResult, path: str, target_return: float | None = None) -> None:
    """Write ``result.curve`` as a PNG: the mean return of the last 20 episodes against env steps (and the
    target as a dashed line). Needs matplotlib (``pip install 'advantage-service[demo]'``)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'advantage-service[demo]'") from None
    matplotlib.use("Agg")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    from matplotlib import pyplot as plt

    steps = [s for s, _, _ in result.curve]
    returns = [r for _, r, _ in result.curve]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    ax.plot(steps, returns, color="tab:blue", lw=1.8, label=f"mean return, last {RETURN_WINDOW} episodes")
    if target_return is not None and math.isfinite(target_return):
        ax.axhline(target_return, color="tab:green", ls="--", lw=1, label=f"target {target_return:g}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("episodic return")
    ax.set_ylim(0, 520)
    ax.grid(alpha=0.3)
    share = 100 * result.rpc_seconds / result.wall_seconds if result.wall_seconds else 0.0
    ax.set_title(f"PPO on CartPole-v1, GAE from the advantage service ({result.env_steps} steps, "
                 f"{result.wall_seconds:.0f} s, {share:.1f}% in the RPC)", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """``advantage-demo cartpole [options]``; the options come from the ``flag`` fields of :class:`PPOConfig`."""
    parser = argparse.ArgumentParser(prog="advantage-demo", description="Demos of the advantage service.")
    demos = parser.add_subparsers(dest="demo", required=True, metavar="DEMO")
    cartpole = demos.add_parser("cartpole", help="PPO on CartPole-v1 with the service's GAE",
                                description="PPO on gymnasium CartPole-v1; every advantage comes from the "
                                            "advantage service's GAE.")
    add_config_arguments(cartpole, PPOConfig)
    return parser


MISSING_EXTRA = ("advantage-demo cartpole needs gymnasium, which comes with the demo extra: "
                 "pip install 'advantage-service[demo]' (in a checkout: .venv/bin/pip install -e '.[demo]')")


def main(argv: list[str] | None = None) -> int:
    """Run a demo; returns the exit code (0 done, 2 the server could not be reached or refused a call, or
    gymnasium, from the ``demo`` extra, is not installed)."""
    args = vars(build_parser().parse_args(argv))
    args.pop("demo")
    if gym is None:
        print(MISSING_EXTRA, file=sys.stderr)
        return 2
    cfg = PPOConfig(**args)
    try:
        result = train(cfg)
    except AdvantageServiceError as exc:
        print(f"advantage-demo: advantage service error ({exc.code.name}): {exc}", file=sys.stderr)
        return 2
    print(f"final mean return {result.final_mean_return:.1f} (last {RETURN_WINDOW} episodes) | "
          f"env steps {result.env_steps} | wall {result.wall_seconds:.1f}s | "
          f"rpc {100 * result.rpc_seconds / result.wall_seconds:.1f}% | updates {result.updates}", flush=True)
    if cfg.plot:
        plot_learning_curve(result, cfg.plot, cfg.target_return)
        print(f"learning curve written to {cfg.plot}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
