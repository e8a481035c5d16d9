"""Start -> SERVING: seconds from starting a server process to grpc.health.v1 answering SERVING (issue #29).

    .venv/bin/python scripts/start_time.py                      # 5 starts of advantage-server, numba's cache filled
    .venv/bin/python scripts/start_time.py --cache empty        # each start with a new, empty NUMBA_CACHE_DIR
    .venv/bin/python scripts/start_time.py --cache /some/dir    # this cache directory (filled first if empty)
    .venv/bin/python scripts/start_time.py -- --no-warmup       # flags after -- go to advantage-server
    .venv/bin/python scripts/start_time.py --cmd 'podman run --rm -p {port}:50051 IMAGE'   # any command

Each run starts the command (default: this Python's ``advantage_server.cli --host 127.0.0.1 --port {port}
--device cpu``; ``{port}`` is a free loopback port, ``{cache}`` the cache directory) and polls ``Health/Check``
on 127.0.0.1:{port} every 10 ms from the moment before the process is spawned; the clock stops at the first
SERVING reply, then the process gets SIGTERM. The channel reconnects every 10-50 ms (gRPC's default backoff
after a refused connection is 1 s, which would add up to a second to the figure). ``--cache filled`` (default)
fills a temporary cache first (one start of the server, not counted). It prints each run (with the server's
"warmed ..." log line), then min / median / max, and the machine's core count and load average before each
run (the figures of a busy machine are not a quiet one's), and the CPU seconds the server process had used by
SERVING (less sensitive to other work on the machine: roughly what a quiet core would take). ``--json`` prints
one JSON object instead.
Importable: :func:`start_to_serving` times one start of any command.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

#: fast reconnects while the server is not listening yet
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                   ("grpc.max_reconnect_backoff_ms", 50), ("grpc.enable_retries", 0)]
DEFAULT_CMD = (f"{shlex.quote(sys.executable)} -m advantage_server.cli --host 127.0.0.1 --port {{port}} "
               "--device cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all its threads) the process ``pid`` has used so far; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def start_to_serving(argv: list[str], address: str, env: dict[str, str] | None = None,
                     timeout: float = 600.0) -> dict[str, Any]:
    """Start ``argv`` and poll ``address`` (plaintext grpc.health.v1, service "") until SERVING; then SIGTERM it
    and wait for it. Returns ``{"seconds": spawn to SERVING, "cpu": CPU seconds the started process had used
    by then (its own threads, not its children's: for ``podman run`` that is podman's), "warmed": the server's
    warm-up log line or "", "load": 1-minute load average before the start}``. Raises RuntimeError when the
    process exits first or is not SERVING within ``timeout`` seconds (with the end of its output)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    log = tempfile.TemporaryFile()
    load = os.getloadavg()[0]
    cpu = None
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            seconds = None
            while time.perf_counter() - started < timeout:
                if proc.poll() is not None:
                    break
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        seconds = time.perf_counter() - started
                        cpu = _cpu_seconds(proc.pid)
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    log.seek(0)
    output = log.read().decode(errors="replace")
    if seconds is None:
        why = f"exited with {proc.returncode}" if proc.returncode not in (None, 0, -15) else \
            f"not SERVING within {timeout:.0f} s"
        raise RuntimeError(f"{' '.join(argv)}: {why} before SERVING; its output ends:\n{output[-3000:]}")
    warmed = re.search(r"(warmed \d+ kernel signatures.*?\))(?: \[|$)", output, re.M)
    return {"seconds": seconds, "cpu": cpu, "warmed": warmed.group(1) if warmed else "", "load": load}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--runs", type=int, default=5, help="starts to time (default 5)")
    p.add_argument("--cache", default="filled",
                   help="'filled' (default: a temporary cache, filled by one uncounted start), 'empty' (a new "
                        "directory per run) or a directory (NUMBA_CACHE_DIR)")
    p.add_argument("--cmd", default=DEFAULT_CMD, help="command to start, {port} and {cache} substituted "
                                                      "(default: advantage-server on 127.0.0.1:{port})")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for SERVING per run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("server_args", nargs="*", help="after --: more arguments for the command")
    args = p.parse_args(argv)

    root = tempfile.mkdtemp(prefix="advantage-start-time-")
    fixed = None if args.cache in ("filled", "empty") else os.path.abspath(args.cache)

    def one(cache: str) -> dict[str, Any]:
        port = free_port()
        command = shlex.split(args.cmd.format(port=port, cache=cache)) + args.server_args
        return start_to_serving(command, f"127.0.0.1:{port}", {**os.environ, "NUMBA_CACHE_DIR": cache},
                                args.timeout)

    filled = fixed or os.path.join(root, "filled")
    fill = None
    if args.cache != "empty":
        os.makedirs(filled, exist_ok=True)
        fill = one(filled)  # fills the cache (a no-op for a filled directory); not counted
    runs = []
    for _ in range(args.runs):
        cache = tempfile.mkdtemp(dir=root) if args.cache == "empty" else filled
        runs.append(one(cache))
        if not args.json:
            r = runs[-1]
            cpu = f"cpu {r['cpu']:.2f} s, " if r["cpu"] is not None else ""
            print(f"{r['seconds']:6.2f} s  ({cpu}load {r['load']:.2f})  {r['warmed'] or '(no warm-up line)'}",
                  flush=True)
    seconds = [r["seconds"] for r in runs]
    cpus = [r["cpu"] for r in runs if r["cpu"] is not None]
    summary = {"cache": args.cache, "command": args.cmd, "server_args": args.server_args, "nproc": os.cpu_count(),
               "runs": runs, "min": min(seconds), "median": statistics.median(seconds), "max": max(seconds),
               "cpu_min": min(cpus) if cpus else None,
               "cpu_median": statistics.median(cpus) if cpus else None, "fill": fill}
    if args.json:
        print(json.dumps(summary))
    else:
        loads = [r["load"] for r in runs]
        print(f"start -> SERVING over {len(runs)} runs ({args.cache} cache): min {summary['min']:.2f} s, median "
              f"{summary['median']:.2f} s, max {summary['max']:.2f} s; nproc {os.cpu_count()}, 1-min load before "
              f"each run {min(loads):.2f}-{max(loads):.2f}"
              + (f"; the server's CPU time by SERVING: min {min(cpus):.2f} s, median {statistics.median(cpus):.2f} s "
                 "(what a quiet core would take, roughly)" if cpus else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
