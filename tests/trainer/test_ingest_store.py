"""The ledger's index as a run grows: an older index is upgraded in place (states and read models
included), and the queries run for every submission, commit or trainer step never scan the run's
history (``trainer/ledger/store.py``)."""

from __future__ import annotations

import sqlite3

from test_ingest import COORD, RUN, SPEC, submission

import trainer.ledger.store as store_mod
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from trainer.ledger import BanBook, State, SubmissionLedger, SubmissionStore
from trainer.ledger.states import PENDING

OLD_SCHEMA = """
CREATE TABLE submissions (id TEXT PRIMARY KEY, worker TEXT NOT NULL, policy_step INTEGER NOT NULL, counter INTEGER NOT NULL,
    n_rollouts INTEGER NOT NULL, size_bytes INTEGER NOT NULL, received_ms INTEGER NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
    reason TEXT NOT NULL DEFAULT '', verdict_by TEXT NOT NULL DEFAULT '', lease_until_ms INTEGER NOT NULL DEFAULT 0,
    consumed_step INTEGER NOT NULL DEFAULT -1, seq INTEGER NOT NULL);
CREATE TABLE verdicts (id TEXT PRIMARY KEY, submission_id TEXT NOT NULL, validator TEXT NOT NULL, accepted INTEGER NOT NULL,
    reason TEXT NOT NULL, received_ms INTEGER NOT NULL);
"""


def test_an_index_from_an_older_version_is_upgraded(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.executescript(OLD_SCHEMA)
    db.execute("INSERT INTO submissions (id, worker, policy_step, counter, n_rollouts, size_bytes, received_ms, seq)"
               " VALUES ('old', 'w', 0, 0, 1, 100, 0, 1)")
    db.commit()
    db.close()
    store = SubmissionStore(tmp_path, RUN)
    w = NodeKey.generate()
    assert store.add(open_envelope(submission(w), run_id=RUN), source_ip="10.0.0.3")
    assert store.usage(w.peer_id, "10.0.0.3").ip_pending == 1
    assert store.usage("w", "").disk_files == 2
    assert store.get("old").state == State.STORED and store.worker_stats()["w"] == {"pending": 1}
    store.close()


def test_every_state_of_a_version_1_index_is_migrated(tmp_path):
    """pending → stored; accepted with its file → accepted, or consumed (step ≥ 0); accepted with
    its file gone, or untrainable (−2) → retired; rejected stays; the read models are rebuilt."""
    tmp_path.mkdir(exist_ok=True)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.executescript(OLD_SCHEMA)
    db.execute("ALTER TABLE submissions ADD COLUMN source_ip TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE submissions ADD COLUMN on_disk INTEGER NOT NULL DEFAULT 1")
    rows = [("p", "pending", -1, 1, ""), ("a", "accepted", -1, 1, "ok"), ("c", "accepted", 3, 1, "ok"), ("t", "accepted", 2, 0, "ok"),
            ("s", "accepted", -1, 0, "ok"), ("u", "accepted", -2, 1, "ok"), ("r", "rejected", -1, 0, "stale_policy")]
    for seq, (sid, state, consumed, on_disk, reason) in enumerate(rows, 1):
        db.execute("INSERT INTO submissions (id, worker, policy_step, counter, n_rollouts, size_bytes, received_ms, seq, state,"
                   " consumed_step, on_disk, reason) VALUES (?, 'w', 0, ?, 2, 100, 0, ?, ?, ?, ?, ?)",
                   (sid, seq, seq, state, consumed, on_disk, reason))
    db.execute("INSERT INTO verdicts VALUES ('v', 'a', 'val', 1, 'ok', 0)")
    db.commit()
    db.close()
    store = SubmissionStore(tmp_path, RUN)
    try:
        got = {sid: (store.get(sid).state, store.get(sid).consumed_step) for sid, *_ in rows}
        assert got == {"p": (State.STORED, None), "a": (State.ACCEPTED, None), "c": (State.CONSUMED, 3), "t": (State.RETIRED, 2),
                       "s": (State.RETIRED, None), "u": (State.RETIRED, None), "r": (State.REJECTED, None)}
        assert store.worker_stats() == {"w": {"pending": 1, "accepted": 5, "rejected": 1, "stale": 1, "trained": 2}}
        assert store.counts() == {"pending": 1, "accepted": 5, "rejected": 1, "consumed": 2, "displaced": 0}
        assert store.verdict_reasons() == {"ok": 1}
        assert store.leaderboard(1)[0]["rollouts_trained"] == 4
    finally:
        store.close()
    again = SubmissionStore(tmp_path, RUN)  # a second open migrates nothing
    try:
        assert again.counts() == {"pending": 1, "accepted": 5, "rejected": 1, "consumed": 2, "displaced": 0}
    finally:
        again.close()


def test_per_submission_queries_use_indexes_not_the_history(tmp_path):
    """EXPLAIN QUERY PLAN of what admission, group commit, the trainer and the run page ask: no table scan."""
    store = SubmissionStore(tmp_path, RUN)
    queries = [
        ("usage", store_mod._usage_sql(2), ("w", "ip", "a", "b", "w", "2001:db8::/32", "2001:db8::/48")),
        ("counter_used", "SELECT 1 FROM submissions WHERE worker = ? AND counter = ? AND id != ? LIMIT 1", ("w", 1, "x")),
        ("next seq", "SELECT COALESCE(MAX(seq), 0) FROM submissions", ()),
        ("trainable", store_mod._TRAINABLE_SQL, (3, 5)),
        ("expire", *store_mod._select_sql(PENDING, policy_below=3)),
        ("retire stale", *store_mod._select_sql({State.ACCEPTED}, policy_below=3)),
        ("retire consumed", *store_mod._select_sql({State.CONSUMED}, consumed_below=3)),
        ("unconsume", *store_mod._select_sql({State.CONSUMED}, consumed_above=3)),
        ("ban", *store_mod._select_sql(PENDING, worker="w")),
        ("newest stored of a prefix (displacement)", store_mod._NEWEST_STORED_SQL, ("10.0.0.0/24", 8)),
        ("allocation and prefix standing (precheck)", store_mod._STANDING_SQL,
         ("2001:db8::/32", "2001:db8::/32", "2001:db8::/48", "2001:db8::/32", "2001:db8::/48")),
        *((f"heaviest allocations {i} (displacement)", sql, ("2001:db8::/32", 9)) for i, sql in enumerate(store_mod._HEAVIEST_ALLOCATIONS_SQL)),
        *((f"heaviest prefixes of an allocation {i} (displacement)", sql, ("2001:db8::/32", "2001:db8::/48", 9))
          for i, sql in enumerate(store_mod._HEAVIEST_PREFIXES_SQL)),
        ("groups consumed after a step (resume)", "SELECT 1 FROM consumed_groups WHERE step > ?", (3,)),
        ("groups of a retired submission (trigger)", "SELECT 1 FROM consumed_groups WHERE submission_id = ?", ("x",)),
    ]
    for name, sql, args in queries:
        plan = [row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql, args)]
        # (the heaviest prefixes walk their index from the top and stop at the limit)
        assert not any(step.startswith(("SCAN submissions", "SCAN s ")) or step in ("SCAN probation_prefixes", "SCAN probation_allocations", "SCAN consumed_groups")
                       or "TEMP B-TREE" in step for step in plan), (name, plan)
    # the leaderboard walks its index in order and stops at the limit: no sort of every worker
    plan = [row[3] for row in store._db.execute("EXPLAIN QUERY PLAN SELECT worker, tokens FROM worker_stats"
                                                " ORDER BY accepted DESC, rejected, worker LIMIT 200")]
    assert plan == ["SCAN worker_stats USING INDEX worker_stats_board"], plan
    store.close()


