"""Build the ``cpu`` image and check, from the host, that it serves (issue #29): ``make image-check``.

    .venv/bin/python scripts/image_check.py                   # build (podman or docker, see --engine), then check
    .venv/bin/python scripts/image_check.py --torch cpu       # the same with a CPU-only torch (1.41 GB, not 5.44)
    .venv/bin/python scripts/image_check.py --no-build        # check the image already built
    .venv/bin/python scripts/image_check.py --git-ref HEAD    # build the last commit, not the working tree
    .venv/bin/python scripts/image_check.py --dry-run         # print the build command only
    .venv/bin/python scripts/image_check.py --build-only      # build, print the size and the build time

The engine (``--engine auto``): ``docker`` where ``docker info`` answers (a normal Docker: the Dockerfile's own
base images, ``docker build --target cpu``); otherwise ``podman`` with the shared container tools
(``../shared/tools/container/``: no image registry is reachable on the project's machines, so the base is the
stand-in its ``setup.sh`` imports, and the build runs with the same arguments as its ``build.sh``;
``--format docker`` keeps the HEALTHCHECK, which OCI images drop). Where neither works it says what to install.

The checks, each printed with its figures (exit status 1 if any fails):

1. start -> SERVING: seconds from spawning ``ENGINE run -d`` (the image's own ENTRYPOINT and CMD, ports
   published on 127.0.0.1) to the first SERVING reply of grpc.health.v1 on the published health port, polled
   every 10 ms from the host; ``--starts N`` fresh containers (min / median / max, with the load average:
   a busy machine's figure is not a quiet one's). The first container is the one the other checks use.
2. uid: PID 1 of the container is ``advantage-server`` and its real, effective and saved uid and gid are
   10001 (``/proc/1/status`` read with ``ENGINE exec``). torch: the image's torch version (``+cpu`` and no
   CUDA required with ``--torch cpu``).
3. HEALTHCHECK: the image carries the HEALTHCHECK (``advantage-healthcheck``), and it passes: podman runs it
   with ``podman healthcheck run`` (no systemd timer here), docker's own schedule is waited for (``healthy``).
4. golden calls from the host: every NeMo RL golden case (tests/golden/nemo-rl) through this checkout's
   Python client to the published port, compared with tests/conftest.py's ``assert_close_to_golden``.
5. ``/metrics`` from the host: ``GET http://127.0.0.1:PORT/metrics`` parses, and
   ``advantage_requests_total{method="ComputeAdvantage",code="OK"}`` counts exactly the golden calls.
6. SIGTERM with a call in flight: a GAE call big enough to last about a second or more (sized on the image by
   one timed call first) is sent; once the server's ``advantage_requests_in_flight`` gauge shows it,
   ``ENGINE kill --signal TERM``; the call must come back OK with the values of the timed call, the container
   must exit 0, and its log must say it drained one call.

Figures: ``--json FILE`` writes every figure (build seconds, image size, start times, check results).
"""
from __future__ import annotations

import argparse
import calendar
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED_TOOLS = ROOT.parent / "shared" / "tools" / "container"
STANDIN_BASE = "localhost/python-standin:3.11-slim-bookworm"
PODMAN_IMAGE = "localhost/advantage-service:cpu"
DOCKER_IMAGE = "advantage-service:cpu"
#: the suffix of the image's tag when built with a CPU-only torch (``--torch cpu``)
CPU_TORCH_SUFFIX = "-cputorch"
#: PyTorch's CPU wheel index: where a Docker build with ``--torch cpu`` finds torch 2.13.0+cpu
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: where these machines keep a CPU wheel of the pinned torch (pip's ``find-links`` on the host)
LOCAL_WHEELS = pathlib.Path("/opt/wheels")
#: the image's user (Dockerfile: ``USER 10001:10001``)
IMAGE_UID = 10001
#: container ports (the image's CMD)
GRPC, HEALTH, METRICS = 50051, 50052, 9464
#: fast reconnects while the server is not listening yet (gRPC's default backoff after a refused
#: connection is 1 s, which would add up to a second to the start figure)
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                  ("grpc.max_reconnect_backoff_ms", 50), ("grpc.enable_retries", 0)]


