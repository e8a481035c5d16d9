"""prime-rl's extension point served (issue #38): ``advantage_client.prime_rl.install()`` replaces ``grpo``, ``echo``,
``max_rl`` and ``hierarchical_grpo`` in prime-rl's ``ALGORITHM_CLASSES`` by subclasses of prime-rl's classes whose
``score_group`` asks the service.

The drop-in is called the way prime-rl's orchestrator calls it: the registry entry for ``[orchestrator.algo] type``
is built with ``(config, policy_pool)`` (prime-rl's ``build_algorithm``) and ``await algorithm.finalize_group(
episodes)`` runs per cohort (prime-rl's train sink). The answers are checked against prime-rl's own outputs on every
golden case (``tests/golden_prime_rl/``), the requests are counted at the server (one per cohort), and with the
server's answers scaled by 1.0001 every case fails.

prime-rl publishes no package, so CI cannot import its ``prime_rl.orchestrator.algo``: this test puts a stand-in of
the names the drop-in touches into ``sys.modules`` (the registry, the four base classes, ``Algorithm.finalize_group``
calling ``score_group``, and the two helpers the drop-in uses: ``iter_trainable_traces`` keeping traces without an
error, of a trainable agent, with a sampled token; ``assign_advantages`` writing one value on each sampled token). The
real ones run in ``tests/golden_prime_rl/generate.py --check-dropin`` (by hand, prime-rl's own package at the pinned
commit; the outcome is recorded in the cases' ``source.dropin_check``: 40 of 40 pass, one request per cohort, 40 of
40 fail at x1.0001).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import sys
import types

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent / "golden_prime_rl"
GOLDEN = json.loads((HERE / "prime_rl_cases.json").read_text())
CASES = GOLDEN["cases"]
RTOL, ATOL = 1e-5, 2e-6


# ----------------------------------------------------------------------------- stand-ins for prime-rl's package
class Algorithm:
    action_loss_type = "rl"

    def __init__(self, config, policy_pool):
        self.policy_pool = policy_pool

    async def score_group(self, episodes):
        raise AssertionError("prime-rl's own score_group ran: the drop-in did not replace it")

    async def finalize_group(self, episodes):
        await self.score_group(episodes)


class GRPOAlgorithm(Algorithm):
    def __init__(self, config, policy_pool):
        super().__init__(config, policy_pool)
        self.length_penalty = config.length_penalty


class EchoAlgorithm(GRPOAlgorithm):
    async def score_episode(self, episode):
        episode.echo_weighted = True


class MaxRLAlgorithm(Algorithm):
    pass


class HierarchicalGRPOAlgorithm(Algorithm):
    def __init__(self, config, policy_pool):
        super().__init__(config, policy_pool)
        self.episode_agents = set(config.episode_agents)


class RAEAlgorithm(Algorithm):
    pass


def iter_trainable_traces(episodes):
    for episode in episodes:
        for trace in episode.traces:
            if not trace.has_error and trace.agent.trainable and any(any(n.mask) for n in trace.nodes):
                yield episode, trace


def assign_advantages(trace, value):
    for node in trace.nodes:
        if any(node.mask):
            node.advantages = [float(value)] * sum(node.mask)


@pytest.fixture
def prime_rl(monkeypatch):
    """The stand-in package in sys.modules; returns its ALGORITHM_CLASSES (a fresh dict per test)."""
    registry = {"grpo": GRPOAlgorithm, "echo": EchoAlgorithm, "max_rl": MaxRLAlgorithm, "rae": RAEAlgorithm,
                "hierarchical_grpo": HierarchicalGRPOAlgorithm, "opd": Algorithm, "opsd": Algorithm, "sft": Algorithm}
    mods = {"prime_rl": types.ModuleType("prime_rl"), "prime_rl.orchestrator": types.ModuleType("prime_rl.orchestrator"),
            "prime_rl.orchestrator.algo": types.ModuleType("prime_rl.orchestrator.algo"),
            "prime_rl.orchestrator.algo.base": types.ModuleType("prime_rl.orchestrator.algo.base"),
            "prime_rl.orchestrator.algo.routing": types.ModuleType("prime_rl.orchestrator.algo.routing")}
    mods["prime_rl.orchestrator.algo"].ALGORITHM_CLASSES = registry
    mods["prime_rl.orchestrator.algo.base"].iter_trainable_traces = iter_trainable_traces
    mods["prime_rl.orchestrator.algo.base"].Algorithm = Algorithm
    mods["prime_rl.orchestrator.algo.routing"].assign_advantages = assign_advantages
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return registry


# ----------------------------------------------------------------------------- episodes (verifiers' shapes)
class Node:
    def __init__(self, mask):
        self.mask, self.token_ids, self.advantages = [bool(x) for x in mask], list(range(len(mask))), None


class Trace:
    def __init__(self, tid, t):
        self.id, self.reward, self.has_error = tid, t["reward"], t["has_error"]
        self.agent = types.SimpleNamespace(name=t["agent"], trainable=t["trainable"])
        self.num_output_tokens, self.num_total_tokens, self.num_turns = (
            t["num_output_tokens"], t["num_total_tokens"], t["num_turns"])
        self.nodes = [Node(m) for m in t["node_masks"]]


def episodes_of(cohort):
    return [types.SimpleNamespace(id=e["id"], traces=[Trace(f"{e['id']}/{k}", t) for k, t in enumerate(e["traces"])])
            for e in cohort]


def config_of(case):
    c = case["config"]
    lp = c.get("length_penalty")
    return types.SimpleNamespace(type=case["algo"], episode_agents=c.get("episode_agents", []),
                                 length_penalty=None if lp is None else types.SimpleNamespace(type="linear", **lp))


def run_case(registry, case):
    """prime-rl's calls: build the registry's class, await finalize_group per cohort. Per trace: the value on its
    sampled tokens (they must agree), or None where nothing was assigned."""
    algorithm = registry[case["algo"]](config_of(case), None)
    got = []
    for cohort in case["cohorts"]:
        episodes = episodes_of(cohort)
        asyncio.run(algorithm.finalize_group(episodes))
        for e in episodes:
            for t in e.traces:
                values = [v for n in t.nodes for v in (n.advantages or [])]
                assert len(set(values)) <= 1, values
                got.append(values[0] if values else None)
    return got


def close(got, case) -> bool:
    want = [t["expected_advantage"] for cohort in case["cohorts"] for e in cohort for t in e["traces"]]
    if [g is None for g in got] != [w is None for w in want]:
        return False
    g = np.array([x for x in got if x is not None], np.float64)
    w = np.array([x for x in want if x is not None], np.float64)
    return bool(np.all(np.abs(g - w) <= RTOL * np.abs(w) + ATOL * max(1.0, float(np.abs(w).max()))))


@pytest.fixture
def counted(monkeypatch):
    from advantage_server.estimators.registry import REGISTRY

    state = {"calls": 0, "scale": 1.0}
    for name in ("grpo", "maxrl"):
        spec = REGISTRY[name]

        def fn(cfg, batch, _inner=spec.fn):
            state["calls"] += 1
            out = _inner(cfg, batch)
            return dataclasses.replace(out, advantages=out.advantages * state["scale"]) if state["scale"] != 1 else out
        monkeypatch.setitem(REGISTRY, name, dataclasses.replace(spec, fn=fn))
    return state


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_installed_algorithm_gives_prime_rls_advantages(client, prime_rl, counted, case):
    from advantage_client.prime_rl import install

    install(client=client)
    assert close(run_case(prime_rl, case), case)
    assert counted["calls"] == len(case["cohorts"])  # one request per cohort


def test_every_case_fails_with_the_servers_answers_scaled(client, prime_rl, counted):
    from advantage_client.prime_rl import install

    install(client=client)
    counted["scale"] = 1.0001
    passed = [c["name"] for c in CASES if close(run_case(prime_rl, c), c)]
    assert not passed, passed
    assert counted["calls"] == sum(len(c["cohorts"]) for c in CASES)


def test_install_replaces_the_four_and_keeps_prime_rls_classes_and_hooks(client, prime_rl):
    from advantage_client import prime_rl as dropin

    originals = dict(prime_rl)
    installed = dropin.install(client=client)
    assert set(installed) == {"grpo", "echo", "max_rl", "hierarchical_grpo"}
    for kind, cls in installed.items():
        assert prime_rl[kind] is cls and issubclass(cls, originals[kind]) and cls is not originals[kind]
        assert cls.action_loss_type == originals[kind].action_loss_type  # build_algorithm's check holds
    for kind in ("rae", "opd", "opsd", "sft"):
        assert prime_rl[kind] is originals[kind]
    assert dropin.install(client=client) == installed  # twice: no second wrapping
    episode = types.SimpleNamespace()
    asyncio.run(prime_rl["echo"](config_of({"algo": "echo", "config": {}}), None).score_episode(episode))
    assert episode.echo_weighted  # echo's own CE weighting stays prime-rl's
    with pytest.raises(ValueError, match=r"type = 'rae' is not served.*moving-average baseline"):
        dropin.remote_class("rae", RAEAlgorithm, client)


def test_install_without_a_registry_finds_prime_rls(prime_rl, client):
    from advantage_client.prime_rl import install

    install(client=client)
    assert prime_rl["grpo"].__module__ == "advantage_client.prime_rl"


def test_hierarchical_peer_sets_become_prompt_ids(prime_rl):
    from advantage_client.prime_rl import request_of

    episodes = [types.SimpleNamespace(id=f"e{k}") for k in range(2)]
    agents = [("proposer", 0), ("solver", 0), ("solver", 0), ("proposer", 1), ("solver", 1)]
    pairs = [(episodes[e], types.SimpleNamespace(agent=types.SimpleNamespace(name=a), reward=0.5)) for a, e in agents]
    algorithm = types.SimpleNamespace(episode_agents={"solver"})
    name, config, inputs, dtype = request_of("hierarchical_grpo", algorithm, pairs)
    assert (name, config, dtype) == ("grpo", {"semantics": "prime_rl"}, "float64")
    # the proposers share one set across the cohort; each episode's solvers are their own
    np.testing.assert_array_equal(inputs["prompt_ids"], [0, 1, 1, 0, 2])
    assert inputs["rewards"].dtype == np.float64


def test_a_missing_count_and_an_empty_cohort(client, prime_rl, counted):
    from advantage_client.prime_rl import install

    install(client=client)
    case = next(c for c in CASES if c["algo"] == "grpo" and c["config"]["length_penalty"])
    algorithm = prime_rl["grpo"](config_of(case), None)
    episodes = episodes_of(case["cohorts"][0])
    del episodes[0].traces[0].num_turns
    with pytest.raises(ValueError, match=r"has no num_turns: prime-rl's length_penalty reads"):
        asyncio.run(algorithm.finalize_group(episodes))
    asyncio.run(algorithm.finalize_group([]))  # nothing to score: no request, as prime-rl assigns nothing
    assert counted["calls"] == 0
