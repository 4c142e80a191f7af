"""Step deltas on the node: publish them (origin), fetch and apply them (clients), mirror and
rebuild from them (relays). Format and verification rule: :mod:`protocol.delta`,
``docs/shardcast.md`` §9.

* **Origin.** :func:`publish_delta` encodes the delta between two checkpoints read straight from
  the store's pieces, cuts it into content-addressed pieces in the same store and stores the
  coordinator-signed ``delta_manifest/1``. :func:`node.shardcast.publish_checkpoint` calls it
  *before* it stores the target's full manifest, so whoever sees a new step can find its delta.
* **Client.** :func:`fetch_step` holds step *b* in a directory and wants step *s*: it resolves the
  signed full manifest of *s*, walks the deltas back from *s* to *b* (at most ``max_chain``),
  downloads each delta's pieces through the same multi-source, per-piece-verified path as a full
  fetch (a bad piece bans its source), applies it streaming into a staging directory, checks
  every reconstructed piece against the signed *full* manifest, fsyncs and renames the directory
  into place. Whether to try deltas at all is :func:`full_fetch_reason` (the one place a node
  chooses); any refusal (no delta, a chain too long, a result that does not match) falls back to
  the full fetch; an interrupted delta download resumes from its verified pieces.
* **Relay.** :func:`mirror_delta` stores an upstream's delta manifest next to the full one;
  :func:`rebuild_from_delta` fetches the delta pieces into the store (served at once, like any
  piece) and writes the target's full pieces from the held base step plus the delta, each piece
  verified by its ID before it is stored.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Self

import aiohttp

from node.errors import FetchError, ShardcastError, SourceError, StoreError
from node.shardcast.client import MANIFEST_FILE_NAME, FetchResult, fetch_checkpoint, resolve_manifest
from node.shardcast.download import DownloadConfig, InPlaceWriter, ManifestCache, PieceDownloader, make_session
from node.shardcast.sources import SourcePool
from node.shardcast.store import ShardcastStore
from protocol.content import hex_id
from protocol.delta import (
    DELTA_FILE_NAME,
    DeltaStats,
    apply_delta,
    check_delta_links,
    encode_delta,
    iter_delta_pieces,
    open_delta_manifest,
)
from protocol.durable import fsync_dir
from protocol.envelope import Authorities, Envelope, open_envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import DeltaManifest, Manifest, ManifestFile
from protocol.shardcast import READ_CHUNK_BYTES, ROUTE_PREFIX, PieceRef, build_manifest, open_manifest

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHAIN = 4
"""Most deltas applied in a row before a full fetch is cheaper and simpler (run spec ``shardcast.max_delta_chain``)."""


class DeltaUnavailable(ShardcastError):
    """No usable delta chain leads from the held step to the wanted one (the caller fetches the full checkpoint)."""


def delta_url(source: str, step: int) -> str:
    return f"{source}{ROUTE_PREFIX}/deltas/{step}"


# --- reading checkpoint files out of a store --------------------------------------------------


class StoreFileReader:
    """A checkpoint file read sequentially from the store's piece files (blocking, flat memory).

    Args:
        store: the store holding the pieces.
        manifest: the checkpoint's manifest.
        f: the file of that manifest to read.

    Raises (from ``read``):
        OSError: a piece file is missing.
    """

    def __init__(self, store: ShardcastStore, manifest: Manifest, f: ManifestFile) -> None:
        self._store = store
        self._pieces = list(f.pieces)
        self._left = f.size_bytes
        self._idx = 0
        self._fh: BinaryIO | None = None

    def read(self, n: int = -1) -> bytes:
        out: list[bytes] = []
        want = self._left if n < 0 else min(n, self._left)
        while want > 0:
            if self._fh is None:
                self._fh = open(self._store.piece_path(self._pieces[self._idx]), "rb")  # noqa: SIM115 - closed below
            chunk = self._fh.read(want)
            if not chunk:
                self._fh.close()
                self._fh = None
                self._idx += 1
                if self._idx >= len(self._pieces):
                    break
                continue
            out.append(chunk)
            want -= len(chunk)
            self._left -= len(chunk)
        return b"".join(out)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def store_opener(store: ShardcastStore, manifest: Manifest) -> Callable[[str], Any]:
    """``open(name)`` over the files of ``manifest`` as stored in ``store``'s pieces."""
    files = {f.name: f for f in manifest.files}
    return lambda name: StoreFileReader(store, manifest, files[name])


