"""A node's held checkpoints: the one owner of the policy steps a worker or validator holds, on
disk (:class:`PolicyFollower`) and as loaded models (:class:`HeldModels`).

:class:`PolicyFollower` learns new steps from gossip (and polling) and holds fetched checkpoints
in ``root/step-N`` (the files plus ``.shardcast-manifest``, the coordinator-signed manifest
:mod:`node.shardcast.client` writes). It owns, for the node that constructs it:

* **where a step comes from** — the :class:`PolicySources` it is constructed with (relays that
  gossip says hold the step, tree first, then the coordinator's origins);
* **how** — :func:`node.shardcast.delta.fetch_step` from the newest held earlier step, which makes
  the delta-or-full choice (:func:`node.shardcast.delta.full_fetch_reason`); step 0 must be the
  run's pinned base model;
* **how many** — the retention rule :func:`protocol.window.retained_steps` with the run spec's
  ``shardcast.keep_steps`` (the step just fetched is kept even when it is older).

Weights are read from a held directory by :func:`protocol.models.load_model` (validators) or an
engine's ``load_weights`` (workers), both through :func:`protocol.models.iter_weights`, the one
safetensors loader. A relay holds steps as pieces in its :class:`~node.shardcast.ShardcastStore`
(it serves pieces and loads no weights), under the same retention rule.

A fetch is verified piece by piece against the coordinator-signed manifest, so no source needs
to be trusted.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from node.errors import FetchError, NodeError
from node.memory import release_free_memory
from node.shardcast import DownloadConfig
from node.shardcast.client import MANIFEST_FILE_NAME, resolve_manifest
from node.shardcast.delta import fetch_step
from node.shardcast.download import ManifestCache, make_session
from node.shardcast.events import log_held
from node.shardcast.sources import SourcePool
from node.timeouts import FOLLOWER_DEADLINE_S, FOLLOWER_STALL_TIMEOUT_S
from protocol.errors import ProtocolError
from protocol.models import check_base_hash
from protocol.runspec import RunSpec
from protocol.step_dirs import step_dir, step_dirs
from protocol.window import retained_steps

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0
"""How often the latest manifest is polled when gossip announced nothing new, seconds."""
RELAY_WAIT_S = 3.0
"""A fetch the node needs now waits up to this long for a relay to hold the step before loading the
origin (relays exist to spare the origin's upload), seconds."""
PREFETCH_RELAY_WAIT_S = 30.0
"""A prefetch (started at the announcement, nothing waits on it) waits up to this long for a relay,
seconds, and only :data:`RELAY_WAIT_S` once a :meth:`PolicyFollower.fetch` of the step needs it.
A relay holds a step only after fetching it (and applying its delta: 10–12 s at the 0.5B profile),
so prefetches that gave up after 3 s all loaded the origin, which relays are there to spare."""


class PolicySources(Protocol):
    """Where a node's checkpoints come from (:class:`GossipSources` on every node; tests make their own)."""

    def __call__(self, step: int | None) -> list[str]:
        """Base URLs for ``step`` (``None``: the latest announced): relays holding it first, then origins."""
        ...

    def origins(self) -> list[str]:
        """The origin base URLs among them (always asked, on reserved request slots)."""
        ...

    def relays_lagging(self, step: int) -> bool:
        """Relays are known but none holds ``step`` yet (then a fetch waits up to :data:`RELAY_WAIT_S`)."""
        ...


@dataclass
class _StepLock:
    """One step's fetch lock and how many calls use it (dropped at zero, so a lying ingest naming
    ever new steps cannot grow the follower's memory)."""

    lock: asyncio.Lock
    users: int = 0


class PolicyFollower:
    """Knows the newest policy step and holds checkpoints of any step in ``root/step-N``.

    Args:
        spec: the run spec (run ID, coordinator key, ``shardcast.keep_steps``, deltas, base hash).
        root: directory of fetched checkpoints.
        sources: where steps come from (see :class:`PolicySources`).
    """

    def __init__(self, spec: RunSpec, root: Path, sources: PolicySources) -> None:
        self.spec = spec
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.sources = sources
        self.latest_step = -1
        self.last_error = ""
        self._locks: dict[int, _StepLock] = {}
        self._cfg = DownloadConfig(stall_timeout_s=FOLLOWER_STALL_TIMEOUT_S, deadline_s=FOLLOWER_DEADLINE_S)
        self._session: Any = None
        self._manifests = ManifestCache()  # verified manifests are not downloaded/decoded again; liars not re-polled
        self._prefetch: asyncio.Task[None] | None = None
        self._needed: set[int] = set()  # steps a fetch() waits for: a prefetch of one stops waiting for relays

    async def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
            await asyncio.gather(self._prefetch, return_exceptions=True)  # stopping: its outcome no longer matters
            self._prefetch = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def prefetch(self, step: int) -> None:
        """Start fetching ``step`` in the background unless it is held or one prefetch runs already.

        A worker learns of a new step while it generates with the old one, and a validator before
        the first submission of it arrives: fetching at once overlaps the download and delta apply
        with that work (INTELLECT-2's workers do the same), so the step is on disk when it is
        needed. It waits for a relay to hold the step up to :data:`PREFETCH_RELAY_WAIT_S`, where a
        :meth:`fetch` would wait :data:`RELAY_WAIT_S`: nothing waits on it, and every node that loads
        the origin instead costs the origin's upload. :meth:`fetch` of the same step waits for this
        one (one lock per step), and cuts its wait for relays to :data:`RELAY_WAIT_S`. A failure
        is logged; the next :meth:`fetch` tries again.
        """
        if self.have(step) or (self._prefetch is not None and not self._prefetch.done()):
            return

        async def run() -> None:
            try:
                await self._locked_fetch(step, needed=False)
            except (FetchError, NodeError, OSError) as e:
                logger.info("prefetch of policy step %d failed: %s", step, e, extra={"step": step})

        self._prefetch = asyncio.create_task(run(), name=f"prefetch-step-{step}")

    def note_step(self, step: int) -> None:
        """Record that ``step`` was announced (from a verified gossip announcement)."""
        if step > self.latest_step:
            self.latest_step = step
            logger.info("policy step %d announced", step, extra={"step": step})

    async def poll_latest(self) -> int:
        """Ask the sources for their latest signed manifest; returns the newest step known.

        Origins and a bounded random subset of relays are asked at once; a manifest already
        verified is not decoded again, and a source that served a bad one is skipped for a while.
        """
        if self._session is None:
            self._session = make_session(self._cfg)
        pool = SourcePool(self.sources(None), origins=self.sources.origins(), max_candidates=self._cfg.max_candidates)
        try:
            env = await resolve_manifest(self._session, pool, None, run_id=self.spec.run_id, authorities=self.spec.authorities,
                                         cfg=self._cfg, cache=self._manifests)
        except (TimeoutError, NodeError, ProtocolError, OSError) as e:
            logger.debug("latest manifest poll failed: %s", e)
            return self.latest_step
        self.note_step(env.body.step)
        return self.latest_step

    def path_for(self, step: int) -> Path:
        """The directory that holds (or will hold) checkpoint ``step``."""
        return step_dir(self.root, step)

    def have(self, step: int) -> bool:
        """Whether checkpoint ``step`` is held (a completed fetch: config and signed manifest in place)."""
        return (self.path_for(step) / "config.json").exists() and (self.path_for(step) / MANIFEST_FILE_NAME).exists()

    def held_steps(self) -> list[int]:
        """The held steps, ascending."""
        return [s for s in self._step_dirs() if self.have(s)]

    async def fetch(self, step: int) -> Path:
        """The directory of checkpoint ``step``, downloading it first if needed.

        Raises:
            FetchError: no source could provide a verified copy.
        """
        return await self._locked_fetch(step, needed=True)

    async def _locked_fetch(self, step: int, *, needed: bool) -> Path:
        entry = self._locks.setdefault(step, _StepLock(asyncio.Lock()))
        entry.users += 1
        if needed:
            self._needed.add(step)
        try:
            async with entry.lock:
                return await self._fetch(step)
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[step]
                self._needed.discard(step)

    async def _fetch(self, step: int) -> Path:
        out = self.path_for(step)
        if self.have(step):
            return out
        t0 = time.monotonic()
        while self.sources.relays_lagging(step):
            waited = time.monotonic() - t0
            if waited >= PREFETCH_RELAY_WAIT_S or (step in self._needed and waited >= RELAY_WAIT_S):
                break
            await asyncio.sleep(0.1)
        urls = self.sources(step)
        if not urls:
            raise FetchError(f"no source known for policy step {step} yet (no relay or origin in gossip or the run spec)")
        base = max((s for s in self.held_steps() if s < step), default=None)
        t0 = time.monotonic()
        try:
            res = await fetch_step(urls, out, run_id=self.spec.run_id, authorities=self.spec.authorities,
                                   held_dir=self.path_for(base) if base is not None else None, step=step,
                                   max_chain=self.spec.delta_chain_limit, config=self._cfg, origins=self.sources.origins(),
                                   cache=self._manifests)
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
        if res.faulty_sources:
            logger.warning("faulty sources while fetching step %d: %s", step, res.faulty_sources, extra={"step": step})
        if res.via == "delta":
            logger.info("policy step %d from step %d by %d delta(s), %d bytes", step, base, len(res.deltas_applied), res.bytes_downloaded,
                        extra={"step": step})
        else:
            used = sorted(res.full.source_bytes) if res.full is not None else []
            logger.info("fetched policy step %d in %.2f s from %s", step, time.monotonic() - t0, used, extra={"step": step})
        log_held(logger, step, "delta" if res.via == "delta" else "full", res.bytes_downloaded, time.monotonic() - t0, res.apply_s)
        self.note_step(step)
        await asyncio.to_thread(self._prune, step)
        return out

    def _step_dirs(self) -> list[int]:
        """Steps with a ``step-N`` directory under the root (held or not), ascending."""
        return [s for s, _ in step_dirs(self.root)]

    def _prune(self, in_use: int) -> None:
        """Remove step directories the retention rule does not keep (blocking)."""
        steps = self._step_dirs()
        keep = retained_steps(steps, self.spec.shardcast.keep_steps, in_use=in_use)
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.path_for(s), ignore_errors=True)


