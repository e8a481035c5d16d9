"""How the client connects: one or several replicas, TLS, a bearer token, load balancing and retries.

* ``channel_target(["10.0.0.1:50051", "10.0.0.2:50051"])`` -> ``"ipv4:10.0.0.1:50051,10.0.0.2:50051"``: gRPC
  connects to every replica; a DNS name (``"dns:///advantage.svc:50051"``) whose name resolves to several
  addresses does the same. A target must name its port (:func:`check_target`: ``"localhost"`` is a
  ``TargetError``, a ``ValueError``, not a dial to port 443), and one gRPC can dial: ``"localhost:50051/"``,
  ``"localhost:abc"`` and ``"localhost:99999"`` are ``TargetError`` when the client is made, not a failed
  first call.
* :func:`service_config`: ``round_robin`` over the replicas that are up and report SERVING (client-side
  health checking: a draining replica leaves the rotation as soon as it says NOT_SERVING; a server says so only
  while warming up or draining, never for being full; one that keeps no more health ``Watch`` streams answers
  UNIMPLEMENTED, which gRPC takes as "healthy"), and a retry
  policy: a call that fails with UNAVAILABLE (replica killed, restarting, draining) or CANCELLED by the
  server (a draining server's gRPC drops the calls it had queued but not started) is retried, with
  exponential backoff, up to 5 attempts in all; a call the caller cancelled is never retried. The service is
  stateless and deterministic, so a retry gives the same result.
* :func:`make_channel`: plaintext, or TLS with a CA bundle and, for mutual TLS, a client certificate.
* :func:`auth_metadata`: ``authorization: Bearer <token>`` sent with every call.
* :data:`KEEPALIVE_OPTIONS`: an HTTP/2 PING every 2 s on every connection, a connection whose PING is not
  answered within 2 s fails: a hung replica (a SIGSTOPped or wedged process keeps its TCP connection) is found
  within about 4 s, the calls on it end UNAVAILABLE and leave the rotation with it, whatever the call's deadline
  (a healthy slow call answers PINGs and runs to its deadline). The server permits PINGs that often.
* :func:`replica_count`: how many replicas a target names (a list: its length; a DNS name: the addresses it
  resolves to, loopback addresses counted as one), which decides where the clients fail over to
  (``advantage_client.client.Failover``): an admission refusal (RESOURCE_EXHAUSTED with the server's retry
  pushback) is sent again after the pushback, to the same replica when there is one, else to another; with
  several, an attempt whose connection failed (UNAVAILABLE after gRPC's own retries) is sent once more through
  the round_robin picker, which no longer holds the failed connection. Every attempt has the whole deadline
  left: there is no blind resend after a share of the deadline, so a healthy slow call runs once.
"""
from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import re
import socket
import threading
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

import grpc

SERVICE_NAME = "advantage.v1.AdvantageService"

#: retried: UNAVAILABLE (no server answered, or it is shutting down) and CANCELLED (a status from the server: gRPC
#: retries only statuses the server sent, never the caller's own cancel; a shutting-down server's gRPC cancels the
#: calls it had queued, see ``advantage_server.server.BoundServer.stop``); gRPC caps maxAttempts at 5.
RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
}


#: HTTP/2 keepalive: a PING every 2 s on each connection, with or without calls open, and no cap on PINGs while
#: no data flows; one not answered within 2 s fails the connection (gRPC 1.85 applies
#: ``grpc.http2.ping_timeout_ms``, default 60 s, to a keepalive PING's answer: without it a call on a hung replica
#: ran to its 20 s deadline), so the calls on a hung replica (a stopped or wedged process, whose kernel still holds
#: the TCP connection) end UNAVAILABLE within about 4 s (measured: 2.4 s at most over 20 calls, two replicas, one
#: SIGSTOPped) and gRPC's retry policy or ``advantage_client.client.Failover`` sends them to another replica; a
#: healthy slow call is answered PINGs by the server's gRPC threads and runs to its deadline. The server permits
#: PINGs this often (``advantage_server.server``'s keepalive options); a server that does not answers GOAWAY
#: "too_many_pings" and gRPC then doubles the client's interval.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", 2_000),
)