# --- origin ------------------------------------------------------------------------------------


def publish_delta(store: ShardcastStore, target_raw: bytes, *, base_step: int, key: NodeKey, level: int = 3) -> Envelope[DeltaManifest]:
    """Encode, piece and sign the delta from stored ``base_step`` to the checkpoint of ``target_raw`` (blocking).

    The target's pieces must already be in ``store`` (its manifest need not be stored yet).

    Args:
        store: the origin's store.
        target_raw: the coordinator-signed full manifest envelope of the new step.
        base_step: a complete step of the store (the previously published one).
        key: the run's coordinator key.
        level: zstd level.

    Returns:
        The stored delta manifest.

    Raises:
        ShardcastError: the base is not complete, a piece file is missing, or the delta does not verify.
    """
    base_env = store.manifest(base_step)
    if base_env is None or not store.check_complete(base_step):
        raise ShardcastError(f"cannot publish a delta from step {base_step}: it is not complete in the store")
    try:
        target_env = open_manifest(target_raw, run_id=store.run_id, authorities=store.authorities)
    except ProtocolError as e:
        raise ShardcastError(f"cannot publish a delta: {e}") from e
    target = target_env.body
    tmp = store.tmp_path(b"delta-encode")
    sink = store.sink()
    try:
        with open(tmp, "w+b") as f:
            stats = encode_delta(base_env.body, target, store_opener(store, base_env.body), store_opener(store, target), f, level=level)
            f.seek(0)
            cut = build_manifest(target.step, [(DELTA_FILE_NAME, f)], piece_size_bytes=target.piece_size_bytes, sink=sink)
    except (OSError, ValueError, ProtocolError) as e:
        raise ShardcastError(f"cannot publish the delta {base_step} → {target.step}: {e}") from e
    finally:
        sink.close()
        tmp.unlink(missing_ok=True)
    dm = DeltaManifest(
        step=target.step,
        base_step=base_step,
        base_manifest_id=base_env.id,
        target_manifest_id=target_env.id,
        piece_size_bytes=target.piece_size_bytes,
        size_bytes=cut.files[0].size_bytes,
        raw_size_bytes=stats.raw_size_bytes,
        pieces=cut.files[0].pieces,
        delta_hash=cut.checkpoint_hash,
        changed_elements=stats.changed_elements,
        total_elements=stats.total_elements,
    )
    try:
        env = store.add_delta(seal(key, store.run_id, dm))
    except ProtocolError as e:
        raise ShardcastError(f"cannot store the delta into step {target.step}: {e}") from e
    logger.info(
        "published delta %d → %d: %d bytes (%.4f of the checkpoint), %d of %d words changed",
        base_step, target.step, dm.size_bytes, dm.size_bytes / max(1, sum(f.size_bytes for f in target.files)),
        stats.changed_elements, stats.total_elements, extra={"step": target.step},
    )
    return env


# --- fetching ----------------------------------------------------------------------------------


