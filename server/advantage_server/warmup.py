"""Warm-up: every compiled kernel variant a request can need is made before the server reports SERVING.

The CPU kernels (:mod:`advantage_server.estimators.jit`) are numba functions compiled on first use, once per
argument signature (dtype float32/float64, a raw mask's dtype, the group layout's path, ...): ~0.5 s each,
about 20 s of CPU for all of them, during which the calling request (and, through the GIL, every other one)
waits. :func:`warm` runs every registered estimator on small inputs (B=64, T=72: big enough for the kernels,
which small inputs skip) under each semantics and each bool option, in float32 and float64, with grouped rows
in order and shuffled, each declared shape of the ids and the rewards, every mask dtype the wire carries, a NaN
where the config allows one, a magnitude that needs float64, per-sample results and the packed layout. With numba's on-disk cache
filled (``NUMBA_CACHE_DIR``; the Docker image fills it at build time) the variants load in well under a second;
with an empty one they compile (and are saved for the next process).

``BoundServer.start`` calls it (``create_server(..., warmup=True)``; ``advantage-server`` warms unless
``--no-warmup``) between starting gRPC and setting health SERVING: health says NOT_SERVING meanwhile. A stop
asked meanwhile (SIGTERM or SIGINT to ``advantage-server``, ``BoundServer.stop`` from another thread) ends the
warm-up at its next estimator call or kernel compile, whichever comes first (one compile, ~0.5 s on an idle
core, is not interrupted), and the server stops without ever reporting SERVING.
tests/test_warmup.py checks that every kernel in :data:`~advantage_server.estimators.jit.KERNELS` is reached
and that a wider sweep of requests compiles nothing more afterwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from numba.core import event as numba_event

from advantage_server.errors import InvalidInput
from advantage_server.estimators import REGISTRY, jit
from advantage_server.estimators.registry import EstimatorSpec

log = logging.getLogger("advantage_server")

#: rows and columns of the warm-up batches: B*T above validate.SMALL_ELEMENTS (4096), where the checks use the
#: kernels, and small enough for the calls to cost little once the kernels are loaded
B, T, L = 64, 72, 4
GROUP = 4  # samples per prompt in the in-order layout
#: a magnitude beyond core.FLOAT32_PROMOTE_MAGNITUDE: the float32 request computes in float64
HUGE = 1e30
FLOAT_DTYPES = (np.float32, np.float64)
#: every mask dtype the wire decodes to (validate checks each raw mask with its own kernel variant)
MASK_DTYPES = (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64)


@dataclass
class WarmupReport:
    """What :func:`warm` did: ``signatures`` kernel variants held afterwards (``new`` of them made here:
    ``loaded`` from numba's cache, ``compiled`` afresh), ``calls`` estimator runs, ``seconds`` of wall time,
    ``cache`` numba's cache directory in words, ``stopped`` when the server stopped it half-way."""

    signatures: int
    new: int
    loaded: int
    compiled: int
    calls: int
    seconds: float
    cache: str
    stopped: bool = False

    def line(self) -> str:
        """The start-up log line: ``warmed 41 kernel signatures in 0.8 s (41 loaded from cache, 0 compiled;
        1234 estimator calls; cache: DIR)``."""
        return (f"warmed {self.signatures} kernel signatures in {self.seconds:.1f} s ({self.loaded} loaded from "
                f"cache, {self.compiled} compiled; {self.calls} estimator calls; cache: {self.cache})"
                + (" [stopped early: the server is shutting down]" if self.stopped else ""))


def _cache_counts() -> tuple[int, int]:
    """(cache hits, cache misses) summed over the kernels: loads from numba's cache and fresh compiles."""
    hits = misses = 0
    for kernel in jit.KERNELS:
        hits += sum(kernel.stats.cache_hits.values())
        misses += sum(kernel.stats.cache_misses.values())
    return hits, misses


class KernelCollector:
    """Prometheus collector: ``advantage_kernel_signatures``, the compiled kernel variants this process holds
    (:func:`~advantage_server.estimators.jit.compiled_signatures`). Constant after a warm-up that covered
    everything; a rise after SERVING means a request waited for a compile."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("advantage_kernel_signatures", "Compiled CPU kernel variants held by this "
                                "process (numba); rises when a request needs one the warm-up did not make",
                                value=jit.compiled_signatures())


# ------------------------------------------------------------------------------------------ the requests
def _bool_fields(config: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config) if str(f.type).replace(" ", "") in ("bool", "bool|None")]


def configs(spec: EstimatorSpec) -> Iterator[dict[str, Any]]:
    """Configs that reach every path of ``spec``: under each semantics, the defaults, each bool field set
    to the opposite of its default there (True where it does not apply), and all of them True (a combination
    the semantics refuses is skipped by the caller)."""
    fields = {f.name: f for f in dataclasses.fields(spec.config)}
    semantics = fields["semantics"].metadata["choices"] if "semantics" in fields else (None,)
    bools = _bool_fields(spec.config)
    for s in semantics:
        base = {} if s is None else {"semantics": s}
        yield base
        defaults = spec.config(**base).resolved()
        for name in bools:
            yield {**base, name: getattr(defaults, name) is not True}
        if len(bools) > 1:
            yield {**base, **{name: True for name in bools}}


#: prompt-id layouts: equal groups back to back (the trainers' layout), equal groups shuffled, mixed sizes
LAYOUTS = ("in_order", "permuted", "mixed")


def batch(spec: EstimatorSpec, dtype: type, rng: np.random.Generator, *, layout: str = "in_order",
          ids_shape: int = 0, mask_dtype: type | None = None, optional: bool = True, rows: int = B,
          float_shape: int = 0) -> dict[str, torch.Tensor]:
    """One tensor for every input ``spec`` declares (the optional ones only when ``optional``): ``dtype``
    floats, prompt ids in the ``layout`` of :data:`LAYOUTS`, the ``ids_shape``-th declared shape of an id
    input (``float_shape``-th: of a float input), a mask of ``mask_dtype`` (default ``dtype``), ``rows`` rows."""
    out: dict[str, torch.Tensor] = {}
    dims = {"B": rows, "T": T, "L": L}
    for s in spec.inputs:
        if not (optional or s.required):
            continue
        k = {"integer": ids_shape, "float": float_shape}.get(s.kind, 0)
        shape_text = s.shapes[min(k, len(s.shapes) - 1)]
        size = tuple(dims.get(d.strip(), L) for d in shape_text.strip("[]").split(",") if d.strip())
        for name in (f"{s.prefix}a", f"{s.prefix}b") if s.is_pattern else (s.name,):
            if s.kind == "mask":
                m = rng.random(size) < 0.8
                m[:, 0] = True
                a = m.astype(mask_dtype or dtype)
            elif s.kind == "integer":
                groups = np.repeat(np.arange(rows // GROUP), GROUP)
                if layout == "permuted":
                    groups = rng.permutation(groups)
                elif layout == "mixed":
                    groups = rng.integers(0, rows // 3, rows)
                a = groups.astype(np.int64)
                if len(size) > 1:  # token-id rows: equal rows are one group
                    a = np.repeat(a[:, None], size[1], axis=1) * 7 + np.arange(size[1])
            elif name.endswith("logprobs"):
                a = (-2 * rng.random(size)).astype(dtype)
            else:  # rewards, values, weights: positive (probability masses and IS weights must be)
                a = (0.05 + 0.95 * rng.random(size)).astype(dtype)
            out[name] = torch.from_numpy(np.ascontiguousarray(a))
    return out


def packed(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``tensors`` in the packed layout: the ``[B, T]`` inputs flat over the mask's positions, and the
    ``cu_seqlens`` keyword for ``AdvantageCore.run``."""
    mask = tensors["mask"].bool()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), mask.sum(1).cumsum(0)])
    flat = {k: (v[mask] if v.dim() == 2 and v.shape == mask.shape else v) for k, v in tensors.items()}
    return flat, {"cu_seqlens": cu}