def service_config(retry: bool = True, wait_for_ready: bool = False, health_check: bool = True) -> dict[str, Any]:
    """The gRPC service config the client uses (see the module docstring)."""
    method: dict[str, Any] = {"name": [{"service": SERVICE_NAME}]}
    if retry:
        method["retryPolicy"] = RETRY_POLICY
    if wait_for_ready:
        method["waitForReady"] = True
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [method]}
    if health_check:
        config["healthCheckConfig"] = {"serviceName": SERVICE_NAME}
    return config


#: the port ``advantage-server`` listens on by default (``--port``)
DEFAULT_PORT = 50051
#: the environment variable the verl drop-in reads its target from (``advantage_client.verl``)
TARGET_ENV = "ADVANTAGE_SERVICE_TARGET"
#: a PEM file: the CA that signed the server's certificate (TLS on), for clients the framework adapters build
TLS_CA_ENV = "ADVANTAGE_SERVICE_TLS_CA"
#: a file holding the bearer token sent with every call, for clients the framework adapters build
TOKEN_FILE_ENV = "ADVANTAGE_SERVICE_TOKEN_FILE"
DEFAULT_TARGET = "localhost:50051"
#: the variables a framework's Ray workers need to reach the service, forwarded to them by the launchers
#: (``python -m advantage_client.openrlhf``, ``python -m advantage_client.skyrl``: :func:`forward_to_ray_workers`)
FORWARDED_ENV = (TARGET_ENV, TLS_CA_ENV, TOKEN_FILE_ENV)


def ray_job_runtime_env() -> dict:
    """The runtime environment of the Ray job this process is the driver of (``ray job submit
    --runtime-env-json``: Ray hands it to the driver in ``$RAY_JOB_CONFIG_JSON_ENV_VAR``), else empty."""
    try:
        return dict(json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("runtime_env") or {})
    except (ValueError, AttributeError, TypeError):
        return {}


def forward_to_ray_workers(runtime_env: Mapping[str, Any] | None, job: Mapping[str, Any] | None = None) -> dict:
    """``runtime_env`` (a Ray runtime environment, as a framework passes it to ``ray.init``; None: empty) with this
    process's :data:`FORWARDED_ENV` variables added to its ``env_vars``, so every worker of the job, on every node,
    gets them (those it already sets are kept). ``job``: the Ray job's own runtime environment
    (:func:`ray_job_runtime_env`); Ray refuses a ``ray.init`` that repeats one of its variables, so a variable the
    job already gives is not added again."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    given = set((job or {}).get("env_vars") or {})
    for key in FORWARDED_ENV:
        if os.environ.get(key) and key not in given:
            env_vars.setdefault(key, os.environ[key])
    if env_vars:
        env["env_vars"] = env_vars
    return env


def settings_from_environment(target: Any = None, tls_ca: str | None = None,
                              token_file: str | None = None) -> tuple[Any, str | None, str | None]:
    """``(target, tls_ca, token_file)`` for a client a framework adapter builds (verl, TRL, AReaL, SkyRL): each
    argument left None comes from ``$ADVANTAGE_SERVICE_TARGET`` (a comma-separated string is a list of
    replicas; default ``localhost:50051``), ``$ADVANTAGE_SERVICE_TLS_CA`` (a PEM file turns TLS on) and
    ``$ADVANTAGE_SERVICE_TOKEN_FILE`` (its bearer token is sent); empty values count as unset."""
    if target is None:
        target = replica_list(os.environ.get(TARGET_ENV, "").strip() or DEFAULT_TARGET)
    return target, tls_ca or os.environ.get(TLS_CA_ENV) or None, token_file or os.environ.get(TOKEN_FILE_ENV) or None


def replica_list(target: Any) -> Any:
    """A comma-separated string (``"10.0.0.1:50051,10.0.0.2:50051"``, as an environment variable gives replicas) as
    the list of its addresses; any other ``target`` as given."""
    if isinstance(target, str) and "," in target:
        return [t.strip() for t in target.split(",") if t.strip()]
    return target


#: gRPC target schemes whose addresses carry no port (a socket path, an abstract name) or a port of their own
#: syntax (``vsock:cid:port``): passed on as given
_PORTLESS_SCHEMES = ("unix:", "unix-abstract:", "vsock:")
#: another resolver's URI (``xds:///name``, a resolver registered by the application): passed on as given
_OTHER_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


class TargetError(ValueError):
    """A target the client cannot dial: no port (gRPC would dial port 443 and report that nothing answered),
    not a string, or replicas that are not IP:PORT. Raised by the clients' constructors."""


