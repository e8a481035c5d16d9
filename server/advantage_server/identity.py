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

import ctypes
import functools
import ipaddress
import os
import re
import socket
import struct
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
    """The client host of a peer string: :func:`host_of` of its address (cached: a sweep of the connections names
    thousands of peers of a few hosts)."""
    host, sep, port = peer.rpartition(":")
    if sep and port.isdigit() and peer.startswith(("ipv4:", "ipv6:")):
        return _host_of(host, IPV6_HOST_PREFIX)
    return _host_of(peer, IPV6_HOST_PREFIX)


@functools.lru_cache(maxsize=4096)
def _host_of(address: str, _prefix: int) -> str:
    return host_of(address + ":0") if address.startswith(("ipv4:", "ipv6:")) else address


def host_of(peer: str) -> str:
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
            self._libc = ctypes.PyDLL(None, use_errno=True)
            self._buf = ctypes.create_string_buffer(64)
            self._table_buf = ctypes.create_string_buffer(1 << 20)
        # an established socket whose local port is ours: its peer address and port (hex), its inode
        self._row = re.compile(rf"^ *\d+: [0-9A-F]+:{port:04X} ([0-9A-F]+):([0-9A-F]{{4}}) 01 (?:\S+ +){{5}}(\d+)",
                               re.M)
        self._peers: dict[Any, str] = {}  # a table's hex address or sock_diag's family and bytes -> the peer's host
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

    def _diag(self, states: int) -> dict[int, str]:
        """``{inode: peer}`` of this network namespace's TCP sockets whose local port is ours and whose state is in
        the bit set ``states`` (1 << 1: established; 1 << 10: listening), asked of the kernel by netlink
        (``NETLINK_SOCK_DIAG``, ``inet_diag``): the kernel filters by state and port, so neither closed connections
        waiting out TIME_WAIT nor the clients' own ends (a same-host attacker's thousands) are read, formatted and
        parsed, as with the text tables (measured beside a churning host: 0.5-3 s a scan through the tables).
        Raises ``OSError`` where sock_diag cannot be used."""
        port = self.port
        # the bytecode keeps sockets whose source port is >= port and <= port (INET_DIAG_BC_S_GE, _S_LE)
        ops = struct.pack("=BBHBBHBBHBBH", 2, 8, 20, 0, 0, port, 3, 8, 12, 0, 0, port)
        out: dict[int, str] = {}
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as nl:  # NETLINK_SOCK_DIAG
            fd = nl.fileno()
            for family in (socket.AF_INET6, socket.AF_INET):
                body = (struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, states) + bytes(48)
                        + struct.pack("=HH", 4 + len(ops), 1) + ops)  # inet_diag_req_v2, INET_DIAG_REQ_BYTECODE
                # SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP
                nl.send(struct.pack("=IHHII", 16 + len(body), 20, 0x301, family, 0) + body)
                done = False
                while not done:
                    n = self._libc.recv(fd, self._table_buf, len(self._table_buf), 0)
                    if n <= 0:
                        raise OSError(ctypes.get_errno(), "sock_diag: recv failed")
                    data = self._table_buf.raw[:n]
                    off = 0
                    while off + 16 <= n:
                        length, kind = struct.unpack_from("=IH", data, off)
                        if kind == 3:  # NLMSG_DONE
                            done = True
                            break
                        if kind == 2:  # NLMSG_ERROR
                            raise OSError(-struct.unpack_from("=i", data, off + 16)[0], "sock_diag refused")
                        # inet_diag_msg: family, state, timer, retrans, then the id: sport, dport (big-endian),
                        # src[16], dst[16], if, cookie[2]; then expires, rqueue, wqueue, uid, inode
                        msg = off + 16
                        key = data[msg:msg + 1] + data[msg + 24:msg + 40]
                        peer = self._peers.get(key) or self._name(
                            key, data[msg + 24:msg + 28] if data[msg] == socket.AF_INET else data[msg + 24:msg + 40])
                        dport = (data[msg + 6] << 8) | data[msg + 7]
                        out[struct.unpack_from("=I", data, msg + 68)[0]] = f"{peer}:{dport}"
                        off += (length + 3) & ~3
        return out

    def descriptors(self) -> int:
        """Descriptors this process holds open now (0 where that cannot be read): cheap, a directory listing."""
        try:
            return len(os.listdir(self.FD_DIR)) if self.available else 0
        except OSError:
            return 0

    def _name(self, key: Any, raw: bytes) -> str:
        """The peer-string host part of the address ``raw`` (4 or 16 bytes), remembered under ``key``."""
        address = ipaddress.ip_address(raw)
        name = f"ipv4:{address}" if address.version == 4 else f"ipv6:[{address}]"
        if len(self._peers) < 65536:
            self._peers[key] = name
        return name

    def _host(self, hexaddr: str) -> str:
        """The same for a text table's address (hex, in 32-bit words of host byte order)."""
        known = self._peers.get(hexaddr)
        if known is not None:
            return known
        raw = bytes.fromhex(hexaddr)
        return self._name(hexaddr, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))

    def scan(self) -> dict[int, str]:
        """``{descriptor: peer}`` (:func:`call_peer`'s spelling, e.g. ``ipv6:[::ffff:10.0.0.7]:51234``) of every
        connection accepted on the port."""
        if not self.available:
            return {}
        try:
            peers = self._diag(1 << 1)  # inode -> peer of every connection accepted on the port
        except OSError:
            peers = {}  # no sock_diag (not Linux, a kernel without it, a sandbox): the text tables
            for table in self.TABLES:
                for m in self._row.finditer(self._read_table(table)):
                    peers[int(m.group(3))] = f"{self._host(m.group(1))}:{int(m.group(2), 16)}"
        # a socket keeps its descriptor while it is open: only the inodes new since the last scan are looked for,
        # among the descriptors that held none of the sockets still open
        fds = {inode: fd for inode, fd in self._fds.items() if inode in peers}
        if len(fds) < len(peers):
            fds.update(self._descriptors_of(peers, skip=set(fds.values())))
        self._fds = fds
        self._inodes = {fd: inode for inode, fd in fds.items()}
        return {fd: peers[inode] for inode, fd in fds.items()}

    def listeners(self) -> list[int]:
        """This process's descriptors of the sockets listening on the port (gRPC's), found by the tables' inodes."""
        if not self.available:
            return []
        try:
            inodes = set(self._diag(1 << 10))
        except OSError:
            row = re.compile(rf"^ *\d+: [0-9A-F]+:{self.port:04X} [0-9A-F]+:0000 0A (?:\S+ +){{5}}(\d+)", re.M)
            inodes = {int(m.group(1)) for table in self.TABLES for m in row.finditer(self._read_table(table))}
        return sorted(self._descriptors_of(inodes).values()) if inodes else []

    def _descriptors_of(self, inodes: Any, skip: set[int] = frozenset()) -> dict[int, int]:  # type: ignore[assignment]
        """``{inode: descriptor}`` of this process's descriptors (but ``skip``) that hold a socket of ``inodes``."""
        try:
            names = os.listdir(self.FD_DIR)
        except OSError:
            return {}
        found: dict[int, int] = {}
        for name in names:
            fd = int(name)
            if fd in skip:
                continue
            link = self._readlink(f"{self.FD_DIR}/{name}".encode())
            if link.startswith(b"socket:[") and (inode := int(link[8:-1])) in inodes:
                found[inode] = fd
        return found

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


