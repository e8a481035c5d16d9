"""Who is calling: the one place the server names a call's connection, host and standing.

The admission model (RELIABILITY.md, "The admission model") asks three questions and answers each once:
*who* is calling (this module), *what they are owed* (:mod:`advantage_server.shares`: places, Watch streams,
regions) and *whether the replica is alive* (:mod:`advantage_server.health_service`). Here:

* **connection**: the call's peer as gRPC names it (:func:`call_peer`: ``ipv4:10.0.0.7:51234``); every call of
  one client channel's connection has the same one.
* **host**: the machine a connection comes from (:func:`peer_host`), the unit of fairness between machines:
  an IPv4 address; every IPv4 loopback address (``127.0.0.0/8``) is this machine, one host; an IPv6 address
  counts by its /64 prefix (the subnet one machine or one customer gets: an attacker holding a /64 is one host,
  not 2^64 of them; ``--ipv6-host-prefix`` sets the length, e.g. 56 where customers get a /56), except ``::1``
  (this machine); an IPv4 client seen through an IPv6 socket (``::ffff:a.b.c.d``), through a NAT64 gateway
  (the well-known prefix ``64:ff9b::/96``, RFC 6052) or as an IPv4-compatible address (``::a.b.c.d``) is its
  IPv4 address (each of those families shares one /64, so by prefix every such client would be one host); a
  link-local client (``fe80::/10``: every machine of a segment shares ``fe80::/64``) counts by its whole
  address; ``unix:`` and anything else is as given (all such clients are one host).
* **authenticated or anonymous**: with a bearer token (``--auth-token-file``) every ``AdvantageService`` call
  and reflection stream must present it (:class:`advantage_server.auth.TokenAuthInterceptor` refuses the rest
  with UNAUTHENTICATED before admission); with mutual TLS (``--tls-client-ca``) no connection without a verified
  client certificate exists at all. So an anonymous caller of a server with a token reaches only the health
  service, and what it can hold there (``Watch`` streams) is bounded per host and in all, and is never taken
  from a token holder (:mod:`advantage_server.health_service`). Health checks carry no credentials (gRPC's
  client-side health checking sends none), so every ``Watch`` counts as anonymous. Without a token or mutual
  TLS every caller is anonymous and equal.
"""
from __future__ import annotations

import functools
import ipaddress
import os
import socket
import urllib.parse
from typing import Any, Callable

import grpc

#: the host every IPv4 loopback client counts as
LOOPBACK_V4 = "ipv4:127.0.0.1"
#: IPv6 hosts count by this prefix length (a /64 is one subnet: one machine or one customer); the process's
#: ``--ipv6-host-prefix`` (:func:`set_ipv6_host_prefix`)
IPV6_HOST_PREFIX = 64
#: NAT64's well-known prefix (RFC 6052): the client's IPv4 address is the last 32 bits
NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")


def set_ipv6_host_prefix(length: int) -> None:
    """Count IPv6 clients by their ``/length`` prefix from now on, in this process (``--ipv6-host-prefix``,
    16-128; 128: every address is a host of its own). Raises ``ValueError`` outside that range."""
    global IPV6_HOST_PREFIX
    if not isinstance(length, int) or not 16 <= length <= 128:
        raise ValueError(f"--ipv6-host-prefix {length!r}: give a prefix length from 16 to 128")
    IPV6_HOST_PREFIX = length


def call_peer(context: Any) -> str:
    """The call's connection as gRPC names it (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``); ``unknown``
    when the context gives none (in-process tests)."""
    try:
        peer = context.peer()
    except Exception:  # noqa: BLE001 - a context without a peer
        peer = None
    return peer if isinstance(peer, str) and peer else "unknown"


def peer_host(peer: str) -> str:
    """The client host of a peer string (see the module docstring):

    * ``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4``; ``ipv4:127.0.0.9:5678`` -> ``ipv4:127.0.0.1``;
    * ``ipv6:[2001:db8:1:2:aa::7]:5678`` -> ``ipv6:[2001:db8:1:2::]/64``; ``ipv6:[::1]:5678`` -> ``ipv6:[::1]``;
    * ``ipv6:[::ffff:1.2.3.4]:5678``, ``ipv6:[64:ff9b::102:304]:5678`` (NAT64) and ``ipv6:[::1.2.3.4]:5678``
      -> ``ipv4:1.2.3.4``; ``ipv6:[fe80::1:2]:5678`` -> ``ipv6:[fe80::1:2]``;
    * the same percent-encoded, as grpcio writes IPv6 peers (``ipv6:%5B::1%5D:5678``);
    * anything else (``unix:...``, ``unknown``, a string that does not parse) unchanged.
    """
    if not peer.startswith(("ipv4:", "ipv6:")):
        return peer
    peer = urllib.parse.unquote(peer)  # grpcio writes IPv6 peers percent-encoded: ipv6:%5B::1%5D:45828
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return peer
    if host.startswith("ipv4:"):
        try:
            address = ipaddress.IPv4Address(host[len("ipv4:"):])
        except ValueError:
            return host
        return LOOPBACK_V4 if address.is_loopback else host
    text = host[len("ipv6:"):]
    if not (text.startswith("[") and text.endswith("]")):
        return host
    try:
        address6 = ipaddress.IPv6Address(text[1:-1].split("%", 1)[0])  # a zone id (fe80::1%eth0) names no host
    except ValueError:
        return host
    if address6.is_loopback:
        return "ipv6:[::1]"
    v4 = address6.ipv4_mapped
    if v4 is None and (address6 in NAT64_PREFIX or (int(address6) >> 32 == 0 and int(address6) > 1)):
        v4 = ipaddress.IPv4Address(int(address6) & 0xFFFFFFFF)  # NAT64, or IPv4-compatible ::a.b.c.d
    if v4 is not None:
        return LOOPBACK_V4 if v4.is_loopback else f"ipv4:{v4}"
    if address6.is_link_local:
        return f"ipv6:[{address6}]"
    prefix = IPV6_HOST_PREFIX
    if prefix >= 128:
        return f"ipv6:[{address6}]"
    net = ipaddress.IPv6Network((address6, prefix), strict=False)
    return f"ipv6:[{net.network_address}]/{prefix}"


