"""The ban rule: which verdicts decide a submission, and when a cheat verdict bans its worker
(``docs/validator.md`` "Ban rule").

* The first verdict on a pending submission decides it (accepted or rejected); later verdicts
  are recorded and never change its state.
* A rejection for a benign reason (``protocol.verdicts``) never bans. A deciding rejection for a
  cheat reason bans only once a second, independent check reproduces a cheat reason: the
  coordinator's re-check (:data:`Recheck`, run here in a background thread, one submission at a
  time) or a later verdict of *another* run validator on the same submission. The re-check's own
  failure (its resources, a policy it no longer has) is no evidence against the worker.
* At most ``max_pending_rechecks`` workers wait for a re-check, one submission each (one
  reproduction bans a worker, so a worker's further cheat verdicts while it waits add nothing);
  a cheat verdict against a further worker rejects its submission without a ban.
* The per-worker audit (``audit.py``, ``protocol.audit``; run spec ``[audit]``) counts the replay
  statistics of every deciding verdict that carries them; when a worker's test reaches
  ``1 / audit.false_alarm`` it is banned with reason ``audit`` on that evidence alone (no single
  verdict shows it; the evidence is the statistics of all its verdicts, kept for reproduction).
* A ban rejects the worker's pending work, withdraws its accepted work no trainer step consumed
  yet, and is signed into the ban list (``bans.py``).

The rejected submission's file is kept only while a re-check may read it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from protocol.envelope import Envelope
from protocol.identity import PeerId
from protocol.messages import BanEvidence, Verdict
from protocol.verdicts import AUDIT_BAN_REASON, is_cheat
from trainer.ledger.audit import WorkerAudit
from trainer.ledger.ids import SubmissionId, content_id
from trainer.ledger.ledger import SubmissionLedger, evidence_summary
from trainer.ledger.store import DecidingVerdict

logger = logging.getLogger(__name__)

MAX_PENDING_RECHECKS = 64
"""Workers with a cheat verdict waiting for the coordinator's re-check (default)."""


@dataclass(frozen=True)
class RecheckResult:
    """What an independent re-check of a submission found.

    Attributes:
        accepted: whether every check passed.
        reason: ``"ok"`` or the first failing check's reason code (``protocol.verdicts``).
        detail: a short summary of the evidence (which rollout, the numbers), ≤ 200 characters.
        by: peer ID of whoever re-checked (the coordinator; empty when the re-check itself failed).
    """

    accepted: bool
    reason: str
    detail: str
    by: PeerId


Recheck = Callable[[bytes], RecheckResult]
"""Re-runs every check of a submission envelope independently of the validator that judged it
(the coordinator's: ``node/coordinator/recheck.py``)."""


