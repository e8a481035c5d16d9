"""Warm-up: every compiled kernel variant a request can need is made before the server reports SERVING.

The CPU kernels (:mod:`advantage_server.estimators.jit`) are numba functions compiled on first use, once per
argument signature (dtype float32/float64, a raw mask's dtype, the group layout's path, ...): ~0.5 s each,
about 30 s of CPU for all 56 of them, during which the calling request (and, through the GIL, every other one)
waits. Which signatures exist is found by running requests: :func:`all_requests` runs every registered
estimator on small inputs (B=64, T=72: big enough for the kernels, which small inputs skip) under each
semantics and each bool option, in float32 and float64, with grouped rows in order and shuffled, each declared
shape of the ids and the rewards, every mask dtype the wire carries, a NaN where the config allows one, a
magnitude that needs float64, per-sample results and the packed layout (1,065 calls).

:func:`warm` runs those calls only when it must. They write a *signature list* (every kernel's signatures,
:func:`list_path`) into numba's cache directory, under a :func:`fingerprint` of the code that decides the
signatures; a later start with that list loads each signature from numba's on-disk cache
(``NUMBA_CACHE_DIR``; the Docker image fills it, and the list, at build time) without running the 1,065 calls,
then runs one call per estimator (:func:`first_calls`). Measured with ``scripts/start_time.py`` on a 2-core
machine shared with other work (never idle; its 1-minute load before each start is given): this warm-up took
0.5-0.9 s (the list 0.4-0.5 s, the 19 calls 0.05-0.3 s), and ``advantage-server`` went from process start to
SERVING in 2.13 s at best, 2.22 s median, 2.79 s at worst over 7 starts at load 0.7-1.0 (2.1-2.8 s of the
server's own CPU, most of it importing torch), and 2.26 s at best, 2.77 s median over 10 at load 1.8-2.4.
Before, the 1,065 calls ran on every start: 2.75 s at best, 4.95 s median, 7.17 s at worst over 5 starts at load
0.9 (3.4-7.1 s of CPU; 10-19 s when busier). With an empty cache the calls compile everything: 22.3 and 22.6 s
to SERVING at load 1.3-1.5 (24 s of CPU), 28 and 42 s busier; the compiled code and the list are saved for the
next process. Either kind of start holds the same 56 signatures
(``advantage_kernel_signatures``): a cache-loaded start held 49 before, lacking the signatures numba gives the
kernels that other kernels call only when it compiles their callers (:func:`_callees`).

``BoundServer.start`` calls it (``create_server(..., warmup=True)``; ``advantage-server`` warms unless
``--no-warmup``) between starting gRPC and setting health SERVING: health says NOT_SERVING meanwhile. A stop
asked meanwhile (SIGTERM or SIGINT to ``advantage-server``, ``BoundServer.stop`` from another thread) ends the
warm-up at its next estimator call, listed signature or kernel compile, whichever comes first (one compile,
~0.5 s on an idle core, is not interrupted), and the server stops without ever reporting SERVING.
tests/test_warmup.py checks that every kernel in :data:`~advantage_server.estimators.jit.KERNELS` is reached,
that a wider sweep of requests compiles nothing more afterwards, both after the calls and after a start from
the list, and that both starts hold the same signatures (``advantage_kernel_signatures``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import logging
import os
import pathlib
import pickle
import platform
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import numba
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
    ``loaded`` from numba's cache, ``compiled`` afresh), ``calls`` estimator runs (0 when the signature list
    was loaded instead), ``seconds`` of wall time, ``cache`` numba's cache directory in words, ``source`` how
    the signatures were found (the signature list's path, or the estimator calls), ``stopped`` when the
    server stopped it half-way."""

    signatures: int
    new: int
    loaded: int
    compiled: int
    calls: int
    seconds: float
    cache: str
    stopped: bool = False
    source: str = "estimator calls"

    def line(self) -> str:
        """The start-up log line: ``warmed 56 kernel signatures in 0.5 s (56 loaded from cache, 0 compiled;
        from the signature list PATH; cache: DIR)`` or ``... (0 loaded from cache, 56 compiled; 1065 estimator
        calls, signature list written to PATH; cache: DIR)``."""
        how = f"{self.calls} estimator calls" if self.calls else ""
        if self.source != "estimator calls":
            how = f"{how}, {self.source}" if how else self.source
        return (f"warmed {self.signatures} kernel signatures in {self.seconds:.1f} s ({self.loaded} loaded from "
                f"cache, {self.compiled} compiled; {how}; cache: {self.cache})"
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
        s.kind == "integer" and len(s.shapes) > 1 and s.required for s in spec.inputs)), None)  # sent here
    if rows is not None:
        yield rows.name, {}, batch(rows, np.float32, rng, ids_shape=1, layout="mixed", optional=False,
                                   rows=1200), {}


