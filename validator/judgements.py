"""What a validator judged, remembered across restarts: which (worker, counter) pairs it has judged
(its replay check), each worker's reputation, and its verified history for spot checks
(:mod:`validator.spot`). Not the coordinator's submission ledger (``trainer/ledger/``): a
validator's own record of its judgements."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from validator.spot import is_doubt, next_verified

_SCHEMA = """
CREATE TABLE IF NOT EXISTS judged (
    worker TEXT NOT NULL,
    counter INTEGER NOT NULL,
    submission_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (worker, counter, submission_id)
);
CREATE TABLE IF NOT EXISTS reputation (
    worker TEXT NOT NULL,
    reason TEXT NOT NULL,
    n INTEGER NOT NULL,
    PRIMARY KEY (worker, reason)
);
CREATE TABLE IF NOT EXISTS history (
    worker TEXT PRIMARY KEY,
    verified INTEGER NOT NULL,
    doubts INTEGER NOT NULL
);
"""


class Judgements:
    """Judged submissions, per-worker verdict counts and verified history, in SQLite under ``path``
    (survives restarts).

    Args:
        path: the database file.
    """

    def __init__(self, path: Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # a commit per verdict without an fsync each (WAL stays consistent; a power cut may lose the last
        # verdicts' records: their submissions are judged again, and the history only counts lower)
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def counter_seen(self, worker: str, counter: int, submission_id: str) -> bool:
        """Whether ``worker`` used ``counter`` in a *different* submission already judged (a replay)."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM judged WHERE worker = ? AND counter = ? AND submission_id != ? LIMIT 1", (worker, counter, submission_id)
            ).fetchone()
        return row is not None

    def already_judged(self, submission_id: str) -> str | None:
        """The reason this validator gave ``submission_id`` before, if any."""
        with self._lock:
            row = self._db.execute("SELECT reason FROM judged WHERE submission_id = ? LIMIT 1", (submission_id,)).fetchone()
        return row[0] if row else None

    def record(self, worker: str, counter: int, submission_id: str, reason: str, *, full: bool = True) -> None:
        """Remember a verdict, count it in the worker's reputation and update its verified history.

        A submission judged again (re-leased after a lease expired or a restart) is counted once.
        The worker's verified count moves by :func:`validator.spot.next_verified` (+1 for an accept
        after a full check, 0 after a doubt).

        Args:
            full: whether the verdict came from a full check (light: no model work).
        """
        with self._lock:
            self._db.execute("BEGIN")
            new = self._db.execute("INSERT OR IGNORE INTO judged (worker, counter, submission_id, reason) VALUES (?, ?, ?, ?)",
                                   (worker, counter, submission_id, reason)).rowcount
            if new:
                self._db.execute("INSERT INTO reputation (worker, reason, n) VALUES (?, ?, 1) ON CONFLICT(worker, reason) DO UPDATE SET n = n + 1",
                                 (worker, reason))
                row = self._db.execute("SELECT verified FROM history WHERE worker = ?", (worker,)).fetchone()
                before = int(row[0]) if row else 0
                after, doubt = next_verified(before, reason, full), int(is_doubt(reason))
                if after != before or doubt:
                    self._db.execute("INSERT INTO history (worker, verified, doubts) VALUES (?, ?, ?) ON CONFLICT(worker) DO UPDATE SET "
                                     "verified = excluded.verified, doubts = doubts + excluded.doubts", (worker, after, doubt))
            self._db.execute("COMMIT")

    def verified(self, worker: str) -> int:
        """Fully checked, accepted submissions of ``worker`` since its last doubt (0 if none)."""
        with self._lock:
            row = self._db.execute("SELECT verified FROM history WHERE worker = ?", (worker,)).fetchone()
        return int(row[0]) if row else 0

    def reputation(self) -> dict[str, dict[str, int]]:
        """Per worker: verdict counts by reason (``ok`` for accepted)."""
        with self._lock:
            rows = self._db.execute("SELECT worker, reason, n FROM reputation").fetchall()
        out: dict[str, dict[str, int]] = {}
        for worker, reason, n in rows:
            out.setdefault(worker, {})[reason] = int(n)
        return out
