"""The run page's leaderboard cannot take a growing share of the coordinator's time.

It used to scan the whole submission history (every row ever stored: counters stay unique for
the run) under the store's lock, which the ingest's admission also takes on the event loop:
rebuilt every second, 200,000 rows of history (≈ 0.3 s a build; hostile workers can each add
rows with a fresh key) held the lock about a third of the time. It now reads the ledger's
per-worker read model, and whatever that costs it is rebuilt only when ``BOARD_DUTY_FACTOR``
times its last build time has passed (checked with a clock the ledger advances, so no wall time
is measured).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node.web.runpage import BOARD_DUTY_FACTOR, RunPage
from protocol.identity import NodeKey
from protocol.runspec import RunInfo, RunSpec, sign_run_spec
from trainer.ledger import BanBook, SubmissionLedger

COORD = NodeKey.from_seed(b"c" * 32)
SIGNED = sign_run_spec(RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=1)), COORD)
SCAN_S = 1.0
"""What one scan of the history costs on the test's clock, seconds."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _LongHistory(SubmissionLedger):
    """A ledger whose leaderboard takes :data:`SCAN_S` on the test's clock."""

    clock: _Clock
    scans = 0

    def leaderboard(self, limit: int) -> list[dict[str, Any]]:
        self.scans += 1
        self.clock.now += SCAN_S
        return [{"peer_id": f"worker{i}", "accepted": i, "rejected": 0, "pending": 0, "submissions_trained": 0, "rollouts_trained": 0,
                 "tokens": 0} for i in range(3)]


def test_the_leaderboard_scans_the_history_a_bounded_share_of_the_time(tmp_path: Path) -> None:
    clock = _Clock()
    store = _LongHistory(tmp_path / "ingest", SIGNED.spec, BanBook(tmp_path / "bans.msgpack", COORD, SIGNED.run_id),
                         trainer_step=lambda: 0, latest_policy_step=lambda: 0)
    store.clock = clock
    try:
        page = RunPage(SIGNED, store, status=dict, metrics_path=tmp_path / "metrics.jsonl", peer_id=COORD.peer_id, clock=clock)
        first = page.build([])
        assert store.scans == 1 and b"worker2" in first
        built_at = clock.now
        while clock.now < built_at + (BOARD_DUTY_FACTOR - 1) * SCAN_S - 1.0:  # one rebuild a second, as the refresh task does
            clock.now += 1.0
            assert b"worker2" in page.build([])  # the last leaderboard is shown meanwhile
        assert store.scans == 1
        clock.now = built_at + (BOARD_DUTY_FACTOR - 1) * SCAN_S
        page.build([])
        assert store.scans == 2  # due again: at most one scan per BOARD_DUTY_FACTOR × its cost
    finally:
        store.close()
