"""A node's part in liveness (``docs/gossip.md``, "Liveness"): :class:`Presence`.

Which peers are alive reaches the node's :class:`~node.p2p.peers.PeerTable` three ways besides
records on ``nodes``: over presence streams (a hub hears its attached workers; a worker hears the
live hubs in its hubs' views) and through hubs' rosters (the coordinator and silent observers).
:class:`Presence` runs the side of those protocols the node's role needs (``node.p2p.presence``:
:class:`~node.p2p.presence.PresenceHub`, :class:`~node.p2p.presence.PresenceClient`,
:class:`~node.p2p.presence.RosterFetcher`) and owns everything the node keeps of them:

* who vouches for whom (:class:`~node.p2p.peers.Vouchers`), and a worker's hubs whose stream is open;
* a hub's view: the latest verified record of each live hub, what its workers were last sent, and
  the loop that sends a changed view (half an interval after the change, at most one per interval);
* a worker's last record content (a change is sent to its hubs at once) and the hub records it has
  verified in views (so a view repeating them costs no check);
* counts of what it delivered and of the view records it refused.

The :class:`~node.p2p.service.GossipNode` owns the lifecycle, its own record and publishing; it
calls :meth:`Presence.prepare` / :meth:`Presence.run_trio` from its trio task, :meth:`start` /
:meth:`stop` on asyncio, and the hooks of its heartbeat (:meth:`beat_record`, :meth:`roster`,
:meth:`published`, :meth:`vouch`) and of its ``nodes`` delivery (:meth:`heard_hub`,
:meth:`heard_hub_trio`). Each method says which thread it runs on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import trio

from node.errors import GossipError
from node.p2p.bridge import TrioBridge
from node.p2p.config import GossipConfig
from node.p2p.gossip import EnvelopeValidator, TopicKind, penalty_for
from node.p2p.host import P2PHost
from node.p2p.peers import KEY_CHECKED_ROLES, PeerTable, Vouchers
from node.p2p.presence import PresenceClient, PresenceHub, RosterFetcher, unpack_view
from protocol.content import content_id
from protocol.envelope import Envelope, open_envelope
from protocol.errors import ProtocolError, SchemaError
from protocol.identity import PeerId
from protocol.messages import HUB_ROLES, NodeRecord, Role
from protocol.presence import fit_view, pack_envelopes
from protocol.runspec import RunSpec

logger = logging.getLogger(__name__)

__all__ = ["VIEW_CACHE", "VIEW_SETTLE_INTERVALS", "Presence"]

CALL_TIMEOUT_S = 5.0
"""Limit of one asyncio → trio call (a view handed to the hub, a record to the client), seconds."""
VIEW_SETTLE_INTERVALS = 0.5
"""A hub sends its workers a changed view this many heartbeat intervals after the change, and at most
one per interval: a new policy step changes the coordinator's record and then each relay's, each
change would otherwise cost one frame per attached worker, and the announcement that caused it
should reach them first."""
VIEW_CACHE = 1024
"""Hub records a worker remembers as verified (by envelope ID), so a view repeating them costs no check."""

Deliver = Callable[[TopicKind, Envelope[Any]], None]
"""The node's handlers of a topic kind, called on asyncio with a verified envelope."""


def _view_material(record: NodeRecord) -> tuple[Any, ...]:
    """What of a hub's record its workers need (a change sends them a new view; not ``seq``,
    hardware or the roster digest)."""
    return (record.role, record.http_url, tuple(record.addrs), record.policy_step, tuple(record.held_steps), record.version)


