"""A Shardcast relay: mirrors manifests and pieces from upstreams and serves them.

A relay with no upstreams is an origin: it serves what ``publish`` puts in its store (it re-reads
the store's manifest directory every ``poll_interval_s``). With upstreams it polls their
``/held`` answers, takes the manifests of the newest ``keep_steps`` steps any upstream knows
(verified against the coordinator key before they are stored), and fills each step with
parallel, verified piece downloads from all upstreams. Each piece is served as soon as it is
stored (cut-through), while :meth:`Relay.held_steps` — what heartbeats announce — lists only
complete steps. After each completed step the store's retention removes older steps.

Upstreams can change at run time (:meth:`Relay.set_upstreams`), e.g. from gossip.

Lifecycle: ``Relay(store, config)`` (no I/O) → ``await start()`` → ``await run()`` (until
:meth:`stop`) → ``await stop()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from node.errors import FetchError, SourceError
from node.shardcast.delta import mirror_delta, rebuild_from_delta
from node.shardcast.download import DownloadConfig, PieceDownloader, get_held, get_manifest, make_session
from node.shardcast.server import ShardcastServer
from node.shardcast.sources import SourcePool
from node.shardcast.store import PieceWriter, ShardcastStore
from protocol.errors import ProtocolError
from protocol.shardcast import PieceRef

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayConfig:
    """Settings of a relay.

    Attributes:
        host: interface the HTTP server binds.
        port: TCP port (0: any free port).
        upstreams: base URLs to follow (empty: this node is an origin).
        poll_interval_s: how often upstreams' ``/held`` (and the local store) are checked, seconds
            (a tiny JSON request; short, so a new step starts moving at once).
        upstream_ban_s: how long evidence bans an upstream, seconds.
        download: limits and timeouts of piece downloads (``deadline_s`` bounds one attempt at a step).
        peer_id: this node's peer ID, reported by ``/held``.
    """

    host: str = "127.0.0.1"
    port: int = 0
    upstreams: tuple[str, ...] = ()
    poll_interval_s: float = 0.2
    upstream_ban_s: float = 600.0
    download: DownloadConfig = field(default_factory=lambda: DownloadConfig(stall_timeout_s=120.0))
    peer_id: str = ""


class Relay:
    """Serve a store and keep it filled from upstreams.

    Args:
        store: the relay's store (run ID, coordinator key and ``keep_steps`` come with it).
        config: see :class:`RelayConfig`.
    """

    store: ShardcastStore
    config: RelayConfig
    server: ShardcastServer
    pool: SourcePool

    def __init__(self, store: ShardcastStore, config: RelayConfig | None = None) -> None:
        self.store = store
        self.config = config or RelayConfig()
        self.server = ShardcastServer(store, host=self.config.host, port=self.config.port, peer_id=self.config.peer_id)
        self.pool = SourcePool(
            self.config.upstreams,
            exploration=self.config.download.exploration,
            max_in_flight_per_source=self.config.download.max_in_flight_per_source,
            ban_s=self.config.upstream_ban_s,
        )
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._syncs: dict[int, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._wake = asyncio.Event()

    # --- public face ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL the relay serves on (valid after :meth:`start`)."""
        return self.server.url

    def held_steps(self) -> list[int]:
        """Complete steps, ascending: the only steps this relay announces."""
        return self.store.held_steps()

    def set_upstreams(self, urls: Iterable[str]) -> None:
        """Replace the upstream list (kept upstreams keep their statistics and bans)."""
        self.pool.set_urls(urls)
        self._wake.set()
        logger.info("upstreams: %s", ", ".join(self.pool.urls) or "none (origin)")

    async def start(self) -> None:
        """Start the HTTP server and the follow loop."""
        self._session = make_session(self.config.download)
        self._sem = asyncio.Semaphore(self.config.download.max_concurrency)
        await self.server.start()
        self._loop_task = asyncio.create_task(self._follow_loop(), name="shardcast-relay-follow")

    async def run(self) -> None:
        """Wait until :meth:`stop` is called (the work happens in background tasks)."""
        await self._stopped.wait()

    async def stop(self) -> None:
        """Stop syncing and serving; safe to call more than once."""
        self._stopped.set()
        tasks = [t for t in [self._loop_task, *self._syncs.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._syncs.clear()
        self._loop_task = None
        await self.server.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- follow loop ------------------------------------------------------------------------

    async def _follow_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("relay poll failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.poll_interval_s)
            except TimeoutError:
                pass

    async def poll_once(self) -> None:
        """One round: re-read the store, learn upstream steps, start syncs, apply retention."""
        await asyncio.to_thread(self.store.refresh)
        if self.pool.urls:
            await self._learn_upstream_steps()
        for step in self.store.steps():
            if not self.store.is_complete(step) and step not in self._syncs:
                self._syncs[step] = asyncio.create_task(self._sync(step), name=f"shardcast-sync-{step}")
        await self._prune()

    async def _learn_upstream_steps(self) -> None:
        assert self._session is not None
        cfg = self.config.download
        srcs = self.pool.usable()
        answers = await asyncio.gather(*(get_held(self._session, s.url, timeout_s=cfg.manifest_timeout_s) for s in srcs), return_exceptions=True)
        offers: dict[int, list[str]] = {}
        for src, ans in zip(srcs, answers, strict=True):
            if isinstance(ans, SourceError):
                self.pool.record_failure(src, ans.reason)
                continue
            if isinstance(ans, BaseException):
                raise ans
            for step in ans[1]:
                offers.setdefault(step, []).append(src.url)
        known = set(self.store.steps())
        held = self.store.held_steps()
        floor = held[-self.store.keep_steps] if len(held) >= self.store.keep_steps else -1
        newest = set(sorted(known | set(offers))[-self.store.keep_steps:])  # older ones would be pruned at once
        wanted = sorted(s for s in offers if s not in known and s > floor and s in newest)
        for step in wanted:
            for url in offers[step]:
                src = self.pool.get(url)
                if src is None:
                    continue
                try:
                    env = await get_manifest(
                        self._session, url, step, run_id=self.store.run_id, authorities=self.store.authorities, timeout_s=cfg.manifest_timeout_s
                    )
                except SourceError as e:
                    (self.pool.record_evidence if e.evidence else self.pool.record_failure)(src, e.reason)
                    continue
                if env is None:
                    continue
                await mirror_delta(self._session, self.pool, self.store, env, cfg)  # delta first: downstream sees both
                try:
                    await asyncio.to_thread(self.store.add_manifest, env.raw)
                except ProtocolError as e:  # verified already; only a changed store could refuse
                    logger.warning("store refused manifest of step %d: %s", step, e)
                    continue
                break

    async def _sync(self, step: int) -> None:
        """Fill ``step`` from the upstreams (one attempt; the next poll retries a failed one)."""
        assert self._session is not None
        try:
            if self.pool.urls:  # from the held base step + a small delta when there is one (docs/shardcast.md §9)
                await rebuild_from_delta(self._session, self.pool, self.store, step, self.config.download, semaphore=self._sem,
                                         on_piece=self.server.piece_stored)
            missing: list[PieceRef] = await asyncio.to_thread(self.store.missing_pieces, step)
            if missing and self.pool.urls:
                logger.info("syncing step %d: %d pieces", step, len(missing), extra={"step": step})
                downloader = PieceDownloader(
                    self._session, self.pool, self.config.download, semaphore=self._sem,
                    on_piece=lambda p: self.server.piece_stored(p.piece_id),
                )

                async def open_writer(piece: PieceRef) -> PieceWriter:
                    return await asyncio.to_thread(self.store.piece_writer, piece.piece_id, piece.size_bytes)

                await downloader.run(missing, open_writer)
            if await asyncio.to_thread(self.store.check_complete, step):
                await self._prune()
        except FetchError as e:
            logger.warning("sync of step %d stopped: %s", step, e, extra={"step": step})
        except Exception:
            logger.exception("sync of step %d failed", step)
        finally:
            self._syncs.pop(step, None)
            self._wake.set()

    async def _prune(self) -> None:
        removed = await asyncio.to_thread(self.store.prune)
        for step in removed:
            task = self._syncs.pop(step, None)
            if task is not None:
                task.cancel()