# classic BPF (linux/filter.h): the opcodes the SYN gate's program uses
_LD_B_ABS, _LD_W_ABS, _ALU_AND, _ALU_RSH, _JEQ, _JA, _RET = 0x30, 0x20, 0x54, 0x74, 0x15, 0x05, 0x06
_NET = 0xFFF00000  # SKF_NET_OFF: loads relative to the IP header (plain offsets are the TCP header's)
_ACCEPT = 0xFFFFFFFF  # keep the whole packet
#: hosts one gate program names at most (4 instructions per IPv4 host, up to 13 per IPv6 one: far below the
#: kernel's 4,096); past it the hosts holding the most are named (the caller passes them in that order)
GATE_MAX_HOSTS = 64


def _gate_matchers(host: str) -> list[tuple[int, bytes, int]]:
    """The source addresses of ``host`` (a :func:`peer_host` key) as ``(ip version, network bytes, prefix
    length)``; [] for a key that names no IP host (``unix:...``)."""
    try:
        if host.startswith("ipv4:"):
            if host == LOOPBACK_V4:
                return [(4, bytes((127, 0, 0, 0)), 8)]
            v4 = ipaddress.IPv4Address(host[len("ipv4:"):]).packed
            # the forms peer_host counts as this IPv4 host that reach the socket as IPv6 packets: NAT64, ::a.b.c.d
            return [(4, v4, 32), (6, NAT64_PREFIX.network_address.packed[:12] + v4, 128), (6, bytes(12) + v4, 128)]
        if host.startswith("ipv6:["):
            text, _, prefix = host[len("ipv6:["):].partition("]")
            length = int(prefix[1:]) if prefix.startswith("/") else 128
            return [(6, ipaddress.IPv6Address(text).packed, length)]
    except ValueError:
        pass
    return []


