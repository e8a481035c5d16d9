"""prime-rl (PrimeIntellect-ai/prime-rl) adoption: its algorithm registry, one change, no code of yours.

prime-rl's orchestrator builds one algorithm per environment from ``[orchestrator.algo] type`` with
``prime_rl.orchestrator.algo.build_algorithm``, which looks the type up in ``ALGORITHM_CLASSES``, and awaits
``algorithm.finalize_group(episodes)`` for every finished cohort (``train_sink.py``); that runs the class's
``score_group``, which writes each trace's advantage on its sampled tokens. prime-rl has no config hook for the
computation, so :func:`install` replaces the four stateless entries of that registry (``grpo``, ``echo``,
``max_rl``, ``hierarchical_grpo``) by subclasses of prime-rl's own classes whose ``score_group`` asks the service
instead. Everything else is prime-rl's: the config, ``setup``, echo's ``score_episode`` (its CE weights), the
choice of traces (prime-rl's ``iter_trainable_traces``) and the writing of the advantages (prime-rl's
``assign_advantages``).

The one change, either of:

* run the orchestrator through this module (same arguments as prime-rl's ``orchestrator`` command)::

      python -m advantage_client.prime_rl @ configs/orchestrator.toml

* or, where prime-rl's ``rl`` command starts the orchestrator for you, append one line to
  ``src/prime_rl/orchestrator/algo/__init__.py`` (after ``ALGORITHM_CLASSES``)::

      from advantage_client.prime_rl import install; install(ALGORITHM_CLASSES)

The server is ``$ADVANTAGE_SERVICE_TARGET`` (TLS and the bearer token from ``$ADVANTAGE_SERVICE_TLS_CA`` /
``$ADVANTAGE_SERVICE_TOKEN_FILE``) in the orchestrator's process.

One request per cohort (what prime-rl scores at once), one row per trace ``iter_trainable_traces`` keeps, one
value back per row (``per_sample``), all under ``semantics = prime_rl``:

================== ======== ================================================================================
``type``           service  request
================== ======== ================================================================================
``grpo``, ``echo`` grpo     ``prompt_ids`` all 0; float32 rewards (prime-rl casts them so); with
                            ``length_penalty`` set: its three weights and the float32 ``num_output_tokens``,
                            ``num_total_tokens``, ``num_turns`` of each trace
``max_rl``         maxrl    ``prompt_ids`` all 0; float32 rewards
``hierarchical_    grpo     ``prompt_ids``: one id per peer set, (agent, episode) for the agents in
grpo``                      ``episode_agents`` and (agent, cohort) for the others; float64 rewards (prime-rl
                            averages Python floats)
================== ======== ================================================================================

Not served: ``rae`` (its baseline is a per-agent moving average kept in the orchestrator's memory across cohorts
and updated trace by trace: state, not a stateless computation of one request), ``opd``, ``opsd`` and ``sft``
(they assign no advantage). :func:`install` leaves those entries as they are.

This module holds no math: the numbers are the service's, checked against prime-rl's own ``finalize_group`` at the
commit ``advantage_client.references`` names (``tests/test_golden_prime_rl.py``; inside prime-rl's own code by
``tests/golden_prime_rl/generate.py --check-dropin``).
"""
from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import numpy as np

from advantage_client.trl import client_from_environment

__all__ = ["install", "remote_class", "request_of", "SERVED", "NOT_SERVED"]

#: prime-rl's ``[orchestrator.algo] type`` -> the service's estimator (``semantics = prime_rl``)
SERVED = {"grpo": "grpo", "echo": "grpo", "max_rl": "maxrl", "hierarchical_grpo": "grpo"}
#: prime-rl's types that install() leaves to prime-rl, and why
NOT_SERVED = {
    "rae": "a per-agent moving-average baseline kept across cohorts in the orchestrator (state, not one request)",
    "opd": "no advantage (a reference-KL target scored by a teacher)",
    "opsd": "no advantage (a reference-KL target scored by the policy itself)",
    "sft": "no advantage (cross-entropy on a frozen model's tokens)",
}
LENGTH_WEIGHTS = ("num_output_tokens_weight", "num_input_tokens_weight", "num_turns_weight")
COUNTS = ("num_output_tokens", "num_total_tokens", "num_turns")

_client: Any = None
_lock = threading.Lock()


def _shared_client() -> Any:
    global _client
    with _lock:
        if _client is None:
            _client = client_from_environment()
        return _client


def _count(trace: Any, name: str) -> Any:
    try:
        return getattr(trace, name)
    except AttributeError:
        raise ValueError(f"trace {getattr(trace, 'id', '?')!r} has no {name}: prime-rl's length_penalty reads "
                         f"num_output_tokens, num_total_tokens and num_turns of every trace") from None


