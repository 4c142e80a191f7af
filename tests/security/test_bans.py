"""No ban on one noisy check (issue 12, item 9): benign reasons, contradicting verdicts, and bans
only on a cheat reproduced by a second independent check, with the evidence in the ban record."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from ingest_attack_helpers import (
    COORD,
    RUN,
    SPEC,
    VALIDATOR,
    VALIDATOR2,
    honest_session,
    post,
    running_ingest,
    submission,
    verdict,
)
from waiting import wait_until

from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.ingest_api import SUBMISSIONS_ROUTE, VERDICTS_ROUTE
from protocol.messages import BanList
from protocol.verdicts import BENIGN_REASONS, CHEAT_REASONS, is_cheat
from trainer.ingest.limits import IngestLimits
from trainer.ledger import RecheckResult
from trainer.ledger.states import PENDING
from validator.rewards import mismatch_reason


class Recheck:
    """A stand-in for the coordinator's re-check that answers ``result`` and counts its calls."""

    def __init__(self, accepted: bool, reason: str) -> None:
        self.result = RecheckResult(accepted, reason, "rollout=0", COORD.peer_id)
        self.calls = 0
        self.done = threading.Event()

    def __call__(self, raw: bytes) -> RecheckResult:
        self.calls += 1
        self.done.set()
        return self.result


async def _stored(ing, worker: NodeKey, counter: int = 0) -> bytes:
    sub = submission(worker, counter=counter)
    async with honest_session(ing.url) as http:
        status, _ = await post(http, SUBMISSIONS_ROUTE, sub)
    assert status == 200
    return sub


async def test_benign_reasons_never_ban_nor_recheck(tmp_path: Path) -> None:
    recheck = Recheck(False, "toploc")
    async with running_ingest(tmp_path, recheck=recheck) as ing:
        for i, reason in enumerate(sorted(BENIGN_REASONS)):
            w = NodeKey.generate()
            sub = await _stored(ing, w, i)
            assert ing.service.apply_verdict(verdict(sub, False, reason)) is True
            assert not ing.bans.is_banned(w.peer_id)
        assert recheck.calls == 0 and ing.bans.entries() == []
        assert list(ing.store.dir.glob("*.sub")) == []  # a benign rejection is final: files deleted


async def test_contradicting_second_verdict_neither_applies_nor_bans(tmp_path: Path) -> None:
    recheck = Recheck(False, "toploc")
    w = NodeKey.generate()
    async with running_ingest(tmp_path, recheck=recheck) as ing:
        sub = await _stored(ing, w)
        sid = open_envelope(sub, run_id=RUN).id.hex()
        assert ing.service.apply_verdict(verdict(sub, True, "ok", key=VALIDATOR)) is True
        assert ing.service.apply_verdict(verdict(sub, False, "toploc", key=VALIDATOR2)) is False
        assert ing.store.get(sid).state == "accepted" and not ing.bans.is_banned(w.peer_id) and recheck.calls == 0


async def test_one_cheat_verdict_not_reproduced_by_the_recheck_does_not_ban(tmp_path: Path) -> None:
    recheck = Recheck(True, "ok")  # e.g. the validator's own wall clock was the problem
    w = NodeKey.generate()
    async with running_ingest(tmp_path, recheck=recheck) as ing:
        sub = await _stored(ing, w)
        assert ing.service.apply_verdict(verdict(sub, False, "reward", reported=1.0, recomputed=0.0)) is True
        await wait_until(lambda: ing.service.ban_rule.rechecks["not_reproduced"] == 1, what="re-check done")
        assert not ing.bans.is_banned(w.peer_id) and recheck.calls == 1
        assert ing.store.get(open_envelope(sub, run_id=RUN).id.hex()).state == "rejected"  # still never trained on
        await wait_until(lambda: not list(ing.store.dir.glob("*.sub")), what="file deleted")
        # and the same validator saying it twice is not a second independent check
        assert ing.service.apply_verdict(verdict(sub, False, "reward", key=VALIDATOR)) is False
        assert not ing.bans.is_banned(w.peer_id)


