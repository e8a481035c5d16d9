"""``advantage-bench``: the estimator kernels against the published reference code, the vectorized peer
and the memory floor; concurrency; server memory per request; end to end over gRPC on loopback.

Prints one table per run (medians of repeated runs after a warm-up), with the machine, the copy
bandwidth and the load average before and after (other work on the machine skews timings: compare the
ratios within one run). See BENCHMARKS.md for the command and results.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from advantage_server import tuning
from advantage_server.bench import groups, measure, references, transports, workloads
from advantage_server.core import AdvantageCore, config_from_dict
from advantage_server.estimators import REGISTRY, Batch, jit
from advantage_server.estimators.gae import gae_kernel, token_level_rewards

# the flags and their constants: a module without torch (advantage-bench answers a bad flag at once)
from advantage_server.bench.options import (  # noqa: E402,F401 - re-exported
    DEFAULT_GROUP_SIZES, DEFAULT_SIZES, GROUP_ESTIMATORS, OPT_IN_SECTIONS, QUICK_GROUP_SIZES, QUICK_SIZES, SECTIONS,
    build_parser,
)
MiB = 1 << 20


@dataclass
class Row:
    section: str
    estimator: str
    size: str
    impl: str
    ms: float | None = None          # median wall time
    vs_ours: float | None = None     # time / our time for the same operation (concurrency: throughput ratio)
    vs_floor: float | None = None    # time / memory-floor time
    gbps: float | None = None        # floor bytes (e2e: payload bytes) per second
    extra_mib: float | None = None   # peak RSS above the RSS before the call
    err: float | None = None         # max |this - reference| / max(1, max |reference|)
    note: str = ""
    # the groups section (per-group traffic): concurrent callers, p99, throughput, bytes per call each way
    callers: int | None = None
    p99_ms: float | None = None
    calls_s: float | None = None
    bytes_in: float | None = None
    bytes_out: float | None = None
    compact: str | None = None


@dataclass
class Report:
    argv: list[str]
    machine: dict[str, str]
    bandwidth: measure.Bandwidth | None = None
    load_before: str = ""
    load_after: str = ""
    peak_rss_mib: float = 0.0
    seconds: float = 0.0
    rows: list[Row] = field(default_factory=list)
    adversarial: dict[str, Any] | None = None  # the adversarial section's figures (bench/adversarial.py)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    sizes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            B, T, G = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"bad size {item!r}: write BxTxG, e.g. 512x8192x8") from None
        sizes.append((B, T, G))
    return sizes


def size_label(B: int, T: int, G: int) -> str:
    return f"{B}x{T}x{G}"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.to(torch.float64), ref.to(torch.float64)
    return float((g - r).abs().max()) / max(1.0, float(r.abs().max()))


def dense(result: Any) -> Any:
    """An estimator result with its tensors as dense memory (an ``expand`` view is written out)."""
    result.advantages = result.advantages.contiguous()
    if result.returns is not None:
        result.returns = result.returns.contiguous()
    return result


# ------------------------------------------------------------------------------------ kernel
def prepared(estimator: str, B: int, T: int, G: int, seed: int = 0, device: str = "cpu"):
    config, tensors = workloads.inputs(estimator, B, T, G, seed)
    if device != "cpu":  # the inputs live on the device before the call, as the server holds them
        tensors = {k: v.to(device) for k, v in tensors.items()}
    spec = REGISTRY[estimator]
    cfg = config_from_dict(spec, config).resolved()
    batch = Batch(AdvantageCore(device).prepare(spec, cfg, tensors))
    return spec, cfg, batch, tensors


def timeit_ref(fn: Callable[[], Any], args) -> measure.Timing:
    """A reference loop: warmed up only when it is quick (a per-prompt loop at B = 65536 takes seconds and
    has nothing to warm up), at most ``--ref-repeats`` runs within ``--ref-budget`` seconds."""
    t0 = time.perf_counter()
    first = fn()
    once = time.perf_counter() - t0
    if once * (args.ref_repeats + 1) > args.ref_budget:
        return measure.Timing(once, [once], first)
    return measure.timeit(fn, args.ref_repeats, warmup=0, budget_s=args.ref_budget)


def kernel_section(report: Report, estimator: str, size: tuple[int, int, int], args, probe: measure.CopyProbe,
                   refs: bool = True) -> None:
    """Our estimator (and for GAE the bare kernel) against the reference, the peer and the memory floor.
    Each of our rows is timed alternately with a large memcpy: its floor is the row's floor bytes over
    the copy bandwidth measured in between its own runs (the reference rows use the same floor)."""
    if getattr(args, "device", "cpu") != "cpu":
        device_kernel_section(report, estimator, size, args)
        return
    B, T, G = size
    label = size_label(*size)
    spec, cfg, batch, tensors = prepared(estimator, B, T, G)
    measure.settle_heap()
    floor_b = workloads.floor_bytes(estimator, B, T)

    def run_ours():
        return dense(spec.fn(cfg, batch))

    t_ours, bw = measure.timeit_with_floor(run_ours, args.repeats, probe)
    floor_s = floor_b / (bw * 1e9)
    ours = t_ours.result
    extra = measure.peak_extra_rss(run_ours)
    report.add(Row("kernel", estimator, label, "ours: estimator (in-process)", t_ours.ms, 1.0, t_ours.median_s / floor_s,
                   floor_b / t_ours.median_s / 1e9, None if extra is None else extra / MiB,
                   note=f"{len(t_ours.runs)} runs; copy {bw:.1f} GB/s in between"))
    # the same call writing its [B, T] outputs into memory reused from the previous call (what the shared-memory
    # transport's output room gives the server): no page faults of fresh output memory
    reused: dict[str, torch.Tensor] = {}

    def reuse(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = reused.get(name)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            t = reused[name] = torch.zeros(shape, dtype=dtype, device=device)
        return t

    def run_reused():
        batch.output_provider, batch.provided = reuse, {}
        try:
            return dense(spec.fn(cfg, batch))
        finally:
            batch.output_provider, batch.provided = None, {}

    t_re, rbw = measure.timeit_with_floor(run_reused, args.repeats, probe)
    rfloor_s = floor_b / (rbw * 1e9)
    report.add(Row("kernel", estimator, label, "ours: estimator, outputs in reused memory", t_re.ms,
                   t_re.median_s / t_ours.median_s, t_re.median_s / rfloor_s, floor_b / t_re.median_s / 1e9,
                   err=rel_err(t_re.result.advantages, ours.advantages),
                   note=f"{len(t_re.runs)} runs; as the shared-memory path writes; copy {rbw:.1f} GB/s in between"))
    if estimator == "gae":
        mask, values = batch["mask"], batch["values"]
        tok = token_level_rewards(batch["rewards"], mask)
        kfloor_b = workloads.gae_kernel_floor_bytes(B, T)
        gamma, lam = cfg.gae_gamma, cfg.gae_lambda
        t_k, kbw = measure.timeit_with_floor(lambda: gae_kernel(tok, values, mask, gamma, lam), args.repeats, probe)
        kfloor_s = kfloor_b / (kbw * 1e9)
        k_out = t_k.result
        extra = measure.peak_extra_rss(lambda: gae_kernel(tok, values, mask, gamma, lam))
        report.add(Row("kernel", estimator, label, "ours: gae_kernel", t_k.ms, 1.0, t_k.median_s / kfloor_s,
                       kfloor_b / t_k.median_s / 1e9, None if extra is None else extra / MiB,
                       note=f"token rewards [B,T] -> advantages, no whitening; copy {kbw:.1f} GB/s in between"))
        if refs and not args.no_refs:
            t_ref = timeit_ref(lambda: references.gae_per_step_loop(tok, values, mask, gamma, lam), args)
            ref = t_ref.result
            report.add(Row("kernel", estimator, label, "ref: per-time-step loop", t_ref.ms, t_ref.median_s / t_k.median_s,
                           t_ref.median_s / kfloor_s, kfloor_b / t_ref.median_s / 1e9, err=rel_err(k_out, ref),
                           note=f"x ours vs gae_kernel; err = gae_kernel vs this loop; {len(t_ref.runs)} runs"))
        peer_label, peer = references.torchrl_peer()
        prep = references.prepare_peer(tok, values, gamma, lam)
        full = torch.ones_like(mask)
        t_k_full, fbw = measure.timeit_with_floor(lambda: gae_kernel(tok, values, full, gamma, lam), args.repeats, probe)
        k_full = t_k_full.result
        ffloor_s = kfloor_b / (fbw * 1e9)
        t_peer = measure.timeit(lambda: peer(prep), args.repeats)
        report.add(Row("kernel", estimator, label, "ours: gae_kernel, full rows", t_k_full.ms, 1.0,
                       t_k_full.median_s / ffloor_s, kfloor_b / t_k_full.median_s / 1e9,
                       note=f"all-ones mask: the peer's workload; copy {fbw:.1f} GB/s in between"))
        report.add(Row("kernel", estimator, label, peer_label, t_peer.ms, t_peer.median_s / t_k_full.median_s,
                       t_peer.median_s / ffloor_s, kfloor_b / t_peer.median_s / 1e9,
                       err=rel_err(peer(prep), k_full),
                       note="x ours vs gae_kernel on full rows (no mask support); err vs ours"))
        report.add(Row("kernel", estimator, label, "memory floor: gae_kernel", kfloor_s * 1e3, None, 1.0, kbw,
                       note=f"{kfloor_b / MiB:.1f} MiB moved"))
        report.add(Row("kernel", estimator, label, "memory floor: estimator", floor_s * 1e3, None, 1.0, bw,
                       note=f"{floor_b / MiB:.1f} MiB moved"))
        return

    ref_fn: Callable[[], Any] | None = None
    ref_label = ""
    ids = tensors.get("prompt_ids")
    if estimator == "grpo":
        ref_label = "ref: per-prompt loop"
        ref_fn = lambda: references.grpo_per_prompt_loop(ids, tensors["rewards"], T)  # noqa: E731
    elif estimator == "gdpo":
        ref_label = "ref: per-prompt loop per component"
        comps = [tensors[k] for k in sorted(k for k in tensors if k.startswith("reward/"))]
        ref_fn = lambda: references.gdpo_per_prompt_loop(ids, comps, T)  # noqa: E731
    elif estimator == "reinforce_plus_plus":
        ref_label = "ref: per-prompt loop + masked whitening"
        ref_fn = lambda: references.reinforce_pp_per_prompt_loop(ids, tensors["rewards"], tensors["mask"])  # noqa: E731
    elif estimator == "opd":
        ref_label = "ref: straightforward torch"
        ref_fn = lambda: references.opd_straightforward(tensors["teacher_logprobs"], tensors["prev_logprobs"],  # noqa: E731
                                                        tensors["mask"])[0]
    if ref_fn is not None and refs and not args.no_refs:
        t_ref = timeit_ref(ref_fn, args)
        report.add(Row("kernel", estimator, label, ref_label, t_ref.ms, t_ref.median_s / t_ours.median_s,
                       t_ref.median_s / floor_s, floor_b / t_ref.median_s / 1e9, err=rel_err(ours.advantages, t_ref.result),
                       note=f"err = ours vs this; {len(t_ref.runs)} runs"))
    report.add(Row("kernel", estimator, label, "memory floor", floor_s * 1e3, None, 1.0, bw,
                   note=f"{floor_b / MiB:.2f} MiB moved"))


def device_kernel_section(report: Report, estimator: str, size: tuple[int, int, int], args) -> None:
    """``--device cuda``: our estimator (and for GAE the bare kernel) on device-resident inputs, against a
    device-to-device copy of the same bytes (the HBM floor). The torch kernels run there (the numba ones
    apply to CPU tensors only). Each run is timed between two ``torch.cuda.synchronize`` calls, so it
    includes the launches and any device-to-host sync the estimator makes; the floor copy is timed the
    same way, alternately with the kernel. +MiB = ``torch.cuda.max_memory_allocated`` above the memory
    allocated before one run. No reference loops or peer (CPU code)."""
    B, T, G = size
    label = size_label(*size)
    dev = torch.device(args.device)
    spec, cfg, batch, _ = prepared(estimator, B, T, G, device=args.device)
    rows: list[tuple[str, Callable[[], Any], int, str]] = [
        ("ours: estimator (in-process)", lambda: dense(spec.fn(cfg, batch)), workloads.floor_bytes(estimator, B, T),
         "memory floor" if estimator != "gae" else "memory floor: estimator")]
    if estimator == "gae":
        mask, values = batch["mask"], batch["values"]
        tok = token_level_rewards(batch["rewards"], mask)
        gamma, lam = cfg.gae_gamma, cfg.gae_lambda
        rows.append(("ours: gae_kernel", lambda: gae_kernel(tok, values, mask, gamma, lam),
                     workloads.gae_kernel_floor_bytes(B, T), "memory floor: gae_kernel"))
    floors = []
    for impl, fn, floor_b, floor_label in rows:
        t, floor_s, peak = measure.cuda_timeit_with_floor(fn, args.repeats, floor_b, dev)
        report.add(Row("kernel", estimator, label, impl, t.ms, 1.0, t.median_s / floor_s, floor_b / t.median_s / 1e9,
                       peak / MiB, note=f"{len(t.runs)} runs, {dev} synchronised; +MiB = device peak above before"))
        floors.append(Row("kernel", estimator, label, floor_label, floor_s * 1e3, None, 1.0, floor_b / floor_s / 1e9,
                          note=f"{dev} copy of {floor_b / 2 / MiB:.2f} MiB ({floor_b / MiB:.2f} MiB read + written)"))
    for row in floors:
        report.add(row)


def check_device(args) -> None:
    """``--device``: cpu (the default, every section), or cuda / cuda:N (the kernel section only), which
    needs a CUDA build of torch and a visible GPU: anything else exits with a message saying so."""
    try:
        dev = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise SystemExit(f"advantage-bench: --device {args.device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        args.device = "cpu"
        return
    if dev.type != "cuda":
        raise SystemExit(f"advantage-bench: --device {args.device}: only cpu and cuda[:N] are measured")
    if not torch.cuda.is_available():
        raise SystemExit(f"advantage-bench: --device {args.device}: no CUDA device here (torch {torch.__version__}, "
                         f"CUDA build {torch.version.cuda or 'none'}, torch.cuda.is_available() is False). "
                         "Run it on a GPU machine, e.g. scripts/gpu_bench.sh")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SystemExit(f"advantage-bench: --device {args.device}: only {torch.cuda.device_count()} CUDA device(s)")
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if sections - {"kernel"}:
        raise SystemExit(f"advantage-bench: --device {args.device} measures the kernel section only "
                         f"(pass --sections kernel; got {','.join(sorted(sections))})")


# ------------------------------------------------------------------------------- concurrency
def concurrency_section(report: Report, estimator: str, size: tuple[int, int, int], args) -> None:
    B, T, G = size
    spec, cfg, batch, _ = prepared(estimator, B, T, G)
    measure.settle_heap()
    call = lambda: spec.fn(cfg, batch)  # noqa: E731
    call()
    callers = args.callers
    t_one = measure.timeit(call, 3).median_s
    per_thread = max(2, min(50, int(args.concurrency_seconds / max(t_one, 1e-4) / callers)))

    def throughput(n_threads: int) -> float:
        # every caller keeps its last callers / n_threads results alive, as a server holds responses in
        # flight: 1 caller and n callers then cycle through the same number of outputs (one output
        # reused back to back stays in the CPU's last-level cache, which n concurrent outputs do not)
        total = per_thread * callers
        keep = max(1, callers // n_threads)
        if n_threads == 1:
            held: collections.deque = collections.deque(maxlen=keep)
            t0 = time.perf_counter()
            for _ in range(total):
                held.append(call())
            return total / (time.perf_counter() - t0)
        barrier = threading.Barrier(n_threads + 1)
        errors: list[BaseException] = []

        def worker():
            held: collections.deque = collections.deque(maxlen=keep)
            barrier.wait()
            try:
                for _ in range(total // n_threads):
                    held.append(call())
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(n_threads)]
        for th in threads:
            th.start()
        barrier.wait()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return (total // n_threads) * n_threads / (time.perf_counter() - t0)

    label = size_label(*size)
    for split in (True, False):
        old = jit.set_row_parallel(split)
        try:
            one = throughput(1)
            many = throughput(callers)
        finally:
            jit.set_row_parallel(old)
        how = "rows split over the cores" if split else "each call on one core"
        report.add(Row("concurrency", estimator, label, f"1 caller ({how})", 1e3 / one, 1.0,
                       note=f"{one:.1f} calls/s; keeps its last {callers} results alive (as {callers} callers do)"))
        report.add(Row("concurrency", estimator, label, f"{callers} callers ({how})", 1e3 / many, many / one,
                       note=f"{many:.1f} calls/s; x ours = throughput / 1 caller's"))


# ------------------------------------------------------------------------------------ memory
def memory_section(report: Report, estimator: str, size: tuple[int, int, int]) -> None:
    B, T, G = size
    proc = subprocess.run([sys.executable, "-m", "advantage_server.bench.memprobe", estimator, str(B), str(T), str(G)],
                          capture_output=True, text=True, timeout=600)
    label = size_label(*size)
    if proc.returncode != 0:
        report.add(Row("memory", estimator, label, "core.compute peak extra RSS", note="probe failed: "
                       + (proc.stderr.strip().splitlines() or ["?"])[-1][:80]))
        return
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    extra = out["extra"]
    ratio = None if extra is None else extra / out["payload"]
    report.add(Row("memory", estimator, label, "core.compute peak extra RSS", None,
                   extra_mib=None if extra is None else extra / MiB,
                   note=(f"request {out['payload'] / MiB:.1f} MiB, response {out['response'] / MiB:.1f} MiB; "
                         + ("peak not measurable here" if ratio is None else f"{ratio:.2f}x request payload"))))


# ----------------------------------------------------------------------------------- e2e
class BenchServer:
    """The benchmark's server in its own process (``advantage_server.bench.serve``)."""

    def __init__(self, *options: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "advantage_server.bench.serve", *options],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the benchmark server did not start")
        info = json.loads(line)
        self.address, self.pid = info["address"], info["pid"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=15)
        except Exception:  # pragma: no cover
            self.proc.kill()


