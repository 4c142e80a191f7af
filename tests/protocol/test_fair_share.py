"""One rate shared fairly (``protocol.ratelimit.FairShare``): the rate addresses with no accepted
submission share at the ingest. One flooder, however fast it asks, takes one key's share; a
newcomer gets its own at once; levels (allocation, prefix) share in turn; memory is bounded."""

from __future__ import annotations

from protocol.ratelimit import FairShare, RateLimiter

RATE, BURST = 10.0, 20.0


def _run(limiter, asks: dict[tuple[str, ...], float], start: float, end: float, step: float = 0.01) -> dict[tuple[str, ...], int]:
    """Each path asks every ``asks[path]`` seconds from ``start`` to ``end``; how many passed each."""
    passed = dict.fromkeys(asks, 0)
    nxt = dict.fromkeys(asks, start)
    t = start
    while t < end:
        for path, every in asks.items():
            if t >= nxt[path]:
                nxt[path] = t + every
                passed[path] += limiter.allow(path, now_s=t)
        t = round(t + step, 6)
    return passed


def test_a_flooder_takes_one_share_and_a_newcomer_gets_its_own_at_once() -> None:
    fair = FairShare(RATE, BURST)
    flood, new = ("a", "a1"), ("b", "b1")
    alone = _run(fair, {flood: 0.001}, 0.0, 10.0)
    assert alone[flood] <= RATE * 10 + BURST + 1  # alone, the whole rate
    both = _run(fair, {flood: 0.001, new: 0.5}, 10.0, 20.0)
    assert both[new] == 20  # every request of the newcomer passed, from the first
    assert both[flood] <= RATE / 2 * 10 + BURST / 2 + 1  # the flooder kept one share
    # the old single bucket: the flooder, asking 500 times as often, took nearly every token
    one = RateLimiter(RATE, BURST)
    shared = {flood: 0, new: 0}
    t, nxt = 0.0, 10.0
    while t < 20.0:
        shared[flood] += one.allow("unproven", now_s=t)
        if t >= nxt:
            nxt += 0.5
            shared[new] += one.allow("unproven", now_s=t)
        t = round(t + 0.001, 6)
    assert shared[new] <= 2


def test_the_shares_add_up_to_the_rate_and_idle_keys_leave_the_count() -> None:
    fair = FairShare(RATE, BURST, active_s=5.0)
    paths = {(f"a{i}", f"p{i}"): 0.001 for i in range(4)}
    got = _run(fair, paths, 0.0, 20.0)
    assert sum(got.values()) <= RATE * 20 + 2 * BURST
    assert min(got.values()) >= RATE / 4 * 20 * 0.8  # each about a quarter
    # three stop asking: after active_s the last one has the whole rate again
    last = _run(fair, {("a0", "p0"): 0.001}, 30.0, 40.0)
    assert last[("a0", "p0")] >= RATE * 10 * 0.9


def test_within_an_allocation_its_prefixes_share_its_part() -> None:
    fair = FairShare(RATE, BURST)
    got = _run(fair, {("A", "a1"): 0.001, ("A", "a2"): 0.001, ("B", "b1"): 0.001}, 0.0, 20.0)
    assert got[("B", "b1")] >= RATE / 2 * 20 * 0.9  # one allocation against one allocation
    assert abs(got[("A", "a1")] - got[("A", "a2")]) <= BURST  # A's half, halved
    assert got[("A", "a1")] <= RATE / 4 * 20 + BURST
    # many prefixes of one allocation weigh as one allocation
    many = _run(FairShare(RATE, BURST), {**{("A", f"a{i}"): 0.01 for i in range(50)}, ("B", "b1"): 0.01}, 0.0, 20.0)
    assert many[("B", "b1")] >= RATE / 2 * 20 * 0.9


def test_retry_after_names_when_the_path_may_ask_again_and_memory_is_bounded() -> None:
    fair = FairShare(1.0, 1.0, max_keys=100)
    assert fair.allow(("a", "p"), now_s=0.0) and not fair.allow(("a", "p"), now_s=0.0)
    assert fair.retry_after_s(("a", "p")) == 1.0
    assert fair.allow(("a", "p"), now_s=1.0)
    for i in range(10_000):
        fair.allow((f"x{i}", f"y{i}"), now_s=2.0 + i * 1e-3)
    assert len(fair._buckets) <= 2 * 100 and len(fair._seen) <= 100 and all(len(s) <= 100 for s in fair._seen.values())
