"""The order in which validators are handed pending submissions: fair under Sybil pressure.

Validators' time is the scarce resource a flood of junk submissions spends. Keys are free and
addresses cheap, so the order gives a fair share per *established* identity first, not per key
or per address (``docs/protocol.md`` "Leasing"):

1. **Tiers.** A worker with an accepted submission is *established*; one without is *on
   probation*. Established workers' submissions are leased first; probation gets one slot in
   :data:`PROBATION_EVERY` while both have work (so a new honest worker still gets in, at a rate
   that junk from any number of new keys cannot raise), and every slot when established work is
   leased out.
2. **Round robin within a tier**, nested: over address prefixes (an IPv4 /24, an IPv6 /48:
   what one operator usually holds), then the addresses inside a prefix, then the worker keys
   from one address, one submission per turn. At each level the child whose oldest pending
   submission waited longest goes first. So 66 addresses of one /24, or 1,000 keys behind one
   address, weigh as one prefix or one address.
3. **Within a worker newest first**: what validators judge first is what the trainer can still
   use; a worker's oldest pending work ages out of the async window instead.

The ledger also bounds what probation may hold (``ledger.py``, ``Quotas.probation_share``), so
junk cannot fill the disk quota that established workers' submissions need.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from collections.abc import Iterable

from trainer.ledger.ids import SubmissionId
from trainer.ledger.store import LeaseCandidate

PROBATION_EVERY = 8
"""While both tiers have pending work, one lease slot in this many goes to workers on probation."""

IPV4_PREFIX = 24
IPV6_PREFIX = 48
"""Address prefixes the lease order shares out first (bits)."""


def prefix_key(address: str) -> str:
    """The prefix an address (``protocol.addresses.address_key``: an IPv4 address or an IPv6
    /64 network) belongs to for leasing: its IPv4 /24 or IPv6 /48; anything else unchanged."""
    try:
        net = ipaddress.ip_network(address, strict=False)
    except ValueError:
        return address
    bits = IPV4_PREFIX if net.version == 4 else IPV6_PREFIX
    return str(net.supernet(new_prefix=min(bits, net.prefixlen)))


class _RoundRobin:
    """Children taken one item per turn (a child is a sub-round-robin or a leaf queue of IDs)."""

    def __init__(self, children: Iterable[_RoundRobin | deque[SubmissionId]]) -> None:
        self.children = deque(children)

    def __bool__(self) -> bool:
        return bool(self.children)

    def pop(self) -> SubmissionId:
        child = self.children.popleft()
        sid = child.popleft() if isinstance(child, deque) else child.pop()
        if child:
            self.children.append(child)
        return sid


def _tier(candidates: list[LeaseCandidate]) -> _RoundRobin:
    """Prefix → address → worker round robin over ``candidates`` (oldest waiting first at each level)."""
    tree: dict[str, dict[str, dict[str, list[LeaseCandidate]]]] = {}
    for c in candidates:
        tree.setdefault(prefix_key(c.address), {}).setdefault(c.address, {}).setdefault(c.worker, []).append(c)

    def oldest(node: dict | list) -> int:  # type: ignore[type-arg]
        return min(c.seq for c in node) if isinstance(node, list) else min(oldest(v) for v in node.values())

    def build(node: dict | list) -> _RoundRobin | deque[SubmissionId]:  # type: ignore[type-arg]
        if isinstance(node, list):
            return deque(c.id for c in sorted(node, key=lambda c: -c.seq))  # newest first
        return _RoundRobin(build(v) for v in sorted(node.values(), key=oldest))

    root = build(tree)
    assert isinstance(root, _RoundRobin)
    return root


def lease_order(candidates: list[LeaseCandidate], limit: int, *, slot: int = 0,
                probation_every: int = PROBATION_EVERY) -> tuple[list[SubmissionId], int]:
    """Up to ``limit`` of ``candidates`` in lease order (see the module docstring).

    Args:
        candidates: pending submissions not leased now.
        limit: most to hand out.
        slot: the lease slot this answer starts at (the ledger counts slots across answers, so a
            validator leasing one at a time still gives probation its share).
        probation_every: see :data:`PROBATION_EVERY`.

    Returns:
        The IDs, and the next slot number.
    """
    established = _tier([c for c in candidates if c.established])
    probation = _tier([c for c in candidates if not c.established])
    out: list[SubmissionId] = []
    while len(out) < limit and (established or probation):
        probation_turn = slot % probation_every == probation_every - 1
        tier = probation if (probation and (probation_turn or not established)) else established
        out.append(tier.pop())
        slot += 1
    return out, slot
