"""The submission ledger: one owner for a submission's life on the coordinator.

Every change of a submission's state is one method here, named after its transition
(:mod:`trainer.ledger.states`); the async-window rule (:mod:`protocol.window`) and the retention
rule (which files go when) are applied here and nowhere else on the coordinator. Callers:

* the ingest's HTTP adapter (``trainer/ingest/service.py``): :meth:`SubmissionLedger.admit` →
  :meth:`~SubmissionLedger.stored`; :meth:`~SubmissionLedger.lease`; verdicts through the ban
  rule (``ban_rule.py``), which calls :meth:`~SubmissionLedger.judge`; :meth:`~SubmissionLedger.expire_stale`
  on a timer, never inside a request;
* the rollout buffer (``trainer/buffer.py``, the ledger's trainable view):
  :meth:`~SubmissionLedger.trainable`, :meth:`~SubmissionLedger.body`,
  :meth:`~SubmissionLedger.consume` (the groups a step consumed: the ledger is their one owner),
  :meth:`~SubmissionLedger.retire_superseded`, :meth:`~SubmissionLedger.unconsume_after`,
  :meth:`~SubmissionLedger.retire_untrainable`;
* status pages and the run page read the read models (:meth:`~SubmissionLedger.counts`,
  :meth:`~SubmissionLedger.worker_stats`, :meth:`~SubmissionLedger.leaderboard`, …), kept as
  transitions happen: nothing here opens a stored envelope except :meth:`~SubmissionLedger.body`
  for a body no longer held (after a restart) and the ban rule's re-check.

Retention: a rejected submission's file goes once its verdict is final (the ban rule says when);
a consumed one's when a later step's training state is saved (a resume never needs it again);
a pending or accepted one's when it leaves the async window; an unreadable one's at once; a
displaced one's when it is displaced.

Probation's share is shared out per address allocation and then per prefix within it
(``prefixes.py``) by displacement (:meth:`SubmissionLedger.admit`, ``docs/protocol.md`` "Quotas"):
keys are free, address space is not, so when workers on probation hold their whole share, a
submission from an allocation holding less of it than the heaviest allocation takes the place of
that allocation's heaviest prefix's newest never-leased one (within its own allocation, from a
heavier prefix of it) — an allocation or prefix is only ever pushed out by one holding less, so
many together cannot lock out one that holds little.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.audit import HeldSubmission
from protocol.envelope import Envelope, open_envelope
from protocol.messages import Submission, Verdict
from protocol.runspec import RunSpec
from protocol.window import in_window, oldest_fresh_step
from trainer.errors import Refused
from trainer.ledger.bans import BanBook
from trainer.ledger.bodies import MAX_HELD_BODY_BYTES, HeldBodies
from trainer.ledger.ids import GroupKey, SubmissionId, submission_id
from trainer.ledger.leasing import LeaseOrder
from trainer.ledger.prefixes import allocation_key, prefix_key
from trainer.ledger.schema import STALE_REASON
from trainer.ledger.states import PENDING, State, Transition, public_state
from trainer.ledger.store import DecidingVerdict, ProbationView, StoredSubmission, SubmissionStore, Usage

logger = logging.getLogger(__name__)

BANNED_REASON = "banned"
WITHDRAWN_REASON = "withdrawn"
"""Reason of an accepted submission rejected because its worker was banned before a step trained it."""
"""The reason of a pending submission rejected because its worker was banned."""

MAX_DISPLACED = 8
"""Most submissions one admission displaces (when probation's share is full by bytes, a large
submission may need the room of several smaller ones); past it the submission is refused."""


@dataclass(frozen=True)
class Quotas:
    """What the ledger admits: bounds that keep one worker, one address or many free identities
    from taking the disk, and the validators' time, that others need.

    Attributes:
        max_pending_per_worker: a worker's unjudged submissions: backpressure, so workers
            generate no faster than validators judge (their excess would only turn stale).
        max_pending_bytes_per_worker: a worker's unjudged bytes.
        max_pending_per_ip: unjudged submissions posted from one address, whatever the keys.
        max_pending_bytes_per_ip: unjudged bytes posted from one address.
        max_disk_files: submission files on disk in all (pending, and accepted not yet retired).
        max_disk_bytes: their bytes.
        min_free_disk_bytes: refuse submissions that would leave less free space than this.
        probation_share: the fraction of ``max_disk_files`` and ``max_disk_bytes`` that workers
            on probation (no accepted submission yet) may hold pending together, so free keys
            can never take the room established workers' submissions need; shared out per
            address allocation, then prefix, by displacement (:meth:`SubmissionLedger.admit`).
    """

    max_pending_per_worker: int = 4
    max_pending_bytes_per_worker: int = 256 << 20
    max_pending_per_ip: int = 64
    max_pending_bytes_per_ip: int = 1 << 30
    max_disk_files: int = 4096
    max_disk_bytes: int = 8 << 30
    min_free_disk_bytes: int = 256 << 20
    probation_share: float = 0.5


@dataclass(frozen=True)
class Admission:
    """An admitted submission.

    Attributes:
        sid: its ID.
        durable: resolves ``True`` once it is durable (``False``: the same bytes were stored by a
            concurrent request); raises ``OSError``/``sqlite3.Error`` if it could not be stored.
            ``None`` when it was already stored: a duplicate, answered at once.
        state: a duplicate's state as the ingest reports it (``pending``/``accepted``/``rejected``).
    """

    sid: SubmissionId
    durable: Future[bool] | None
    state: str = "pending"


@dataclass(frozen=True)
class Judgement:
    """A verdict recorded against its submission: ``decided`` when it was the first (it set the state);
    ``held``: the submission's rollouts and completion tokens as stored (``None`` for a row stored before
    the index counted tokens), which a verdict's replay statistics must match (``protocol.audit.verdict_mismatch``)."""

    sid: SubmissionId
    worker: str
    decided: bool
    held: HeldSubmission | None = None


