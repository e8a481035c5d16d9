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
import re
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


@functools.lru_cache(maxsize=16384)  # every call of a connection names it the same way: parsed once
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


class ServerSockets:
    """The TCP connections this process has accepted on ``port``: who is connected, whether or not it has made a
    call (gRPC tells a handler its caller, never the connections that make no call). Linux only (elsewhere
    :attr:`available` is False and :meth:`scan` finds none): the kernel's socket tables (``/proc/self/net/tcp6``
    and ``tcp``: each established socket's local port, peer and inode) joined with the process's descriptors
    (``/proc/self/fd``: descriptor -> socket inode).

    :meth:`shut` ends a connection as its client vanishing would: ``shutdown(SHUT_RDWR)`` on a duplicate of gRPC's
    descriptor, checked to be the same socket first (never ``close``: the descriptor stays gRPC's, which sees
    end-of-stream, drops the connection and closes it).

    The per-descriptor calls go to libc without releasing the GIL (``ctypes.PyDLL``): each is a microsecond, and a
    thread that released and re-took the GIL around each of thousands of them, beside gRPC's busy threads, waited
    for the GIL every time (measured: 0.7-3.3 s to read and close 10,000 connections that way, 20-60 ms now). Not
    thread-safe: one reaper thread uses it."""

    FD_DIR = "/proc/self/fd"
    TABLES = ("/proc/self/net/tcp6", "/proc/self/net/tcp")

    def __init__(self, port: int):
        self.port = port
        self.available = port > 0 and os.path.isdir(self.FD_DIR) and any(os.path.exists(t) for t in self.TABLES)
        if self.available:
            import ctypes
            self._libc = ctypes.PyDLL(None, use_errno=True)
            self._buf = ctypes.create_string_buffer(64)
            self._table_buf = ctypes.create_string_buffer(1 << 20)
        # an established socket whose local port is ours: its peer address and port (hex), its inode
        self._row = re.compile(rf"^ *\d+: [0-9A-F]+:{port:04X} ([0-9A-F]+):([0-9A-F]{{4}}) 01 (?:\S+ +){{5}}(\d+)",
                               re.M)
        self._peers: dict[str, str] = {}  # the tables' hex address -> its peer-string host part
        self._inodes: dict[int, int] = {}  # fd -> socket inode, as of the last scan
        self._fds: dict[int, int] = {}  # socket inode -> fd, as of the last scan

    def _readlink(self, path: bytes) -> bytes:
        n = self._libc.readlink(path, self._buf, 64)
        return self._buf.raw[:n] if n > 0 else b""

    def _read_table(self, path: str) -> str:
        """A whole socket table, read by libc ``read`` of up to 1 MiB at a time without releasing the GIL (Python's
        own reads of a /proc file come in 8 KiB pieces, each a GIL hand-over)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return ""
        parts = []
        try:
            while True:
                n = self._libc.read(fd, self._table_buf, len(self._table_buf))
                if n <= 0:
                    break
                parts.append(self._table_buf.raw[:n])
        finally:
            os.close(fd)
        return b"".join(parts).decode("ascii", "replace")

    def descriptors(self) -> int:
        """Descriptors this process holds open now (0 where that cannot be read): cheap, a directory listing."""
        try:
            return len(os.listdir(self.FD_DIR)) if self.available else 0
        except OSError:
            return 0

    def _host(self, hexaddr: str) -> str:
        host = self._peers.get(hexaddr)
        if host is None:
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words, host byte order
            address = ipaddress.ip_address(raw)
            host = f"ipv4:{address}" if address.version == 4 else f"ipv6:[{address}]"
            if len(self._peers) < 65536:
                self._peers[hexaddr] = host
        return host

    def scan(self) -> dict[int, str]:
        """``{descriptor: peer}`` (:func:`call_peer`'s spelling, e.g. ``ipv6:[::ffff:10.0.0.7]:51234``) of every
        connection accepted on the port."""
        if not self.available:
            return {}
        peers: dict[int, str] = {}  # inode -> peer of every connection accepted on the port
        for table in self.TABLES:
            for m in self._row.finditer(self._read_table(table)):
                peers[int(m.group(3))] = f"{self._host(m.group(1))}:{int(m.group(2), 16)}"
        # a socket keeps its descriptor while it is open: only the inodes new since the last scan are looked for,
        # among the descriptors that held none of the sockets still open
        fds = {inode: fd for inode, fd in self._fds.items() if inode in peers}
        if len(fds) < len(peers):
            try:
                names = os.listdir(self.FD_DIR)
            except OSError:
                names = []
            known = set(fds.values())
            for name in names:
                fd = int(name)
                if fd in known:
                    continue
                link = self._readlink(f"{self.FD_DIR}/{name}".encode())
                if link.startswith(b"socket:["):
                    inode = int(link[8:-1])
                    if inode in peers:
                        fds[inode] = fd
        self._fds = fds
        self._inodes = {fd: inode for inode, fd in fds.items()}
        return {fd: peers[inode] for inode, fd in fds.items()}

    def shut(self, fd: int, peer: str) -> bool:
        """End the connection on descriptor ``fd`` (from :meth:`scan`, ``peer`` its peer); False when ``fd`` no longer
        holds the socket the scan found there."""
        inode = self._inodes.get(fd)
        if inode is None:
            return False
        dup = self._libc.dup(fd)
        if dup < 0:
            return False
        try:
            if self._readlink(f"{self.FD_DIR}/{dup}".encode()) != f"socket:[{inode}]".encode():
                return False  # gRPC closed it and the number now holds another socket or file
            return self._libc.shutdown(dup, 2) == 0  # SHUT_RDWR
        finally:
            self._libc.close(dup)


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
