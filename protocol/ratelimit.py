"""Token buckets, alone and keyed by peer (pure).

One implementation for every per-peer budget of a node: the ingest's per-address and per-key
rates (``trainer/ingest/limits.py``), the run page's and ``/status``'s (``node/web/assets.py``), a
presence hub's stream opens and roster requests (``node/p2p/presence.py``) and the gossip
forwarders' node-record budget (``node/p2p/service.py``). Not a wire format; it lives here, below
both ``trainer/`` and ``node/``, like :mod:`protocol.addresses`.

Clocks are the caller's (seconds, monotonic): asyncio callers pass nothing (``time.monotonic``),
trio callers pass ``trio.current_time()``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["RateLimiter", "TokenBucket"]


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second; :meth:`take` spends ``cost`` if there are that many.

    Args:
        rate: tokens refilled per second.
        burst: capacity, tokens (the bucket starts full).
        now: the caller's clock now, seconds.
    """

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Spend ``cost`` tokens at time ``now``; ``False`` (and nothing spent) if there are fewer."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


@dataclass
class RateLimiter:
    """Token buckets keyed by peer (an address, a key, a peer ID).

    Attributes:
        rate_per_s: tokens refilled per second.
        burst: bucket capacity (tokens).
        max_peers: buckets kept; the least recently used is forgotten beyond it, in O(1) (the
            buckets are kept in order of use). A forgotten peer starts again with a full bucket,
            so this must exceed the peers a node serves at once: then only peers idle longest are
            forgotten, never everyone's budget at once, and a flood of new identities costs a new
            one no more than a known one (a scan for the oldest cost ≈ 10–90 ms per new address at
            100,000, which a flood of fresh addresses turned into a stalled event loop).
    """

    rate_per_s: float
    burst: float
    max_peers: int = 100_000
    _buckets: OrderedDict[str, TokenBucket] = field(default_factory=OrderedDict)

    def allow(self, peer: str, cost: float = 1.0, now_s: float | None = None) -> bool:
        """Take ``cost`` tokens from ``peer``'s bucket at ``now_s`` (default: ``time.monotonic()``);
        ``False`` (and nothing taken) if too few."""
        now = time.monotonic() if now_s is None else now_s
        b = self._buckets.get(peer)
        if b is None:
            if len(self._buckets) >= self.max_peers:
                self._buckets.popitem(last=False)  # the least recently used
            b = self._buckets[peer] = TokenBucket(self.rate_per_s, self.burst, now)
        else:
            self._buckets.move_to_end(peer)
        return b.take(now, cost)

    def retry_after_s(self, peer: str, cost: float = 1.0) -> float:
        """Seconds until ``peer`` could spend ``cost`` tokens (as of its last :meth:`allow`)."""
        b = self._buckets.get(peer)
        if b is None or b.tokens >= cost:
            return 0.0
        return (cost - b.tokens) / self.rate_per_s

    def __len__(self) -> int:
        """Peers with a bucket now (at most :attr:`max_peers`)."""
        return len(self._buckets)