def first_calls() -> Iterator[tuple[str, dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]]:
    """One call of each estimator, its default config, float32, every input: what the warm-up runs after loading
    the signature list. Its kernels are loaded by then; the calls pay what a process pays once, at its first
    call, outside numba's compiler (numba's argument typing, torch's first use of an operator and of its thread
    pool, lazy imports): ~0.1-0.3 s that the first requests would otherwise wait."""
    rng = np.random.default_rng(2)
    for name, spec in REGISTRY.items():
        if not name.startswith("_"):
            yield name, {}, batch(spec, np.float32, rng), {}


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


# ------------------------------------------------------------------------------------------ the signature list
#: the signature list's file name in numba's cache directory: PREFIX + the code's fingerprint + ".pkl"
LIST_PREFIX = "advantage-warmup-"
#: the code the warm-up's calls run (``AdvantageCore.run`` and what it calls, by package): its source is part of
#: the :func:`fingerprint`. tests/test_warmup.py checks that every module these import is here or named there as
#: one that cannot change a kernel's argument types (the admission, the limits, the errors, ...)
HASHED = {"advantage_server": ("estimators", "core.py", "validate.py", "warmup.py"),
          "advantage_client": ("layout.py", "wire.py", "references.py", "conditions.py")}


def kernel_name(kernel: Any) -> str:
    """``module.qualname`` of a kernel's Python function: how the signature list names a kernel."""
    return f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__}"


def fingerprint() -> str:
    """A hash of what decides which kernel signatures the warm-up's calls make: the Python, numpy, torch and
    numba versions, the machine's architecture, and the source of :data:`HASHED` (the estimators, the core, the
    checks, this module; any edit there can change a dtype or a path). A signature list made under another
    fingerprint is not used. Edits elsewhere (the server's admission, transports, CLI) keep the list."""
    h = hashlib.sha256(repr((sys.version, platform.machine(), np.__version__, torch.__version__,
                             numba.__version__)).encode())
    for package, entries in HASHED.items():
        spec = importlib.util.find_spec(package)
        root = pathlib.Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]
        for entry in entries:
            for path in sorted((root / entry).rglob("*.py")) if (root / entry).is_dir() else [root / entry]:
                h.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:20]


def list_path(fp: str | None = None) -> str | None:
    """Where the signature list for this code lives: in numba's cache directory for the kernels (the
    ``NUMBA_CACHE_DIR`` subdirectory, or the in-tree ``__pycache__``, that holds the first kernel's index),
    so it travels with the cache it describes (the image's, its writable copy). None without a disk cache."""
    cache = getattr(jit.KERNELS[0], "_cache", None) if jit.KERNELS else None
    where = getattr(cache, "_cache_path", None)
    if not where:
        return None
    return os.path.join(where, f"{LIST_PREFIX}{fp or fingerprint()}.pkl")


