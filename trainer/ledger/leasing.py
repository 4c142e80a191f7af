"""The order in which validators are handed pending submissions: fair under Sybil pressure.

Validators' time is the scarce resource a flood of junk submissions spends. Keys are free and
addresses cheap, so the order gives a fair share per *established* identity first, not per key
or per address (``docs/protocol.md`` "Leasing"):

1. **Tiers.** A worker with an accepted submission is *established*; one without is *on
   probation*. Established workers' submissions are leased first; probation gets one slot in
   :data:`PROBATION_EVERY` (so a new honest worker still gets in, at a rate that junk from any
   number of new keys cannot raise), and at most ``⌈limit / PROBATION_EVERY⌉`` submissions of one
   lease answer even when no established work is pending: a validator then leases again sooner
   instead of spending a whole batch on probation while established work arrives behind it.
2. **Round robin within a tier**, nested: over address allocations (an IPv6 /32; an IPv4 /24),
   then the prefixes inside one (an IPv6 /48; for IPv4 the same /24: ``prefixes.py``), then the
   addresses inside a prefix, then the worker keys from one address, one submission per turn.
   Turns carry over from one lease answer to the next (:class:`LeaseOrder`): at each level the
   child waiting longest for its turn goes first, and a child just served goes behind every child
   waiting then, so a validator leasing one at a time sees the same round robin. So 66 addresses
   of one /24, 65,536 /48s of one IPv6 /32, or 1,000 keys behind one address, weigh as one
   allocation, prefix or address, and fresh keys cannot jump the queue.
3. **Within a worker newest first**: what validators judge first is what the trainer can still
   use; a worker's oldest pending work ages out of the async window instead.

The ledger also bounds what probation may hold (``ledger.py``, ``Quotas.probation_share``), so
junk cannot fill the disk quota that established workers' submissions need, and shares that out
per allocation and prefix too (displacement: an allocation or prefix holding less takes the heaviest's newest
unleased place).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from trainer.ledger.ids import SubmissionId
from trainer.ledger.prefixes import IPV4_PREFIX, IPV6_ALLOCATION, IPV6_PREFIX, allocation_key, prefix_key
from trainer.ledger.store import LeaseCandidate

__all__ = ["IPV4_PREFIX", "IPV6_ALLOCATION", "IPV6_PREFIX", "MAX_REMEMBERED_TURNS", "PROBATION_EVERY", "LeaseOrder", "allocation_key",
           "prefix_key"]

PROBATION_EVERY = 8
"""While both tiers have pending work, one lease slot in this many goes to workers on probation."""

MAX_REMEMBERED_TURNS = 1 << 16
"""Most allocations, prefixes, addresses and keys whose last turn :class:`LeaseOrder` remembers (its memory bound)."""

_Path = tuple[str, ...]
_Turn = tuple[int, int]  # (arrival seq, order within an answer): compared as a tuple, smaller goes first


class _RoundRobin:
    """Children taken one item per turn (a child is a sub-round-robin or a leaf queue of IDs); each
    pop reports the path it took (allocation, prefix, address, key) to ``served``."""

    def __init__(self, children: Iterable[tuple[_Path, _RoundRobin | deque[SubmissionId]]]) -> None:
        self.children = deque(children)

    def __bool__(self) -> bool:
        return bool(self.children)

    def pop(self, served: list[_Path]) -> SubmissionId:
        path, child = self.children.popleft()
        served.append(path)
        sid = child.popleft() if isinstance(child, deque) else child.pop(served)
        if child:
            self.children.append((path, child))
        return sid


class LeaseOrder:
    """The fair lease order, with what it remembers across lease answers (see the module docstring).

    Turns carry over between answers, so a validator leasing one or a few at a time sees the same
    shares as one leasing many: the slot count (probation's one in :data:`PROBATION_EVERY`), and
    each allocation's, prefix's, address's and key's last turn. At each level the child whose turn is oldest goes
    first: a child's turn is its oldest pending submission's arrival until it is served, then the
    moment it was served (after every submission pending then), so it goes behind everyone who was
    waiting, and a new key, arriving later, goes behind it in turn: fresh keys cannot jump the queue.

    Thread-safety: none; the ledger calls :meth:`take` under its lease lock.

    Args:
        probation_every: see :data:`PROBATION_EVERY`.
        max_remembered: see :data:`MAX_REMEMBERED_TURNS`.
    """

    def __init__(self, probation_every: int = PROBATION_EVERY, max_remembered: int = MAX_REMEMBERED_TURNS) -> None:
        self.probation_every = probation_every
        self.max_remembered = max_remembered
        self.slot = 0
        """Lease slots handed out so far (one per submission)."""
        self._turns: dict[_Path, _Turn] = {}

    def take(self, candidates: list[LeaseCandidate], limit: int) -> list[SubmissionId]:
        """Up to ``limit`` of ``candidates`` in lease order; their turns are remembered.

        Args:
            candidates: pending submissions not leased now.
            limit: most to hand out.

        Returns:
            The IDs, fewer than ``limit`` when only probation's share of one answer
            (``⌈limit / probation_every⌉``) is left.
        """
        if not candidates:
            return []
        now = max(c.seq for c in candidates)  # every later submission arrives after this
        established = self._tier([c for c in candidates if c.established])
        probation = self._tier([c for c in candidates if not c.established])
        probation_left = -(-limit // self.probation_every)  # per answer
        out: list[SubmissionId] = []
        while len(out) < limit:
            probation_turn = self.slot % self.probation_every == self.probation_every - 1
            served: list[_Path] = []
            if probation and probation_left and (probation_turn or not established):
                out.append(probation.pop(served))
                probation_left -= 1
            elif established:
                out.append(established.pop(served))
            else:
                break
            for path in served:
                self._turns[path] = (now, len(out))
            self.slot += 1
        self._forget(min(c.seq for c in candidates))
        return out

    def _turn(self, path: _Path, oldest: int) -> _Turn:
        return max((oldest, 0), self._turns.get(path, (oldest, 0)))

    def _tier(self, candidates: list[LeaseCandidate]) -> _RoundRobin:
        """Allocation → prefix → address → key round robin over ``candidates`` (oldest turn first at each level)."""
        tree: dict[str, dict[str, dict[str, dict[str, list[LeaseCandidate]]]]] = {}
        for c in candidates:
            (tree.setdefault(allocation_key(c.address), {}).setdefault(prefix_key(c.address), {}).setdefault(c.address, {})
             .setdefault(c.worker, []).append(c))

        def oldest(node: dict | list) -> int:  # type: ignore[type-arg]
            return min(c.seq for c in node) if isinstance(node, list) else min(oldest(v) for v in node.values())

        def build(path: _Path, node: dict | list) -> _RoundRobin | deque[SubmissionId]:  # type: ignore[type-arg]
            if isinstance(node, list):
                return deque(c.id for c in sorted(node, key=lambda c: -c.seq))  # newest first
            children = sorted(((*path, name), child) for name, child in node.items())
            children.sort(key=lambda pc: self._turn(pc[0], oldest(pc[1])))
            return _RoundRobin((p, build(p, child)) for p, child in children)

        root = build((), tree)
        assert isinstance(root, _RoundRobin)
        return root

    def _forget(self, oldest_pending: int) -> None:
        """Drop turns that no longer decide anything (older than every candidate's arrival), and
        the oldest beyond :attr:`max_remembered`."""
        self._turns = {p: t for p, t in self._turns.items() if t >= (oldest_pending, 1)}
        if len(self._turns) > self.max_remembered:
            keep = sorted(self._turns.items(), key=lambda pt: pt[1])[-self.max_remembered:]
            self._turns = dict(keep)
