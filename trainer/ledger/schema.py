"""The ledger index's schema (SQLite): its tables, the triggers that keep the read models, and
the migration of an index an older version wrote. Used by :mod:`trainer.ledger.store` only.

Tables: ``submissions`` (one row per stored submission, kept for the whole run so counters stay
unique; ``state`` is a :class:`~trainer.ledger.states.State`), ``verdicts`` (every verdict,
deciding or not), and the read models kept by triggers in the transaction of each change:
``worker_stats`` (per worker: pending and its bytes, accepted, rejected, stale, trained,
rollouts trained, completion tokens, displaced), ``verdict_reasons``, ``probation`` (pending work
of workers with no accepted submission), ``probation_allocations`` and ``probation_prefixes`` (the
same per address allocation and per prefix, ``prefixes.py``, with how much of it was never leased:
what displacement weighs and may take, ``ledger.py``),
``address_stats`` (accepted submissions per address); and ``consumed_groups`` (the GRPO groups a
trainer step consumed, per submission, until the submission is retired: what the trainable view
leaves out, and what a resume from an earlier step gives back).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from trainer.ledger.prefixes import allocation_key, prefix_key
from trainer.ledger.states import PENDING, State

SCHEMA_VERSION = 4
"""``PRAGMA user_version`` of an index this code wrote. Version 1 (no version set) kept states as
``pending``/``accepted``/``rejected`` plus ``consumed_step`` sentinels (−1 none, −2 untrainable);
version 2 had no address prefix per submission, no ``displaced`` state and no per-prefix
probation table; version 3 no ``consumed_groups`` (the trainer's saved state held them) and no
address allocation (IPv6 /32) above the prefix. All are migrated in place on open
(:func:`_migrate_v1`, :func:`_migrate_v2`; the new tables are created, the read models rebuilt)."""

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
    on_disk INTEGER NOT NULL DEFAULT 1,  -- 0 once its file is deleted
    prefix TEXT NOT NULL DEFAULT '',     -- source_ip's prefix (trainer.ledger.prefixes): probation's fair share
    allocation TEXT NOT NULL DEFAULT ''  -- source_ip's allocation (trainer.ledger.prefixes): shared out before the prefix
);
CREATE INDEX IF NOT EXISTS submissions_state ON submissions(state, seq);
CREATE INDEX IF NOT EXISTS submissions_worker ON submissions(worker, counter);
CREATE INDEX IF NOT EXISTS submissions_worker_state ON submissions(worker, state, size_bytes);
CREATE INDEX IF NOT EXISTS submissions_ip_state ON submissions(source_ip, state, size_bytes);
CREATE INDEX IF NOT EXISTS submissions_on_disk ON submissions(on_disk, size_bytes);
CREATE INDEX IF NOT EXISTS submissions_seq ON submissions(seq);
CREATE INDEX IF NOT EXISTS submissions_prefix_state ON submissions(prefix, state, seq);
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
    tokens INTEGER NOT NULL DEFAULT 0,
    displaced INTEGER NOT NULL DEFAULT 0
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
CREATE TABLE IF NOT EXISTS probation_prefixes (  -- rows with pending > 0 only
    prefix TEXT PRIMARY KEY,
    allocation TEXT NOT NULL,        -- the allocation it is in
    pending INTEGER NOT NULL,        -- pending submissions of workers on probation posted from this prefix
    pending_bytes INTEGER NOT NULL,
    stored INTEGER NOT NULL          -- of them, never leased (state stored): what displacement may take
);
CREATE INDEX IF NOT EXISTS probation_prefixes_files ON probation_prefixes(allocation, pending);
CREATE INDEX IF NOT EXISTS probation_prefixes_bytes ON probation_prefixes(allocation, pending_bytes);
CREATE TABLE IF NOT EXISTS probation_allocations (  -- the same per allocation; rows with pending > 0 only
    allocation TEXT PRIMARY KEY,
    pending INTEGER NOT NULL,
    pending_bytes INTEGER NOT NULL,
    stored INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS probation_allocations_files ON probation_allocations(pending);
CREATE INDEX IF NOT EXISTS probation_allocations_bytes ON probation_allocations(pending_bytes);
CREATE TABLE IF NOT EXISTS consumed_groups (  -- rows of submissions not yet retired only
    submission_id TEXT NOT NULL,
    task_key TEXT NOT NULL,         -- the group's key (trainer.batch.GroupKey): task_key, group_seed
    group_seed INTEGER NOT NULL,
    step INTEGER NOT NULL,          -- the trainer step that consumed it; a resume from an earlier step forgets it
    PRIMARY KEY (submission_id, task_key, group_seed)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS consumed_groups_step ON consumed_groups(step);
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
        "displaced": f"({r}.state = '{State.DISPLACED.value}')",
    }


_STAT_COLUMNS = ("pending", "pending_bytes", "accepted", "rejected", "stale", "trained", "rollouts_trained", "displaced", "tokens")
"""worker_stats' counted columns; ``tokens`` (last) is added on insert only."""


def _on_probation(worker: str) -> str:
    """SQL: ``worker`` has no accepted submission (as worker_stats says at that moment)."""
    return f"COALESCE((SELECT accepted FROM worker_stats WHERE worker = {worker}), 0) = 0"


_HOLDINGS = (("probation_allocations", "allocation"), ("probation_prefixes", "prefix"))
"""The per-allocation and per-prefix probation holdings: (table, the submissions column it is keyed by)."""


def _add_to_holdings(r: str) -> str:
    """SQL: count row ``r`` (``NEW``) in its allocation's and its prefix's probation holding if it is
    pending and its worker on probation."""
    out = []
    for table, col in _HOLDINGS:
        extra_col, extra_val = (", allocation", f", {r}.allocation") if table == "probation_prefixes" else ("", "")
        out.append(f"INSERT INTO {table} ({col}{extra_col}, pending, pending_bytes, stored)"
                   f" SELECT {r}.{col}{extra_val}, 1, {r}.size_bytes, {r}.state = '{State.STORED.value}'"
                   f" WHERE {r}.state IN {in_states(PENDING)} AND {_on_probation(f'{r}.worker')}"
                   f" ON CONFLICT ({col}) DO UPDATE SET pending = pending + 1, pending_bytes = pending_bytes + excluded.pending_bytes,"
                   " stored = stored + excluded.stored;")
    return "\n    ".join(out)


def _take_from_holdings(r: str) -> str:
    """SQL: take row ``r`` (``OLD``) out of its allocation's and its prefix's probation holding if it
    was counted there."""
    stored, pending = f"'{State.STORED.value}'", in_states(PENDING)
    return "\n    ".join(
        f"UPDATE {table} SET pending = pending - 1, pending_bytes = pending_bytes - {r}.size_bytes,"
        f" stored = stored - ({r}.state = {stored}) WHERE {col} = {r}.{col} AND {r}.state IN {pending}"
        f" AND {_on_probation(f'{r}.worker')};" for table, col in _HOLDINGS)


def _drop_empty_holdings(r: str) -> str:
    """SQL: drop row ``r``'s (``OLD``) allocation and prefix holdings if they are left empty."""
    return "\n    ".join(f"DELETE FROM {table} WHERE {col} = {r}.{col} AND pending <= 0;" for table, col in _HOLDINGS)


def _established_holdings() -> str:
    """SQL of a worker just established (``NEW`` of worker_stats): its other pending rows leave probation's holdings."""
    pending, stored = in_states(PENDING), f"'{State.STORED.value}'"
    out = []
    for table, col in _HOLDINGS:
        of_worker = f"FROM submissions s WHERE s.worker = NEW.worker AND s.{col} = {table}.{col} AND s.state IN {pending}"
        out.append(f"""UPDATE {table} SET pending = pending - (SELECT COUNT(*) {of_worker}),
                              pending_bytes = pending_bytes - (SELECT COALESCE(SUM(s.size_bytes), 0) {of_worker}),
                              stored = stored - (SELECT COUNT(*) {of_worker} AND s.state = {stored})
    WHERE {col} IN (SELECT {col} FROM submissions WHERE worker = NEW.worker AND state IN {pending});
    DELETE FROM {table} WHERE pending <= 0 AND {col} IN (SELECT {col} FROM submissions WHERE worker = NEW.worker AND state IN {pending});""")
    return "\n    ".join(out)


def _triggers() -> str:
    new, old = _terms("NEW"), _terms("OLD")
    cols = ", ".join(_STAT_COLUMNS)
    values = ", ".join([*(new[c] for c in _STAT_COLUMNS[:-1]), "NEW.tokens"])
    on_insert = ", ".join(f"{c} = {c} + excluded.{c}" for c in _STAT_COLUMNS)
    on_update = ", ".join(f"{c} = {c} + ({new[c]}) - ({old[c]})" for c in _STAT_COLUMNS[:-1])
    # The per-allocation and per-prefix probation holdings change in ledger_update before worker_stats
    # does: an accept takes its own row out while its worker is still on probation, and
    # probation_established (fired by that worker_stats update) then takes out the worker's other pending rows.
    return f"""
CREATE TRIGGER IF NOT EXISTS ledger_insert AFTER INSERT ON submissions BEGIN
    INSERT INTO worker_stats (worker, {cols}) VALUES (NEW.worker, {values})
    ON CONFLICT (worker) DO UPDATE SET {on_insert};
    {_add_to_holdings("NEW")}
END;
CREATE TRIGGER IF NOT EXISTS ledger_update AFTER UPDATE OF state, reason, consumed_step, prefix, allocation ON submissions BEGIN
    {_take_from_holdings("OLD")}
    {_add_to_holdings("NEW")}
    {_drop_empty_holdings("OLD")}
    UPDATE worker_stats SET {on_update} WHERE worker = NEW.worker;
END;
CREATE TRIGGER IF NOT EXISTS probation_established AFTER UPDATE OF accepted ON worker_stats
WHEN OLD.accepted = 0 AND NEW.accepted > 0 BEGIN
    {_established_holdings()}
END;
CREATE TRIGGER IF NOT EXISTS ledger_address AFTER UPDATE OF state ON submissions
WHEN NEW.state = '{State.ACCEPTED.value}' AND OLD.state IN {in_states(PENDING)} BEGIN
    INSERT INTO address_stats VALUES (NEW.source_ip, 1) ON CONFLICT (address) DO UPDATE SET accepted = accepted + 1;
END;
CREATE TRIGGER IF NOT EXISTS consumed_groups_retired AFTER UPDATE OF state ON submissions
WHEN NEW.state = '{State.RETIRED.value}' BEGIN
    DELETE FROM consumed_groups WHERE submission_id = NEW.id;
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
    on_probation = (f" FROM submissions s LEFT JOIN worker_stats w ON w.worker = s.worker WHERE s.state IN {in_states(PENDING)}"
                    " AND COALESCE(w.accepted, 0) = 0")
    sums = f"COUNT(*), SUM(s.size_bytes), SUM(s.state = '{State.STORED.value}')"
    db.execute("DELETE FROM probation_prefixes")
    db.execute(f"INSERT INTO probation_prefixes (prefix, allocation, pending, pending_bytes, stored) SELECT s.prefix, MIN(s.allocation), {sums}"
               f"{on_probation} GROUP BY s.prefix")
    db.execute("DELETE FROM probation_allocations")
    db.execute(f"INSERT INTO probation_allocations (allocation, pending, pending_bytes, stored) SELECT s.allocation, {sums}"
               f"{on_probation} GROUP BY s.allocation")


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


def _migrate_v2(db: sqlite3.Connection) -> None:
    """Bring a version-2 or -3 index (or one :func:`_migrate_v1` just rewrote) to this version: each
    submission's address prefix and allocation, worker_stats' ``displaced`` count, the per-prefix
    probation table dropped (created again with its allocation), and every trigger dropped (they are
    created again, with the per-allocation and per-prefix probation holdings; the read models are
    rebuilt after)."""
    columns = {t: {row[1] for row in db.execute(f"PRAGMA table_info({t})")} for t in ("submissions", "worker_stats")}
    for col in ("prefix", "allocation"):
        if col not in columns["submissions"]:
            db.execute(f"ALTER TABLE submissions ADD COLUMN {col} TEXT NOT NULL DEFAULT ''")
    if columns["worker_stats"] and "displaced" not in columns["worker_stats"]:
        db.execute("ALTER TABLE worker_stats ADD COLUMN displaced INTEGER NOT NULL DEFAULT 0")
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    db.execute("DROP TABLE IF EXISTS probation_prefixes")  # and its indexes
    db.create_function("ledger_prefix", 1, prefix_key, deterministic=True)
    db.create_function("ledger_allocation", 1, allocation_key, deterministic=True)
    db.execute("UPDATE submissions SET prefix = ledger_prefix(source_ip), allocation = ledger_allocation(source_ip)")


def open_schema(db: sqlite3.Connection) -> int:
    """Create the index on ``db``, or migrate one an older version wrote, in one transaction.

    Returns:
        How many submissions a migration moved, or −1 when there was nothing to migrate.
    """
    version = db.execute("PRAGMA user_version").fetchone()[0]
    old = version < SCHEMA_VERSION and db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'submissions'").fetchone()
    db.execute("BEGIN IMMEDIATE")
    try:
        n = _migrate_v1(db) if old and version < 2 else -1
        if old:
            _migrate_v2(db)
            n = max(n, db.execute("SELECT COUNT(*) FROM submissions").fetchone()[0])
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
