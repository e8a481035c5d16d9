"""Who is calling: the one place the server names a call's connection, host and standing.

The admission model (RELIABILITY.md, "The admission model") asks three questions and answers each once:
*who* is calling (this module), *what they are owed* (:mod:`advantage_server.shares`: places, Watch streams,
regions) and *whether the replica is alive* (:mod:`advantage_server.health_service`). Here:

* **connection**: the call's peer as gRPC names it (:func:`call_peer`: ``ipv4:10.0.0.7:51234``); every call of
  one client channel's connection has the same one.
* **host**: the machine a connection comes from (:func:`peer_host`), the unit of fairness between machines:
  an IPv4 address; every IPv4 loopback address (``127.0.0.0/8``) is this machine, one host; an IPv6 address
  counts by its /64 prefix (the subnet one machine or one customer gets: an attacker holding a /64 is one host,
  not 2^64 of them), except ``::1`` (this machine); an IPv4 client seen through an IPv6 socket
  (``::ffff:a.b.c.d``) is its IPv4 address; ``unix:`` and anything else is as given (all such clients are one
  host).
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
#: IPv6 hosts count by this prefix length (a /64 is one subnet: one machine or one customer)
IPV6_HOST_PREFIX = 64


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
    * ``ipv6:[::ffff:1.2.3.4]:5678`` -> ``ipv4:1.2.3.4``;
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
    if address6.ipv4_mapped is not None:
        v4 = address6.ipv4_mapped
        return LOOPBACK_V4 if v4.is_loopback else f"ipv4:{v4}"
    if address6.is_loopback:
        return "ipv6:[::1]"
    net = ipaddress.IPv6Network((address6, IPV6_HOST_PREFIX), strict=False)
    return f"ipv6:[{net.network_address}]/{IPV6_HOST_PREFIX}"