def connection_key(peer: str) -> str:
    """One spelling per connection, whoever names it (issue #35: the ledger's connections entry): ``1.2.3.4:5678``
    or ``[2001:db8::7]:5678``. gRPC names a dual-stack socket's IPv4 client ``ipv6:%5B::ffff:1.2.3.4%5D:5678`` in
    :func:`call_peer` and the socket itself says ``::ffff:1.2.3.4``: both are ``1.2.3.4:5678`` here. A peer that
    names no IP connection (``unix:``, ``unknown``) is returned unchanged."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return peer
    text = urllib.parse.unquote(peer)[len("ipv4:"):]
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return peer
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return f"{address}:{port}" if address.version == 4 else f"[{address}]:{port}"


def sockaddr_peer(address: tuple) -> str:
    """gRPC's peer string (:func:`call_peer`) for a socket's ``getpeername()``: ``ipv4:1.2.3.4:5678``,
    ``ipv6:[::ffff:1.2.3.4]:5678``."""
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class ServerSockets:
    """The TCP connections this process has accepted on ``port``: who is connected, whether or not it has made a
    call (gRPC tells a handler its caller, never the connections that make no call). Read from the process's own
    descriptors (``/proc/self/fd``: Linux; elsewhere :attr:`available` is False and :meth:`scan` finds none), each
    socket asked its local and peer address once and remembered by its descriptor and inode.

    :meth:`shut` ends a connection as its client vanishing would: ``shutdown(SHUT_RDWR)`` on a duplicate of gRPC's
    descriptor, checked to be the same socket first (never ``close``: the descriptor stays gRPC's, which sees
    end-of-stream, drops the connection and closes it). Not thread-safe: one reaper thread uses it."""

    FD_DIR = "/proc/self/fd"

    def __init__(self, port: int):
        self.port = port
        self.available = os.path.isdir(self.FD_DIR) and port > 0
        self._known: dict[int, tuple[str, str | None]] = {}  # fd -> (its link, "socket:[inode]"; peer or None)

    def descriptors(self) -> int:
        """Descriptors this process holds open now (0 where that cannot be read): cheap, a directory listing."""
        try:
            return len(os.listdir(self.FD_DIR)) if self.available else 0
        except OSError:
            return 0

    def scan(self) -> dict[int, str]:
        """``{descriptor: peer}`` (:func:`sockaddr_peer`'s spelling) of every connection accepted on the port."""
        if not self.available:
            return {}
        try:
            names = os.listdir(self.FD_DIR)
        except OSError:
            return {}
        found: dict[int, str] = {}
        known: dict[int, tuple[str, str | None]] = {}
        for name in names:
            fd = int(name)
            try:
                link = os.readlink(f"{self.FD_DIR}/{fd}")
            except OSError:
                continue
            if not link.startswith("socket:"):
                continue
            seen = self._known.get(fd)
            peer = seen[1] if seen is not None and seen[0] == link else self._peer_of(fd)
            known[fd] = (link, peer)
            if peer is not None:
                found[fd] = peer
        self._known = known
        return found

    def _peer_of(self, fd: int) -> str | None:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            if sock.getsockname()[1] != self.port:
                return None
            return sockaddr_peer(sock.getpeername())
        except OSError:  # the listener (not connected), or a socket closed meanwhile
            return None
        finally:
            sock.close()

    def shut(self, fd: int, peer: str) -> bool:
        """End connection ``peer`` on descriptor ``fd`` (from :meth:`scan`); False when ``fd`` no longer holds it."""
        seen = self._known.get(fd)
        try:
            dup = os.dup(fd)
        except OSError:
            return False
        sock = socket.socket(fileno=dup)
        try:
            if seen is None or f"socket:[{os.fstat(dup).st_ino}]" != seen[0]:
                return False  # gRPC closed it and the number now holds another socket or file
            if sockaddr_peer(sock.getpeername()) != peer:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            sock.close()


class CallsPerConnection(grpc.ServerInterceptor):
    """Tells ``started(key)`` and ``ended(key)`` (:func:`connection_key`) when each call of any service begins and
    ends (gRPC's termination callback: the status was sent, or the call was cancelled), so that a connection with a
    call open, a waiting one or a health ``Watch`` stream included, is never taken for idle
    (:class:`advantage_server.shares.ConnectionShares`). The first interceptor: it sees every call."""

    def __init__(self, started: Callable[[str], None], ended: Callable[[str], None]):
        self.started, self.ended = started, ended

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        kind = next((k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                     if getattr(handler, k) is not None), None)
        if kind is None:
            return handler
        return handler._replace(**{kind: self._counted(getattr(handler, kind))})

    def _counted(self, behavior: Callable) -> Callable:
        started, ended = self.started, self.ended

        @functools.wraps(behavior)  # keeps experimental_non_blocking
        def counted(request: Any, context: Any, *rest: Any) -> Any:
            key = connection_key(call_peer(context))
            started(key)
            if not context.add_callback(lambda: ended(key)):  # already over
                ended(key)
            return behavior(request, context, *rest)

        return counted
