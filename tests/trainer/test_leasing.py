"""The lease order (``trainer/ledger/leasing.py``): established workers first, one slot in
``PROBATION_EVERY`` for workers on probation, round robin over address prefixes, addresses and
keys, newest first within a worker."""

from __future__ import annotations

from trainer.ledger.ids import SubmissionId
from trainer.ledger.leasing import PROBATION_EVERY, lease_order, prefix_key
from trainer.ledger.store import LeaseCandidate


def cand(i: int, worker: str, address: str, established: bool = False) -> LeaseCandidate:
    return LeaseCandidate(SubmissionId(f"{i:064x}"), worker, address, i, established)


def workers_of(ids: list[SubmissionId], cands: list[LeaseCandidate]) -> list[str]:
    by_id = {c.id: c.worker for c in cands}
    return [by_id[i] for i in ids]


def test_prefixes() -> None:
    assert prefix_key("10.1.2.3") == prefix_key("10.1.2.200") == "10.1.2.0/24"
    assert prefix_key("10.1.3.3") != prefix_key("10.1.2.3")
    assert prefix_key("2001:db8:1:2::/64") == prefix_key("2001:db8:1:ffff::/64") == "2001:db8:1::/48"
    assert prefix_key("?") == "?"


def test_established_work_goes_first_whatever_junk_piles_up() -> None:
    junk = [cand(i, f"junk{i}", f"10.{i % 66}.0.1") for i in range(4000)]
    honest = [cand(5000, "honest", "192.0.2.1", established=True)]
    ids, _ = lease_order(junk + honest, 1)
    assert workers_of(ids, honest) == ["honest"]


def test_probation_gets_one_slot_in_eight_while_both_have_work() -> None:
    est = [cand(i, f"e{i % 3}", f"192.0.{i % 3}.1", established=True) for i in range(100)]
    new = [cand(1000 + i, f"n{i}", f"10.0.{i}.1") for i in range(100)]
    ids, slot = lease_order(est + new, 64)
    kinds = ["n" if w.startswith("n") else "e" for w in workers_of(ids, est + new)]
    assert kinds.count("n") == 64 // PROBATION_EVERY and slot == 64
    assert kinds[PROBATION_EVERY - 1] == "n" and kinds[:PROBATION_EVERY - 1] == ["e"] * (PROBATION_EVERY - 1)
    # the slot count carries over between answers: a validator leasing one at a time gives the same share
    slot, got = 0, []
    pool = est + new
    for _ in range(64):
        one, slot = lease_order(pool, 1, slot=slot)
        got += one
        pool = [c for c in pool if c.id not in one]
    assert sum(w.startswith("n") for w in workers_of(got, est + new)) == 64 // PROBATION_EVERY
    # with no established work left, probation takes every slot
    ids, _ = lease_order(new, 10)
    assert len(ids) == 10


def test_round_robin_over_prefixes_then_addresses_then_keys() -> None:
    # one /24 with 66 addresses and 10 keys each, and one lone worker in another /24
    crowd = [cand(i, f"k{i}", f"10.0.0.{i % 66}") for i in range(660)]
    lone = [cand(10_000, "lone", "10.9.9.9")]
    ids, _ = lease_order(crowd + lone, 2)
    assert "lone" in workers_of(ids, crowd + lone)  # one prefix against one prefix
    # within a prefix, addresses take turns; within an address, keys; within a key, newest first
    same = [cand(1, "a", "10.0.0.1"), cand(2, "a", "10.0.0.1"), cand(3, "b", "10.0.0.1"), cand(4, "c", "10.0.0.2")]
    ids, _ = lease_order(same, 4)
    assert workers_of(ids, same)[:2] in (["a", "c"], ["c", "a"]) and ids.index(SubmissionId(f"{2:064x}")) < ids.index(SubmissionId(f"{1:064x}"))