def requests(spec: EstimatorSpec) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]]:
    """``(config, tensors, keywords for AdvantageCore.run)`` for every warm-up call of ``spec`` (see the
    module's doc)."""
    rng = np.random.default_rng(0)
    ids = any(s.kind == "integer" for s in spec.inputs)
    optional = any(not s.required for s in spec.inputs)
    id_shapes = max((len(s.shapes) for s in spec.inputs if s.kind == "integer"), default=1)
    float_shapes = max((len(s.shapes) for s in spec.inputs if s.kind == "float"), default=1)
    dense: dict[str, Any] = {}
    float_2d = next((s.name for s in spec.inputs if s.kind == "float" and not s.is_pattern
                     and len(s.shapes[0].split(",")) == 2), None)
    for dtype in FLOAT_DTYPES:
        for cfg in configs(spec):
            yield cfg, batch(spec, dtype, rng), dense
            if optional:  # an optional input present can turn a fast path off (grpo's std_rewards)
                yield cfg, batch(spec, dtype, rng, optional=False), dense
            if ids:
                yield cfg, batch(spec, dtype, rng, layout="mixed"), dense
                yield cfg, batch(spec, dtype, rng, layout="permuted", optional=False), dense
            for k in range(1, float_shapes):  # token-level rewards [B, T] where [B] is the first shape
                yield cfg, batch(spec, dtype, rng, float_shape=k, optional=False), dense
            for k in range(1, id_shapes):
                yield cfg, batch(spec, dtype, rng, ids_shape=k, optional=False), dense
            for s in spec.inputs:  # a missing value where the config allows one (NaN: "no value")
                if s.nan_allowed_when is not None and not s.is_pattern:
                    tensors = batch(spec, dtype, rng)
                    tensors[s.name].view(-1)[1] = float("nan")
                    yield cfg, tensors, dense
        for layout in (("in_order", "mixed") if ids else ("in_order",)):
            yield {}, batch(spec, dtype, rng, layout=layout, optional=False), {"per_sample": True}
        yield ({}, *packed(batch(spec, dtype, rng, optional=False)))
        if float_2d is not None:
            tensors = batch(spec, dtype, rng)
            tensors[float_2d].view(-1)[3] = HUGE
            yield {}, tensors, dense


