"""A Shardcast relay: mirrors manifests and pieces from upstreams and serves them.

A relay with no upstreams is an origin: it serves what ``publish`` puts in its store (it re-reads
the store's manifest directory every ``poll_interval_s``). With upstreams it polls their
``/held`` answers, takes the manifests of the newest ``keep_steps`` steps any upstream knows
(verified against the coordinator key before they are stored), and fills each step with
parallel, verified piece downloads from all upstreams. Each piece is served as soon as it is
stored (cut-through), while :meth:`Relay.held_steps` — what heartbeats announce — lists only
complete steps. After each completed step the store's retention removes older steps. The
artifacts the run spec pins (``RelayConfig.artifacts``: the task list, ``docs/shardcast.md`` §10)
are mirrored the same way, once, and kept: their manifests are checked against the pinned IDs.

Upstreams can change at run time (:meth:`Relay.set_upstreams`), e.g. from gossip.

Hostile upstreams (issue #12): origins are always kept in the upstream pool with request slots of
their own; relay upstreams are a bounded random subset; a ``/held`` answer is unsigned, so steps
above the latest coordinator-signed step (a gossip announcement via :meth:`Relay.note_latest_step`,
or what an origin reports) are ignored, a step an upstream offers but cannot serve a manifest for
is not asked of it again, and each upstream gets a bounded number of failed manifest requests per
poll. A slow ``/held`` never delays the others: each upstream's request runs on its own and is
read when it is done.

Lifecycle: ``Relay(store, config)`` (no I/O) → ``await start()`` → ``await run()`` (until
:meth:`stop`) → ``await stop()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from node.errors import FetchError, SourceError
from node.shardcast.delta import mirror_delta, rebuild_from_delta
from node.shardcast.download import DownloadConfig, PieceDownloader, get_held, get_manifest, make_session
from node.shardcast.events import log_held
from node.shardcast.server import ShardcastServer
from node.shardcast.sources import SourcePool, normalise_url
from node.shardcast.store import PieceWriter, ShardcastStore
from node.timeouts import RELAY_STALL_TIMEOUT_S
from protocol.errors import ProtocolError
from protocol.identity import PeerId
from protocol.shardcast import PieceRef

logger = logging.getLogger(__name__)

ARTIFACT_RETRY_S = 5.0
"""After a failed attempt to mirror an artifact, the next one waits this long, seconds."""


@dataclass(frozen=True)
class RelayConfig:
    """Settings of a relay.

    Attributes:
        host: interface the HTTP server binds.
        port: TCP port (0: any free port).
        upstreams: base URLs to follow (empty: this node is an origin).
        origins: URLs that are origins (the run spec's ``origin_urls``): when they are upstreams
            they are always kept, have reserved request slots, and their ``/held`` bounds the steps
            the relay believes exist.
        poll_interval_s: how often upstreams' ``/held`` (and the local store) are checked, seconds
            (a tiny JSON request; short, so a new step starts moving at once).
        upstream_ban_s: how long evidence bans an upstream, seconds.
        download: limits and timeouts of piece downloads (``deadline_s`` bounds one attempt at a step).
        peer_id: this node's peer ID, reported by ``/held``.
        artifacts: IDs of the artifacts to mirror (the run spec's ``[artifacts]``), 32 bytes each.
    """

    host: str = "127.0.0.1"
    port: int = 0
    upstreams: tuple[str, ...] = ()
    origins: tuple[str, ...] = ()
    poll_interval_s: float = 0.2
    upstream_ban_s: float = 600.0
    download: DownloadConfig = field(default_factory=lambda: DownloadConfig(stall_timeout_s=RELAY_STALL_TIMEOUT_S))
    peer_id: PeerId | None = None
    artifacts: tuple[bytes, ...] = ()


def _origins_among(urls: Iterable[str], origins: Iterable[str]) -> list[str]:
    """The URLs of ``urls`` that name one of ``origins`` (trailing slashes ignored)."""
    wanted = {normalise_url(o) for o in origins}
    return [u for u in urls if normalise_url(u) in wanted]


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
            origins=_origins_among(self.config.upstreams, self.config.origins),
            exploration=self.config.download.exploration,
            max_in_flight_per_source=self.config.download.max_in_flight_per_source,
            ban_s=self.config.upstream_ban_s,
            max_candidates=self.config.download.max_candidates,
        )
        self._latest_signed: int | None = None
        self._origin_latest: int | None = None
        self._origins_heard: set[str] = set()
        self._held_tasks: dict[str, asyncio.Task[tuple[list[int], list[int]]]] = {}
        self._bad_offers: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._syncs: dict[int, asyncio.Task[None]] = {}
        self._artifact_syncs: dict[bytes, asyncio.Task[None]] = {}
        self._artifact_retry_at: dict[bytes, float] = {}  # artifact ID → monotonic time of the next attempt after a failure
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

    def set_upstreams(self, urls: Iterable[str], *, origins: Iterable[str] | None = None) -> None:
        """Replace the upstream list (kept upstreams keep their statistics and bans).

        Args:
            urls: upstream base URLs; at most ``download.max_candidates`` non-origins are kept
                (a random subset).
            origins: which URLs are origins (always kept, reserved slots); default: those of
                ``urls`` named in ``config.origins``. An origin not in ``urls`` is added.
        """
        urls = list(urls)
        chosen = list(origins) if origins is not None else _origins_among(urls, self.config.origins)
        self.pool.set_urls(urls, origins=chosen)
        self._wake.set()
        logger.info("upstreams: %s", ", ".join(self.pool.urls) or "none (origin)")

    def note_latest_step(self, step: int | None) -> None:
        """The newest step a coordinator-signed message names (gossip announcement or record).

        Steps that upstreams offer above the newest such step are ignored (``/held`` is unsigned).
        """
        if step is not None and (self._latest_signed is None or step > self._latest_signed):
            self._latest_signed = step
            self._wake.set()

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
        tasks = [t for t in [self._loop_task, *self._syncs.values(), *self._held_tasks.values(), *self._artifact_syncs.values()]
                 if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._syncs.clear()
        self._held_tasks.clear()
        self._artifact_syncs.clear()
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
        if self.pool.urls:
            for aid in self.config.artifacts:
                if aid not in self._artifact_syncs and not self.store.artifact_complete(aid) \
                        and time.monotonic() >= self._artifact_retry_at.get(aid, 0.0):
                    self._artifact_syncs[aid] = asyncio.create_task(self._sync_artifact(aid), name=f"shardcast-artifact-{aid.hex()[:8]}")
        await self._prune()

    async def _sync_artifact(self, artifact_id: bytes) -> None:
        """Mirror one pinned artifact from the upstreams (one attempt; the next poll retries a failed one)."""
        assert self._session is not None
        from node.shardcast.client import resolve_artifact

        try:
            if self.store.artifact(artifact_id) is None:
                _, raw = await resolve_artifact(self._session, self.pool, artifact_id, self.config.download)
                await asyncio.to_thread(self.store.add_artifact, raw, artifact_id)
            missing = await asyncio.to_thread(self.store.missing_artifact_pieces, artifact_id)
            if missing:
                downloader = PieceDownloader(self._session, self.pool, self.config.download, semaphore=self._sem,
                                             on_piece=lambda p: self.server.piece_stored(p.piece_id))

                async def open_writer(piece: PieceRef) -> PieceWriter:
                    return await asyncio.to_thread(self.store.piece_writer, piece.piece_id, piece.size_bytes)

                await downloader.run(missing, open_writer)
            if await asyncio.to_thread(self.store.check_artifact, artifact_id):
                logger.info("artifact %s… held", artifact_id.hex()[:16])
        except (FetchError, ProtocolError) as e:
            logger.info("mirroring artifact %s… stopped: %s", artifact_id.hex()[:16], e)
            self._artifact_retry_at[artifact_id] = time.monotonic() + ARTIFACT_RETRY_S
        except Exception:
            logger.exception("mirroring artifact %s… failed", artifact_id.hex()[:16])
            self._artifact_retry_at[artifact_id] = time.monotonic() + ARTIFACT_RETRY_S
        finally:
            self._artifact_syncs.pop(artifact_id, None)

    async def _poll_held(self) -> tuple[dict[int, list[str]], list[int]]:
        """Start a ``/held`` request per usable upstream that has none running; wait at most one
        poll interval; return ``(offers: step → URLs, steps reported by origins)`` of those done."""
        assert self._session is not None
        cfg = self.config.download
        for up in self.pool.usable():
            if up.url not in self._held_tasks:
                self._held_tasks[up.url] = asyncio.ensure_future(get_held(self._session, up.url, timeout_s=cfg.held_timeout_s, cfg=cfg))
        if self._held_tasks:
            await asyncio.wait(list(self._held_tasks.values()), timeout=max(self.config.poll_interval_s, 0.05))
        offers: dict[int, list[str]] = {}
        origin_steps: list[int] = []
        for url, task in list(self._held_tasks.items()):
            if not task.done():
                continue
            del self._held_tasks[url]
            exc = task.exception()
            src = self.pool.get(url)
            if src is None:  # no longer an upstream
                continue
            if src.origin:
                self._origins_heard.add(url)
            if isinstance(exc, SourceError):
                self.pool.record_failure(src, exc.reason)
                continue
            if exc is not None:
                raise exc
            for step in task.result()[1]:
                offers.setdefault(step, []).append(url)
            if src.origin and task.result()[1]:
                origin_steps.extend(task.result()[1])
                self._origin_latest = max(self._origin_latest or 0, task.result()[1][-1])
        return offers, origin_steps

    def _ceiling(self, origin_steps: list[int]) -> int | None:
        """The newest step known to exist from signed sources: a coordinator-signed announcement,
        an origin's report, the relay's own verified manifests (``None``: no announcement and no
        origin known, so every offer is tried, within the per-upstream failure budget)."""
        signed = [s for s in (self._latest_signed, self._origin_latest, max(origin_steps, default=None)) if s is not None]
        if not signed:
            return None
        return max([*signed, *self.store.steps()[-1:]])

    def _mark_bad_offer(self, url: str, step: int, reason: str) -> None:
        self._bad_offers[(url, step)] = reason
        self._bad_offers.move_to_end((url, step))
        while len(self._bad_offers) > 4096:
            self._bad_offers.popitem(last=False)

    async def _learn_upstream_steps(self) -> None:
        assert self._session is not None
        cfg = self.config.download
        offers, origin_steps = await self._poll_held()
        ceiling = self._ceiling(origin_steps)
        if ceiling is None and any(s.origin and s.url not in self._origins_heard for s in self.pool.states()):
            # an origin has not answered yet: take only its offers until it did (or failed once)
            origin_urls = {s.url for s in self.pool.origins()}
            offers = {k: [u for u in v if u in origin_urls] for k, v in offers.items()}
            offers = {k: v for k, v in offers.items() if v}
        known = set(self.store.steps())
        floor = self.store.retention_floor()
        wanted = sorted((s for s in offers if s not in known and s > floor and (ceiling is None or s <= ceiling)), reverse=True)
        failures: dict[str, int] = {}
        for step in wanted:
            if sum(1 for k in known if k > step) >= self.store.keep_steps:
                break  # older ones would be pruned at once
            srcs = [s for s in (self.pool.get(u) for u in offers[step]) if s is not None]
            srcs.sort(key=lambda s: (not s.origin, not s.proven))  # origins first, then relays that delivered
            for src in srcs:
                url = src.url
                if (url, step) in self._bad_offers or failures.get(url, 0) >= self.store.keep_steps:
                    continue
                try:
                    env = await get_manifest(
                        self._session, url, step, run_id=self.store.run_id, authorities=self.store.authorities,
                        timeout_s=cfg.manifest_timeout_s, cfg=cfg,
                    )
                except SourceError as e:
                    (self.pool.record_evidence if e.evidence else self.pool.record_failure)(src, e.reason)
                    failures[url] = failures.get(url, 0) + 1
                    if e.evidence:
                        self._mark_bad_offer(url, step, e.reason)
                    continue
                if env is None:  # offered a step it has no manifest of: not asked for it again
                    failures[url] = failures.get(url, 0) + 1
                    self._mark_bad_offer(url, step, "no manifest")
                    self.pool.record_missing(src, f"offered step {step} without a manifest")
                    continue
                # delta first (downstream sees both); asked only of this source and the origins, so
                # silent relays in the pool cannot hold the step's manifest back
                mirror_from = self.pool.view([url, *(o.url for o in self.pool.origins())])
                await mirror_delta(self._session, mirror_from, self.store, env, cfg)
                try:
                    await asyncio.to_thread(self.store.add_manifest, env.raw)
                except ProtocolError as e:  # verified already; only a changed store could refuse
                    logger.warning("store refused manifest of step %d: %s", step, e)
                    continue
                known.add(step)
                break

    async def _sync(self, step: int) -> None:
        """Fill ``step`` from the upstreams (one attempt; the next poll retries a failed one)."""
        assert self._session is not None
        t0 = time.monotonic()
        apply_s: float | None = None
        try:
            if self.pool.urls:  # from the held base step + a small delta when there is one (docs/shardcast.md §9)
                apply_s = await rebuild_from_delta(self._session, self.pool, self.store, step, self.config.download, semaphore=self._sem,
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
                delta = self.store.delta(step)
                nbytes = (delta.body.size_bytes if apply_s is not None and delta is not None
                          else sum(p.size_bytes for p in missing))
                log_held(logger, step, "delta" if apply_s is not None and not missing else "full", nbytes, time.monotonic() - t0,
                         apply_s or 0.0)
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
