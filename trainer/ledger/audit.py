"""The coordinator's per-worker audit: the state of :mod:`protocol.audit`'s test, one owner, persisted.

Each accepted verdict that carries replay statistics is counted into its worker's test (a rejected
submission is never trained, and counting it let a worker farm evidence in work it had rejected on
purpose) against the honest bounds current then; the
calibration (honest reference submissions the coordinator generates in the run's worker dtype,
``node/coordinator/calibrate.py``) moves those bounds. A worker whose test reaches
``1 / audit.false_alarm`` (once the baseline holds ``audit.min_calibration_tokens`` tokens) is
flagged: the ban rule bans it with reason ``audit`` and withdraws its untrained work
(:class:`~trainer.ledger.ban_rule.BanRule`).

Under ``eprocess-v2`` the verdicts' twin counts (up / down among decisive rollouts) are tested too,
against the honest up-share calibrated over the whole run (``docs/toploc.md`` §11.2).

Persistence: one SQLite file of its own (``audit.sqlite`` beside the ledger's index) with the
calibration counts per policy step and decode configuration (batch size), the reference work's twin counts (kept for the whole run), each worker's test state, and every counted verdict's
statistics with the bounds it was counted against: the evidence of a flag, which anyone can
recompute from the signed verdicts (:func:`protocol.audit.replay_evidence`; ``evidence``). The
rows of one verdict are written in one transaction after the ledger decided it; a crash between
the two loses that verdict's counts (the test only forgets evidence; it never invents any).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

from protocol.audit import TWINS_PER_SUBMISSION, AuditState, Baseline, Flag, HeldSubmission, rates, rule_events, verdict_mismatch
from protocol.messages import ReplayStats
from protocol.runspec import AUDIT_RULE_EPROCESS_V2, AUDIT_RULES, CALIBRATION_BATCHES_DEFAULT, AuditSpec

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calibration (step INTEGER NOT NULL, stats TEXT NOT NULL, config INTEGER NOT NULL DEFAULT 64);
CREATE TABLE IF NOT EXISTS calibration_twins (step INTEGER NOT NULL, up INTEGER NOT NULL, down INTEGER NOT NULL, decided INTEGER NOT NULL,
                                              config INTEGER NOT NULL DEFAULT 64);
CREATE TABLE IF NOT EXISTS workers (worker TEXT PRIMARY KEY, state TEXT NOT NULL, flagged TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS evidence (worker TEXT NOT NULL, seq INTEGER NOT NULL, submission_id TEXT NOT NULL, verdict_id TEXT NOT NULL,
                                     stats TEXT NOT NULL, bounds TEXT NOT NULL, PRIMARY KEY (worker, seq));
"""
_CONFIG_COLUMN = f"config INTEGER NOT NULL DEFAULT {CALIBRATION_BATCHES_DEFAULT[0]}"
"""The decode configuration (batch size) of a calibration row; a file written before configurations were
recorded gains the column, and its rows belong to the one configuration calibrated then (batch 64)."""