class Presence:
    """A node's side of presence streams, views and rosters (see the module docstring).

    Args:
        spec: the run spec.
        peer_id: this node's peer ID.
        signer: this node's public key (its own records coming back are skipped).
        role: the role it started with (hubs accept presence streams).
        config: gossip settings.
        heartbeat_interval_s: the run's heartbeat interval, seconds.
        peers: the node's peer table (asyncio side), which presence keeps alive.
        envelopes: the node's envelope validator (one dedupe set with the topics).
        deliver: the node's handlers, called with what presence verified (``workers``: a worker's
            record; ``nodes``: a hub's record from a view).
        step_changed: called after a view may have raised the latest coordinator-signed step.

    Attributes:
        is_hub: accepts workers' presence streams and sends them views (coordinator, relay, validator).
        fetch_rosters: fetches hubs' rosters (by default the coordinator and silent observers).
        vouchers: which hubs vouch for which peers (asyncio side).
        delivered: what presence delivered, by kind (asyncio side).
        rejected: view records refused, by reason (``view_…``; trio side).
    """

    def __init__(
        self,
        spec: RunSpec,
        *,
        peer_id: PeerId,
        signer: bytes,
        role: Role,
        config: GossipConfig,
        heartbeat_interval_s: float,
        peers: PeerTable,
        envelopes: EnvelopeValidator,
        deliver: Deliver,
        step_changed: Callable[[], None],
    ) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self.peer_id = peer_id
        self.signer = signer
        self.config = config
        self.interval_s = heartbeat_interval_s
        self.peers = peers
        self.envelopes = envelopes
        self.deliver = deliver
        self.step_changed = step_changed
        self.is_hub = role in HUB_ROLES
        self.is_client = not self.is_hub and config.publish_records
        fetch = config.fetch_rosters
        self.fetch_rosters = fetch if fetch is not None else role == "coordinator" or not config.publish_records
        self.vouchers = Vouchers()
        self.delivered: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self._running = False
        self._bridge: TrioBridge | None = None
        # asyncio side
        self._linked: set[PeerId] = set()  # a worker: hubs whose presence stream is open
        self._hub_envs: dict[PeerId, Envelope[NodeRecord]] = {}  # a hub: latest verified record of each hub
        self._own_sealed = b""  # a hub: its own latest published record
        self._view_key: tuple[Any, ...] | None = None  # a hub: what its workers were last sent
        self._view_wanted = asyncio.Event()
        self._view_task: asyncio.Task[None] | None = None
        self._last_material: tuple[Any, ...] | None = None  # a worker: its record's content last offered
        # trio side
        self.hub: PresenceHub | None = None
        self.client: PresenceClient | None = None
        self.fetcher: RosterFetcher | None = None
        self._view_cache: OrderedDict[bytes, Envelope[NodeRecord]] = OrderedDict()

    # --- lifecycle (trio side) ------------------------------------------------------------------

    def prepare(self, host: P2PHost, bridge: TrioBridge) -> None:
        """Trio side, before ``host`` serves: a hub registers its presence and roster handlers."""
        self._bridge = bridge
        if self.is_hub:
            self.hub = PresenceHub(
                self.run_id, peer_id=self.peer_id, heartbeat_interval_s=self.interval_s,
                check_record=lambda data: self.envelopes.check("workers", data),  # type: ignore[arg-type,return-value]
                on_attach=lambda env: bridge.to_asyncio(self._attached, env),
                on_detach=lambda peer: bridge.to_asyncio(self._detached, peer),
                ban=host.ban, max_attached=self.config.max_peers,
            )
            self.hub.install(host)

    async def run_trio(self, host: P2PHost, nursery: trio.Nursery) -> None:
        """Trio side, once ``host`` serves: start the hub's beat check, the worker's streams and the
        roster fetcher in ``nursery`` (they run until it is cancelled)."""
        bridge = self._bridge
        assert bridge is not None
        if self.hub is not None:
            nursery.start_soon(self.hub.run)
        elif self.is_client:
            self.client = PresenceClient(
                self.run_id, host, heartbeat_interval_s=self.interval_s,
                on_view=lambda hub, payload: self._check_view(hub, payload, host),
                on_detach=lambda hub: bridge.to_asyncio(self._unlinked, hub),
            )
            await nursery.start(self.client.run)
        if self.fetch_rosters:
            self.fetcher = RosterFetcher(
                self.run_id, host, check_entry=self._check_roster_entry, heartbeat_interval_s=self.interval_s,
                deliver=lambda hub, rid, fresh, members: bridge.to_asyncio(self._roster, hub, rid, fresh, members),
            )
            await nursery.start(self.fetcher.run)

    def stats(self) -> dict[str, Any]:
        """Trio side: the hub's or client's counters under ``presence``, the fetcher's under ``rosters``."""
        out: dict[str, Any] = {}
        if self.hub is not None:
            out["presence"] = self.hub.stats()
        if self.client is not None:
            out["presence"] = self.client.stats()
        if self.fetcher is not None:
            out["rosters"] = self.fetcher.stats()
        return out

    # --- lifecycle (asyncio side) ---------------------------------------------------------------

    def start(self) -> None:
        """Asyncio side, once the trio side runs: a hub starts sending views."""
        self._running = True
        if self.hub is not None:
            self._view_task = asyncio.create_task(self._view_loop(), name=f"gossip-views-{self.peer_id[-6:]}")

    def stop(self) -> asyncio.Task[None] | None:
        """Asyncio side: stop delivering; returns the view task, cancelled, for the caller to await."""
        self._running = False
        task, self._view_task = self._view_task, None
        if task is not None:
            task.cancel()
        return task

    @property
    def attached_hubs(self) -> frozenset[PeerId]:
        """A worker: the hubs its presence stream is open to (empty for a hub)."""
        return frozenset(self._linked)

    # --- the node's heartbeat (asyncio side) ----------------------------------------------------

    async def beat_record(self, sealed: bytes, record: NodeRecord) -> None:
        """A worker's heartbeat: hand its freshly sealed ``record`` to its presence streams (sent to
        every hub at once when its content changed, else kept for streams opened from now on).

        Raises:
            TimeoutError, GossipError: the trio side did not take it in time.
        """
        assert self._bridge is not None and self.client is not None
        material = tuple(v for k, v in record.model_dump().items() if k != "seq")
        changed, self._last_material = material != self._last_material, material
        await self._bridge.run_sync(self.client.offer, sealed, changed, timeout_s=CALL_TIMEOUT_S)

    async def roster(self) -> tuple[int, bytes]:
        """A hub's heartbeat: ``(workers attached, roster ID)`` for its record (``(0, b"")``: none).

        Raises:
            TimeoutError, GossipError: the trio side did not answer in time.
        """
        if self.hub is None or self._bridge is None:
            return 0, b""
        return await self._bridge.run_sync(self.hub.roster, timeout_s=CALL_TIMEOUT_S)

    def published(self, sealed: bytes) -> None:
        """A hub published its record ``sealed``: its workers' view may change."""
        if self.hub is not None:
            self._own_sealed = sealed
            self._view_wanted.set()

    def vouch(self) -> None:
        """Each heartbeat: peers a hub vouches for count as heard now — a hub's attached workers,
        a worker's hubs' views, and (coordinator, observers) the rosters of live hubs."""
        if self.is_hub:
            self.peers.touch(self.vouchers.members(self.peer_id))
        for hub in self._linked:
            self.peers.touch(self.vouchers.members(hub))

    # --- hubs' records from nodes ---------------------------------------------------------------

    def heard_hub_trio(self, record: NodeRecord) -> None:
        """Trio side: a hub's verified record on ``nodes`` (the fetcher asks for a roster it names)."""
        if self.fetcher is not None:
            self.fetcher.note_hub(record)

    def heard_hub(self, env: Envelope[NodeRecord]) -> None:
        """Asyncio side: a hub's record from ``nodes``: its roster still vouches for its workers,
        and (a hub) the view this node sends its own workers may have changed."""
        record = env.body
        if self.fetch_rosters:
            self.peers.touch(self.vouchers.members(record.peer_id))
        if self.hub is not None:
            self._hub_envs[record.peer_id] = env
            self._view_wanted.set()

    # --- deliveries from the trio side (asyncio side) -------------------------------------------

    def _attached(self, env: Envelope[NodeRecord]) -> None:
        """A hub: a worker's verified record arrived on its presence stream."""
        if not self._running:
            return
        self.delivered["presence"] += 1
        self.peers.update(env.body, env.ts_ms)
        self.vouchers.add(self.peer_id, env.body.peer_id)
        self.peers.touch([env.body.peer_id])
        self.deliver("workers", env)

    def _detached(self, peer_id: PeerId) -> None:
        """A hub: a worker's presence stream ended."""
        if self._running and self.vouchers.remove(self.peer_id, peer_id):
            self.peers.expire(peer_id)

    def _view(self, hub: PeerId, envs: list[Envelope[NodeRecord]]) -> None:
        """A worker: hub ``hub`` sent the live hubs' verified records."""
        if not self._running:
            return
        self.delivered["views"] += 1
        self._linked.add(hub)
        members: list[PeerId] = []
        for env in envs:
            if env.signer == self.signer:
                continue
            members.append(env.body.peer_id)
            self.peers.update(env.body, env.ts_ms)
            self.deliver("nodes", env)
        for gone in self.vouchers.set(hub, members):
            self.peers.expire(gone)  # no hub lists it any more: it left
        self.peers.touch(members)
        self.step_changed()

    def _unlinked(self, hub: PeerId) -> None:
        """A worker: the presence stream to ``hub`` ended (what it vouched for ages out normally)."""
        self._linked.discard(hub)
        self.vouchers.set(hub, [])

    def _roster(self, hub: PeerId, roster_id: bytes, fresh: list[Envelope[NodeRecord]], members: list[PeerId]) -> None:
        """Coordinator, observers: hub ``hub``'s roster ``roster_id`` was fetched and verified."""
        if not self._running:
            return
        self.delivered["rosters"] += 1
        for env in fresh:
            if env.signer == self.signer:
                continue
            self.peers.update(env.body, env.ts_ms)
            self.deliver("workers", env)
        for gone in self.vouchers.set(hub, members):
            self.peers.expire(gone)  # the hub dropped it and no other hub lists it
        self.peers.touch(members)

    # --- a hub's views (asyncio side) -----------------------------------------------------------

    async def _view_loop(self) -> None:
        """A hub: send attached workers a new view when what they need changed — half an interval
        after the change (the announcement that usually causes it goes out first and alone) and at
        most once per interval — and keep the view new streams get fresh."""
        assert self._bridge is not None and self.hub is not None
        loop = asyncio.get_running_loop()
        interval_s = self.interval_s
        last = -interval_s
        pending_since: float | None = None
        while True:
            await self._view_wanted.wait()
            self._view_wanted.clear()
            if not self._own_sealed:
                continue
            own = open_envelope(self._own_sealed, run_id=self.run_id, expect=NodeRecord)
            # what workers need most first (hub records are self-signed: anyone can add hubs, up to
            # any size): this hub, the key-checked coordinator and validators, then the hubs heard
            # longest; the rest is cut where the frame ends (protocol.presence.fit_view)
            hubs = sorted((p for p in self.peers.alive() if p.peer_id in self._hub_envs),
                          key=lambda p: (p.role not in KEY_CHECKED_ROLES, p.first_seen, p.peer_id))
            live = [own] + [self._hub_envs[p.peer_id] for p in hubs]
            for pid in [p for p in self._hub_envs if p not in self.peers]:
                del self._hub_envs[pid]
            live = live[:len(fit_view([e.raw for e in live]))]
            key = tuple(sorted((e.body.peer_id, _view_material(e.body)) for e in live))
            data = pack_envelopes([e.raw for e in live])
            now = loop.time()
            try:
                if key == self._view_key:  # unchanged: only streams opened from now on get these newer copies
                    pending_since = None
                    await self._bridge.run_sync(self.hub.refresh_view, data, timeout_s=CALL_TIMEOUT_S)
                    continue
                pending_since = now if pending_since is None else pending_since
                due = max(last + interval_s, pending_since + VIEW_SETTLE_INTERVALS * interval_s)
                if now < due:
                    loop.call_later(due - now, self._view_wanted.set)
                    continue
                self._view_key, last, pending_since = key, now, None
                await self._bridge.run_sync(self.hub.set_view, data, timeout_s=CALL_TIMEOUT_S)
            except (TimeoutError, GossipError) as e:
                logger.warning("view not sent: %s", e)

    # --- checks (trio side) ---------------------------------------------------------------------

    def _check_roster_entry(self, data: bytes) -> Envelope[NodeRecord]:
        """A roster entry: a worker's record, signed by it. Entries keep the envelope of a worker's
        last *change*, so no age limit (its hub vouches that it is attached now)."""
        env: Envelope[NodeRecord] = open_envelope(
            data, run_id=self.run_id, authorities=self.spec.authorities, expect=NodeRecord,
            max_bytes=NodeRecord.MAX_BYTES, max_future_s=self.config.max_future_s,
        )
        if env.body.role not in ("worker", "observer"):
            raise SchemaError(f"a {env.body.role} record in a roster", "body.role")
        return env

    def _check_view(self, hub: PeerId, payload: bytes, host: P2PHost) -> bool:
        """A worker: verify a hub's view; hand the valid records to the asyncio side.

        Returns:
            ``False`` when the view is malformed or holds a record that fails for any reason but
            its age (a hub verified every record it lists, so that hub lies); the view is dropped
            at that record, so a lying view costs at most one failed check.
        """
        assert self._bridge is not None
        try:
            raws = unpack_view(payload)
        except ProtocolError as e:
            self.rejected["view_malformed"] += 1
            logger.debug("malformed view from %s: %s", hub, e, extra={"peer_id": hub})
            return False
        envs: list[Envelope[NodeRecord]] = []
        for raw in raws:
            eid = bytes(content_id(raw))
            env = self._view_cache.get(eid)
            if env is None:
                try:
                    env = self.envelopes.check("nodes", raw, remember=False)  # type: ignore[assignment]
                except ProtocolError as e:
                    reason, _ = penalty_for(e)
                    self.rejected[f"view_{reason}"] += 1
                    if reason in ("stale", "duplicate"):  # aged on the way, or seen: skipped, not a lie
                        continue
                    logger.debug("view from %s lists a record that fails: %s", hub, e, extra={"peer_id": hub})
                    return False
                assert env is not None and isinstance(env.body, NodeRecord)
                self._view_cache[eid] = env
                while len(self._view_cache) > VIEW_CACHE:
                    self._view_cache.popitem(last=False)
            if env.signer != self.signer:
                host.note_peer(env.body.peer_id, env.body.addrs)
            envs.append(env)
        self._bridge.to_asyncio(self._view, hub, envs)
        return True