_URL_SCHEME = re.compile(r"(?i)(https?|grpcs?)://")


def _no_url_scheme(address: str) -> str:
    """``ValueError`` for a URL (``http://host:port``): gRPC reads it as a DNS name and fails much later with
    "Misformatted domain name"."""
    match = _URL_SCHEME.match(str(address))
    if match:
        rest = str(address)[match.end():].rstrip("/")
        raise TargetError(f"target {address!r}: drop the {match.group(1).lower()}:// scheme and give host:port, "
                          f"e.g. {rest!r}; a gRPC target is not a URL (for TLS pass tls=True or tls_ca=)")
    return address


def _named(address: str) -> str:
    """How an error names ``address``: with the environment variable when that is where it came from."""
    if os.environ.get(TARGET_ENV, "").strip() == address.strip():
        return f"${TARGET_ENV}={address!r}"
    return repr(address)


def _no_port(address: str, example: str) -> TargetError:
    return TargetError(f"target {_named(address)} has no port: give host:port (the server's default port is "
                       f"{DEFAULT_PORT}), e.g. {example!r}")


def _check_port(port: str, host: str, whole: str, prefix: str) -> None:
    """``TargetError`` for a port gRPC cannot dial: one followed by a path (``localhost:50051/``, gRPC's
    "Failed to parse port" at the first call), one beyond 65535 (gRPC dials it modulo 65536: 99999 -> 34463),
    or a name that is not a TCP service of this host (``/etc/services``; ``localhost:http`` is port 80)."""
    if "/" in port:
        number = port.partition("/")[0]
        fix = f"'{prefix}{host}:{number}'" if number else f"'{prefix}{host}:{DEFAULT_PORT}'"
        raise TargetError(f"target {_named(whole)} has a path after the port: a gRPC target is host:port and "
                          f"nothing after it; give {fix}")
    if port.strip().isdigit():  # gRPC strips the blanks
        if not 0 < int(port) < 65536:
            raise TargetError(f"target {_named(whole)}: port {port} is not a TCP port (1-65535); give the port "
                              f"advantage-server listens on, e.g. '{prefix}{host}:{DEFAULT_PORT}'")
        return
    try:
        socket.getservbyname(port, "tcp")
    except OSError:
        raise TargetError(f"target {_named(whole)}: port {port!r} is not a number; give host:port with the port "
                          f"advantage-server listens on, e.g. '{prefix}{host}:{DEFAULT_PORT}'") from None


def _host_port(address: str, whole: str, prefix: str = "") -> None:
    """``TargetError`` when ``address`` (``host:port``, ``[v6]:port``; ``whole`` is the target it is part of,
    ``prefix`` what precedes it there) names no port, or one gRPC cannot dial (:func:`_check_port`)."""
    if address.startswith("["):
        host, _, rest = address.partition("]")
        if not rest.startswith(":") or not rest[1:]:
            raise _no_port(whole, f"{prefix}{host}]:{DEFAULT_PORT}")
        _check_port(rest[1:], host + "]", whole, prefix)
        return
    if address.count(":") > 1:  # a bare IPv6 literal: gRPC reads all of it as the host
        raise TargetError(f"target {_named(whole)} has no port: an IPv6 address takes brackets before the port, "
                          f"e.g. '{prefix}[{address}]:{DEFAULT_PORT}' (the server's default port is {DEFAULT_PORT})")
    host, sep, port = address.rpartition(":")
    if not sep or not port:
        raise _no_port(whole, f"{prefix}{host if sep else address}:{DEFAULT_PORT}")
    _check_port(port, host, whole, prefix)


