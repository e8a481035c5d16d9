"""The benchmark's ``adversarial`` section: legitimate goodput under attack (issue #27).

For each attack the same legitimate clients run twice, once alone and once beside the attacker, and the row
reports their goodput (completed calls per second) under attack as a fraction of their goodput alone (the
mean of the windows alone just before and just after the attack's window: the windows alternate, so the
machine's other load drifts less into the fraction):

* ``same host``: ``--legit-clients`` :class:`advantage_client.AdvantageClient` objects (the project's client,
  its health checking and retry policy, default transport ``"auto"``, the token) in one process on the
  attacker's own host (the neighbour);
* ``other host``: as many clients in one process inside a network namespace (``ip netns``) joined to this one
  by a veth pair: a real second host on this machine (10.201.0.2/30 there, 10.201.0.1/30 here, where the
  server listens). The bench creates the namespace and removes it afterwards; it needs root and ``ip``, else
  those rows say why they were skipped (and the server listens on 127.0.0.1).

The server is a real ``advantage-server`` process (``--auth-token-file``, ``--max-concurrent-requests 16``,
``--stream-idle-timeout 2``, no warm-up); the legitimate clients create their :class:`AdvantageClient` at the
start of each window (so a flood that locks *new* clients out shows) and call GRPO on a 16x32 batch one call
after the other for ``seconds`` seconds each. The attacks (each in its own process on this host):

* ``slow-loris``: 8 connections, 24 loops of calls that never send their body (unary) or trickle it (a stream
  that declares 1 MiB and sends 64 bytes a second), reopened as soon as the server ends them; token holders
  (a tokenless caller is refused before admission);
* ``slow-loris-fresh``: the same 24 loops, each call on a fresh connection of its own (issue #35 item 2);
* ``stalled-uploader``: one connection with 16 stream uploads that send their first chunk and then stall;
* ``tokenless-flood``: no token, 1,000 ``ComputeAdvantage`` calls outstanding over 10 connections, each sent
  again as soon as it is refused (issue #35 item 3);
* ``watch-flood``: no token, 300 health ``Watch`` streams over 10 connections, reopened when refused;
* ``shm-churn``: 4 processes (token holders) each holding 8 shared-memory regions and registering and
  unregistering another one in a loop;
* ``unread-results``: a token holder that opens a fresh raw HTTP/2 connection every 20 ms (:mod:`rawh2`), sends
  one 86-byte packed GRPO call whose result is 8 MiB, and never opens its receive window (issue #35 item 1);
* ``idle-connections``: the server's connection limit plus 64 TCP connections that send HTTP/2's preface and
  nothing else, each one the server closes opened again at once (issue #35 item 4; :func:`hold_idle_connections`).

Opt-in (``--adversarial-attacks``; :data:`.options.ADVERSARIAL_HEAVY`), outside issue #35's target:

* ``bulk-requests``: a heavy *legitimate* host, the bandwidth class (RELIABILITY.md): 4 token-holding
  :class:`AdvantageClient` loops, each sending a valid 16 MiB ``raw_reward`` request (2 Mi rows, ``transport=
  "stream"``, what a client on another host sends; ``"auto"`` would pick shared memory on this one) as soon as its
  last one returned. It holds no more than its share of places, but each of its calls costs the server ~100 times a
  small one: shares of places are not shares of cost.

A first window alone warms the server and the clients up and is not counted, and ``SETTLE_S`` passes between an
attacker's exit and the next window. A control row comes first, ``none``: the same windows with an attacker process that starts and sends nothing. Its
fraction, and the spread of its rounds, is what the machine's own noise gives a row: an attack's row within that
spread of the control's cannot be told from no attack.

``pin`` (``--adversarial-pin``, the bench's default; ``--no-adversarial-pin``): the attacker's processes run on
the machine's last CPU, the server and the legitimate clients on the others (``os.sched_setaffinity``; at least 2
CPUs): the attacker brings its own CPU, as one on another machine would, so the fraction measures what its traffic costs the server rather than what its
own process takes from the clients beside it. The windows alone then have one CPU fewer.

Only 127.0.0.1 and the namespace's 10.201.0.0/30 are ever targets. Figures vary with the machine's load:
compare the fractions, and see BENCHMARKS.md.
"""
from __future__ import annotations

