"""SourcePool rules that keep hostile relays contained: origins kept and reserved, a bounded random
(sticky) subset of relay candidates, banned ones drawn last, probation, back-off on misses."""

from __future__ import annotations

import random

from node.shardcast.sources import SourcePool


def test_origins_kept_candidates_bounded_sticky_and_banned_last() -> None:
    relays = [f"http://r{i}" for i in range(20)]
    pool = SourcePool([*relays, "http://origin/"], origins=["http://origin"], max_candidates=8, rng=random.Random(1))
    assert "http://origin" in pool.urls and pool.get("http://origin").origin  # type: ignore[union-attr]
    cands = [u for u in pool.urls if u != "http://origin"]
    assert len(cands) == 8 and pool.offered == 20
    # the same offer again keeps the same candidates (a Sybil cannot reshuffle them by re-announcing)
    pool.set_urls([*reversed(relays), "http://origin"], origins=["http://origin"])
    assert sorted(u for u in pool.urls if u != "http://origin") == sorted(cands)
    # a banned candidate is replaced by a fresh one, and drawn again only if nothing else is offered
    bad = pool.get(cands[0])
    assert bad is not None
    pool.record_evidence(bad, "bad_hash")
    pool.set_urls([*relays, "http://origin"], origins=["http://origin"])
    assert cands[0] not in pool.urls and len(pool.urls) == 9
    # origins are never dropped, whatever the relays offered
    pool.set_urls([f"http://sybil{i}" for i in range(100)], origins=["http://origin"])
    assert "http://origin" in pool.urls and len(pool.urls) == 9


def test_probation_reserved_origin_slots_and_miss_backoff() -> None:
    pool = SourcePool(["http://r"], origins=["http://o"], max_in_flight_per_source=4)
    r, o = pool.get("http://r"), pool.get("http://o")
    assert r is not None and o is not None
    assert pool.capacity(r) == 1 and pool.capacity(o) == 4, "an unproven relay gets one request at a time"
    assert pool.choose(relays=False) is o, "with no relay slot free only the origin can be chosen"
    pool.record_success(r, 1000, 0.01)
    assert pool.capacity(r) == 4
    delays = []
    for _ in range(6):
        pool.record_missing(r)
        delays.append(r.cooldown_until)
    assert r not in pool.usable() and "http://r" in pool.cooled()
    assert all(b >= a for a, b in zip(delays, delays[1:], strict=False)), "back-off grows per consecutive miss"
    pool.record_success(r, 1000, 0.01)
    assert r.consecutive_misses == 0


def test_failure_and_miss_cool_downs_double_to_their_caps(monkeypatch) -> None:
    """Transport failures: 0.25 s doubling to 30 s; "not held" misses: 0.5 s doubling to 10 s; a
    cool-down never shortens one already running (clock frozen, so the delays are exact)."""
    from node.shardcast import sources

    monkeypatch.setattr(sources.time, "monotonic", lambda: 1000.0)
    pool = SourcePool(["http://r", "http://m"])
    r, m = pool.get("http://r"), pool.get("http://m")
    assert r is not None and m is not None
    failures = []
    for i in range(9):
        pool.record_failure(r, f"refused {i}")
        failures.append(r.cooldown_until - 1000.0)
    assert failures == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert (r.cooldowns, r.last_failure) == (9, "refused 8")
    misses = []
    for _ in range(6):
        pool.record_missing(m)
        misses.append(m.cooldown_until - 1000.0)
    assert misses == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    pool.record_success(r, 1000, 0.01)
    pool.record_failure(r, "reset")  # a new streak starts at 0.25 s but keeps the 30 s already running
    assert r.cooldown_until - 1000.0 == 30.0 and r.cooldowns == 10


def test_long_failure_and_miss_streaks_stay_at_their_caps(monkeypatch) -> None:
    """An upstream down for hours (a relay polling it every cool-down) builds a streak of thousands of
    failures; the back-off stays at its cap instead of overflowing (``0.25 · 2**1024`` raised
    ``OverflowError`` out of ``record_failure``, stopping the caller's poll loop)."""
    from node.shardcast import sources

    monkeypatch.setattr(sources.time, "monotonic", lambda: 1000.0)
    pool = SourcePool(["http://r", "http://m"])
    r, m = pool.get("http://r"), pool.get("http://m")
    assert r is not None and m is not None
    for i in range(3000):
        pool.record_failure(r, f"refused {i}")
        pool.record_missing(m)
    assert (r.consecutive_failures, r.cooldown_until - 1000.0, r.last_failure) == (3000, 30.0, "refused 2999")
    assert (m.consecutive_misses, m.cooldown_until - 1000.0, m.cooldowns) == (3000, 10.0, 3000)


def test_weight_is_earned_by_delivered_bytes() -> None:
    """Issue 23: an untried relay weighs 1/8 of the best measured source (it was weighed as the best);
    a request cut off as too slow sets its source's rate to what it delivered, however fast it once was."""
    pool = SourcePool(["http://r"], origins=["http://o"], exploration=0.0, rng=random.Random(3))
    r, o = pool.get("http://r"), pool.get("http://o")
    assert r is not None and o is not None
    pool.record_success(o, 16 << 20, 0.1)  # 168 MB/s

    def share_of_relay() -> float:
        picks = [pool.choose() for _ in range(4000)]
        return sum(p is r for p in picks) / len(picks)

    assert 0.07 < share_of_relay() < 0.16, "untried: 1/8 of the origin's weight, ≈ 1/9 of the picks"
    pool.record_success(r, 16 << 20, 0.1)
    assert 0.4 < share_of_relay() < 0.6, "delivering as fast as the origin earns the same weight"
    pool.record_slow(r, 0.5)  # then one byte every 2 s
    assert r.throughput_bps == 0.5 and r.cooldowns == 1 and pool.cooled() == {"http://r": "slow"}
    r.cooldown_until = 0.0  # cooled down over: the relay is usable again, but weighs next to nothing
    assert share_of_relay() < 0.01
    assert pool.best_rate_bps() == o.throughput_bps
