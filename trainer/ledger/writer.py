"""The ledger's write path: submission files and their index rows, group committed.

:class:`GroupCommit` is the only code that writes a new submission; the store
(:mod:`trainer.ledger.store`) stages each admitted submission here and answers every query.
The ingest acknowledges a submission only once its future resolves:

1. :meth:`GroupCommit.stage` (called by ``SubmissionStore.submit`` under the store's lock) keeps
   the submission in the staging table at once, so the store's quota and replay queries count it
   from that instant, and hands it to a writer thread;
2. a writer thread writes ``<id>.sub`` with :func:`protocol.durable.atomic_write` without the
   directory flush (temporary file, ``fsync``, rename into place) — several files at once; the
   file holds the address it was posted from (:func:`file_header`) before the envelope;
3. the commit thread takes every written submission waiting for it, flushes the directory
   once for all of them (the renames are durable) and inserts all their index rows in one SQLite
   transaction (WAL) on its own connection, so readers do not wait for it; only then does each
   one's future resolve. Submissions written while a commit runs wait for the next one, so under
   load one directory ``fsync`` serves a whole group instead of every submission.

The ordering per submission is the one a single durable write had (file data, rename, directory,
index row, then the answer). The group's index rows are committed with ``synchronous=NORMAL``:
they are in the WAL at once (a crash of the process keeps them) and on stable storage with the
WAL's next ``fsync`` (any commit of the store's main connection, all ``synchronous=FULL``, or a
checkpoint). A power cut can therefore take only the newest index rows, never their files, and
a WAL is recovered as a prefix, so no later verdict survives without them;
``SubmissionStore.recover`` re-indexes on start every file without an index row.

The staging table and the threads' queues are guarded by the store's lock (passed in): the
store's readers see a submission staged, committing or committed, each exactly once.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from protocol.durable import atomic_write, fsync_dir, tmp_path_for
from trainer.ledger.ids import SubmissionId
from trainer.ledger.prefixes import allocation_key, prefix_key
from trainer.ledger.states import State

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 60.0
"""How long a write on one of the index's SQLite connections waits for another's, seconds."""

WRITERS = 32
"""Submission files written and flushed (``fsync``) at once: concurrent flushes share the file
system's journal commits, so a slow disk is waited for once per group, not once per file."""

FILE_MAGIC = b"\xc1isa"
"""First bytes of a submission file that starts with the address it was posted from. ``0xC1`` is
never the first byte of msgpack, so a file an older version wrote (the bare envelope) reads as one
with no address."""
MAX_FILE_ADDRESS_BYTES = 255
"""Longest address kept in a file's header (UTF-8 bytes; a longer one, no IP address, is not kept)."""


def file_header(address: str) -> bytes:
    """What a submission file holds before its envelope: :data:`FILE_MAGIC`, the address's length
    (one byte) and the address (``protocol.addresses.address_key``, UTF-8). Kept so that
    ``SubmissionStore.recover`` re-indexes a file whose index row a crash lost under its own
    address prefix (without it, every such file shared the prefix ``""``, heavier than any other,
    and was displaced first). ``b""`` for no address or one longer than :data:`MAX_FILE_ADDRESS_BYTES`."""
    raw = address.encode("utf-8")
    if not raw or len(raw) > MAX_FILE_ADDRESS_BYTES:
        return b""
    return FILE_MAGIC + bytes([len(raw)]) + raw


def read_submission_file(path: Path) -> tuple[str, bytes]:
    """The address a submission file keeps (``""``: none) and its envelope bytes (blocking).

    Raises:
        OSError: the file is gone (``FileNotFoundError``) or unreadable now.
    """
    with open(path, "rb") as f:
        head = f.read(len(FILE_MAGIC) + 1)
        if head[: len(FILE_MAGIC)] != FILE_MAGIC or len(head) <= len(FILE_MAGIC):
            return "", head + f.read()
        address = f.read(head[-1]).decode("utf-8", errors="replace")
        return address, f.read()


def _write_file(path: Path, header: bytes, raw: bytes) -> None:
    with open(path, "wb") as f:
        f.write(header)
        f.write(raw)