class SubmissionLedger:
    """The submissions of one run on the coordinator (see the module docstring).

    Thread-safety: admission and leasing run on the event loop, verdicts on the loop or the
    gossip thread, the trainable view on the training thread; the store serialises its writes.

    Args:
        root: the ledger's directory (``<data dir>/ingest``: files and index).
        spec: the run spec (run ID, async level).
        bans: the ban book (who is banned; the ban rule adds to it).
        trainer_step: returns the trainer step ``n`` (:mod:`protocol.window`).
        latest_policy_step: returns the newest published policy step (the window's upper end at admission).
        quotas: :class:`Quotas`.
        max_held_bytes: verified bodies held in memory (:data:`~trainer.ledger.bodies.MAX_HELD_BODY_BYTES`).
    """

    def __init__(self, root: Path, spec: RunSpec, bans: BanBook, *, trainer_step: Callable[[], int],
                 latest_policy_step: Callable[[], int], quotas: Quotas | None = None, max_held_bytes: int = MAX_HELD_BODY_BYTES) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self.async_level = spec.rl.async_level
        self.store = SubmissionStore(root, spec.run_id)
        self.bans = bans
        self.bodies = HeldBodies(max_held_bytes)
        self.trainer_step = trainer_step
        self.latest_policy_step = latest_policy_step
        self.quotas = quotas or Quotas()
        self.lease_order = LeaseOrder()
        """The fair lease order and the turns it remembers across answers (``leasing.py``)."""
        self._lease_lock = threading.Lock()
        self.reopened = 0
        """Stored envelopes opened and verified again (bodies no longer held, or after a restart)."""

    def close(self) -> None:
        """Finish every write in progress and close the index."""
        self.store.close()

    # --- admitted → stored (event loop) --------------------------------------------------------

    def admit(self, env: Envelope[Submission], address: str) -> Admission:
        """Admit a verified submission: not banned, inside the async window, not a replayed counter,
        within its quotas; its durable write starts (group-committed) and it counts from now on.

        One call, no await: the checks see every earlier admitted submission, durable or still
        being written, and this one is counted before the next is checked.

        When workers on probation hold their whole share and this one's worker is on probation,
        it is admitted only by *displacing* (:attr:`~Transition.DISPLACE`) never-leased
        submissions of the heaviest prefix of the address allocation holding the most of the share
        (by files, or by bytes when bytes are short), newest first, each only while that allocation
        holds more than this one's allocation will; once none does, of a prefix of this one's own
        allocation holding more than its prefix will (at most :data:`MAX_DISPLACED` in all:
        ``_displace_for``); their files are deleted. A displaced
        submission had no verdict: it counts toward no ban and no rejection, its counter stays
        free, and the same bytes posted again are stored again.

        Args:
            env: the verified envelope.
            address: the address it was posted from (``protocol.addresses.address_key``).

        Raises:
            Refused: ``banned``, ``stale_policy``, ``replay``, or a quota (``backpressure``,
                ``quota``, ``ip_quota``, ``probation_quota``, ``disk_quota``, ``disk_full``).
        """
        sub = env.body
        if self.bans.is_banned(sub.worker):
            raise Refused("banned", f"worker {sub.worker} is banned")
        now, hi = self.trainer_step(), self.latest_policy_step()
        if not in_window(sub.policy_step, trainer_step=now, async_level=self.async_level, newest_step=hi):
            raise Refused("stale_policy", f"policy step {sub.policy_step} outside the window [{oldest_fresh_step(now, self.async_level)}, {hi}]")
        sid = submission_id(env.id)
        # staged first, then the index: a submission goes staged → (both, while committing) → index
        if not self.store.storing(sid):  # the same bytes being stored now: a duplicate, answered when they are durable
            existing = self.store.get(sid)
            if existing is not None and existing.state is not State.DISPLACED:  # a displaced one is stored again
                return Admission(sid, None, public_state(existing.state))
            if self.store.counter_used(sub.worker, sub.counter, sid):
                raise Refused("replay", f"worker {sub.worker} already submitted counter {sub.counter} in another submission")
            self._check_quotas(sub.worker, address, len(env.raw))
        return Admission(sid, self.store.submit(env, None, address))

    def _check_quotas(self, worker: str, address: str, size: int) -> None:
        q = self.quotas
        u = self.store.usage(worker, address)
        if u.worker_pending >= q.max_pending_per_worker:
            raise Refused("backpressure", f"worker {worker} has {q.max_pending_per_worker} submissions awaiting verdicts; retry later",
                          retry_after_s=1.0)
        if u.worker_bytes + size > q.max_pending_bytes_per_worker:
            raise Refused("quota", f"worker {worker} has too many unjudged bytes; retry later", retry_after_s=10.0)
        if u.ip_pending >= q.max_pending_per_ip or u.ip_bytes + size > q.max_pending_bytes_per_ip:
            raise Refused("ip_quota", f"address {address} has {u.ip_pending} submissions ({u.ip_bytes} bytes) awaiting verdicts; retry later",
                          retry_after_s=10.0)
        over_disk = u.disk_files >= q.max_disk_files or u.disk_bytes + size > q.max_disk_bytes
        over_share = not u.established and (u.probation_pending + 1 > q.probation_share * q.max_disk_files
                                            or u.probation_bytes + size > q.probation_share * q.max_disk_bytes)
        if over_share and not self._displace_for(address, u, size):
            if over_disk:
                raise Refused("disk_quota", f"the ingest holds {u.disk_files} submissions ({u.disk_bytes} bytes), its limit; retry later",
                              retry_after_s=10.0)
            raise Refused("probation_quota", f"workers with no accepted submission yet hold {u.probation_pending} submissions "
                          f"({u.probation_bytes} bytes) awaiting verdicts, their share, and no address allocation holds more of it "
                          f"than {allocation_key(address)} would, nor a prefix in it more than {prefix_key(address)}; retry later",
                          retry_after_s=10.0)
        if over_disk and not over_share:
            raise Refused("disk_quota", f"the ingest holds {u.disk_files} submissions ({u.disk_bytes} bytes), its limit; retry later",
                          retry_after_s=10.0)
        # minus what admitted submissions are still writing: the file system does not show it yet
        free = shutil.disk_usage(self.store.dir).free - u.writing_bytes
        if free - size < q.min_free_disk_bytes:
            raise Refused("disk_full", f"only {free} bytes free on the ingest's disk; retry later", retry_after_s=30.0)

    def _displace_for(self, address: str, u: Usage, size: int) -> bool:
        """Make room in probation's share (and the disk quota) for a submission of ``size`` bytes
        from ``address`` by displacement (see :meth:`admit`); ``False`` when nobody holds more.

        Two levels (``prefixes.py``): while another allocation holds more of the share than this
        address's allocation will, that allocation's heaviest prefix gives way; once none does,
        another prefix of this address's own allocation holding more than its prefix will."""
        q = self.quotas
        alloc, mine = allocation_key(address), prefix_key(address)
        need_files = max(u.probation_pending + 1 - q.probation_share * q.max_disk_files, u.disk_files + 1 - q.max_disk_files)
        need_bytes = max(u.probation_bytes + size - q.probation_share * q.max_disk_bytes, u.disk_bytes + size - q.max_disk_bytes)
        after_alloc = (u.allocation_pending + 1, u.allocation_bytes + size)  # what this allocation holds once this one is in
        after_prefix = (u.prefix_pending + 1, u.prefix_bytes + size)  # and this prefix
        k = MAX_DISPLACED + 1

        def plan(view: ProbationView) -> list[SubmissionId] | None:
            others = {h.key: [h.files, h.bytes] for h in view.heaviest_allocations(alloc, k)}
            inner = {alloc: {h.key: [h.files, h.bytes] for h in view.heaviest_prefixes(alloc, mine, k)}}
            queues: dict[str, list[tuple[SubmissionId, int]]] = {}
            victims: list[SubmissionId] = []
            files, nbytes = need_files, need_bytes
            while files > 0 or nbytes > 0:
                if len(victims) >= MAX_DISPLACED:
                    return None
                dim = 0 if files > 0 else 1  # files first; then bytes, when a large submission needs more room
                top = max(others, key=lambda a: (others[a][dim], a), default=None)
                if top is not None and others[top][dim] > after_alloc[dim]:  # another allocation holds more
                    prefixes = inner.setdefault(top, {h.key: [h.files, h.bytes] for h in view.heaviest_prefixes(top, mine, k)})
                    holding: list[int] | None = others[top]
                else:  # no allocation holds more: within this one, a prefix holding more than this one will
                    prefixes, holding = inner[alloc], None
                heaviest = max(prefixes, key=lambda p: (prefixes[p][dim], p), default=None)
                if heaviest is None or (holding is None and prefixes[heaviest][dim] <= after_prefix[dim]):
                    if holding is None:
                        return None  # nobody holds more than this address's allocation and prefix would: pushed out by no one heavier
                    del others[top]  # type: ignore[arg-type]
                    continue
                queue = queues.setdefault(heaviest, view.newest_stored(heaviest, MAX_DISPLACED))
                if not queue:
                    del prefixes[heaviest]
                    continue
                sid, n = queue.pop(0)
                victims.append(sid)
                for h in (prefixes[heaviest], *([holding] if holding is not None else [])):
                    h[0] -= 1
                    h[1] -= n
                files, nbytes = files - 1, nbytes - n
            return victims

        done = self.store.displace(plan)
        if done is None:
            return False
        for sid in done:
            self.bodies.take(sid)
        logger.info("displaced %d submissions on probation for one from %s in %s (probation's share full)", len(done), mine, alloc)
        return True

    def precheck(self, address: str) -> bool:
        """What can be refused before a body from ``address`` is read (its bytes would only be
        refused after decoding and verifying them): an address holding its whole pending quota,
        and, while workers on probation hold their whole share, an address none of whose
        submissions was ever accepted unless its allocation holds less of the share than another
        allocation, or its prefix less than another prefix of its allocation (one submission more
        would still leave it lighter: it could displace, :meth:`admit`). So a Sybil flood costs the
        coordinator no decoding once its share is full and evenly held, a new worker from an
        allocation or prefix of its own still gets in, and so does one behind an established
        worker's address.

        Returns:
            Whether the address is *proven* (a submission it posted was accepted).

        Raises:
            Refused: ``ip_quota``, ``probation_quota`` (or ``disk_quota`` when probation holds it all).
        """
        q = self.quotas
        pending, established, probation = self.store.address_standing(address)
        if pending >= q.max_pending_per_ip:
            raise Refused("ip_quota", f"address {address} holds {q.max_pending_per_ip} submissions awaiting verdicts; retry later",
                          retry_after_s=10.0)
        if established or probation < q.probation_share * q.max_disk_files:
            return established
        st = self.store.standing(address)
        if st.heaviest_allocation > st.allocation + 1 or st.heaviest_prefix > st.prefix + 1:
            return False  # it may displace: read its body (under the unproven addresses' shared rate)
        if probation >= q.max_disk_files:  # what admission would say: the whole disk quota is taken
            raise Refused("disk_quota", f"the ingest holds {probation} submissions, its limit; retry later", retry_after_s=10.0)
        raise Refused("probation_quota", f"workers with no accepted submission yet hold {probation} submissions awaiting verdicts, "
                      f"their share, none from this address was ever accepted, and no allocation holds more of it than "
                      f"{allocation_key(address)}, nor a prefix in it more than {prefix_key(address)}; retry later", retry_after_s=10.0)

    def stored(self, sid: SubmissionId, body: Submission) -> None:
        """``sid`` is durable: keep its verified body for the trainer (so it is not verified again).

        Raises:
            Refused: ``banned`` — its worker was banned while it was being written (the ban's
                rejection of its pending work missed it); it is rejected now.
        """
        if self.bans.is_banned(body.worker):
            self.ban_pending(body.worker)
            raise Refused("banned", f"worker {body.worker} is banned")
        self.bodies.hold(sid, body)

    def get(self, sid: SubmissionId) -> StoredSubmission | None:
        """The index row of ``sid`` (no body), or ``None``."""
        return self.store.get(sid)

    # --- stored → leased ---------------------------------------------------------------------

    def lease(self, limit: int, lease_s: float, now_ms: int | None = None) -> list[SubmissionId]:
        """Lease up to ``limit`` pending submissions to a validator for ``lease_s`` seconds, in the
        fair order of ``leasing.py`` (established workers first, round robin over address
        prefixes, addresses and keys); each may be leased again once its lease ends."""
        with self._lease_lock:  # one lease at a time: each sees the previous one's leases
            now = now_ms or int(time.time() * 1000)
            order = self.lease_order.take(self.store.leasable(now), limit)
            return self.store.lease(order, now + int(lease_s * 1000), now)

    def read(self, sid: SubmissionId) -> bytes:
        """The stored envelope of ``sid`` (for a lease answer, the re-check).

        Raises:
            OSError: its file is gone or unreadable now.
        """
        return self.store.read(sid)

    # --- leased → accepted | rejected (the ban rule drives these) --------------------------------

    def judge(self, env: Envelope[Verdict]) -> Judgement | None:
        """Record a verified verdict; the first on a pending submission decides it (accept or reject).

        Returns:
            The :class:`Judgement`, or ``None`` when the verdict names an unknown submission or
            another worker than the one that signed it (never recorded).
        """
        v = env.body
        sid = submission_id(v.submission_id)
        stored = self.store.get(sid)
        if stored is None or stored.worker != v.worker:
            return None
        decided = self.store.record_verdict(env.id.hex(), sid, env.peer_id, v.accepted, v.reason, evidence=evidence_summary(v.evidence))
        held = HeldSubmission(stored.n_rollouts, stored.tokens) if stored.tokens > 0 else None
        return Judgement(sid, v.worker, decided, held)

    def deciding_verdict(self, sid: SubmissionId) -> DecidingVerdict | None:
        """The verdict that decided ``sid`` (``None`` while pending, or rejected without one)."""
        return self.store.deciding_verdict(sid)

    def release(self, sid: SubmissionId) -> None:
        """A rejection of ``sid`` is final (no re-check will read it): its file goes."""
        self.store.delete_files([sid])

    def ban_pending(self, worker: str) -> tuple[int, int]:
        """The ban transitions: reject every pending submission of a banned worker, and withdraw its
        accepted ones no trainer step consumed yet (their remaining groups are never trained; groups
        a step already trained stay trained); delete their files.

        Returns:
            How many were rejected and how many withdrawn.
        """
        done = self.store.apply(Transition.BAN, self.store.select(PENDING, worker=worker), reason=BANNED_REASON)
        withdrawn = self.store.apply(Transition.WITHDRAW, self.store.select({State.ACCEPTED}, worker=worker), reason=WITHDRAWN_REASON)
        self.store.delete_files([*done, *withdrawn])
        if withdrawn:
            logger.warning("withdrew %d accepted, untrained submissions of banned worker %s", len(withdrawn), worker, extra={"peer_id": worker})
        return len(done), len(withdrawn)

    # --- the async window ---------------------------------------------------------------------

    def expire_stale(self) -> int:
        """Drop work that fell out of the async window at the current trainer step: pending →
        rejected ``stale_policy`` (expire), accepted → retired; their files go.

        Returns:
            How many files were deleted.
        """
        lo = oldest_fresh_step(self.trainer_step(), self.async_level)
        expired = self.store.apply(Transition.EXPIRE, self.store.select(PENDING, policy_below=lo), reason=STALE_REASON)
        retired = self.store.apply(Transition.RETIRE, self.store.select({State.ACCEPTED}, policy_below=lo))
        n = self.store.delete_files([*expired, *retired])
        if n:
            logger.info("deleted %d submission files that fell out of the async window", n)
        return n

    # --- accepted → consumed → retired (the trainable view, training thread) --------------------

    def trainable(self, step: int) -> list[StoredSubmission]:
        """Accepted submissions fresh at trainer step ``step``, oldest first: inside the async window
        ``n − k ≤ policy_step ≤ n`` (:func:`protocol.window.in_window` with ``newest_step = n``). The
        upper bound matters after a resume from an earlier step: work accepted of a policy the
        trainer has not reached again waits until it has. Batch assembly trusts this view and does
        not apply the window again (``trainer/batch.py``)."""
        return self.store.trainable(oldest_fresh_step(step, self.async_level), step)

    def body(self, sid: SubmissionId) -> Submission:
        """The verified body of ``sid``: the one the ingest verified if still held, else read back
        from disk and verified again (counted in :attr:`reopened`).

        Raises:
            OSError: its file is gone or unreadable now.
            ProtocolError: its bytes no longer verify.
        """
        held = self.bodies.take(sid)
        if held is not None:
            return held
        self.reopened += 1
        return open_envelope(self.store.read(sid), run_id=self.run_id, expect=Submission).body

    def forget_body(self, sid: SubmissionId) -> None:
        """Drop ``sid``'s held body (the trainer no longer needs it)."""
        self.bodies.take(sid)

    def retire_untrainable(self, sid: SubmissionId) -> None:
        """Retire an accepted submission that can never be trained (file gone, bytes that no longer
        decode, token IDs out of the vocabulary); its file goes now."""
        self.store.apply(Transition.RETIRE, [sid])
        self.store.delete_files([sid])

    def consume(self, step: int, groups: Mapping[SubmissionId, Iterable[GroupKey]], finished: Iterable[SubmissionId]) -> list[SubmissionId]:
        """Trainer step ``step`` consumed these GRPO groups (trained, or dropped with all-zero
        advantages); ``finished`` are the submissions every group of which is now consumed (the
        :attr:`~Transition.CONSUME` transition). Call it before the training state of ``step`` is
        saved: a resume from that state never trains these groups again, a resume from an earlier
        one forgets them (:meth:`unconsume_after`). The ledger is the one owner of what was consumed.

        Returns:
            The submissions consumed whole now.
        """
        rows = [(sid, key[0], key[1]) for sid, keys in groups.items() for key in keys]
        return self.store.consume_groups(rows, finished, step)

    def consumed_groups(self) -> set[GroupKey]:
        """The consumed groups of submissions not yet retired (what the trainable view leaves out)."""
        return self.store.consumed_groups()

    def retire_superseded(self, step: int) -> int:
        """The training state of ``step`` is saved: submissions consumed by earlier steps are retired
        and their files deleted (a resume from that state never makes them trainable again).

        Returns:
            How many were retired.
        """
        superseded = self.store.apply(Transition.RETIRE, self.store.select({State.CONSUMED}, consumed_below=step))
        self.store.delete_files(superseded)
        return len(superseded)

    def unconsume_after(self, step: int) -> int:
        """Resume from trainer step ``step``: groups and submissions consumed by later steps (trained
        by a step whose state was never saved) become trainable again; returns how many submissions."""
        return len(self.store.unconsume_after(step))

    # --- read models ----------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """``pending`` now; ``accepted``, ``rejected``, ``consumed`` over the run; ``displaced`` now."""
        return self.store.counts()

    def verdict_reasons(self) -> dict[str, int]:
        """Verdicts received, by reason."""
        return self.store.verdict_reasons()

    def worker_stats(self, limit: int | None = None) -> dict[str, dict[str, int]]:
        """Per worker: its non-zero ``pending``/``accepted``/``rejected``/``stale``/``trained``/``displaced`` counts
        (``limit``: the first in the leaderboard's order only)."""
        return self.store.worker_stats(limit)

    def displaced_now(self, worker: str) -> int:
        """How many of ``worker``'s submissions are displaced now (what its next answer tells it)."""
        return self.store.displaced_now(worker)

    def worker_count(self) -> int:
        """Workers with a submission in this run."""
        return self.store.worker_count()

    def worker_standing(self, worker: str) -> dict[str, Any]:
        """One worker's counts, rejections by reason, leaderboard place and the number of workers
        (:meth:`~trainer.ledger.store.SubmissionStore.worker_standing`), and whether it is banned."""
        out = self.store.worker_standing(worker)
        ban = next((e for e in self.bans.entries() if e.peer_id == worker), None)
        return {**out, "banned": ban is not None, "ban_reason": ban.reason[:64] if ban is not None else ""}

    def leaderboard(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` workers with the most accepted submissions, with their tokens and trained rollouts."""
        return self.store.leaderboard(limit)


def evidence_summary(evidence: dict[str, Any]) -> str:
    """A verdict's evidence map as one ≤ 200-character line (for a ban record)."""
    return ", ".join(f"{k}={v}" for k, v in evidence.items())[:200]