# ------------------------------------------------------------------------------------------------ engine
def docker_works() -> bool:
    """``docker info`` answers (a docker CLI without a daemon, as on the project's machines, does not)."""
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pick_engine(wanted: str) -> str:
    """``docker`` or ``podman`` for ``--engine auto|docker|podman``; raises SystemExit naming what to install."""
    if wanted == "docker" or (wanted == "auto" and docker_works()):
        return "docker"
    if shutil.which("podman"):
        return "podman"
    setup = SHARED_TOOLS / "setup.sh"
    hint = (f"run {setup} (installs podman and imports the stand-in base image)" if setup.exists() else
            "install Docker (docker info must answer) or podman")
    raise SystemExit(f"image-check: no container engine: `docker info` does not answer and podman is not "
                     f"installed; {hint}")


def image_name(engine: str, torch: str, override: str | None) -> str:
    if override:
        return override
    base = PODMAN_IMAGE if engine == "podman" else DOCKER_IMAGE
    return base + (CPU_TORCH_SUFFIX if torch == "cpu" else "")


def local_torch_wheel(wheels: pathlib.Path = LOCAL_WHEELS) -> pathlib.Path | None:
    """A CPU build of the pinned torch in ``wheels`` (``torch-<pin>+cpu-cp311-...whl``), or None."""
    pin = next((line.split("==", 1)[1].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line.startswith("torch==")), None)
    if pin is None or not wheels.is_dir():
        return None
    found = sorted(wheels.glob(f"torch-{pin}+cpu-cp311-*.whl"))
    return found[0] if found else None


def build_command(engine: str, image: str, torch: str, wheels: pathlib.Path | None) -> list[str]:
    """The build command. podman: ``../shared/tools/container/build.sh``'s arguments (stand-in base, the
    machine's CA bundle and pip config mounted for pip at build time, ``--format docker``). ``torch == "cpu"``:
    pip also sees a CPU wheel of the pinned torch (2.13.0+cpu, which it prefers to PyPI's 2.13.0): from
    ``wheels`` mounted at build time (podman; PIP_FIND_LINKS) or from PyTorch's CPU index (PIP_EXTRA_INDEX_URL)."""
    if engine == "podman":
        cmd = ["podman", "build", "--format", "docker", "--pull=never", "--target", "cpu",
               "--build-arg", f"PYTHON_IMAGE={STANDIN_BASE}",
               "-v", "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro",
               "-v", "/tmp/pip-build.conf:/etc/pip.conf:ro"]
    else:
        cmd = ["docker", "build", "--target", "cpu"]
    if torch == "cpu":
        if engine == "podman" and wheels is not None:
            cmd += ["-v", f"{wheels.parent}:/wheels-host:ro", "--build-arg", "PIP_FIND_LINKS=/wheels-host"]
        else:
            cmd += ["--build-arg", f"PIP_EXTRA_INDEX_URL={PYTORCH_CPU_INDEX}"]
    return cmd + ["-t", image, "."]


def ensure_podman_base() -> None:
    """The stand-in base image exists (``setup.sh`` makes it, ~2 min once per machine)."""
    if subprocess.run(["podman", "image", "exists", STANDIN_BASE]).returncode == 0 \
            and pathlib.Path("/tmp/pip-build.conf").exists():
        return
    setup = SHARED_TOOLS / "setup.sh"
    if not setup.exists():
        raise SystemExit(f"image-check: podman has no {STANDIN_BASE} and there is no {setup} to make it "
                         "(no image registry is reachable here); use Docker where a registry is reachable")
    print(f"image-check: {setup} (the stand-in base image, ~2 min once)", flush=True)
    subprocess.run(["bash", str(setup)], check=True)


def image_size(engine: str, image: str) -> int:
    out = subprocess.run([engine, "image", "inspect", "--format", "{{.Size}}", image], capture_output=True,
                         text=True, check=True).stdout
    return int(out.strip())


# ------------------------------------------------------------------------------------------------ checks
class Checks:
    """The results: ``ok(name, detail)`` / ``fail(name, detail)``, each printed as it comes."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def record(self, name: str, passed: bool, detail: str, **figures: Any) -> bool:
        self.results.append({"check": name, "passed": passed, "detail": detail, **figures})
        print(f"image-check: {'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)
        return passed

    def run(self, name: str, fn: Callable[[], tuple[str, dict]]) -> bool:
        """``fn`` returns (detail, figures) or raises AssertionError / any error (a failure with its text)."""
        try:
            detail, figures = fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the other checks still run
            return self.record(name, False, f"{type(exc).__name__}: {exc}")
        return self.record(name, True, detail, **figures)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r["passed"] for r in self.results)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (the sockets stay open until all are found, so no port comes twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_serving(address: str, timeout: float, started: float | None = None) -> float:
    """Seconds from ``started`` (default: now) until grpc.health.v1 ``Check('')`` at ``address`` says SERVING;
    raises TimeoutError after ``timeout`` s."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    t0 = time.monotonic() if started is None else started
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - t0 < timeout:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0
            except grpc.RpcError:
                pass
            time.sleep(0.01)
    raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f} s")