@dataclass
class Staged:
    """A submission admitted but not yet committed: counted by the quotas, not yet visible to readers."""

    sid: SubmissionId
    worker: str
    policy_step: int
    counter: int
    n_rollouts: int
    tokens: int
    size_bytes: int
    received_ms: int
    source_ip: str
    raw: bytes
    future: Future[bool] = field(default_factory=Future)
    admitted: int = 0  # admission number: a group is indexed in admission order
    committing: bool = False  # its group's transaction may already be visible (usage() then checks the index)
    written: bool = False  # its file is complete (or its write failed): the free space on disk shows it
    prefix: str = ""  # source_ip's prefix (trainer.ledger.prefixes)
    allocation: str = ""  # and its allocation

    def __post_init__(self) -> None:
        self.prefix = prefix_key(self.source_ip)
        self.allocation = allocation_key(self.source_ip)


class GroupCommit:
    """Writes staged submissions under ``directory`` and commits their rows into ``index``: a pool of
    :data:`WRITERS` writer threads and one commit thread, started on first use and stopped by
    :meth:`close` (which first finishes every submission already staged).

    Args:
        directory: where ``<id>.sub`` files go.
        index: the SQLite index file (the commit thread opens its own connection).
        lock: the store's lock, which guards :attr:`staged` and this object's queues.
    """

    def __init__(self, directory: Path, index: Path, lock: threading.Lock) -> None:
        self.dir = Path(directory)
        self._lock = lock
        self.staged: dict[str, Staged] = {}
        """Staged, not yet committed (nor failed), by submission ID; read under the lock."""
        self._written: list[Staged] = []  # files durable and renamed, waiting for the commit thread
        self._wake = threading.Condition(lock)  # the commit thread waits here for written files
        self._admitted = 0
        self._writers: ThreadPoolExecutor | None = None
        self._committer: threading.Thread | None = None
        self._unlinking: dict[str, tuple[object, Future[None]]] = {}  # displaced submissions whose file a writer thread deletes
        self.closing = False
        """Set by :meth:`close`: nothing more may be staged."""
        self.commits = {"groups": 0, "submissions": 0, "largest_group": 0}
        """Group commits done, submissions they committed, and the most in one (for benchmarks)."""
        # Its own connection, so its commits do not hold the lock every reader takes. synchronous=NORMAL:
        # its commits reach the WAL (they survive a crash of this process) and stable storage with the
        # next fsync of the WAL (the next FULL commit of the store's connection, or a checkpoint). A
        # power cut can lose only the newest index rows, whose files are already on stable storage,
        # and the store's recover() re-indexes those on start: no acknowledged submission is lost,
        # and one WAL fsync fewer is waited for per group.
        self._db = sqlite3.connect(index, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        self._db.execute("PRAGMA synchronous=NORMAL")

    def stage(self, item: Staged) -> None:
        """Stage ``item`` and start writing it (the caller holds the lock; no I/O here). If a file of
        the same name is being deleted (displaced a moment ago), it is written after that."""
        item.admitted = self._admitted
        self._admitted += 1
        self.staged[item.sid] = item
        unlinking = self._unlinking.get(item.sid, (None, None))[1]
        self._start_threads().submit(self._write, item, unlinking)

    def unlink(self, ids: list[SubmissionId]) -> None:
        """Delete the files of displaced submissions in a writer thread (the caller holds the lock; an
        unlink took ~1 ms on this machine's disk, on the event loop). The same bytes staged again
        meanwhile are written after it (:meth:`stage`)."""
        writers = self._start_threads()
        for sid in ids:
            token = object()
            self._unlinking[sid] = (token, writers.submit(self._unlink, sid, token))

    def close(self) -> None:
        """Finish every staged write (their futures resolve), stop the threads, close the connection."""
        with self._lock:
            self.closing = True
            self._wake.notify_all()
            writers, committer = self._writers, self._committer
        if writers is not None:
            writers.shutdown(wait=True)  # every written file reaches _written
        if committer is not None:
            with self._lock:
                self._wake.notify_all()
            committer.join()
        with self._lock:
            self._db.close()

    def _start_threads(self) -> ThreadPoolExecutor:
        """The writer pool, and the commit thread, started on first use (the caller holds the lock)."""
        if self._writers is None:
            self._writers = ThreadPoolExecutor(WRITERS, thread_name_prefix="ingest-write")
            self._committer = threading.Thread(target=self._commit_loop, name="ingest-commit", daemon=True)
            self._committer.start()
        return self._writers

    def _write(self, item: Staged, after: Future[None] | None = None) -> None:
        """Writer thread: the file durably under its final name; the directory is flushed per group
        (``after``: the deletion of a displaced file of the same name, submitted to this pool
        earlier, so already running or done)."""
        if after is not None:
            after.exception()  # waits; its failure is its own (logged there)
        path = self.dir / f"{item.sid}.sub"
        header = file_header(item.source_ip)
        try:
            atomic_write(path, (lambda p: _write_file(p, header, item.raw)) if header else item.raw, sync_dir=False)
        except Exception as e:  # noqa: BLE001 - whatever failed, the waiting request gets it as its answer
            # a failed write (EIO, ENOSPC) leaves its temporary file, counted by no quota: drop it now
            tmp_path_for(path).unlink(missing_ok=True)
            with self._lock:
                item.written = True
                self.staged.pop(item.sid, None)
            item.future.set_exception(e)
            return
        with self._lock:
            item.written = True
            self._written.append(item)
            self._wake.notify()

    def _commit_loop(self) -> None:
        """Commit thread: one directory ``fsync`` and one SQLite transaction per group of written files."""
        while True:
            with self._lock:
                while not self._written and not (self.closing and not self.staged):
                    self._wake.wait()
                if not self._written:
                    return  # closing and nothing left to commit
                group, self._written = sorted(self._written, key=lambda i: i.admitted), []
            try:
                fsync_dir(self.dir)
                with self._lock:
                    for item in group:
                        item.committing = True
                # the WAL fsync happens here, without the lock: readers and admission go on meanwhile
                insert_rows(self._db, group)
                with self._lock:
                    for item in group:
                        del self.staged[item.sid]
                    self.commits["groups"] += 1
                    self.commits["submissions"] += len(group)
                    self.commits["largest_group"] = max(self.commits["largest_group"], len(group))
            except Exception as e:  # noqa: BLE001 - whatever failed, every waiting request gets it as its answer
                for item in group:  # not acknowledged: drop the files too, so the disk quota stays exact
                    (self.dir / f"{item.sid}.sub").unlink(missing_ok=True)
                with self._lock:
                    for item in group:
                        self.staged.pop(item.sid, None)
                logger.error("could not commit %d submissions: %s", len(group), e)
                for item in group:
                    item.future.set_exception(e)
                continue
            for item in group:
                item.future.set_result(True)

    def _unlink(self, sid: SubmissionId, token: object) -> None:
        """Writer thread: delete a displaced submission's file."""
        try:
            (self.dir / f"{sid}.sub").unlink(missing_ok=True)
        except OSError as e:  # left for recover(): a displaced row's file restores it on the next start
            logger.warning("could not delete displaced submission %s: %s", sid[:12], e)
        finally:
            with self._lock:
                if self._unlinking.get(sid, (None,))[0] is token:
                    del self._unlinking[sid]


def insert_rows(db: sqlite3.Connection, items: list[Staged]) -> None:
    """Insert the index rows of ``items`` in one transaction on ``db``, in order (the commit thread's
    connection, or the store's under its lock for ``recover``).

    A displaced submission's row (the same bytes posted again) is *restored*
    (:attr:`~trainer.ledger.states.Transition.RESTORE`): stored again, with its new address and
    arrival; any other existing row is left alone."""
    db.execute("BEGIN IMMEDIATE")
    try:
        seq = db.execute("SELECT COALESCE(MAX(seq), 0) FROM submissions").fetchone()[0]
        rows = []
        for item in items:
            seq += 1
            rows.append((item.sid, item.worker, item.policy_step, item.counter, item.n_rollouts, item.tokens, item.size_bytes,
                         item.received_ms, State.STORED.value, seq, item.source_ip, item.prefix, item.allocation))
        db.executemany(
            "INSERT INTO submissions (id, worker, policy_step, counter, n_rollouts, tokens, size_bytes, received_ms, state,"
            " seq, source_ip, prefix, allocation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET state = excluded.state, reason = '', verdict_by = '', lease_until_ms = 0,"
            " received_ms = excluded.received_ms, seq = excluded.seq, source_ip = excluded.source_ip, prefix = excluded.prefix,"
            f" allocation = excluded.allocation, on_disk = 1 WHERE submissions.state = '{State.DISPLACED.value}'",
            rows,
        )
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