async def get_delta_manifest(
    session: aiohttp.ClientSession, source: str, step: int, *, run_id: bytes, authorities: Authorities, timeout_s: float
) -> Envelope[DeltaManifest] | None:
    """Ask ``source`` for the delta into ``step`` and verify it.

    Returns:
        The verified delta manifest, or ``None`` when the source has none (404).

    Raises:
        SourceError: transport failure or bad status; ``evidence=True`` for bytes that are not a
            coordinator-signed delta of this run into ``step``, or an oversized answer.
    """
    try:
        async with session.get(delta_url(source, step), timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"delta request answered HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length > DeltaManifest.MAX_BYTES:
                raise SourceError(source, "oversized", f"delta manifest of {resp.content_length} bytes", evidence=True)
            buf = bytearray()
            while chunk := await resp.content.read(READ_CHUNK_BYTES):
                buf += chunk
                if len(buf) > DeltaManifest.MAX_BYTES:
                    raise SourceError(source, "oversized", "delta manifest exceeds its size limit", evidence=True)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise SourceError(source, "unreachable", f"delta request failed: {type(e).__name__}: {e}") from e
    try:
        env = await asyncio.to_thread(open_delta_manifest, bytes(buf), run_id=run_id, authorities=authorities)
    except ProtocolError as e:
        raise SourceError(source, "bad_delta_manifest", f"rejected its delta manifest: {e}", evidence=True) from e
    if env.body.step != step:
        raise SourceError(source, "bad_delta_manifest", f"asked for the delta into {step}, got one into {env.body.step}", evidence=True)
    return env


async def _ask_delta(session: aiohttp.ClientSession, pool: SourcePool, step: int, run_id: bytes, authorities: Authorities,
                     cfg: DownloadConfig) -> Envelope[DeltaManifest] | None:
    """The delta into ``step`` from the first usable source that has a valid one (evidence recorded).

    Origins first, then relays that delivered, so silent relay candidates are asked last; when an
    origin says it has no such delta (404), relays are not asked (they only mirror what it published).
    """
    for src in sorted(pool.usable(), key=lambda s: (not s.origin, not s.proven)):
        try:
            env = await get_delta_manifest(session, src.url, step, run_id=run_id, authorities=authorities, timeout_s=cfg.manifest_timeout_s)
        except SourceError as e:
            (pool.record_evidence if e.evidence else pool.record_failure)(src, e.reason)
            continue
        if env is not None:
            return env
        if src.origin:
            return None
    return None


def _verified_delta_pieces(path: Path, refs: Sequence[PieceRef]) -> set[int]:
    ok: set[int] = set()
    if not path.exists():
        return ok
    with open(path, "rb") as fh:
        for r in refs:
            fh.seek(r.offset_bytes)
            if hashlib.sha256(fh.read(r.size_bytes)).digest() == r.piece_id:
                ok.add(r.index)
    return ok


async def _download_delta(session: aiohttp.ClientSession, pool: SourcePool, cfg: DownloadConfig, dm: DeltaManifest,
                          path: Path) -> tuple[int, int]:
    """Download (or resume) the delta bytes into ``path``; returns (bytes downloaded, bytes resumed)."""
    refs = list(iter_delta_pieces(dm))
    done = await asyncio.to_thread(_verified_delta_pieces, path, refs)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != dm.size_bytes:
            os.ftruncate(fd, dm.size_bytes)
        pending: dict[bytes, list[PieceRef]] = {}
        for r in refs:
            if r.index not in done:
                pending.setdefault(r.piece_id, []).append(r)

        async def open_writer(p: PieceRef) -> InPlaceWriter:  # one download fills every position of equal pieces
            return InPlaceWriter([fd], pending[p.piece_id])  # one delta file: file_index 0

        stats = await PieceDownloader(session, pool, cfg).run([rs[0] for rs in pending.values()], open_writer)
        await asyncio.to_thread(os.fdatasync, fd)
    finally:
        os.close(fd)
    return stats.bytes, sum(r.size_bytes for r in refs if r.index in done)


def apply_into_dir(delta_path: Path, dm: DeltaManifest, base: Envelope[Manifest], base_dir: Path, target: Envelope[Manifest],
                   dest: Path) -> DeltaStats:
    """Apply a downloaded delta to the checkpoint in ``base_dir``, creating ``dest`` crash-safely (blocking).

    The files are written into a staging directory next to ``dest``, each piece checked against
    the target full manifest as it is written; then fsynced, the manifest envelope added, and the
    directory renamed to ``dest`` (which must not exist or be empty). An interrupted or refused
    apply leaves ``dest`` untouched.

    Raises:
        DeltaFormatError, DeltaMismatchError: the delta is refused (staging removed).
        OSError: local disk trouble.
    """
    staging = dest.parent / f".{dest.name}.{hex_id(target.body.checkpoint_hash)[:16]}.applying"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    handles: list[BinaryIO] = []

    def open_out(f: ManifestFile) -> BinaryIO:
        fh = open(staging / f.name, "wb")  # noqa: SIM115 - closed below
        handles.append(fh)
        return fh

    try:
        try:
            with open(delta_path, "rb") as comp:
                stats = apply_delta(comp, delta=dm, base=base.body, target=target.body,
                                    open_base=lambda name: open(base_dir / name, "rb"),  # noqa: SIM115 - apply_delta closes it (with)
                                    open_out=open_out)
            for fh in handles:
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            for fh in handles:
                fh.close()
        with open(staging / MANIFEST_FILE_NAME, "wb") as mf:
            mf.write(target.raw)
            mf.flush()
            os.fsync(mf.fileno())
        fsync_dir(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if dest.exists():
        dest.rmdir()  # empty (checked by the caller); a non-empty one raises and keeps both
    os.replace(staging, dest)
    fsync_dir(dest.parent)
    return stats


def read_held(held_dir: Path, run_id: bytes, authorities: Authorities) -> Envelope[Manifest] | None:
    """The verified manifest of the checkpoint a fetched directory holds, or ``None``."""
    try:
        return open_envelope((held_dir / MANIFEST_FILE_NAME).read_bytes(), run_id=run_id, authorities=authorities, expect=Manifest)
    except (OSError, ProtocolError):
        return None


@dataclass
class StepFetchResult:
    """Outcome of :func:`fetch_step`.

    Attributes:
        step: policy step now held in ``out_dir``.
        manifest: its verified full manifest.
        out_dir: the directory holding the files.
        files: paths of the checkpoint files, in manifest order.
        via: ``"delta"`` (a chain of deltas applied) or ``"full"`` (all pieces fetched).
        deltas_applied: target steps of the applied deltas, in order.
        bytes_downloaded: verified bytes received (delta pieces, plus full pieces after a fallback), bytes.
        bytes_resumed: delta bytes found verified on disk from an interrupted call, bytes.
        elapsed_s: wall time, seconds.
        faulty_sources: sources caught serving bad data, with the reason.
        fallback_reason: why the delta path was not taken (empty when it was).
        full: the full fetch's own result when ``via`` is ``"full"`` (sources used, bytes per source).
        apply_s: of ``elapsed_s``, applying deltas to the held files (reading, decoding, writing and hashing), seconds.
    """

    step: int
    manifest: Envelope[Manifest]
    out_dir: Path
    files: list[Path]
    via: str
    deltas_applied: list[int] = field(default_factory=list)
    bytes_downloaded: int = 0
    bytes_resumed: int = 0
    elapsed_s: float = 0.0
    faulty_sources: dict[str, str] = field(default_factory=dict)
    fallback_reason: str = ""
    full: FetchResult | None = None
    apply_s: float = 0.0


async def _resolve_chain(session: aiohttp.ClientSession, pool: SourcePool, held: Envelope[Manifest], target: Envelope[Manifest],
                         max_chain: int, run_id: bytes, authorities: Authorities, cfg: DownloadConfig
                         ) -> list[tuple[Envelope[DeltaManifest], Envelope[Manifest]]]:
    """Deltas leading from ``held`` to ``target`` (oldest first), each with its target's full manifest.

    Raises:
        DeltaUnavailable: a delta is missing, the chain is longer than ``max_chain``, or a link does not hold.
    """
    chain: list[tuple[Envelope[DeltaManifest], Envelope[Manifest]]] = []
    cur = target
    while cur.body.step != held.body.step:
        if len(chain) >= max_chain:
            raise DeltaUnavailable(f"more than {max_chain} deltas from step {held.body.step} to {target.body.step}")
        d = await _ask_delta(session, pool, cur.body.step, run_id, authorities, cfg)
        if d is None:
            raise DeltaUnavailable(f"no source has a delta into step {cur.body.step}")
        if d.body.base_step < held.body.step:
            raise DeltaUnavailable(f"the delta into step {cur.body.step} starts at step {d.body.base_step}, before the held {held.body.step}")
        base = held if d.body.base_step == held.body.step else await resolve_manifest(session, pool, d.body.base_step, run_id=run_id, authorities=authorities, cfg=cfg)
        try:
            check_delta_links(d.body, base, cur)
        except ProtocolError as e:
            raise DeltaUnavailable(str(e)) from e
        chain.append((d, cur))
        cur = base
    chain.reverse()
    return chain


def full_fetch_reason(held: Envelope[Manifest] | None, target_step: int | None, out_dir: Path, max_chain: int) -> str:
    """Why a step is fetched in full rather than through deltas: the one place a node chooses.

    Args:
        held: the verified manifest of the checkpoint the node holds as a base (``None``: none).
        target_step: the wanted step (``None``: not known yet, the newest any source has).
        out_dir: where the step goes.
        max_chain: most deltas applied in a row; 0 when the run publishes none
            (:attr:`protocol.runspec.RunSpec.delta_chain_limit`).

    Returns:
        The reason to fetch in full, or ``""``: try the delta chain (:func:`fetch_step` still falls
        back to the full fetch when the chain is refused).
    """
    if max_chain <= 0:
        return "the run publishes no deltas"
    if held is None:
        return "no held checkpoint"
    if target_step is not None and held.body.step >= target_step:
        return f"held step {held.body.step} is not before step {target_step}"
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        return f"{out_dir} is not empty"
    return ""


async def fetch_step(
    sources: Sequence[str],
    out_dir: Path,
    *,
    run_id: bytes,
    authorities: Authorities,
    held_dir: Path | None = None,
    step: int | None = None,
    max_chain: int = DEFAULT_MAX_CHAIN,
    config: DownloadConfig | None = None,
    session: aiohttp.ClientSession | None = None,
    origins: Sequence[str] = (),
    cache: ManifestCache | None = None,
) -> StepFetchResult:
    """Hold checkpoint ``step`` in ``out_dir``: through deltas from ``held_dir`` when possible, else in full.

    The delta-or-full choice is :func:`full_fetch_reason`; a refused chain (no delta, a chain too
    long, a source that failed or lied, a result that does not match) falls back to the full
    fetch from the sources not caught lying.

    Args:
        sources: base URLs of origins/relays.
        out_dir: directory to create (must not exist or be empty, as for a full fetch).
        run_id, authorities: the run's ID and keys (manifests must be coordinator-signed).
        held_dir: a directory holding an earlier step, as a fetch leaves it (with ``.shardcast-manifest``);
            it is only read.
        step: the wanted step (``None``: the newest any source has).
        max_chain: most deltas applied in a row (:attr:`protocol.runspec.RunSpec.delta_chain_limit`;
            0: always in full).
        config: limits and timeouts.
        session: an HTTP session to reuse.
        origins: origin URLs: always asked, on reserved slots (see :func:`fetch_checkpoint`).
        cache: verified manifests and sources known to serve bad ones, kept across calls.

    Returns:
        :class:`StepFetchResult`; ``via`` says which path was taken and ``fallback_reason`` why.

    Raises:
        FetchError: neither a delta chain nor the full checkpoint could be fetched.
    """
    cfg = config or DownloadConfig()
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    pool = SourcePool(sources, origins=origins, exploration=cfg.exploration, max_in_flight_per_source=cfg.max_in_flight_per_source,
                      max_candidates=cfg.max_candidates)
    if not pool.urls:
        raise FetchError("no sources given")
    sess = session or make_session(cfg)
    made: list[Path] = []
    downloaded = resumed = 0
    try:
        held = await asyncio.to_thread(read_held, held_dir, run_id, authorities) if held_dir is not None else None
        reason = full_fetch_reason(held, step, out_dir, max_chain)
        target: Envelope[Manifest] | None = None
        if not reason:
            target = await resolve_manifest(sess, pool, step, run_id=run_id, authorities=authorities, cfg=cfg, cache=cache)
            reason = full_fetch_reason(held, target.body.step, out_dir, max_chain)
        if not reason:
            assert held is not None and held_dir is not None and target is not None
            files = [out_dir / f.name for f in target.body.files]
            try:
                chain = await _resolve_chain(sess, pool, held, target, max_chain, run_id, authorities, cfg)
                cur_dir, cur = held_dir, held
                applied: list[int] = []
                apply_s = 0.0
                for i, (d, tenv) in enumerate(chain):
                    last = i == len(chain) - 1
                    dest = out_dir if last else out_dir.parent / f".{out_dir.name}.chain-{tenv.body.step}"
                    if not last:
                        shutil.rmtree(dest, ignore_errors=True)
                        made.append(dest)
                    dpath = out_dir.parent / f".{out_dir.name}.{hex_id(d.body.delta_hash)[:16]}.delta"
                    got, had = await _download_delta(sess, pool, cfg, d.body, dpath)
                    downloaded, resumed = downloaded + got, resumed + had
                    t_apply = time.monotonic()
                    await asyncio.to_thread(apply_into_dir, dpath, d.body, cur, cur_dir, tenv, dest)
                    apply_s += time.monotonic() - t_apply
                    dpath.unlink(missing_ok=True)
                    cur_dir, cur = dest, tenv
                    applied.append(tenv.body.step)
                logger.info("step %d from step %d through %d delta(s): %d bytes in %.2f s (apply %.2f s)", target.body.step,
                            held.body.step, len(chain), downloaded, time.monotonic() - t0, apply_s, extra={"step": target.body.step})
                return StepFetchResult(target.body.step, target, out_dir, files, "delta", applied, downloaded, resumed,
                                       time.monotonic() - t0, pool.faulty(), apply_s=apply_s)
            except (DeltaUnavailable, FetchError, ProtocolError, StoreError, OSError) as e:  # OSError: e.g. the held base vanished
                reason = str(e)
                # no delta published (yet) is normal; a source that failed or lied is worth a warning
                logger.log(logging.INFO if isinstance(e, DeltaUnavailable) else logging.WARNING,
                           "delta path to step %d refused (%s); fetching the full checkpoint", target.body.step, reason,
                           extra={"step": target.body.step})
        faulty = pool.faulty()
        full_sources = [u for u in pool.urls if u not in faulty] or pool.urls
        full = await fetch_checkpoint(full_sources, out_dir, run_id=run_id, authorities=authorities,
                                      step=target.body.step if target is not None else step, config=cfg, progress=False, session=sess,
                                      origins=origins, cache=cache)
        return StepFetchResult(full.step, full.manifest, out_dir, full.files, "full", [], downloaded + full.bytes_downloaded, resumed,
                               time.monotonic() - t0, {**faulty, **full.faulty_sources}, reason, full)
    finally:
        for chain_dir in made:
            shutil.rmtree(chain_dir, ignore_errors=True)
        if session is None:
            await sess.close()


# --- relays ------------------------------------------------------------------------------------


async def mirror_delta(session: aiohttp.ClientSession, pool: SourcePool, store: ShardcastStore, target: Envelope[Manifest],
                       cfg: DownloadConfig) -> Envelope[DeltaManifest] | None:
    """Store the upstreams' delta into ``target``'s step, if one leads to exactly ``target`` (relays).

    Called before the target's full manifest is stored, so a downstream node that sees the step
    can find its delta too. A delta naming another target manifest is evidence against its source.
    """
    step = target.body.step
    if store.delta(step) is not None:
        return store.delta(step)
    for src in pool.usable():
        try:
            d = await get_delta_manifest(session, src.url, step, run_id=store.run_id, authorities=store.authorities,
                                         timeout_s=cfg.manifest_timeout_s)
        except SourceError as e:
            (pool.record_evidence if e.evidence else pool.record_failure)(src, e.reason)
            continue
        if d is None:
            continue
        if d.body.target_manifest_id != target.id:
            pool.record_evidence(src, "bad_delta_manifest")
            continue
        try:
            return await asyncio.to_thread(store.add_delta, d.raw)
        except ProtocolError as e:
            logger.info("delta into step %d not stored: %s", step, e, extra={"step": step})
            return None
    return None


class _StorePieceOut:
    """A target file written as pieces into the store: each piece is verified by its ID before it is stored."""

    def __init__(self, store: ShardcastStore, f: ManifestFile, piece_size_bytes: int, on_piece: Callable[[bytes], object]) -> None:
        self._store, self._f, self._p, self._on_piece = store, f, piece_size_bytes, on_piece
        self._idx = 0
        self._in = 0
        self._w: Any = None
        self._skip = False

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            if self._w is None and not self._skip:
                pid = self._f.pieces[self._idx]
                size = min(self._p, self._f.size_bytes - self._idx * self._p)
                self._skip = self._store.has_piece(pid)
                if not self._skip:
                    self._w = self._store.piece_writer(pid, size)  # type: ignore[arg-type]
            size = min(self._p, self._f.size_bytes - self._idx * self._p)
            take = min(len(view), size - self._in)
            if self._w is not None:
                self._w.write(view[:take])
            view = view[take:]
            self._in += take
            if self._in == size:
                if self._w is not None:
                    self._w.commit()  # refuses bytes that do not hash to the piece ID
                    self._on_piece(self._f.pieces[self._idx])
                self._w, self._skip, self._in = None, False, 0
                self._idx += 1

    def abort(self) -> None:
        if self._w is not None:
            self._w.abort()
            self._w = None


def _rebuild_blocking(store: ShardcastStore, d: DeltaManifest, base: Envelope[Manifest], target: Envelope[Manifest],
                      on_piece: Callable[[bytes], object]) -> DeltaStats:
    outs: list[_StorePieceOut] = []

    def open_out(f: ManifestFile) -> Any:
        o = _StorePieceOut(store, f, target.body.piece_size_bytes, on_piece)
        outs.append(o)
        return o

    try:
        with StoreFileReader(store, d_manifest_file(d), d_manifest_file(d).files[0]) as comp:
            # apply_delta only read()s the delta stream; StoreFileReader is no full BinaryIO (as in store_opener)
            return apply_delta(comp, delta=d, base=base.body, target=target.body,  # type: ignore[arg-type]
                               open_base=store_opener(store, base.body), open_out=open_out)
    finally:
        for o in outs:
            o.abort()


def d_manifest_file(d: DeltaManifest) -> Manifest:
    """The delta's bytes seen as a one-file checkpoint (for :class:`StoreFileReader`)."""
    return Manifest(step=d.step, piece_size_bytes=d.piece_size_bytes,
                    files=[ManifestFile(name=DELTA_FILE_NAME, size_bytes=d.size_bytes, pieces=list(d.pieces))],
                    checkpoint_hash=d.delta_hash)


async def rebuild_from_delta(session: aiohttp.ClientSession, pool: SourcePool, store: ShardcastStore, step: int,
                             cfg: DownloadConfig, *, semaphore: asyncio.Semaphore | None = None,
                             on_piece: Callable[[bytes], None] | None = None) -> float | None:
    """Fill ``step`` in a relay's store from its stored delta and the held base step (relays).

    The delta pieces are fetched into the store (and so served downstream at once); the target's
    pieces are then written from base + delta, each verified by its ID before it is stored.

    Returns:
        Seconds spent rebuilding the target's pieces from base + delta once the delta was here
        (its apply time), or ``None`` when the step was not filled this way (no delta or base, or
        the rebuild failed; the caller fetches pieces).
    """
    d = store.delta(step)
    target = store.manifest(step)
    if d is None or target is None or d.body.target_manifest_id != target.id:
        return None
    base = store.manifest(d.body.base_step)
    if base is None or base.id != d.body.base_manifest_id or not store.is_complete(d.body.base_step):
        return None
    loop = asyncio.get_running_loop()
    notify = on_piece or (lambda _pid: None)
    try:
        missing = await asyncio.to_thread(store.missing_delta_pieces, step)
        if missing:
            downloader = PieceDownloader(session, pool, cfg, semaphore=semaphore, on_piece=lambda p: notify(p.piece_id))

            async def open_writer(piece: PieceRef) -> Any:
                return await asyncio.to_thread(store.piece_writer, piece.piece_id, piece.size_bytes)

            await downloader.run(missing, open_writer)
        t_apply = time.monotonic()
        stats = await asyncio.to_thread(_rebuild_blocking, store, d.body, base, target,
                                        lambda pid: loop.call_soon_threadsafe(notify, pid))
        apply_s = time.monotonic() - t_apply
    except (FetchError, ProtocolError, StoreError, OSError) as e:
        logger.warning("rebuilding step %d from its delta failed (%s); fetching its pieces", step, e, extra={"step": step})
        return None
    logger.info("rebuilt step %d from step %d + %d-byte delta (%d words changed) in %.2f s", step, d.body.base_step, d.body.size_bytes,
                stats.changed_elements, apply_s, extra={"step": step})
    return apply_s