def check_target(target: str) -> str:
    """``target`` as given when it names a port, else ``TargetError`` (a ``ValueError``) saying how to give one.

    Accepted: ``host:port``, ``[::1]:50051``, ``dns:///name:port`` (also ``dns://authority/name:port``,
    ``dns:name:port``), ``ipv4:a:p,b:p`` / ``ipv6:[a]:p,[b]:p``, and, as given, ``unix:``/``unix-abstract:``
    (no port) and ``vsock:`` targets and any other resolver's URI (``scheme:/...``). Refused: a target without
    a port (``"localhost"``, ``"dns:///localhost"``, ``"ipv4:127.0.0.1"``, a bare ``"::1"``: gRPC would dial
    port 443), one gRPC cannot dial (a path after it, ``"localhost:50051/"``; beyond 65535; a name that is no
    TCP service of this host: :func:`_check_port`), an empty one, and a URL (``http://host:port``, see
    :func:`_no_url_scheme`)."""
    address = _no_url_scheme(target).strip()
    if not address:
        raise TargetError(f"target {target!r} is empty: give host:port, e.g. 'localhost:{DEFAULT_PORT}'")
    low = address.lower()
    if low.startswith(_PORTLESS_SCHEMES):
        return target
    if low.startswith("dns:"):
        rest = address[4:]
        if rest.startswith("//"):  # dns://[authority]/name:port
            _, _, rest = rest[2:].partition("/")
        _host_port(rest, target, address[:len(address) - len(rest)])
        return target
    if low.startswith(("ipv4:", "ipv6:")):
        for part in address[5:].split(","):
            _host_port(part.strip(), target, address[:5])
        return target
    if _OTHER_URI.match(address):
        return target
    _host_port(address, target)
    return target


def _not_a_string(target: Any) -> TargetError:
    example = (f"'localhost:{target}'" if isinstance(target, int) and not isinstance(target, bool)
               and 0 < target < 65536 else f"'localhost:{DEFAULT_PORT}'")
    return TargetError(f"target={target!r} ({type(target).__name__}): give 'host:port' as a string, e.g. "
                       f"{example}, or a list of such strings for several replicas")


def channel_target(target: str | Sequence[str]) -> str:
    """A gRPC target string for one address (checked by :func:`check_target`, returned as given) or several
    replicas (IP literals, all IPv4 or all IPv6). Raises ``TargetError`` (a ``ValueError``) for a target
    without a port, one that is not a string (``50051``: give ``'localhost:50051'``) and replicas that are
    not IP:PORT; a URL (``http://host:port``) is a ``ValueError`` that says to drop the scheme."""
    if isinstance(target, str):
        return check_target(target)
    if isinstance(target, (bytes, bytearray, Mapping)) or not isinstance(target, Iterable):
        raise _not_a_string(target)
    target = list(target)
    for address in target:
        if not isinstance(address, str):
            raise _not_a_string(address)
    addresses = [_no_url_scheme(a) for a in target]
    if not addresses:
        raise TargetError("target: give at least one address")
    if len(addresses) == 1:
        return check_target(addresses[0])
    families, parts = set(), []
    for address in addresses:
        host, sep, port = str(address).rpartition(":")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if not sep or not port.isdigit() or ip is None:
            raise TargetError(f"target: {address!r} is not IP:PORT. Name several replicas by IP address "
                              "(all IPv4 or all IPv6), or pass one DNS name that resolves to all of them, "
                              "e.g. 'dns:///advantage.svc:50051'")
        families.add(ip.version)
        parts.append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    if len(families) != 1:
        raise TargetError("target: replicas must be all IPv4 or all IPv6 addresses")
    return f"ipv{families.pop()}:{','.join(parts)}"


