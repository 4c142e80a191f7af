"""Following the policy: learn new steps from gossip (and polling), fetch them through Shardcast.

Used by workers (to hot-swap the engine's weights) and validators (to prefill with the exact
checkpoint a submission names). Sources are the relays that gossip says hold the step (tree
first), then the coordinator's origin; a fetch is verified piece by piece against the
coordinator-signed manifest, so no source needs to be trusted.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.errors import FetchError, NodeError
from node.shardcast import DownloadConfig, fetch_checkpoint
from node.shardcast.client import resolve_manifest
from node.shardcast.download import ManifestCache, make_session
from node.shardcast.sources import SourcePool
from protocol.errors import ProtocolError
from protocol.models import check_base_hash
from protocol.runspec import RunSpec

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0
"""How often the latest manifest is polled when gossip announced nothing new, seconds."""
RELAY_WAIT_S = 3.0
"""After an announcement, wait up to this long for a relay to hold the step before loading the
origin (relays exist to spare the origin's upload), seconds."""


class PolicyFollower:
    """Knows the newest policy step and fetches checkpoints of any step into ``root/step-N``.

    Args:
        spec: the run spec (run ID, coordinator key, origin URLs, keep_steps).
        root: directory of fetched checkpoints.
        sources: callable returning candidate base URLs for a step (relays holding it first);
            a :class:`GossipSources` also says which of them are origins (otherwise the run
            spec's ``origin_urls`` are).
        keep: how many fetched steps to keep on disk.
        relays_waiting: callable telling whether relays are known but none holds the step yet
            (then :meth:`fetch` waits up to :data:`RELAY_WAIT_S` for one before using the origin).
    """

    def __init__(
        self,
        spec: RunSpec,
        root: Path,
        sources: Callable[[int | None], list[str]],
        *,
        keep: int | None = None,
        relays_waiting: Callable[[int], bool] | None = None,
    ) -> None:
        self.spec = spec
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.sources = sources
        self.keep = keep or spec.shardcast.keep_steps
        self.latest_step = -1
        self.fetch_seconds: dict[int, float] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        self._cfg = DownloadConfig(stall_timeout_s=30.0, deadline_s=600.0)
        self._session: Any = None
        self._manifests = ManifestCache()  # verified manifests are not downloaded/decoded again; liars not re-polled
        self.last_error = ""
        self.relays_waiting = relays_waiting

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def note_step(self, step: int) -> None:
        """Record that ``step`` was announced (from a verified gossip announcement)."""
        if step > self.latest_step:
            self.latest_step = step
            logger.info("policy step %d announced", step, extra={"step": step})

    def origins(self) -> list[str]:
        """Origin URLs: from gossip (coordinator record, signed announcement) and the run spec."""
        if isinstance(self.sources, GossipSources):
            return self.sources.origins()
        return [u.rstrip("/") for u in self.spec.network.origin_urls]

    async def poll_latest(self) -> int:
        """Ask the sources for their latest signed manifest; returns the newest step known.

        Origins and a bounded random subset of relays are asked at once; a manifest already
        verified is not decoded again, and a source that served a bad one is skipped for a while.
        """
        if self._session is None:
            self._session = make_session(self._cfg)
        pool = SourcePool(self.sources(None), origins=self.origins(), max_candidates=self._cfg.max_candidates)
        try:
            env = await resolve_manifest(self._session, pool, None, run_id=self.spec.run_id, authorities=self.spec.authorities,
                                         cfg=self._cfg, cache=self._manifests)
        except (TimeoutError, NodeError, ProtocolError, OSError) as e:
            logger.debug("latest manifest poll failed: %s", e)
            return self.latest_step
        self.note_step(env.body.step)
        return self.latest_step

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def have(self, step: int) -> bool:
        return (self.path_for(step) / "config.json").exists() and (self.path_for(step) / ".shardcast-manifest").exists()

    async def fetch(self, step: int) -> Path:
        """The directory of checkpoint ``step``, downloading it first if needed.

        Raises:
            FetchError: no source could provide a verified copy.
        """
        lock = self._locks.setdefault(step, asyncio.Lock())
        async with lock:
            out = self.path_for(step)
            if self.have(step):
                return out
            if self.relays_waiting is not None:
                end = time.monotonic() + RELAY_WAIT_S
                while self.relays_waiting(step) and time.monotonic() < end:
                    await asyncio.sleep(0.1)
            sources = self.sources(step)
            if not sources:
                raise FetchError(f"no source known for policy step {step} yet (no relay or origin in gossip or the run spec)")
            t0 = time.monotonic()
            if await self._fetch_by_delta(step, out, sources):
                self.fetch_seconds[step] = time.monotonic() - t0
                self.note_step(step)
                await asyncio.to_thread(self._prune)
                return out
            try:
                result = await fetch_checkpoint(sources, out, run_id=self.spec.run_id, authorities=self.spec.authorities, step=step,
                                                config=self._cfg, progress=False, origins=self.origins(), cache=self._manifests)
            except FetchError as e:
                self.last_error = str(e)
                raise
            if step == 0 and self.spec.model.base_hash:
                try:  # step 0 is the base, file for file: refuse one that is not the pinned base
                    await asyncio.to_thread(check_base_hash, out, self.spec.model.base_hash)
                except ProtocolError as e:
                    shutil.rmtree(out, ignore_errors=True)
                    self.last_error = str(e)
                    raise FetchError(f"policy step 0 is not the run's base model: {e}") from None
            self.fetch_seconds[step] = time.monotonic() - t0
            if result.faulty_sources:
                logger.warning("faulty sources while fetching step %d: %s", step, result.faulty_sources, extra={"step": step})
            logger.info("fetched policy step %d in %.2f s from %s", step, self.fetch_seconds[step], sorted(result.source_bytes),
                        extra={"step": step})
            self.note_step(step)
            await asyncio.to_thread(self._prune)
            return out

    async def _fetch_by_delta(self, step: int, out: Path, sources: list[str]) -> bool:
        """Reach ``step`` through signed deltas from the newest held earlier step (docs/shardcast.md §9).

        Returns:
            Whether ``out`` now holds the verified step; ``False``: fetch it in full (no held
            step, deltas off, or the delta path refused — the reason is logged).
        """
        held = [s for s in self._held_steps() if s < step]
        if step == 0 or not held or not self.spec.publishes_deltas:
            return False
        from node.shardcast.delta import fetch_step

        try:
            res = await fetch_step(sources, out, run_id=self.spec.run_id, authorities=self.spec.authorities, held_dir=self.path_for(held[-1]),
                                   step=step, max_chain=self.spec.shardcast.max_delta_chain, config=self._cfg, full_fallback=False,
                                   origins=self.origins(), cache=self._manifests)
        except NodeError as e:
            logger.info("step %d not reachable by deltas from step %d (%s); fetching it in full", step, held[-1], e, extra={"step": step})
            return False
        if res.faulty_sources:
            logger.warning("faulty sources while fetching deltas to step %d: %s", step, res.faulty_sources, extra={"step": step})
        logger.info("policy step %d from step %d by %d delta(s), %d bytes", step, held[-1], len(res.deltas_applied), res.bytes_downloaded,
                    extra={"step": step})
        return True

    def _held_steps(self) -> list[int]:
        steps = sorted(int(p.name.split("-", 1)[1]) for p in self.root.glob("step-*") if p.name.split("-", 1)[1].isdigit())
        return [s for s in steps if self.have(s)]

    def _prune(self) -> None:
        steps = sorted(int(p.name.split("-", 1)[1]) for p in self.root.glob("step-*") if p.name.split("-", 1)[1].isdigit())
        for s in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(self.path_for(s), ignore_errors=True)


def relays_lagging(gossip: Any) -> Callable[[int], bool]:
    """For :class:`PolicyFollower`: relays are alive on gossip but none announces holding ``step`` yet."""

    def waiting(step: int) -> bool:
        if gossip is None:
            return False
        peers = gossip.peers
        return bool(peers.by_role("relay")) and not peers.relays_holding(step)

    return waiting


class GossipSources:
    """Source chooser over a :class:`node.p2p.GossipNode`: relays holding the step, then origins.

    Origins are the coordinator's record ``http_url`` (its role is key-checked), the latest
    coordinator-signed announcement's ``origin_url`` and the run spec's ``origin_urls``; relay
    URLs come from self-signed records anyone can make, so fetches use only a bounded random
    subset of them and keep the origins on reserved slots.
    """

    def __init__(self, gossip: Any, spec: RunSpec) -> None:
        self.gossip = gossip
        self.spec = spec

    def origins(self) -> list[str]:
        """Origin base URLs, deduplicated, without trailing slashes."""
        urls: list[str] = []
        if self.gossip is not None:
            coord = self.gossip.peers.coordinator()
            if coord is not None and coord.http_url:
                urls.append(coord.http_url)
            ann = self.gossip.peers.latest_announcement
            if ann is not None and ann.origin_url:
                urls.append(ann.origin_url)
        urls.extend(self.spec.network.origin_urls)
        return list(dict.fromkeys(u.rstrip("/") for u in urls if u))

    def __call__(self, step: int | None) -> list[str]:
        """Base URLs for ``step`` (``None``: the latest announced): relays holding it, then origins."""
        urls: list[str] = []
        if self.gossip is not None:
            peers = self.gossip.peers
            want = step if step is not None else peers.latest_step()
            if want is not None:
                urls.extend(p.http_url for p in peers.relays_holding(want) if p.http_url)
        urls.extend(self.origins())
        return list(dict.fromkeys(u.rstrip("/") for u in urls if u))


def gossip_sources(gossip: Any, spec: RunSpec) -> GossipSources:
    """Source chooser over a :class:`node.p2p.GossipNode` (see :class:`GossipSources`)."""
    return GossipSources(gossip, spec)
