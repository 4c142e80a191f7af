"""The ledger's persistence: envelope files plus a SQLite index (with ``writer.py`` and
``schema.py``, the only SQL of the coordinator): every query, and every change of state.

Nothing outside ``trainer/ledger/`` reads the index: the ledger (:mod:`trainer.ledger.ledger`)
names every change of state (:mod:`trainer.ledger.states`) and this module applies it as one
guarded update; the state names and the SQL live here, in ``writer.py`` (the group commit's
inserts), ``schema.py`` (tables, triggers, migration) and in ``states.py`` only.

Write path: :mod:`trainer.ledger.writer` (:class:`~trainer.ledger.writer.GroupCommit`) writes
each admitted submission's file and commits its index row in groups; :meth:`SubmissionStore.submit`
stages it there at once, so :meth:`usage` and :meth:`counter_used` count it from that instant
(quotas and replay protection stay exact while it is written), and the ingest acknowledges it
only once its future resolves. :meth:`recover` re-indexes on start every file without an index
row (a power cut's newest rows, or a crash between file and row): an acknowledged submission is
never lost, and an unacknowledged one is at worst accepted late (at its file's time, under the
address its file keeps: ``writer.file_header``).

Read models: per-worker counts (pending, accepted, rejected, stale, trained, rollouts trained,
completion tokens), verdicts by reason and the pending work of workers on probation are tables
kept by SQLite triggers in the same transaction as each change of state, so ``/status``, the
run page's leaderboard and admission read them in O(workers) or O(1), never by scanning the run's
history, and never by opening an envelope.

Files do not outlive their use (the disk is what free identities would fill): index rows stay
(a few hundred bytes each) so counters remain unique per worker for the whole run
(:meth:`counter_used`); which files go when is the ledger's retention rule.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.envelope import Envelope, open_envelope
from protocol.errors import ProtocolError
from protocol.identity import PeerId
from protocol.messages import Submission
from trainer.ledger.ids import GroupKey, SubmissionId
from trainer.ledger.prefixes import allocation_key, prefix_key
from trainer.ledger.schema import SCHEMA_VERSION, in_states, open_schema
from trainer.ledger.states import PENDING, TRANSITIONS, State, Transition
from trainer.ledger.writer import BUSY_TIMEOUT_S, GroupCommit, Staged, insert_rows, read_submission_file

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Usage:
    """What one worker, one address and everybody hold: the inputs of the ledger's admission quotas.

    Attributes:
        worker_pending, worker_bytes: the worker's pending submissions and their bytes.
        ip_pending, ip_bytes: the same for the address.
        disk_files, disk_bytes: submission files on disk in all and their bytes.
        writing_bytes: bytes of submissions admitted whose files are not yet written (the file
            system's free space does not show them yet).
        established: the worker has an accepted submission (else it is on probation).
        probation_pending, probation_bytes: pending submissions (and bytes) of every worker on probation.
        allocation_pending, allocation_bytes: of those, the ones posted from the address's
            allocation (``trainer.ledger.prefixes``): its holding of probation's share.
        prefix_pending, prefix_bytes: of those, the ones posted from the address's prefix.
    """

    worker_pending: int
    worker_bytes: int
    ip_pending: int
    ip_bytes: int
    disk_files: int
    disk_bytes: int
    writing_bytes: int = 0
    established: bool = False
    probation_pending: int = 0
    probation_bytes: int = 0
    allocation_pending: int = 0
    allocation_bytes: int = 0
    prefix_pending: int = 0
    prefix_bytes: int = 0


@dataclass(frozen=True)
class Holding:
    """What one address allocation or prefix holds of probation's share (indexed submissions;
    ``probation_allocations``, ``probation_prefixes``).

    Attributes:
        key: the allocation or prefix (``trainer.ledger.prefixes``).
        files, bytes: pending submissions of workers on probation posted from it, and their bytes.
        stored: of them, never leased (what displacement may take).
    """

    key: str
    files: int
    bytes: int
    stored: int


@dataclass(frozen=True)
class Standing:
    """Pending submissions of workers on probation (files) that an address's allocation and prefix
    hold, and the most another allocation holds, and another prefix of the same allocation (each
    with a never-leased submission): what admission checks before a body is read."""

    allocation: int
    heaviest_allocation: int
    prefix: int
    heaviest_prefix: int


class ProbationView:
    """Reads for a displacement plan, on the store's connection while the store's lock is held
    (``SubmissionStore.displace``): each an indexed range, never a scan of pending work."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def heaviest_allocations(self, exclude: str, k: int) -> list[Holding]:
        """The ``k`` allocations other than ``exclude`` holding the most files and the ``k`` holding
        the most bytes of probation's share (those with a never-leased submission; up to 2k, no repeats)."""
        return self._heaviest(_HEAVIEST_ALLOCATIONS_SQL, (exclude, k))

    def heaviest_prefixes(self, allocation: str, exclude: str, k: int) -> list[Holding]:
        """The same for the prefixes of ``allocation`` other than ``exclude``."""
        return self._heaviest(_HEAVIEST_PREFIXES_SQL, (allocation, exclude, k))

    def _heaviest(self, queries: tuple[str, ...], params: tuple[str | int, ...]) -> list[Holding]:
        out: dict[str, Holding] = {}
        for sql in queries:
            for r in self._db.execute(sql, params):
                out[r[0]] = Holding(r[0], int(r[1]), int(r[2]), int(r[3]))
        return list(out.values())

    def newest_stored(self, prefix: str, k: int) -> list[tuple[SubmissionId, int]]:
        """Up to ``k`` never-leased pending submissions of workers on probation from ``prefix``,
        newest first, with their sizes in bytes."""
        return [(SubmissionId(i), int(n)) for i, n in self._db.execute(_NEWEST_STORED_SQL, (prefix, k))]


