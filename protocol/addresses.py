"""Client addresses as per-address limits count them (pure).

One rule for every limit that counts a remote by its address: the ingest's quotas and in-flight
shares (``trainer/ingest/service.py``), every HTTP server's connection cap
(``node/http_server.py``) and the gossip host's per-address cap (``node/p2p/transport.py``, per
/56). Not a wire format: nodes need not agree on it, but the layers of one node must, so it lives
here, below both ``trainer/`` and ``node/``.
"""

from __future__ import annotations

import ipaddress

__all__ = ["address_key"]


def address_key(host: str, v6_prefix: int = 64) -> str:
    """The client address that per-address limits count.

    Args:
        host: the remote's IP address as the socket reports it (IPv4, IPv6, IPv6 with a zone ID).
        v6_prefix: IPv6 addresses count per ``/v6_prefix`` network (64: one host or site usually
            holds a whole /64, so counting single IPv6 addresses would bound nothing; the gossip
            host uses 56, go-libp2p's per-subnet limit).

    Returns:
        An IPv4 address, or an IPv6 address's network (``"2001:db8::/64"``); an IPv4-mapped IPv6
        address counts as its IPv4 address; a zone ID is dropped. Anything that is no IP address
        (a Unix socket's name, ``"?"``) is returned unchanged.
    """
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, v6_prefix), strict=False))
    return str(addr)
