"""Per-peer rate limits: token buckets for requests and bytes, so one peer can't exhaust the coordinator."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    tokens: float
    updated_s: float


@dataclass
class RateLimiter:
    """Token buckets keyed by peer.

    Attributes:
        rate_per_s: tokens refilled per second.
        burst: bucket capacity (tokens).
        max_peers: buckets kept; the least recently used are forgotten beyond it.
    """

    rate_per_s: float
    burst: float
    max_peers: int = 100_000
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def allow(self, peer: str, cost: float = 1.0, now_s: float | None = None) -> bool:
        """Take ``cost`` tokens from ``peer``'s bucket; ``False`` (and nothing taken) if too few."""
        now = time.monotonic() if now_s is None else now_s
        b = self._buckets.get(peer)
        if b is None:
            if len(self._buckets) >= self.max_peers:
                oldest = min(self._buckets, key=lambda k: self._buckets[k].updated_s)
                del self._buckets[oldest]
            b = self._buckets[peer] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.updated_s) * self.rate_per_s)
        b.updated_s = now
        if b.tokens < cost:
            return False
        b.tokens -= cost
        return True

    def retry_after_s(self, peer: str, cost: float = 1.0) -> float:
        """Seconds until ``peer`` could spend ``cost`` tokens."""
        b = self._buckets.get(peer)
        if b is None or b.tokens >= cost:
            return 0.0
        return (cost - b.tokens) / self.rate_per_s
