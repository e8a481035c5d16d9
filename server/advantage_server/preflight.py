"""Checks ``advantage-server`` runs on its flags before it builds the server (and before torch is imported).

gRPC reports a failed bind as one "cannot bind" for every cause (its own log line, above ours, holds the
real one) and a bad TLS pair as a failed bind too. These checks tell the causes apart first, each as a
``ValueError`` whose one-line message names the flag, the value and the fix:

* :func:`check_bind`: the host resolves (``socket.getaddrinfo``), it is an address of this machine, the port
  is free (a test bind of a plain socket on ``host:port``, closed at once);
* :func:`check_tls`: the PEM files can be read, the certificate and the key parse, the key is the
  certificate's (``ssl.SSLContext.load_cert_chain``), the key is not encrypted (gRPC takes no passphrase),
  the client CA bundle parses;
* :func:`check_server_flags`: both, for parsed ``advantage-server`` flags (``--host``/``--port``,
  ``--host``/``--health-port``, ``--metrics-host``/``--metrics-port``, ``--tls-*``).

Used by ``advantage-server`` (exit 2 with the message) and ``advantage-ray`` (the TLS files where ``up``
runs, the bind in each replica before its server starts). Standard library only (and
:func:`advantage_server.auth.read_pem`).
"""
from __future__ import annotations

import errno
import os
import socket
import ssl
from typing import Any

from advantage_server.auth import read_pem


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_bind(host: str, port: int, host_flag: str = "--host", port_flag: str = "--port") -> None:
    """Raise ``ValueError`` (naming ``host_flag``/``port_flag``) unless a listening socket could be bound on
    ``host:port`` now: the host does not resolve ("address lookup failed"), resolves to no address of this
    machine ("not an address of this machine"), the port is taken ("the port is in use") or needs privileges.

    ``host``: a name, an IPv4 or IPv6 address (``[::]`` brackets allowed) or ``""``/``0.0.0.0``/``::`` (every
    address); ``port``: 0 to 65535, 0 = any free port (then only the host is checked). The test socket has
    ``SO_REUSEADDR`` (a port whose old connections linger in TIME_WAIT is free, as for gRPC) and is closed
    at once; the host is fine when any of its addresses binds (as gRPC binds every address a name has).
    """
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    where = _address(host, port)
    try:
        infos = socket.getaddrinfo(name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ValueError(f"{host_flag} {host}: address lookup failed ({reason}): give an IP address of this "
                         "machine, a name that resolves to one, or 0.0.0.0 (every IPv4 address)") from None
    first: OSError | None = None
    for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
            return
        except OSError as exc:
            first = first or exc
    if first is None:  # pragma: no cover - getaddrinfo returns at least one address or raises
        raise ValueError(f"{host_flag} {host}: address lookup failed (no address)")
    code = first.errno
    if code == errno.EADDRNOTAVAIL:
        raise ValueError(f"{host_flag} {host}: not an address of this machine (cannot bind {where}): give one "
                         "of its addresses, 127.0.0.1 (this machine only) or 0.0.0.0 (every IPv4 address)")
    if code == errno.EADDRINUSE:
        raise ValueError(f"{port_flag} {port}: cannot bind {where}: the port is in use (another process "
                         f"listens on it): stop that process, or give another {port_flag} (0 = any free port)")
    if code == errno.EACCES:
        raise ValueError(f"{port_flag} {port}: cannot bind {where}: permission denied (a port below 1024 needs "
                         f"root or CAP_NET_BIND_SERVICE): give {port_flag} 1024 or above")
    if code == errno.EAFNOSUPPORT:
        raise ValueError(f"{host_flag} {host}: cannot bind {where}: this machine has no "
                         f"{'IPv6' if ':' in name else 'IPv4'}: give an address of the other family")
    raise ValueError(f"{host_flag} {host} {port_flag} {port}: cannot bind {where}: "
                     f"{first.strerror or first}")


def check_tls(cert: str | os.PathLike | None, key: str | os.PathLike | None,
              client_ca: str | os.PathLike | None = None) -> None:
    """Raise ``ValueError`` naming the flag (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``) when a PEM
    file given by path cannot be read, is not PEM of its kind, the key is encrypted, or the key is not the
    certificate's, or only one half of the pair is given (checked first: a usage error before any file)."""
    if (cert is None) != (key is None):
        raise ValueError("TLS needs both --tls-cert and --tls-key" + (" (--tls-key is missing)" if key is None
                                                                       else " (--tls-cert is missing)"))
    for value, flag in ((cert, "--tls-cert"), (key, "--tls-key"), (client_ca, "--tls-client-ca")):
        if value is not None:
            read_pem(value, flag)  # ValueError "--flag: cannot read PATH: reason"
    if cert is not None and key is not None:
        asked: list[bool] = []

        def password() -> bytes:  # called by OpenSSL only for an encrypted key (never prompt on a terminal)
            asked.append(True)
            return b""

        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=password)
        except ssl.SSLError as exc:
            if asked:
                raise ValueError(f"--tls-key {key}: the key is encrypted; gRPC needs it unencrypted "
                                 f"(openssl pkey -in {key} -out KEY.pem, then --tls-key KEY.pem)") from None
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ValueError(f"--tls-key {key}: it is not the private key of --tls-cert {cert} (the pair "
                                 "does not match): give the key the certificate was issued for") from None
            if not _holds_certificates(cert):
                raise ValueError(f"--tls-cert {cert}: not a PEM certificate chain (no '-----BEGIN CERTIFICATE"
                                 "-----' block that parses)") from None
            raise ValueError(f"--tls-key {key}: not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----' "
                             "block that parses)") from None
    if client_ca is not None and not _holds_certificates(client_ca):
        raise ValueError(f"--tls-client-ca {client_ca}: not a PEM CA bundle (no '-----BEGIN CERTIFICATE-----' "
                         "block that parses)")


def _holds_certificates(path: str | os.PathLike) -> bool:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
        return True
    except (ssl.SSLError, ValueError):
        return False


def check_server_flags(args: Any, bind: bool = True) -> None:
    """:func:`check_tls` and (``bind``) :func:`check_bind` for parsed ``advantage-server`` flags (an
    ``argparse.Namespace`` of ``advantage_server.cli.build_parser``): the server's port, the health port and
    the metrics port. Raises the first ``ValueError``."""
    check_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    if bind:
        check_bind(args.host, args.port)
        if args.health_port is not None:
            check_bind(args.host, args.health_port, port_flag="--health-port")
        if args.metrics_port is not None:
            check_bind(args.metrics_host, args.metrics_port, "--metrics-host", "--metrics-port")
