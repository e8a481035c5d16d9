"""What refused requests cost the server (issue 11, item 2): server CPU and peak RSS of a real server process.

    .venv/bin/python scripts/refusal_cost.py                       # the working tree
    .venv/bin/python scripts/refusal_cost.py /tmp/old/server:/tmp/old/client   # another checkout (PYTHONPATH)

1. with --auth-token-file: 3 tokenless requests of 30 MiB of tiny unknown protobuf fields, one at a time;
2. 4 concurrent tokenless 256 MiB requests;
3. --max-concurrent-requests 2, both places held by streams that stall, then 32 concurrent 64 MiB requests.
Servers listen on 127.0.0.1; every call has a 120 s deadline.
"""
from __future__ import annotations

import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import psutil

from advantage_client._proto.advantage.v1 import advantage_pb2 as pb

PYTHONPATH = sys.argv[1] if len(sys.argv) > 1 else ""
METHOD = "/advantage.v1.AdvantageService/ComputeAdvantage"
OPTIONS = [("grpc.max_send_message_length", -1)]


def start(*flags: str) -> tuple[subprocess.Popen, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = pathlib.Path(tempfile.mkdtemp()) / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PYTHONPATH": PYTHONPATH} if PYTHONPATH else {})}
    proc = subprocess.Popen([sys.executable, "-m", "advantage_server.cli", "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", *flags], stdout=subprocess.DEVNULL, stderr=out.open("wb"), env=env)  # start-up lines: stderr
    deadline = time.monotonic() + 60
    while "listening" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    return proc, f"127.0.0.1:{port}"


def cpu_s(proc: subprocess.Popen) -> float:
    t = psutil.Process(proc.pid).cpu_times()
    return t.user + t.system


class PeakRss:
    def __init__(self, pid: int):
        self.proc, self.done = psutil.Process(pid), threading.Event()
        self.start = self.peak = self.proc.memory_info().rss
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> str:
        time.sleep(0.05)
        self.done.set()
        return f"RSS {self.start >> 20} -> peak {self.peak >> 20} MiB"


def concurrently(call, body: bytes, n: int) -> tuple[dict[str, int], list[float]]:
    codes: dict[str, int] = {}
    seconds: list[float] = []

    def one() -> None:
        t = time.monotonic()
        try:
            call(body, timeout=120)
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        seconds.append(time.monotonic() - t)
        codes[code] = codes.get(code, 0) + 1
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes, seconds


def main() -> None:
    token = pathlib.Path(tempfile.mkdtemp()) / "token"
    token.write_text("s3cret")
    proc, address = start("--auth-token-file", str(token))
    try:
        call = grpc.insecure_channel(address, options=OPTIONS).unary_unary(METHOD)
        junk = b"\x78\x00" * (15 << 20)  # 30 MiB of tiny unknown fields (field 15, varint 0)
        for _ in range(3):
            c0, t0 = cpu_s(proc), time.monotonic()
            codes, _ = concurrently(call, junk, 1)
            print(f"tokenless 30 MiB of unknown fields: {codes}; server CPU {1e3 * (cpu_s(proc) - c0):.0f} ms, "
                  f"wall {1e3 * (time.monotonic() - t0):.0f} ms", flush=True)
        rss, c0 = PeakRss(proc.pid), cpu_s(proc)
        codes, seconds = concurrently(call, b"\x78\x00" * (128 << 20), 4)
        print(f"4 concurrent tokenless 256 MiB: {codes}; server {rss.stop()}, CPU {cpu_s(proc) - c0:.2f} s, "
              f"slowest answer {max(seconds):.1f} s", flush=True)
    finally:
        proc.kill()
        proc.wait()

    proc, address = start("--max-concurrent-requests", "2")
    release = threading.Event()
    try:
        channel = grpc.insecure_channel(address, options=OPTIONS)

        def stalled():
            yield pb.ComputeAdvantageChunk(total_size=1 << 20, data=b"\0" * 1000).SerializeToString()
            release.wait(120)
        holders = [channel.stream_stream("/advantage.v1.AdvantageService/ComputeAdvantageStream")(stalled(), timeout=120)
                   for _ in range(2)]
        time.sleep(1.0)
        rss, c0 = PeakRss(proc.pid), cpu_s(proc)
        codes, seconds = concurrently(channel.unary_unary(METHOD), b"\x78\x00" * (32 << 20), 32)
        print(f"32 concurrent 64 MiB against 2 held places: {codes}; server {rss.stop()}, CPU {cpu_s(proc) - c0:.2f} s; "
              f"answers (client side, sending included) median {statistics.median(seconds):.2f} s, "
              f"max {max(seconds):.2f} s", flush=True)
        release.set()
        for h in holders:
            h.cancel()
    finally:
        release.set()
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