async def test_cheat_reproduced_by_the_coordinator_bans_with_evidence(tmp_path: Path) -> None:
    recheck = Recheck(False, "toploc")
    w, other = NodeKey.generate(), NodeKey.generate()
    async with running_ingest(tmp_path, recheck=recheck) as ing, honest_session(ing.url) as http:
        sub = await _stored(ing, w, 0)
        later = await _stored(ing, w, 1)
        honest = await _stored(ing, other, 0)
        status, body = await post(http, VERDICTS_ROUTE, verdict(sub, False, "toploc", rollout=0, chunk=3))
        assert (status, body) == (200, {"applied": True})
        await wait_until(lambda: ing.gossiped, what="ban published")
        env = open_envelope(ing.gossiped[-1], run_id=RUN, expect=BanList, authorities=SPEC.authorities)
        (entry,) = env.body.entries
        assert entry.peer_id == w.peer_id and entry.reason == "toploc" and entry.submission_id == open_envelope(sub, run_id=RUN).id
        first, second = entry.evidence
        assert (first.by, first.reason, second.by, second.reason) == (VALIDATOR.peer_id, "toploc", COORD.peer_id, "toploc")
        assert first.verdict_id == entry.verdict_id and len(first.verdict_id) == 32 and "chunk=3" in first.detail
        assert ing.store.get(open_envelope(later, run_id=RUN).id.hex()).state == "rejected"  # its pending work goes too
        assert ing.store.get(open_envelope(honest, run_id=RUN).id.hex()).state in PENDING
        async with http.get("/status") as r:
            st = await r.json()
        assert st["banned"][0]["evidence"] == [f"toploc by {VALIDATOR.peer_id}", f"toploc by {COORD.peer_id}"]
        assert st["rechecks"]["reproduced"] == 1


async def test_cheat_reproduced_by_a_second_validator_bans_without_a_recheck(tmp_path: Path) -> None:
    w = NodeKey.generate()
    async with running_ingest(tmp_path, recheck=None) as ing:
        sub = await _stored(ing, w)
        assert ing.service.apply_verdict(verdict(sub, False, "sampling", key=VALIDATOR)) is True
        assert not ing.bans.is_banned(w.peer_id)  # one check is not enough
        v2 = verdict(sub, False, "toploc", key=VALIDATOR2)
        assert ing.service.apply_verdict(v2) is False  # not deciding, but it corroborates
        (entry,) = ing.bans.entries()
        assert entry.reason == "sampling"
        assert [(e.by, e.reason) for e in entry.evidence] == [(VALIDATOR.peer_id, "sampling"), (VALIDATOR2.peer_id, "toploc")]
        assert entry.evidence[1].verdict_id == open_envelope(v2, run_id=RUN, authorities=SPEC.authorities).id


def test_reason_families_are_disjoint() -> None:
    assert not CHEAT_REASONS & BENIGN_REASONS
    assert {"reward_error", "limit_hit", "resources", "unknown_checkpoint", "timeout"} <= BENIGN_REASONS
    assert is_cheat("reward") and not is_cheat("reward_error") and not is_cheat("limit_hit")


@pytest.mark.parametrize(
    ("reported", "recomputed", "limit_hit", "reason"),
    [
        # the validator's own scoring hit a limit (its load, its memory): the worker may be right (issue 12, item 9)
        (1.0, 0.0, "wall", "limit_hit"),
        (1.0, 0.0, "cpu", "limit_hit"),
        (1.0, 0.0, "memory", "limit_hit"),
        # the worker's scoring hit a limit: it scored 0 what passes here
        (0.0, 1.0, None, "limit_hit"),
        # an inflated reward with no limit in sight
        (1.0, 0.0, None, "reward"),
    ],
)
def test_reward_mismatch_reasons(reported: float, recomputed: float, limit_hit: str | None, reason: str) -> None:
    assert mismatch_reason(reported, recomputed, limit_hit) == reason


