"""``advantage-server``: run the advantage service.

    advantage-server --port 50051 --device auto

Logs its address and device at start, once (stderr: ``advantage-server listening on ADDRESS device=DEVICE
(...)``). On SIGTERM or SIGINT it drains: health reports NOT_SERVING,
new calls get UNAVAILABLE, calls in progress finish (within ``--grace`` seconds, at most a day), then it exits 0,
within ``--grace`` + 5 s of the signal whatever is still running (:func:`exit_watchdog`).
``kill -USR1 PID`` prints every thread's Python stack to stderr and the server goes on (for a server that
seems stuck).
Exits 2 with a one-line message naming the flag when a flag is out of range (a port outside 0-65535, a limit
that is not a positive integer, a negative ``--grace``, an unknown ``--log-level`` or ``--device``), a flag is
unknown (the nearest known one named: did you mean), the
``--host`` does not resolve or is not an address of this machine, a port is in use, a TLS file cannot be
read, is not PEM, or the key does not match the certificate (:mod:`advantage_server.preflight`: checked before
the server is built), the device does not exist, or the token file cannot be read. Flags are parsed and
checked before torch is imported: a bad one is answered at once.

Limits: ``--max-message-mb``, ``--max-batch-elements``, ``--max-concurrent-requests`` (beyond them:
RESOURCE_EXHAUSTED at once), ``--workers`` (computations at once), ``--stream-idle-timeout`` (a stalled
upload is cut), ``--min-upload-rate-kib`` / ``--upload-rate-window`` (a streamed upload slower than the
minimum is cut), ``--max-shm-regions-per-client`` (shared-memory regions per client connection),
``--max-pending-per-peer`` / ``--max-pending-per-connection`` (calls of one client host / connection waiting for
their request body that keep their place when the server is full). Security: ``--tls-cert`` and
``--tls-key`` (TLS), ``--tls-client-ca`` (mutual TLS), ``--auth-token-file`` (bearer token on every
call but health checks). See RELIABILITY.md.
"""
from __future__ import annotations

import argparse
import difflib
import faulthandler
import gc
import logging
import math
import os
import re
import signal
import sys
import threading
import time

# Light imports only (no torch, numba or client): a bad flag is answered, and advantage-healthcheck runs, at
# once; the server itself (advantage_server.server, .metrics) is imported once the flags have passed.
from advantage_server import logs
from advantage_server.defaults import (
    DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_MESSAGE_MB, DEFAULT_MAX_STREAM_MB,
    DEFAULT_MAX_SHM_REGIONS_PER_CLIENT, DEFAULT_MIN_UPLOAD_RATE_KIB, DEFAULT_STREAM_IDLE_TIMEOUT,
    DEFAULT_STREAM_WINDOW_MB, DEFAULT_UPLOAD_RATE_WINDOW, DEFAULT_WORKERS,
)

log = logging.getLogger("advantage_server")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


