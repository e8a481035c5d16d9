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

import ipaddress
import urllib.parse
from typing import Any

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