_HEAVIEST_ALLOCATIONS_SQL = tuple(f"SELECT allocation, pending, pending_bytes, stored FROM probation_allocations WHERE stored > 0"
                                  f" AND allocation != ? ORDER BY {col} DESC LIMIT ?" for col in ("pending", "pending_bytes"))
_HEAVIEST_PREFIXES_SQL = tuple(f"SELECT prefix, pending, pending_bytes, stored FROM probation_prefixes WHERE allocation = ? AND stored > 0"
                               f" AND prefix != ? ORDER BY {col} DESC LIMIT ?" for col in ("pending", "pending_bytes"))
_NEWEST_STORED_SQL = (f"SELECT s.id, s.size_bytes FROM submissions s WHERE s.prefix = ? AND s.state = '{State.STORED.value}'"
                      " AND COALESCE((SELECT accepted FROM worker_stats w WHERE w.worker = s.worker), 0) = 0 ORDER BY s.seq DESC LIMIT ?")
_STANDING_SQL = ("SELECT (SELECT COALESCE(MAX(pending), 0) FROM probation_allocations WHERE allocation = ?),"
                 " (SELECT COALESCE(MAX(pending), 0) FROM probation_allocations WHERE stored > 0 AND allocation != ?),"
                 " (SELECT COALESCE(MAX(pending), 0) FROM probation_prefixes WHERE prefix = ?),"
                 " (SELECT COALESCE(MAX(pending), 0) FROM probation_prefixes WHERE allocation = ? AND stored > 0 AND prefix != ?)")


DISPLACED_REASON = "displaced"
"""The ``reason`` of a displaced submission (no verdict: probation's share went to a lighter prefix)."""


@dataclass(frozen=True)
class DecidingVerdict:
    """The verdict that decided a submission: its envelope's content ID, signer, outcome, evidence summary."""

    verdict_id: bytes
    validator: PeerId
    accepted: bool
    reason: str
    evidence: str


@dataclass(frozen=True)
class StoredSubmission:
    """An index row of the ledger (no body)."""

    id: SubmissionId
    worker: str
    policy_step: int
    counter: int
    n_rollouts: int
    size_bytes: int
    received_ms: int
    state: State
    reason: str
    consumed_step: int | None = None
    tokens: int = 0
    """Completion tokens of its rollouts (0: stored before the index counted them)."""


@dataclass(frozen=True)
class LeaseCandidate:
    """A pending submission a validator may lease now, with what the lease order weighs.

    Attributes:
        id: the submission; worker: its signer; address: the address it was posted from
            (``protocol.addresses.address_key``); seq: arrival order (higher is newer).
        established: its worker has an accepted submission (else it is on probation).
    """

    id: SubmissionId
    worker: str
    address: str
    seq: int
    established: bool


_ROW = "id, worker, policy_step, counter, n_rollouts, size_bytes, received_ms, state, reason, consumed_step, tokens"


def _row(r: tuple[Any, ...]) -> StoredSubmission:
    return StoredSubmission(SubmissionId(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], State(r[7]), r[8], r[9], r[10])


