"""Fetch a checkpoint from several untrusted sources into a directory (workers, validators, CLI).

:func:`fetch_checkpoint` resolves the coordinator-signed manifest, downloads the pieces in
parallel from the sources (throughput-weighted choice with exploration, :mod:`sources`),
verifies each piece as it streams to disk, bans a source that serves a bad piece and takes the
piece from another, and finally flushes the files and moves the directory into place with one
rename (after which ``.shardcast-manifest`` inside it says which checkpoint it holds).

Files are written straight into a staging directory next to ``out_dir`` named after the
checkpoint hash (``.<out name>.<hash prefix>.partial``); a fetch that is killed leaves it
behind, and the next fetch of the same checkpoint re-hashes what is there and downloads only
the pieces that do not verify. Memory stays flat: about 1 MiB per piece in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from node.errors import FetchError, SourceError
from node.retry import first_success
from node.shardcast.download import (
    DownloadConfig,
    DownloadStats,
    InPlaceWriter,
    ManifestCache,
    PieceDownloader,
    get_artifact_manifest,
    get_manifest,
    make_session,
)
from node.shardcast.sources import SourcePool, SourceState
from protocol.artifacts import ArtifactManifest, open_artifact
from protocol.content import hex_id
from protocol.durable import fsync_dir
from protocol.envelope import Authorities, Envelope, open_envelope
from protocol.errors import ProtocolError
from protocol.messages import Manifest
from protocol.shardcast import READ_CHUNK_BYTES, PieceListing, PieceRef, iter_pieces, total_size_bytes

logger = logging.getLogger(__name__)

MANIFEST_FILE_NAME = ".shardcast-manifest"
"""The manifest envelope, written next to the checkpoint files of a fetched directory."""


@dataclass
class FetchResult:
    """Outcome of :func:`fetch_checkpoint`.

    Attributes:
        step: policy step of the checkpoint.
        manifest: the verified manifest envelope.
        out_dir: the directory holding the files.
        files: paths of the checkpoint files, in manifest order.
        bytes_downloaded: verified piece bytes received in this call, in bytes.
        bytes_resumed: bytes already verified on disk from an earlier, interrupted call.
        pieces_downloaded: pieces received in this call.
        pieces_resumed: pieces found verified on disk.
        wasted_bytes: bytes received and thrown away (bad pieces, broken transfers).
        elapsed_s: wall time of the call, seconds.
        faulty_sources: sources caught serving bad data, with the reason.
        cooled_sources: sources cooled down for transport failures, silence or "not held"
            answers (e.g. tarpits, relays advertising what they cannot serve), with the latest reason.
        source_bytes: verified bytes received per source (the sources used: origins and the
            relay candidates drawn).
        candidates_offered: relay URLs offered before the random subset was drawn.
    """

    step: int
    manifest: Envelope[Manifest]
    out_dir: Path
    files: list[Path]
    bytes_downloaded: int = 0
    bytes_resumed: int = 0
    pieces_downloaded: int = 0
    pieces_resumed: int = 0
    wasted_bytes: int = 0
    elapsed_s: float = 0.0
    faulty_sources: dict[str, str] = field(default_factory=dict)
    cooled_sources: dict[str, str] = field(default_factory=dict)
    source_bytes: dict[str, int] = field(default_factory=dict)
    candidates_offered: int = 0


async def resolve_manifest(
    session: aiohttp.ClientSession,
    pool: SourcePool,
    step: int | None,
    *,
    run_id: bytes,
    authorities: Authorities,
    cfg: DownloadConfig,
    cache: ManifestCache | None = None,
) -> Envelope[Manifest]:
    """Ask the usable sources for the manifest of ``step`` (``None``: the newest any has).

    All are asked at once and the answer is taken as soon as it is known, without waiting for
    slow sources: for a given step the first verified manifest (there is one per step: the
    coordinator signs it); for ``latest`` the best one once every origin answered (relays only
    mirror the origin), or, with no origin answer, ``latest_grace_s`` after the first valid
    one. Requests still running then are cancelled without penalty. Sources that answer with a
    manifest that does not verify get evidence against them; failures cool them down.

    Raises:
        FetchError: no source has a valid manifest of that step (the message lists why).
    """
    srcs = pool.usable()
    tasks = {
        asyncio.ensure_future(
            get_manifest(session, s.url, step, run_id=run_id, authorities=authorities, timeout_s=cfg.manifest_timeout_s, cfg=cfg, cache=cache)
        ): s
        for s in srcs
    }
    best: Envelope[Manifest] | None = None
    problems: list[str] = []
    origins_left = {s.url for s in srcs if s.origin}
    origin_valid = False
    grace_end: float | None = None
    loop = asyncio.get_running_loop()
    pending = set(tasks)
    try:
        while pending:
            if best is not None and (step is not None or (origin_valid and not origins_left)):
                break
            timeout = None if grace_end is None else max(0.0, grace_end - loop.time())
            if timeout == 0.0:
                break
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                src = tasks[t]
                origins_left.discard(src.url)
                exc = t.exception()
                if isinstance(exc, SourceError):
                    problems.append(str(exc))
                    if exc.evidence:
                        pool.record_evidence(src, exc.reason)
                    else:
                        pool.record_failure(src, exc.reason)
                elif exc is not None:
                    raise exc
                elif (res := t.result()) is None:
                    problems.append(f"{src.url}: has no manifest of {'any step' if step is None else f'step {step}'}")
                else:
                    origin_valid = origin_valid or src.origin
                    if best is None or res.body.step > best.body.step:
                        best = res
            if best is not None and grace_end is None and step is None:
                grace_end = loop.time() + cfg.latest_grace_s
    finally:
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if best is None:
        what = "any step" if step is None else f"step {step}"
        raise FetchError(f"no source has a valid manifest of {what}: " + "; ".join(problems or ["no sources"]), pool.faulty())
    return best


def _read_existing(out_dir: Path, run_id: bytes, authorities: Authorities) -> Envelope[Manifest] | None:
    try:
        raw = (out_dir / MANIFEST_FILE_NAME).read_bytes()
        return open_envelope(raw, run_id=run_id, authorities=authorities, expect=Manifest)
    except (OSError, ProtocolError):
        return None


def _verified_on_disk(staging: Path, manifest: PieceListing) -> set[tuple[int, int]]:
    """``(file_index, piece index)`` of the pieces already correct in the staging files (blocking)."""
    ok: set[tuple[int, int]] = set()
    handles = {}
    try:
        for fi, f in enumerate(manifest.files):
            p = staging / f.name
            if p.exists():
                handles[fi] = open(p, "rb")  # noqa: SIM115 - closed below
        for ref in iter_pieces(manifest):
            fh = handles.get(ref.file_index)
            if fh is None:
                continue
            fh.seek(ref.offset_bytes)
            h = hashlib.sha256()
            left = ref.size_bytes
            while left > 0:
                chunk = fh.read(min(READ_CHUNK_BYTES, left))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            if left == 0 and h.digest() == ref.piece_id:
                ok.add((ref.file_index, ref.index))
    finally:
        for fh in handles.values():
            fh.close()
    return ok


def _open_staging(staging: Path, manifest: PieceListing) -> list[int]:
    staging.mkdir(parents=True, exist_ok=True)
    fds = []
    for f in manifest.files:
        fd = os.open(staging / f.name, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size != f.size_bytes:
            os.ftruncate(fd, f.size_bytes)
        fds.append(fd)
    return fds


def _finish(staging: Path, out_dir: Path, fds: list[int], listing: PieceListing, raw: bytes, manifest_name: str) -> None:
    """Flush the files, write the manifest bytes as ``manifest_name``, then move the staging
    directory into place (blocking).

    The whole-checkpoint hash is not recomputed: every piece was verified against its ID in the
    coordinator-signed (or spec-pinned) manifest and the pieces tile each file exactly (the piece
    rule), so the bytes on disk are the signed checkpoint; re-reading them would only double the disk work.
    """
    for fd, f in zip(fds, listing.files, strict=True):
        if os.fstat(fd).st_size != f.size_bytes:
            raise FetchError(f"staging file {f.name} has the wrong size (staging dir {staging} kept)")
        os.fdatasync(fd)
    mpath = staging / manifest_name
    with open(mpath, "wb") as mf:
        mf.write(raw)
        mf.flush()
        os.fsync(mf.fileno())
    if out_dir.exists():
        out_dir.rmdir()  # checked empty before the download
    os.replace(staging, out_dir)
    fsync_dir(out_dir.parent)


class _Progress:
    """A rich progress bar on a terminal, nothing otherwise."""

    def __init__(self, enabled: bool, total_bytes: int, done_bytes: int, label: str) -> None:
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            self._bar = Progress(
                "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                transient=True,
            )
            self._task = self._bar.add_task(label, total=total_bytes, completed=done_bytes)
            self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


async def fetch_checkpoint(
    sources: Sequence[str],
    out_dir: Path,
    *,
    run_id: bytes,
    authorities: Authorities,
    step: int | None = None,
    config: DownloadConfig | None = None,
    progress: bool | None = None,
    session: aiohttp.ClientSession | None = None,
    origins: Sequence[str] = (),
    cache: ManifestCache | None = None,
) -> FetchResult:
    """Download and verify a checkpoint into ``out_dir``.

    Args:
        sources: base URLs of relays (``http://host:port``), e.g. from gossip: at most
            ``config.max_candidates`` of them, drawn at random, are used. A URL also in
            ``origins`` is an origin.
        out_dir: directory to create with the checkpoint files (plus ``.shardcast-manifest``);
            it must not exist, be empty, or already hold this exact checkpoint.
        run_id: this node's 32-byte run ID.
        authorities: the run spec's keys (the manifest must be signed by its coordinator).
        step: the policy step; ``None`` fetches the newest step any source has.
        config: limits and timeouts (default :class:`DownloadConfig`).
        progress: show a progress bar (default: when stderr is a terminal).
        session: an HTTP session to reuse, made by :func:`~node.shardcast.download.make_session`
            (default: one made for this call).
        origins: base URLs of origins (the run spec's ``origin_urls``, the coordinator's):
            always asked, on connections and request slots that relays cannot take.
        cache: verified manifests and sources known to serve bad ones, kept across calls
            (:class:`~node.shardcast.download.ManifestCache`).

    Returns:
        What was fetched and from where (:class:`FetchResult`).

    Raises:
        FetchError: no valid manifest, every source faulty, stalled, deadline passed, or
            ``out_dir`` holds something else. A partial download is kept for the next call.
    """
    cfg = config or DownloadConfig()
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    pool = SourcePool(
        sources, origins=origins, exploration=cfg.exploration, max_in_flight_per_source=cfg.max_in_flight_per_source,
        max_candidates=cfg.max_candidates,
    )
    if not pool.urls:
        raise FetchError("no sources given")
    own_session = session is None
    sess = session or make_session(cfg)
    try:
        env = await resolve_manifest(sess, pool, step, run_id=run_id, authorities=authorities, cfg=cfg, cache=cache)
        m = env.body
        files = [out_dir / f.name for f in m.files]
        if out_dir.exists():
            have = await asyncio.to_thread(_read_existing, out_dir, run_id, authorities)
            if have is not None and have.body.checkpoint_hash == m.checkpoint_hash:
                logger.info("step %d already in %s", m.step, out_dir, extra={"step": m.step})
                return FetchResult(m.step, have, out_dir, files, elapsed_s=time.monotonic() - t0)
            if not out_dir.is_dir() or any(out_dir.iterdir()):
                raise FetchError(f"{out_dir} exists and holds something else; choose another --out or remove it")
        staging = out_dir.parent / f".{out_dir.name}.{hex_id(m.checkpoint_hash)[:16]}.partial"
        stats, resumed_bytes, resumed = await _download_files(sess, pool, cfg, m, out_dir, staging, env.raw, MANIFEST_FILE_NAME,
                                                              f"step {m.step}", progress)
        result = FetchResult(
            step=m.step,
            manifest=env,
            out_dir=out_dir,
            files=files,
            bytes_downloaded=stats.bytes,
            bytes_resumed=resumed_bytes,
            pieces_downloaded=stats.pieces,
            pieces_resumed=resumed,
            wasted_bytes=stats.wasted_bytes,
            elapsed_s=time.monotonic() - t0,
            faulty_sources=pool.faulty(),
            cooled_sources=pool.cooled(),
            source_bytes={s.url: s.bytes_received for s in pool.states()},
            candidates_offered=pool.offered,
        )
        logger.info(
            "fetched step %d into %s: %d bytes in %.2f s%s",
            m.step, out_dir, stats.bytes, result.elapsed_s,
            f"; faulty sources: {', '.join(result.faulty_sources)}" if result.faulty_sources else "",
            extra={"step": m.step},
        )
        return result
    finally:
        if own_session:
            await sess.close()


async def _download_files(sess: aiohttp.ClientSession, pool: SourcePool, cfg: DownloadConfig, listing: PieceListing, out_dir: Path,
                          staging: Path, raw: bytes, manifest_name: str, label: str, progress: bool | None) -> tuple[DownloadStats, int, int]:
    """Download every piece of ``listing`` into ``staging`` (resuming verified ones), then move it to
    ``out_dir`` with the manifest bytes ``raw`` as ``manifest_name``.

    Returns:
        ``(download stats, bytes found verified on disk, pieces found verified on disk)``.
    """
    resumed = await asyncio.to_thread(_verified_on_disk, staging, listing) if staging.exists() else set()
    fds = await asyncio.to_thread(_open_staging, staging, listing)
    try:
        refs = list(iter_pieces(listing))
        pending: dict[bytes, list[PieceRef]] = defaultdict(list)
        for r in refs:
            if (r.file_index, r.index) not in resumed:
                pending[r.piece_id].append(r)
        resumed_bytes = sum(r.size_bytes for r in refs if (r.file_index, r.index) in resumed)
        if resumed:
            logger.info("resuming %s: %d pieces already verified on disk", label, len(resumed))
        bar = _Progress(sys.stderr.isatty() if progress is None else progress, total_size_bytes(listing), resumed_bytes, label)
        downloader = PieceDownloader(sess, pool, cfg, on_bytes=bar.advance)

        async def open_writer(piece: PieceRef) -> InPlaceWriter:
            return InPlaceWriter(fds, pending[piece.piece_id])

        try:
            stats = await downloader.run([rs[0] for rs in pending.values()], open_writer)
        finally:
            bar.close()
        await asyncio.to_thread(_finish, staging, out_dir, fds, listing, raw, manifest_name)
    finally:
        for fd in fds:
            os.close(fd)
    return stats, resumed_bytes, len(resumed)


ARTIFACT_FILE_NAME = ".artifact-manifest"
"""The artifact manifest's bytes, written next to an artifact's files in a fetched directory."""


@dataclass
class ArtifactFetch:
    """Outcome of :func:`fetch_artifact`.

    Attributes:
        artifact_id: the pinned 32-byte ID.
        manifest: the verified manifest.
        out_dir: the directory holding its files (and :data:`ARTIFACT_FILE_NAME`).
        bytes_downloaded: verified piece bytes received in this call.
        faulty_sources: sources caught serving bad data, with the reason.
        elapsed_s: wall time, seconds.
    """

    artifact_id: bytes
    manifest: ArtifactManifest
    out_dir: Path
    bytes_downloaded: int = 0
    faulty_sources: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0


def held_artifact(out_dir: Path, artifact_id: bytes) -> ArtifactManifest | None:
    """The manifest of the artifact ``out_dir`` holds, if it is ``artifact_id`` (blocking), else ``None``."""
    try:
        return open_artifact((Path(out_dir) / ARTIFACT_FILE_NAME).read_bytes(), artifact_id)
    except (OSError, ProtocolError):
        return None


async def resolve_artifact(session: aiohttp.ClientSession, pool: SourcePool, artifact_id: bytes,
                           cfg: DownloadConfig) -> tuple[ArtifactManifest, bytes]:
    """Ask every usable source for the artifact's manifest at once; the first that hashes to
    ``artifact_id`` wins (the others are cancelled). A source that answers other bytes is evidence.

    Raises:
        FetchError: no source has it (the message lists why).
    """
    async def ask(src: SourceState) -> tuple[ArtifactManifest, bytes]:
        got = await get_artifact_manifest(session, src.url, artifact_id, timeout_s=cfg.manifest_timeout_s, cfg=cfg)
        if got is None:
            raise SourceError(src.url, "not_held", f"does not hold artifact {hex_id(artifact_id)[:16]}…")
        return got

    srcs = {s.url: s for s in pool.usable()}
    won, failed = await first_success({url: ask(src) for url, src in srcs.items()}, (SourceError,))
    for url, exc in failed:
        assert isinstance(exc, SourceError)
        if exc.evidence:
            pool.record_evidence(srcs[url], exc.reason)
        elif exc.reason != "not_held":
            pool.record_failure(srcs[url], exc.reason)
    if won is not None:
        return won[1]
    why = "; ".join(str(e) for _, e in failed) or "no sources"
    raise FetchError(f"no source has artifact {hex_id(artifact_id)[:16]}…: {why}", pool.faulty())


async def fetch_artifact(sources: Sequence[str], out_dir: Path, artifact_id: bytes, *, origins: Sequence[str] = (),
                         config: DownloadConfig | None = None, progress: bool | None = None,
                         session: aiohttp.ClientSession | None = None, keep_partial: bool = True) -> ArtifactFetch:
    """Download an artifact pinned by the run spec into ``out_dir`` (``docs/shardcast.md`` §10).

    The same verified, parallel, resumable download as :func:`fetch_checkpoint`; the manifest is
    trusted because its bytes hash to ``artifact_id`` (:func:`protocol.artifacts.open_artifact`).

    Args:
        sources: base URLs of relays and origins (at most ``config.max_candidates`` relays used).
        out_dir: the directory to create (files plus :data:`ARTIFACT_FILE_NAME`); one that already
            holds this artifact is returned as it is.
        artifact_id: the 32-byte ID from the run spec's ``[artifacts]``.
        origins: which of them are origins (reserved slots).
        config: limits and timeouts; progress: a progress bar (default: on a terminal).
        session: an HTTP session to reuse.
        keep_partial: keep the staging directory of a failed download for the next call; ``False``
            removes it, so a failed fetch leaves nothing behind.

    Raises:
        FetchError: no source has a manifest hashing to ``artifact_id``, every source faulty,
            stalled, deadline passed, or ``out_dir`` holds something else.
    """
    cfg = config or DownloadConfig()
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    if (have := await asyncio.to_thread(held_artifact, out_dir, artifact_id)) is not None:
        return ArtifactFetch(artifact_id, have, out_dir, elapsed_s=time.monotonic() - t0)
    pool = SourcePool(sources, origins=origins, exploration=cfg.exploration, max_in_flight_per_source=cfg.max_in_flight_per_source,
                      max_candidates=cfg.max_candidates)
    if not pool.urls:
        raise FetchError("no sources given")
    own_session = session is None
    sess = session or make_session(cfg)
    staging = out_dir.parent / f".{out_dir.name}.{hex_id(artifact_id)[:16]}.partial"
    try:
        manifest, raw = await resolve_artifact(sess, pool, artifact_id, cfg)
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise FetchError(f"{out_dir} exists and holds something else; remove it")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            stats, _, _ = await _download_files(sess, pool, cfg, manifest, out_dir, staging, raw, ARTIFACT_FILE_NAME,
                                                f"artifact {manifest.name}", progress)
        except BaseException:
            if not keep_partial:
                await asyncio.to_thread(shutil.rmtree, staging, True)
            raise
        logger.info("fetched artifact %s %s… into %s: %d bytes", manifest.name, hex_id(artifact_id)[:16], out_dir, stats.bytes)
        return ArtifactFetch(artifact_id, manifest, out_dir, stats.bytes, pool.faulty(), time.monotonic() - t0)
    finally:
        if own_session:
            await sess.close()