def golden_check(target: str, golden: pathlib.Path | None = None) -> tuple[str, dict]:
    """Every NeMo RL golden case through the Python client to ``target``; returns (detail, figures) with the
    number of ComputeAdvantage calls made. Raises AssertionError naming the first case that differs."""
    sys.path.insert(0, str(ROOT / "tests"))
    if golden is not None:
        os.environ["ADVANTAGE_GOLDEN_DIR"] = str(golden)
    from conftest import assert_close_to_golden, golden_cases, load_case  # the suite's own comparison
    from test_golden_nemo import nemo_kwargs
    from advantage_client import RemoteAdvantageEstimator
    cases = golden_cases("nemo-rl")
    t0 = time.monotonic()
    for path in cases:
        case = load_case(path)
        estimator = RemoteAdvantageEstimator(target, case["estimator"], case["config"],
                                             result_format="advantage_result")
        result = estimator.compute_advantage(**nemo_kwargs(case))
        assert_close_to_golden(result.advantages.numpy(), case, "advantages")
        if case["expected"]["returns"] is not None:
            assert_close_to_golden(result.returns.numpy(), case, "returns")
        for key, want in case["expected"]["metrics"].items():
            got = result.metrics[key]
            assert abs(got - want) <= 1e-5 + 1e-4 * abs(want), f"{case['id']} metric {key}: {got} != {want}"
    return (f"{len(cases)} NeMo RL golden cases equal to the reference from the host's client "
            f"({time.monotonic() - t0:.1f} s)", {"golden_cases": len(cases)})


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``GET url`` (Prometheus text format) as ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200, f"GET {url}: HTTP {reply.status}"
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def metrics_check(url: str, ok_calls: int) -> tuple[str, dict]:
    samples = scrape(url)
    got = metric(samples, "advantage_requests_total", method="ComputeAdvantage", code="OK")
    assert got == ok_calls, (f"advantage_requests_total{{method=ComputeAdvantage,code=OK}} = {got}, expected "
                             f"{ok_calls} (the calls this check made)")
    assert any(n == "advantage_requests_in_flight" for n, _ in samples), "no advantage_requests_in_flight"
    return f"GET {url}: {len(samples)} samples, ComputeAdvantage OK calls = {int(got)}", {}


def gae_inputs(rows: int, cols: int):
    import numpy as np
    rng = np.random.default_rng(29)
    return {"rewards": rng.standard_normal((rows, cols), dtype=np.float32),
            "values": rng.standard_normal((rows, cols), dtype=np.float32),
            "mask": np.ones((rows, cols), dtype=np.float32)}