class WorkerAudit:
    """Per-worker sequential tests of replay statistics (``docs/toploc.md`` §11).

    Thread-safe (verdicts arrive on the event loop's executor, calibration on its own thread).

    Args:
        spec: the run spec's ``[audit]`` section; ``rule = "none"``: :meth:`observe` counts nothing.
        path: the SQLite file (created).
        chunk_size: the run's ``toploc.chunk_size`` (tokens), against which a verdict's TOPLOC chunk count
            is checked (``protocol.audit.verdict_mismatch``); ``None``: not checked.
    """

    def __init__(self, spec: AuditSpec, path: Path, *, chunk_size: int | None = None) -> None:
        self.spec = spec
        self.chunk_size = chunk_size
        self.mismatched = 0
        """Verdicts not counted because their counts disagree with the submission held (``/status``)."""
        self.enabled = spec.rule in AUDIT_RULES
        self.baseline = Baseline(spec.baseline_confidence, spec.calibration_window_steps, tuple(spec.calibration_batches))
        self._lock = threading.Lock()
        self._states: dict[str, AuditState] = {}
        self._flagged: dict[str, Flag] = {}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.executescript(_SCHEMA)
        for table in ("calibration", "calibration_twins"):  # a file from before decode configurations were recorded
            if "config" not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {_CONFIG_COLUMN}")
        self._load()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _load(self) -> None:
        for step, stats, config in self._db.execute("SELECT step, stats, config FROM calibration ORDER BY rowid"):
            if int(config) in self.baseline.per_config:  # a configuration the spec does not name counts for nothing
                self.baseline.add(int(step), ReplayStats.model_validate_json(stats), config=int(config), twins=False)
        for config, up, down, decided in self._db.execute("SELECT config, SUM(up), SUM(down), SUM(decided) FROM calibration_twins "
                                                          "GROUP BY config"):
            if int(config) in self.baseline.per_config:
                self.baseline.per_config[int(config)].twins = (int(up), int(up) + int(down), int(decided))
        for worker, state, flagged in self._db.execute("SELECT worker, state, flagged FROM workers"):
            self._states[worker] = AuditState.from_json(json.loads(state))
            if flagged:
                self._flagged[worker] = Flag(**json.loads(flagged))

    # --- calibration ----------------------------------------------------------------------------

    def calibrate(self, step: int, stats: ReplayStats, config: int | None = None) -> None:
        """Count one honest reference submission's statistics at policy ``step``, decoded with batch size
        ``config`` (one of ``audit.calibration_batches``; ``None``: the only one), into the baseline (its twin
        counts are kept for the whole run, :class:`~protocol.audit.Baseline`).

        Raises:
            ValueError: ``config`` is not calibrated by this run.
        """
        with self._lock:
            self.baseline.add(step, stats, config=config)
            config = self.baseline.configs[0] if config is None else config
            self._db.execute("INSERT INTO calibration (step, stats, config) VALUES (?, ?, ?)", (step, stats.model_dump_json(), config))
            if stats.decided:
                self._db.execute("INSERT INTO calibration_twins (step, up, down, decided, config) VALUES (?, ?, ?, ?, ?)",
                                 (step, stats.up, stats.down, stats.decided, config))
            oldest = min(self.baseline.per_config[config].by_step, default=step)
            self._db.execute("DELETE FROM calibration WHERE config = ? AND step < ?", (config, oldest))

    def ready(self) -> bool:
        """Whether the baseline holds enough replayed tokens to flag anyone: ``audit.min_calibration_tokens`` in
        *every* decode configuration (a configuration short of data bounds its events loosely, and a worker decoding
        like it must not be judged by the others' bounds alone; :class:`~protocol.audit.Baseline`)."""
        return self.baseline.tokens() >= self.spec.min_calibration_tokens

    def wants_decisive(self) -> bool:
        """Under ``eprocess-v2``, whether some decode configuration's baseline holds fewer decisive reference rollouts
        than ``audit.min_calibration_decisive`` (the first calibrated step keeps making reference work while so).
        The twin test needs no minimum to be sound: with few decisive rollouts its bound is near 1 and it
        bets little."""
        return self.spec.rule == AUDIT_RULE_EPROCESS_V2 and self.baseline.decisive() < self.spec.min_calibration_decisive

    # --- verdicts -------------------------------------------------------------------------------

    def observe(self, worker: str, stats: ReplayStats, submission_id: str, verdict_id: str,
                held: HeldSubmission | None = None) -> Flag | None:
        """Count one deciding verdict's statistics; a :class:`~protocol.audit.Flag` the first time the
        worker's test reaches ``1 / audit.false_alarm``.

        A verdict claiming more decided twins than :data:`~protocol.audit.TWINS_PER_SUBMISSION`, or whose
        tokens, rollouts or chunks cannot be those of ``held`` (the submission as the coordinator stored
        it; :func:`~protocol.audit.verdict_mismatch`), is not counted (logged, counted in ``mismatched``):
        one forged verdict with inflated trials would dilute the worker's test. Before the baseline is :meth:`ready` a verdict is kept, not counted (its bounds would be 1:
        no bet); the worker's kept verdicts are counted, in order, against the bounds of the first
        verdict after it is ready. The bounds come from the coordinator's own reference work, never
        from the worker's, so counting them late keeps the test's guarantee.
        """
        if not self.enabled:
            return None
        if stats.decided > TWINS_PER_SUBMISSION:  # no validator decodes more: a forged or broken verdict (red team a33b)
            logger.warning("audit: verdict %s on %s claims %d decided twins (> %d per submission): not counted", verdict_id[:12],
                           submission_id[:12], stats.decided, TWINS_PER_SUBMISSION, extra={"peer_id": worker})
            return None
        why = verdict_mismatch(stats, held, rule=self.spec.rule, chunk_size=self.chunk_size) if held is not None else None
        if why is not None:
            logger.warning("audit: verdict %s on %s does not match the submission held (%s): not counted", verdict_id[:12],
                           submission_id[:12], why, extra={"peer_id": worker})
            with self._lock:
                self.mismatched += 1
            return None
        with self._lock:
            if worker in self._flagged:
                return None
            state = self._states.setdefault(worker, AuditState(rule=self.spec.rule))
            seq = state.verdicts + self._kept(worker) + 1
            if not self.ready():
                self._db.execute("INSERT INTO evidence (worker, seq, submission_id, verdict_id, stats, bounds) VALUES (?, ?, ?, ?, ?, '')",
                                 (worker, seq, submission_id, verdict_id, stats.model_dump_json()))
                return None
            bounds = self.baseline.bounds()
            flag: Flag | None = None
            with self._db:
                self._db.execute("BEGIN")
                kept = self._db.execute("SELECT seq, stats FROM evidence WHERE worker = ? AND bounds = '' ORDER BY seq", (worker,)).fetchall()
                for kseq, kstats in kept:  # verdicts that came before the baseline was ready, in order
                    state.observe(ReplayStats.model_validate_json(kstats), bounds)
                    flag = flag or state.flag(self.spec.false_alarm, bounds)
                    self._db.execute("UPDATE evidence SET bounds = ? WHERE worker = ? AND seq = ?", (json.dumps(bounds), worker, kseq))
                state.observe(stats, bounds)
                flag = flag or state.flag(self.spec.false_alarm, bounds)
                self._db.execute("INSERT INTO evidence (worker, seq, submission_id, verdict_id, stats, bounds) VALUES (?, ?, ?, ?, ?, ?)",
                                 (worker, seq, submission_id, verdict_id, stats.model_dump_json(), json.dumps(bounds)))
                self._db.execute("INSERT OR REPLACE INTO workers (worker, state, flagged) VALUES (?, ?, ?)",
                                 (worker, json.dumps(state.to_json()), json.dumps(flag.__dict__) if flag else ""))
            if flag is not None:
                self._flagged[worker] = flag
                logger.warning("audit flags %s: %s", worker, flag.detail(), extra={"peer_id": worker})
            return flag

    def count_kept(self) -> list[tuple[str, Flag, str, str]]:
        """Once the baseline is :meth:`ready`, count every worker's kept verdicts now, in order, against
        the current bounds (as :meth:`observe` would on the worker's next verdict), so that a worker
        whose whole work arrived before the baseline is judged before any of it is trained on.

        Returns:
            ``(worker, flag, submission_id, verdict_id)`` of each worker this flags (the IDs of the
            verdict that completed the test); empty before the baseline is ready or with nothing kept.
        """
        if not self.enabled or not self.ready():
            return []
        out: list[tuple[str, Flag, str, str]] = []
        with self._lock:
            bounds = self.baseline.bounds()
            workers = [w for (w,) in self._db.execute("SELECT DISTINCT worker FROM evidence WHERE bounds = ''").fetchall()]
            for worker in workers:
                if worker in self._flagged:
                    continue
                state = self._states.setdefault(worker, AuditState(rule=self.spec.rule))
                flag: Flag | None = None
                last = ("", "")
                with self._db:
                    self._db.execute("BEGIN")
                    kept = self._db.execute("SELECT seq, stats, submission_id, verdict_id FROM evidence WHERE worker = ? AND bounds = '' "
                                            "ORDER BY seq", (worker,)).fetchall()
                    for kseq, kstats, sid, vid in kept:
                        state.observe(ReplayStats.model_validate_json(kstats), bounds)
                        if flag is None:
                            flag = state.flag(self.spec.false_alarm, bounds)
                            last = (sid, vid)
                        self._db.execute("UPDATE evidence SET bounds = ? WHERE worker = ? AND seq = ?", (json.dumps(bounds), worker, kseq))
                    self._db.execute("INSERT OR REPLACE INTO workers (worker, state, flagged) VALUES (?, ?, ?)",
                                     (worker, json.dumps(state.to_json()), json.dumps(flag.__dict__) if flag else ""))
                if flag is not None:
                    self._flagged[worker] = flag
                    logger.warning("audit flags %s: %s", worker, flag.detail(), extra={"peer_id": worker})
                    out.append((worker, flag, *last))
        return out

    def _kept(self, worker: str) -> int:
        (n,) = self._db.execute("SELECT COUNT(*) FROM evidence WHERE worker = ? AND bounds = ''", (worker,)).fetchone()
        return int(n)

    def flagged(self, worker: str) -> Flag | None:
        """The worker's flag, if the audit raised one."""
        with self._lock:
            return self._flagged.get(worker)

    def evidence(self, worker: str) -> list[dict[str, Any]]:
        """Every counted verdict of ``worker`` in the order it was counted: submission and verdict IDs,
        the statistics and the bounds they were counted against (:func:`protocol.audit.replay_evidence`
        recomputes the test); verdicts still kept for a baseline not yet ready are left out."""
        with self._lock:
            rows = self._db.execute("SELECT seq, submission_id, verdict_id, stats, bounds FROM evidence WHERE worker = ? AND bounds != '' "
                                    "ORDER BY seq", (worker,)).fetchall()
        return [{"seq": s, "submission_id": sid, "verdict_id": vid, "stats": json.loads(st), "bounds": json.loads(b)} for s, sid, vid, st, b in rows]

    def status(self, limit: int = 64) -> dict[str, Any]:
        """For ``/status``: the baseline (tokens, bounds) and the workers with the most evidence against them."""
        with self._lock:
            bounds = self.baseline.bounds()
            top = sorted(self._states.items(), key=lambda kv: -kv[1].log_e_value())[:limit]
            return {
                "rule": self.spec.rule,
                "false_alarm": self.spec.false_alarm,
                "baseline_tokens": self.baseline.tokens(),
                "baseline_decisive": self.baseline.decisive(),
                "baseline_by_batch": {str(c): {"tokens": t, "decisive": self.baseline.decisive_by_config()[c]}
                                      for c, t in self.baseline.tokens_by_config().items()},
                "ready": self.baseline.tokens() >= self.spec.min_calibration_tokens,
                "mismatched_verdicts": self.mismatched,
                "bounds": {k: round(v, 8) for k, v in bounds.items()},
                "workers": {w: {"log10_e": round(s.log_e_value() / 2.302585092994046, 3), "verdicts": s.verdicts,
                                "rates": {k: round(v, 6) for k, v in rates(s.totals, rule_events(s.rule)).items()},
                                "flagged": w in self._flagged} for w, s in top},
            }
