"""The Dockerfile: hadolint passes, both targets run the `advantage-server` console script the tests start as a
non-root user, and the image's own CMD and HEALTHCHECK work against a real server (no Docker engine needed)."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

from test_server_cli import ServerProcess, free_port, server_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
TARGETS = ("cpu", "gpu")


def tool(name: str) -> str:
    """A linter installed by the test extra; a missing one fails in CI and skips elsewhere."""
    here = pathlib.Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed: `pip install -c constraints.txt -e '.[test]'` (make setup) installs it")
    pytest.skip(f"{name} is not installed (the test extra installs it)")


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """``{stage name: [(INSTRUCTION, arguments), ...]}``, continuation lines joined, comments dropped."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    logical = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        logical += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if line.rstrip().endswith("\\"):
            continue
        instruction, _, args = logical.strip().partition(" ")
        logical = ""
        if instruction.upper() == "FROM":
            current = []
            words = args.split()
            out[words[-1] if len(words) >= 3 and words[-2].upper() == "AS" else f"stage{len(out)}"] = current
        current.append((instruction.upper(), args.strip()))
    return out


def last(stage: list[tuple[str, str]], instruction: str) -> str:
    values = [args for ins, args in stage if ins == instruction]
    assert values, f"no {instruction}"
    return values[-1]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {args}"
    return value


STAGES = stages(DOCKERFILE.read_text())


