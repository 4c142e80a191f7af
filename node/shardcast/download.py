"""HTTP side of fetching: manifests and pieces from untrusted sources, verified as they stream.

Shared by the client (:mod:`node.shardcast.client`) and the relay (:mod:`node.shardcast.relay`);
they differ only in where verified bytes go (a :class:`PieceWriter`). Every request has explicit
timeouts; every response is bounded before it is read; hashing and disk writes leave the event
loop in ~2 MiB batches (``asyncio.to_thread``; SHA-256 and file writes release the GIL), so
memory per piece in flight is a few MiB whatever the piece size.

Timeouts never include waiting for a pooled connection: requests use aiohttp's ``sock_connect``
and ``sock_read`` (silence on the socket) plus a transfer deadline counted from the response
headers, and the connection pool has a per-source cap and no global one (our own scheduler bounds
the total), so a tarpit holding its connections cannot delay a request to another source.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from node.errors import BadPieceError, FetchError, SourceError
from node.shardcast.sources import SourcePool, SourceState
from node.timeouts import (
    CONNECT_TIMEOUT_S,
    DOWNLOAD_DEADLINE_S,
    HELD_TIMEOUT_S,
    MANIFEST_TIMEOUT_S,
    PIECE_BODY_GRACE_S,
    READ_TIMEOUT_S,
    STALL_TIMEOUT_S,
)
from protocol.artifacts import MAX_ARTIFACT_MANIFEST_BYTES, ArtifactManifest, open_artifact
from protocol.content import hex_id
from protocol.envelope import Authorities, Envelope
from protocol.errors import ProtocolError
from protocol.messages import Manifest
from protocol.shardcast import MANIFEST_FETCH_LIMIT_BYTES, READ_CHUNK_BYTES, ROUTE_PREFIX, PieceId, PieceRef, open_manifest

logger = logging.getLogger(__name__)

MAX_HELD_BYTES = 64 << 10
"""Largest ``/held`` answer read, in bytes."""

DEFAULT_MAX_MANIFEST_BYTES = MANIFEST_FETCH_LIMIT_BYTES
"""Largest manifest a fetcher reads, in bytes (``protocol.shardcast.MANIFEST_FETCH_LIMIT_BYTES``)."""

WRITE_BATCH_BYTES = 2 << 20
"""Received bytes are hashed and written off the event loop in batches of about this size."""


@dataclass(frozen=True)
class DownloadConfig:
    """Limits and timeouts of a download (the timeouts' defaults: :mod:`node.timeouts`).

    Attributes:
        max_concurrency: pieces downloaded at once from relay candidates (memory ≈ this × 1 MiB);
            each origin has ``max_in_flight_per_source`` slots of its own on top.
        max_in_flight_per_source: requests at once to one proven source (an unproven relay: 1).
        max_candidates: relay candidates used, a random subset of those offered (origins on top).
        connect_timeout_s: TCP connect timeout, seconds (never includes waiting for the pool).
        read_timeout_s: longest silence while waiting for or reading a response, seconds.
        min_rate_bps: slowest accepted transfer, bytes/second; a piece's body must arrive within
            ``size / min_rate_bps`` + :data:`~node.timeouts.PIECE_BODY_GRACE_S` seconds of its
            response headers (from a relay, also within half the stall timeout).
        rate_window_s: a piece request is measured over windows of this many seconds from its
            response headers on; a relay's request that delivers less than the rate floor in a
            window is cut off (cooled down, its piece moved to a proven source), seconds.
        rate_floor_bps: the absolute rate floor, bytes/second.
        slow_fraction: the relative rate floor, as a fraction of the best rate measured in this
            download (the floor is the larger of the two).
        manifest_timeout_s: longest silence on a manifest request, seconds.
        held_timeout_s: longest silence on a ``/held`` request, seconds (a tiny JSON answer).
        max_manifest_bytes: largest manifest read, bytes (bounded read; a larger one is evidence).
        latest_grace_s: when resolving the latest manifest without an origin answer, wait this
            long after the first valid answer for newer ones, seconds.
        hedge_after_s: when every piece is assigned, a request to a relay that has not answered
            with headers for this long is moved to a free proven source, seconds.
        exploration: probability of choosing a source uniformly (see :class:`SourcePool`).
        missing_retry_s: after a source answers 404 for a piece, ask it again after this many seconds.
        stall_timeout_s: give up when for this many seconds no piece arrived and no request
            delivered at the rate floor.
        deadline_s: give up after this many seconds in total.
    """

    max_concurrency: int = 8
    max_in_flight_per_source: int = 4
    max_candidates: int = 8
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    read_timeout_s: float = READ_TIMEOUT_S
    min_rate_bps: float = 256 * 1024
    rate_window_s: float = 2.0
    rate_floor_bps: float = 64 * 1024
    slow_fraction: float = 1 / 8
    manifest_timeout_s: float = MANIFEST_TIMEOUT_S
    held_timeout_s: float = HELD_TIMEOUT_S
    max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES
    latest_grace_s: float = 1.0
    hedge_after_s: float = 0.5
    exploration: float = 0.1
    missing_retry_s: float = 0.5
    stall_timeout_s: float = STALL_TIMEOUT_S
    deadline_s: float = DOWNLOAD_DEADLINE_S


class PieceWriter(Protocol):
    """Destination of one piece's bytes. All methods block (call them off the event loop)."""

    def write(self, chunk: bytes | memoryview) -> None: ...

    def digest_matches(self) -> bool: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class InPlaceWriter:
    """A :class:`PieceWriter` that puts one piece's bytes at every position it has in open files.

    Identical pieces (same content ID) at several positions are downloaded once and written to
    each (``os.pwrite``), hashing as the bytes come. Nothing is moved on commit: the bytes are in
    place and verified; nothing is undone on abort: unverified bytes in place are overwritten by
    a later download, or re-checked on resume.

    Args:
        fds: open file descriptors, indexed by :attr:`PieceRef.file_index`.
        refs: the positions of the piece (same ``piece_id`` and size), at least one.
    """

    def __init__(self, fds: Sequence[int], refs: Sequence[PieceRef]) -> None:
        self._fds = fds
        self._refs = refs
        self._piece = refs[0]
        self._hash = hashlib.sha256()
        self._pos = 0

    def write(self, chunk: bytes | memoryview) -> None:
        for r in self._refs:
            os.pwrite(self._fds[r.file_index], chunk, r.offset_bytes + self._pos)
        self._hash.update(chunk)
        self._pos += len(chunk)

    def digest_matches(self) -> bool:
        return self._pos == self._piece.size_bytes and self._hash.digest() == self._piece.piece_id

    def commit(self) -> None:
        """Nothing to move: the bytes are in place and verified."""

    def abort(self) -> None:
        """Nothing to undo: unverified bytes in place are overwritten or re-checked on resume."""


def piece_url(source: str, piece_id: bytes) -> str:
    return f"{source}{ROUTE_PREFIX}/pieces/{hex_id(piece_id)}"


def manifest_url(source: str, step: int | None) -> str:
    return f"{source}{ROUTE_PREFIX}/manifests/{'latest' if step is None else step}"


def artifact_url(source: str, artifact_id: bytes) -> str:
    return f"{source}{ROUTE_PREFIX}/artifacts/{hex_id(artifact_id)}"


def held_url(source: str) -> str:
    return f"{source}{ROUTE_PREFIX}/held"


def make_session(cfg: DownloadConfig) -> aiohttp.ClientSession:
    """An HTTP session for Shardcast: raw bytes (no decompression), a connection cap per source.

    There is no global connection cap (its queue would let one source's stuck connections delay
    requests to every other source); callers bound the total: at most ``max_candidates`` relays
    plus the origins, each with at most ``max_in_flight_per_source`` piece requests plus one
    ``/held`` and one manifest request. So an origin's connections are reserved: a relay
    candidate can never take them.
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=cfg.max_in_flight_per_source + 2, enable_cleanup_closed=True)
    # 1 MiB read buffer: fewer pause/resume rounds of the socket than aiohttp's 64 KiB default.
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, raise_for_status=False, read_bufsize=READ_CHUNK_BYTES)


def request_timeout(cfg: DownloadConfig, read_s: float) -> aiohttp.ClientTimeout:
    """Socket-level timeouts only (connect, silence): never the wait for a pooled connection."""
    return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=cfg.connect_timeout_s, sock_read=read_s)


async def _read_bounded(resp: aiohttp.ClientResponse, source: str, limit_bytes: int, deadline_s: float) -> bytes:
    """Read at most ``limit_bytes`` of the body (never more than ``limit_bytes + 1`` off the stream).

    Raises:
        SourceError: evidence when the body is (or declares to be) over the limit; a transport
            failure when it does not arrive within ``deadline_s`` seconds.
    """
    declared = resp.content_length
    if declared is not None and declared > limit_bytes:
        raise SourceError(source, "oversized", f"response of {declared} bytes exceeds the {limit_bytes}-byte limit", evidence=True)
    end = time.monotonic() + deadline_s
    buf = bytearray()
    while chunk := await resp.content.read(min(READ_CHUNK_BYTES, limit_bytes + 1 - len(buf))):
        buf += chunk
        if len(buf) > limit_bytes:
            raise SourceError(source, "oversized", f"response exceeds the {limit_bytes}-byte limit", evidence=True)
        if time.monotonic() > end:
            raise SourceError(source, "slow", f"response not complete within {deadline_s:.0f} s")
    return bytes(buf)


class ManifestCache:
    """Verified manifests by ID, the ETag each source last gave, and sources caught lying.

    A poller keeps one so that a manifest it already verified is neither downloaded nor decoded
    again (the server's ``ETag`` is the manifest ID; ``If-None-Match`` gets a ``304``), and a
    source that served an over-limit or invalid manifest is not asked again: for a given step
    never (within this cache's life), for ``latest`` for ``faulty_ban_s`` seconds. Every map is
    bounded (least recently used entries go first).

    Args:
        max_manifests: verified manifests kept.
        faulty_ban_s: how long a source that lied about ``latest`` is skipped, seconds.
    """

    MAX_ENTRIES = 4096

    def __init__(self, max_manifests: int = 16, faulty_ban_s: float = 600.0) -> None:
        self.max_manifests = max_manifests
        self.faulty_ban_s = faulty_ban_s
        self._by_id: OrderedDict[bytes, Envelope[Manifest]] = OrderedDict()
        self._etags: OrderedDict[tuple[str, int | None], bytes] = OrderedDict()
        self._faulty: OrderedDict[tuple[str, int | None], tuple[str, float]] = OrderedDict()
        self.decoded = 0  # manifests decoded and verified through this cache (tests, metrics)

    def faulty_reason(self, source: str, step: int | None) -> str | None:
        """Why ``source`` is not asked for ``step`` (``None``: latest) any more, or ``None``."""
        hit = self._faulty.get((source, step))
        if hit is None:
            return None
        if hit[1] <= time.monotonic():
            del self._faulty[(source, step)]
            return None
        return hit[0]

    def mark_faulty(self, source: str, step: int | None, reason: str) -> None:
        """``source`` served a bad manifest for ``step``: skip it (for good; ``latest``: a while)."""
        until = time.monotonic() + self.faulty_ban_s if step is None else float("inf")
        self._put(self._faulty, (source, step), (reason, until))

    def etag(self, source: str, step: int | None) -> bytes | None:
        """ID of the verified manifest ``source`` last gave for ``step``, if still cached."""
        mid = self._etags.get((source, step))
        return mid if mid is not None and mid in self._by_id else None

    def lookup(self, manifest_id: bytes) -> Envelope[Manifest] | None:
        """The verified manifest with this ID, if cached."""
        env = self._by_id.get(manifest_id)
        if env is not None:
            self._by_id.move_to_end(manifest_id)
        return env

    def add(self, source: str, step: int | None, env: Envelope[Manifest]) -> None:
        """Remember a verified manifest and that ``source`` gave it for ``step``."""
        self._put(self._by_id, env.id, env, self.max_manifests)
        self._put(self._etags, (source, step), env.id)

    def _put(self, d: OrderedDict[Any, Any], key: Any, value: Any, cap: int = MAX_ENTRIES) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > cap:
            d.popitem(last=False)


def _etag_id(value: str | None) -> bytes | None:
    """The manifest ID in an ``ETag: "<64 hex>"`` header, or ``None``."""
    if not value or len(value) != 66 or value[0] != '"' or value[-1] != '"':
        return None
    try:
        return bytes.fromhex(value[1:-1])
    except ValueError:
        return None


async def get_manifest(
    session: aiohttp.ClientSession,
    source: str,
    step: int | None,
    *,
    run_id: bytes,
    authorities: Authorities,
    timeout_s: float,
    cfg: DownloadConfig | None = None,
    cache: ManifestCache | None = None,
) -> Envelope[Manifest] | None:
    """Ask ``source`` for the manifest of ``step`` (``None``: its latest) and verify it.

    The body is read with a hard cap (``cfg.max_manifest_bytes``) and verified off the event loop
    (:func:`protocol.shardcast.open_manifest`: signature over the raw bytes before the full
    decode). With a ``cache``, a manifest whose ``ETag`` names one already verified is not read
    again, and a source the cache marks faulty for ``step`` is not asked at all.

    Args:
        session: from :func:`make_session`.
        source: base URL.
        step: the step, or ``None`` for the source's latest.
        run_id: this node's run ID.
        authorities: the run spec's keys (the coordinator must have signed the manifest).
        timeout_s: longest silence on the socket, seconds; the body must also arrive within
            ``max_manifest_bytes / min_rate_bps + timeout_s`` seconds of the headers.
        cfg: limits (default :class:`DownloadConfig`).
        cache: verified manifests and faulty sources (see :class:`ManifestCache`).

    Returns:
        The verified manifest, or ``None`` when the source does not have it (404).

    Raises:
        SourceError: transport failure or bad status; with ``evidence=True`` when the bytes are
            over the limit, not a manifest of this run signed by its coordinator, or of another
            step, or when ``cache`` already knows the source lied about ``step``.
    """
    cfg = cfg or DownloadConfig()
    if cache is not None and (why := cache.faulty_reason(source, step)) is not None:
        raise SourceError(source, why, f"not asked again: it served a bad manifest ({why})", evidence=True)
    headers = {}
    known = cache.etag(source, step) if cache is not None else None
    if known is not None:
        headers["If-None-Match"] = f'"{hex_id(known)}"'
    body_s = cfg.max_manifest_bytes / cfg.min_rate_bps + timeout_s
    try:  # a whole-request deadline too: aiohttp re-arms sock_read on each byte of a dribbled head
        async with asyncio.timeout(cfg.connect_timeout_s + timeout_s + body_s) as deadline, session.get(
            manifest_url(source, step), headers=headers, timeout=request_timeout(cfg, timeout_s)
        ) as resp:
            if resp.status == 404:
                return None
            if resp.status == 304 and cache is not None and known is not None and (env := cache.lookup(known)) is not None:
                return env
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"manifest request answered HTTP {resp.status}")
            tag = _etag_id(resp.headers.get("ETag"))
            if cache is not None and tag is not None and (env := cache.lookup(tag)) is not None and step in (None, env.body.step):
                cache.add(source, step, env)
                return env  # already verified: the body is not read (a wrong ETag only hides a manifest we have)
            try:
                raw = await _read_bounded(resp, source, cfg.max_manifest_bytes, body_s)
            except SourceError as e:
                if e.evidence and cache is not None:
                    cache.mark_faulty(source, step, e.reason)
                raise
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        if deadline.expired():
            raise SourceError(source, "slow", f"manifest request not answered within {cfg.connect_timeout_s + timeout_s + body_s:.0f} s") from None
        raise SourceError(source, "unreachable", f"manifest request failed: {type(e).__name__}: {e}") from e
    try:
        env = await asyncio.to_thread(open_manifest, raw, run_id=run_id, authorities=authorities, max_bytes=cfg.max_manifest_bytes)
    except ProtocolError as e:
        if cache is not None:
            cache.mark_faulty(source, step, "bad_manifest")
        raise SourceError(source, "bad_manifest", f"rejected its manifest: {e}", evidence=True) from e
    if step is not None and env.body.step != step:
        if cache is not None:
            cache.mark_faulty(source, step, "bad_manifest")
        raise SourceError(source, "bad_manifest", f"asked for step {step}, got a manifest of step {env.body.step}", evidence=True)
    if cache is not None:
        cache.decoded += 1
        cache.add(source, step, env)
    return env


async def get_artifact_manifest(session: aiohttp.ClientSession, source: str, artifact_id: bytes, *, timeout_s: float,
                                cfg: DownloadConfig | None = None) -> tuple[ArtifactManifest, bytes] | None:
    """Ask ``source`` for the manifest of artifact ``artifact_id`` and check it against that ID.

    Read with a hard cap (:data:`protocol.artifacts.MAX_ARTIFACT_MANIFEST_BYTES`) and a
    whole-request deadline; the bytes must hash to the pinned ID before they are decoded
    (:func:`protocol.artifacts.open_artifact`, off the event loop).

    Returns:
        ``(manifest, its bytes)``, or ``None`` when the source does not hold it (404).

    Raises:
        SourceError: transport failure or bad status; with ``evidence=True`` when the bytes are over
            the limit or are not the pinned artifact.
    """
    cfg = cfg or DownloadConfig()
    body_s = MAX_ARTIFACT_MANIFEST_BYTES / cfg.min_rate_bps + timeout_s
    try:
        async with asyncio.timeout(cfg.connect_timeout_s + timeout_s + body_s) as deadline, session.get(
            artifact_url(source, artifact_id), timeout=request_timeout(cfg, timeout_s)
        ) as resp:
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"artifact request answered HTTP {resp.status}")
            raw = await _read_bounded(resp, source, MAX_ARTIFACT_MANIFEST_BYTES, body_s)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        if deadline.expired():
            raise SourceError(source, "slow", f"artifact request not answered within {cfg.connect_timeout_s + timeout_s + body_s:.0f} s") from None
        raise SourceError(source, "unreachable", f"artifact request failed: {type(e).__name__}: {e}") from e
    try:
        manifest = await asyncio.to_thread(open_artifact, raw, artifact_id)
    except ProtocolError as e:
        raise SourceError(source, "bad_artifact", f"rejected its artifact manifest: {e}", evidence=True) from e
    return manifest, raw


async def get_held(
    session: aiohttp.ClientSession, source: str, *, timeout_s: float, cfg: DownloadConfig | None = None
) -> tuple[list[int], list[int]]:
    """``(held_steps, steps)`` that ``source`` reports (complete steps; all steps with a manifest).

    The answer is unsigned: callers must not let it outrank coordinator-signed information.

    Raises:
        SourceError: transport failure, bad status or malformed JSON.
    """
    cfg = cfg or DownloadConfig()
    try:  # a whole-request deadline too (see get_manifest)
        async with asyncio.timeout(cfg.connect_timeout_s + 3 * timeout_s) as deadline, session.get(
            held_url(source), timeout=request_timeout(cfg, timeout_s)
        ) as resp:
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"/held answered HTTP {resp.status}")
            raw = await _read_bounded(resp, source, MAX_HELD_BYTES, 2 * timeout_s)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        if deadline.expired():
            raise SourceError(source, "slow", f"/held request not answered within {cfg.connect_timeout_s + 3 * timeout_s:.0f} s") from None
        raise SourceError(source, "unreachable", f"/held request failed: {type(e).__name__}: {e}") from e
    try:
        doc: Any = json.loads(raw)
        held, steps = doc["held_steps"], doc["steps"]
        if not isinstance(held, list) or not isinstance(steps, list) or len(held) > 1024 or len(steps) > 1024:
            raise ValueError("held_steps and steps must be lists of at most 1024 steps")
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 2**40 for x in [*held, *steps]):
            raise ValueError("steps must be integers 0 … 2^40")
    except (ValueError, KeyError, TypeError) as e:
        raise SourceError(source, "bad_held", f"malformed /held answer: {e}") from e
    return sorted(held), sorted(steps)


def _write_all(writer: PieceWriter, chunks: list[bytes]) -> None:
    for c in chunks:
        writer.write(c)


async def _settled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread, finished even when the caller is cancelled meanwhile.

    A cancelled ``asyncio.to_thread`` leaves its thread running: a hedged or cut-off request
    would then go on writing (or aborting) its piece while the piece's next request writes the
    same bytes. So a cancellation waits for the thread before it propagates.
    """
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({fut})
        raise


def body_deadline_s(piece: PieceRef, cfg: DownloadConfig, *, origin: bool) -> float:
    """Seconds a piece's body may take after its response headers: ``size / min_rate_bps`` +
    :data:`~node.timeouts.PIECE_BODY_GRACE_S`;
    from a relay also at most half of ``stall_timeout_s`` (so a relay's request always ends, and
    its piece moves on, before the download could stall)."""
    s = piece.size_bytes / cfg.min_rate_bps + PIECE_BODY_GRACE_S
    return s if origin else min(s, cfg.stall_timeout_s / 2)


async def download_piece(
    session: aiohttp.ClientSession,
    source: str,
    piece: PieceRef,
    writer: PieceWriter,
    cfg: DownloadConfig,
    on_bytes: Callable[[int], None] | None = None,
    on_headers: Callable[[], None] | None = None,
    *,
    deadline_s: float | None = None,
) -> None:
    """GET one piece from ``source``, streaming it through ``writer``, and verify it.

    The writer is committed only if the bytes hash to the piece ID; otherwise it is aborted.
    Nothing is written before ``on_headers`` is called (so cancelling the request before that
    point can never leave a write behind); a cancellation after it waits for the writer's
    thread, so no write of this request lands after it ended.

    Args:
        deadline_s: seconds the body may take after the headers (default
            :func:`body_deadline_s` for a relay).

    Raises:
        SourceError: ``reason="missing"`` on 404; a transport failure, bad status, a body slower
            than its deadline allows or truncated (an honest source can do that).
        BadPieceError: evidence: a declared or actual length other than the piece's, or bytes
            that do not hash to the piece ID.
    """
    ok = False
    limit_s = body_deadline_s(piece, cfg, origin=False) if deadline_s is None else deadline_s
    try:
        async with session.get(piece_url(source, piece.piece_id), timeout=request_timeout(cfg, cfg.read_timeout_s)) as resp:
            if on_headers is not None:
                on_headers()
            if resp.status == 404:
                raise SourceError(source, "missing", f"does not hold piece {hex_id(piece.piece_id)[:16]}…")
            if resp.status != 200:
                raise SourceError(source, f"http_{resp.status}", f"piece request answered HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length != piece.size_bytes:
                raise BadPieceError(source, piece.piece_id, f"declared {resp.content_length} bytes, the piece has {piece.size_bytes}", reason="bad_length")
            end = time.monotonic() + limit_s
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
                    await _settled(_write_all, writer, batch)
                    batch, batch_bytes = [], 0
                if on_bytes is not None:
                    on_bytes(len(chunk))
                if time.monotonic() > end:
                    raise SourceError(source, "slow", f"piece {hex_id(piece.piece_id)[:16]}… not delivered within {limit_s:.0f} s")
            if batch:
                await _settled(_write_all, writer, batch)
            if got < piece.size_bytes:
                raise SourceError(source, "truncated", f"piece {hex_id(piece.piece_id)[:16]}… ended after {got} of {piece.size_bytes} bytes")
        if not await _settled(writer.digest_matches):
            raise BadPieceError(source, piece.piece_id, "content does not hash to the piece ID", reason="bad_hash")
        await _settled(writer.commit)
        ok = True
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise SourceError(source, "unreachable", f"piece transfer failed: {type(e).__name__}: {e}") from e
    finally:
        if not ok:
            await _settled(writer.abort)


@dataclass
class DownloadStats:
    """What a :class:`PieceDownloader` run did.

    Attributes:
        pieces: pieces fetched and verified.
        bytes: verified piece bytes received, in bytes.
        wasted_bytes: bytes received in failed, cut-off or rejected transfers, in bytes.
        hedged: requests to a silent relay moved to another source.
        slow: requests to a relay cut off for delivering below the rate floor.
    """

    pieces: int = 0
    bytes: int = 0
    wasted_bytes: int = 0
    hedged: int = 0
    slow: int = 0


@dataclass
class _Request:
    """One piece request in flight."""

    piece: PieceRef
    src: SourceState
    started: float
    relay_slot: bool
    task: asyncio.Task[bool] | None = None
    answered: bool = False  # response headers arrived (from then on it is never cancelled early)
    hedged: bool = False  # cancelled by the downloader (silent or too slow)
    received: int = 0  # body bytes so far
    window_start: float = 0.0  # monotonic start of the current rate window (set at the headers)
    window_bytes: int = 0  # ``received`` at the start of the window


class PieceDownloader:
    """Downloads a set of pieces from a :class:`SourcePool` in parallel, verifying each.

    One dispatcher assigns pieces to sources with free capacity: each origin has its own
    ``max_in_flight_per_source`` slots, relay candidates share ``semaphore`` (``max_concurrency``)
    and an unproven relay gets one request at a time, so relays that never answer can hold at
    most their own slots while the origin keeps serving. A piece that fails verification is
    discarded, the source gets evidence against it (the pool bans it) and the piece is retried
    elsewhere; a source without the piece (404) is cooled down (back-off) and not asked for that
    piece for ``missing_retry_s``; transport failures cool the source down.

    Rates are watched as bytes arrive (``docs/shardcast.md`` §6.2): every ``rate_window_s``
    after its headers a request's bytes in that window give its rate, and the **rate floor** is
    ``max(rate_floor_bps, slow_fraction × best)``, ``best`` being the highest rate an origin
    delivered in this download (windows and completed pieces of the last ``10 × rate_window_s``)
    or in the pool: relays cannot raise it. A relay's request below the floor is cut off like a silent one: its writes finished,
    its source's rate set to what it delivered and cooled down, its piece moved to proven
    sources only. Origin requests are never cut off for rate (their reserved path always makes
    progress); their windows feed ``best``. When every piece is assigned, a request to a relay
    that sent no response headers for ``hedge_after_s`` while a proven source is free is
    cancelled (no byte of it was written) and the piece moves on. The download stalls (and
    fails) only when for ``stall_timeout_s`` no piece verified and no request delivered at the
    floor; a relay's request never outlives half of that (:func:`body_deadline_s`).

    Args:
        session: HTTP session (see :func:`make_session`).
        pool: the sources.
        cfg: limits and timeouts.
        semaphore: shared bound on relay requests in flight (a relay syncing several steps
            passes one); default: ``cfg.max_concurrency``.
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
        self._proven_only: set[bytes] = set()  # pieces taken from a silent or slow relay: only proven sources get them again
        self._rates: deque[tuple[float, float]] = deque(maxlen=256)  # (when, bytes/s) of origins' recent windows and pieces

    async def run(self, pieces: Sequence[PieceRef], open_writer: Callable[[PieceRef], Awaitable[PieceWriter]]) -> DownloadStats:
        """Fetch every piece in ``pieces`` (each piece ID once) through writers from ``open_writer``.

        Raises:
            FetchError: every source is banned, no progress for ``stall_timeout_s``, or
                ``deadline_s`` passed; ``faulty_sources`` names the sources with evidence.
        """
        queue = list({p.piece_id: p for p in pieces}.values())
        if not queue:
            return self.stats
        deadline = time.monotonic() + self._cfg.deadline_s
        self._last_progress = time.monotonic()
        missing_until: dict[tuple[bytes, str], float] = {}
        running: dict[asyncio.Task[bool], _Request] = {}
        try:
            while queue or running:
                self._check_limits(deadline)
                await self._dispatch(queue, running, missing_until, open_writer)
                self._police(running)
                if not queue:
                    self._hedge(running)
                done = [t for t in running if t.done()]
                for t in done:
                    req = running.pop(t)
                    if req.relay_slot:
                        self._sem.release()
                    if t.cancelled() or not t.result():
                        queue.insert(0, req.piece)
                if done:
                    continue
                await self._wait_for_change(self._next_wake(queue, running, missing_until))
        finally:
            for t, req in running.items():
                t.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
                for req in running.values():
                    if req.relay_slot:
                        self._sem.release()
                    if not req.answered:  # a relay that never answered before the fetch ended
                        self._pool.record_failure(req.src, "no response")
        return self.stats

    async def _dispatch(
        self,
        queue: list[PieceRef],
        running: dict[asyncio.Task[bool], _Request],
        missing_until: dict[tuple[bytes, str], float],
        open_writer: Callable[[PieceRef], Awaitable[PieceWriter]],
    ) -> None:
        now = time.monotonic()
        while queue:
            relay_free = not self._sem.locked()
            idx = src = None
            for _ in range(4):  # a source that lacks the queued pieces: try another
                src = self._pool.choose(relays=relay_free)
                if src is None:
                    break
                idx = next(
                    (
                        i for i, p in enumerate(queue)
                        if missing_until.get((p.piece_id, src.url), 0.0) <= now and (src.proven or p.piece_id not in self._proven_only)
                    ),
                    None,
                )
                if idx is not None:
                    break
            if src is None or idx is None:
                return
            piece = queue.pop(idx)
            relay_slot = not src.origin
            if relay_slot:
                await self._sem.acquire()  # free (checked above): returns without suspending
            req = _Request(piece, src, now, relay_slot)
            src.in_flight += 1
            req.task = asyncio.ensure_future(self._try(req, open_writer, missing_until))
            req.task.add_done_callback(functools.partial(self._finished, req))  # also runs if cancelled before it started
            running[req.task] = req

    def _finished(self, req: _Request, _task: asyncio.Task[bool]) -> None:
        req.src.in_flight -= 1
        self._changed.set()

    def rate_floor_bps(self, now: float | None = None) -> float:
        """The rate floor now: ``max(rate_floor_bps, slow_fraction × best)``, bytes/s, ``best`` being
        the origins' best rate: a relay that serves one piece from memory at once (gigabytes a second
        over a short path) and then refuses would otherwise set a floor that cuts every honest relay
        off in each window, leaving the origin to serve nearly everything."""
        now = time.monotonic() if now is None else now
        horizon = now - 10 * self._cfg.rate_window_s
        best = max((r for t, r in self._rates if t >= horizon), default=0.0)
        return max(self._cfg.rate_floor_bps, self._cfg.slow_fraction * max(best, self._pool.best_rate_bps(origins_only=True) or 0.0))

    def _police(self, running: dict[asyncio.Task[bool], _Request]) -> None:
        """Close the rate windows that are due; cut off relay requests below the floor."""
        now = time.monotonic()
        window = self._cfg.rate_window_s
        closed: list[tuple[_Request, float]] = []
        for req in running.values():
            if req.answered and not req.hedged and req.task is not None and not req.task.done() and now - req.window_start >= window:
                rate = (req.received - req.window_bytes) / (now - req.window_start)
                req.window_start, req.window_bytes = now, req.received
                if req.src.origin:
                    self._rates.append((now, rate))
                closed.append((req, rate))
        if not closed:
            return
        floor = self.rate_floor_bps(now)
        for req, rate in closed:
            if rate >= floor:
                self._last_progress = now  # bytes are flowing at the floor: not a stall
            elif not req.src.origin:
                assert req.task is not None
                req.hedged = True
                self._proven_only.add(req.piece.piece_id)
                self.stats.slow += 1
                req.task.cancel()  # its writes finish first (_settled); the piece is queued again once it ended
                self._pool.record_slow(req.src, rate)
                logger.debug("source %s delivered %.0f bytes/s (floor %.0f): piece moved on", req.src.url, rate, floor)

    def _hedge(self, running: dict[asyncio.Task[bool], _Request]) -> None:
        """Cancel requests to relays silent for ``hedge_after_s`` while a proven source is free."""
        now = time.monotonic()
        silent = [r for r in running.values() if not r.answered and not r.src.origin and not r.hedged and now - r.started >= self._cfg.hedge_after_s]
        for req in silent:
            if self._pool.choose(exclude=[req.src.url], relays=not self._sem.locked(), proven_only=True) is None:
                return
            req.hedged = True
            self._proven_only.add(req.piece.piece_id)
            self.stats.hedged += 1
            assert req.task is not None
            req.task.cancel()  # still inside session.get(): no byte of this request was written
            self._pool.record_failure(req.src, "no response")

    def _next_wake(
        self, queue: list[PieceRef], running: dict[asyncio.Task[bool], _Request], missing_until: dict[tuple[bytes, str], float]
    ) -> float:
        now = time.monotonic()
        waits = [self._cfg.missing_retry_s]
        ready = self._pool.next_ready_s(now)
        if ready is not None:
            waits.append(ready + 0.01)
        if not queue and any(not r.answered and not r.src.origin for r in running.values()):
            waits.append(self._cfg.hedge_after_s / 2)
        windows = [r.window_start + self._cfg.rate_window_s - now for r in running.values() if r.answered and not r.hedged]
        if windows:
            waits.append(min(windows) + 0.01)
        return max(0.01, min(waits))

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
                f"no source delivered a piece, nor bytes at {self.rate_floor_bps(now):.0f} bytes/s, for {self._cfg.stall_timeout_s:.0f} s "
                f"(sources: {', '.join(self._pool.urls) or 'none'})",
                self._pool.faulty(),
            )

    async def _try(
        self,
        req: _Request,
        open_writer: Callable[[PieceRef], Awaitable[PieceWriter]],
        missing_until: dict[tuple[bytes, str], float],
    ) -> bool:
        src, piece = req.src, req.piece

        def count(n: int) -> None:
            req.received += n
            if self._on_bytes is not None:
                self._on_bytes(n)

        def answered() -> None:
            req.answered = True
            req.window_start = time.monotonic()
            self._changed.set()  # the first rate window is now due at a known time

        t0 = time.monotonic()
        try:
            writer = await open_writer(piece)
            await download_piece(self._session, src.url, piece, writer, self._cfg, count, answered,
                                 deadline_s=body_deadline_s(piece, self._cfg, origin=src.origin))
        except BadPieceError as e:
            self._pool.record_evidence(src, f"{e.reason}: piece {hex_id(piece.piece_id)[:16]}…")
            self.stats.wasted_bytes += req.received
            return False
        except SourceError as e:
            self.stats.wasted_bytes += req.received
            if e.evidence:
                self._pool.record_evidence(src, e.reason)
            elif e.reason == "missing":
                missing_until[(piece.piece_id, src.url)] = time.monotonic() + self._cfg.missing_retry_s
                self._pool.record_missing(src)
            elif e.reason == "slow":  # over its body deadline: what it delivered is its rate
                self._pool.record_slow(src, req.received / max(time.monotonic() - t0, 1e-6))
            else:
                self._pool.record_failure(src, e.reason)
            return False
        except asyncio.CancelledError:
            self.stats.wasted_bytes += req.received
            raise
        seconds = time.monotonic() - t0
        self._pool.record_success(src, piece.size_bytes, seconds)
        if src.origin:
            self._rates.append((time.monotonic(), piece.size_bytes / max(seconds, 1e-6)))
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
    "ManifestCache",
    "PieceDownloader",
    "PieceId",
    "body_deadline_s",
    "download_piece",
    "get_held",
    "get_manifest",
    "make_session",
    "request_timeout",
]