class BanRule:
    """Applies verdicts to the ledger under the ban rule (see the module docstring).

    Args:
        ledger: the submission ledger (its ban book is the one banned workers go into).
        recheck: the coordinator's independent re-check; ``None``: only a second validator's
            verdict can confirm a cheat.
        max_pending_rechecks: see :data:`MAX_PENDING_RECHECKS`.
        on_ban: called with the new signed ban-list envelope after each ban (to gossip it).
        on_recheck: called with each re-check outcome (``queued``, ``reproduced``,
            ``not_reproduced``, ``coalesced``, ``dropped``), e.g. for a Prometheus counter.
        audit: the per-worker audit; ``None``: none.
    """

    def __init__(self, ledger: SubmissionLedger, *, recheck: Recheck | None = None, max_pending_rechecks: int = MAX_PENDING_RECHECKS,
                 on_ban: Callable[[bytes], None] | None = None, on_recheck: Callable[[str], None] | None = None,
                 audit: WorkerAudit | None = None) -> None:
        self.ledger = ledger
        self.audit = audit
        self.bans = ledger.bans
        self.recheck = recheck
        self.max_pending_rechecks = max_pending_rechecks
        self.on_ban = on_ban
        self.on_recheck = on_recheck
        # worker → submission ID, oldest first: IDs, not bytes (64 queued 32 MiB submissions would hold
        # 2 GiB; read when re-checked), and one per worker, so one cheater cannot fill it for others
        self._waiting: OrderedDict[str, SubmissionId] = OrderedDict()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.rechecks = {"queued": 0, "reproduced": 0, "not_reproduced": 0, "coalesced": 0, "dropped": 0}
        """Re-check outcomes so far (``/status``)."""

    def close(self) -> None:
        """Stop the re-check thread (queued re-checks are dropped: those submissions stay rejected, unbanned)."""
        if self._thread is not None:
            with self._cv:
                self._stop = True
                self._cv.notify()
            self._thread.join(timeout=5.0)
            self._thread = None
        if self.audit is not None:
            self.audit.close()

    def apply(self, env: Envelope[Verdict]) -> bool:
        """Apply a verified verdict of a run validator.

        Returns:
            Whether it decided its submission's state (``False``: a repeat, a late verdict, or one
            naming a submission this coordinator does not hold for that worker).
        """
        v = env.body
        judged = self.ledger.judge(env)
        if judged is None:
            return False
        # accepted verdicts only: rejected work is never trained, and counting it let a steerer farm twin
        # downs (and clean tokens) in submissions it had rejected as `precision` on purpose (red team a33b)
        if judged.decided and v.accepted and v.stats is not None and self.audit is not None and not self.bans.is_banned(v.worker):
            flag = self.audit.observe(v.worker, v.stats, judged.sid, env.id.hex(), held=judged.held)
            if flag is not None:
                self._ban_audited(v.worker, judged.sid, bytes(env.id), flag.detail())
                return True
        cheat = not v.accepted and is_cheat(v.reason)
        banned = self.bans.is_banned(v.worker)
        if judged.decided and not v.accepted and (not cheat or banned):
            self.ledger.release(judged.sid)  # final: nothing will read it again
        if not cheat or banned:
            return judged.decided
        if judged.decided:
            self._queue(judged.sid, v.worker)
            return True
        # not deciding: a second validator's cheat verdict corroborates a deciding cheat verdict
        decision = self.ledger.deciding_verdict(judged.sid)
        if decision is not None and decision.validator != env.peer_id and not decision.accepted and is_cheat(decision.reason):
            self._ban(v.worker, judged.sid, decision, BanEvidence(by=env.peer_id, verdict_id=bytes(env.id), reason=v.reason,
                                                                  detail=evidence_summary(v.evidence)))
        return False

    def _count(self, outcome: str) -> None:
        self.rechecks[outcome] += 1
        if self.on_recheck is not None:
            self.on_recheck(outcome)

    def _queue(self, sid: SubmissionId, worker: str) -> None:
        if self.recheck is None:
            return  # only another validator's verdict can confirm it
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ingest-recheck", daemon=True)
            self._thread.start()
        with self._cv:
            if worker in self._waiting:
                outcome = "coalesced"  # its earlier cheat verdict is already waiting
            elif len(self._waiting) >= self.max_pending_rechecks:
                outcome = "dropped"
            else:
                self._waiting[worker] = sid
                self._cv.notify()
                outcome = "queued"
        self._count(outcome)
        if outcome == "queued":
            return
        if outcome == "dropped":
            logger.warning("no re-check of %s (%d workers already wait for one): its worker is not banned on this verdict", sid[:12],
                           self.max_pending_rechecks, extra={"peer_id": worker})
        self.ledger.release(sid)  # rejected and never re-checked: nothing will read it again

    def _next(self) -> SubmissionId | None:
        """The oldest waiting submission (blocks); ``None`` once closed."""
        with self._cv:
            while not self._waiting and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            return self._waiting.popitem(last=False)[1]

    def _loop(self) -> None:
        """Re-check queued submissions one at a time (a background thread)."""
        assert self.recheck is not None
        while True:
            sid = self._next()
            if sid is None:
                return
            try:
                self._recheck_one(sid)
            except Exception:  # keep the thread alive for the next one
                logger.exception("re-check of %s could not be applied", sid[:12])

    def _recheck_one(self, sid: SubmissionId) -> None:
        assert self.recheck is not None
        decision = self.ledger.deciding_verdict(sid)
        stored = self.ledger.get(sid)
        if decision is None or stored is None or self.bans.is_banned(stored.worker):
            self.ledger.release(sid)  # banned meanwhile (or gone): rejected, never read again
            return
        try:
            raw = self.ledger.read(sid)
        except OSError as e:
            self._count("dropped")
            logger.warning("no re-check of %s (%s): its worker is not banned on one verdict", sid[:12], type(e).__name__)
            return
        try:
            result = self.recheck(raw)
        except Exception as e:  # noqa: BLE001 - the re-check's own failure is no evidence against the worker
            logger.warning("re-check of %s failed: %s", sid[:12], e)
            result = RecheckResult(True, "recheck_failed", str(e)[:200], PeerId(""))  # by nobody: benign, never evidence
        if not result.accepted and is_cheat(result.reason):
            self._count("reproduced")
            self._ban(stored.worker, sid, decision, BanEvidence(by=result.by, reason=result.reason, detail=result.detail[:200]))
        else:
            self._count("not_reproduced")
            logger.warning("%s's %s verdict on %s was not reproduced by the re-check (%s): no ban", decision.validator,
                           decision.reason, sid[:12], result.reason, extra={"peer_id": stored.worker})
        self.ledger.release(sid)

    def audit_catch_up(self) -> int:
        """Count the verdicts the audit kept while its baseline was not ready (``WorkerAudit.count_kept``)
        and ban each worker that flags: called before every batch, so no step trains work whose worker
        the kept verdicts already convict. Returns the workers banned."""
        if self.audit is None:
            return 0
        banned = 0
        for worker, flag, sid, verdict_id in self.audit.count_kept():
            if not self.bans.is_banned(worker):
                self._ban_audited(worker, SubmissionId(sid), bytes.fromhex(verdict_id), flag.detail())
                banned += 1
        return banned

    def _ban_audited(self, worker: str, sid: SubmissionId, verdict_id: bytes, detail: str) -> None:
        """Ban on the audit's flag: the evidence is the coordinator's test over all the worker's
        verdicts (``WorkerAudit.evidence``), named by the verdict that completed it."""
        evidence = [BanEvidence(by=self.bans.key.peer_id, verdict_id=verdict_id, reason=AUDIT_BAN_REASON, detail=detail)]
        if self.bans.ban(worker, AUDIT_BAN_REASON, verdict_id, submission_id=content_id(sid), evidence=evidence):
            self.ledger.ban_pending(worker)
            if self.on_ban is not None:
                self.on_ban(self.bans.envelope)

    def _ban(self, worker: str, sid: SubmissionId, decision: DecidingVerdict, second: BanEvidence) -> None:
        first = BanEvidence(by=decision.validator, verdict_id=decision.verdict_id, reason=decision.reason, detail=decision.evidence[:200])
        if self.bans.ban(worker, decision.reason, decision.verdict_id, submission_id=content_id(sid), evidence=[first, second]):
            self.ledger.ban_pending(worker)
            self.ledger.release(sid)
            if self.on_ban is not None:
                self.on_ban(self.bans.envelope)
