"""On-disk, content-addressed store of manifests and pieces for one run.

Layout under ``<data_dir>/shardcast/<run ID hex>/``::

    manifests/<step>.manifest   exact envelope bytes of the coordinator-signed manifest
    deltas/<step>.delta         exact envelope bytes of the coordinator-signed delta into <step>
    artifacts/<ID hex>.artifact exact bytes of an artifact manifest, hashing to its ID (``protocol.artifacts``)
    pieces/<hh>/<piece ID hex>  one file per verified piece (``hh``: first two hex digits)
    tmp/                        files being written; renamed into place when complete

Every file appears by atomic rename, so a reader never sees a partial piece or manifest, and
a piece file exists only once its bytes hashed to its name.

Durability is batched: a verified piece is renamed into place at once (and served from the page
cache) while its ``fsync`` runs in a background thread; :meth:`ShardcastStore.sync` waits for
those and flushes the piece directories, and a step is marked complete (announced) only after
that sync, as is a published manifest stored. Before the first unflushed piece is renamed in, a
marker file ``unsynced.<pid>.<n>`` (holding the pid and the boot ID) is written and flushed; the
sync removes it. A store that finds a marker from an earlier boot (the machine went down with
pieces unflushed) re-hashes every piece file and deletes those that do not hash to their name,
so the store never serves a piece whose bytes are not its ID. Manifests are flushed one by one. A step is *complete* (held) when
every piece its manifest lists is present. Retention (:func:`protocol.window.retained_steps`) keeps the newest ``keep_steps`` complete
steps plus any newer step still being filled, and deletes only pieces that no kept manifest
(of a step, a delta or an artifact: artifacts are pinned by the run spec and never pruned) lists, so a fetch of a kept step is never disturbed (a reader with an open file keeps its data
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
from collections.abc import Container, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from node.errors import StoreError
from protocol.artifacts import ArtifactManifest, open_artifact
from protocol.content import hex_id
from protocol.delta import iter_delta_pieces, open_delta_manifest
from protocol.durable import atomic_write, fsync_dir
from protocol.envelope import Authorities, Envelope
from protocol.errors import SchemaError
from protocol.messages import DeltaManifest, Manifest
from protocol.shardcast import PieceId, PieceRef, iter_pieces, open_manifest
from protocol.window import retained_steps

logger = logging.getLogger(__name__)

_STALE_TMP_S = 3600.0
_VERIFY_CHUNK_BYTES = 4 << 20
_DIRTY_PREFIX = "unsynced."


class PieceWriter:
    """Writes one piece into the store's tmp dir, hashing as it goes; :meth:`commit` verifies it.

    Not for concurrent use by several threads; one writer per piece download.
    """

    def __init__(self, store: ShardcastStore, piece_id: PieceId, size_bytes: int) -> None:
        self._store = store
        self.piece_id = piece_id
        self.size_bytes = size_bytes
        self._tmp = store.tmp_path(piece_id)
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._hash = hashlib.sha256()
        self.written_bytes = 0

    def write(self, chunk: bytes | memoryview) -> None:
        """Append ``chunk`` to the piece (blocking: file write + hash; both release the GIL)."""
        assert self._fd is not None
        view = memoryview(chunk)
        self._hash.update(view)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.written_bytes += len(chunk)

    def digest_matches(self) -> bool:
        """Whether the bytes written so far are exactly the piece."""
        return self.written_bytes == self.size_bytes and self._hash.digest() == self.piece_id

    def commit(self) -> None:
        """Move the verified piece into place (blocking).

        The file is not flushed here: it is queued for a background ``fsync`` and the step is
        made durable as a whole by :meth:`ShardcastStore.sync` (see the store's docstring).

        Raises:
            StoreError: the written bytes do not form the piece (callers verify first).
        """
        if not self.digest_matches():
            self.abort()
            raise StoreError(f"refusing to store piece {hex_id(self.piece_id)[:16]}…: bytes do not match its ID")
        assert self._fd is not None
        fd, self._fd = self._fd, None
        self._store._install(fd, self._tmp, self.piece_id)

    def abort(self) -> None:
        """Drop what was written (blocking)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._tmp.unlink(missing_ok=True)


class _StoreSink:
    """:class:`protocol.shardcast.PieceSink` that stores pieces while a checkpoint is cut.

    Pieces are renamed into place unflushed (queued for a background ``fsync``); ``close()``
    makes them all durable (:meth:`ShardcastStore.sync`) before the caller stores the manifest.
    """

    def __init__(self, store: ShardcastStore) -> None:
        self._store = store
        self._tmp = store.tmp_path(b"publish")
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def end_piece(self, piece_id: PieceId, size_bytes: int) -> None:
        fd, tmp = self._fd, self._tmp
        if self._store.has_piece(piece_id):
            os.close(fd)
            tmp.unlink()
        else:
            self._store._install(fd, tmp, piece_id)
        self._tmp = self._store.tmp_path(b"publish")
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def close(self) -> None:
        os.close(self._fd)
        self._tmp.unlink(missing_ok=True)
        self._store.sync()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path) -> bytes | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(_VERIFY_CHUNK_BYTES):
                h.update(chunk)
    except OSError:
        return None
    return h.digest()


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
        self._delta_dir = self.root / "deltas"
        self._artifact_dir = self.root / "artifacts"
        self._artifacts: dict[bytes, tuple[ArtifactManifest, bytes]] = {}  # ID → (manifest, its bytes)
        self._artifact_piece_sets: dict[bytes, frozenset[bytes]] = {}
        self._artifacts_complete: set[bytes] = set()
        self._lock = threading.Lock()
        self._deltas: dict[int, Envelope[DeltaManifest]] = {}  # by target step (docs/shardcast.md §9)
        self._delta_piece_sets: dict[int, frozenset[bytes]] = {}
        self._manifests: dict[int, Envelope[Manifest]] = {}
        self._complete: set[int] = set()
        self._piece_sets: dict[int, frozenset[bytes]] = {}
        # batched durability (see the module docstring): pieces renamed in but not yet fsynced
        self._sync_lock = threading.Lock()  # guards the fields below
        self._sync_mutex = threading.Lock()  # one sync() at a time
        self._pending: list[Future[None]] = []
        self._unsynced_dirs: set[Path] = set()
        self._installs = 0
        self._marker: Path | None = None
        self._fsync_pool: ThreadPoolExecutor | None = None
        try:
            for d in (self._manifest_dir, self._piece_dir, self._tmp_dir, self._delta_dir, self._artifact_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the Shardcast store at {self.root}: {e.strerror}") from e
        self._clean_tmp()
        self._recover()
        self._load_artifacts()
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

    # --- durability -------------------------------------------------------------------------

    def _install(self, fd: int, tmp: Path, piece_id: bytes) -> None:
        """Rename a verified piece file (open as ``fd``, which this takes over) into place."""
        dest = self.piece_path(piece_id)
        dest.parent.mkdir(exist_ok=True)
        if not self.fsync:
            os.close(fd)
            os.replace(tmp, dest)
            return
        self._mark_unsynced()
        os.replace(tmp, dest)
        with self._sync_lock:
            if self._fsync_pool is None:
                self._fsync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardcast-fsync")
            self._installs += 1
            self._unsynced_dirs.add(dest.parent)
            self._pending.append(self._fsync_pool.submit(_fsync_close, fd))

    def _mark_unsynced(self) -> None:
        """Make sure a durable marker says "this store may hold unflushed pieces" (blocking)."""
        with self._sync_lock:
            if self._marker is not None:
                return
            marker = self.root / f"{_DIRTY_PREFIX}{os.getpid()}.{time.monotonic_ns()}"
            with open(marker, "w") as f:
                f.write(f"{os.getpid()} {_boot_id()}\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.root)
            self._marker = marker

    def sync(self) -> None:
        """Make every piece stored so far durable (blocking): wait for their background
        ``fsync``, flush their directories, then drop the unsynced marker. No-op without ``fsync``."""
        if not self.fsync:
            return
        with self._sync_mutex:
            with self._sync_lock:
                pending, self._pending = self._pending, []
                dirs, self._unsynced_dirs = self._unsynced_dirs, set()
                installs = self._installs
            for fut in pending:
                fut.result()
            for d in dirs:
                fsync_dir(d)
            with self._sync_lock:
                if self._marker is not None and installs == self._installs:
                    self._marker.unlink(missing_ok=True)
                    self._marker = None

    def _recover(self) -> None:
        """Deal with unsynced markers left by processes that are gone (blocking).

        A marker from an earlier boot means the machine went down while pieces were unflushed:
        every piece file is re-hashed and the ones that do not hash to their name are deleted.
        A marker from this boot whose process is dead only lost its process (the page cache
        holds complete files, renamed in after they were written and verified): flush and drop it.
        """
        boot = _boot_id()
        stale: list[Path] = []
        crashed = False
        for m in self.root.glob(_DIRTY_PREFIX + "*"):
            try:
                pid_text, marker_boot = m.read_text().split()
                pid = int(pid_text)
            except (OSError, ValueError):
                pid, marker_boot = -1, ""
            if marker_boot == boot and boot != "unknown" and pid != os.getpid() and pid > 0 and _pid_alive(pid):
                continue  # a live writer (e.g. ``publish`` into a served store)
            stale.append(m)
            crashed |= marker_boot != boot or boot == "unknown"
        if not stale:
            return
        if crashed:
            removed = self.verify_pieces()
            logger.warning("unclean shutdown with unflushed pieces: re-verified the store, removed %d bad pieces", removed)
        else:
            os.sync()
        for m in stale:
            m.unlink(missing_ok=True)

    def verify_pieces(self) -> int:
        """Re-hash every piece file and delete those whose bytes do not hash to their name (blocking).

        Returns:
            How many piece files were removed.
        """
        paths = [p for d in self._piece_dir.iterdir() if d.is_dir() for p in d.iterdir()]
        removed = 0
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            for p, digest in zip(paths, pool.map(_hash_file, paths), strict=True):
                if digest is None or digest.hex() != p.name or p.parent.name != p.name[:2]:
                    p.unlink(missing_ok=True)
                    removed += 1
        for d in self._piece_dir.iterdir():
            if d.is_dir():
                fsync_dir(d)
        return removed

    # --- manifests --------------------------------------------------------------------------

    def _unseen_step_files(self, directory: Path, suffix: str, known: Container[int]) -> Iterator[tuple[int, Path]]:
        """``(step, path)`` of the files ``<step><suffix>`` in ``directory``, ascending by step, whose
        step ``known`` does not hold (checked under the lock as each file comes up); other names skipped."""
        steps: list[tuple[int, Path]] = []
        for p in directory.glob(f"*{suffix}"):
            name = p.name[: -len(suffix)]
            if name.isascii() and name.isdigit():
                steps.append((int(name), p))
        for step, p in sorted(steps):
            with self._lock:
                if step in known:
                    continue
            yield step, p

    def refresh(self) -> list[int]:
        """Pick up manifests another process wrote (``publish`` into a served store); blocking.

        Returns:
            Steps newly found, ascending. Unreadable or invalid manifest files are skipped with a warning.
        """
        found: list[int] = []
        for step, p in self._unseen_step_files(self._manifest_dir, ".manifest", self._manifests):
            try:
                env = open_manifest(p.read_bytes(), run_id=self.run_id, authorities=self.authorities)
            except Exception as e:  # noqa: BLE001 - a bad file on disk must not stop the node
                logger.warning("ignoring unreadable manifest %s: %s", p, e)
                continue
            if env.body.step != step:
                logger.warning("ignoring manifest %s: it is for step %d", p, env.body.step)
                continue
            with self._lock:  # prune() unlinks under this lock: a step pruned meanwhile stays gone
                if step in self._manifests or not p.exists():
                    continue
                self._manifests[step] = env
                self._piece_sets[step] = frozenset(p.piece_id for p in iter_pieces(env.body))
            self.check_complete(step)
            found.append(step)
        with self._lock:  # steps whose manifests another process pruned
            for step in [s for s in self._manifests if not self._manifest_path(s).exists()]:
                del self._manifests[step]
                self._piece_sets.pop(step, None)
                self._complete.discard(step)
        self._refresh_deltas()
        return found

    # --- deltas (docs/shardcast.md §9) -------------------------------------------------------

    def _delta_path(self, step: int) -> Path:
        return self._delta_dir / f"{step}.delta"

    def _refresh_deltas(self) -> None:
        for step, p in self._unseen_step_files(self._delta_dir, ".delta", self._deltas):
            try:
                env = open_delta_manifest(p.read_bytes(), run_id=self.run_id, authorities=self.authorities)
                if env.body.step != step:
                    raise SchemaError(f"it is for step {env.body.step}", "body.step")
            except Exception as e:  # noqa: BLE001 - a bad file on disk must not stop the node
                logger.warning("ignoring unreadable delta manifest %s: %s", p, e)
                continue
            with self._lock:
                if step not in self._deltas and p.exists():
                    self._deltas[step] = env
                    self._delta_piece_sets[step] = frozenset(env.body.pieces)
        with self._lock:
            for step in [s for s in self._deltas if not self._delta_path(s).exists()]:
                del self._deltas[step]
                self._delta_piece_sets.pop(step, None)

    def add_delta(self, raw: bytes) -> Envelope[DeltaManifest]:
        """Verify and store a delta manifest (blocking); a known step keeps its first delta.

        The delta's target (and base) manifest IDs must match the manifests stored for those
        steps, where stored.

        Returns:
            The stored envelope for that step.

        Raises:
            ProtocolError: from :func:`protocol.delta.open_delta_manifest`, or ``SchemaError`` for
                a delta naming other manifests than the stored ones; nothing is stored.
        """
        env = open_delta_manifest(raw, run_id=self.run_id, authorities=self.authorities)
        dm = env.body
        for step, want, what in ((dm.step, dm.target_manifest_id, "target"), (dm.base_step, dm.base_manifest_id, "base")):
            have = self.manifest(step)
            if have is not None and have.id != want:
                raise SchemaError(f"delta into step {dm.step} names another {what} manifest than the stored one of step {step}", "body")
        with self._lock:
            if dm.step in self._deltas:
                return self._deltas[dm.step]
        atomic_write(self._delta_path(dm.step), env.raw, tmp=self.tmp_path(b"delta"), durable=self.fsync, sync_dir=False)
        with self._lock:
            if dm.step not in self._deltas:
                self._deltas[dm.step] = env
                self._delta_piece_sets[dm.step] = frozenset(dm.pieces)
        logger.info("stored delta %d → %d (%d bytes)", dm.base_step, dm.step, dm.size_bytes, extra={"step": dm.step})
        return self._deltas[dm.step]

    def delta(self, step: int) -> Envelope[DeltaManifest] | None:
        """The stored delta manifest into ``step``, or ``None``."""
        with self._lock:
            return self._deltas.get(step)

    def delta_steps(self) -> list[int]:
        """Target steps of the stored delta manifests, ascending."""
        with self._lock:
            return sorted(self._deltas)

    def missing_delta_pieces(self, step: int) -> list[PieceRef]:
        """Pieces of the delta into ``step`` not in the store, in order (blocking)."""
        env = self.delta(step)
        if env is None:
            raise StoreError(f"no delta into step {step}")
        return [p for p in iter_delta_pieces(env.body) if not self.has_piece(p.piece_id)]

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
        atomic_write(self._manifest_path(step), env.raw, tmp=self.tmp_path(b"manifest"), durable=self.fsync, sync_dir=False)
        with self._lock:
            if step not in self._manifests:
                self._manifests[step] = env
                self._piece_sets[step] = frozenset(p.piece_id for p in iter_pieces(env.body))
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

    def is_awaited(self, piece_id: bytes) -> bool:
        """Whether a stored manifest of a step still being filled lists ``piece_id`` (it may arrive soon)."""
        with self._lock:
            return any(piece_id in ids for step, ids in self._piece_sets.items() if step not in self._complete) or any(
                piece_id in ids for step, ids in self._delta_piece_sets.items() if step not in self._complete
            ) or any(piece_id in ids for aid, ids in self._artifact_piece_sets.items() if aid not in self._artifacts_complete)

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
        if done and not self.is_complete(step):
            self.sync()  # a step is announced only once its pieces are durable
        with self._lock:
            if done and step in self._manifests:
                newly = step not in self._complete
                self._complete.add(step)
            else:
                newly = False
        if newly:
            logger.info("step %d complete", step, extra={"step": step})
        return done

    # --- artifacts (docs/shardcast.md §10) -----------------------------------------------------

    def _artifact_path(self, artifact_id: bytes) -> Path:
        return self._artifact_dir / f"{hex_id(artifact_id)}.artifact"

    def _load_artifacts(self) -> None:
        """Read the artifact manifests on disk; one that does not hash to its file name is deleted."""
        for p in sorted(self._artifact_dir.glob("*.artifact")):
            name = p.name[: -len(".artifact")]
            try:
                aid = bytes.fromhex(name)
                manifest = open_artifact(p.read_bytes(), aid)
            except Exception as e:  # noqa: BLE001 - a bad file on disk must not stop the node
                logger.warning("removing unreadable artifact manifest %s: %s", p, e)
                p.unlink(missing_ok=True)
                continue
            self._remember_artifact(aid, manifest, p.read_bytes())

    def _remember_artifact(self, artifact_id: bytes, manifest: ArtifactManifest, raw: bytes) -> None:
        with self._lock:
            self._artifacts[artifact_id] = (manifest, raw)
            self._artifact_piece_sets[artifact_id] = frozenset(p.piece_id for p in iter_pieces(manifest))
        self.check_artifact(artifact_id)

    def add_artifact(self, raw: bytes, artifact_id: bytes) -> ArtifactManifest:
        """Verify artifact manifest bytes against the pinned ``artifact_id`` and store them (blocking).

        Raises:
            ProtocolError: ``ArtifactError`` (bytes that do not hash to the ID) or a decode/schema
                error from :func:`protocol.artifacts.open_artifact`; nothing is stored.
        """
        manifest = open_artifact(raw, artifact_id)
        with self._lock:
            if artifact_id in self._artifacts:
                return self._artifacts[artifact_id][0]
        atomic_write(self._artifact_path(artifact_id), raw, tmp=self.tmp_path(b"artifact"), durable=self.fsync, sync_dir=False)
        self._remember_artifact(artifact_id, manifest, raw)
        logger.info("stored artifact %s %s… (%d files)", manifest.name, hex_id(artifact_id)[:16], len(manifest.files))
        return manifest

    def artifact(self, artifact_id: bytes) -> tuple[ArtifactManifest, bytes] | None:
        """The stored artifact manifest with ID ``artifact_id`` and its exact bytes, or ``None``."""
        with self._lock:
            return self._artifacts.get(artifact_id)

    def artifact_ids(self) -> list[bytes]:
        """IDs of the stored artifact manifests (complete or being filled)."""
        with self._lock:
            return sorted(self._artifacts)

    def missing_artifact_pieces(self, artifact_id: bytes) -> list[PieceRef]:
        """Pieces of the artifact not in the store, in manifest order (blocking)."""
        held = self.artifact(artifact_id)
        if held is None:
            raise StoreError(f"no artifact {hex_id(artifact_id)[:16]}…")
        return [p for p in iter_pieces(held[0]) if not self.has_piece(p.piece_id)]

    def check_artifact(self, artifact_id: bytes) -> bool:
        """Re-check whether every piece of the artifact is present, and record it (blocking)."""
        held = self.artifact(artifact_id)
        if held is None:
            return False
        done = all(self.has_piece(p.piece_id) for p in iter_pieces(held[0]))
        if done:
            self.sync()
            with self._lock:
                self._artifacts_complete.add(artifact_id)
        return done

    def artifact_complete(self, artifact_id: bytes) -> bool:
        with self._lock:
            return artifact_id in self._artifacts_complete

    # --- retention --------------------------------------------------------------------------

    def retention_floor(self) -> int:
        """The oldest of the newest ``keep_steps`` complete steps (−1 while fewer are complete): an
        incomplete step not above it is pruned (so a relay does not start fetching it)."""
        with self._lock:
            return self._floor(retained_steps(self._complete, self.keep_steps))

    def steps_to_keep(self) -> set[int]:
        """The newest ``keep_steps`` complete steps and every incomplete step newer than the oldest of them."""
        with self._lock:
            kept = retained_steps(self._complete, self.keep_steps)
            floor = self._floor(kept)
            return kept | {s for s in self._manifests if s not in self._complete and s > floor}

    def _floor(self, kept: set[int]) -> int:
        return min(kept) if len(kept) >= self.keep_steps else -1

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
            for s in drop:
                self._piece_sets.pop(s, None)
                self._manifest_path(s).unlink(missing_ok=True)  # under the lock, so refresh() cannot re-add it
            self._complete.difference_update(drop)
            orphan_floor = min(keep) if keep else -1  # deltas of steps whose manifest never came (a publish that died)
            dropped_deltas = [self._deltas.pop(s) for s in list(self._deltas) if s in dropped or (s not in self._manifests and s < orphan_floor)]
            for env_d in dropped_deltas:
                self._delta_piece_sets.pop(env_d.body.step, None)
                self._delta_path(env_d.body.step).unlink(missing_ok=True)
            still_used: set[bytes] = {p.piece_id for env in self._manifests.values() for p in iter_pieces(env.body)}
            still_used |= {pid for ids in self._delta_piece_sets.values() for pid in ids}
            still_used |= {pid for ids in self._artifact_piece_sets.values() for pid in ids}
        for step, env in dropped.items():
            for p in iter_pieces(env.body):
                if p.piece_id not in still_used:
                    self.piece_path(p.piece_id).unlink(missing_ok=True)
            logger.info("pruned step %d", step, extra={"step": step})
        for env_d in dropped_deltas:
            for pid in env_d.body.pieces:
                if pid not in still_used:
                    self.piece_path(pid).unlink(missing_ok=True)
        return drop