# Flag values are checked by argparse: a bad one exits 2 with "advantage-server: error: argument --X: ..."
def port_number(text: str) -> int:
    """``--port`` and friends: an integer from 0 to 65535 (0 = any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: give an integer from 0 to 65535 "
                                         "(0 = any free port)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: a port is 0 to 65535 (0 = any free port)")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a positive integer (1 or more)")
    return value


def non_negative_int(text: str) -> int:
    """A whole number, 0 or more (0 turns the limit off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give 0 (off) or a positive integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: give 0 (off) or a positive integer")
    return value


def seconds(allow_zero: bool, maximum: float | None = None):
    """A finite number of seconds, >= 0 (``allow_zero``) or > 0, and at most ``maximum`` when given."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{text}: give a finite number of seconds "
                                             f"{'>= 0' if allow_zero else '> 0'}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text}: give at most {maximum:g} seconds")
        return value
    return parse


#: the longest ``--grace`` (one day): gRPC's stop takes a float it turns into a deadline, and 1e12 s overflowed it
MAX_GRACE_S = 86400.0
#: seconds past ``--grace`` after which a stopping server's process exits whatever is still running
EXIT_MARGIN_S = 5.0


def exit_watchdog(seconds: float) -> threading.Thread:
    """Start a daemon thread that ends the process (exit code 0) ``seconds`` from now, logging why, unless it
    has ended before: the drain's promise is an exit within ``--grace`` + ``EXIT_MARGIN_S`` seconds of SIGTERM,
    and neither a kernel that does not reach its next checkpoint nor a thread that holds up the interpreter's
    exit may break it (issue #35 item 7: ``--grace 0`` under load exited 4-13 s after SIGTERM, and 3 of 4 servers
    stopped at once were still alive 90 s after logging "stopped"). ``os._exit``: no clean-up runs, which is the
    point; the calls in progress had their grace."""
    def run() -> None:
        time.sleep(seconds)
        log.warning("still running %.1f s after the signal to stop (--grace + %.0f s): exiting now", seconds,
                    EXIT_MARGIN_S)
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(0)
    thread = threading.Thread(target=run, name="advantage-exit-watchdog", daemon=True)
    thread.start()
    return thread


def prefix_length(text: str) -> int:
    """An IPv6 prefix length from 16 to 128 (``--ipv6-host-prefix``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a prefix length") from None
    if not 16 <= value <= 128:
        raise argparse.ArgumentTypeError(f"{text}: give a prefix length from 16 to 128")
    return value


def log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: choose {', '.join(LOG_LEVELS[:-1])} or "
                                         f"{LOG_LEVELS[-1]}")
    return text.upper()


def device_name(text: str) -> str:
    if not _DEVICE.fullmatch(text.strip().lower()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: choose auto, cpu, cuda or cuda:N "
                                         "(N = the GPU's index, e.g. cuda:0)")
    return text.strip().lower()


def host_name(text: str) -> str:
    """``--host``/``--metrics-host``: a name or an IP address; an IPv6 one with or without brackets (``[::]`` is
    ``::``; the server adds them back where an address needs them). Whether it resolves to an address of this
    machine is checked before binding (:func:`advantage_server.preflight.check_bind`)."""
    value = text.strip()
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    if not value or any(c.isspace() or c in "[]/" for c in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a host: give an IP address (127.0.0.1, ::1), a host "
                                         "name, or 0.0.0.0 / :: (every address)")
    return value


class FlagParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are two lines (a short usage, then the error; ``--help`` keeps the full
    usage) and whose error for an unknown flag names the nearest known one (``--max-concurent-requests``: did you
    mean ``--max-concurrent-requests``?)."""

    def format_usage(self) -> str:  # what an error prints first: not every flag's usage (22 lines) before it
        return f"usage: {self.prog} [options]   ({self.prog} --help lists them)\n"

    def error(self, message: str) -> None:  # type: ignore[override] - exits 2, as argparse's
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flags = [flag for action in self._actions for flag in action.option_strings]
            words = message[len(prefix):].split()
            words = words[:words.index("--")] if "--" in words else words  # after "--": positionals, not flags
            near = {word: match[0] for word in dict.fromkeys(words) if word.startswith("--")
                    for match in [difflib.get_close_matches(word.split("=", 1)[0], flags, 1)] if match}
            if len(near) == 1:
                message += f" (did you mean {next(iter(near.values()))}?)"
            elif near:
                message += f" (did you mean {', '.join(f'{flag} for {word}' for word, flag in near.items())}?)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="advantage-server", description="gRPC service computing RL advantages.",
                   epilog="Each flag, its default and what happens past each limit: docs/server-flags.md; the "
                          "admission model and the memory bound: RELIABILITY.md.")
    p.add_argument("--host", type=host_name, default="0.0.0.0", help="address to listen on (default 0.0.0.0; [::] for IPv6)")
    p.add_argument("--port", type=port_number, default=50051, help="port (default 50051; 0 = pick a free one)")
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (GPU if present), cpu, cuda or cuda:N (default auto)")
    p.add_argument("--max-message-mb", type=positive_int, default=DEFAULT_MAX_MESSAGE_MB,
                   help=f"largest request/response in MiB (default {DEFAULT_MAX_MESSAGE_MB})")
    p.add_argument("--max-stream-mb", type=positive_int, default=DEFAULT_MAX_STREAM_MB,
                   help=f"largest request through ComputeAdvantageStream in MiB (default {DEFAULT_MAX_STREAM_MB})")
    p.add_argument("--max-batch-elements", type=positive_int, default=DEFAULT_MAX_BATCH_ELEMENTS,
                   help=f"most elements in any one input tensor (default {DEFAULT_MAX_BATCH_ELEMENTS})")
    p.add_argument("--max-concurrent-requests", type=positive_int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                   help="ComputeAdvantage calls in progress at once; more are refused with RESOURCE_EXHAUSTED "
                        f"(default {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    p.add_argument("--workers", type=positive_int, default=DEFAULT_WORKERS,
                   help=f"calls computing at once; other admitted calls wait for one (default {DEFAULT_WORKERS})")
    p.add_argument("--stream-idle-timeout", type=seconds(allow_zero=False), default=DEFAULT_STREAM_IDLE_TIMEOUT,
                   help="seconds an admitted call may wait for request bytes (between a stream's chunks; a unary "
                        "request in full); a stalled upload is then cut with RESOURCE_EXHAUSTED and its place "
                        f"and memory freed (default {DEFAULT_STREAM_IDLE_TIMEOUT:g})")
    p.add_argument("--min-upload-rate-kib", type=non_negative_int, default=DEFAULT_MIN_UPLOAD_RATE_KIB,
                   help="KiB per second a streamed upload (ComputeAdvantageStream) must average over each "
                        "--upload-rate-window once it has lasted that long; a slower one is cut with "
                        "RESOURCE_EXHAUSTED and its place and memory freed (default "
                        f"{DEFAULT_MIN_UPLOAD_RATE_KIB}, i.e. 1 MiB/s; 0 = no minimum)")
    p.add_argument("--upload-rate-window", type=seconds(allow_zero=False), default=DEFAULT_UPLOAD_RATE_WINDOW,
                   help="seconds the upload rate is averaged over, and the grace before its first check "
                        f"(default {DEFAULT_UPLOAD_RATE_WINDOW:g})")
    p.add_argument("--stream-window-mb", type=non_negative_int, default=DEFAULT_STREAM_WINDOW_MB,
                   help="MiB of HTTP/2 stream window the server announces, fixed: the most of its body gRPC receives "
                        "for a call waiting for a place (the memory bound's 2 x C x F term); 0 = gRPC's BDP "
                        "auto-tuning (faster uploads over a long round trip, memory unbounded by any flag; "
                        f"default {DEFAULT_STREAM_WINDOW_MB})")
    p.add_argument("--max-shm-regions-per-client", type=positive_int, default=DEFAULT_MAX_SHM_REGIONS_PER_CLIENT,
                   help="shared-memory regions one client connection may hold registered; more are refused with "
                        "RESOURCE_EXHAUSTED (default "
                        f"{DEFAULT_MAX_SHM_REGIONS_PER_CLIENT}; the server holds 256 in all)")
    p.add_argument("--max-pending-per-peer", type=positive_int, default=None,
                   help="the host share of the places held by calls waiting for their request body: when the server "
                        "is full, a newcomer whose host holds fewer takes a place back from a host holding more "
                        "(its most stalled upload is cut, RESOURCE_EXHAUSTED); max-min fair between hosts, then "
                        "connections (default: max(1, --max-concurrent-requests // 4))")
    p.add_argument("--ipv6-host-prefix", type=prefix_length, default=64,
                   help="IPv6 clients count as one host per prefix of this length, for the fair shares (default 64; "
                        "56 where each customer holds a /56; 128: every address is a host)")
    p.add_argument("--max-pending-per-connection", type=positive_int, default=None,
                   help="the connection share inside one host, the same way (default: --max-pending-per-peer's value)")
    p.add_argument("--max-connections-per-host", type=positive_int, default=None,
                   help="open connections one client host may hold (default a quarter of the server's connection "
                        "limit, at least 64): past it, its idle connections are closed and its new ones dropped for "
                        "1-16 s (docs/server-flags.md). Behind a proxy or NAT every client is one host: raise it there")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: mutual TLS, clients must present a certificate it signed")
    p.add_argument("--auth-token-file", help="file holding a bearer token every call but health checks must carry")
    p.add_argument("--grace", type=seconds(allow_zero=True, maximum=MAX_GRACE_S), default=10.0,
                   help="seconds in-flight calls get on shutdown, at most 86400 (default 10); the process exits "
                        "within --grace + 5 s of SIGTERM whatever is still running")
    p.add_argument("--log-level", type=log_level, default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--log-format", default="text", choices=logs.FORMATS,
                   help="text, or json: one object per line with the call's request_id, method and estimator "
                        "(default text)")
    p.add_argument("--metrics-port", type=port_number, help="serve Prometheus metrics over HTTP on this port "
                                                    "(GET /metrics; 0 = any free port; default: off)")
    p.add_argument("--metrics-host", type=host_name, default="127.0.0.1",
                   help="address the metrics port listens on (default 127.0.0.1: plain HTTP without TLS or token, "
                        "so only this host sees it; 0.0.0.0 for a Prometheus that scrapes over the network)")
    p.add_argument("--health-port", type=port_number, help="also serve grpc.health.v1 in plaintext on this port, for "
                                                   "kubelet gRPC probes of a TLS server (0 = any free port; "
                                                   "default: off)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="report SERVING without first loading or compiling the CPU kernels (by default every "
                        "kernel signature is loaded from numba's cache (NUMBA_CACHE_DIR, else beside the package), or "
                        "compiled, while health "
                        "says NOT_SERVING: 0.5-0.9 s with a filled cache (about 2.2 s from process start to SERVING), "
                        "20-40 s with an empty one on 2 cores; "
                        "the start-up log says how long it took). For tests; a first call may then wait seconds for "
                        "a compile. "
                        "ADVANTAGE_WARMUP=0 in the environment makes --no-warmup the default (the test suite sets "
                        "it for the servers it starts)")
    p.set_defaults(warmup=os.environ.get("ADVANTAGE_WARMUP", "1").strip() != "0")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage and what is wrong with the flag (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    logs.configure(args.log_level, args.log_format)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's Python stack on stderr (a stuck server)
        try:  # the process's own stderr (fd 2): sys.stderr may be a stream without a file descriptor (in tests)
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
        except (AttributeError, ValueError, OSError):  # no usable stderr at all: no dump, the server still runs
            pass
    try:
        # host resolves to this machine, ports free, TLS pair parses and matches: each cause named (not
        # gRPC's one "cannot bind"), before torch is imported
        from advantage_server.auth import load_token
        from advantage_server.preflight import check_server_flags
        check_server_flags(args)
        from advantage_server.identity import set_ipv6_host_prefix
        set_ipv6_host_prefix(args.ipv6_host_prefix)
        token = load_token(args.auth_token_file) if args.auth_token_file else None
        from advantage_server.server import create_server
        server = create_server(args.host, args.port, args.device,
                               max_message_mb=args.max_message_mb, max_stream_mb=args.max_stream_mb,
                               workers=args.workers,
                               max_batch_elements=args.max_batch_elements,
                               max_concurrent_requests=args.max_concurrent_requests,
                               stream_idle_timeout=args.stream_idle_timeout,
                               min_upload_rate_kib=args.min_upload_rate_kib,
                               upload_rate_window=args.upload_rate_window,
                               max_shm_regions_per_client=args.max_shm_regions_per_client,
                               max_pending_per_peer=args.max_pending_per_peer,
                               max_pending_per_connection=args.max_pending_per_connection,
                               max_connections_per_host=args.max_connections_per_host,
                               stream_window_mb=args.stream_window_mb,
                               tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                               auth_token=token, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                               health_port=args.health_port, warmup=args.warmup)
        del token
    except (RuntimeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    # A flag, not an Event: the handler runs in the main thread, between two bytecodes of whatever it is doing, and
    # Event.set() takes the lock that the main thread's own Event.wait() may hold at that moment (a deadlock seen on
    # CI: SIGTERM ignored for ever). stop_warmup is only read (is_set) while the main thread warms up.
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)
        server.stop_warmup.set()  # a SIGTERM during the warm-up ends it at its next call (it can take 30+ s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server.start()
    # what is alive now (modules, kernels, the warm-up's caches) lives as long as the process: out of the cyclic
    # collector's way, a full collection (the memory trimmer's, after a burst) takes microseconds instead of
    # ~0.1 s holding the GIL (measured: bench unread-results, where the trimmer ran about once a second)
    gc.collect()
    gc.freeze()
    security = ("mutual TLS" if args.tls_client_ca else "TLS" if server.tls else "plaintext") + \
        (", bearer token" if server.auth else "")
    # Each start-up line once, through the log (stderr, text or JSON); "listening on ADDRESS device=DEVICE"
    # and "metrics/health on port N" are what scripts wait for. Not after a signal that came during the warm-up:
    # the server shuts down at once, and a script waiting for the line would call a server that is leaving
    # (a fresh-clone newcomer's finding)
    if not stopping:
        log.info("advantage-server listening on %s device=%s (%d workers, max %d concurrent requests, %s)",
                 server.address, server.core.device, args.workers, args.max_concurrent_requests, security)
        if server.metrics is not None and server.metrics.port is not None:
            log.info("advantage-server metrics on port %d (Prometheus: http://%s:%d/metrics)", server.metrics.port,
                     args.metrics_host, server.metrics.port)
        if args.health_port is not None:
            from advantage_server.metrics import HealthPort
            port = next(e.port for e in server.endpoints if isinstance(e, HealthPort))
            log.info("advantage-server health on port %d (plaintext grpc.health.v1 on %s)", port, args.host)
    while not stopping:  # the drain begins within 50 ms of the signal (a short call is still in flight)
        time.sleep(0.05)
    exit_watchdog(args.grace + EXIT_MARGIN_S)  # the exit is promised within --grace + 5 s of the signal
    log.info("shutting down: health NOT_SERVING, new calls UNAVAILABLE, finishing in-flight calls (grace %.1fs)",
             args.grace)
    server.stop(args.grace)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _health_hint(code: object, details: str, args: argparse.Namespace) -> str:
    """What ``advantage-healthcheck`` prints after "unhealthy: " when its Check fails: the problem at
    ``args.address`` first, what to check, then gRPC's code and text (kept: they name the resolved address)."""
    name = getattr(code, "name", str(code))
    grpc_text = f"(gRPC {name}: {details})"
    low = details.lower()
    tls = bool(args.tls_ca or args.tls_cert or args.tls_key)
    if name == "UNAVAILABLE" and ("handshake" in low or "ssl" in low or "socket closed" in low
                                  or "http/2" in low or "settings frame" in low):
        fix = ("the server runs plaintext: drop --tls-ca/--tls-cert/--tls-key" if tls else
               "a server started with --tls-cert needs --tls-ca (and --tls-cert/--tls-key for mutual TLS)")
        return (f"the server at {args.address} did not complete a {'TLS' if tls else 'plaintext'} gRPC "
                f"handshake: {fix}; or --address names a port that is not advantage-server's gRPC port "
                f"{grpc_text}")
    if name == "UNAVAILABLE":
        return (f"no server is reachable at {args.address}: check that advantage-server is running (its log says "
                "'advantage-server listening on ADDRESS'), that --address names that host and its gRPC port "
                "(default 50051; the Docker image's health-only port is 50052), and that no firewall or "
                f"network policy is in the way {grpc_text}")
    if name == "DEADLINE_EXCEEDED":
        return (f"no answer from {args.address} within --timeout {args.timeout:g} s: the address may drop "
                "packets (a firewall, a wrong host), or the server is too busy to answer its health service; "
                f"check the address, or pass a larger --timeout {grpc_text}")
    if name == "UNIMPLEMENTED":
        return (f"the server at {args.address} has no grpc.health.v1 Health service: --address names another "
                f"service's port, not advantage-server's {grpc_text}")
    if name == "NOT_FOUND":
        return (f"the server at {args.address} knows no service {args.service!r}: leave --service out to check "
                f"the whole server, or give 'advantage.v1.AdvantageService' {grpc_text}")
    return f"{name}: {details}"


def healthcheck_main(argv: list[str] | None = None) -> int:
    """``advantage-healthcheck [--address HOST:PORT]``: exit 0 if the server reports SERVING, else 1.

    Uses the standard ``grpc.health.v1.Health/Check`` (for a container HEALTHCHECK or a probe script).
    Health needs no bearer token; a TLS server needs ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for
    mutual TLS).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    p = argparse.ArgumentParser(prog="advantage-healthcheck", description=healthcheck_main.__doc__.splitlines()[0])
    p.add_argument("--address", default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    p.add_argument("--service", default="", help="service name to check (default: the whole server)")
    p.add_argument("--timeout", type=seconds(allow_zero=False), default=3.0, help="seconds (default 3)")
    p.add_argument("--tls-ca", help="PEM CA bundle that signed the server's certificate: connect with TLS")
    p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    args = p.parse_args(argv)
    url = re.match(r"(?i)[a-z][a-z0-9+.-]*://([^/]*)", args.address)
    if url and not args.address.lower().startswith(("dns:", "unix:")) or re.search(r":\d+/", args.address):
        bare = url.group(1) if url else args.address.split("/", 1)[0]
        p.error(f"--address {args.address!r} is not host:port: give the address without a scheme or a path, "
                f"e.g. {bare!r}")
    if not re.search(r":\d+$", args.address) and not args.address.startswith(("unix:", "unix-abstract:", "vsock:")):
        p.error(f"--address {args.address!r} has no port: give host:port (the server's default port is 50051; "
                "the Docker image's health-only port is 50052)")
    if args.tls_ca or args.tls_cert or args.tls_key:
        from advantage_server.auth import read_pem
        try:
            creds = grpc.ssl_channel_credentials(read_pem(args.tls_ca, "--tls-ca"), read_pem(args.tls_key, "--tls-key"),
                                                 read_pem(args.tls_cert, "--tls-cert"))
        except ValueError as exc:
            print(f"unhealthy: {exc}", file=sys.stderr)
            return 1
        channel_cm = grpc.secure_channel(args.address, creds)
    else:
        channel_cm = grpc.insecure_channel(args.address)
    with channel_cm as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"unhealthy: {_health_hint(err.code(), err.details() or '', args)}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