def syn_gate_program(hosts: list[str]) -> bytes:
    """A classic BPF socket filter (``struct sock_filter[]``, host byte order) for a listening TCP socket that drops
    every connection request (a segment with SYN set and ACK clear) from a source address of ``hosts`` (:func:`
    peer_host` keys, at most :data:`GATE_MAX_HOSTS` used) and keeps every other packet. The dropped client's
    kernel sends its SYN again (after 1 s, then 2 s, ...) as for a lost packet. Only connection requests are
    matched, so a connection accepted earlier (which inherits its listener's filter) never loses a packet to it."""
    code: list[tuple[int, int, int, int]] = []
    code += [(_LD_B_ABS, 0, 0, 13), (_ALU_AND, 0, 0, 0x12), (_JEQ, 1, 0, 0x02), (_RET, 0, 0, _ACCEPT),
             (_LD_B_ABS, 0, 0, _NET), (_ALU_RSH, 0, 0, 4), (_JEQ, 0, 1, 6)]
    v4: list[tuple[bytes, int]] = []
    v6: list[tuple[bytes, int]] = []
    for host in hosts[:GATE_MAX_HOSTS]:
        for version, address, length in _gate_matchers(host):
            (v4 if version == 4 else v6).append((address, length))
    ja = len(code)
    code.append((_JA, 0, 0, 0))  # to the IPv6 part, patched below
    for address, length in v4:  # the IPv4 source address is bytes 12-15 of the IP header
        mask = (0xFFFFFFFF << (32 - length)) & 0xFFFFFFFF
        code += [(_LD_W_ABS, 0, 0, _NET + 12), (_ALU_AND, 0, 0, mask),
                 (_JEQ, 0, 1, int.from_bytes(address, "big") & mask), (_RET, 0, 0, 0)]
    code.append((_RET, 0, 0, _ACCEPT))
    code[ja] = (_JA, 0, 0, len(code) - ja - 1)
    for address, length in v6:  # the IPv6 source address is bytes 8-23 of the IP header, matched a word at a time
        words = [(i, min(32, length - 32 * i)) for i in range((length + 31) // 32)]
        for n, (i, bits) in enumerate(words):
            mask = (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF
            left = 3 * (len(words) - n - 1) + 1  # the rest of this host's words and its drop
            code += [(_LD_W_ABS, 0, 0, _NET + 8 + 4 * i), (_ALU_AND, 0, 0, mask),
                     (_JEQ, 0, left, int.from_bytes(address[4 * i:4 * i + 4], "big") & mask)]
        code.append((_RET, 0, 0, 0))
    code.append((_RET, 0, 0, _ACCEPT))
    return b"".join(struct.pack("=HBBI", *ins) for ins in code)


class ListenerGate:
    """Connection requests dropped in the kernel, per host (issue #35 item 4, the ledger's connections entry): gRPC's
    Python server has no hook where a connection is accepted, and it closes each connection past its limit as it
    arrives, whoever sent it; a host that reopens every connection closed (~20,000 a second from one CPU) keeps
    the server at that limit. :meth:`set` puts a :func:`syn_gate_program` on every socket listening on ``port``
    in this process (``SO_ATTACH_FILTER`` on a duplicate of gRPC's descriptor: no privilege is needed on one's own
    socket), so the gated hosts' SYNs are dropped before a connection exists, at no cost to the server's
    threads; ``set([])`` takes the filter off. Linux only (elsewhere, or with no listener found, :meth:`set`
    returns False and nothing is gated). Not thread-safe: the reaper's thread uses it."""

    SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27
    LISTEN_STATE = "0A"

    def __init__(self, sockets: "ServerSockets"):
        self.sockets = sockets
        self.hosts: tuple[str, ...] = ()
        self._program: Any = None  # the ctypes buffer of the program attached (kept alive while attached)

    def set(self, hosts: list[str]) -> bool:
        """Gate exactly ``hosts`` from now on (in the order of priority, see :data:`GATE_MAX_HOSTS`); True when
        every listener took it. A call with the hosts already gated does nothing."""
        hosts_t = tuple(hosts[:GATE_MAX_HOSTS])
        if hosts_t == self.hosts:
            return True
        fds = self.sockets.listeners()
        if not fds:
            return False
        program = ctypes.create_string_buffer(syn_gate_program(list(hosts_t)))
        fprog = struct.pack("=HxxxxxxQ" if struct.calcsize("P") == 8 else "=HxxI",
                            len(program.raw) // 8, ctypes.addressof(program))
        done = True
        for fd in fds:
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if hosts_t:
                        sock.setsockopt(socket.SOL_SOCKET, self.SO_ATTACH_FILTER, fprog)
                    else:
                        sock.setsockopt(socket.SOL_SOCKET, self.SO_DETACH_FILTER, 0)
            except OSError:
                done = False  # ENOENT: no filter to detach; EBADF: gRPC closed it (a stopped server)
        self.hosts, self._program = hosts_t, program
        return done


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
