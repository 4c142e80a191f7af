"""What the ingest reports: ``/status`` (JSON) and ``/metrics`` (Prometheus), from the ledger's read models.

The per-worker counts come from tables the ledger keeps as transitions happen (O(workers) to
read, never a scan of the run's history, never an envelope opened). ``/status`` is public, so its
whole-run part is still rebuilt at most 1/:data:`STATUS_DUTY_FACTOR` of the time and its JSON
encoded once per rebuild, in the status thread.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainer.ledger.ban_rule import BanRule
from trainer.ledger.ledger import SubmissionLedger

STATUS_DUTY_FACTOR = 20
"""``/status``'s whole-run counts are rebuilt at most 1/20 of the time (they are O(workers))."""
STATUS_WORKERS_MAX = 1000
"""Workers ``/status`` lists (most accepted first, then fewest rejected; ``workers_total`` counts
them all). Every key with one stored submission has a row, and keys are free: listing every worker
of the run made ``/status`` 7.3 MB at 10^5 junk keys (one admitted each: ≈ 1.4 hours of the shared
rate of unproven addresses), ~50,000 times the bytes of the request, at 5 requests/s per address."""
STATUS_CACHE_MIN_S = 0.005
"""A rebuild faster than this (seconds) is not cached: small runs answer exactly."""


class IngestMetrics:
    """The ingest's Prometheus metrics, in their own registry (the coordinator adds its gauges to it)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.submissions = Counter("intellect_ingest_submissions", "Submissions received, by outcome", ["outcome"], registry=self.registry)
        self.verdicts = Counter("intellect_ingest_verdicts", "Verdicts applied, by reason", ["reason"], registry=self.registry)
        self.rechecks = Counter("intellect_ingest_rechecks", "Re-checks of cheat verdicts, by outcome", ["outcome"], registry=self.registry)
        self.bytes = Counter("intellect_ingest_bytes", "Submission bytes stored", registry=self.registry)
        self.pending = Gauge("intellect_ingest_pending", "Submissions waiting for a verdict", registry=self.registry)
        self.banned = Gauge("intellect_banned_peers", "Peers on the ban list", registry=self.registry)
        self.latency = Histogram("intellect_ingest_store_seconds", "Time to store a submission durably", registry=self.registry)


class IngestStatus:
    """Builds ``/status`` (thread-safe; blocking reads of the ledger's read models).

    Args:
        ledger: the submission ledger; ban_rule: the ban rule (re-check counts, the ban book).
        metrics: where the pending gauge is set.
        status_extra: adds the coordinator's fields (role, state, …).
    """

    def __init__(self, ledger: SubmissionLedger, ban_rule: BanRule, metrics: IngestMetrics,
                 status_extra: Callable[[], dict[str, Any]] | None = None) -> None:
        self.ledger = ledger
        self.ban_rule = ban_rule
        self.metrics = metrics
        self.status_extra = status_extra
        self.started_s = time.time()
        self._lock = threading.Lock()
        self._history: dict[str, Any] | None = None
        self._due = 0.0

    def history_stats(self) -> dict[str, Any]:
        """``submissions`` (counts), ``verdicts_by_reason``, ``workers`` (per-worker counts of the first
        :data:`STATUS_WORKERS_MAX` in the leaderboard's order), ``workers_total`` and
        ``workers_json`` (``workers`` as JSON text): rebuilt at most 1/:data:`STATUS_DUTY_FACTOR` of
        the time; a rebuild under :data:`STATUS_CACHE_MIN_S` is not kept. Concurrent callers share one."""
        with self._lock:
            if self._history is not None and time.monotonic() < self._due:
                return self._history
            t0 = time.monotonic()
            doc: dict[str, Any] = {"submissions": self.ledger.counts(), "verdicts_by_reason": self.ledger.verdict_reasons(),
                                   "workers": self.ledger.worker_stats(STATUS_WORKERS_MAX), "workers_total": self.ledger.worker_count()}
            # encoded here, once per rebuild and counted in its cost
            doc["workers_json"] = json.dumps(doc["workers"], default=str)
            t1 = time.monotonic()
            if t1 - t0 >= STATUS_CACHE_MIN_S:
                self._history, self._due = doc, t1 + (STATUS_DUTY_FACTOR - 1) * (t1 - t0)
            else:
                self._history = None
            return doc

    def status(self, history: dict[str, Any] | None = None) -> dict[str, Any]:
        """What ``/status`` shows (``history``: a :meth:`history_stats` result to use)."""
        history = self.history_stats() if history is None else history
        self.metrics.pending.set(history["submissions"]["pending"])
        out: dict[str, Any] = {
            "run_id": self.ledger.run_id.hex(),
            "trainer_step": self.ledger.trainer_step(),
            "latest_policy_step": self.ledger.latest_policy_step(),
            "async_level": self.ledger.async_level,
            "submissions": history["submissions"],
            "verdicts_by_reason": history["verdicts_by_reason"],
            "banned": [{"peer_id": e.peer_id, "reason": e.reason, "evidence": [f"{x.reason} by {x.by}" for x in e.evidence],
                        "detail": [x.detail for x in e.evidence]}
                       for e in self.ledger.bans.entries()],
            "rechecks": dict(self.ban_rule.rechecks),
            "audit": self.ban_rule.audit.status() if self.ban_rule.audit is not None and self.ban_rule.audit.enabled else None,
            "workers": history["workers"],
            "workers_total": history["workers_total"],
            "uptime_s": round(time.time() - self.started_s, 1),
        }
        if self.status_extra:
            out.update(self.status_extra())
        return out

    def status_body(self) -> bytes:
        """``/status`` as UTF-8 JSON. ``workers`` (every worker of the run) is spliced in as encoded
        by the last :meth:`history_stats` rebuild, not encoded per request: at 10^5 workers that
        took 112 ms of the event loop for each GET of a public route."""
        history = self.history_stats()
        doc = self.status(history)
        del doc["workers"]
        head = json.dumps(doc, default=str)  # a non-empty object: "{...}"
        workers: str = history["workers_json"]
        return (head[:-1] + ', "workers": ' + workers + "}").encode()