def drain_check(target: str, metrics_url: str, send_sigterm: Callable[[], None],
                wait_exit: Callable[[float], int], logs: Callable[[], str],
                min_call_s: float = 2.0, max_elements: int = 1 << 25) -> tuple[str, dict]:
    """SIGTERM with a call in flight: the call completes with the values of an identical call made before,
    and the server exits 0 having logged that it waited for the call."""
    import numpy as np
    from advantage_client import AdvantageClient
    rows, cols = 256, 4096
    config = {"gae_gamma": 0.99, "gae_lambda": 0.95}
    with AdvantageClient(target, timeout=300) as client:
        client.compute("gae", config, as_numpy=True, **gae_inputs(4, 8))  # kernels loaded: not in the timing
        while True:  # size the call on this image and machine: timed calls, twice as big until one is long enough
            inputs = gae_inputs(rows, cols)
            t0 = time.monotonic()
            reference = client.compute("gae", config, as_numpy=True, **inputs)
            took = time.monotonic() - t0
            if took >= min_call_s or rows * cols * 2 > max_elements:
                break
            rows *= 2
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["result"] = client.compute("gae", config, as_numpy=True, **inputs)
            except Exception as exc:  # noqa: BLE001 - reported below
                box["error"] = exc
        thread = threading.Thread(target=call, daemon=True)
        sent = time.monotonic()
        thread.start()
        seen = 0.0
        while time.monotonic() - sent < 60 and thread.is_alive():
            seen = metric(scrape(metrics_url), "advantage_requests_in_flight")
            if seen >= 1:
                break
            time.sleep(0.01)
        assert seen >= 1 and thread.is_alive(), (f"the call was never seen in flight (in_flight={seen}, "
                                                  f"done={not thread.is_alive()}): nothing to drain")
        signalled = time.monotonic()
        send_sigterm()
        thread.join(300)
        returned = time.monotonic()
        assert not thread.is_alive(), "the call in flight did not come back within 300 s of SIGTERM"
        assert "error" not in box, f"the call in flight failed after SIGTERM: {box.get('error')!r}"
        result = box["result"]
        np.testing.assert_array_equal(result.advantages, reference.advantages)
        np.testing.assert_array_equal(result.returns, reference.returns)
    code = wait_exit(60)
    exited = time.monotonic()
    text = logs()
    assert code == 0, f"exit status {code} after SIGTERM (want 0); log tail:\n{text[-2000:]}"
    assert re.search(r"draining: waiting for [1-9]\d* call", text), f"no 'draining: waiting' line:\n{text[-2000:]}"
    return (f"GAE [{rows}, {cols}] ({took:.2f} s when timed) in flight at SIGTERM: came back OK, equal to the "
            f"timed call, {returned - sent:.2f} s after sending ({signalled - sent:.2f} s before SIGTERM, "
            f"{returned - signalled:.2f} s after); exit 0 {exited - signalled:.2f} s "
            f"after SIGTERM; log: drained", {"drain_call_elements": rows * cols, "drain_exit_s": exited - signalled})


# ------------------------------------------------------------------------------------------------ container
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", re.M)
WARMED = re.compile(r"warmed (\d+) kernel signatures in ([\d.]+) s \((\d+) loaded from cache, (\d+) compiled")


def start_phases(log: str, run_wall: float) -> str:
    """``"first log line after A s; warm-up B s (N signatures: L loaded, C compiled)"``, from the server's log
    (its timestamps are UTC wall-clock seconds, as the host's); parts the log lacks are left out."""
    parts = []
    first = LOG_TIME.search(log)
    if first:
        stamp = calendar.timegm(time.strptime(first.group(1), "%Y-%m-%d %H:%M:%S"))
        parts.append(f"first log line {stamp + int(first.group(2)) / 1000 - run_wall:.1f} s after `run` "
                     "(container, Python, imports)")
    warmed = WARMED.search(log)
    if warmed:
        parts.append(f"warm-up {warmed.group(2)} s ({warmed.group(1)} signatures: {warmed.group(3)} loaded, "
                     f"{warmed.group(4)} compiled)")
    return "; ".join(parts)