def request_of(kind: str, algorithm: Any, pairs: list[tuple[Any, Any]]) -> tuple[str, dict, dict, str]:
    """(estimator, config, inputs, output dtype) of one cohort for the service.

    kind: prime-rl's ``[orchestrator.algo] type`` (a key of :data:`SERVED`); algorithm: the prime-rl algorithm
    instance (its ``length_penalty`` / ``episode_agents``); pairs: ``(episode, trace)`` as prime-rl's
    ``iter_trainable_traces`` yields them. Raises ``ValueError`` for a type the service does not serve, a length
    penalty of another type than ``linear`` or a trace without a count the penalty reads."""
    if kind not in SERVED:
        why = NOT_SERVED.get(kind, "not one of prime-rl's algorithms at the pinned commit")
        raise ValueError(f"[orchestrator.algo] type = {kind!r} is not served by the advantage service: {why}")
    config: dict[str, Any] = {"semantics": "prime_rl"}
    traces = [trace for _, trace in pairs]
    B = len(traces)
    inputs: dict[str, Any] = {"mask": np.ones((B, 1), np.float32), "prompt_ids": np.zeros(B, np.int64)}
    dtype = "float32"
    if kind == "hierarchical_grpo":
        agents = set(algorithm.episode_agents)
        peers: dict[tuple, int] = {}
        inputs["prompt_ids"] = np.array([
            peers.setdefault((t.agent.name, e.id if t.agent.name in agents else None), len(peers)) for e, t in pairs
        ], np.int64)
        dtype = "float64"
    inputs["rewards"] = np.array([t.reward for t in traces], dtype)
    penalty = getattr(algorithm, "length_penalty", None) if kind in ("grpo", "echo") else None
    if penalty is not None:
        if getattr(penalty, "type", "linear") != "linear":
            raise ValueError(f"[orchestrator.algo.length_penalty] type = {penalty.type!r}: the service serves "
                             "prime-rl's 'linear' length penalty")
        config["length_penalty"] = True
        config.update({w: float(getattr(penalty, w)) for w in LENGTH_WEIGHTS})
        for name in COUNTS:  # prime-rl casts them to the rewards' float32
            inputs[name] = np.array([_count(t, name) for t in traces], np.float32)
    return SERVED[kind], config, inputs, dtype


def remote_class(kind: str, base: type, client: Any = None) -> type:
    """A subclass of prime-rl's algorithm class ``base`` (the ``ALGORITHM_CLASSES[kind]`` entry) whose
    ``score_group`` asks the service (``client``; None: one shared client from the environment, made on first
    use). prime-rl's ``iter_trainable_traces`` picks the traces and its ``assign_advantages`` writes the values."""
    if kind not in SERVED:
        request_of(kind, None, [])  # raises, naming why
    from prime_rl.orchestrator.algo.base import iter_trainable_traces
    from prime_rl.orchestrator.algo.routing import assign_advantages

    async def score_group(self: Any, episodes: list) -> None:
        pairs = list(iter_trainable_traces(episodes))
        if not pairs:  # prime-rl: nothing to score
            return
        name, config, inputs, dtype = request_of(kind, self, pairs)
        service = client if client is not None else _shared_client()
        result = await asyncio.to_thread(service.compute, name, config, output_dtype=dtype, as_numpy=True,
                                         per_sample=True, **inputs)
        values = np.asarray(result.advantages).reshape(len(pairs)).tolist()
        for (_, trace), value in zip(pairs, values, strict=True):
            assign_advantages(trace, value)

    score_group.__doc__ = (f"prime-rl's {base.__name__}.score_group, computed by the advantage service "
                           f"({SERVED[kind]}, semantics = prime_rl): one request per cohort.")
    return type(f"Remote{base.__name__}", (base,), {"score_group": score_group, "__module__": __name__,
                                                   "served_as": SERVED[kind], "__doc__": base.__doc__})


def install(registry: dict | None = None, client: Any = None) -> dict[str, type]:
    """Replace prime-rl's ``grpo``, ``echo``, ``max_rl`` and ``hierarchical_grpo`` in ``registry`` (None: prime-rl's
    ``prime_rl.orchestrator.algo.ALGORITHM_CLASSES``) by :func:`remote_class` subclasses; other entries (``rae``,
    ``opd``, ``opsd``, ``sft``) stay prime-rl's. Call it before the orchestrator builds its algorithms. Installing
    twice changes nothing. Returns ``{type: the class now registered}`` for the four."""
    if registry is None:
        try:
            from prime_rl.orchestrator.algo import ALGORITHM_CLASSES as registry
        except ModuleNotFoundError as exc:
            raise ImportError(f"advantage_client.prime_rl.install() patches prime-rl's ALGORITHM_CLASSES, but "
                              f"{exc.name!r} does not import: run it in prime-rl's own environment (the one its "
                              "orchestrator runs in), or pass the registry: install(ALGORITHM_CLASSES)") from exc
    out = {}
    for kind in SERVED:
        cls = registry.get(kind)
        if cls is None:
            raise ValueError(f"prime-rl's ALGORITHM_CLASSES has no {kind!r}: not the prime-rl this drop-in serves "
                             "(see advantage_client.references)")
        if getattr(cls, "__module__", None) != __name__:
            registry[kind] = remote_class(kind, cls, client)
        out[kind] = registry[kind]
    return out


def main(argv: list[str] | None = None) -> None:
    """prime-rl's ``orchestrator`` command with :func:`install` done first (same arguments)."""
    install()
    from prime_rl.entrypoints.orchestrator import main as orchestrator

    sys.argv = ["orchestrator", *(sys.argv[1:] if argv is None else argv)]
    orchestrator()


if __name__ == "__main__":
    main()