def test_worker_stats_tell_stale_retirements_apart_from_other_rejections(tmp_path):
    step = [0]
    ledger = SubmissionLedger(tmp_path, SPEC, BanBook(tmp_path / "bans.msgpack", COORD, RUN), trainer_step=lambda: step[0],
                              latest_policy_step=lambda: 5)
    try:
        w = NodeKey.generate()
        old, cheat, fresh = (open_envelope(submission(w, counter=c, step=s), run_id=RUN) for c, s in ((0, 0), (1, 5), (2, 5)))
        for env in (old, cheat, fresh):
            assert ledger.store.add(env)
        assert ledger.store.record_verdict("v1", cheat.id.hex(), "validator", False, "toploc")
        step[0] = 6  # async level 2: the step-0 submission left the window unjudged
        assert ledger.expire_stale() == 1
        stats = ledger.worker_stats()[w.peer_id]
        assert stats == {"rejected": 2, "stale": 1, "pending": 1}
    finally:
        ledger.close()


def test_history_statistics_never_wait_for_the_store_lock(tmp_path):
    """The read models behind ``/status`` and the run page read
    their own committed snapshot: they answer while another thread holds the store's lock (an
    admission, a verdict, a commit waiting for fsync), and they never hold that lock themselves."""
    import threading

    store = SubmissionStore(tmp_path, RUN)
    try:
        w = NodeKey.generate()
        env = open_envelope(submission(w), run_id=RUN)
        assert store.add(env)
        assert store.record_verdict("v1", env.id.hex(), "validator", True, "ok")
        out: dict[str, object] = {}

        def read_all() -> None:
            out["counts"] = store.counts()
            out["workers"] = store.worker_stats()
            out["board"] = store.leaderboard(10)
            out["verdicts"] = store.verdict_reasons()

        with store._lock:  # e.g. the group commit mid-fsync
            reader = threading.Thread(target=read_all)
            reader.start()
            reader.join(60)
            finished = not reader.is_alive()
        reader.join()
        assert finished, "a statistics query waited for the store's lock"
        assert out["counts"]["accepted"] == 1 and out["workers"] == {w.peer_id: {"accepted": 1}}
        assert out["verdicts"] == {"ok": 1} and out["board"][0]["rollouts_trained"] == 0
    finally:
        store.close()
