"""Probation's share of the disk quota is shared out per address prefix by displacement
(``trainer/ledger/ledger.py`` ``admit``, ``docs/protocol.md`` "Quotas").

A Sybil flood from a few /24s with fresh keys kept the share full, and a new honest worker from a
prefix of its own got 507 ``probation_quota`` until the flood let up (never, in one 120 s run).
Now a submission from a prefix holding less of the share than the heaviest one takes the place
of that prefix's newest never-leased submission, which is *displaced*: no verdict, no ban, no
rejection, its counter free again, its file gone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_ingest import COORD, RUN, SPEC, submission, verdict
from waiting import wait_for

from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission
from trainer.errors import Refused
from trainer.ledger import BanBook, State, SubmissionLedger
from trainer.ledger.ban_rule import BanRule
from trainer.ledger.ledger import Quotas
from trainer.ledger.schema import in_states
from trainer.ledger.states import PENDING

QUOTAS = Quotas(max_disk_files=16, max_pending_per_ip=64)  # probation's share: 8 files


def open_ledger(root: Path) -> SubmissionLedger:
    return SubmissionLedger(root, SPEC, BanBook(root / "bans.msgpack", COORD, RUN), trainer_step=lambda: 0, latest_policy_step=lambda: 0,
                            quotas=QUOTAS)


def admit(ledger: SubmissionLedger, raw: bytes, address: str) -> str:
    env = open_envelope(raw, run_id=RUN, expect=Submission)
    adm = ledger.admit(env, address)
    assert adm.durable is not None and adm.durable.result(timeout=30) is True
    ledger.stored(adm.sid, env.body)
    return adm.sid


def sid_of(raw: bytes) -> str:
    return open_envelope(raw, run_id=RUN, expect=Submission).id.hex()


def accept(rule: BanRule, raw: bytes) -> bool:
    return rule.apply(open_envelope(verdict(raw, True, "ok"), run_id=RUN, authorities=SPEC.authorities))


def file_goes(ledger: SubmissionLedger, sid: str) -> None:
    """A displaced submission's file is deleted by a writer thread, soon after."""
    path = ledger.store.dir / f"{sid}.sub"
    wait_for(lambda: not path.exists(), timeout_s=10, what=f"{sid[:12]}'s file deleted")


def assert_read_model_exact(ledger: SubmissionLedger) -> None:
    """The per-allocation and per-prefix probation holdings kept by triggers equal ones computed from the index."""
    db = ledger.store._db
    for table, col, extra in (("probation_prefixes", "prefix", ", allocation"), ("probation_allocations", "allocation", "")):
        kept = sorted(db.execute(f"SELECT {col}{extra}, pending, pending_bytes, stored FROM {table}").fetchall())
        fresh = sorted(db.execute(
            f"SELECT s.{col}{', MIN(s.allocation)' if extra else ''}, COUNT(*), SUM(s.size_bytes), SUM(s.state = 'stored') FROM submissions s"
            f" LEFT JOIN worker_stats w ON w.worker = s.worker WHERE s.state IN {in_states(PENDING)} AND COALESCE(w.accepted, 0) = 0"
            f" GROUP BY s.{col}").fetchall())
        assert kept == fresh, table


KEYS: list[NodeKey] = []  # every key fill() made


def fill(ledger: SubmissionLedger, layout: dict[str, int]) -> dict[str, list[bytes]]:
    """Fresh keys from each prefix (``layout``: its first three octets → how many), one from each in turn."""
    posted: dict[str, list[bytes]] = {p: [] for p in layout}
    for _ in range(max(layout.values())):
        for p, n in layout.items():
            if len(posted[p]) < n:
                KEYS.append(key := NodeKey.generate())
                raw = submission(key)
                admit(ledger, raw, f"{p}.{len(posted[p]) + 1}")
                posted[p].append(raw)
    return posted


