"""Address prefixes: what one operator usually holds, and what the ledger shares out fairly.

Keys are free and single addresses cheap, but address prefixes are not: the lease order
(``leasing.py``) round-robins over prefixes first, and the probation share of the disk quota
(``ledger.py``, ``docs/protocol.md`` "Quotas") is shared out per prefix by displacement.
"""

from __future__ import annotations

import ipaddress

__all__ = ["IPV4_PREFIX", "IPV6_PREFIX", "prefix_key"]

IPV4_PREFIX = 24
IPV6_PREFIX = 48
"""Address prefixes the ledger shares out (bits)."""


def prefix_key(address: str) -> str:
    """The prefix an address (``protocol.addresses.address_key``: an IPv4 address or an IPv6
    /64 network) belongs to: its IPv4 /24 or IPv6 /48; anything else unchanged (``""``, the
    address of a submission an older version's file did not keep, stays ``""``)."""
    try:
        net = ipaddress.ip_network(address, strict=False)
    except ValueError:
        return address
    bits = IPV4_PREFIX if net.version == 4 else IPV6_PREFIX
    return str(net.supernet(new_prefix=min(bits, net.prefixlen)))