def test_hadolint_passes():
    proc = subprocess.run([tool("hadolint"), "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_hadolint_really_lints(tmp_path):
    """The linter runs offline and fails on a finding (so a green run means something)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 10001:10001", "USER advantage", 1)
                   + "RUN apt-get install curl\n")
    proc = subprocess.run([tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "DL3066" in proc.stdout and "DL3008" in proc.stdout, proc.stdout


@pytest.mark.parametrize("target", TARGETS)
def test_targets_run_the_console_script_as_non_root(target):
    stage = STAGES[target]
    entrypoint = exec_form(last(stage, "ENTRYPOINT"))
    assert entrypoint == ["advantage-server"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["advantage-server"] == "advantage_server.cli:main"
    # ... the same console script the process tests start
    assert pathlib.Path(server_command()[0]).name == "advantage-server" or server_command()[1:] == [
        "-m", "advantage_server.cli"]
    user = last(stage, "USER").split(":")
    assert all(part.isdigit() and int(part) > 0 for part in user), f"USER {user}: numeric, non-root"
    exposed = set(last(stage, "EXPOSE").split())
    assert {"50051", "50052", "9464"} <= exposed
    healthcheck = last(stage, "HEALTHCHECK")
    command = exec_form(healthcheck[healthcheck.index("CMD") + 3:].strip())
    assert command[0] == "advantage-healthcheck"
    assert scripts["advantage-healthcheck"] == "advantage_server.cli:healthcheck_main"
    cmd = exec_form(last(stage, "CMD"))
    assert cmd[cmd.index("--health-port") + 1] == command[command.index("--address") + 1].rsplit(":", 1)[1]


def test_gpu_target_uses_an_official_cuda_pytorch_base():
    text = DOCKERFILE.read_text()
    base = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG TORCH_CUDA_IMAGE="))
    assert base.startswith("pytorch/pytorch:") and "-cuda" in base and base.endswith("-runtime"), base
    assert STAGES["gpu"][0] == ("FROM", "${TORCH_CUDA_IMAGE} AS gpu")
    assert "--device" in (cmd := exec_form(last(STAGES["gpu"], "CMD"))) and cmd[cmd.index("--device") + 1] == "auto"


def test_image_cmd_and_healthcheck_against_a_real_server(tmp_path):
    """Start the server with the cpu image's CMD (its ports swapped for free ones, loopback only), then run the
    image's HEALTHCHECK command: SERVING (exit 0) while up, exit 1 once stopped. In between, the probes
    ``make image-check`` runs against the image (scripts/image_check.py) run against this server, so that they
    stay true to the server without a container engine: the golden calls, the /metrics count of exactly those
    calls (one call fewer fails it), and SIGTERM with a call in flight (it comes back equal, exit 0)."""
    stage = STAGES["cpu"]
    cmd = exec_form(last(stage, "CMD"))
    healthcheck = last(stage, "HEALTHCHECK")
    check = exec_form(healthcheck[healthcheck.index("CMD") + 3:].strip())
    ports = {p: free_port() for p in ("50051", "50052", "9464")}
    args = [str(ports.get(a, a)) for a in cmd]
    for flag in ("--host", "--port", "--metrics-host"):  # the helper passes --host 127.0.0.1 and the port itself
        i = args.index(flag)
        assert flag not in ("--host", "--metrics-host") or args[i + 1] == "0.0.0.0"
        del args[i:i + 2]
    srv = ServerProcess(tmp_path, ports["50051"], *args, name="image-cmd")
    try:
        srv.wait_listening()
        assert f"health on port {ports['50052']}" in srv.stderr and f"metrics on port {ports['9464']}" in srv.stderr
        host_check = [str(pathlib.Path(sys.executable).with_name(check[0])), *check[1:]]
        addr = host_check.index("--address") + 1
        host_check[addr] = host_check[addr].replace(":50052", f":{ports['50052']}")
        assert host_check[addr] == f"127.0.0.1:{ports['50052']}"
        ok = subprocess.run(host_check, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stdout + ok.stderr
        image_check = load_image_check()
        detail, figures = image_check.golden_check(srv.address)
        assert figures["golden_cases"] == len(list((ROOT / "tests" / "golden" / "nemo-rl").glob("*.json"))) >= 29
        metrics_url = f"http://127.0.0.1:{ports['9464']}/metrics"
        image_check.metrics_check(metrics_url, figures["golden_cases"])
        with pytest.raises(AssertionError, match="advantage_requests_total"):
            image_check.metrics_check(metrics_url, figures["golden_cases"] - 1)
        detail, _ = image_check.drain_check(srv.address, metrics_url, srv.proc.terminate, srv.wait,
                                            lambda: srv.stderr, min_call_s=1.5)
        assert "in flight at SIGTERM: came back OK" in detail and "exit 0" in detail, detail
    finally:
        if srv.proc.poll() is None:
            srv.proc.terminate()
        assert srv.wait(timeout=30) == 0, srv.stderr
        srv.close()
    down = subprocess.run(host_check, capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "unhealthy" in down.stderr, down.stdout + down.stderr


def load_image_check():
    """scripts/image_check.py as a module (``make image-check``)."""
    spec = importlib.util.spec_from_file_location("image_check", ROOT / "scripts" / "image_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_image_check_build_args_reach_pip():
    """``make image-check TORCH=cpu`` passes build args that the stage running pip declares (an undeclared
    ``--build-arg`` is ignored with a warning, and the image would silently get PyPI's 5.44 GB torch); the
    default build passes none of them (the cpu target as a user's ``docker build --target cpu`` builds it)."""
    image_check = load_image_check()
    declared = {args.split("=")[0] for ins, args in STAGES["cpu-venv"] if ins == "ARG"}
    wheels = pathlib.Path("/wheels-example")
    for engine, found in (("podman", wheels / "torch.whl"), ("podman", None), ("docker", None)):
        default = image_check.build_command(engine, "img", "pypi", None)
        cpu = image_check.build_command(engine, "img", "cpu", found)
        assert default[default.index("--target") + 1] == cpu[cpu.index("--target") + 1] == "cpu"
        passed = {cpu[i + 1].split("=")[0] for i, a in enumerate(cpu) if a == "--build-arg"}
        passed -= {"PYTHON_IMAGE"}  # the base (podman's stand-in), declared before the first FROM
        assert passed and passed <= declared, (passed, declared)
        assert not any(a.startswith("PIP_") for a in default), default
        if found is not None:
            assert f"{wheels}:/wheels-host:ro" in cpu and "PIP_FIND_LINKS=/wheels-host" in cpu, cpu
        else:
            assert f"PIP_EXTRA_INDEX_URL={image_check.PYTORCH_CPU_INDEX}" in cpu, cpu
    assert "ARG PYTHON_IMAGE=" in DOCKERFILE.read_text().split("FROM", 1)[0]


def numba_cache_dir(stage: list[tuple[str, str]]) -> str:
    """The stage's ``NUMBA_CACHE_DIR`` (from its ``ENV KEY=VALUE ...`` lines)."""
    values = [word.split("=", 1)[1] for ins, args in stage if ins == "ENV" for word in args.split()
              if word.startswith("NUMBA_CACHE_DIR=")]
    assert values, "no ENV NUMBA_CACHE_DIR"
    return values[-1]


@pytest.mark.parametrize("target", TARGETS)
def test_image_is_built_with_the_numba_cache_filled(target):
    """Each image compiles every kernel signature at build time (``python -m advantage_server.warmup``) into a
    NUMBA_CACHE_DIR outside /tmp (a Kubernetes emptyDir on /tmp would hide it), made readable for the server's
    user, before USER switches to it; both targets use the same directory (the manifests rely on it)."""
    stage = STAGES[target]
    cache = numba_cache_dir(stage)
    assert cache == numba_cache_dir(STAGES["cpu"]) == numba_cache_dir(STAGES["gpu"])
    assert cache.startswith("/") and not cache.startswith("/tmp"), cache
    runs = [i for i, (ins, args) in enumerate(stage) if ins == "RUN" and "advantage_server.warmup" in args]
    assert len(runs) == 1, "one RUN step warms the kernels"
    run = stage[runs[0]][1]
    assert "python -m advantage_server.warmup" in run and f"chmod -R a+rX {cache}" in run, run
    env_at = min(i for i, (ins, args) in enumerate(stage) if ins == "ENV" and "NUMBA_CACHE_DIR=" in args)
    user_at = max(i for i, (ins, _) in enumerate(stage) if ins == "USER")
    assert env_at < runs[0] < user_at, "warm after NUMBA_CACHE_DIR is set, as root, before USER"
    cmd = exec_form(last(stage, "CMD"))
    assert "--no-warmup" not in cmd, "the image's server warms before SERVING"


def test_warmup_module_runs_as_the_image_runs_it(tmp_path):
    """The build step's command runs and reports what it warmed (with this checkout's cache, so quickly; the
    empty-cache case is tests/test_warmup.py's)."""
    proc = subprocess.run([sys.executable, "-m", "advantage_server.warmup"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("warmed ") and "kernel signatures in" in proc.stdout, proc.stdout