def completion_tokens(sub: Submission) -> int:
    """Completion tokens of a submission's rollouts (packed ``<u4`` IDs, ``protocol.rollout``)."""
    return sum(len(r.completion_ids) // 4 for r in sub.rollouts)


class SubmissionStore:
    """Submissions on disk under ``root``: ``root/submissions/<id>.sub`` and ``root/index.sqlite``.

    Thread-safe (one connection guarded by a lock; SQLite work is milliseconds). Writes are group
    committed by a writer pool and one commit thread, started on the first :meth:`submit` and
    stopped by :meth:`close` (which first finishes every submission already submitted).

    Args:
        root: directory (created).
        run_id: the run's 32-byte ID, to re-open stored envelopes.
    """

    def __init__(self, root: Path, run_id: bytes) -> None:
        self.root = Path(root)
        self.dir = self.root / "submissions"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self._lock = threading.Lock()  # the connection, and the writer's staging table
        self._db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # every write but the group commit's and a displacement's
        n = open_schema(self._db)
        if n >= 0:
            logger.info("migrated the submission index to schema %d (%d submissions)", SCHEMA_VERSION, n)
        # Read models and whole-history reads go through their own connection: in WAL mode a reader
        # sees the last committed snapshot without the store's lock, so they never hold up
        # admission, verdicts or the group commit.
        self._stats_lock = threading.Lock()  # this connection only
        self._stats_db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        self._stats_db.execute("PRAGMA query_only=1")
        # Displacements (:meth:`displace`) are committed on the event loop, under the lock: with
        # synchronous=NORMAL and no automatic checkpoint on this connection, such a commit is a WAL
        # append without an fsync (the loop never waits for the disk here); it reaches stable storage
        # with the WAL's next fsync (any FULL commit, a checkpoint). A power cut before that can undo
        # one (see recover()).
        self._displace_db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        self._displace_db.execute("PRAGMA synchronous=NORMAL")
        self._displace_db.execute("PRAGMA wal_autocheckpoint=0")
        self._writer = GroupCommit(self.dir, self.root / "index.sqlite", self._lock)
        self.recover()

    @property
    def commits(self) -> dict[str, int]:
        """Group commits done, submissions they committed, and the most in one (for benchmarks)."""
        return self._writer.commits

    def close(self) -> None:
        """Finish every submitted write (their futures resolve), stop the threads, close the index."""
        self._writer.close()
        with self._lock:
            self._db.close()
            self._displace_db.close()
        with self._stats_lock:
            self._stats_db.close()

    # --- write path --------------------------------------------------------------------------

    def add(self, env: Envelope[Submission], now_ms: int | None = None, source_ip: str = "") -> bool:
        """Store a verified submission durably (blocking until it is; see :meth:`submit`).

        Args:
            env: the verified envelope (its raw bytes are what is stored).
            now_ms: arrival time, ms since the epoch.
            source_ip: the address it came from (counted in its per-IP quota).

        Returns:
            ``True`` if stored now, ``False`` if this exact envelope was already stored (idempotent).

        Raises:
            OSError, sqlite3.Error: the write or the commit failed; nothing was stored.
        """
        return self.submit(env, now_ms, source_ip).result()

    def submit(self, env: Envelope[Submission], now_ms: int | None = None, source_ip: str = "") -> Future[bool]:
        """Start storing a verified submission; its future resolves once it is durable.

        Returns at once (no I/O in the calling thread, so the event loop may call it). From the
        moment it returns, the submission counts in :meth:`usage` and :meth:`counter_used`; it
        becomes visible to :meth:`get` and every other reader when its group commits, just before
        the future resolves.

        Args:
            env: the verified envelope (its raw bytes are what is stored).
            now_ms: arrival time, ms since the epoch.
            source_ip: the address it came from (counted in its per-IP quota).

        Returns:
            A future of ``True`` (stored now and durable: the file, its name and its index row are
            on stable storage) or ``False`` (this exact envelope was already stored, or is being
            stored by an earlier call: resolves when that one does). It raises ``OSError`` or
            ``sqlite3.Error`` if the write or the commit failed (nothing stored) and
            ``RuntimeError`` if the store is closing.
        """
        sid = SubmissionId(env.id.hex())
        body = env.body
        fut: Future[bool] = Future()
        fut.set_running_or_notify_cancel()  # nobody can cancel it: the commit thread resolves every future it holds
        with self._lock:
            if self._writer.closing:
                raise RuntimeError("the submission store is closed")
            earlier = self._writer.staged.get(sid)
            if earlier is None and self._db.execute(f"SELECT 1 FROM submissions WHERE id = ? AND state != '{State.DISPLACED.value}'",
                                                    (sid,)).fetchone():
                fut.set_result(False)
                return fut
            if earlier is not None:  # the same bytes posted twice at once: answer when the first is durable
                earlier.future.add_done_callback(lambda f: _chain_duplicate(f, fut))
                return fut
            self._writer.stage(Staged(sid, body.worker, body.policy_step, body.counter, len(body.rollouts), completion_tokens(body),
                                      len(env.raw), now_ms or int(time.time() * 1000), source_ip, env.raw, fut))
        return fut

    def recover(self) -> int:
        """Index submission files a crash left unindexed (a displaced submission's file still there
        restores it: a crash between its displacement's commit and the file's deletion, or a power
        cut that undid the commit of its restoring); remove stray temporary files. A power cut can
        also undo a displacement's commit after its file went: that row is stored again without a
        file, and leaves like any unreadable pending one (a lease skips it; it expires with the
        async window, as ``stale_policy``).

        Returns:
            How many files were re-indexed.
        """
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        paths = list(self.dir.glob("*.sub"))
        with self._lock:
            known = {row[0] for row in self._db.execute(f"SELECT id FROM submissions WHERE state != '{State.DISPLACED.value}'")}
        found: list[Staged] = []
        for path in sorted(paths, key=lambda p: p.stat().st_mtime):
            sid = SubmissionId(path.stem)
            if sid in known:
                continue
            try:
                address, raw = read_submission_file(path)
                env = open_envelope(raw, run_id=self.run_id, expect=Submission)
            except (OSError, ProtocolError) as e:
                logger.warning("dropping unreadable stored submission %s: %s", path.name, e)
                path.unlink(missing_ok=True)
                continue
            body = env.body
            found.append(Staged(sid, body.worker, body.policy_step, body.counter, len(body.rollouts), completion_tokens(body), len(env.raw),
                                 int(path.stat().st_mtime * 1000), address, b""))
        if found:
            with self._lock:
                insert_rows(self._db, found)
            logger.info("re-indexed %d submissions after an unclean stop", len(found))
        return len(found)

    # --- reads -------------------------------------------------------------------------------

    def get(self, sid: SubmissionId) -> StoredSubmission | None:
        """The index row of ``sid`` (``None`` if unknown, or still being stored)."""
        with self._lock:
            row = self._db.execute(f"SELECT {_ROW} FROM submissions WHERE id = ?", (sid,)).fetchone()
        return _row(row) if row else None

    def read(self, sid: SubmissionId) -> bytes:
        """The stored envelope bytes of submission ``sid``.

        Raises:
            OSError: its file is gone (``FileNotFoundError``) or unreadable now.
        """
        return read_submission_file(self.dir / f"{sid}.sub")[1]

    def counter_used(self, worker: str, counter: int, exclude_id: SubmissionId) -> bool:
        """Whether ``worker`` already has another stored submission with this counter (stored or being
        stored); a displaced one does not count (it was never judged: its counter is free)."""
        with self._lock:
            if any(s.worker == worker and s.counter == counter and s.sid != exclude_id for s in self._writer.staged.values()):
                return True
            row = self._db.execute(
                f"SELECT 1 FROM submissions WHERE worker = ? AND counter = ? AND id != ? AND state != '{State.DISPLACED.value}' LIMIT 1",
                (worker, counter, exclude_id)
            ).fetchone()
        return row is not None

    def address_standing(self, source_ip: str) -> tuple[int, bool, int]:
        """What admission can check before a body from ``source_ip`` is read: its pending submissions
        (stored or being stored), whether a submission it posted was ever accepted (a *proven*
        address), and the pending submissions of workers on probation (indexed ones; O(1))."""
        with self._lock:
            n = sum(1 for s in self._writer.staged.values() if s.source_ip == source_ip)
            row = self._db.execute(
                f"SELECT (SELECT COUNT(*) FROM submissions WHERE source_ip = ? AND state IN {in_states(PENDING)}),"
                " (SELECT COALESCE(MAX(accepted), 0) FROM address_stats WHERE address = ?), (SELECT pending FROM probation)",
                (source_ip, source_ip)).fetchone()
        return int(row[0]) + n, bool(row[1]), int(row[2])

    def standing(self, source_ip: str) -> Standing:
        """What the allocation and the prefix of ``source_ip`` hold of probation's share (files being
        stored counted: every one, whatever its worker, an over-count of at most the staged ones),
        and the most files another allocation, and another prefix of the same allocation, with a
        never-leased submission hold (indexed; O(1))."""
        allocation, prefix = allocation_key(source_ip), prefix_key(source_ip)
        with self._lock:
            staged = self._writer.staged.values()
            na = sum(1 for s in staged if s.allocation == allocation)
            np_ = sum(1 for s in staged if s.prefix == prefix)
            row = self._db.execute(_STANDING_SQL, (allocation, allocation, prefix, allocation, prefix)).fetchone()
        return Standing(int(row[0]) + na, int(row[1]), int(row[2]) + np_, int(row[3]))

    def displace(self, plan: Callable[[ProbationView], list[SubmissionId] | None]) -> list[SubmissionId] | None:
        """The :attr:`~Transition.DISPLACE` transition, planned and applied under one hold of the
        store's lock (no lease, verdict or expiry can come between): ``plan`` reads what it needs
        through a :class:`ProbationView` and returns the submissions to displace, or ``None``
        (nothing is changed). Each of them still stored is displaced, its file deleted after the
        commit; a commit without an fsync (see ``__init__``), so the event loop may call this.

        Returns:
            The displaced submissions, or ``None`` when ``plan`` said no.
        """
        sources, target = TRANSITIONS[Transition.DISPLACE]
        with self._lock:
            victims = plan(ProbationView(self._db))
            if not victims:
                return victims
            done: list[SubmissionId] = []
            db = self._displace_db
            db.execute("BEGIN IMMEDIATE")
            try:
                for sid in victims:
                    cur = db.execute(f"UPDATE submissions SET state = ?, reason = ?, on_disk = 0 WHERE id = ? AND state IN {in_states(sources)}",
                                     (target.value, DISPLACED_REASON, sid))
                    if cur.rowcount:
                        done.append(sid)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            self._writer.unlink(done)  # in a writer thread; the same bytes posted again meanwhile are written after it
        return done

    def usage(self, worker: str, source_ip: str) -> Usage:
        """What one worker, one address, the workers on probation and everybody hold (:class:`Usage`).

        Submissions still being stored (:meth:`submit`) count as pending and on disk, each exactly
        once: one whose group is committing right now may already be in the index too, so those
        are looked up there (a group leaves the staged table only after its commit). Those whose
        file is not yet written make ``writing_bytes`` (not yet in the file system's free space).
        """
        with self._lock:
            staged = list(self._writer.staged.values())
            # not committing: its commit has not begun (the flag is set under this lock first), so not in the index
            committing = [s.sid for s in staged if s.committing]
            prefix, allocation = prefix_key(source_ip), allocation_key(source_ip)
            row = self._db.execute(_usage_sql(len(committing)), (worker, source_ip, *committing, worker, allocation, prefix)).fetchone()
            if row[6]:  # committing and already in the index: counted there
                indexed = set(row[6].split(","))
                staged = [s for s in staged if s.sid not in indexed]
            others = {s.worker for s in staged if s.worker != worker}
            known = {r[0] for r in self._db.execute(
                f"SELECT worker FROM worker_stats WHERE accepted > 0 AND worker IN ({','.join('?' * len(others))})", tuple(others))
            } if others else set()
        established = bool(row[7])
        w, ip, disk = (row[0], row[1]), (row[2], row[3]), (row[4], row[5])
        sw = [s.size_bytes for s in staged if s.worker == worker]
        si = [s.size_bytes for s in staged if s.source_ip == source_ip]
        sp = [s for s in staged if (s.worker == worker and not established) or (s.worker != worker and s.worker not in known)]
        spa = [s.size_bytes for s in sp if s.allocation == allocation]
        spp = [s.size_bytes for s in sp if s.prefix == prefix]
        return Usage(int(w[0]) + len(sw), int(w[1]) + sum(sw), int(ip[0]) + len(si), int(ip[1]) + sum(si),
                     int(disk[0]) + len(staged), int(disk[1]) + sum(s.size_bytes for s in staged),
                     sum(s.size_bytes for s in staged if not s.written), established, int(row[8]) + len(sp),
                     int(row[9]) + sum(s.size_bytes for s in sp), int(row[10]) + len(spa), int(row[11]) + sum(spa),
                     int(row[12]) + len(spp), int(row[13]) + sum(spp))

    def storing(self, sid: SubmissionId) -> bool:
        """Whether submission ``sid`` was submitted and is not yet committed (nor failed)."""
        with self._lock:
            return sid in self._writer.staged

    def leasable(self, now_ms: int) -> list[LeaseCandidate]:
        """Every pending submission not leased at ``now_ms`` (the disk quota bounds how many), with
        what the lease order needs (``trainer/ledger/leasing.py``)."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT s.id, s.worker, s.source_ip, s.seq, COALESCE(w.accepted, 0) > 0 FROM submissions s"
                f" LEFT JOIN worker_stats w ON w.worker = s.worker WHERE s.state IN {in_states(PENDING)} AND s.lease_until_ms <= ?",
                (now_ms,),
            ).fetchall()
        return [LeaseCandidate(SubmissionId(i), w, ip, int(seq), bool(e)) for i, w, ip, seq, e in rows]

    def lease(self, ids: list[SubmissionId], until_ms: int, now_ms: int) -> list[SubmissionId]:
        """The :attr:`~Transition.LEASE` transition: each of ``ids`` still pending and not leased at
        ``now_ms`` is leased until ``until_ms``; returns those."""
        sources, target = TRANSITIONS[Transition.LEASE]
        out: list[SubmissionId] = []
        with self._lock, self._transaction():
            for sid in ids:
                cur = self._db.execute(f"UPDATE submissions SET state = ?, lease_until_ms = ? WHERE id = ? AND state IN {in_states(sources)}"
                                       " AND lease_until_ms <= ?", (target.value, until_ms, sid, now_ms))
                if cur.rowcount:
                    out.append(sid)
        return out

    def apply(self, transition: Transition, ids: Iterable[SubmissionId], *, reason: str | None = None,
              consumed_step: int | None = None) -> list[SubmissionId]:
        """Apply ``transition`` (:data:`~trainer.ledger.states.TRANSITIONS`) to each of ``ids`` that
        is in one of its source states; returns those it changed.

        Args:
            reason: the new ``reason`` (:attr:`~Transition.EXPIRE`, :attr:`~Transition.BAN`).
            consumed_step: the consuming trainer step (:attr:`~Transition.CONSUME`; required there).

        Raises:
            ValueError: a verdict's transition (use :meth:`record_verdict`), or a missing ``consumed_step``.
        """
        with self._lock, self._transaction():
            return self._apply(transition, ids, reason=reason, consumed_step=consumed_step)

    def _apply(self, transition: Transition, ids: Iterable[SubmissionId], *, reason: str | None = None,
               consumed_step: int | None = None) -> list[SubmissionId]:
        """:meth:`apply` inside a transaction the caller holds (with the lock)."""
        sources, target = TRANSITIONS[transition]
        sets: list[str] = ["state = ?"]
        params: list[str | int] = [target.value]
        if transition in (Transition.ACCEPT, Transition.REJECT, Transition.LEASE):
            raise ValueError(f"{transition} is applied by record_verdict or lease")
        if transition is Transition.CONSUME:
            if consumed_step is None:
                raise ValueError("consume needs the consuming step")
            sets.append("consumed_step = ?")
            params.append(consumed_step)
        elif transition is Transition.UNCONSUME:
            sets.append("consumed_step = NULL")
        if reason is not None:
            sets.append("reason = ?")
            params.append(reason)
        sql = f"UPDATE submissions SET {', '.join(sets)} WHERE id = ? AND state IN {in_states(sources)}"
        return [sid for sid in ids if self._db.execute(sql, (*params, sid)).rowcount]

    def consume_groups(self, groups: Iterable[tuple[SubmissionId, str, int]], finished: Iterable[SubmissionId],
                       step: int) -> list[SubmissionId]:
        """Record the GRPO groups trainer step ``step`` consumed and apply :attr:`~Transition.CONSUME`
        (``consumed_step = step``) to ``finished``, the submissions every group of which is now
        consumed, in one transaction.

        Args:
            groups: ``(submission, task_key, group_seed)`` of each consumed group; a group already
                recorded keeps the step that consumed it first.
            finished: submissions to consume whole.
            step: the consuming trainer step.

        Returns:
            The submissions consumed now (accepted ones among ``finished``).
        """
        with self._lock, self._transaction():
            self._db.executemany("INSERT OR IGNORE INTO consumed_groups (submission_id, task_key, group_seed, step) VALUES (?, ?, ?, ?)",
                                 [(sid, key, int(seed), step) for sid, key, seed in groups])
            return self._apply(Transition.CONSUME, finished, consumed_step=step)

    def consumed_groups(self) -> set[GroupKey]:
        """Keys ``(task_key, group_seed)`` of the consumed groups of submissions not yet retired."""
        with self._lock:
            return {(k, int(s)) for k, s in self._db.execute("SELECT task_key, group_seed FROM consumed_groups")}

    def unconsume_after(self, step: int) -> list[SubmissionId]:
        """Forget every group consumed by a trainer step after ``step`` and apply
        :attr:`~Transition.UNCONSUME` to the submissions those steps consumed, in one transaction;
        returns the submissions unconsumed."""
        sql, params = _select_sql({State.CONSUMED}, consumed_above=step)
        with self._lock, self._transaction():
            self._db.execute("DELETE FROM consumed_groups WHERE step > ?", (step,))
            return self._apply(Transition.UNCONSUME, [SubmissionId(r[0]) for r in self._db.execute(sql, params).fetchall()])

    def select(self, states: Iterable[State], *, worker: str | None = None, policy_below: int | None = None,
               consumed_below: int | None = None, consumed_above: int | None = None, on_disk: bool | None = None) -> list[SubmissionId]:
        """IDs of submissions in ``states`` matching every filter given (each an indexed range)."""
        sql, params = _select_sql(states, worker=worker, policy_below=policy_below, consumed_below=consumed_below,
                                  consumed_above=consumed_above, on_disk=on_disk)
        with self._lock:
            return [SubmissionId(r[0]) for r in self._db.execute(sql, params)]

    def record_verdict(self, verdict_id: str, submission_id: SubmissionId, validator: str, accepted: bool, reason: str,
                       now_ms: int | None = None, evidence: str = "") -> bool:
        """Record a validator's verdict; the first on a pending submission decides it (the
        :attr:`~Transition.ACCEPT` or :attr:`~Transition.REJECT` transition, in the same transaction).

        Every verdict is recorded (with ``evidence``, a one-line summary), deciding or not.

        Returns:
            ``True`` if it decided the submission's state, ``False`` if it was a repeat or late.
        """
        now = now_ms or int(time.time() * 1000)
        sources, target = TRANSITIONS[Transition.ACCEPT if accepted else Transition.REJECT]
        with self._lock, self._transaction():
            self._db.execute(
                "INSERT OR IGNORE INTO verdicts (id, submission_id, validator, accepted, reason, received_ms, evidence)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (verdict_id, submission_id, validator, int(accepted), reason, now, evidence),
            )
            cur = self._db.execute(
                f"UPDATE submissions SET state = ?, reason = ?, verdict_by = ? WHERE id = ? AND state IN {in_states(sources)}",
                (target.value, reason, validator, submission_id),
            )
        return cur.rowcount == 1

    def deciding_verdict(self, submission_id: SubmissionId) -> DecidingVerdict | None:
        """The verdict that decided ``submission_id``'s state, or ``None`` while it is pending (or
        when it was rejected without one: stale, its worker banned)."""
        with self._lock:
            row = self._db.execute(
                "SELECT v.id, v.validator, v.accepted, v.reason, v.evidence FROM submissions s JOIN verdicts v"
                " ON v.submission_id = s.id AND v.validator = s.verdict_by AND v.reason = s.reason"
                f" WHERE s.id = ? AND s.state NOT IN {in_states(PENDING)} ORDER BY v.received_ms LIMIT 1",
                (submission_id,),
            ).fetchone()
        return DecidingVerdict(bytes.fromhex(row[0]), PeerId(row[1]), bool(row[2]), row[3], row[4]) if row else None

    def delete_files(self, ids: Iterable[SubmissionId]) -> int:
        """Delete the files of these submissions (their index rows stay); returns how many were on disk."""
        ids = list(ids)
        n = 0
        for sid in ids:
            path = self.dir / f"{sid}.sub"
            if path.exists():
                path.unlink(missing_ok=True)
                n += 1
        with self._lock:
            self._db.executemany("UPDATE submissions SET on_disk = 0 WHERE id = ?", [(i,) for i in ids])
        return n

    def trainable(self, min_policy_step: int, max_policy_step: int) -> list[StoredSubmission]:
        """Accepted submissions not yet consumed with ``min_policy_step ≤ policy_step ≤ max_policy_step``, oldest first."""
        with self._lock:
            rows = self._db.execute(_TRAINABLE_SQL, (min_policy_step, max_policy_step)).fetchall()
        return [_row(r) for r in rows]

    # --- read models (their own connection: never the store's lock) ----------------------------

    def _snapshot(self, *queries: tuple[str, tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
        """Rows of each query, all from one committed snapshot."""
        with self._stats_lock:
            self._stats_db.execute("BEGIN")
            try:
                return [self._stats_db.execute(q, p).fetchall() for q, p in queries]
            finally:
                self._stats_db.execute("COMMIT")

    def counts(self) -> dict[str, int]:
        """Submissions of the run: ``pending`` now, ever ``accepted``, ``rejected`` and ``consumed``
        (trained on by a step), and ``displaced`` now (their place in probation's share taken; a
        restored one counts as pending again). O(workers)."""
        ((row,),) = self._snapshot((("SELECT COALESCE(SUM(pending), 0), COALESCE(SUM(accepted), 0), COALESCE(SUM(rejected), 0),"
                                    " COALESCE(SUM(trained), 0), COALESCE(SUM(displaced), 0) FROM worker_stats"), ()))
        return dict(zip(("pending", "accepted", "rejected", "consumed", "displaced"), (int(x) for x in row), strict=True))

    def verdict_reasons(self) -> dict[str, int]:
        """Verdicts received, by reason (deciding or not)."""
        (rows,) = self._snapshot(("SELECT reason, n FROM verdict_reasons", ()))
        return {k: int(v) for k, v in rows}

    def worker_stats(self, limit: int | None = None) -> dict[str, dict[str, int]]:
        """Per worker, its non-zero counts: ``pending``, ``accepted``, ``rejected``, ``stale`` (of the
        rejected, those that left the async window unjudged: no fault of the worker's) and
        ``trained`` (submissions a trainer step consumed), ``displaced`` (their place in probation's
        share taken by a lighter prefix: no verdict, not rejected). O(workers); with ``limit``, only the
        ``limit`` first in the leaderboard's order (most accepted, then fewest rejected), O(limit)."""
        keys = ("pending", "accepted", "rejected", "stale", "trained", "displaced")
        query = f"SELECT worker, {', '.join(keys)} FROM worker_stats"
        (rows,) = self._snapshot((query, ()) if limit is None else (query + " ORDER BY accepted DESC, rejected, worker LIMIT ?", (limit,)))
        return {r[0]: {k: int(v) for k, v in zip(keys, r[1:], strict=True) if v} for r in rows}

    def worker_standing(self, worker: str) -> dict[str, Any]:
        """One worker's counts (``worker_stats``' columns, zero when it has no submission), its
        rejections by reason (``rejected_by_reason``), its ``place`` in the leaderboard's order (1 is
        first; 0 without a submission) and ``workers`` (all with a submission), from one snapshot.
        O(its rejected submissions + the workers ranked at or above it)."""
        keys = ("pending", "accepted", "rejected", "stale", "trained", "rollouts_trained", "displaced")
        (row,) = self._snapshot((f"SELECT {', '.join(keys)} FROM worker_stats WHERE worker = ?", (worker,)))
        counts = dict(zip(keys, (int(x) for x in row[0]), strict=True)) if row else dict.fromkeys(keys, 0)
        a, r = counts["accepted"], counts["rejected"]
        ahead, total, reasons = self._snapshot(
            ("SELECT COUNT(*) FROM worker_stats WHERE accepted > ? OR (accepted = ? AND (rejected < ? OR (rejected = ? AND worker < ?)))",
             (a, a, r, r, worker)),
            ("SELECT COUNT(*) FROM worker_stats", ()),
            (f"SELECT reason, COUNT(*) FROM submissions WHERE worker = ? AND state = '{State.REJECTED.value}' GROUP BY reason", (worker,)),
        )
        return {**counts, "place": int(ahead[0][0]) + 1 if row else 0, "workers": int(total[0][0]),
                "rejected_by_reason": {str(k or "unknown"): int(n) for k, n in reasons}}

    def displaced_now(self, worker: str) -> int:
        """How many of ``worker``'s submissions are displaced now (O(1): its read-model row)."""
        (rows,) = self._snapshot(("SELECT displaced FROM worker_stats WHERE worker = ?", (worker,)))
        return int(rows[0][0]) if rows else 0

    def worker_count(self) -> int:
        """Workers with a submission in this run."""
        (rows,) = self._snapshot(("SELECT COUNT(*) FROM worker_stats", ()))
        return int(rows[0][0])

    def leaderboard(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` workers with the most accepted submissions (then fewest rejected, then peer
        ID): ``peer_id``, ``accepted``, ``rejected``, ``pending``, ``submissions_trained``,
        ``rollouts_trained``, ``tokens`` (completion tokens of everything it stored)."""
        (rows,) = self._snapshot((("SELECT worker, accepted, rejected, pending, trained, rollouts_trained, tokens FROM worker_stats"
                                  " ORDER BY accepted DESC, rejected, worker LIMIT ?"), (limit,)))
        keys = ("peer_id", "accepted", "rejected", "pending", "submissions_trained", "rollouts_trained", "tokens")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on an error) on a connection the caller holds the lock of."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.db.execute("COMMIT")
        elif self.db.in_transaction:
            self.db.execute("ROLLBACK")


_TRAINABLE_SQL = f"SELECT {_ROW} FROM submissions WHERE state = '{State.ACCEPTED.value}' AND policy_step BETWEEN ? AND ? ORDER BY seq"


def _select_sql(states: Iterable[State], *, worker: str | None = None, policy_below: int | None = None, consumed_below: int | None = None,
                consumed_above: int | None = None, on_disk: bool | None = None) -> tuple[str, tuple[Any, ...]]:
    """The statement of :meth:`SubmissionStore.select` and its parameters."""
    where, params = [f"state IN {in_states(states)}"], []
    for clause, value in (("worker = ?", worker), ("policy_step < ?", policy_below), ("consumed_step < ?", consumed_below),
                          ("consumed_step > ?", consumed_above), ("on_disk = ?", None if on_disk is None else int(on_disk))):
        if value is not None:
            where.append(clause)
            params.append(value)
    return f"SELECT id FROM submissions WHERE {' AND '.join(where)}", tuple(params)


def _usage_sql(n_committing: int) -> str:
    """The one statement of :meth:`SubmissionStore.usage` (one snapshot; each index range read once):
    parameters ``worker, source_ip``, ``n_committing`` submission IDs, ``worker``, ``allocation``,
    ``prefix``; one row ``(worker count, worker bytes, address count, address bytes, files on disk,
    their bytes, comma-joined IDs of the given ones already indexed, the worker's accepted count,
    probation count, probation bytes, the allocation's probation count, its probation bytes, the
    prefix's probation count, its probation bytes)``."""
    marks = ",".join("?" * n_committing) or "NULL"
    pending = in_states(PENDING)
    return ("SELECT w.n, w.b, i.n, i.b, d.n, d.b, x.ids, e.accepted, p.pending, p.pending_bytes,"
            " COALESCE(a.n, 0), COALESCE(a.b, 0), COALESCE(f.n, 0), COALESCE(f.b, 0) FROM"
            f" (SELECT COUNT(*) AS n, COALESCE(SUM(size_bytes), 0) AS b FROM submissions WHERE worker = ? AND state IN {pending}) AS w,"
            f" (SELECT COUNT(*) AS n, COALESCE(SUM(size_bytes), 0) AS b FROM submissions WHERE source_ip = ? AND state IN {pending}) AS i,"
            " (SELECT COUNT(*) AS n, COALESCE(SUM(size_bytes), 0) AS b FROM submissions WHERE on_disk = 1) AS d,"
            f" (SELECT group_concat(id) AS ids FROM submissions WHERE id IN ({marks})) AS x,"
            " (SELECT COALESCE(MAX(accepted), 0) AS accepted FROM worker_stats WHERE worker = ?) AS e,"
            " probation AS p"
            " LEFT JOIN (SELECT pending AS n, pending_bytes AS b FROM probation_allocations WHERE allocation = ?) AS a ON 1"
            " LEFT JOIN (SELECT pending AS n, pending_bytes AS b FROM probation_prefixes WHERE prefix = ?) AS f ON 1")


def _chain_duplicate(first: Future[bool], dup: Future[bool]) -> None:
    """Resolve a duplicate's future when the first copy's does: ``False`` (already stored), or its error."""
    e = first.exception()
    if e is not None:
        dup.set_exception(e)
    else:
        dup.set_result(False)
