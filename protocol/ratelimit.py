"""Token buckets, alone, keyed by peer, and one rate shared fairly by whoever uses it (pure).

One implementation for every per-peer budget of a node: the ingest's per-address and per-key
rates and the rate addresses with no accepted submission share (:class:`FairShare`,
``trainer/ingest/limits.py``), the run page's and ``/status``'s (``node/web/assets.py``), a
presence hub's stream opens and roster requests (``node/p2p/presence.py``) and the gossip
forwarders' node-record budget (``node/p2p/service.py``). Not a wire format; it lives here, below
both ``trainer/`` and ``node/``, like :mod:`protocol.addresses`.

Clocks are the caller's (seconds, monotonic): asyncio callers pass nothing (``time.monotonic``),
trio callers pass ``trio.current_time()``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["FairShare", "RateLimiter", "TokenBucket"]


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


class FairShare:
    """One rate shared fairly by the keys that use it, level by level along a key's path.

    A request names a path (e.g. ``(allocation, prefix)``: ``trainer/ledger/prefixes.py``). At the
    first level the rate is split evenly among the first-level keys active in the last
    ``active_s`` seconds; at each next level, a key's share evenly among its children active then.
    Each key on the path has a token bucket refilled at its share now (capacity the same fraction
    of ``burst``, at least one request), and a request passes only if every bucket on its path
    holds its cost. So one flooder, however fast it asks, takes one key's share, and a newcomer
    gets its own share at once instead of whatever the flooder left of one shared bucket (which was
    nothing); keys that stop asking leave the count after ``active_s``, and the rest share the
    whole rate again. The shares of the keys active now add up to the rate (buckets a change of the
    count leaves fuller than their new capacity are cut to it at their next request).

    Not thread-safe (one event loop). Memory: at most ``max_keys`` keys of each level are
    remembered, the least recently used forgotten first (as :class:`RateLimiter`).

    Args:
        rate_per_s: the rate shared, requests (tokens) per second.
        burst: the capacity shared, tokens.
        active_s: a key counts as active this many seconds after its last request.
        max_keys: keys remembered per level.
    """

    def __init__(self, rate_per_s: float, burst: float, *, active_s: float = 10.0, max_keys: int = 100_000) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.active_s = active_s
        self.max_keys = max_keys
        self._seen: OrderedDict[tuple[str, ...], OrderedDict[str, float]] = OrderedDict()  # parent path → child → last request (oldest first)
        self._buckets: OrderedDict[tuple[str, ...], TokenBucket] = OrderedDict()  # path → its bucket (least recently used first)

    def _active(self, parent: tuple[str, ...], child: str, now: float) -> int:
        """Record ``child``'s request under ``parent``; how many children of ``parent`` are active now."""
        seen = self._seen.get(parent)
        if seen is None:
            if len(self._seen) >= self.max_keys:
                self._seen.popitem(last=False)  # the parent asked least recently
            seen = self._seen[parent] = OrderedDict()
        else:
            self._seen.move_to_end(parent)
        seen[child] = now
        seen.move_to_end(child)
        while seen and (next(iter(seen.values())) < now - self.active_s or len(seen) > self.max_keys):
            seen.popitem(last=False)
        return len(seen)

    def _path_buckets(self, path: Sequence[str], now: float, cost: float) -> list[TokenBucket]:
        out: list[TokenBucket] = []
        share = self.rate_per_s
        for i, key in enumerate(path):
            share /= max(1, self._active(tuple(path[:i]), key, now))
            node = tuple(path[: i + 1])
            b = self._buckets.get(node)
            if b is None:
                if len(self._buckets) >= self.max_keys * max(1, len(path)):
                    self._buckets.popitem(last=False)
                b = self._buckets[node] = TokenBucket(share, max(cost, self.burst * share / self.rate_per_s), now)
            else:
                self._buckets.move_to_end(node)
                b.rate, b.burst = share, max(cost, self.burst * share / self.rate_per_s)
            out.append(b)
        return out

    def allow(self, path: Sequence[str], cost: float = 1.0, now_s: float | None = None) -> bool:
        """Take ``cost`` tokens from every bucket on ``path`` at ``now_s`` (default ``time.monotonic()``);
        ``False`` (and nothing taken) if one holds fewer. The request counts ``path``'s keys active."""
        now = time.monotonic() if now_s is None else now_s
        buckets = self._path_buckets(path, now, cost)
        for b in buckets:  # refill (and cut to capacity) at each key's share now
            b.take(now, 0.0)
        if any(b.tokens < cost for b in buckets):
            return False
        for b in buckets:
            b.tokens -= cost
        return True

    def retry_after_s(self, path: Sequence[str], cost: float = 1.0) -> float:
        """Seconds until ``path`` could spend ``cost`` tokens at its shares of its last :meth:`allow`."""
        waits = [0.0]
        for i in range(len(path)):
            b = self._buckets.get(tuple(path[: i + 1]))
            if b is not None and b.tokens < cost:
                waits.append((cost - b.tokens) / b.rate)
        return max(waits)
