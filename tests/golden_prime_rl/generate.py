"""Generate golden advantages by running prime-rl's own algorithm code (PrimeIntellect-ai/prime-rl).

Pinned source: https://github.com/PrimeIntellect-ai/prime-rl at commit
559b44772e471d1538537b8805cc77f3824a5e64.

This script is a maintenance tool.  The tests only read its output,
``tests/golden_prime_rl/prime_rl_cases.json``; they never import this file and CI
never runs it.

Refresh command (from the repository root)::

    rm -rf /tmp/prime-rl-src && mkdir -p /tmp/prime-rl-src && git --git-dir=/work/.mirror/PrimeIntellect-ai+prime-rl/repo archive 559b44772e471d1538537b8805cc77f3824a5e64 | tar -x -C /tmp/prime-rl-src && .venv/bin/python tests/golden_prime_rl/generate.py --prime-rl-src /tmp/prime-rl-src

Without the local mirror, use a checkout instead::

    git clone https://github.com/PrimeIntellect-ai/prime-rl /tmp/prime-rl-src && git -C /tmp/prime-rl-src checkout 559b44772e471d1538537b8805cc77f3824a5e64
    .venv/bin/python tests/golden_prime_rl/generate.py --prime-rl-src /tmp/prime-rl-src

The script checks the git blob ids of the source files it runs (and of the config file it reads defaults from)
against the pinned commit and refuses to run on other versions (``--no-verify`` skips that check).  Output is
deterministic: seeded NumPy inputs, CPU PyTorch with one thread.

prime-rl code that is run (unmodified, imported from ``--prime-rl-src/src``):

* the package ``prime_rl.orchestrator.algo`` itself (its ``__init__``, so every algorithm module it imports:
  ``base``, ``routing``, ``grpo``, ``echo``, ``max_rl``, ``hierarchical_grpo``, ``rae``, ``opd``, ``opsd``,
  ``sft``), its ``build_algorithm(config, policy_pool)`` (the orchestrator's ``envs.py`` builds the per-env
  algorithm with it), and per cohort ``await algorithm.finalize_group(episodes)`` (what
  ``train_sink.py`` awaits once a group's episodes are finished), which runs the algorithm's ``score_group``:
  the real ``iter_trainable_traces`` (``base.py``) picks the traces, the real ``assign_advantages``
  (``routing.py``) writes each sampled token's advantage into ``node.advantages``.  The expected advantage of a
  trace is read back from there (every sampled token of a trace must hold the same value; it does).
* ``LinearLengthPenaltyConfig``'s defaults are read (``ast``, not executed) from
  ``packages/prime-rl-configs/src/prime_rl/configs/algorithm.py``.

Stand-ins (none computes anything numeric):

* ``prime_rl.configs`` / ``prime_rl.configs.algorithm``: plain classes carrying the attributes the algorithms
  read (``length_penalty`` with its three weights, ``episode_agents``, echo's ``roles`` / ``filter``, ``decay``,
  ``teacher``; ``action_loss_type`` / ``type`` for ``build_algorithm``'s check).  The real module needs
  pydantic, ``renderers``, ``pydantic_config`` and ``verifiers.EnvConfig`` at class-definition time.
* ``verifiers`` / ``verifiers.v1``: empty modules (the algorithm modules use ``vf`` only in annotations).
* ``prime_rl.utils.logger`` (``get_logger``), ``prime_rl.utils.utils`` (``import_object``),
  ``prime_rl.transports.rollouts`` (``TrainingSample``), ``prime_rl.orchestrator.trajectories``
  (``iter_trainable_branches``), ``prime_rl.orchestrator.utils`` (``episode_env_name``): names imported at
  module level by the algo package, never called by ``finalize_group`` of the algorithms run here (the real
  modules import wandb, msgspec, zmq, ...).
* the episodes: ``Episode`` (``id``, ``traces``), ``Trace`` (``id``, ``agent.name``, ``agent.trainable``,
  ``has_error``, ``reward``, ``num_output_tokens``, ``num_total_tokens``, ``num_turns``, ``nodes``) and
  ``MessageNode`` (``token_ids``, ``mask``, ``advantages``) objects holding the generated values, in place of
  verifiers' pydantic ``Episode`` / ``Trace`` (whose ``reward``, counts and ``has_error`` are properties over
  rewards, usage records and errors).

Drop-in check (``--check-dropin``)
---------------------------------

Proves ``advantage_client.prime_rl`` inside prime-rl's own code, for every case already in ``--out``; it computes
no new cases and writes only ``source.dropin_check``.  Command (from the repository root)::

    rm -rf /tmp/prime-rl-src && mkdir -p /tmp/prime-rl-src && git --git-dir=/work/.mirror/PrimeIntellect-ai+prime-rl/repo archive 559b44772e471d1538537b8805cc77f3824a5e64 | tar -x -C /tmp/prime-rl-src && .venv/bin/python tests/golden_prime_rl/generate.py --prime-rl-src /tmp/prime-rl-src --check-dropin

With the same set-up, it starts an in-process server (``create_server("127.0.0.1", 0, device="cpu")``), points
``$ADVANTAGE_SERVICE_TARGET`` at it, wraps the ``fn`` of the server's ``grpo`` and ``maxrl`` to count the calls,
and calls ``advantage_client.prime_rl.install()`` (which replaces ``grpo``, ``echo``, ``max_rl`` and
``hierarchical_grpo`` in the real ``prime_rl.orchestrator.algo.ALGORITHM_CLASSES``).  Per case, from its recorded
inputs, the real ``build_algorithm`` builds the algorithm (it must be the drop-in's class) and
``finalize_group`` runs on fresh episodes of every cohort; each trace's sampled tokens must hold the recorded
advantage within ``|got - want| <= 1e-5 * |want| + 2e-6 * max(1, max |want| of the case)``, an unscored trace
none, with exactly one request per cohort.  It then runs every case again with the estimators' advantages
multiplied by 1.0001 and counts the cases that fail (all of them).  The outcome goes into
``source.dropin_check``.  Exit status 1 when a case fails the unperturbed check.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import copy
import hashlib
import json
import math
import os
import sys
import types
from pathlib import Path

import numpy as np

PRIME_REPO = "https://github.com/PrimeIntellect-ai/prime-rl"
PRIME_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
ALGO = "src/prime_rl/orchestrator/algo/"
CONFIGS = "packages/prime-rl-configs/src/prime_rl/configs/algorithm.py"
# git blob ids of the files at PRIME_COMMIT (git rev-parse <commit>:<path>).
PRIME_BLOBS = {
    ALGO + "__init__.py": "2e9736c718d4cfcd06cf7afdac3a587ce9fe1dd3",
    ALGO + "base.py": "9bc9e76cf409343affcf1c44246ca524570d7854",
    ALGO + "routing.py": "c7e569b4516ae24124d62dc062149076276cefe4",
    ALGO + "grpo.py": "9d040962309499332bf4c6e7f413c9d086f5b75b",
    ALGO + "echo.py": "32afd81a45a8a5cec0d26846c1152b9647bef7f3",
    ALGO + "max_rl.py": "2eb93c4b8d3a99fc527ad008c0708a42fb0f72dd",
    ALGO + "hierarchical_grpo.py": "f08e1bc9b28ecab61be154e0d8344275bbe01ae2",
    ALGO + "rae.py": "5763a39ff962c146323dd93459ee5929af85bc42",
    ALGO + "opd.py": "3e72ed3fc83aacc2e8fab3d8882dd5e886beee4c",
    ALGO + "opsd.py": "6a280b27b0207b69058ed2c40ec14c424d3cd5db",
    ALGO + "sft.py": "9f1aa91d33bb3817e303fe8904beabb73457daf3",
    CONFIGS: "739cd6e4bb7cfe76ba43bb0963f714dc26ba9c31",
}
SOURCE_PATHS = [ALGO + "grpo.py", ALGO + "echo.py", ALGO + "max_rl.py", ALGO + "hierarchical_grpo.py",
                ALGO + "base.py", ALGO + "routing.py", ALGO + "__init__.py", CONFIGS]
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "prime_rl_cases.json"
BASE_SEED = 20260821


# --------------------------------------------------------------------------
# Importing prime-rl
# --------------------------------------------------------------------------


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def verify_source(src: Path) -> None:
    bad = []
    for rel, blob in PRIME_BLOBS.items():
        p = src / rel
        if not p.is_file():
            bad.append(f"{rel}: missing")
        elif git_blob_id(p) != blob:
            bad.append(f"{rel}: blob {git_blob_id(p)} != {blob}")
    if bad:
        raise SystemExit(f"--prime-rl-src {src} is not prime-rl@{PRIME_COMMIT}:\n  " + "\n  ".join(bad)
                         + "\n(use --no-verify to override)")


def length_penalty_defaults(src: Path) -> dict[str, float]:
    """The defaults of LinearLengthPenaltyConfig's three weights, read from the source (``Field(<default>, ...)``)."""
    tree = ast.parse((src / CONFIGS).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LinearLengthPenaltyConfig")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id.endswith("_weight"):
            call = node.value
            assert isinstance(call, ast.Call) and call.func.id == "Field", ast.dump(node)
            out[node.target.id] = float(ast.literal_eval(call.args[0]))
    assert set(out) == {"num_output_tokens_weight", "num_input_tokens_weight", "num_turns_weight"}, out
    return out


class _Config:
    """Stand-in for a prime-rl algorithm config (pydantic in prime-rl): the attributes the algorithms read."""

    action_loss_type = "rl"

    def __init__(self, **kw):
        self.__dict__.update(kw)


def install_stubs() -> None:
    """Stand-ins for the modules the algo package imports but ``finalize_group`` never uses (module docstring)."""

    def module(name, package=False, **attrs):
        assert name not in sys.modules, f"{name} is already imported; refusing to shadow it"
        m = types.ModuleType(name)
        if package:
            m.__path__ = []
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    def never(name):
        def fn(*a, **k):
            raise AssertionError(f"stand-in {name} was called")
        return fn

    vf = module("verifiers", package=True)
    vf.v1 = module("verifiers.v1")
    configs = module("prime_rl.configs", package=True)
    names = ["AlgoConfig", "FrozenModelConfig", "GRPOAlgoConfig", "EchoAlgoConfig", "MaxRLAlgoConfig",
             "RAEAlgoConfig", "HierarchicalGRPOAlgoConfig", "OPDAlgoConfig", "OPSDAlgoConfig", "SFTAlgoConfig"]
    configs.algorithm = module("prime_rl.configs.algorithm", ActionLossType=str,
                               **{n: type(n, (_Config,), {}) for n in names})
    module("prime_rl.utils.logger", get_logger=lambda: types.SimpleNamespace(
        info=lambda *a, **k: None, debug=lambda *a, **k: None, warning=lambda *a, **k: None))
    module("prime_rl.utils.utils", import_object=never("import_object"))
    module("prime_rl.transports.rollouts", TrainingSample=type("TrainingSample", (), {}))
    module("prime_rl.orchestrator.trajectories", iter_trainable_branches=never("iter_trainable_branches"))
    module("prime_rl.orchestrator.utils", episode_env_name=never("episode_env_name"))


def import_prime_rl(src: Path):
    """The real ``prime_rl.orchestrator.algo`` package from ``src`` (after :func:`install_stubs`)."""
    sys.path.insert(0, str(src / "src"))
    import prime_rl.orchestrator.algo as algo

    for mod in ("prime_rl.orchestrator.algo", "prime_rl.orchestrator.algo.base", "prime_rl.orchestrator.algo.grpo",
                "prime_rl.orchestrator.algo.routing", "prime_rl.orchestrator.algo.max_rl",
                "prime_rl.orchestrator.algo.hierarchical_grpo", "prime_rl.orchestrator.algo.echo"):
        f = Path(sys.modules[mod].__file__).resolve()
        assert f.is_relative_to(src.resolve()), f"{mod} was imported from {f}, not from {src}"
    return algo


# --------------------------------------------------------------------------
# Stand-in episodes
# --------------------------------------------------------------------------


class MessageNode:
    def __init__(self, token_ids, mask):
        self.token_ids, self.mask = list(token_ids), list(mask)
        self.advantages = None


class Agent:
    def __init__(self, name, trainable):
        self.name, self.trainable = name, trainable


class Trace:
    def __init__(self, tid, t):
        self.id = tid
        self.agent = Agent(t["agent"], t["trainable"])
        self.has_error = t["has_error"]
        self.reward = t["reward"]
        self.num_output_tokens = t["num_output_tokens"]
        self.num_total_tokens = t["num_total_tokens"]
        self.num_turns = t["num_turns"]
        self.nodes = [MessageNode(range(100, 100 + len(m)), [bool(x) for x in m]) for m in t["node_masks"]]


class Episode:
    def __init__(self, e):
        self.id = e["id"]
        self.traces = [Trace(f"{e['id']}/{k}", t) for k, t in enumerate(e["traces"])]


def build_config(algo_module, case):
    """A stand-in config of ``case["algo"]`` (prime-rl's ``[orchestrator.algo]``)."""
    cfg = algo_module.ALGORITHM_CLASSES  # noqa: F841  (the registry the config's type selects from)
    conf = sys.modules["prime_rl.configs.algorithm"]
    c = case["config"]
    lp = c.get("length_penalty")
    lp_obj = None if lp is None else _Config(type="linear", **lp)
    kind = case["algo"]
    if kind == "grpo":
        return conf.GRPOAlgoConfig(type="grpo", length_penalty=lp_obj)
    if kind == "echo":
        tool = _Config(alpha=0.1)
        roles = _Config(system=None, user=None, assistant=None, tool=tool)
        return conf.EchoAlgoConfig(type="echo", length_penalty=lp_obj, roles=roles, filter=None)
    if kind == "max_rl":
        return conf.MaxRLAlgoConfig(type="max_rl")
    if kind == "hierarchical_grpo":
        return conf.HierarchicalGRPOAlgoConfig(type="hierarchical_grpo", episode_agents=list(c["episode_agents"]))
    raise ValueError(kind)


def read_advantages(episodes):
    """Per trace (in episode order): the scalar every sampled token holds, or None (no advantage assigned)."""
    out = []
    for e in episodes:
        for t in e.traces:
            values = [v for n in t.nodes for v in (n.advantages or [])]
            if all(n.advantages is None for n in t.nodes):
                out.append(None)
                continue
            assert len(values) == sum(sum(n.mask) for n in t.nodes), t.id
            assert all(v == values[0] for v in values), (t.id, values)
            assert isinstance(values[0], float) and math.isfinite(values[0])
            out.append(values[0])
    return out


def run_algorithm(algo_module, case, cohorts):
    """Build the case's algorithm with prime-rl's build_algorithm and await finalize_group per cohort."""
    algorithm = algo_module.build_algorithm(build_config(algo_module, case), None)
    per_cohort = []
    for cohort in cohorts:
        episodes = [Episode(e) for e in cohort]
        asyncio.run(algorithm.finalize_group(episodes))
        per_cohort.append(read_advantages(episodes))
    return algorithm, per_cohort


# --------------------------------------------------------------------------
# Case specifications
# --------------------------------------------------------------------------


def spec(name, algo, groups, *, rewards="binary", lp=None, agents=("solver",), episode_agents=None,
         filtered=False, counts="random"):
    """groups: episodes per cohort; agents: the agents of one episode (one trace each); lp: None (off),
    "default" (prime-rl's defaults) or a dict of the three weights."""
    return dict(name=name, algo=algo, groups=list(groups), rewards=rewards, lp=lp, agents=list(agents),
                episode_agents=episode_agents, filtered=filtered, counts=counts)


W_OUT, W_IN, W_TURN = "num_output_tokens_weight", "num_input_tokens_weight", "num_turns_weight"
CASES = [
    # ---- grpo: reward minus the cohort mean over its trainable traces, no std
    spec("grpo-4x8-binary", "grpo", [8, 8, 8, 8]),
    spec("grpo-2x4-float", "grpo", [4, 4], rewards="normal"),
    spec("grpo-3x16-decimal", "grpo", [16, 16, 16], rewards="decimal"),
    spec("grpo-ragged-cohorts", "grpo", [1, 2, 5, 7, 3], rewards="uniform"),
    spec("grpo-tied-and-single", "grpo", [6, 1, 5, 4], rewards="ties"),
    spec("grpo-filtered-traces", "grpo", [8, 6, 6], rewards="uniform", filtered=True),
    spec("grpo-multi-agent-pooled", "grpo", [4, 3], rewards="normal", agents=("proposer", "solver", "solver")),
    spec("grpo-large-rewards", "grpo", [5, 5], rewards="large"),
    spec("grpo-negative", "grpo", [6, 6], rewards="negative"),
    # ---- grpo with the linear length penalty
    spec("grpo-lp-default-binary", "grpo", [8, 8], lp="default"),
    spec("grpo-lp-default-float", "grpo", [6, 4, 4], rewards="uniform", lp="default"),
    spec("grpo-lp-default-decimal", "grpo", [16, 8], rewards="decimal", lp="default"),
    spec("grpo-lp-output-only", "grpo", [8, 8], rewards="uniform", lp={W_OUT: 0.5, W_IN: 0.0, W_TURN: 0.0}),
    spec("grpo-lp-input-only", "grpo", [8, 5], rewards="uniform", lp={W_OUT: 0.0, W_IN: 0.3, W_TURN: 0.0}),
    spec("grpo-lp-turns-only", "grpo", [6, 6], rewards="binary", lp={W_OUT: 0.0, W_IN: 0.0, W_TURN: 0.7}),
    spec("grpo-lp-heavy", "grpo", [4, 4, 4], rewards="uniform", lp={W_OUT: 2.0, W_IN: 1.5, W_TURN: 1.0}),
    spec("grpo-lp-zero-weights", "grpo", [6, 6], rewards="normal", lp={W_OUT: 0.0, W_IN: 0.0, W_TURN: 0.0}),
    spec("grpo-lp-zero-counts", "grpo", [5, 5], rewards="uniform", lp="default", counts="zeros"),
    spec("grpo-lp-small-counts", "grpo", [6, 6, 3], rewards="binary", lp="default", counts="small"),
    spec("grpo-lp-negative-rewards", "grpo", [6, 6], rewards="normal", lp="default"),
    spec("grpo-lp-ragged-filtered", "grpo", [1, 3, 7, 2], rewards="uniform", lp="default", filtered=True),
    spec("grpo-lp-multi-agent", "grpo", [3, 3], rewards="uniform", lp="default", agents=("proposer", "solver")),
    # ---- echo: GRPO's score_group, inherited (the generator checks the numbers equal grpo's)
    spec("echo-2x8-binary", "echo", [8, 8]),
    spec("echo-lp-default", "echo", [6, 6], rewards="uniform", lp="default"),
    spec("echo-ragged-filtered", "echo", [2, 5, 4], rewards="decimal", filtered=True),
    # ---- max_rl: (r - mean) / mean, 0 where the mean <= 0
    spec("maxrl-4x8-binary", "max_rl", [8, 8, 8, 8]),
    spec("maxrl-rare-success", "max_rl", [16, 16, 16], rewards="rare"),
    spec("maxrl-uniform", "max_rl", [6, 6], rewards="uniform"),
    spec("maxrl-small-mean", "max_rl", [4, 4, 4], rewards="tiny"),
    spec("maxrl-zero-and-negative-means", "max_rl", [5, 4, 6, 4], rewards="mixed_sign"),
    spec("maxrl-ties-and-single", "max_rl", [6, 1, 4, 3], rewards="ties"),
    spec("maxrl-decimal", "max_rl", [8, 8], rewards="decimal"),
    spec("maxrl-filtered-multi-agent", "max_rl", [4, 4], rewards="uniform", filtered=True,
         agents=("proposer", "solver")),
    # ---- hierarchical_grpo: peer sets (agent, episode) for episode_agents, else (agent, cohort)
    spec("hier-proposer-solver", "hierarchical_grpo", [4, 4], rewards="uniform",
         agents=("proposer", "solver", "solver", "solver"), episode_agents=["solver"]),
    spec("hier-binary-many-solvers", "hierarchical_grpo", [3, 5], rewards="binary",
         agents=("proposer", "solver", "solver", "solver", "solver", "solver"), episode_agents=["solver"]),
    spec("hier-single-solver-zero", "hierarchical_grpo", [5], rewards="normal",
         agents=("proposer", "solver"), episode_agents=["solver"]),
    spec("hier-two-episode-agents", "hierarchical_grpo", [3, 3], rewards="decimal",
         agents=("proposer", "solver", "solver", "judge", "judge"), episode_agents=["solver", "judge"]),
    spec("hier-filtered", "hierarchical_grpo", [5, 4], rewards="uniform", filtered=True,
         agents=("proposer", "solver", "solver", "solver"), episode_agents=["solver"]),
    spec("hier-no-episode-agent-present", "hierarchical_grpo", [6, 4], rewards="normal",
         agents=("proposer", "critic"), episode_agents=["solver"]),
    spec("hier-ties", "hierarchical_grpo", [4, 3], rewards="ties",
         agents=("proposer", "solver", "solver", "solver"), episode_agents=["solver"]),
]


# --------------------------------------------------------------------------
# Input generation
# --------------------------------------------------------------------------


def gen_rewards(rng, kind, n, cohort=0):
    if kind == "binary":
        r = rng.integers(0, 2, size=n).astype(float)
    elif kind == "rare":  # MaxRL's case: a low pass rate
        r = (rng.random(n) < 0.12).astype(float)
    elif kind == "normal":
        r = rng.normal(0.0, 1.0, size=n)
    elif kind == "uniform":
        r = rng.random(n)
    elif kind == "decimal":  # values no float32 holds exactly (0.1, 0.7, ...)
        r = rng.integers(0, 11, size=n) / 10.0
    elif kind == "large":
        r = rng.normal(0.0, 1.0, size=n) * 1000.0 + 5000.0
    elif kind == "negative":
        r = -rng.random(n) * 3.0
    elif kind == "tiny":  # a small positive mean: SkyRL's epsilon would show
        r = rng.random(n) * 1e-3
    elif kind == "mixed_sign":  # per cohort: a zero group, a negative-mean group, a positive one
        choice = int(rng.integers(0, 3))
        r = [np.zeros(n), rng.normal(-1.0, 0.5, size=n), rng.normal(0.5, 0.5, size=n)][choice]
    elif kind == "ties":
        v = float(rng.choice([0.7, 0.1, 1.0, 0.0, 0.3]))
        r = np.full(n, v) if cohort % 2 == 0 else rng.integers(0, 11, size=n) / 10.0  # odd cohorts: untied
    else:
        raise ValueError(kind)
    return [float(x) for x in r]


def gen_counts(rng, kind):
    if kind == "zeros":  # every count 0: the group maxima clamp to 1
        return 0, 0, 0
    if kind == "small":
        out = int(rng.integers(0, 4))
        return out, out + int(rng.integers(0, 3)), int(rng.integers(0, 3))
    out = int(rng.integers(1, 4000))
    return out, out + int(rng.integers(0, 9000)), int(rng.integers(1, 9))


def gen_node_masks(rng, sampled):
    """A prompt node, then model turns and tool outputs; ``sampled`` False: no sampled token at all."""
    masks = [[0] * int(rng.integers(1, 6))]
    for k in range(int(rng.integers(1, 4))):
        masks.append([1 if sampled else 0] * int(rng.integers(1, 7)))
        if k and rng.random() < 0.5:
            masks.append([0] * int(rng.integers(1, 4)))
    return masks


def gen_cohorts(rng, c):
    cohorts = []
    for g, n_episodes in enumerate(c["groups"]):
        n_traces = n_episodes * len(c["agents"])
        # cohorts with mixed_sign draw one kind for the whole cohort
        rewards = gen_rewards(rng, c["rewards"], n_traces, g)
        episodes, k = [], 0
        for e in range(n_episodes):
            traces = []
            for agent in c["agents"]:
                fault = str(rng.choice(["none", "error", "untrainable", "unsampled"], p=[0.7, 0.1, 0.1, 0.1])) \
                    if c["filtered"] else "none"
                out, tot, turns = gen_counts(rng, c["counts"])
                traces.append(dict(agent=agent, trainable=fault != "untrainable", has_error=fault == "error",
                                   reward=rewards[k], num_output_tokens=out, num_total_tokens=tot, num_turns=turns,
                                   node_masks=gen_node_masks(rng, fault != "unsampled")))
                k += 1
            episodes.append(dict(id=f"ep{g}-{e}", traces=traces))
        cohorts.append(episodes)
    return cohorts


def case_config(c, defaults):
    config = {}
    if c["algo"] in ("grpo", "echo"):
        config["length_penalty"] = (None if c["lp"] is None else dict(defaults) if c["lp"] == "default"
                                    else dict(c["lp"]))
    if c["algo"] == "hierarchical_grpo":
        config["episode_agents"] = list(c["episode_agents"])
    return config


def run_case(algo_module, defaults, idx, c):
    rng = np.random.default_rng([BASE_SEED, idx])
    case = {"name": c["name"], "algo": c["algo"], "config": case_config(c, defaults),
            "length_penalty_weights_from": ("LinearLengthPenaltyConfig defaults" if c["lp"] == "default" else None)}
    cohorts = gen_cohorts(rng, c)
    algorithm, advantages = run_algorithm(algo_module, case, cohorts)
    assert type(algorithm) is algo_module.ALGORITHM_CLASSES[c["algo"]]
    if c["algo"] == "echo":  # the same numbers as grpo's, bit for bit
        _, as_grpo = run_algorithm(algo_module, {**case, "algo": "grpo"}, cohorts)
        assert as_grpo == advantages, c["name"]
    for cohort, adv in zip(cohorts, advantages):
        traces = [t for e in cohort for t in e["traces"]]
        for t, a in zip(traces, adv, strict=True):
            t["expected_advantage"] = a
    case["cohorts"] = cohorts
    scored = [a for adv in advantages for a in adv if a is not None]
    assert scored, c["name"]
    # every case must notice its answers scaled by 1.0001 (tests/test_prime_rl_dropin.py)
    assert max(abs(a) for a in scored) > 0.05, c["name"]
    return case


HOW = (
    "CPU PyTorch {torch_version}, torch.set_num_threads(1), inputs from a seeded NumPy generator "
    "(numpy.random.default_rng([{seed}, case_index])). Per case: prime-rl's own build_algorithm "
    "(src/prime_rl/orchestrator/algo/__init__.py, the real package and ALGORITHM_CLASSES) builds the algorithm "
    "from a stand-in config of [orchestrator.algo] (type, length_penalty with its three weights, episode_agents; "
    "the length-penalty defaults read with ast from packages/prime-rl-configs/src/prime_rl/configs/algorithm.py), "
    "and per cohort `await algorithm.finalize_group(episodes)` runs its unmodified score_group (grpo.py, echo.py, "
    "max_rl.py, hierarchical_grpo.py) with the real iter_trainable_traces (base.py) and assign_advantages "
    "(routing.py) on stand-in verifiers Episode/Trace/MessageNode objects holding the generated rewards (Python "
    "floats), token counts, turns, agents, error/trainable flags and node masks; expected_advantage is the value "
    "assign_advantages wrote on every sampled token of the trace (null: the trace was not scored). Stubs: "
    "prime_rl.configs(.algorithm) (plain config classes), verifiers(.v1) (empty), prime_rl.utils.logger, "
    "prime_rl.utils.utils, prime_rl.transports.rollouts, prime_rl.orchestrator.trajectories, "
    "prime_rl.orchestrator.utils (names imported at module level, never called). echo cases are also run as grpo "
    "and must give the same numbers bit for bit. Floats are written with repr."
)


def dump(doc, path: Path) -> None:
    parts = ['{"source":' + json.dumps(doc["source"], allow_nan=False) + ',\n"cases":[\n']
    parts.append(",\n".join(json.dumps(c, separators=(",", ":"), allow_nan=False) for c in doc["cases"]))
    parts.append("\n]}\n")
    path.write_text("".join(parts))
    assert json.loads(path.read_text()) == doc


# --------------------------------------------------------------------------
# --check-dropin: advantage_client.prime_rl inside prime-rl's own code
# --------------------------------------------------------------------------

DROPIN_ESTIMATORS = ("grpo", "maxrl")
DROPIN_PERTURBATION = 1.0001
DROPIN_COMMAND = (
    "rm -rf /tmp/prime-rl-src && mkdir -p /tmp/prime-rl-src && git --git-dir=/work/.mirror/PrimeIntellect-ai+"
    f"prime-rl/repo archive {PRIME_COMMIT} | tar -x -C /tmp/prime-rl-src && .venv/bin/python "
    "tests/golden_prime_rl/generate.py --prime-rl-src /tmp/prime-rl-src --check-dropin"
)


def _tol_of(want):
    scale = 2e-6 * max(1.0, max((abs(w) for w in want if w is not None), default=0.0))
    return lambda w: 1e-5 * abs(w) + scale


def dropin_case(algo_module, case, requests):
    """One case through build_algorithm and finalize_group with the drop-in installed: (failures, info)."""
    failures, info = [], {}
    before = sum(requests.values())
    try:
        algorithm, got = run_algorithm(algo_module, case, copy.deepcopy(case["cohorts"]))
    except Exception as err:  # noqa: BLE001  (reported, not hidden)
        return [f"raised {err!r}"], info
    name = type(algorithm).__module__
    if name != "advantage_client.prime_rl":
        failures.append(f"build_algorithm gave {type(algorithm)!r}, not the drop-in's class")
    info["requests"] = made = sum(requests.values()) - before
    if made != len(case["cohorts"]):
        failures.append(f"{made} requests for {len(case['cohorts'])} cohorts")
    want = [t["expected_advantage"] for cohort in case["cohorts"] for e in cohort for t in e["traces"]]
    flat = [a for adv in got for a in adv]
    tol = _tol_of(want)
    worst = 0.0
    for i, (g, w) in enumerate(zip(flat, want, strict=True)):
        if (g is None) != (w is None):
            failures.append(f"trace {i}: got {g!r}, want {w!r}")
        elif w is not None:
            worst = max(worst, abs(g - w) / tol(w))
            if not abs(g - w) <= tol(w):
                failures.append(f"trace {i}: got {g!r}, want {w!r} (tolerance {tol(w):.3g})")
    info["worst"] = worst
    return failures, info


def check_dropin(algo_module, path: Path, factor: float = DROPIN_PERTURBATION) -> int:
    import dataclasses
    import functools

    root = HERE.parents[1]
    for sub in ("server", "client"):
        if str(root / sub) not in sys.path:
            sys.path.append(str(root / sub))
    from advantage_server.estimators.registry import REGISTRY
    from advantage_server.server import create_server

    import advantage_client.prime_rl as dropin

    doc = json.loads(path.read_text())
    cases = doc["cases"]
    state = {"scale": 1.0, "requests": dict.fromkeys(DROPIN_ESTIMATORS, 0)}

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(cfg, batch):
            state["requests"][name] += 1
            result = fn(cfg, batch)
            if state["scale"] != 1.0:
                result = dataclasses.replace(result, advantages=result.advantages * state["scale"])
            return result
        return wrapper

    originals = {name: REGISTRY[name] for name in DROPIN_ESTIMATORS}
    for name, spec_ in originals.items():
        REGISTRY[name] = dataclasses.replace(spec_, fn=counted(name, spec_.fn))
    for var in ("ADVANTAGE_SERVICE_TLS_CA", "ADVANTAGE_SERVICE_TOKEN_FILE"):
        os.environ.pop(var, None)
    srv = create_server("127.0.0.1", 0, device="cpu").start()
    try:
        os.environ["ADVANTAGE_SERVICE_TARGET"] = srv.address
        replaced = dropin.install()
        assert set(replaced) == {"grpo", "echo", "max_rl", "hierarchical_grpo"}, replaced

        def run_all(scale):
            state["scale"] = scale
            return [(c["name"], *dropin_case(algo_module, c, state["requests"])) for c in cases]

        results = run_all(1.0)
        requests = dict(state["requests"])
        perturbed = run_all(factor)
    finally:
        srv.stop(grace=1.0)
        REGISTRY.update(originals)

    passed = [name for name, failures, _ in results if not failures]
    failed_perturbed = [name for name, failures, _ in perturbed if failures]
    print(f"drop-in check, {len(cases)} cases of {path}:")
    for name, failures, info in results:
        print(f"  {'ok  ' if not failures else 'FAIL'} {name}: requests {info.get('requests')}; worst |err|/tol "
              f"{info.get('worst', float('nan')):.3g}")
        for f in failures:
            print(f"       {f}")
    print(f"passed {len(passed)}/{len(cases)}; requests {requests}")
    print(f"with every estimator's results x{factor}: {len(failed_perturbed)}/{len(cases)} fail")
    for name, failures, info in perturbed:
        if not failures:
            print(f"  PASSES {name}: worst |err|/tol {info.get('worst', float('nan')):.3g}")
    if factor != DROPIN_PERTURBATION:
        print(f"(factor {factor} is not the recorded {DROPIN_PERTURBATION}: {path} left as it is)")
        return 0 if len(passed) == len(cases) else 1
    doc["source"]["dropin_check"] = {
        "cases": len(cases),
        "passed": len(passed),
        "requests": requests,
        "cohorts": sum(len(c["cohorts"]) for c in cases),
        f"fail_at_x{DROPIN_PERTURBATION}": len(failed_perturbed),
        "stubbed": "as for the cases (source.how); the server is in-process, the client the drop-in's own",
        "command": DROPIN_COMMAND,
    }
    dump(doc, path)
    print(f"wrote source.dropin_check into {path}")
    return 0 if len(passed) == len(cases) else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prime-rl-src", required=True, type=Path, help="prime-rl source tree at commit " + PRIME_COMMIT)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-verify", action="store_true", help="skip the source version check")
    ap.add_argument("--check-dropin", action="store_true",
                    help="check advantage_client.prime_rl against the cases in --out inside prime-rl's own code "
                         "(an in-process server) and record the outcome in source.dropin_check")
    ap.add_argument("--dropin-perturbation", type=float, default=DROPIN_PERTURBATION)
    a = ap.parse_args(argv)
    src = a.prime_rl_src.resolve()
    if not a.no_verify:
        verify_source(src)

    import torch

    torch.set_num_threads(1)
    defaults = length_penalty_defaults(src)
    install_stubs()
    algo_module = import_prime_rl(src)
    if a.check_dropin:
        return check_dropin(algo_module, a.out, a.dropin_perturbation)

    names = [c["name"] for c in CASES]
    assert len(set(names)) == len(names)
    cases = [run_case(algo_module, defaults, i, c) for i, c in enumerate(CASES)]
    doc = {
        "source": {
            "repo": PRIME_REPO,
            "commit": PRIME_COMMIT,
            "paths": SOURCE_PATHS,
            "length_penalty_defaults": defaults,
            "how": HOW.format(torch_version=torch.__version__, seed=BASE_SEED),
            "generator": "tests/golden_prime_rl/generate.py",
        },
        "cases": cases,
    }
    dump(doc, a.out)
    counts = {}
    for c in cases:
        counts[c["algo"]] = counts.get(c["algo"], 0) + 1
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes, {len(cases)} cases: {counts})")


if __name__ == "__main__":
    sys.exit(main())