def test_a_new_prefix_displaces_the_heaviest_prefixs_newest_unleased_submission(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path)
    try:
        posted = fill(ledger, {"10.1.0": 3, "10.2.0": 1, "10.3.0": 1, "10.4.0": 1, "10.5.0": 1, "10.6.0": 1})  # the share (8) is full
        heavy = posted["10.1.0"]
        now = 1_000
        assert ledger.store.lease([sid_of(heavy[2])], now + 60_000, now) == [sid_of(heavy[2])]  # its newest is with a validator
        newcomer = NodeKey.generate()
        with pytest.raises(Refused) as e:  # nobody lighter: a fourth key from the heaviest prefix is refused
            admit(ledger, submission(NodeKey.generate()), "10.1.0.9")
        assert e.value.code == "probation_quota"
        sid = admit(ledger, first := submission(newcomer), "10.9.0.1")  # old code: 507 probation_quota
        victim = sid_of(heavy[1])  # the heaviest prefix's newest never-leased one
        assert ledger.get(victim).state is State.DISPLACED
        file_goes(ledger, victim)
        assert (ledger.store.dir / f"{sid}.sub").exists()
        assert all(ledger.get(sid_of(r)).state in PENDING for p, rs in posted.items() for r in rs if sid_of(r) != victim)
        assert ledger.counts()["pending"] == 8 and ledger.counts()["displaced"] == 1 and ledger.counts()["rejected"] == 0
        assert_read_model_exact(ledger)
        # the newcomer is leased and accepted like anyone on probation
        assert ledger.lease(8, 30.0, now_ms=now)
        rule = BanRule(ledger)
        assert accept(rule, first) is True
        rule.close()
        assert_read_model_exact(ledger)
    finally:
        ledger.close()


def test_a_prefix_never_displaces_one_holding_no_more_than_it_would(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path)
    try:
        posted = fill(ledger, {"10.1.0": 4, "10.2.0": 3, "10.3.0": 1})
        refused(ledger, "10.1.0.9")  # the heaviest: nobody holds more
        refused(ledger, "10.2.0.9")  # would hold 4, as the heaviest does
        assert ledger.precheck("10.3.0.9") is False  # would hold 2 of 4: its body is read (old code: 507 before the body)
        admit(ledger, submission(NodeKey.generate()), "10.3.0.9")
        assert ledger.get(sid_of(posted["10.1.0"][3])).state is State.DISPLACED  # now 3 / 3 / 2
        refused(ledger, "10.1.0.10")  # one prefix cannot push others out by holding more
        refused(ledger, "10.2.0.10")
        assert ledger.counts()["displaced"] == 1
        assert_read_model_exact(ledger)
    finally:
        ledger.close()


def refused(ledger: SubmissionLedger, address: str) -> None:
    """Refused ``probation_quota`` before its body is read and again at admission (nothing displaced)."""
    displaced = ledger.counts().get("displaced", 0)
    with pytest.raises(Refused) as e:
        ledger.precheck(address)
    assert e.value.code == "probation_quota"
    with pytest.raises(Refused) as e:
        admit(ledger, submission(NodeKey.generate()), address)
    assert e.value.code == "probation_quota"
    assert ledger.counts().get("displaced", 0) == displaced


def test_a_displaced_worker_is_not_banned_and_may_submit_its_counter_again(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path)
    rule = BanRule(ledger)
    try:
        posted = fill(ledger, {"10.1.0": 5, "10.2.0": 3})
        raw = posted["10.1.0"][4]
        worker = open_envelope(raw, run_id=RUN, expect=Submission).body.worker
        admit(ledger, first := submission(NodeKey.generate()), "10.9.0.1")
        assert ledger.get(sid_of(raw)).state is State.DISPLACED
        file_goes(ledger, sid_of(raw))
        assert not ledger.bans.is_banned(worker) and rule.rechecks["queued"] == 0
        assert ledger.worker_stats()[worker] == {"displaced": 1}  # not rejected
        with pytest.raises(Refused) as e:  # the same bytes now would make its prefix the heaviest again: refused, not a "duplicate"
            admit(ledger, raw, "10.1.0.5")
        assert e.value.code == "probation_quota"
        assert accept(rule, first)  # the newcomer is established: room for one
        assert admit(ledger, raw, "10.1.0.5") == sid_of(raw)  # the same bytes: stored again (old code: a duplicate, "rejected")
        assert ledger.get(sid_of(raw)).state is State.STORED and (ledger.store.dir / f"{sid_of(raw)}.sub").exists()
        assert ledger.worker_stats()[worker] == {"pending": 1} and ledger.counts()["displaced"] == 0
        assert_read_model_exact(ledger)
        # displaced again; its counter is free for another submission, after which the old bytes are a replay
        admit(ledger, second := submission(NodeKey.generate()), "10.8.0.1")
        assert ledger.get(sid_of(raw)).state is State.DISPLACED
        assert accept(rule, second)
        key = next(k for k in KEYS if k.peer_id == worker)
        other = submission(key, counter=0, payload=5)
        assert admit(ledger, other, "10.1.0.5")
        with pytest.raises(Refused) as e:
            admit(ledger, raw, "10.1.0.5")
        assert e.value.code == "replay"
        assert ledger.worker_stats()[worker] == {"pending": 1, "displaced": 1} and not ledger.bans.is_banned(worker)
    finally:
        rule.close()
        ledger.close()


