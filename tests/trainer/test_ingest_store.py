"""The submission store's index as a run grows: an older index is upgraded in place, and the
queries run for every submission or commit never scan the run's history (``trainer/ledger/store.py``)."""

from __future__ import annotations

import sqlite3

from test_ingest import RUN, submission

import trainer.ledger.store as store_mod
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from trainer.ledger import SubmissionStore

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
    assert store.usage("w", "").disk_files == 2 and [s for s, _, _ in store.submissions_after(0, 10)] == [1, 2]
    store.close()


def test_per_submission_queries_use_indexes_not_the_history(tmp_path):
    """EXPLAIN QUERY PLAN of what admission, group commit, the trainer and the run page ask: no table scan."""
    store = SubmissionStore(tmp_path, RUN)
    queries = [
        ("usage", store_mod._usage_sql(2), ("w", "ip", "a", "b")),
        ("counter_used", "SELECT 1 FROM submissions WHERE worker = ? AND counter = ? AND id != ? LIMIT 1", ("w", 1, "x")),
        ("next seq", "SELECT COALESCE(MAX(seq), 0) FROM submissions", ()),
        ("submissions_after", "SELECT seq, id, worker FROM submissions WHERE seq > ? ORDER BY seq LIMIT ?", (5, 10)),
        ("accepted_unconsumed", "SELECT id FROM submissions WHERE state = 'accepted' AND consumed_step = -1 AND policy_step >= ? ORDER BY seq",
         (3,)),
        ("retire_stale", ("SELECT id FROM submissions WHERE on_disk = 1 AND policy_step < ? AND (state = 'pending' OR"
                         " (state = 'accepted' AND consumed_step = -1))"), (3,)),
    ]
    for name, sql, args in queries:
        plan = [row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql, args)]
        assert not any(step.startswith("SCAN submissions") or "TEMP B-TREE" in step for step in plan), (name, plan)
    store.close()


def test_worker_stats_tell_stale_retirements_apart_from_other_rejections(tmp_path):
    store = SubmissionStore(tmp_path, RUN)
    try:
        w = NodeKey.generate()
        old, cheat, fresh = (open_envelope(submission(w, counter=c, step=s), run_id=RUN) for c, s in ((0, 0), (1, 5), (2, 5)))
        for env in (old, cheat, fresh):
            assert store.add(env)
        assert store.record_verdict("v1", cheat.id.hex(), "validator", False, "toploc")
        store.retire_stale(min_policy_step=4)  # the step-0 submission left the window unjudged
        stats = store.worker_stats()[w.peer_id]
        assert stats == {"rejected": 2, "stale": 1, "pending": 1}
    finally:
        store.close()


def test_history_statistics_never_wait_for_the_store_lock(tmp_path):
    """The whole-history scans behind ``/status`` and the run page (≈ 2 s at 10^6 submissions) read
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
            out["trained"] = store.rollouts_trained()
            out["verdicts"] = store.verdict_reasons()

        with store._lock:  # e.g. the group commit mid-fsync
            reader = threading.Thread(target=read_all)
            reader.start()
            reader.join(60)
            finished = not reader.is_alive()
        reader.join()
        assert finished, "a statistics query waited for the store's lock"
        assert out["counts"]["accepted"] == 1 and out["workers"] == {w.peer_id: {"accepted": 1}}
        assert out["verdicts"] == {"ok": 1} and out["trained"] == {}
    finally:
        store.close()