class HeldModels:
    """The policy models a node holds in memory, loaded from held checkpoints: the one in-memory
    holder beside :class:`PolicyFollower` (which holds their directories).

    Kept by the retention rule (:func:`protocol.window.retained_steps` with ``keep_steps``: the
    newest, plus the step in use) and, of those, only as many as fit ``max_bytes`` of parameters
    (judged by a loaded one; the model in use always): the validator's models (a float32 model of
    the 0.5B shape is ≈ 2 GB) and the coordinator's ban re-check. Models the rule drops are freed
    before the next one is loaded, their heap pages handed back to the kernel
    (:func:`node.memory.release_free_memory`), so no more than that many are ever in memory at once.

    Thread-safe; :meth:`hold` blocks (the caller runs it in a thread).

    Args:
        keep_steps: the newest steps kept (the run spec's ``shardcast.keep_steps``).
        load: loads a model from a checkpoint directory (blocking).
        max_bytes: parameter bytes kept in memory (``None``: no bound but the rule's).
    """

    def __init__(self, keep_steps: int, load: Callable[[Path], Any], *, max_bytes: int | None = None) -> None:
        self.keep_steps = keep_steps
        self.max_bytes = max_bytes
        self._load = load
        self._models: dict[int, Any] = {}
        self._lock = threading.Lock()

    def steps(self) -> list[int]:
        """The steps held, ascending."""
        with self._lock:
            return sorted(self._models)

    def get(self, step: int) -> Any | None:
        """The model of ``step`` if held."""
        with self._lock:
            return self._models.get(step)

    def __contains__(self, step: object) -> bool:
        with self._lock:
            return step in self._models

    def _fitting(self) -> int:
        """How many models fit :attr:`max_bytes` (at least one: the model in use), judged by a held
        one (before any is held, or with no bound: no bound)."""
        if self.max_bytes is None or not self._models:
            return 1 << 20
        size = sum(p.numel() * p.element_size() for p in next(iter(self._models.values())).parameters())
        return max(1, self.max_bytes // max(1, size))

    def hold(self, step: int, path: Path) -> Any:
        """The model of ``step``, loaded from ``path`` unless held (blocking). Before a load, the
        models the retention rule and :attr:`max_bytes` leave out are freed.

        Raises:
            whatever ``load`` raises (nothing is held then).
        """
        with self._lock:
            if step in self._models:
                return self._models[step]
            kept = retained_steps([*self._models, step], self.keep_steps, in_use=step)
            others = sorted((s for s in kept if s != step), reverse=True)[: self._fitting() - 1]
            dropped = [s for s in self._models if s not in others]
            for s in dropped:
                del self._models[s]
        if dropped:  # the dropped models' heap pages back to the kernel, or they sit beside the next one (node/memory.py)
            release_free_memory()
        model = self._load(path)
        with self._lock:
            self._models[step] = model
        return model


class GossipSources:
    """The sources of a node on gossip: relays holding the step, then origins.

    Origins are the coordinator's record ``http_url`` (its role is key-checked), the latest
    coordinator-signed announcement's ``origin_url`` and the run spec's ``origin_urls``; relay
    URLs come from self-signed records anyone can make, so fetches use only a bounded random
    subset of them and keep the origins on reserved slots.

    Args:
        gossip: returns the node's :class:`node.p2p.GossipNode` (``None`` before it started, or
            off gossip: then the run spec's origins only). A role constructs its follower before
            ``start`` joins gossip, so the node is looked up at each call.
        spec: the run spec (its ``network.origin_urls``).
    """

    def __init__(self, gossip: Callable[[], Any], spec: RunSpec) -> None:
        self.gossip = gossip
        self.spec = spec

    def origins(self) -> list[str]:
        """Origin base URLs, deduplicated, without trailing slashes."""
        urls: list[str] = []
        node = self.gossip()
        if node is not None:
            coord = node.peers.coordinator()
            if coord is not None and coord.http_url:
                urls.append(coord.http_url)
            ann = node.peers.latest_announcement
            if ann is not None and ann.origin_url:
                urls.append(ann.origin_url)
        urls.extend(self.spec.network.origin_urls)
        return list(dict.fromkeys(u.rstrip("/") for u in urls if u))

    def __call__(self, step: int | None) -> list[str]:
        """Base URLs for ``step`` (``None``: the latest announced): relays holding it, then origins."""
        urls: list[str] = []
        node = self.gossip()
        if node is not None:
            peers = node.peers
            want = step if step is not None else peers.latest_step()
            if want is not None:
                urls.extend(p.http_url for p in peers.relays_holding(want) if p.http_url)
        urls.extend(self.origins())
        return list(dict.fromkeys(u.rstrip("/") for u in urls if u))

    def relays_lagging(self, step: int) -> bool:
        """Relays are alive on gossip but none announces holding ``step`` yet."""
        node = self.gossip()
        if node is None:
            return False
        peers = node.peers
        return bool(peers.by_role("relay")) and not peers.relays_holding(step)
