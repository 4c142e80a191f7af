"""On-disk, content-addressed store of manifests and pieces for one run.

Layout under ``<data_dir>/shardcast/<run ID hex>/``::

    manifests/<step>.manifest   exact envelope bytes of the coordinator-signed manifest
    pieces/<hh>/<piece ID hex>  one file per verified piece (``hh``: first two hex digits)
    tmp/                        files being written; renamed into place when complete

Every file appears by atomic rename, so a reader never sees a partial piece or manifest, and
a piece file exists only once its bytes hashed to its name. A step is *complete* (held) when
every piece its manifest lists is present. Retention keeps the newest ``keep_steps`` complete
steps plus any newer step still being filled, and deletes only pieces that no kept manifest
lists, so a fetch of a kept step is never disturbed (a reader with an open file keeps its data
on POSIX even if a file is unlinked).

The store is synchronous and thread-safe; async callers run its disk work through
``asyncio.to_thread``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from node.errors import StoreError
from protocol.content import hex_id
from protocol.envelope import Authorities, Envelope
from protocol.messages import Manifest
from protocol.shardcast import PieceId, PieceRef, iter_pieces, open_manifest

logger = logging.getLogger(__name__)

_STALE_TMP_S = 3600.0


class PieceWriter:
    """Writes one piece into the store's tmp dir, hashing as it goes; :meth:`commit` verifies it.

    Not for concurrent use by several threads; one writer per piece download.
    """

    def __init__(self, store: ShardcastStore, piece_id: PieceId, size_bytes: int) -> None:
        self._store = store
        self.piece_id = piece_id
        self.size_bytes = size_bytes
        self._tmp = store.tmp_path(piece_id)
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed by commit/abort
        self._hash = hashlib.sha256()
        self.written_bytes = 0

    def write(self, chunk: bytes | memoryview) -> None:
        """Append ``chunk`` to the piece (blocking: file write + hash)."""
        self._f.write(chunk)
        self._hash.update(chunk)
        self.written_bytes += len(chunk)

    def digest_matches(self) -> bool:
        """Whether the bytes written so far are exactly the piece."""
        return self.written_bytes == self.size_bytes and self._hash.digest() == self.piece_id

    def commit(self) -> None:
        """Move the verified piece into place (blocking).

        Raises:
            StoreError: the written bytes do not form the piece (callers verify first).
        """
        if not self.digest_matches():
            self.abort()
            raise StoreError(f"refusing to store piece {hex_id(self.piece_id)[:16]}…: bytes do not match its ID")
        if self._store.fsync:
            self._f.flush()
            os.fsync(self._f.fileno())
        self._f.close()
        dest = self._store.piece_path(self.piece_id)
        dest.parent.mkdir(exist_ok=True)
        os.replace(self._tmp, dest)

    def abort(self) -> None:
        """Drop what was written (blocking)."""
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)


class _StoreSink:
    """:class:`protocol.shardcast.PieceSink` that stores pieces while a checkpoint is cut."""

    def __init__(self, store: ShardcastStore) -> None:
        self._store = store
        self._tmp = store.tmp_path(b"publish")
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in end_piece/close

    def write(self, chunk: bytes) -> None:
        self._f.write(chunk)

    def end_piece(self, piece_id: PieceId, size_bytes: int) -> None:
        if self._store.fsync:
            self._f.flush()
            os.fsync(self._f.fileno())
        self._f.close()
        dest = self._store.piece_path(piece_id)
        if dest.exists():
            self._tmp.unlink()
        else:
            dest.parent.mkdir(exist_ok=True)
            os.replace(self._tmp, dest)
        self._f = open(self._tmp, "wb")  # noqa: SIM115

    def close(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)


class ShardcastStore:
    """Manifests and pieces of one run on disk.

    Args:
        data_dir: the node's data directory; the store lives in ``shardcast/<run ID hex>/`` below it.
        run_id: 32-byte run ID; manifests of other runs are rejected.
        authorities: the run's keys; manifests not signed by its coordinator are rejected.
        keep_steps: complete steps to keep (≥ 1; the run spec's ``shardcast.keep_steps``).
        fsync: flush pieces and manifests to stable storage before they become visible.

    Raises:
        StoreError: the directory cannot be created.
    """

    def __init__(
        self, data_dir: Path, *, run_id: bytes, authorities: Authorities, keep_steps: int, fsync: bool = True
    ) -> None:
        if keep_steps < 1:
            raise ValueError("keep_steps must be ≥ 1")
        self.run_id = run_id
        self.authorities = authorities
        self.keep_steps = keep_steps
        self.fsync = fsync
        self.root = Path(data_dir) / "shardcast" / run_id.hex()
        self._manifest_dir = self.root / "manifests"
        self._piece_dir = self.root / "pieces"
        self._tmp_dir = self.root / "tmp"
        self._lock = threading.Lock()
        self._manifests: dict[int, Envelope[Manifest]] = {}
        self._complete: set[int] = set()
        try:
            for d in (self._manifest_dir, self._piece_dir, self._tmp_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the Shardcast store at {self.root}: {e.strerror}") from e
        self._clean_tmp()
        self.refresh()

    # --- paths ------------------------------------------------------------------------------

    def piece_path(self, piece_id: bytes) -> Path:
        """Where the piece with ID ``piece_id`` lives (whether or not it is held)."""
        h = hex_id(piece_id)
        return self._piece_dir / h[:2] / h

    def tmp_path(self, tag: bytes) -> Path:
        """A fresh temporary file name in the store (same filesystem as the pieces)."""
        return self._tmp_dir / f"{tag.hex()[:16]}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}"

    def _manifest_path(self, step: int) -> Path:
        return self._manifest_dir / f"{step}.manifest"

    def _clean_tmp(self) -> None:
        now = time.time()
        for p in self._tmp_dir.iterdir():
            try:
                if now - p.stat().st_mtime > _STALE_TMP_S or p.name.split(".")[1] == str(os.getpid()):
                    p.unlink()
            except (OSError, IndexError):
                continue

    # --- manifests --------------------------------------------------------------------------

    def refresh(self) -> list[int]:
        """Pick up manifests another process wrote (``publish`` into a served store); blocking.

        Returns:
            Steps newly found, ascending. Unreadable or invalid manifest files are skipped with a warning.
        """
        found: list[int] = []
        for p in sorted(self._manifest_dir.glob("*.manifest")):
            try:
                step = int(p.stem)
            except ValueError:
                continue
            with self._lock:
                if step in self._manifests:
                    continue
            try:
                env = open_manifest(p.read_bytes(), run_id=self.run_id, authorities=self.authorities)
            except Exception as e:  # noqa: BLE001 - a bad file on disk must not stop the node
                logger.warning("ignoring unreadable manifest %s: %s", p, e)
                continue
            if env.body.step != step:
                logger.warning("ignoring manifest %s: it is for step %d", p, env.body.step)
                continue
            with self._lock:
                self._manifests[step] = env
            self.check_complete(step)
            found.append(step)
        with self._lock:  # steps whose manifests another process pruned
            for step in [s for s in self._manifests if not self._manifest_path(s).exists()]:
                del self._manifests[step]
                self._complete.discard(step)
        return found

    def add_manifest(self, raw: bytes) -> Envelope[Manifest]:
        """Verify and store a manifest (blocking); a known step keeps its first manifest.

        Returns:
            The stored envelope for that step.

        Raises:
            ProtocolError: subclasses from :func:`protocol.shardcast.open_manifest`; nothing is stored.
        """
        env = open_manifest(raw, run_id=self.run_id, authorities=self.authorities)
        step = env.body.step
        with self._lock:
            if step in self._manifests:
                return self._manifests[step]
        tmp = self.tmp_path(b"manifest")
        with open(tmp, "wb") as f:
            f.write(env.raw)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self._manifest_path(step))
        with self._lock:
            self._manifests.setdefault(step, env)
        self.check_complete(step)
        logger.info("stored manifest of step %d (%d files)", step, len(env.body.files), extra={"step": step})
        return env

    def manifest(self, step: int) -> Envelope[Manifest] | None:
        """The stored manifest of ``step``, or ``None``."""
        with self._lock:
            return self._manifests.get(step)

    def steps(self) -> list[int]:
        """Steps with a stored manifest (complete or being filled), ascending."""
        with self._lock:
            return sorted(self._manifests)

    def held_steps(self) -> list[int]:
        """Complete steps (every piece present), ascending: what a node may announce."""
        with self._lock:
            return sorted(self._complete)

    def is_complete(self, step: int) -> bool:
        with self._lock:
            return step in self._complete

    def latest_step(self, *, complete_only: bool = False) -> int | None:
        """The highest stored (or, with ``complete_only``, held) step, or ``None``."""
        steps = self.held_steps() if complete_only else self.steps()
        return steps[-1] if steps else None

    # --- pieces -----------------------------------------------------------------------------

    def has_piece(self, piece_id: bytes) -> bool:
        return self.piece_path(piece_id).exists()

    def missing_pieces(self, step: int) -> list[PieceRef]:
        """Pieces of ``step``'s manifest not in the store, in manifest order (blocking: one stat each)."""
        env = self.manifest(step)
        if env is None:
            raise StoreError(f"no manifest for step {step}")
        return [p for p in iter_pieces(env.body) if not self.has_piece(p.piece_id)]

    def piece_writer(self, piece_id: PieceId, size_bytes: int) -> PieceWriter:
        """A writer for one piece that verifies before it stores (blocking open)."""
        return PieceWriter(self, piece_id, size_bytes)

    def sink(self) -> _StoreSink:
        """A :class:`protocol.shardcast.PieceSink` storing pieces as they are cut; ``close()`` it."""
        return _StoreSink(self)

    def check_complete(self, step: int) -> bool:
        """Re-check whether ``step`` is complete and record it (blocking)."""
        env = self.manifest(step)
        if env is None:
            return False
        done = all(self.has_piece(p.piece_id) for p in iter_pieces(env.body))
        with self._lock:
            if done and step in self._manifests:
                newly = step not in self._complete
                self._complete.add(step)
            else:
                newly = False
        if newly:
            logger.info("step %d complete", step, extra={"step": step})
        return done

    # --- retention --------------------------------------------------------------------------

    def steps_to_keep(self) -> set[int]:
        """The newest ``keep_steps`` complete steps and every incomplete step newer than the oldest of them."""
        with self._lock:
            kept = set(sorted(self._complete)[-self.keep_steps:])
            floor = min(kept) if len(kept) >= self.keep_steps else -1
            kept |= {s for s in self._manifests if s not in self._complete and s > floor}
        return kept

    def prune(self, protect: Iterable[int] = ()) -> list[int]:
        """Delete steps outside :meth:`steps_to_keep` (and not in ``protect``); blocking.

        The manifest goes first (no one is offered the step any more), then the pieces that no
        kept manifest lists.

        Returns:
            The removed steps, ascending.
        """
        keep = self.steps_to_keep() | set(protect)
        with self._lock:
            drop = sorted(s for s in self._manifests if s not in keep)
            if not drop:
                return []
            dropped = {s: self._manifests.pop(s) for s in drop}
            self._complete.difference_update(drop)
            still_used = {p.piece_id for env in self._manifests.values() for p in iter_pieces(env.body)}
        for step, env in dropped.items():
            self._manifest_path(step).unlink(missing_ok=True)
            for p in iter_pieces(env.body):
                if p.piece_id not in still_used:
                    self.piece_path(p.piece_id).unlink(missing_ok=True)
            logger.info("pruned step %d", step, extra={"step": step})
        return drop