def read_list(path: str | None) -> list[tuple[Any, Any]] | None:
    """The ``(kernel, signature)`` pairs of the signature list at ``path``, or None when there is none, it
    cannot be read, or it names a kernel this process lacks (then the estimator calls run instead)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            entries = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as err:  # a truncated or foreign file: the estimator calls remake it
        log.warning("ignoring the kernel signature list %s (%s: %s)", path, type(err).__name__, err)
        return None
    by_name = {kernel_name(k): k for k in jit.KERNELS}
    if not isinstance(entries, list) or any(name not in by_name for name, _ in entries):
        log.warning("ignoring the kernel signature list %s: it names kernels this code does not have", path)
        return None
    return [(by_name[name], sig) for name, sig in entries]


def write_list(path: str | None) -> str | None:
    """Write every signature the kernels hold to ``path`` (atomically: a replica reading it meanwhile sees the
    old file or the new one) and remove lists of other fingerprints beside it. Returns the path, or None when
    the directory is not writable (the next start then runs the estimator calls again)."""
    if path is None:
        return None
    entries = [(kernel_name(k), sig) for k in jit.KERNELS for sig in k.signatures]
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(entries, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        for old in glob.glob(os.path.join(os.path.dirname(path), f"{LIST_PREFIX}*.pkl")):
            if old != path:
                os.remove(old)
    except OSError as err:
        log.warning("could not write the kernel signature list %s (%s): the next start runs the warm-up's "
                    "estimator calls again", path, err)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return None
    return path


def _callees() -> list[Any]:
    """Kernels that other kernels call (``_row_finite`` in ``_gae_rows``, ...). numba gives a callee a signature
    of its own when it compiles a caller, but not when it loads the caller's machine code from the cache: a
    compiling start held 56 signatures and a cache-loaded one 49 (issue #29)."""
    ids = {id(k) for k in jit.KERNELS}
    callees: dict[int, Any] = {}
    for k in jit.KERNELS:
        names, stack = set(), [k.py_func.__code__]
        while stack:  # the function's code and the code objects nested in it
            code = stack.pop()
            names.update(code.co_names)
            stack.extend(c for c in code.co_consts if hasattr(c, "co_names"))
        for name in names:
            target = k.py_func.__globals__.get(name)
            if id(target) in ids and target is not k:
                callees[id(target)] = target
    return list(callees.values())


def _cached_signatures(kernel: Any) -> list[Any]:
    """The signatures numba's cache index holds for ``kernel`` that this code and this CPU can load. For a
    callee these are what compiling its callers made, plus any signature another process sharing the cache
    directory compiled for it (a test calling it directly): loaded too, so counted."""
    cache = getattr(kernel, "_cache", None)
    index_file = getattr(cache, "_cache_file", None)
    if index_file is None:
        return []
    try:
        index = index_file._load_index()
        codegen = kernel.targetctx.codegen()
        return [key[0] for key in index if cache._index_key(key[0], codegen) == key]
    except Exception:  # another numba's layout: the callees then hold what this process compiled
        return []


# ------------------------------------------------------------------------------------------ the warm-up
def warm(core: Any, stop: threading.Event | None = None, *, use_list: bool = True) -> WarmupReport:
    """Make every kernel signature a request can need, compiled or loaded from numba's cache; returns what it
    did. Two ways:

    * the signature list (:func:`list_path`) for this code's :func:`fingerprint` exists (a previous warm-up
      wrote it; the image's build step does): each listed signature is loaded with numba's
      ``dispatcher.compile(signature)``, which reads the cache (and compiles what it lacks: another CPU),
      then :func:`first_calls` runs one call per estimator (the one-time costs outside numba's compiler);
    * else every warm-up call (:func:`all_requests`) runs on ``core``; a request the estimator refuses (a
      config the semantics does not take) is skipped; any other error propagates (a bug: the server must not
      report SERVING). Then the callee kernels' cached signatures are loaded as well (see :func:`_callees`),
      so a cache-loaded start holds what a compiling one does, and the list is written for the next start.

    ``core`` on a GPU, or numba off (``ADVANTAGE_NUMBA=0``): always the calls (on a GPU they also start
    CUDA's libraries), and no list. ``use_list=False``: always the calls (the coverage test checks them).
    ``stop`` (set by ``BoundServer.stop`` or a signal handler, from another thread or from a signal handler
    of this one): the warm-up ends before its next call, signature or
    kernel compile, whichever comes first, and the report says ``stopped=True`` (a compile in progress is not
    interrupted); no list is written then."""
    started = time.perf_counter()
    before = jit.compiled_signatures()
    hits, misses = _cache_counts()
    calls, stopped, source = 0, False, "estimator calls"
    # numba off (ADVANTAGE_NUMBA=0): the calls run the torch paths and make no signature; a list written then
    # would be empty, and a later start with numba on would load nothing from it
    path = list_path() if use_list and jit.NUMBA and core.device.type == "cpu" else None
    listed = read_list(path)
    listening = (numba_event.install_listener("numba:compile", _StopBeforeCompile(stop, threading.get_ident()))
                 if stop is not None else contextlib.nullcontext())
    with listening:
        try:
            if listed is not None:
                source = f"from the signature list {path}"
                for kernel, sig in listed:
                    if stop is not None and stop.is_set():
                        stopped = True
                        break
                    kernel.compile(sig)
            for name, cfg, tensors, keywords in (first_calls() if listed is not None else all_requests()):
                if stop is not None and stop.is_set():
                    stopped = True
                    break
                try:
                    core.run(name, dict(cfg), tensors, **keywords)
                except InvalidInput:
                    continue
                calls += 1
            if listed is None and not stopped:
                for kernel in _callees():
                    for sig in _cached_signatures(kernel):
                        kernel.compile(sig)
        except Exception:  # WarmupStopped, possibly wrapped by numba (a kernel's callee compiles inside it)
            if stop is None or not stop.is_set():
                raise
            stopped = True
    if core.device.type == "cuda":
        torch.cuda.synchronize(core.device)
    if path is not None and listed is None and not stopped:
        written = write_list(path)
        source = f"signature list written to {written}" if written else "no signature list written"
    after_hits, after_misses = _cache_counts()
    signatures = jit.compiled_signatures()
    return WarmupReport(signatures=signatures, new=signatures - before, loaded=after_hits - hits,
                        compiled=after_misses - misses, calls=calls, seconds=time.perf_counter() - started,
                        cache=jit.cache_location(), stopped=stopped, source=source)


def main() -> int:
    """``python -m advantage_server.warmup``: fill numba's cache (``NUMBA_CACHE_DIR``) with every kernel
    signature and the signature list, on the CPU, and print the report line (the Docker image runs it at build
    time; with a cache and list already there it only loads them)."""
    from advantage_server.core import AdvantageCore

    report = warm(AdvantageCore("cpu"))
    print(report.line(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
