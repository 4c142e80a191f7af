"""The lease order (``trainer/ledger/leasing.py``): established workers first, one slot in
``PROBATION_EVERY`` for workers on probation, round robin over address prefixes, addresses and
keys with turns carried across lease answers, newest first within a worker."""

from __future__ import annotations

import pytest

from trainer.ledger.ids import SubmissionId
from trainer.ledger.leasing import PROBATION_EVERY, LeaseOrder, allocation_key, prefix_key
from trainer.ledger.store import LeaseCandidate


def cand(i: int, worker: str, address: str, established: bool = False) -> LeaseCandidate:
    return LeaseCandidate(SubmissionId(f"{i:064x}"), worker, address, i, established)


def workers_of(ids: list[SubmissionId], cands: list[LeaseCandidate]) -> list[str]:
    by_id = {c.id: c.worker for c in cands}
    return [by_id[i] for i in ids]


def lease_one_at_a_time(order: LeaseOrder, pool: list[LeaseCandidate], answers: int, limit: int = 1) -> list[SubmissionId]:
    """What ``answers`` lease answers of ``limit`` hand out, each leased away from ``pool``."""
    got: list[SubmissionId] = []
    for _ in range(answers):
        ids = order.take(pool, limit)
        got += ids
        pool = [c for c in pool if c.id not in ids]
    return got


def test_prefixes() -> None:
    assert prefix_key("10.1.2.3") == prefix_key("10.1.2.200") == "10.1.2.0/24"
    assert prefix_key("10.1.3.3") != prefix_key("10.1.2.3")
    assert prefix_key("2001:db8:1:2::/64") == prefix_key("2001:db8:1:ffff::/64") == "2001:db8:1::/48"
    assert prefix_key("?") == "?"
    # above the prefix, the allocation: an IPv6 /32; for IPv4 the /24 itself
    assert allocation_key("2001:db8:1:2::/64") == allocation_key("2001:db8:ffff::/48") == "2001:db8::/32"
    assert allocation_key("10.1.2.3") == prefix_key("10.1.2.3") and allocation_key("?") == "?"


def test_one_ipv6_allocation_weighs_as_one_whatever_its_48s() -> None:
    """65,536 /48s fit in one /32: shared per /48 alone, 200 of them outnumbered a lone worker 200
    to 1 (old code: it was served after all 200, every one of which arrived before it)."""
    crowd = [cand(i, f"k{i}", f"2001:db8:{i:x}::/64", established=True) for i in range(200)]
    lone = [cand(10_000, "lone", "2001:db9:1::/64", established=True)]
    assert "lone" in workers_of(LeaseOrder().take(crowd + lone, 2), crowd + lone)
    # inside the /32, its /48s take turns as prefixes did
    got = workers_of(LeaseOrder().take(crowd + lone, 9), crowd + lone)
    assert len(set(got)) == 9 and got.count("lone") == 1


def test_established_work_goes_first_whatever_junk_piles_up() -> None:
    junk = [cand(i, f"junk{i}", f"10.{i % 66}.0.1") for i in range(4000)]
    honest = [cand(5000, "honest", "192.0.2.1", established=True)]
    assert workers_of(LeaseOrder().take(junk + honest, 1), honest) == ["honest"]


def test_probation_gets_one_slot_in_eight_while_both_have_work() -> None:
    est = [cand(i, f"e{i % 3}", f"192.0.{i % 3}.1", established=True) for i in range(100)]
    new = [cand(1000 + i, f"n{i}", f"10.0.{i}.1") for i in range(100)]
    order = LeaseOrder()
    ids = order.take(est + new, 64)
    kinds = ["n" if w.startswith("n") else "e" for w in workers_of(ids, est + new)]
    assert kinds.count("n") == 64 // PROBATION_EVERY and order.slot == 64
    assert kinds[PROBATION_EVERY - 1] == "n" and kinds[:PROBATION_EVERY - 1] == ["e"] * (PROBATION_EVERY - 1)
    # the slot count carries over between answers: a validator leasing one at a time gives the same share
    got = lease_one_at_a_time(LeaseOrder(), est + new, 64)
    assert sum(w.startswith("n") for w in workers_of(got, est + new)) == 64 // PROBATION_EVERY
    # with no established work, probation gets its share of one answer (a validator leases again sooner)
    assert len(LeaseOrder().take(new, 10)) == 2  # ⌈10 / 8⌉
    ids = LeaseOrder().take(new + est[:1], 8)
    w = workers_of(ids, new + est[:1])
    assert w[0] == "e0" and w[1].startswith("n") and len(ids) == 2


def test_round_robin_over_prefixes_then_addresses_then_keys() -> None:
    # (the same order in either tier) one /24 with 66 addresses and 10 keys each, and one lone worker in another /24
    crowd = [cand(i, f"k{i}", f"10.0.0.{i % 66}", established=True) for i in range(660)]
    lone = [cand(10_000, "lone", "10.9.9.9", established=True)]
    assert "lone" in workers_of(LeaseOrder().take(crowd + lone, 2), crowd + lone)  # one prefix against one prefix
    # within a prefix, addresses take turns; within an address, keys; within a key, newest first
    same = [cand(i, w, ip, established=True) for i, w, ip in ((1, "a", "10.0.0.1"), (2, "a", "10.0.0.1"), (3, "b", "10.0.0.1"),
                                                            (4, "c", "10.0.0.2"))]
    ids = LeaseOrder().take(same, 4)
    assert workers_of(ids, same)[:2] in (["a", "c"], ["c", "a"]) and ids.index(SubmissionId(f"{2:064x}")) < ids.index(SubmissionId(f"{1:064x}"))


@pytest.mark.slow
def test_turns_carry_over_between_answers() -> None:
    # 66 junk prefixes whose 20 submissions each all arrived before one new honest worker's; a
    # validator leasing one per answer reaches the honest one within one round of prefixes
    # (without remembered turns: after all 1,320 older junk submissions)
    for established in (False, True):
        junk = [cand(i, f"j{i}", f"10.{i % 66}.0.1", established) for i in range(66 * 20)]
        honest = [cand(5000, "honest", "192.0.2.1", established)]
        # (on probation one answer of 8 holds one: the same turn per answer)
        got = lease_one_at_a_time(LeaseOrder(), junk + honest, 67, limit=1 if established else 8)
        assert "honest" in workers_of(got, junk + honest)
    # keys behind one address: a key with four pending submissions against one with one, one per answer
    pool = [cand(c, "junk", "127.0.0.1") for c in range(4)] + [cand(10, "honest", "127.0.0.1")]
    assert sorted(workers_of(lease_one_at_a_time(LeaseOrder(), pool, 2, limit=8), pool)) == ["honest", "junk"]
    # a key served goes behind keys that arrived before it was served, not behind keys arriving later
    order = LeaseOrder()
    a = [cand(1, "a", "10.0.0.1", True), cand(2, "a", "10.0.0.1", True)]
    first = order.take(a + [cand(3, "b", "10.0.0.1", True)], 1)
    assert workers_of(first, a) == ["a"]
    rest = [c for c in a if c.id not in first] + [cand(3, "b", "10.0.0.1", True), cand(9, "fresh", "10.0.0.1", True)]
    assert workers_of(order.take(rest, 3), rest) == ["b", "a", "fresh"]


def test_remembered_turns_are_bounded() -> None:
    order = LeaseOrder(max_remembered=100)
    pool = [cand(i, f"k{i}", f"10.{i // 256 % 256}.{i % 256}.1", True) for i in range(2000)]
    lease_one_at_a_time(order, pool, 10, limit=64)
    assert len(order._turns) <= 100