def _pem(value: bytes | str | os.PathLike | None, what: str) -> bytes | None:
    """``value`` (PEM bytes or text, or the path of a PEM file) as PEM bytes; None stays None. Raises ValueError naming
    ``what`` when the file cannot be read or holds no PEM block (gRPC would only fail the TLS handshake later, with
    "Failed to create security handshaker" and its reason in its own log)."""
    if value is None:
        return None
    if isinstance(value, str) and "-----BEGIN " in value:  # the PEM text itself, not a path (never echoed: a key)
        data, where = value.encode(), "the text given"
    elif isinstance(value, bytes):
        data, where = value, "the bytes given"
    else:
        try:
            data, where = pathlib.Path(value).read_bytes(), str(value)
        except OSError as exc:
            where = str(value)
            if len(where) >= 256 or "\n" in where:  # not a file name: never echoed (it may be a key)
                where = "the text given (not a file name, nor PEM)"
            raise ValueError(f"{what}: cannot read {where}: {exc.strerror}") from None
        except TypeError:
            raise ValueError(f"{what}: give PEM bytes or the path of a PEM file, not {type(value).__name__}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {where} holds no PEM block ('-----BEGIN ...'): give a PEM-encoded "
                         + ("private key" if what == "tls_key" else "certificate") + " (convert DER with openssl x509 "
                         "-inform der)")
    if what != "tls_key" and b"-----BEGIN CERTIFICATE-----" not in data:
        # a private key (or a CSR) where a certificate belongs: gRPC would print its core's errors, then refuse
        kind = "a private key" if b"PRIVATE KEY-----" in data else "no certificate"
        raise ValueError(f"{what}: {where} holds {kind}, not a certificate ('-----BEGIN CERTIFICATE-----'): "
                         + ("give the CA certificate that signed the server's (e.g. ca.pem), not a key"
                            if what == "tls_ca" else "give the client's certificate; its key goes in tls_key"))
    if what == "tls_key" and b"PRIVATE KEY-----" not in data:
        raise ValueError(f"{what}: {where} holds no private key ('-----BEGIN ... PRIVATE KEY-----'): give the "
                         "client certificate's private key; the certificate goes in tls_cert")
    return data


