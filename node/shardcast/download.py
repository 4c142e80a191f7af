"""HTTP side of fetching: manifests and pieces from untrusted sources, verified as they stream.

Shared by the client (:mod:`node.shardcast.client`) and the relay (:mod:`node.shardcast.relay`);
they differ only in where verified bytes go (a :class:`PieceWriter`). Every request has explicit
timeouts; every response is bounded before it is read; hashing and disk writes leave the event
loop in ~2 MiB batches (``asyncio.to_thread``; SHA-256 and file writes release the GIL), so
memory per piece in flight is a few MiB whatever the piece size.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from node.errors import BadPieceError, FetchError, SourceError
from node.shardcast.sources import SourcePool, SourceState
from protocol.content import hex_id
from protocol.envelope import Authorities, Envelope
from protocol.errors import ProtocolError
from protocol.messages import Manifest
from protocol.shardcast import READ_CHUNK_BYTES, ROUTE_PREFIX, PieceId, PieceRef, open_manifest

logger = logging.getLogger(__name__)

MAX_HELD_BYTES = 64 << 10
"""Largest ``/held`` answer read, in bytes."""

WRITE_BATCH_BYTES = 2 << 20
"""Received bytes are hashed and written off the event loop in batches of about this size."""


@dataclass(frozen=True)
class DownloadConfig:
    """Limits and timeouts of a download.

    Attributes:
        max_concurrency: pieces downloaded at once (memory ≈ this × 1 MiB).
        max_in_flight_per_source: requests at once to one source.
        connect_timeout_s: TCP connect timeout, seconds.
        read_timeout_s: longest silence while reading a response, seconds.
        min_rate_bps: slowest accepted transfer, bytes/second; a piece gets
            ``connect_timeout_s + size / min_rate_bps + 5`` seconds in total.
        manifest_timeout_s: total time for one manifest or ``/held`` request, seconds.
        exploration: probability of choosing a source uniformly (see :class:`SourcePool`).
        missing_retry_s: after a source answers 404 for a piece, ask it again after this many seconds.
        stall_timeout_s: give up when no piece arrived for this many seconds.
        deadline_s: give up after this many seconds in total.
    """

    max_concurrency: int = 8
    max_in_flight_per_source: int = 4
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 15.0
    min_rate_bps: float = 256 * 1024
    manifest_timeout_s: float = 15.0
    exploration: float = 0.1
    missing_retry_s: float = 0.5
    stall_timeout_s: float = 60.0
    deadline_s: float = 3600.0


class PieceWriter(Protocol):
    """Destination of one piece's bytes. All methods block (call them off the event loop)."""

    def write(self, chunk: bytes | memoryview) -> None: ...

    def digest_matches(self) -> bool: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


def piece_url(source: str, piece_id: bytes) -> str:
    return f"{source}{ROUTE_PREFIX}/pieces/{hex_id(piece_id)}"


def manifest_url(source: str, step: int | None) -> str:
    return f"{source}{ROUTE_PREFIX}/manifests/{'latest' if step is None else step}"


def held_url(source: str) -> str:
    return f"{source}{ROUTE_PREFIX}/held"


def make_session(cfg: DownloadConfig) -> aiohttp.ClientSession:
    """An HTTP session for Shardcast: raw bytes (no decompression), bounded connection pool."""
    connector = aiohttp.TCPConnector(limit=max(16, 2 * cfg.max_concurrency), limit_per_host=0, enable_cleanup_closed=True)
    # 1 MiB read buffer: fewer pause/resume rounds of the socket than aiohttp's 64 KiB default.
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, raise_for_status=False, read_bufsize=READ_CHUNK_BYTES)


async def _read_bounded(resp: aiohttp.ClientResponse, source: str, limit_bytes: int) -> bytes:
    declared = resp.content_length
    if declared is not None and declared > limit_bytes:
        raise SourceError(source, "oversized", f"response of {declared} bytes exceeds the {limit_bytes}-byte limit", evidence=True)
    buf = bytearray()
    while chunk := await resp.content.read(min(READ_CHUNK_BYTES, limit_bytes + 1 - len(buf))):
        buf += chunk
        if len(buf) > limit_bytes:
            raise SourceError(source, "oversized", f"response exceeds the {limit_bytes}-byte limit", evidence=True)
    return bytes(buf)


async def get_manifest(
    session: aiohttp.ClientSession,
    source: str,
    step: int | None,
    *,
    run_id: bytes,
    authorities: Authorities,
    timeout_s: float,
) -> Envelope[Manifest] | None:
    """Ask ``source`` for the manifest of ``step`` (``None``: its latest) and verify it.

    Returns:
        The verified manifest, or ``None`` when the source does not have it (404).

    Raises:
        SourceError: transport failure or bad status; with ``evidence=True`` when the bytes are
            not a manifest of this run signed by its coordinator, or are for another step.
    """
    try:
        async with session.get(manifest_url(source, step), timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"manifest request answered HTTP {resp.status}")
            raw = await _read_bounded(resp, source, Manifest.MAX_BYTES)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise SourceError(source, "unreachable", f"manifest request failed: {type(e).__name__}: {e}") from e
    try:
        env = await asyncio.to_thread(open_manifest, raw, run_id=run_id, authorities=authorities)
    except ProtocolError as e:
        raise SourceError(source, "bad_manifest", f"rejected its manifest: {e}", evidence=True) from e
    if step is not None and env.body.step != step:
        raise SourceError(source, "bad_manifest", f"asked for step {step}, got a manifest of step {env.body.step}", evidence=True)
    return env