@pytest.mark.slow
def test_a_long_ban_list_still_fits_its_signed_size(tmp_path: Path) -> None:
    """Free identities can get themselves banned by the thousand: the signed list must stay valid."""
    import time

    from protocol.messages import BanEntry, BanEvidence
    from trainer.ledger import BanBook

    book = BanBook(tmp_path / "bans.msgpack", COORD, RUN)
    detail = "x" * 200
    for i in range(6000):  # ≈ 0.8 KiB each with full evidence: ≈ 4.7 MiB, over ban_list/1's 4 MiB
        pid = NodeKey.generate().peer_id
        ev = [BanEvidence(by=VALIDATOR.peer_id, verdict_id=bytes(32), reason="toploc", detail=detail),
              BanEvidence(by=COORD.peer_id, reason="toploc", detail=detail)]
        book._entries[pid] = BanEntry(peer_id=pid, reason="toploc", since_ms=int(time.time() * 1000) - 10_000 + i, verdict_id=bytes(32), evidence=ev)
    assert book.ban(VALIDATOR2.peer_id, "sampling", bytes(32), evidence=[BanEvidence(by=VALIDATOR.peer_id, reason="sampling")])
    env = open_envelope(book.envelope, run_id=RUN, expect=BanList, authorities=SPEC.authorities)
    by_id = {e.peer_id: e for e in env.body.entries}
    assert len(by_id) == 6001 and len(book.envelope) <= BanList.MAX_BYTES
    assert by_id[VALIDATOR2.peer_id].evidence  # the newest keep their evidence, the oldest lost it
    oldest = min(env.body.entries, key=lambda e: e.since_ms)
    assert oldest.evidence == []


async def test_queued_rechecks_hold_no_submission_bytes(tmp_path: Path) -> None:
    """Cheat verdicts on big junk submissions while the re-check is busy: the queue holds their IDs
    (64 queued 32 MiB bodies would be 2 GiB of the coordinator's memory); each is read when its
    turn comes, and still reproduced and banned."""
    release = threading.Event()

    class Blocked(Recheck):
        def __call__(self, raw: bytes) -> RecheckResult:
            assert len(raw) > 1 << 20  # the whole stored submission, read when re-checked
            release.wait(30)
            return super().__call__(raw)

    recheck = Blocked(False, "toploc")
    workers = [NodeKey.generate() for _ in range(6)]
    async with running_ingest(tmp_path, recheck=recheck) as ing, honest_session(ing.url) as http:
        subs = []
        for w in workers:
            sub = submission(w, payload_tokens=1 << 18)  # ≈ 2 MiB of completion and log-probs
            status, _ = await post(http, "/ingest/1/submissions", sub)
            assert status == 200
            subs.append(sub)
        try:
            for sub in subs:
                assert ing.service.apply_verdict(verdict(sub, False, "toploc")) is True
            queued = list(ing.service.ban_rule._waiting.values())
            assert len(queued) >= len(subs) - 1 and all(isinstance(q, str) for q in queued), queued
        finally:
            release.set()
        await wait_until(lambda: all(ing.bans.is_banned(w.peer_id) for w in workers), what="every cheat reproduced and banned")
        assert recheck.calls == len(subs)


async def test_one_cheater_cannot_fill_the_recheck_queue_for_others(tmp_path: Path) -> None:
    """Many cheat verdicts against one worker while the re-check is busy take one place in the
    queue (one reproduction bans it); another cheater's verdict still gets its re-check and ban,
    and the coalesced submissions' files are deleted (rejected, never read again)."""
    release = threading.Event()

    class Blocked(Recheck):
        def __call__(self, raw: bytes) -> RecheckResult:
            release.wait(30)
            return super().__call__(raw)

    recheck = Blocked(False, "toploc")
    flooder, other = NodeKey.generate(), NodeKey.generate()
    limits = IngestLimits(max_pending_rechecks=2, requests_per_s=1000.0, burst=1000)
    async with running_ingest(tmp_path, recheck=recheck, limits=limits) as ing, honest_session(ing.url) as http:
        flood = [submission(flooder, counter=c) for c in range(8)]
        late = submission(other)
        try:
            for sub in [*flood, late]:  # each judged right away (the worker's pending quota stays free)
                assert (await post(http, "/ingest/1/submissions", sub))[0] == 200
                assert ing.service.apply_verdict(verdict(sub, False, "toploc")) is True
            assert ing.service.ban_rule.rechecks.get("dropped", 0) == 0
            # per worker one waits (and one may be in progress): the other worker always got its place
            assert ing.service.ban_rule.rechecks["queued"] <= 3 and other.peer_id in ing.service.ban_rule._waiting
            assert ing.service.ban_rule.rechecks["coalesced"] >= len(flood) - 2
        finally:
            release.set()
        await wait_until(lambda: ing.bans.is_banned(flooder.peer_id) and ing.bans.is_banned(other.peer_id), what="both cheaters banned")
        assert recheck.calls == 2
        # the ban is published first (so nothing of the worker's is admitted after), then its files go
        await wait_until(lambda: not list((tmp_path / "ingest").rglob("*.sub")), what="every file of both cheaters deleted")