def _extra(first: EstimatorSpec) -> Iterator[tuple[str, dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]]:
    """The checks of a raw mask of every wire dtype, row lengths instead of a mask, and more distinct
    ``[B, L]`` id rows than the row table's first size (it grows)."""
    rng = np.random.default_rng(1)
    for mask_dtype in MASK_DTYPES:
        yield first.name, {}, batch(first, np.float32, rng, mask_dtype=mask_dtype, optional=False), {}
    for dtype in FLOAT_DTYPES:
        tensors = batch(first, dtype, rng, optional=False)
        tensors["lengths"] = torch.from_numpy(tensors.pop("mask").numpy().astype(bool).sum(1).astype(np.int64))
        yield first.name, {}, tensors, {}
    rows = next((spec for name, spec in REGISTRY.items() if not name.startswith("_") and any(
        s.kind == "integer" and len(s.shapes) > 1 for s in spec.inputs)), None)
    if rows is not None:
        yield rows.name, {}, batch(rows, np.float32, rng, ids_shape=1, layout="mixed", optional=False,
                                   rows=1200), {}


def all_requests() -> Iterator[tuple[str, dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]]:
    """``(estimator, config, tensors, keywords for AdvantageCore.run)`` of every warm-up call, estimators in
    registry order."""
    for name, spec in REGISTRY.items():
        if name.startswith("_"):  # test-only registrations
            continue
        for cfg, tensors, keywords in requests(spec):
            yield name, cfg, tensors, keywords
    yield from _extra(next(spec for name, spec in REGISTRY.items() if not name.startswith("_")))


# ------------------------------------------------------------------------------------------ warming
class WarmupStopped(Exception):
    """Raised in the warm-up's thread, where a kernel compile would begin, once the warm-up is asked to stop."""


class _StopBeforeCompile(numba_event.Listener):
    """numba ``"numba:compile"`` listener: in ``thread`` (the warm-up's), raises :class:`WarmupStopped` as a
    kernel compile begins once ``stop`` is set, so that a warm-up call that would compile several kernels ends
    at the next one instead of after all of them. Other threads' compiles (a request that came early) go on."""

    def __init__(self, stop: threading.Event, thread: int):
        self.stop, self.thread = stop, thread

    def on_start(self, event: Any) -> None:
        if self.stop.is_set() and threading.get_ident() == self.thread:
            raise WarmupStopped("the server is shutting down")

    def on_end(self, event: Any) -> None:
        pass


def warm(core: Any, stop: threading.Event | None = None) -> WarmupReport:
    """Run every warm-up call (:func:`all_requests`) on ``core`` (an ``AdvantageCore``, any device) so every
    kernel signature is compiled or loaded from numba's cache; returns what it did. A request the estimator
    refuses (a config the semantics does not take) is skipped; any other error propagates (a bug: the server
    must not report SERVING). ``stop`` (set by ``BoundServer.stop`` or a signal handler, from another thread or
    from a signal handler of this one): the warm-up ends before its next call or its next kernel compile,
    whichever comes first, and the report says ``stopped=True`` (a compile in progress is not interrupted)."""
    started = time.perf_counter()
    before = jit.compiled_signatures()
    hits, misses = _cache_counts()
    calls, stopped = 0, False
    listening = (numba_event.install_listener("numba:compile", _StopBeforeCompile(stop, threading.get_ident()))
                 if stop is not None else contextlib.nullcontext())
    with listening:
        for name, cfg, tensors, keywords in all_requests():
            if stop is not None and stop.is_set():
                stopped = True
                break
            try:
                core.run(name, dict(cfg), tensors, **keywords)
            except InvalidInput:
                continue
            except Exception:  # WarmupStopped, possibly wrapped by numba (a kernel's callee compiles inside it)
                if stop is not None and stop.is_set():
                    stopped = True
                    break
                raise
            calls += 1
    if core.device.type == "cuda":
        torch.cuda.synchronize(core.device)
    after_hits, after_misses = _cache_counts()
    signatures = jit.compiled_signatures()
    return WarmupReport(signatures=signatures, new=signatures - before, loaded=after_hits - hits,
                        compiled=after_misses - misses, calls=calls, seconds=time.perf_counter() - started,
                        cache=jit.cache_location(), stopped=stopped)


def main() -> int:
    """``python -m advantage_server.warmup``: fill numba's cache (``NUMBA_CACHE_DIR``) with every kernel
    signature, on the CPU, and print the report line (the Docker image runs it at build time)."""
    from advantage_server.core import AdvantageCore

    report = warm(AdvantageCore("cpu"))
    print(report.line(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
