"""The ledger index's schema (SQLite): its tables, the triggers that keep the read models, and
the migration of an index an older version wrote. Used by :mod:`trainer.ledger.store` only.

Tables: ``submissions`` (one row per stored submission, kept for the whole run so counters stay
unique; ``state`` is a :class:`~trainer.ledger.states.State`), ``verdicts`` (every verdict,
deciding or not), and the read models kept by triggers in the transaction of each change:
``worker_stats`` (per worker: pending and its bytes, accepted, rejected, stale, trained,
rollouts trained, completion tokens), ``verdict_reasons``, ``probation`` (pending work of
workers with no accepted submission), ``address_stats`` (accepted submissions per address).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from trainer.ledger.states import PENDING, State

SCHEMA_VERSION = 2
"""``PRAGMA user_version`` of an index this code wrote. Version 1 (no version set) kept states as
``pending``/``accepted``/``rejected`` plus ``consumed_step`` sentinels (−1 none, −2 untrainable);
it is migrated in place on open (:func:`_migrate_v1`)."""

STALE_REASON = "stale_policy"
"""The reason of a submission that left the async window before a verdict (``protocol.verdicts``)."""


def in_states(states: Iterable[State]) -> str:
    """``('a','b')``: an SQL list of state names (enum values, never input)."""
    return "(" + ",".join(f"'{s.value}'" for s in sorted(states)) + ")"


_JUDGED_OK = frozenset({State.ACCEPTED, State.CONSUMED, State.RETIRED})  # every accepted one, whatever became of it

_SCHEMA = """
CREATE TABLE IF NOT EXISTS submissions (
    id TEXT PRIMARY KEY,            -- SubmissionId: hex SHA-256 of the envelope bytes
    worker TEXT NOT NULL,
    policy_step INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    n_rollouts INTEGER NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,  -- completion tokens of its rollouts
    size_bytes INTEGER NOT NULL,
    received_ms INTEGER NOT NULL,
    state TEXT NOT NULL,            -- trainer.ledger.states.State
    reason TEXT NOT NULL DEFAULT '',  -- the deciding verdict's reason, or why it was rejected unjudged
    verdict_by TEXT NOT NULL DEFAULT '',
    lease_until_ms INTEGER NOT NULL DEFAULT 0,
    consumed_step INTEGER,          -- the trainer step that consumed it; NULL: none
    seq INTEGER NOT NULL,
    source_ip TEXT NOT NULL DEFAULT '',  -- address it was posted from (per-address quota, lease fairness)
    on_disk INTEGER NOT NULL DEFAULT 1   -- 0 once its file is deleted
);
CREATE INDEX IF NOT EXISTS submissions_state ON submissions(state, seq);
CREATE INDEX IF NOT EXISTS submissions_worker ON submissions(worker, counter);
CREATE INDEX IF NOT EXISTS submissions_worker_state ON submissions(worker, state, size_bytes);
CREATE INDEX IF NOT EXISTS submissions_ip_state ON submissions(source_ip, state, size_bytes);
CREATE INDEX IF NOT EXISTS submissions_on_disk ON submissions(on_disk, size_bytes);
CREATE INDEX IF NOT EXISTS submissions_seq ON submissions(seq);
CREATE TABLE IF NOT EXISTS verdicts (
    id TEXT PRIMARY KEY,            -- hex SHA-256 of the verdict envelope
    submission_id TEXT NOT NULL,
    validator TEXT NOT NULL,
    accepted INTEGER NOT NULL,
    reason TEXT NOT NULL,
    received_ms INTEGER NOT NULL,
    evidence TEXT NOT NULL DEFAULT ''  -- one-line summary of the verdict's evidence (for a ban record)
);
CREATE INDEX IF NOT EXISTS verdicts_submission ON verdicts(submission_id);
CREATE TABLE IF NOT EXISTS worker_stats (
    worker TEXT PRIMARY KEY,
    pending INTEGER NOT NULL DEFAULT 0,
    pending_bytes INTEGER NOT NULL DEFAULT 0,
    accepted INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    stale INTEGER NOT NULL DEFAULT 0,
    trained INTEGER NOT NULL DEFAULT 0,
    rollouts_trained INTEGER NOT NULL DEFAULT 0,
    tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS worker_stats_board ON worker_stats(accepted DESC, rejected, worker);
CREATE TABLE IF NOT EXISTS verdict_reasons (reason TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS address_stats (address TEXT PRIMARY KEY, accepted INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS probation (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    pending INTEGER NOT NULL,
    pending_bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO probation VALUES (1, 0, 0);
"""


def _terms(r: str) -> dict[str, str]:
    """The read model's per-row contributions, as SQL over row ``r`` (``NEW`` or ``OLD``)."""
    pending = f"({r}.state IN {in_states(PENDING)})"
    trained = f"({r}.consumed_step IS NOT NULL)"
    return {
        "pending": pending,
        "pending_bytes": f"{pending} * {r}.size_bytes",
        "accepted": f"({r}.state IN {in_states(_JUDGED_OK)})",
        "rejected": f"({r}.state = '{State.REJECTED.value}')",
        "stale": f"({r}.state = '{State.REJECTED.value}' AND {r}.reason = '{STALE_REASON}')",
        "trained": trained,
        "rollouts_trained": f"{trained} * {r}.n_rollouts",
    }


_STAT_COLUMNS = ("pending", "pending_bytes", "accepted", "rejected", "stale", "trained", "rollouts_trained", "tokens")


def _triggers() -> str:
    new, old = _terms("NEW"), _terms("OLD")
    cols = ", ".join(_STAT_COLUMNS)
    values = ", ".join([*(new[c] for c in _STAT_COLUMNS[:-1]), "NEW.tokens"])
    on_insert = ", ".join(f"{c} = {c} + excluded.{c}" for c in _STAT_COLUMNS)
    on_update = ", ".join(f"{c} = {c} + ({new[c]}) - ({old[c]})" for c in _STAT_COLUMNS[:-1])
    return f"""
CREATE TRIGGER IF NOT EXISTS ledger_insert AFTER INSERT ON submissions BEGIN
    INSERT INTO worker_stats (worker, {cols}) VALUES (NEW.worker, {values})
    ON CONFLICT (worker) DO UPDATE SET {on_insert};
END;
CREATE TRIGGER IF NOT EXISTS ledger_update AFTER UPDATE OF state, reason, consumed_step ON submissions BEGIN
    UPDATE worker_stats SET {on_update} WHERE worker = NEW.worker;
END;
CREATE TRIGGER IF NOT EXISTS ledger_address AFTER UPDATE OF state ON submissions
WHEN NEW.state = '{State.ACCEPTED.value}' AND OLD.state IN {in_states(PENDING)} BEGIN
    INSERT INTO address_stats VALUES (NEW.source_ip, 1) ON CONFLICT (address) DO UPDATE SET accepted = accepted + 1;
END;
CREATE TRIGGER IF NOT EXISTS ledger_verdict AFTER INSERT ON verdicts BEGIN
    INSERT INTO verdict_reasons VALUES (NEW.reason, 1) ON CONFLICT (reason) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS probation_insert AFTER INSERT ON worker_stats BEGIN
    UPDATE probation SET pending = pending + (NEW.accepted = 0) * NEW.pending,
                         pending_bytes = pending_bytes + (NEW.accepted = 0) * NEW.pending_bytes;
END;
CREATE TRIGGER IF NOT EXISTS probation_update AFTER UPDATE ON worker_stats BEGIN
    UPDATE probation SET pending = pending + (NEW.accepted = 0) * NEW.pending - (OLD.accepted = 0) * OLD.pending,
                         pending_bytes = pending_bytes + (NEW.accepted = 0) * NEW.pending_bytes - (OLD.accepted = 0) * OLD.pending_bytes;
END;
"""


def _split(script: str) -> list[str]:
    """The statements of ``script`` (a trigger's body keeps its inner ``;``), to run inside one
    transaction (``executescript`` would commit first)."""
    out: list[str] = []
    acc = ""
    for part in script.split(";"):
        acc += part + ";"
        if sqlite3.complete_statement(acc):
            if acc.strip(" \n;"):
                out.append(acc.strip())
            acc = ""
    return out


def _rebuild_read_models(db: sqlite3.Connection) -> None:
    """Fill the read-model tables from the index in one pass (after a migration)."""
    t = _terms("s")
    sums = ", ".join([*(f"SUM({t[c]})" for c in _STAT_COLUMNS[:-1]), "SUM(s.tokens)"])
    db.execute("DELETE FROM worker_stats")
    db.execute(f"INSERT INTO worker_stats (worker, {', '.join(_STAT_COLUMNS)}) SELECT s.worker, {sums} FROM submissions s GROUP BY s.worker")
    db.execute("DELETE FROM address_stats")
    db.execute(f"INSERT INTO address_stats SELECT source_ip, COUNT(*) FROM submissions WHERE state IN {in_states(_JUDGED_OK)} GROUP BY source_ip")
    db.execute("DELETE FROM verdict_reasons")
    db.execute("INSERT INTO verdict_reasons SELECT reason, COUNT(*) FROM verdicts GROUP BY reason")
    db.execute("UPDATE probation SET pending = (SELECT COALESCE(SUM(pending), 0) FROM worker_stats WHERE accepted = 0),"
               " pending_bytes = (SELECT COALESCE(SUM(pending_bytes), 0) FROM worker_stats WHERE accepted = 0)")


def _migrate_v1(db: sqlite3.Connection) -> int:
    """Rewrite a version-1 index (states ``pending``/``accepted``/``rejected``, ``consumed_step`` −1
    for none and −2 for untrainable) into this schema; returns the rows moved.

    pending → stored (an old lease is kept: leased until it ends); accepted and consumed (step ≥ 0)
    → consumed while its file is kept, else retired; accepted with its file gone or untrainable →
    retired; rejected stays.
    """
    cols = {row[1] for row in db.execute("PRAGMA table_info(submissions)")}
    for col, decl in (("source_ip", "TEXT NOT NULL DEFAULT ''"), ("on_disk", "INTEGER NOT NULL DEFAULT 1")):
        if col not in cols:  # an index made by an even older version
            db.execute(f"ALTER TABLE submissions ADD COLUMN {col} {decl}")
    if "evidence" not in {row[1] for row in db.execute("PRAGMA table_info(verdicts)")}:
        db.execute("ALTER TABLE verdicts ADD COLUMN evidence TEXT NOT NULL DEFAULT ''")
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'submissions' AND sql IS NOT NULL").fetchall():
        db.execute(f"DROP INDEX {name}")
    db.execute("ALTER TABLE submissions RENAME TO submissions_v1")
    for stmt in _split(_SCHEMA):
        db.execute(stmt)
    state = (f"CASE WHEN state = 'pending' THEN '{State.STORED.value}'"
             f" WHEN state = 'rejected' THEN '{State.REJECTED.value}'"
             f" WHEN consumed_step >= 0 AND on_disk = 1 THEN '{State.CONSUMED.value}'"
             f" WHEN consumed_step != -1 OR on_disk = 0 THEN '{State.RETIRED.value}'"
             f" ELSE '{State.ACCEPTED.value}' END")
    cur = db.execute(
        "INSERT INTO submissions (id, worker, policy_step, counter, n_rollouts, tokens, size_bytes, received_ms, state, reason, verdict_by,"
        " lease_until_ms, consumed_step, seq, source_ip, on_disk)"
        f" SELECT id, worker, policy_step, counter, n_rollouts, 0, size_bytes, received_ms, {state}, reason, verdict_by, lease_until_ms,"
        " CASE WHEN consumed_step >= 0 THEN consumed_step END, seq, source_ip, on_disk FROM submissions_v1")
    db.execute("DROP TABLE submissions_v1")
    return cur.rowcount


def open_schema(db: sqlite3.Connection) -> int:
    """Create the index on ``db``, or migrate one an older version wrote, in one transaction.

    Returns:
        How many submissions a migration moved, or −1 when there was nothing to migrate.
    """
    version = db.execute("PRAGMA user_version").fetchone()[0]
    old = version < SCHEMA_VERSION and db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'submissions'").fetchone()
    db.execute("BEGIN IMMEDIATE")
    try:
        n = _migrate_v1(db) if old else -1
        for stmt in _split(_SCHEMA + _triggers()):
            db.execute(stmt)
        if old:
            _rebuild_read_models(db)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    return n