async def get_held(session: aiohttp.ClientSession, source: str, *, timeout_s: float) -> tuple[list[int], list[int]]:
    """``(held_steps, steps)`` that ``source`` reports (complete steps; all steps with a manifest).

    Raises:
        SourceError: transport failure, bad status or malformed JSON.
    """
    try:
        async with session.get(held_url(source), timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"/held answered HTTP {resp.status}")
            raw = await _read_bounded(resp, source, MAX_HELD_BYTES)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise SourceError(source, "unreachable", f"/held request failed: {type(e).__name__}: {e}") from e
    try:
        doc: Any = json.loads(raw)
        held, steps = doc["held_steps"], doc["steps"]
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 2**40 for x in [*held, *steps]):
            raise ValueError("steps must be integers")
        if len(steps) > 1024:
            raise ValueError("too many steps")
    except (ValueError, KeyError, TypeError) as e:
        raise SourceError(source, "bad_held", f"malformed /held answer: {e}") from e
    return sorted(held), sorted(steps)


def _write_all(writer: PieceWriter, chunks: list[bytes]) -> None:
    for c in chunks:
        writer.write(c)


async def download_piece(
    session: aiohttp.ClientSession,
    source: str,
    piece: PieceRef,
    writer: PieceWriter,
    cfg: DownloadConfig,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """GET one piece from ``source``, streaming it through ``writer``, and verify it.

    The writer is committed only if the bytes hash to the piece ID; otherwise it is aborted.

    Raises:
        SourceError: ``reason="missing"`` on 404; a transport failure, bad status or truncated body
            (an honest source can do that).
        BadPieceError: evidence: a declared or actual length other than the piece's, or bytes
            that do not hash to the piece ID.
    """
    timeout = aiohttp.ClientTimeout(
        total=cfg.connect_timeout_s + piece.size_bytes / cfg.min_rate_bps + 5.0,
        sock_connect=cfg.connect_timeout_s,
        sock_read=cfg.read_timeout_s,
    )
    ok = False
    try:
        async with session.get(piece_url(source, piece.piece_id), timeout=timeout) as resp:
            if resp.status == 404:
                raise SourceError(source, "missing", f"does not hold piece {hex_id(piece.piece_id)[:16]}…")
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"piece request answered HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length != piece.size_bytes:
                raise BadPieceError(source, piece.piece_id, f"declared {resp.content_length} bytes, the piece has {piece.size_bytes}", reason="bad_length")
            got = 0
            batch: list[bytes] = []
            batch_bytes = 0
            while True:
                chunk = await resp.content.readany()  # whatever arrived, without re-joining buffers
                if not chunk:
                    break
                got += len(chunk)
                if got > piece.size_bytes:
                    raise BadPieceError(source, piece.piece_id, f"sent more than the piece's {piece.size_bytes} bytes", reason="oversized")
                batch.append(chunk)
                batch_bytes += len(chunk)
                if batch_bytes >= WRITE_BATCH_BYTES:
                    await asyncio.to_thread(_write_all, writer, batch)
                    batch, batch_bytes = [], 0
                if on_bytes is not None:
                    on_bytes(len(chunk))
            if batch:
                await asyncio.to_thread(_write_all, writer, batch)
            if got < piece.size_bytes:
                raise SourceError(source, "truncated", f"piece {hex_id(piece.piece_id)[:16]}… ended after {got} of {piece.size_bytes} bytes")
        if not await asyncio.to_thread(writer.digest_matches):
            raise BadPieceError(source, piece.piece_id, "content does not hash to the piece ID", reason="bad_hash")
        await asyncio.to_thread(writer.commit)
        ok = True
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise SourceError(source, "unreachable", f"piece transfer failed: {type(e).__name__}: {e}") from e
    finally:
        if not ok:
            await asyncio.to_thread(writer.abort)


@dataclass
class DownloadStats:
    """What a :class:`PieceDownloader` run did.

    Attributes:
        pieces: pieces fetched and verified.
        bytes: verified piece bytes received, in bytes.
        wasted_bytes: bytes received in failed or rejected transfers, in bytes.
    """

    pieces: int = 0
    bytes: int = 0
    wasted_bytes: int = 0


class PieceDownloader:
    """Downloads a set of pieces from a :class:`SourcePool` in parallel, verifying each.

    A piece that fails verification is discarded, the source gets evidence against it (and is
    banned by the pool) and the piece is retried elsewhere; a source without the piece (404) is
    asked again after ``missing_retry_s``; transport failures cool the source down.

    Args:
        session: HTTP session (see :func:`make_session`).
        pool: the sources.
        cfg: limits and timeouts.
        semaphore: shared bound on pieces in flight (a relay syncing several steps passes one);
            default: ``cfg.max_concurrency``.
        on_bytes: called with each received chunk's length in bytes (progress bars).
        on_piece: called (on the event loop) with each piece once it is verified and committed.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: SourcePool,
        cfg: DownloadConfig,
        *,
        semaphore: asyncio.Semaphore | None = None,
        on_bytes: Callable[[int], None] | None = None,
        on_piece: Callable[[PieceRef], None] | None = None,
    ) -> None:
        self._session = session
        self._pool = pool
        self._cfg = cfg
        self._sem = semaphore or asyncio.Semaphore(cfg.max_concurrency)
        self._on_bytes = on_bytes
        self._on_piece = on_piece
        self._changed = asyncio.Event()
        self.stats = DownloadStats()
        self._last_progress = time.monotonic()

    async def run(self, pieces: Sequence[PieceRef], open_writer: Callable[[PieceRef], Awaitable[PieceWriter]]) -> DownloadStats:
        """Fetch every piece in ``pieces`` (each piece ID once) through writers from ``open_writer``.

        Raises:
            FetchError: every source is banned, no piece arrived for ``stall_timeout_s``, or
                ``deadline_s`` passed; ``faulty_sources`` names the sources with evidence.
        """
        unique = list({p.piece_id: p for p in pieces}.values())
        if not unique:
            return self.stats
        deadline = time.monotonic() + self._cfg.deadline_s
        self._last_progress = time.monotonic()
        tasks = [asyncio.ensure_future(self._one(p, open_writer, deadline)) for p in unique]
        try:
            for fut in asyncio.as_completed(tasks):
                await fut
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return self.stats

    async def _wait_for_change(self, seconds: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=seconds)
        except TimeoutError:
            pass

    def _check_limits(self, deadline: float) -> None:
        now = time.monotonic()
        if self._pool.all_banned():
            raise FetchError("every source served bad data", self._pool.faulty())
        if now > deadline:
            raise FetchError(f"deadline of {self._cfg.deadline_s:.0f} s passed", self._pool.faulty())
        if now - self._last_progress > self._cfg.stall_timeout_s:
            raise FetchError(
                f"no source delivered a piece for {self._cfg.stall_timeout_s:.0f} s (sources: {', '.join(self._pool.urls) or 'none'})",
                self._pool.faulty(),
            )

    async def _one(self, piece: PieceRef, open_writer: Callable[[PieceRef], Awaitable[PieceWriter]], deadline: float) -> None:
        missing_until: dict[str, float] = {}
        async with self._sem:
            while True:
                self._check_limits(deadline)
                now = time.monotonic()
                src = self._pool.choose(exclude=[u for u, t in missing_until.items() if t > now])
                if src is None:
                    await self._wait_for_change(self._cfg.missing_retry_s)
                    continue
                if await self._try(src, piece, open_writer, missing_until):
                    return

    async def _try(
        self,
        src: SourceState,
        piece: PieceRef,
        open_writer: Callable[[PieceRef], Awaitable[PieceWriter]],
        missing_until: dict[str, float],
    ) -> bool:
        writer = await open_writer(piece)
        received = 0

        def count(n: int) -> None:
            nonlocal received
            received += n
            if self._on_bytes is not None:
                self._on_bytes(n)

        src.in_flight += 1
        t0 = time.monotonic()
        try:
            await download_piece(self._session, src.url, piece, writer, self._cfg, count)
        except BadPieceError as e:
            self._pool.record_evidence(src, f"{e.reason}: piece {hex_id(piece.piece_id)[:16]}…")
            self.stats.wasted_bytes += received
            return False
        except SourceError as e:
            self.stats.wasted_bytes += received
            if e.evidence:
                self._pool.record_evidence(src, e.reason)
            elif e.reason == "missing":
                missing_until[src.url] = time.monotonic() + self._cfg.missing_retry_s
            else:
                self._pool.record_failure(src, e.reason)
            return False
        finally:
            src.in_flight -= 1
            self._changed.set()
        self._pool.record_success(src, piece.size_bytes, time.monotonic() - t0)
        self.stats.pieces += 1
        self.stats.bytes += piece.size_bytes
        self._last_progress = time.monotonic()
        if self._on_piece is not None:
            self._on_piece(piece)
        logger.debug("piece %s from %s", hex_id(piece.piece_id)[:16], src.url)
        return True


__all__ = [
    "DownloadConfig",
    "DownloadStats",
    "PieceDownloader",
    "PieceId",
    "download_piece",
    "get_held",
    "get_manifest",
    "make_session",
]
