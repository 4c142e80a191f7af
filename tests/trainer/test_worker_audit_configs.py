"""The ledger's audit keeps calibration counts per decode configuration (``audit.calibration_batches``,
issue #33): persisted with their batch size, reloaded into the same bounds, and a file written before
configurations were recorded migrates with its rows as the batch-64 configuration's."""

from __future__ import annotations

import json
import sqlite3

from protocol.audit import Baseline
from protocol.messages import ReplayStats
from protocol.runspec import AuditSpec
from trainer.ledger.audit import WorkerAudit

MULTI = AuditSpec(rule="eprocess-v2", min_calibration_tokens=4000, calibration_window_steps=2, calibration_batches=[1, 8, 64])


def ref(chunks_over: int = 0, up: int = 1, down: int = 1) -> ReplayStats:
    return ReplayStats(tokens=2000, differ=6, gap_over=[2, 1, 0, 0, 0], chunks=80, chunks_over=chunks_over, rollouts=64, diverged=3,
                       decided=up + down, up=up, down=down)


def test_per_configuration_counts_survive_a_restart_and_ready_waits_for_every_configuration(tmp_path) -> None:
    path = tmp_path / "audit.sqlite"
    audit = WorkerAudit(MULTI, path)
    for step in range(3):
        audit.calibrate(step, ref(), config=64)
        audit.calibrate(step, ref(), config=8)
    assert not audit.ready()  # batch 1 has nothing yet: its bounds are 1, so nothing could be flagged fairly
    assert all(v == 1.0 for v in audit.baseline.bounds().values())
    audit.calibrate(0, ref(chunks_over=6, up=2, down=0), config=1)  # batch 1's only step: older than the others' window
    audit.calibrate(1, ref(chunks_over=6, up=2, down=0), config=1)
    assert audit.ready()
    bounds, twins = audit.baseline.bounds(), {c: k.twins for c, k in audit.baseline.per_config.items()}
    assert bounds["chunks_over"] == audit.baseline.per_config[1].bounds(MULTI.baseline_confidence)["chunks_over"]
    assert sorted(audit.baseline.per_config[1].by_step) == [0, 1] and sorted(audit.baseline.per_config[64].by_step) == [1, 2]
    status = audit.status()
    assert status["baseline_by_batch"] == {"1": {"tokens": 4000, "decisive": 4}, "8": {"tokens": 4000, "decisive": 6},
                                           "64": {"tokens": 4000, "decisive": 6}} and status["baseline_tokens"] == 4000
    audit.close()
    rows = sqlite3.connect(str(path)).execute("SELECT config, step FROM calibration ORDER BY config, step").fetchall()
    assert rows == [(1, 0), (1, 1), (8, 1), (8, 2), (64, 1), (64, 2)]  # each configuration's window kept, its older steps dropped
    again = WorkerAudit(MULTI, path)
    assert again.baseline.bounds() == bounds and {c: k.twins for c, k in again.baseline.per_config.items()} == twins and again.ready()
    assert again.baseline.tokens_by_config() == {1: 4000, 8: 4000, 64: 4000}
    again.close()


def test_a_file_from_before_configurations_migrates_with_its_rows_as_batch_64(tmp_path) -> None:
    """An ``audit.sqlite`` whose calibration tables lack the ``config`` column (every run before issue #33) opens:
    the column is added, its rows belong to the default configuration (batch 64), and the bounds are those of
    the same counts in a one-configuration baseline."""
    path = tmp_path / "audit.sqlite"
    db = sqlite3.connect(str(path))
    db.executescript("""
        CREATE TABLE calibration (step INTEGER NOT NULL, stats TEXT NOT NULL);
        CREATE TABLE calibration_twins (step INTEGER NOT NULL, up INTEGER NOT NULL, down INTEGER NOT NULL, decided INTEGER NOT NULL);
        CREATE TABLE workers (worker TEXT PRIMARY KEY, state TEXT NOT NULL, flagged TEXT NOT NULL DEFAULT '');
        CREATE TABLE evidence (worker TEXT NOT NULL, seq INTEGER NOT NULL, submission_id TEXT NOT NULL, verdict_id TEXT NOT NULL,
                               stats TEXT NOT NULL, bounds TEXT NOT NULL, PRIMARY KEY (worker, seq));
    """)
    for step in range(3):
        db.execute("INSERT INTO calibration (step, stats) VALUES (?, ?)", (step, ref(chunks_over=1).model_dump_json()))
        db.execute("INSERT INTO calibration_twins (step, up, down, decided) VALUES (?, 1, 1, 2)", (step,))
    db.commit()
    db.close()
    spec = AuditSpec(rule="eprocess-v2", min_calibration_tokens=6000)
    audit = WorkerAudit(spec, path)
    expected = Baseline(spec.baseline_confidence, spec.calibration_window_steps)
    for step in range(3):
        expected.add(step, ref(chunks_over=1))
    assert audit.baseline.tokens_by_config() == {64: 6000} and audit.ready()
    assert audit.baseline.bounds() == expected.bounds() and audit.baseline.twins == (3, 6, 6)
    audit.calibrate(3, ref())  # the migrated file takes new rows
    audit.close()
    db = sqlite3.connect(str(path))
    assert db.execute("SELECT DISTINCT config FROM calibration").fetchall() == [(64,)]
    assert db.execute("SELECT COUNT(*), SUM(config = 64) FROM calibration_twins").fetchone() == (4, 4)
    db.close()
    # a run whose spec names other batch sizes ignores rows of a configuration it does not calibrate (never mixes them in)
    other = WorkerAudit(MULTI, path)
    assert other.baseline.tokens_by_config() == {1: 0, 8: 0, 64: 4000} and not other.ready()
    other.close()
    assert json.loads(json.dumps(other.status()["baseline_by_batch"]))["64"]["tokens"] == 4000
