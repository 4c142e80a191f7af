"""Address prefixes and the allocations above them: what one operator usually holds, and what the
ledger shares out fairly, in two levels.

Keys are free and single addresses cheap, but address space is not. The ledger shares what it
must share out (the lease order, ``leasing.py``; probation's share of the disk quota, by
displacement, ``ledger.py``; the rate of unproven addresses, ``trainer/ingest/service.py``) per
**allocation** first, then per **prefix** within it:

* IPv6: an allocation is a /32 (what a regional registry allocates to an ISP or hoster; a RIPE
  member's default /29 is 8 of them), a prefix a /48 (what one site usually gets). Shared per /48
  alone, one /32 would hold 65,536 "prefixes" and outnumber every other operator that much; shared
  per /32 first, it weighs as one, and the /48s inside it share its part among themselves.
* IPv4: both are the /24 (an IPv4 /24 is already scarce, 256 addresses: one level).
"""

from __future__ import annotations

import ipaddress

__all__ = ["IPV4_PREFIX", "IPV6_ALLOCATION", "IPV6_PREFIX", "allocation_key", "prefix_key"]

IPV4_PREFIX = 24
"""IPv4 addresses are shared out per /24 (bits), as prefix and as allocation."""
IPV6_PREFIX = 48
"""IPv6 addresses are shared out per /48 (bits) within their allocation."""
IPV6_ALLOCATION = 32
"""IPv6 prefixes are shared out per /32 (bits) first."""


def _supernet(address: str, v4_bits: int, v6_bits: int) -> str:
    try:
        net = ipaddress.ip_network(address, strict=False)
    except ValueError:
        return address
    bits = v4_bits if net.version == 4 else v6_bits
    return str(net.supernet(new_prefix=min(bits, net.prefixlen)))


def prefix_key(address: str) -> str:
    """The prefix an address (``protocol.addresses.address_key``: an IPv4 address or an IPv6 /64
    network) belongs to: its IPv4 /24 or IPv6 /48; anything else unchanged (``""``, the
    address of a submission an older version's file did not keep, stays ``""``)."""
    return _supernet(address, IPV4_PREFIX, IPV6_PREFIX)


def allocation_key(address: str) -> str:
    """The allocation an address (or one of its prefixes) belongs to: its IPv4 /24 (the same as its
    prefix) or IPv6 /32; anything else unchanged."""
    return _supernet(address, IPV4_PREFIX, IPV6_ALLOCATION)