def auth_metadata(token: str | None = None, token_file: str | os.PathLike | None = None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying a bearer token (empty without one). The token never appears in errors."""
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    if token_file is not None:
        try:
            token = pathlib.Path(token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"token_file {token_file}: cannot read it ({type(exc).__name__})") from None
        if not token:
            raise ValueError(f"token_file {token_file}: the file is empty")
    if token is not None and not isinstance(token, str):
        raise ValueError(f"token: give the bearer token as a str (or token_file=, a file holding it), not "
                         f"{type(token).__name__}")
    if token is None or not token.strip():  # an empty token counts as unset (as the environment's do)
        return ()
    stripped = token.strip()
    if os.path.isfile(os.path.expanduser(stripped)):  # a path, or a bare name of a file here ("token")
        # a file's path given as the token (issue #37 item 6): the server would answer "missing or wrong bearer
        # token" with no hint; the path is no secret, the file's contents are never read or shown here
        raise ValueError(f"token={stripped!r} names a file: token= is the bearer token itself; pass "
                         f"token_file={stripped!r} to read the token from that file")
    return (("authorization", f"Bearer {stripped}"),)


class PlaintextTokenWarning(UserWarning):
    """A bearer token is about to travel unencrypted to a host that is not this one (see :func:`warn_plaintext_token`)."""


def _plaintext_hosts(target: str) -> list[str]:
    """The hosts of ``target`` (a :func:`channel_target` string) a plaintext call would leave this machine for:
    every host that is not ``localhost``, a loopback address or a unix socket. No DNS look-up."""
    if target.startswith(("unix:", "unix-abstract:")):
        return []
    hosts = []
    scheme = target.strip()[:5].lower()
    ones = [f"{scheme}{a.strip()}" for a in target.strip()[5:].split(",") if a.strip()] \
        if scheme in ("ipv4:", "ipv6:") else [target]
    for one in ones:
        address = one.strip()
        if address.lower().startswith(("ipv4:", "ipv6:")):
            address = address[5:]
        elif address.lower().startswith("dns:"):
            address = address[4:]
            if address.startswith("//"):
                address = address[2:].partition("/")[2]
        host = address.rpartition(":")[0] if ":" in address.strip("[]") or address.startswith("[") else address
        host = host.strip("[]").split("%")[0]
        if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
            continue
        try:
            address_ = ipaddress.ip_address(host)
            if address_.is_loopback or address_.is_unspecified:  # 0.0.0.0 / :: reach this machine
                continue
        except ValueError:
            pass
        hosts.append(host or one)
    return hosts


def warn_plaintext_token(target: str, metadata: Sequence[tuple[str, str]], tls: bool, stacklevel: int = 3) -> None:
    """Warn (:class:`PlaintextTokenWarning`) when a client holding a bearer token (``metadata``) talks plaintext
    (``tls`` False) to a host that is not this machine: anyone on the path reads the token. A newcomer's finding
    (issue #37): nothing said so. Loopback and unix sockets stay quiet; so does a channel the caller made."""
    if not metadata or tls:
        return
    hosts = _plaintext_hosts(target)
    if hosts:
        warnings.warn(f"the bearer token will travel unencrypted (plaintext channel) to {', '.join(hosts)}: anyone "
                      "on the network path can read it; give tls_ca= (the server's --tls-cert CA; docs/tls.md) "
                      "or tls=True, or for a framework drop-in set $ADVANTAGE_SERVICE_TLS_CA", PlaintextTokenWarning,
                      stacklevel=stacklevel)


def make_channel(target: str, *, max_message_mb: int = 1024, tls: bool = False,
                 tls_ca: Any = None, tls_cert: Any = None, tls_key: Any = None, tls_server_name: str | None = None,
                 retry: bool = True, wait_for_ready: bool = False, options: Sequence[tuple[str, Any]] = (),
                 retry_buffer_mb: float | None = None, aio: bool = False) -> Any:
    """A channel to ``target`` with the service config above. TLS when ``tls`` or any ``tls_*`` is given:
    ``tls_ca`` verifies the server (system roots when None); ``tls_cert`` + ``tls_key`` is the client
    certificate for mutual TLS. PEM bytes or file paths. ``options``: more gRPC channel arguments.
    ``retry_buffer_mb``: how much of a call's request gRPC keeps for a retry (default: ``max_message_mb``, so
    any unary request can be retried); a call that has sent more is no longer retried and keeps nothing.
    ``aio``: a ``grpc.aio.Channel`` (same options, service config and credentials) for asyncio, instead of
    a ``grpc.Channel``. Raises ``ValueError`` for a bad ``max_message_mb``, half a client certificate or an
    unreadable PEM file."""
    if not 1 <= max_message_mb <= 2047:
        raise ValueError(f"max_message_mb must be in [1, 2047] (gRPC's 32-bit message length), got {max_message_mb}")
    limit = max_message_mb * 1024 * 1024
    buffer = limit if retry_buffer_mb is None else max(1, int(retry_buffer_mb * 1024 * 1024))
    options = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.service_config", json.dumps(service_config(retry, wait_for_ready))),
        ("grpc.enable_retries", 1 if retry else 0),
        # a request larger than the retry buffer (256 KiB by default) would not be retried
        ("grpc.per_rpc_retry_buffer_size", buffer),
        ("grpc.retry_buffer_size", buffer),
        *KEEPALIVE_OPTIONS,
        *options,
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("mutual TLS needs both tls_cert and tls_key")
    if tls or tls_ca is not None or tls_cert is not None:
        credentials = grpc.ssl_channel_credentials(_pem(tls_ca, "tls_ca"), _pem(tls_key, "tls_key"),
                                                   _pem(tls_cert, "tls_cert"))
        return (grpc.aio if aio else grpc).secure_channel(target, credentials, options=options)
    return (grpc.aio if aio else grpc).insecure_channel(target, options=options)


#: seconds :func:`replica_count` keeps what a DNS name resolved to
DNS_COUNT_TTL_S = 30.0
_counts: dict[str, tuple[int, float]] = {}
_counts_lock = threading.Lock()


def _dns_host_port(target: str) -> tuple[str, str] | None:
    """(host, port) of a target gRPC resolves by DNS (``dns:[//authority/]host:port`` or a bare ``host:port``
    whose host is a name, not an IP literal); None for every other target."""
    address = target.strip()
    low = address.lower()
    if low.startswith("dns:"):
        address = address[4:]
        if address.startswith("//"):
            _, _, address = address[2:].partition("/")
    elif _OTHER_URI.match(address) or low.startswith((*_PORTLESS_SCHEMES, "ipv4:", "ipv6:")):
        return None
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        return None
    try:
        ipaddress.ip_address(host)
        return None  # one address
    except ValueError:
        return host, port


def cached_replica_count(target: str) -> int | None:
    """:func:`replica_count` when it needs no DNS look-up now (a list, an IP, a name resolved less than
    ``DNS_COUNT_TTL_S`` seconds ago); None when it does (the asyncio client then resolves in a thread)."""
    low = target.strip().lower()
    if low.startswith(("ipv4:", "ipv6:")):
        return len([a for a in target.strip()[5:].split(",") if a.strip()])
    if _dns_host_port(target) is None:
        return 1
    with _counts_lock:
        hit = _counts.get(target)
    return hit[0] if hit is not None and hit[1] > time.monotonic() else None


def replica_count(target: str) -> int:
    """How many replicas ``target`` (a :func:`channel_target` string) names: the addresses of an ``ipv4:``/
    ``ipv6:`` list; for a DNS name (``dns:///name:port``, ``name:port``) the distinct addresses it resolves to
    now, every loopback address counted as one (``localhost`` is 127.0.0.1 and ::1: one server), kept for
    ``DNS_COUNT_TTL_S`` seconds (a name that does not resolve counts 1); 1 for an IP address, a unix socket
    and any other resolver's URI (``xds:``: not known here). Never raises."""
    count = cached_replica_count(target)
    if count is not None:
        return count
    host, port = _dns_host_port(target) or ("", "")
    try:
        infos = socket.getaddrinfo(host, int(port) if port.isdigit() else None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        infos = []
    seen = set()
    for info in infos:
        try:
            ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        except ValueError:
            continue
        seen.add("loopback" if ip.is_loopback else str(ip))
    count = max(1, len(seen))
    with _counts_lock:
        _counts[target] = (count, time.monotonic() + DNS_COUNT_TTL_S)
    return count


def replica_targets(target: str) -> list[str]:
    """One gRPC target per replica of an ``ipv4:``/``ipv6:`` list (``"ipv4:10.0.0.1:50051,10.0.0.2:50051"`` ->
    ``["ipv4:10.0.0.1:50051", "ipv4:10.0.0.2:50051"]``): what a client uses to send a call to a replica it
    chooses (failover: the resend of an admission refusal goes to each replica in turn, not wherever the
    round_robin picker, shared with the calls of other threads, points next). Empty for any other target (a
    DNS name's addresses are the resolver's; a resend then goes through the rotation)."""
    address = target.strip()
    scheme = address[:5].lower()
    if scheme not in ("ipv4:", "ipv6:"):
        return []
    parts = [a.strip() for a in address[5:].split(",") if a.strip()]
    return [f"{scheme}{a}" for a in parts] if len(parts) > 1 else []