import json
import itertools
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

# the default run's attacks, named in .options (which parses --adversarial-attacks without importing this module)
from advantage_server.bench.options import ADVERSARIAL_ATTACKS as ATTACKS

#: rows of a bulk-requests request (float32 rewards [B] and mask [B, 1]: 16 MiB)
BULK_ROWS = 2 << 20
#: the control row's attack: an attacker process that sends nothing (the bench's noise floor)
CONTROL = "none"
TARGET_FRACTION = 0.90
#: seconds between an attacker's exit and the next window alone (that window is also the next attack's "before"):
#: the server lets a gated host in again at its next sweep, and a same-host client whose first connection request
#: was dropped just before sends it again only after 1 s. Without the pause the window after idle-connections lost
#: a second of its same-host calls, and the control row after it read 122-133% (93% in its first round)
SETTLE_S = 2.0
HOST_ADDR, NS_ADDR = "10.201.0.1", "10.201.0.2"
#: 16 places: more than the slow-loris's 8 connections (a same-host attacker with at least as many connections as
#: places holds one place per connection, the fair share of a connection, and leaves a neighbour connection none)
SERVER_FLAGS = ("--max-concurrent-requests", "16", "--stream-idle-timeout", "2")
SERVICE = "advantage.v1.AdvantageService"