def test_displacement_survives_a_restart_and_a_crash_before_the_file_went(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path)
    posted = fill(ledger, {"10.1.0": 5, "10.2.0": 3})
    victim, kept = sid_of(posted["10.1.0"][4]), sid_of(posted["10.1.0"][3])
    admit(ledger, submission(NodeKey.generate()), "10.9.0.1")
    before = (ledger.counts(), ledger.worker_stats())
    ledger.close()
    ledger = open_ledger(tmp_path)  # a clean restart: the same state, the same read models
    try:
        assert (ledger.counts(), ledger.worker_stats()) == before
        assert ledger.get(victim).state is State.DISPLACED and not (ledger.store.dir / f"{victim}.sub").exists()
        assert_read_model_exact(ledger)
        refused(ledger, "10.1.0.9")  # still the heaviest after the restart
    finally:
        ledger.close()
    # a crash between a displacement's commit and its file's deletion: the file decides, it is stored again
    (tmp_path / "submissions" / f"{victim}.sub").write_bytes(posted["10.1.0"][4])
    ledger = open_ledger(tmp_path)
    try:
        assert ledger.get(victim).state is State.STORED and ledger.get(kept).state is State.STORED
        assert ledger.counts()["displaced"] == 0 and ledger.counts()["pending"] == 9
        assert_read_model_exact(ledger)
    finally:
        ledger.close()