class Container:
    """One ``ENGINE run -d`` of the image with its three ports published on 127.0.0.1."""

    def __init__(self, engine: str, image: str, name: str):
        self.engine, self.image, self.name = engine, image, name
        self.ports = dict(zip((GRPC, HEALTH, METRICS), free_ports(3)))

    def start(self) -> float:
        """Runs the container; returns the start -> SERVING seconds (from spawning ``ENGINE run``).
        ``self.phases`` then says where the time went, from the server's log (see :func:`start_phases`)."""
        publish = [a for p, h in self.ports.items() for a in ("-p", f"127.0.0.1:{h}:{p}")]
        wall, t0 = time.time(), time.monotonic()
        run = subprocess.run([self.engine, "run", "-d", "--name", self.name, *publish, self.image],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"`{self.engine} run` exit {run.returncode}: {run.stderr.strip()[-2000:]}")
        try:
            seconds = wait_serving(f"127.0.0.1:{self.ports[HEALTH]}", 180, started=t0)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; log tail:\n{self.logs()[-3000:]}") from None
        self.phases = start_phases(self.logs(), wall)
        return seconds


    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports[GRPC]}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[METRICS]}/metrics"

    def exec(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.engine, "exec", self.name, *argv], capture_output=True, text=True, timeout=60)

    def logs(self) -> str:
        out = subprocess.run([self.engine, "logs", self.name], capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    def sigterm(self) -> None:
        subprocess.run([self.engine, "kill", "--signal", "TERM", self.name], check=True, capture_output=True)

    def wait_exit(self, timeout: float) -> int:
        out = subprocess.run([self.engine, "wait", self.name], capture_output=True, text=True, timeout=timeout,
                             check=True)
        return int(out.stdout.strip().splitlines()[-1])

    def remove(self) -> None:
        subprocess.run([self.engine, "rm", "-f", self.name], capture_output=True)


def uid_check(box: Container) -> tuple[str, dict]:
    status = box.exec("cat", "/proc/1/status")
    assert status.returncode == 0, status.stderr
    fields = dict(line.split(":", 1) for line in status.stdout.splitlines() if ":" in line)
    uids, gids = fields["Uid"].split(), fields["Gid"].split()
    cmdline = box.exec("cat", "/proc/1/cmdline").stdout.replace("\0", " ").strip()
    assert "advantage-server" in cmdline, f"PID 1 is {cmdline!r}, not advantage-server"
    assert set(uids[:3]) == {str(IMAGE_UID)} and set(gids[:3]) == {str(IMAGE_UID)}, f"Uid {uids} Gid {gids}"
    return f"PID 1 ({cmdline.split()[1] if len(cmdline.split()) > 1 else cmdline}) runs as uid {uids[0]} gid {gids[0]}", {}


def torch_check(box: Container, cpu_only: bool) -> tuple[str, dict]:
    """The image's torch build; with ``--torch cpu`` it must be a CPU build (``+cpu``, no CUDA): pip falls back
    to PyPI's CUDA build without a word when the CPU wheel's index is unreachable."""
    out = box.exec("python", "-c", "import torch; print(torch.__version__, torch.version.cuda)")
    assert out.returncode == 0, out.stderr[-2000:]
    version, cuda = out.stdout.split()
    if cpu_only:
        assert version.endswith("+cpu") and cuda == "None", (
            f"torch {version} (CUDA {cuda}) in an image built with --torch cpu: pip did not see the CPU wheel "
            f"(podman: a torch-<pin>+cpu wheel in {LOCAL_WHEELS}; docker: {PYTORCH_CPU_INDEX} reachable)")
    return f"torch {version} (CUDA {cuda})", {"torch": version}


def healthcheck_check(box: Container) -> tuple[str, dict]:
    fmt = "{{json .Config.Healthcheck}}"
    config = subprocess.run([box.engine, "image", "inspect", "--format", fmt, box.image], capture_output=True,
                            text=True, check=True).stdout.strip()
    test = (json.loads(config) or {}).get("Test") if config not in ("", "null", "<no value>") else None
    assert test and "advantage-healthcheck" in test, (f"the image has no HEALTHCHECK ({config!r}): podman keeps it "
                                                      "only with `podman build --format docker`")
    t0 = time.monotonic()
    if box.engine == "podman":
        run = subprocess.run(["podman", "healthcheck", "run", box.name], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"podman healthcheck run: exit {run.returncode} {run.stdout}{run.stderr}"
        how = "podman healthcheck run: healthy"
    else:
        status = ""
        while time.monotonic() - t0 < 120 and status != "healthy":
            status = subprocess.run(["docker", "inspect", "--format", "{{.State.Health.Status}}", box.name],
                                    capture_output=True, text=True).stdout.strip()
            time.sleep(1)
        assert status == "healthy", f"docker's health status: {status!r} after 120 s"
        how = "docker reports healthy"
    return f"HEALTHCHECK {test[1:]}; {how} ({time.monotonic() - t0:.2f} s)", {}


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("auto", "podman", "docker"), default="auto")
    p.add_argument("--torch", choices=("pypi", "cpu"), default="pypi",
                   help="pypi: the Dockerfile unchanged (PyPI's torch, which bundles CUDA); cpu: a CPU-only torch")
    p.add_argument("--image", help=f"the tag (default {PODMAN_IMAGE} or {DOCKER_IMAGE}, "
                                   f"+{CPU_TORCH_SUFFIX} with --torch cpu)")
    p.add_argument("--no-build", action="store_true", help="check the image already built")
    p.add_argument("--dry-run", action="store_true", help="print the build command and exit")
    p.add_argument("--build-only", action="store_true", help="build (and print the size and time) only")
    p.add_argument("--git-ref", help="build a commit (`git archive REF`, e.g. HEAD) instead of the working tree: "
                                     "a shared checkout's half-made edits stay out of the image")
    p.add_argument("--context", type=pathlib.Path, default=ROOT, help="the build context (default: the checkout)")
    p.add_argument("--starts", type=int, default=3, help="fresh containers timed start -> SERVING (default 3)")
    p.add_argument("--json", type=pathlib.Path, help="write the figures to this file")
    args = p.parse_args(argv)

    engine = pick_engine(args.engine) if not args.dry_run else (args.engine if args.engine != "auto" else
                                                                ("docker" if docker_works() else "podman"))
    image = image_name(engine, args.torch, args.image)
    wheels = local_torch_wheel() if args.torch == "cpu" else None
    cmd = build_command(engine, image, args.torch, wheels)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    figures: dict[str, Any] = {"engine": engine, "image": image, "torch": args.torch, "cores": os.cpu_count()}
    if not args.no_build:
        if engine == "podman":
            ensure_podman_base()
        context = args.context
        if args.git_ref:
            context = pathlib.Path(tempfile.mkdtemp(prefix="image-check-context-"))
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", args.git_ref],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(context)], input=archive, check=True)
            figures["git_ref"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.git_ref],
                                                capture_output=True, text=True, check=True).stdout.strip()
        print(f"image-check: building in {context}: {shlex.join(cmd)}", flush=True)
        t0 = time.monotonic()
        build = subprocess.run(cmd, cwd=context)
        if args.git_ref:
            shutil.rmtree(context, ignore_errors=True)
        figures["build_s"] = round(time.monotonic() - t0, 1)
        if build.returncode != 0:
            print(f"image-check: FAIL build: exit {build.returncode} after {figures['build_s']} s", flush=True)
            return 1
    size = image_size(engine, image)
    figures["image_bytes"] = size
    print(f"image-check: image {image}: {size / 1e9:.2f} GB" +
          (f", built in {figures['build_s']:.0f} s" if "build_s" in figures else ""), flush=True)

    if args.build_only:
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1) + "\n")
        return 0
    checks = Checks()
    starts: list[float] = []
    loads: list[float] = []
    tag = f"advantage-image-check-{os.getpid()}"
    box = Container(engine, image, f"{tag}-1")
    try:
        def start() -> tuple[str, dict]:
            load = os.getloadavg()[0]
            seconds = box.start()
            starts.append(seconds)
            loads.append(load)
            return (f"SERVING {seconds:.2f} s after `{engine} run` (1-min load average {load:.1f}); "
                    f"{box.phases}", {"phases": box.phases})
        ok = checks.run("start", start)
        if ok:
            checks.run("uid", lambda: uid_check(box))
            checks.run("torch", lambda: torch_check(box, args.torch == "cpu"))
            checks.run("healthcheck", lambda: healthcheck_check(box))
            golden = checks.run("golden", lambda: golden_check(box.target))
            calls = checks.results[-1].get("golden_cases", 0) if golden else None
            if calls is not None:
                checks.run("metrics", lambda: metrics_check(box.metrics_url, calls))
            checks.run("sigterm-drain", lambda: drain_check(box.target, box.metrics_url, box.sigterm,
                                                            box.wait_exit, box.logs))
    finally:
        box.remove()
    for n in range(2, args.starts + 1):  # more fresh starts, timed only (each stopped with SIGTERM: exit 0)
        extra = Container(engine, image, f"{tag}-{n}")
        try:
            load = os.getloadavg()[0]
            starts.append(extra.start())
            loads.append(load)
            print(f"image-check: start {n}: SERVING {starts[-1]:.2f} s after `{engine} run`; {extra.phases}",
                  flush=True)
            extra.sigterm()
            code = extra.wait_exit(60)
            if code != 0:
                checks.record(f"start-{n}", False, f"exit {code} after SIGTERM")
        except Exception as exc:  # noqa: BLE001
            checks.record(f"start-{n}", False, f"{type(exc).__name__}: {exc}")
        finally:
            extra.remove()
    if starts:
        figures["start_to_serving_s"] = [round(s, 2) for s in starts]
        figures["load_average_1m"] = [round(x, 2) for x in loads]
        print(f"image-check: start -> SERVING after `{engine} run`, {len(starts)} fresh containers: "
              f"min {min(starts):.2f} s, median {statistics.median(starts):.2f} s, max {max(starts):.2f} s "
              f"({os.cpu_count()} cores, 1-min load average {', '.join(f'{x:.1f}' for x in loads)})", flush=True)
    figures["checks"] = checks.results
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"image-check: {'all checks passed' if checks.passed else 'FAILED'} "
          f"({sum(r['passed'] for r in checks.results)}/{len(checks.results)})", flush=True)
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
