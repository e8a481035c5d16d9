"""``advantage-bench --device``: the GPU kernel section's code path (exercised on the CPU with torch.cuda's
timing and memory calls stubbed), its refusal without CUDA, and the CPU default left unchanged.
The GPU numbers themselves come from scripts/gpu_bench.sh on a GPU machine; CI never needs one."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from advantage_server.bench import measure, run


def test_device_defaults_to_cpu():
    args = run.build_parser().parse_args([])
    assert args.device == "cpu"
    run.check_device(args)
    assert args.device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_says_so():
    proc = subprocess.run([sys.executable, "-m", "advantage_server.bench", "--device", "cuda", "--sections", "kernel"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--device cuda: no CUDA device here" in proc.stderr and "gpu_bench.sh" in proc.stderr, proc.stderr


def test_bad_device_and_sections_are_refused(monkeypatch):
    with pytest.raises(SystemExit, match="not a device"):
        run.check_device(run.build_parser().parse_args(["--device", "nonsense"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="kernel section only"):
        run.check_device(run.build_parser().parse_args(["--device", "cuda", "--sections", "kernel,e2e"]))
    with pytest.raises(SystemExit, match="only 1 CUDA device"):
        run.check_device(run.build_parser().parse_args(["--device", "cuda:3", "--sections", "kernel"]))
    run.check_device(run.build_parser().parse_args(["--device", "cuda", "--sections", "kernel"]))


@pytest.mark.parametrize("estimator", ["gae", "grpo", "opd"])
def test_device_kernel_section_rows(monkeypatch, estimator):
    """The device section on CPU tensors with torch.cuda's synchronize and memory counters stubbed: the
    rows, their floors (a same-device copy of the floor bytes) and their ratios."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 << 20)
    report = run.Report(argv=[], machine={})
    args = argparse.Namespace(device="cpu", repeats=2)
    run.device_kernel_section(report, estimator, (16, 32, 4), args)
    rows = {r.impl: r for r in report.rows}
    ours = rows["ours: estimator (in-process)"]
    floor = rows["memory floor" if estimator != "gae" else "memory floor: estimator"]
    assert ours.ms > 0 and floor.ms > 0 and ours.extra_mib == 3.0
    assert ours.vs_floor == pytest.approx(ours.ms / floor.ms)
    if estimator == "gae":
        assert {"ours: gae_kernel", "memory floor: gae_kernel"} <= set(rows)


def test_cuda_timing_helper_on_stubs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    t, floor_s, peak = measure.cuda_timeit_with_floor(lambda: torch.ones(10), 3, 1 << 20, torch.device("cpu"))
    assert len(t.runs) == 3 and floor_s > 0 and peak == 0 and t.result.shape == (10,)