def test_when_bytes_are_short_the_prefix_holding_the_most_bytes_is_displaced(tmp_path: Path) -> None:
    big, small, medium = (len(submission(NodeKey.generate(), payload=n)) for n in (20_000, 4, 10_000))
    quotas = Quotas(max_disk_files=100, max_pending_per_ip=64, max_disk_bytes=2 * (3 * big + 4 * small + small // 2))
    ledger = SubmissionLedger(tmp_path, SPEC, BanBook(tmp_path / "bans.msgpack", COORD, RUN), trainer_step=lambda: 0,
                              latest_policy_step=lambda: 0, quotas=quotas)
    try:
        large = [submission(NodeKey.generate(), payload=20_000) for _ in range(3)]
        for i, raw in enumerate(large):
            admit(ledger, raw, f"10.1.0.{i + 1}")  # fewer files, more bytes
        for i in range(4):
            admit(ledger, submission(NodeKey.generate()), f"10.2.0.{i + 1}")  # more files, few bytes
        admit(ledger, submission(NodeKey.generate(), payload=10_000), "10.9.0.1")  # old code: 507 probation_quota
        assert ledger.get(sid_of(large[2])).state is State.DISPLACED
        assert ledger.counts() == {"pending": 7, "accepted": 0, "rejected": 0, "consumed": 0, "displaced": 1}
        assert medium < big
        assert_read_model_exact(ledger)
    finally:
        ledger.close()


def test_submissions_recovered_after_a_crash_keep_their_address_prefix(tmp_path: Path) -> None:
    """A crash (or power cut) that loses index rows leaves files that ``recover`` re-indexes. Old
    code re-indexed them with no address: all in one prefix ``""``, the heaviest, displaced first
    whatever prefix they came from. Each file now keeps its address, so they are shared out by
    their own prefixes: a newcomer displaces the heaviest real prefix's newest, not the newest file."""
    ledger = open_ledger(tmp_path / "before")
    posted = {"10.1.0": [], "10.2.0": []}
    for prefix, n in (("10.1.0", 5), ("10.2.0", 3)):  # the share (8) full; the newest files are the light prefix's
        for i in range(n):
            KEYS.append(key := NodeKey.generate())
            admit(ledger, raw := submission(key), f"{prefix}.{i + 1}")
            posted[prefix].append(raw)
    ledger.close()
    lost = tmp_path / "after"
    (lost / "submissions").mkdir(parents=True)
    for f in sorted((tmp_path / "before" / "submissions").glob("*.sub"), key=lambda p: p.stat().st_mtime):
        shutil.copy2(f, lost / "submissions" / f.name)  # every file, none of their index rows
    ledger = open_ledger(lost)
    try:
        assert ledger.counts()["pending"] == 8
        assert {c.address for c in ledger.store.leasable(0)} == {f"{p}.{i + 1}" for p, rs in posted.items() for i in range(len(rs))}
        assert ledger.store.usage("nobody", "10.1.0.3").prefix_pending == 5
        assert_read_model_exact(ledger)
        admit(ledger, submission(NodeKey.generate()), "10.9.0.1")
        assert ledger.get(sid_of(posted["10.1.0"][4])).state is State.DISPLACED  # old code: 10.2.0's newest
        assert all(ledger.get(sid_of(r)).state is State.STORED for r in posted["10.2.0"])
    finally:
        ledger.close()


def test_one_ipv6_allocation_weighs_as_one_whatever_its_48s(tmp_path: Path) -> None:
    """Probation's share was shared per /48, and one /32 holds 65,536 of them: 8 /48s of one /32
    holding one submission each filled the share, and a newcomer from another /32 got 507
    ``probation_quota`` (nobody held more than it would). Shared per /32 first, that /32 holds 8,
    and gives way; inside it, its /48s share its part (the heaviest /48 gives way first)."""
    ledger = open_ledger(tmp_path)
    try:
        crowd = [submission(NodeKey.generate()) for _ in range(8)]
        for i, raw in enumerate(crowd):
            admit(ledger, raw, f"2001:db8:{i + 1:x}::/64")  # eight /48s of 2001:db8::/32
        assert ledger.precheck("2001:db9:1::/64") is False  # it may displace: its body is read (old code: 507 before the body)
        admit(ledger, first := submission(NodeKey.generate()), "2001:db9:1::/64")  # old code: 507 probation_quota
        assert ledger.get(sid_of(crowd[-1])).state is State.DISPLACED  # the /32's newest (all its /48s hold 1)
        assert ledger.counts()["pending"] == 8 and ledger.counts()["displaced"] == 1
        assert_read_model_exact(ledger)
        refused(ledger, "2001:db8:99::/64")  # another /48 of the crowd's /32: the /32 holds 7, more than 2001:db9::/32's 1
        admit(ledger, submission(NodeKey.generate()), "2001:dba:1::/64")  # a third /32 still gets in (7 > 1)
        assert ledger.counts()["displaced"] == 2
        assert_read_model_exact(ledger)
        assert ledger.get(sid_of(first)).state is State.STORED
    finally:
        ledger.close()


def test_within_an_allocation_its_prefixes_share_its_part(tmp_path: Path) -> None:
    """A /48 of a /32 holding the most of the share does not push out a lighter /48 of the same /32,
    and is pushed out by it: a flood from one /48 cannot starve a newcomer next door; and when
    another /32 holds more, it gives way from its heaviest /48, not its lightest."""
    ledger = open_ledger(tmp_path)
    try:
        heavy = [submission(NodeKey.generate()) for _ in range(5)]
        for i, raw in enumerate(heavy):
            admit(ledger, raw, f"2001:db8:1:{i:x}::/64")  # /48 2001:db8:1:: holds 5
        light = submission(NodeKey.generate())
        admit(ledger, light, "2001:db8:2::/64")  # /48 2001:db8:2:: holds 1, the /32 6
        others = [submission(NodeKey.generate()) for _ in range(2)]
        for i, raw in enumerate(others):
            admit(ledger, raw, f"2001:db9:{i + 1:x}::/64")  # another /32: 2 (the share, 8, is full)
        admit(ledger, submission(NodeKey.generate()), "2001:dba::/64")  # a third /32: the heaviest /32's heaviest /48 gives way
        assert ledger.get(sid_of(heavy[-1])).state is State.DISPLACED and ledger.get(sid_of(light)).state is State.STORED
        admit(ledger, submission(NodeKey.generate()), "2001:db8:3::/64")  # next door, in the same /32: its heavy /48 gives way again
        assert ledger.get(sid_of(heavy[-2])).state is State.DISPLACED
        assert all(ledger.get(sid_of(r)).state is State.STORED for r in (light, *others))
        assert_read_model_exact(ledger)
    finally:
        ledger.close()