# ----------------------------------------------------------------------------------- network namespace
class NetNs:
    """A network namespace joined to this one by a veth pair: ``HOST_ADDR`` here, ``NS_ADDR`` there (a /30).
    ``available`` False with ``reason`` when it cannot be made (not root, no ``ip``, the kernel refuses).
    :meth:`close` removes the namespace (which removes the veth pair)."""

    def __init__(self, tag: str | None = None):
        tag = tag or f"{os.getpid() % 100000}"
        self.name, self.host_if, self.ns_if = f"advb-{tag}", f"advbh{tag}", f"advbn{tag}"
        self.available, self.reason = False, ""
        if os.geteuid() != 0:
            self.reason = "skipped: not root (ip netns needs CAP_SYS_ADMIN)"
            return
        if shutil.which("ip") is None:
            self.reason = "skipped: the ip command (iproute2) is missing"
            return
        steps = [["ip", "netns", "add", self.name],
                 ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                 ["ip", "link", "set", self.ns_if, "netns", self.name],
                 ["ip", "addr", "add", f"{HOST_ADDR}/30", "dev", self.host_if],
                 ["ip", "link", "set", self.host_if, "up"],
                 ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{NS_ADDR}/30", "dev", self.ns_if],
                 ["ip", "netns", "exec", self.name, "ip", "link", "set", self.ns_if, "up"],
                 ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode:
                self.reason = f"skipped: `{' '.join(step)}` failed: {done.stderr.strip()[:200]}"
                self.close()
                return
        self.available = True

    def prefix(self) -> list[str]:
        """The command prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        self.available = False

    def __enter__(self) -> "NetNs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------- worker processes
def _token_metadata(token_file: str | None) -> list[tuple[str, str]]:
    if not token_file:
        return []
    with open(token_file) as f:
        return [("authorization", f"Bearer {f.read().strip()}")]


def _batch(seed: int):
    import numpy as np
    rng = np.random.default_rng(seed)
    mask = (rng.random((16, 32)) < 0.85).astype(np.float32)
    mask[:, 0] = 1
    return {"prompt_ids": np.repeat(np.arange(4, dtype=np.int64), 4),
            "rewards": rng.standard_normal(16).astype(np.float32), "mask": mask}


def legit_window(target: str, token_file: str | None, clients: int, seconds: float,
                 transport: str = "auto", timeout: float = 10.0) -> dict[str, Any]:
    """``clients`` new :class:`AdvantageClient` objects, each in its own thread calling GRPO (16x32) one call
    after the other for ``seconds``: ``{"ok", "seconds", "errors": {code: n}}`` (calls that ended OK within
    the window; the clients are created inside it)."""
    from advantage_client import AdvantageClient

    end = time.monotonic() + seconds
    ok, errors, lock = [0], {}, threading.Lock()
    data = _batch(0)

    def run() -> None:
        try:
            client = AdvantageClient(target, token_file=token_file, timeout=timeout, transport=transport)
        except Exception as err:  # noqa: BLE001 - counted, not raised
            with lock:
                errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1
            return
        try:
            while time.monotonic() < end:
                try:
                    out = client.compute("grpo", None, **data)
                    assert out.advantages.shape == (16, 32)
                    if time.monotonic() <= end:
                        with lock:
                            ok[0] += 1
                except Exception as err:  # noqa: BLE001
                    name = getattr(getattr(err, "code", None), "name", None) or type(err).__name__
                    with lock:
                        errors[name] = errors.get(name, 0) + 1
                    time.sleep(0.05)
        finally:
            client.close()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + timeout + 30)
    return {"ok": ok[0], "seconds": seconds, "errors": errors}


def _legit_main(argv: list[str]) -> None:
    """``legit TARGET TOKEN_FILE CLIENTS``: reads ``run SECONDS`` lines and answers one JSON line each."""
    target, token_file, clients = argv[0], argv[1] or None, int(argv[2])
    import advantage_client  # noqa: F401 - imported before the first window
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "run":
            break
        print(json.dumps(legit_window(target, token_file, clients, float(words[1]))), flush=True)


def _channel(target: str, i: int):
    import grpc
    # a channel of its own connection (no subchannel shared with the other channels of this process)
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1), ("advb.conn", i)])


def bulk_call(client: Any) -> Any:
    """One ``bulk-requests`` call on ``client`` (an :class:`AdvantageClient`): ``raw_reward`` on ``BULK_ROWS`` rows
    of ones (float32 rewards ``[B]`` and mask ``[B, 1]``: 16 MiB), streamed (``transport="stream"``: what a client on
    another host sends; ``"auto"`` picks shared memory on the server's host). Returns the
    :class:`AdvantageResult` (NumPy): advantages ``[B, 1]``, all 0.0 (equal rewards, whitened)."""
    import numpy as np
    rewards = np.ones(BULK_ROWS, np.float32)
    return client.compute("raw_reward", rewards=rewards, mask=rewards[:, None], transport="stream", as_numpy=True)


def _loop(stop: threading.Event, body: Callable[[], None], pause: float) -> None:
    import grpc
    while not stop.is_set():
        try:
            body()
        except grpc.RpcError:
            pass
        except Exception:  # noqa: BLE001 - an attacker never stops on its own
            pass
        stop.wait(pause)


def attack(kind: str, target: str, token_file: str | None, stop: threading.Event, connections: int | None = None,
           loops: int | None = None, done: dict[str, int] | None = None) -> list[threading.Thread]:
    """Start attack ``kind`` against ``target`` in threads of this process (until ``stop``); returns them.
    ``connections`` / ``loops``: the slow-loris's or stalled uploader's connections and concurrent calls
    (defaults 8 / 24 and 1 / 16; ``bulk-requests``: its loops, default 4). ``done``: ``bulk-requests`` counts its
    completed calls in ``done["ok"]``."""
    from advantage_client.proto import advantage_pb2 as pb
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    md = _token_metadata(token_file)
    threads: list[threading.Thread] = []

    def start(fn: Callable[[], None], pause: float) -> None:
        t = threading.Thread(target=_loop, args=(stop, fn, pause), daemon=True)
        t.start()
        threads.append(t)

    kind, _, only = kind.partition(":")  # "slow-loris:silent" / "slow-loris:trickle": one kind of loop only

    def stalled_call(ch, mode: str, piece: int) -> None:
        """One call that never sends its body ("silent", unary), trickles ``piece`` bytes a second ("trickle") or
        sends a first chunk and stops ("stall"), both streamed, each declaring a 1 MiB request."""
        def chunks():
            if mode == "silent":
                stop.wait(60)
                return
            yield pb.ComputeAdvantageChunk(total_size=1 << 20, data=b"\0" * piece).SerializeToString()
            while not stop.wait(1.0 if mode == "trickle" else 60):
                yield pb.ComputeAdvantageChunk(data=b"\0" * piece).SerializeToString()
        if mode == "silent":
            ch.stream_unary(f"/{SERVICE}/ComputeAdvantage")(chunks(), timeout=60, metadata=md)
        else:
            list(ch.stream_stream(f"/{SERVICE}/ComputeAdvantageStream")(chunks(), timeout=60, metadata=md))

    if kind in ("slow-loris", "stalled-uploader"):
        channels = [_channel(target, i) for i in range(connections or (8 if kind == "slow-loris" else 1))]
        for i in range(loops or (24 if kind == "slow-loris" else 16)):
            mode = (only or ("silent" if i % 2 == 0 else "trickle")) if kind == "slow-loris" else "stall"
            start(lambda ch=channels[i % len(channels)], mode=mode: stalled_call(ch, mode, 64), 0.005)
    elif kind == "slow-loris-fresh":  # issue #35 item 2: the slow-loris, a fresh connection for every call
        fresh = itertools.count()
        for i in range(loops or 24):
            mode = only or ("silent" if i % 2 == 0 else "trickle")

            def body(mode=mode) -> None:
                with _channel(target, f"fresh-{next(fresh)}") as ch:
                    stalled_call(ch, mode, 16)
            start(body, 0.005)
    elif kind == "tokenless-flood":  # issue #35 item 3: ~1,000 tokenless calls outstanding, each sent again at once
        import grpc
        request = pb.ComputeAdvantageRequest().SerializeToString()
        channels = [_channel(target, f"anon-{i}") for i in range(10)]
        lock = threading.Lock()

        def again(ch) -> None:
            if stop.is_set():
                return
            try:
                future = ch.unary_unary(f"/{SERVICE}/ComputeAdvantage").future(request, timeout=30)
            except Exception:  # noqa: BLE001 - the channel is closing
                return
            future.add_done_callback(lambda _f, ch=ch: again(ch))

        def open_all() -> None:
            for i in range(1000):
                with lock:
                    again(channels[i % 10])
            stop.wait()
            for ch in channels:
                ch.close()
        threads.append(threading.Thread(target=open_all, daemon=True))
        threads[-1].start()
    elif kind == "watch-flood":
        channels = [_channel(target, i) for i in range(10)]
        for i in range(300):
            stub = health_pb2_grpc.HealthStub(channels[i % 10])

            def body(stub=stub) -> None:
                for _ in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=3600):
                    if stop.is_set():
                        return
            start(body, 2.0)  # a refused Watch is asked again every 2 s (the flood's own CPU stays small)
    elif kind == "shm-churn-one":
        from advantage_client import AdvantageClient
        client = AdvantageClient(target, token_file=token_file, timeout=10)
        held = []
        for _ in range(8):
            try:
                held.append(client.shared_memory(1 << 16))
            except Exception:  # noqa: BLE001 - the table or the quota is full: hold what we have
                break

        def body() -> None:
            region = client.shared_memory(1 << 16)
            region.close()
        start(body, 0.01)
        threads.append(threading.Thread(target=lambda: (stop.wait(), [r.close() for r in held], client.close()),
                                        daemon=True))
        threads[-1].start()
    elif kind == "unread-results":  # issue #35 item 1: a fresh raw connection per call, never reading its result
        import collections

        from advantage_server.bench.rawh2 import RawH2, big_result_request
        host, port = target.rsplit(":", 1)
        request = big_result_request(1 << 21)  # 86 bytes asking for 8 MiB of result
        held: collections.deque = collections.deque()

        def body() -> None:
            conn = RawH2(host.strip("[]"), int(port))
            conn.call(f"/{SERVICE}/ComputeAdvantage", request, tuple(md))
            held.append(conn)
            while len(held) > 512:  # the attacker's own descriptors: the oldest connections go
                held.popleft().close()
        start(body, 0.02)
        threads.append(threading.Thread(target=lambda: (stop.wait(), [c.close() for c in list(held)]), daemon=True))
        threads[-1].start()
    elif kind == "bulk-requests":  # a heavy legitimate host: valid 16 MiB requests, one after the other per loop
        from advantage_client import AdvantageClient
        clients = [AdvantageClient(target, token_file=token_file, timeout=60) for _ in range(loops or 4)]
        counts = done if done is not None else {}
        counts.setdefault("ok", 0)
        lock = threading.Lock()

        def bulk(client) -> None:
            try:
                bulk_call(client)
            except Exception:
                stop.wait(0.05)  # a refusal or no server: not at once again (the loop's pause is 0 after a call)
                raise
            with lock:
                counts["ok"] += 1
        for client in clients:
            start(lambda client=client: bulk(client), 0.0)
        threads.append(threading.Thread(target=lambda: (stop.wait(), [c.close() for c in clients]), daemon=True))
        threads[-1].start()
    elif kind == CONTROL:  # the control row: nothing
        pass
    elif kind == "idle-connections":  # issue #35 item 4: connections that send the preface and no call
        host, port = target.rsplit(":", 1)
        full = threading.Event()
        t = threading.Thread(target=hold_idle_connections, args=(host.strip("[]"), int(port), stop, connections),
                             kwargs={"full": full}, daemon=True)
        t.start()
        threads.append(t)
        full.wait(30)  # the server holds its limit (or all of them): new clients meet a full server from now on
    else:
        raise ValueError(f"unknown attack {kind!r}")
    return threads


def hold_idle_connections(host: str, port: int, stop: threading.Event, count: int | None = None,
                          opened: list[int] | None = None, full: threading.Event | None = None,
                          reopen: bool = True) -> None:
    """Hold ``count`` TCP connections to ``host:port`` open, each sending HTTP/2's preface and an empty SETTINGS
    frame and then nothing, and open another at once for each one the server closes, until ``stop``. ``count``
    defaults to the server's connection limit (:func:`advantage_server.server.max_connections` at this machine's
    hard descriptor limit) plus 64: past the limit gRPC closes each new connection as it arrives, and the attacker
    opens it again. ``opened``: when given, ``opened[0]`` counts the connections opened; ``full``: set once the
    server first closes a connection, or all ``count`` are open; ``reopen`` False: a connection closed is not
    opened again (an attacker that only holds what it got)."""
    import resource
    import selectors

    from advantage_server.bench.rawh2 import PREFACE
    from advantage_server.server import max_connections
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    count = min(count or max_connections(hard) + 64, hard - 64)
    hello = PREFACE + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0))  # an empty SETTINGS frame
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sel = selectors.DefaultSelector()
    counter = opened if opened is not None else [0]

    def open_one() -> None:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex((host, port))
        sel.register(sock, selectors.EVENT_WRITE, "connecting")
        counter[0] += 1

    for _ in range(count):
        open_one()
    open_now = 0
    while not stop.is_set():
        for key, _events in sel.select(timeout=0.1):
            sock = key.fileobj
            try:
                if key.data == "connecting":
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        raise OSError("refused")
                    sock.sendall(hello)
                    sel.modify(sock, selectors.EVENT_READ, "open")
                    open_now += 1
                    if full is not None and open_now >= count:
                        full.set()
                elif not sock.recv(65536):  # the server's SETTINGS and PINGs are read and ignored
                    raise OSError("closed")
            except OSError:
                if full is not None:
                    full.set()
                open_now -= key.data == "open"
                sel.unregister(sock)
                sock.close()
                if reopen and not stop.is_set():
                    open_one()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    sel.close()


def _attack_main(argv: list[str]) -> None:
    """``attack KIND TARGET TOKEN_FILE``: attacks until stdin closes; prints ``ready`` once started."""
    kind, target, token_file = argv[0], argv[1], argv[2] or None
    stop = threading.Event()
    children = []
    if kind == "shm-churn":  # 4 processes: regions are charged to each process
        children = [subprocess.Popen([sys.executable, "-m", __name__, "attack", "shm-churn-one", target,
                                      token_file or ""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    for _ in range(4)]
        for c in children:
            c.stdout.readline()
    else:
        attack(kind, target, token_file, stop)
    time.sleep(1.0)  # the attack's calls and streams are open
    print("ready", flush=True)
    sys.stdin.read()
    stop.set()
    for c in children:
        c.stdin.close()
        try:
            c.wait(10)
        except subprocess.TimeoutExpired:
            c.kill()
    os._exit(0)


# ----------------------------------------------------------------------------------- the section
def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Proc:
    """A worker process that answers lines on stdout."""

    def __init__(self, args: list[str], prefix: list[str] | None = None, cpus: set[int] | None = None):
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", __name__, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"worker {args[:2]} did not start (said {line!r})")

    def ask(self, line: str) -> dict[str, Any]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (``VmRSS`` of /proc/<pid>/status; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


class _RssPeak:
    """The largest resident size of process ``pid`` while the block runs, sampled every 50 ms (``.peak``)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, _rss(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss(self.pid))

    def __enter__(self) -> "_RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss(self.pid))


def server_memory_bound() -> int:
    """RELIABILITY.md's peak memory bound (:func:`advantage_server.server.memory_bound`) for the bench's server flags
    (``SERVER_FLAGS``, the rest at their defaults)."""
    from advantage_server.limits import Limits
    from advantage_server.server import memory_bound
    return memory_bound(Limits(max_concurrent_requests=int(SERVER_FLAGS[1]), stream_idle_timeout=float(SERVER_FLAGS[3])))


def _server(host: str, token_file: str, log, cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port(host)
    proc = subprocess.Popen([sys.executable, "-m", "advantage_server.cli", "--host", host, "--port", str(port),
                             "--device", "cpu", "--auth-token-file", token_file, *SERVER_FLAGS],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env={**os.environ, "ADVANTAGE_WARMUP": "0"},
                            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    address = f"{host}:{port}"
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"advantage-server exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, address
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("advantage-server not SERVING after 120 s")


def run_adversarial(attacks: tuple[str, ...] = ATTACKS, clients: int = 4, seconds: float = 4.0,
                    netns: bool = True, rounds: int = 1, pin: bool = False, control: bool = True) -> dict[str, Any]:
    """Measure every attack, after the control (``CONTROL``, with ``control``: an attacker that sends nothing, its
    row's ``meets`` None); returns ``{"server": address, "other_host": reason or "10.201.0.2 (netns)",
    "rows": [{"attack", "where", "base_calls_s", "attack_calls_s", "fraction", "vs_control", "meets", "rounds",
    "errors", "note"}]}`` (``fraction`` None when a row was skipped; ``note`` then says why; ``vs_control``: the
    fraction over the control row's for the same place, the machine's own noise divided out, None without a
    control), "load": the load average at the
    end}``. The windows alternate (alone, attack 1, alone, attack 2, ..., alone), ``rounds`` times over;
    ``base_calls_s``: the mean of the windows alone just before and just after each of the attack's windows,
    ``attack_calls_s`` the mean of its windows, ``fraction`` their ratio (the calls of every round pooled: a
    longer measurement, not a choice among rounds) and ``rounds`` each round's own fraction. ``pin``: the attacker
    on the last CPU, the rest on the others (see the module docstring; ignored, with "pinned" False, on one CPU)."""
    attacks = (CONTROL, *(a for a in attacks if a != CONTROL)) if control else attacks
    cpus = sorted(os.sched_getaffinity(0))
    pin = pin and len(cpus) >= 2
    attacker_cpus, others = ({cpus[-1]}, set(cpus[:-1])) if pin else (None, None)
    ns = NetNs() if netns else None
    other_reason = "" if ns and ns.available else (ns.reason if ns else "skipped: --no-netns")
    host = HOST_ADDR if ns and ns.available else "127.0.0.1"
    out: dict[str, Any] = {"rows": [], "other_host": f"{NS_ADDR} (network namespace)" if not other_reason
                           else other_reason, "pinned": pin}
    tmp = tempfile.mkdtemp(prefix="advantage-bench-adv-")
    token_file = os.path.join(tmp, "token")
    with open(token_file, "w") as f:
        f.write(secrets.token_hex(16))
    log = open(os.path.join(tmp, "server.log"), "wb")
    server = None
    workers: dict[str, _Proc] = {}
    try:
        server, address = _server(host, token_file, log, others)
        out["server"] = address
        workers["same host"] = _Proc(["legit", address, token_file, str(clients)], cpus=others)
        if not other_reason:
            workers["other host"] = _Proc(["legit", address, token_file, str(clients)], prefix=ns.prefix(),
                                          cpus=others)

        def window() -> dict[str, dict[str, Any]]:
            # both places' clients run at the same time, as they would beside each other
            results: dict[str, dict[str, Any]] = {}
            ts = [threading.Thread(target=lambda w=w: results.__setitem__(w, workers[w].ask(f"run {seconds}")))
                  for w in workers]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            return results

        # each attack is compared with the mean of the windows alone just before and just after it (the machine's
        # other load drifts between windows); per (attack, where): [(base calls, attacked calls)] per round
        seen: dict[tuple[str, str], list[tuple[float, int]]] = {}
        errors: dict[tuple[str, str], dict[str, int]] = {}
        window()  # a warm-up, not counted: the first window runs cold (imports, first connections, the JIT), and as
        # the first row's "before" it made that row look better than it was (the control row read 106-119%)
        before = window()
        idle_rss = _rss(server.pid)  # after the first windows alone: warm, as the attacked windows find it
        out["idle_rss"], out["memory_bound"] = idle_rss, server_memory_bound()
        peaks: dict[str, int] = {}
        for _ in range(max(1, rounds)):
            for kind in attacks:
                with _RssPeak(server.pid) as rss:
                    attacker = _Proc(["attack", kind, address,
                                      "" if kind in ("watch-flood", "tokenless-flood") else token_file],
                                     cpus=attacker_cpus)
                    try:
                        hit = window()
                    finally:
                        attacker.close()
                peaks[kind] = max(peaks.get(kind, 0), rss.peak - idle_rss)
                time.sleep(SETTLE_S)  # the attack's tail (a gated host let in again) is not the next window's
                after = window()
                for where in workers:
                    seen.setdefault((kind, where), []).append(
                        ((before[where]["ok"] + after[where]["ok"]) / 2, hit[where]["ok"]))
                    for code, n in hit[where]["errors"].items():
                        errs = errors.setdefault((kind, where), {})
                        errs[code] = errs.get(code, 0) + n
                before = after
        for kind in attacks:
            for where in ("same host", "other host"):
                if where not in workers:
                    out["rows"].append({"attack": kind, "where": where, "base_calls_s": None, "attack_calls_s": None,
                                        "fraction": None, "vs_control": None, "meets": None, "rounds": [], "errors": {},
                                        "rss_growth": None,
                                        "note": other_reason})
                    continue
                pairs = seen[(kind, where)]
                b = sum(p[0] for p in pairs) / (len(pairs) * seconds)
                a = sum(p[1] for p in pairs) / (len(pairs) * seconds)
                frac = a / b if b else None
                control = next((r["fraction"] for r in out["rows"] if r["attack"] == CONTROL and r["where"] == where),
                               None)
                out["rows"].append({"attack": kind, "where": where, "base_calls_s": b, "attack_calls_s": a,
                                    "fraction": frac,
                                    "vs_control": frac / control if frac is not None and control else None,
                                    "meets": None if frac is None or kind == CONTROL else frac >= TARGET_FRACTION,
                                    "rss_growth": peaks.get(kind),
                                    "rounds": [p[1] / p[0] if p[0] else None for p in pairs],
                                    "errors": errors.get((kind, where), {}),
                                    "note": f"{clients} clients, {seconds:g} s windows"
                                            + (f", {len(pairs)} rounds pooled" if len(pairs) > 1 else "")})
        out["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    finally:
        for w in workers.values():
            w.close()
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()
        if ns is not None:
            ns.close()
        if os.environ.get("ADVANTAGE_BENCH_KEEP_LOG"):  # the server's log, kept for a look
            shutil.copy(os.path.join(tmp, "server.log"), os.environ["ADVANTAGE_BENCH_KEEP_LOG"])
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def render(result: dict[str, Any]) -> list[str]:
    lines = ["", f"adversarial: legitimate goodput under attack / without (target >= {TARGET_FRACTION:.0%}); "
             f"server {result.get('server', '?')} ({' '.join(SERVER_FLAGS)}, --auth-token-file); "
             f"other host: {result['other_host']}; load average at the end {result.get('load', '?')}"
             + ("; attacker pinned to the last CPU, the rest to the others" if result.get("pinned") else "")
             + (f"; server RSS {result['idle_rss'] / 2**20:.0f} MiB after the first windows alone, peak growth "
                f"under each attack below against the memory bound {result['memory_bound'] / 2**30:.0f} GiB "
                "(RELIABILITY.md)" if result.get("memory_bound") else "")]
    header = ["attack", "legit client", "calls/s alone", "calls/s attacked", "fraction", "each round", ">= 90%",
              "/ control", "server RSS peak growth", "errors / note"]
    table = []
    for r in result["rows"]:
        f = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items()))
        table.append([r["attack"], r["where"], f(r["base_calls_s"]), f(r["attack_calls_s"]),
                      "-" if r["fraction"] is None else f"{100 * r['fraction']:.0f}%",
                      "/".join("-" if x is None else f"{100 * x:.0f}" for x in r.get("rounds", [])) or "-",
                      "control" if r["attack"] == CONTROL else "-" if r["meets"] is None else
                      ("yes" if r["meets"] else "NO"),
                      "-" if r.get("vs_control") is None or r["attack"] == CONTROL else f"{100 * r['vs_control']:.0f}%",
                      "-" if r.get("rss_growth") is None else f"{r['rss_growth'] / 2**20:+.0f} MiB",
                      "; ".join(filter(None, [errs, r["note"]]))])
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(header)]
    lines.append(" | ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines.append("-+-".join("-" * w for w in widths))
    lines.extend(" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)
    return lines


def adversarial_section(report: Any, row: Callable[..., Any], clients: int = 4, seconds: float = 4.0,
                        attacks: tuple[str, ...] = ATTACKS, rounds: int = 1, pin: bool = False) -> dict[str, Any]:
    """Run :func:`run_adversarial` and add one ``Row("adversarial", attack, where, ...)`` per figure
    (``vs_ours`` = the goodput fraction, ``calls_s`` = calls per second under attack). Returns the dict."""
    result = run_adversarial(attacks, clients, seconds, rounds=rounds, pin=pin)
    for r in result["rows"]:
        verdict = "the control (no attack)" if r["attack"] == CONTROL else \
            f"{'meets' if r['meets'] else 'BELOW'} 90%"
        report.add(row("adversarial", r["attack"], r["where"], "AdvantageClient goodput",
                       vs_ours=r["fraction"], calls_s=r["attack_calls_s"],
                       note=r["note"] if r["fraction"] is None else
                       f"{r['base_calls_s']:.1f} calls/s alone; {verdict}"
                       + ("" if r["attack"] == CONTROL or r["vs_control"] is None else
                          f"; {100 * r['vs_control']:.0f}% of the control's")))
    return result


if __name__ == "__main__":
    if sys.argv[1] == "legit":
        _legit_main(sys.argv[2:])
    elif sys.argv[1] == "attack":
        _attack_main(sys.argv[2:])
    else:
        raise SystemExit(f"usage: python -m {__name__} legit|attack ...")
