"""Judgements (a validator's record of what it judged): replay memory, reputation counts, persistence across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from validator.judgements import Judgements

A = "12D3KooWworkerA"
B = "12D3KooWworkerB"


@pytest.fixture
def ledger(tmp_path: Path):
    led = Judgements(tmp_path / "sub" / "validator.sqlite")  # parent directories are created
    yield led
    led.close()


def test_replay_is_a_counter_reused_by_another_submission(ledger: Judgements) -> None:
    assert not ledger.counter_seen(A, 0, "s1")
    ledger.record(A, 0, "s1", "ok")
    assert not ledger.counter_seen(A, 0, "s1")  # the same submission judged again is no replay
    assert ledger.counter_seen(A, 0, "s2")  # new content under a used counter is
    assert not ledger.counter_seen(A, 1, "s2")
    assert not ledger.counter_seen(B, 0, "s2")  # counters are per worker
    # a rejected submission uses its counter up too
    ledger.record(B, 5, "s3", "toploc")
    assert ledger.counter_seen(B, 5, "s4")


def test_already_judged_returns_the_first_reason(ledger: Judgements) -> None:
    assert ledger.already_judged("s1") is None
    ledger.record(A, 0, "s1", "sampling")
    assert ledger.already_judged("s1") == "sampling"


def test_reputation_counts_by_reason(ledger: Judgements) -> None:
    for i in range(3):
        ledger.record(A, i, f"a{i}", "ok")
    ledger.record(A, 3, "a3", "stale_policy")
    ledger.record(B, 0, "b0", "toploc")
    ledger.record(B, 1, "b1", "ok")
    assert ledger.reputation() == {A: {"ok": 3, "stale_policy": 1}, B: {"toploc": 1, "ok": 1}}


def test_a_submission_judged_again_counts_once(ledger: Judgements) -> None:
    """A re-leased submission (lease expired, validator restarted) must not inflate the counts."""
    ledger.record(A, 0, "s1", "toploc")
    ledger.record(A, 0, "s1", "toploc")
    assert ledger.reputation() == {A: {"toploc": 1}}


def test_ledger_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "validator.sqlite"
    led = Judgements(path)
    led.record(A, 0, "s1", "ok")
    led.record(A, 1, "s2", "replay")
    led.close()
    led = Judgements(path)
    try:
        assert led.counter_seen(A, 0, "other")
        assert led.reputation() == {A: {"ok": 1, "replay": 1}}
    finally:
        led.close()
