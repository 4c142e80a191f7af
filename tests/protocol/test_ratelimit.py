"""protocol.ratelimit: the one per-peer token-bucket limiter (ingest, run page, presence, gossip)."""

from __future__ import annotations

from protocol.ratelimit import RateLimiter, TokenBucket


def test_bucket_spends_its_burst_then_refills_at_its_rate():
    b = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(0.4)  # 0.8 tokens
    assert b.take(0.5)  # 1.0
    assert not b.take(100.0, cost=4.0) and b.take(100.0, cost=3.0)  # never more than the burst


def test_a_flood_of_new_peers_forgets_the_idle_ones_not_a_busy_peers_spent_budget():
    """Full, the limiter forgets the least recently used peer only: a peer that keeps asking keeps its
    spent bucket however many identities arrive (the hubs' budgets used to be cleared whole past
    4 × their workers, handing every peer a fresh burst)."""
    lim = RateLimiter(rate_per_s=0.001, burst=2.0, max_peers=4)
    assert lim.allow("busy", now_s=0.0) and lim.allow("busy", now_s=0.0) and not lim.allow("busy", now_s=0.0)
    for i in range(1000):
        assert lim.allow(f"sybil-{i}", now_s=1.0)
        assert not lim.allow("busy", now_s=1.0)
        assert len(lim) <= 4
    assert lim.retry_after_s("busy") > 0


def test_a_forgotten_peer_starts_full():
    lim = RateLimiter(rate_per_s=0.001, burst=1.0, max_peers=2)
    assert lim.allow("a", now_s=0.0) and not lim.allow("a", now_s=0.0)
    lim.allow("b", now_s=0.0)
    lim.allow("c", now_s=0.0)  # "a" is the least recently used: forgotten
    assert lim.allow("a", now_s=0.0)