#: e2e rows above this many request bytes run twice (cold, with both processes' peaks; then timed)
HUGE_BYTES = 1024 * MiB


def available_bytes() -> int | None:
    """MemAvailable of the machine (None where /proc/meminfo has no such line)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def e2e_section(report: Report, server: BenchServer, transport: transports.Transport, size: tuple[int, int, int],
                args, in_process_ms: dict[str, float], ref_ms: dict[str, float]) -> None:
    B, T, G = size
    label = size_label(*size)
    reason = transport.skip_reason()
    if reason:
        report.add(Row("e2e", "gae", label, transport.name, note=f"skipped: {reason}"))
        return
    config, tensors = workloads.inputs("gae", B, T, G)
    session = transport.open(server.address)
    # streamed calls: (upload s, server compute s, download s, request bytes, bytes after the first result chunk)
    splits: list[tuple[float, float, float, int, int]] = []

    def call():
        out = transport.compute(session, "gae", config, tensors)
        tm = getattr(session, "last_timing", None)
        if getattr(session, "last_transport", None) == "stream" and tm and "first" in tm:
            compute = tm.get("server_compute", 0.0)
            splits.append((tm["first"] - tm["start"] - compute, compute, tm["end"] - tm["first"],
                           tm["request_bytes"], tm["response_bytes"] - tm.get("first_chunk_bytes", 0)))
        return out
    client_extra, huge = None, False
    try:
        big = workloads.payload_bytes(tensors) > 128 * MiB
        huge = workloads.payload_bytes(tensors) > HUGE_BYTES
        if huge:  # two calls: the first (cold processes) with both processes' peak RSS, the second timed
            small_cfg, small = workloads.inputs("gae", 8, 64, 8)  # loads the kernels first
            transport.compute(session, "gae", small_cfg, small)
            before, client_before = measure.rss_bytes(server.pid), measure.rss_bytes()
            measure.reset_peak(server.pid)
            client_reset = measure.reset_peak()
            t0 = time.perf_counter()
            call()
            cold_s = time.perf_counter() - t0  # the result is dropped before the next call
            extra = max(0, measure.peak_bytes(server.pid) - before)
            if client_reset:
                client_extra = max(0, measure.peak_bytes() - client_before)
            splits.clear()
            t = measure.timeit(call, 1, warmup=0)
            res = t.result
        else:
            res = call()
            splits.clear()
            t = measure.timeit(call, 3 if big else args.repeats, warmup=0 if big else 1)
            before = measure.rss_bytes(server.pid)
            measure.reset_peak(server.pid)
            res = call()
            extra = max(0, measure.peak_bytes(server.pid) - before)
    finally:
        transport.close(session)
    request = workloads.payload_bytes(tensors)
    response = res.advantages.numel() * res.advantages.element_size() + (
        0 if res.returns is None else res.returns.numel() * res.returns.element_size())
    moved = request + response
    err = None
    if not big:  # the same batch in-process: the transport must not change a bit of it
        spec, cfg, batch, _ = prepared("gae", B, T, G)
        err = rel_err(res.advantages, spec.fn(cfg, batch).advantages)
    ours = in_process_ms.get(label)
    ref = ref_ms.get(label)
    note = (f"req {request / MiB:.1f} MiB + resp {response / MiB:.1f} MiB = {moved / MiB / t.median_s:.0f} MiB/s; "
            f"server peak +{extra / MiB:.0f} MiB = {extra / request:.2f}x req")
    if client_extra is not None:
        note += f"; client peak +{client_extra / MiB:.0f} MiB = {client_extra / request:.2f}x req"
    if huge:
        note += f"; first call (cold processes, where the peaks are from) {cold_s:.1f} s, the time is the second's"
    if splits:  # per direction: upload = request bytes / (first result chunk - start - server compute);
        # download = bytes after the first result chunk / (last chunk - first chunk)
        up = statistics.median(r / u for u, _, _, r, _ in splits if u > 0) if any(u > 0 for u, *_ in splits) else 0
        downs = [b / d for _, _, d, _, b in splits if d > 0 and b > 0]
        comp = statistics.median(c for _, c, *_ in splits)
        note += (f"; stream split: up {up / MiB:.0f} MiB/s, server compute {comp * 1e3:.0f} ms, "
                 + (f"down {statistics.median(downs) / MiB:.0f} MiB/s" if downs else "down: one chunk"))
    if ref is not None:
        note += f"; vs in-process ref loop: {t.ms / ref:.2f}x"
    report.add(Row("e2e", "gae", label, transport.name, t.ms, None if ours is None else t.ms / ours, None,
                   moved / t.median_s / 1e9, extra / MiB, err, note))


# ------------------------------------------------------------------------------------- table
def fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def render(report: Report) -> str:
    m = report.machine
    lines = [
        f"advantage-bench: {' '.join(report.argv) or '(defaults)'}",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; torch threads {m['torch_threads']}; {m['versions']}"
        f"; {tuning.describe()}",
    ]
    if m.get("device"):
        lines.append(f"device: {m['device']}")
    if report.bandwidth:
        bwr = report.bandwidth
        lines.append(f"copy bandwidth at start ({bwr.size_mib} MiB, read+write): numpy {bwr.numpy_gbps:.1f} GB/s, "
                     f"torch {bwr.torch_gbps:.1f} GB/s; each kernel row's floor uses a 64 MiB numpy copy timed "
                     "between that row's own runs (see its note)")
    lines.append(f"load average: {report.load_before} before, {report.load_after} after; "
                 f"bench peak RSS {report.peak_rss_mib:.0f} MiB; {report.seconds:.0f} s")
    lines.append("columns: ms = median; x ours = time / ours (concurrency: throughput / 1 caller); x floor = time / "
                 "memory-floor time; GB/s = floor bytes (e2e: payload bytes) / time; +RSS = peak RSS above the "
                 "RSS before; err = max abs diff / max(1, max |ref|)")
    header = ["section", "estimator", "BxTxG", "implementation", "ms", "x ours", "x floor", "GB/s", "+RSS MiB", "err",
              "note"]
    table = [[r.section, r.estimator, r.size, r.impl, fmt(r.ms, ".3f"), fmt(r.vs_ours, ".2f"), fmt(r.vs_floor, ".2f"),
              fmt(r.gbps, ".2f"), fmt(r.extra_mib, ".1f"), fmt(r.err, ".1e"), r.note] for r in report.rows
             if r.section not in ("groups", "adversarial")]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(header)]
    numeric = {4, 5, 6, 7, 8, 9}

    def line(cells):
        return " | ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines.append(line(header))
    lines.append("-+-".join("-" * w for w in widths))
    lines.extend(line(r) for r in table)
    lines.extend(groups.render([r for r in report.rows if r.section == "groups"]))
    if report.adversarial is not None:
        from advantage_server.bench.adversarial import render as render_adversarial
        lines.extend(render_adversarial(report.adversarial))
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- main
def plan_sizes(args: argparse.Namespace) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], int]:
    """``(sizes, group_sizes, transport_mib)`` the run measures. ``--sizes`` given alone limits every section
    to those sizes: no group sizes and no transport-size e2e row unless asked for by their own flags."""
    sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    if args.group_sizes is not None:
        group_sizes = parse_sizes(args.group_sizes)
    elif args.sizes:
        group_sizes = []
    else:
        group_sizes = parse_sizes(QUICK_GROUP_SIZES if args.quick else DEFAULT_GROUP_SIZES)
    if args.transport_mib is not None:
        transport_mib = args.transport_mib
    else:
        transport_mib = 0 if (args.quick or args.sizes) else 256
    return sizes, group_sizes, transport_mib


def main(argv: list[str] | None = None) -> Report:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    check_device(args)
    if args.thp and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":  # torch reads it once, at its first allocation
        os.execve(sys.executable, [sys.executable, "-m", "advantage_server.bench", *argv],
                  {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sizes, group_sizes, transport_mib = plan_sizes(args)
    args.repeats = args.repeats or (3 if args.quick else 9)
    if args.quick:
        args.ref_repeats = min(args.ref_repeats, 2)
        args.ref_budget = min(args.ref_budget, 2.0)
    args.concurrency_seconds = args.concurrency_seconds or (0.5 if args.quick else 2.0)
    estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    for e in estimators:
        if e not in workloads.ESTIMATORS:
            raise SystemExit(f"unknown estimator {e!r}; choose from {', '.join(workloads.ESTIMATORS)}")
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if sections - set(SECTIONS):
        raise SystemExit(f"unknown section(s) {sorted(sections - set(SECTIONS))}; choose from {', '.join(SECTIONS)}")
    transports.load_plugins()
    chosen = transports.select(args.transports)

    t_start = time.perf_counter()
    report = Report(argv=["advantage-bench", *argv], machine=measure.machine(args.device), load_before=measure.loadavg())
    report.bandwidth = measure.copy_bandwidth(64 if args.quick else 256, 5 if args.quick else 9)
    probe = measure.CopyProbe(64)

    in_process_ms: dict[str, float] = {}
    ref_ms: dict[str, float] = {}
    if "kernel" in sections:
        for est in estimators:
            for size in sizes + ([s for s in group_sizes] if est in GROUP_ESTIMATORS else []):
                # the per-prompt loops take tens of seconds at B = 65536: by default only at the first group size
                refs = size not in group_sizes or args.group_refs == "all" or (
                    args.group_refs == "first" and size == group_sizes[0])
                kernel_section(report, est, size, args, probe, refs=refs)
                if est == "gae":
                    label = size_label(*size)
                    for r in report.rows:
                        if r.size == label and r.estimator == "gae" and r.section == "kernel":
                            if r.impl.startswith("ours: estimator"):  # the faster of fresh / reused outputs
                                in_process_ms[label] = min(r.ms, in_process_ms.get(label, r.ms))
                            elif r.impl == "ref: per-time-step loop":
                                ref_ms[label] = r.ms
    if "concurrency" in sections:
        if "gae" in estimators:
            concurrency_section(report, "gae", sizes[-1], args)
        if "grpo" in estimators:  # the first group size with T > 1 (by default 65536x64x8), else the last size
            size = next((s for s in group_sizes if s[1] > 1), group_sizes[0]) if group_sizes else sizes[-1]
            concurrency_section(report, "grpo", size, args)
    if "memory" in sections:  # one fresh process per probe (~2 s each): quick mode probes gae and grpo once
        for est in estimators:
            if args.quick and est not in ("gae", "grpo"):
                continue
            probe = [sizes[-1]] if (args.quick or est != "gae") else list(sizes)
            if est in GROUP_ESTIMATORS and group_sizes and not (args.quick and est == "gae"):
                probe = [group_sizes[-1]] if args.quick else probe + [group_sizes[-1]]
            for size in probe:
                memory_section(report, est, size)
    if "e2e" in sections and "gae" in estimators and args.big_mib:
        T = 8192
        B = max(1, args.big_mib * MiB // (2 * T * 4))
        need = int(4.5 * 8 * B * T)  # request and response in each process, plus the inputs' construction
        avail = available_bytes()
        server = BenchServer("--max-batch-elements", str(B * T), "--max-stream-mb", str(2 * args.big_mib + 1024))
        try:
            if avail is not None and avail < need:
                report.add(Row("e2e", "gae", size_label(B, T, 8), "grpc-stream", note=(
                    f"skipped: needs about {need / 2**30:.1f} GiB of free memory, {avail / 2**30:.1f} GiB available")))
            else:
                e2e_section(report, server, transports.select("grpc-stream")[0], (B, T, 8), args, {}, {})
        finally:
            server.close()
    elif "e2e" in sections and "gae" in estimators:
        e2e_sizes = list(sizes)
        if transport_mib:
            T = 8192
            B = max(1, transport_mib * MiB // (2 * T * 4))  # mask + values float32
            e2e_sizes.append((B, T, 8))
        server = BenchServer()
        try:
            for tr in chosen:
                for size in e2e_sizes:
                    e2e_section(report, server, tr, size, args, in_process_ms, ref_ms)
        finally:
            server.close()

    if "groups" in sections:  # per-group traffic: one group of 16 per call, many callers (bench/groups.py)
        tokens = groups.parse_ints(args.group_tokens) if args.group_tokens else (
            groups.QUICK_TOKENS if args.quick else groups.DEFAULT_TOKENS)
        callers = groups.parse_ints(args.group_callers) if args.group_callers else (
            groups.QUICK_CALLERS if args.quick else groups.DEFAULT_CALLERS)
        groups.groups_section(report, Row, tokens, callers, args.group_seconds or (0.25 if args.quick else 1.0))

    if "cold-start" in sections:  # fresh servers: time to SERVING and first calls, empty and filled cache
        from advantage_server.bench.coldstart import cold_start_section
        cold_start_section(report, Row)

    if "adversarial" in sections:  # legitimate goodput under attack, same host and another (netns) host
        from advantage_server.bench.adversarial import adversarial_section
        report.adversarial = adversarial_section(report, Row, args.adversarial_clients,
                                                 args.adversarial_seconds or (2.0 if args.quick else 4.0),
                                                 attacks=args.adversarial_attacks,
                                                 rounds=args.adversarial_rounds or (1 if args.quick else 5),
                                                 pin=args.adversarial_pin)

    report.load_after = measure.loadavg()
    report.peak_rss_mib = measure.peak_bytes() / MiB
    report.seconds = time.perf_counter() - t_start
    print(render(report), flush=True)
    if args.json:
        data = asdict(report)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.plot:
        from advantage_server.bench.plot import plot_report
        plot_report(report, args.plot)
    return report


if __name__ == "__main__":
    main()
