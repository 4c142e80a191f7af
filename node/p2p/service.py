"""``GossipNode``: the one object a role uses to be on the run's gossip network.

It owns (or shares) a trio bridge, runs a :class:`~node.p2p.host.P2PHost` on it, subscribes the
run's topics its role needs (:func:`~node.p2p.gossip.subscribed_kinds`) with an
:class:`~node.p2p.gossip.EnvelopeValidator` as the libp2p topic validator (so nothing invalid is
delivered or forwarded), keeps the :class:`~node.p2p.peers.PeerTable` up to date and calls the
role's handlers on the asyncio loop. Its signed :class:`~protocol.messages.NodeRecord` goes out
every heartbeat interval, by role (``docs/gossip.md``):

* a *hub* (coordinator, relay, validator) publishes it on the ``nodes`` topic, with its roster
  digest (workers attached, roster ID); it accepts workers' presence streams, holds their records
  (its roster) and sends each worker a view of the live hubs when that changes;
* a *worker* sends it only to the hubs it is connected to, over a presence stream
  (:mod:`node.p2p.presence`), when it changes, and a beat every few intervals; it learns the
  hubs from their views;
* the coordinator and silent observers (``node status``) fetch hubs' rosters when their IDs
  change, so their tables list every live worker.

Typical use::

    node = await GossipNode.create(spec, key, GossipConfig(bootstrap=[...]), role="relay", http_url=url)
    node.on_announcement(relay.handle_announcement)      # called with a verified Envelope
    node.set_record(held_steps=[3, 4])                   # carried by the next heartbeat (sent at once)
    ...
    await node.stop()
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.subscription import TrioSubscriptionAPI

from node import __version__
from node.errors import GossipError, PublishError
from node.p2p.bridge import TrioBridge, TrioTaskHandle, make_bridge
from node.p2p.config import GossipConfig
from node.p2p.gossip import (
    TOPIC_KINDS,
    EnvelopeValidator,
    OverRate,
    PeerScores,
    TopicKind,
    penalty_for,
    record_kind,
    subscribed_kinds,
    topic_names,
)
from node.p2p.host import P2PHost
from node.p2p.peers import KEY_CHECKED_ROLES, PeerTable, Vouchers
from node.p2p.presence import PresenceClient, PresenceHub, RosterFetcher, unpack_view
from protocol.content import content_id
from protocol.envelope import Envelope, open_envelope, seal
from protocol.errors import DecodeError, ProtocolError, SchemaError
from protocol.identity import NodeKey, PeerId
from protocol.messages import HUB_ROLES, CheckpointAnnouncement, Hardware, Message, NodeRecord, Role
from protocol.presence import fit_view, pack_envelopes
from protocol.ratelimit import RateLimiter
from protocol.runspec import RunSpec

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

Handler = Callable[[Envelope[Any]], None | Awaitable[None]]
"""Called on the asyncio loop with each verified envelope of a topic; may be a coroutine function."""
StepHandler = Callable[[int], None]
"""Called on the asyncio loop with the new latest coordinator-signed checkpoint step."""

CALL_TIMEOUT_S = 5.0
"""Limit of one asyncio → trio call (publish, stats), seconds."""
ACCEPTED_CACHE = 4096
"""Envelopes verified by the topic validator kept for delivery (entries), so each is decoded once."""
MIN_BEAT_GAP_S = 0.05
"""Shortest gap between two records triggered by :meth:`GossipNode.set_record`, seconds."""
VIEW_SETTLE_INTERVALS = 0.5
"""A hub sends its workers a changed view this many heartbeat intervals after the change, and at most
one per interval: a new policy step changes the coordinator's record and then each relay's, each
change would otherwise cost one frame per attached worker, and the announcement that caused it
should reach them first."""
VIEW_CACHE = 1024
"""Hub records a worker remembers as verified (by envelope ID), so a view repeating them costs no check."""
_NOT_IN_VIEW = frozenset({"seq", "hardware", "workers", "roster"})
"""Record fields whose change alone does not make a hub send its workers a new view."""


def _view_material(record: NodeRecord) -> tuple[Any, ...]:
    """What of a hub's record its workers need (a change sends them a new view)."""
    return (record.role, record.http_url, tuple(record.addrs), record.policy_step, tuple(record.held_steps), record.version)


def _unwrap(error: BaseException) -> BaseException:
    """The single exception inside (nested) trio exception groups, or ``error`` itself."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def local_hardware() -> Hardware:
    """What this machine reports in its node record (CPU count and physical memory)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return Hardware(cpu_count=os.cpu_count() or 0, memory_bytes=max(0, memory))


class GossipNode:
    """A node's presence on the run's gossip network (see the module docstring).

    Attributes:
        spec: the run spec.
        key: the node key (libp2p identity and record signer).
        config: host and gossip settings.
        peer_id: this node's peer ID.
        topics: gossipsub topic names by kind.
        peers: the live peer table (read it on the asyncio loop).
        heartbeat_interval_s: seconds between two node records.

    Args:
        spec: the run spec.
        key: the node key.
        config: host and gossip settings (default: :class:`GossipConfig` defaults).
        role: the role announced in node records.
        http_url: this node's HTTP endpoint, announced in node records (``""``: none).
        bridge: a started trio bridge to share (default: the node starts and owns one).
    """

    spec: RunSpec
    key: NodeKey
    config: GossipConfig
    peer_id: PeerId
    topics: dict[TopicKind, str]
    peers: PeerTable
    heartbeat_interval_s: float

    def __init__(
        self,
        spec: RunSpec,
        key: NodeKey,
        config: GossipConfig | None = None,
        *,
        role: Role = "observer",
        http_url: str = "",
        bridge: TrioBridge | None = None,
    ) -> None:
        self.spec = spec
        self.key = key
        self.config = config or GossipConfig()
        self.peer_id = key.peer_id
        self.run_id = spec.run_id
        self.topics = topic_names(self.run_id)
        self.heartbeat_interval_s = self.config.heartbeat_interval_s or spec.network.heartbeat_interval_s
        self.peers = PeerTable(
            self.heartbeat_interval_s, missed_heartbeats=self.config.missed_heartbeats, coordinator=spec.run.coordinator
        )
        max_age_s = self.config.missed_heartbeats * self.heartbeat_interval_s + self.config.freshness_slack_s
        self.presence = self.config.presence
        self.is_hub = role in HUB_ROLES
        self._validator = EnvelopeValidator(
            self.run_id, spec.authorities, max_age_s=max_age_s, max_future_s=self.config.max_future_s,
            split_records=self.config.split_records or self.presence,
        )
        self._scores = PeerScores(self.config.penalty_limit, self.config.penalty_half_life_s)
        self._record: dict[str, Any] = {
            "role": role,
            "http_url": http_url,
            "policy_step": -1,
            "held_steps": [],
            "hardware": local_hardware(),
        }
        self._seq = 0
        self._handlers: dict[TopicKind, list[Handler]] = {kind: [] for kind in TOPIC_KINDS}
        self._step_handlers: list[StepHandler] = []
        self._latest_step: int | None = None
        # fixed at start: who needs whose records (node.p2p.gossip.subscribed_kinds)
        self.subscribed: tuple[TopicKind, ...] = subscribed_kinds(
            role, split=self.config.split_records, publishes_records=self.config.publish_records, presence=self.presence
        )
        # presence (docs/gossip.md): who vouches for whom, hubs' views and rosters
        fetch = self.config.fetch_rosters
        self.fetch_rosters = self.presence and (fetch if fetch is not None else role == "coordinator" or not self.config.publish_records)
        self._vouchers = Vouchers()
        self._linked: set[PeerId] = set()  # worker: hubs whose presence stream is open (asyncio side)
        self._hub_envs: dict[PeerId, Envelope[NodeRecord]] = {}  # hub: latest verified record of each hub (asyncio side)
        self._view_key: tuple[Any, ...] | None = None
        self._view_wanted = asyncio.Event()
        self._view_task: asyncio.Task[None] | None = None
        self._last_sealed = b""
        self._last_material: tuple[Any, ...] | None = None
        self._presence_hub: PresenceHub | None = None  # trio side
        self._presence_client: PresenceClient | None = None  # trio side
        self._fetcher: RosterFetcher | None = None  # trio side
        self._view_cache: OrderedDict[bytes, Envelope[Message]] = OrderedDict()  # trio side
        # trio side: each forwarder's budgets of node records (the least recently heard forgotten past
        # 4 × max_peers): one for records it published itself, one for records it relayed, so records
        # minted behind an honest hub cannot spend the budget its own heartbeat record needs
        per_interval = float(self.config.max_records_per_interval)
        self._own_budget = RateLimiter(per_interval / self.heartbeat_interval_s, per_interval, max_peers=4 * self.config.max_peers)
        self._forward_budget = RateLimiter(per_interval / self.heartbeat_interval_s, per_interval, max_peers=4 * self.config.max_peers)
        self._bridge = bridge
        self._owns_bridge = bridge is None
        self._host: P2PHost | None = None
        self._trio_task: TrioTaskHandle | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._beat_now = asyncio.Event()
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._accepted: OrderedDict[bytes, Envelope[Message]] = OrderedDict()  # trio side only
        self._rejected: Counter[str] = Counter()  # trio side only
        self._delivered: Counter[str] = Counter()
        self._addrs: list[str] = []
        self._running = False
        self._export_stats = False
        self._stats_snapshot: dict[str, Any] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        spec: RunSpec,
        key: NodeKey,
        config: GossipConfig | None = None,
        *,
        role: Role = "observer",
        http_url: str = "",
        bridge: TrioBridge | None = None,
    ) -> GossipNode:
        """Construct and :meth:`start` a node (arguments as for the class)."""
        node = cls(spec, key, config, role=role, http_url=http_url, bridge=bridge)
        await node.start()
        return node

    async def start(self) -> None:
        """Start the bridge (if owned) and the libp2p host, subscribe the topics, begin heartbeats.

        Returns once the host listens; bootstrap dialing continues in the background (forever,
        with backoff) and never makes start fail.

        Raises:
            GossipError: the host could not start (e.g. port in use) within ``start_timeout_s``.
        """
        if self._running:
            raise GossipError("GossipNode already started")
        if self._bridge is None:
            self._bridge = make_bridge(self.config.bridge)
        if self._owns_bridge:
            await self._bridge.start()
        try:
            self._trio_task = await self._bridge.start_task(self._trio_main, timeout_s=self.config.start_timeout_s)
        except BaseException as e:
            if self._owns_bridge:
                await self._bridge.stop(self.config.stop_timeout_s)
            cause = _unwrap(e)
            if isinstance(cause, TimeoutError):
                raise GossipError(f"libp2p host did not start within {self.config.start_timeout_s} s") from None
            if isinstance(cause, GossipError):
                raise cause from None
            if isinstance(cause, OSError):
                raise GossipError(f"libp2p host did not start: {cause}") from cause
            raise
        self._addrs = list(self._trio_task.value)
        self._running = True
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name=f"gossip-heartbeat-{self.peer_id[-6:]}")
        if self._presence_hub is not None:
            self._view_task = asyncio.create_task(self._view_loop(), name=f"gossip-views-{self.peer_id[-6:]}")
        logger.info(
            "gossip node %s (%s) listening on %s", self.peer_id, self._record["role"], ", ".join(self._addrs),
            extra={"peer_id": self.peer_id},
        )

    async def stop(self) -> None:
        """Stop heartbeats, handlers and the host, then the bridge if owned. Idempotent; bounded by
        ``stop_timeout_s`` seconds per stage, never raises on a slow stop."""
        if not self._running:
            return
        self._running = False
        tasks = [t for t in (self._heartbeat, self._view_task, *self._handler_tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=self.config.stop_timeout_s) if tasks else None
        if self._trio_task is not None:
            try:
                await self._trio_task.cancel(self.config.stop_timeout_s)
            except GossipError as e:
                logger.warning("libp2p host stop: %s", e)
        if self._owns_bridge and self._bridge is not None:
            await self._bridge.stop(self.config.stop_timeout_s)
        logger.info("gossip node %s stopped", self.peer_id, extra={"peer_id": self.peer_id})

    async def __aenter__(self) -> Self:
        if not self._running:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        """Whether the node is started and not stopped."""
        return self._running

    @property
    def addrs(self) -> list[str]:
        """Multiaddrs this node can be dialed at (``…/p2p/<peer ID>``); the first is a bootstrap address."""
        return list(self._addrs)

    @property
    def attached_hubs(self) -> frozenset[PeerId]:
        """A worker: the hubs its presence stream is open to (empty for a hub or in the older layouts)."""
        return frozenset(self._linked)

    # --- what we say -------------------------------------------------------------------------

    def set_record(
        self,
        *,
        role: Role | None = None,
        http_url: str | None = None,
        policy_step: int | None = None,
        held_steps: Sequence[int] | None = None,
        hardware: Hardware | None = None,
    ) -> None:
        """Change what this node's heartbeat says; a record with the change is published at once.

        Args:
            role: the announced role (its records then go on that role's topic; the topics this
                node *reads* stay those of the role it started with).
            http_url: the node's HTTP endpoint (``""``: none).
            policy_step: the policy step it works with (−1: none).
            held_steps: checkpoint steps it serves (relays; at most 64).
            hardware: machine summary.
        """
        updates = {"role": role, "http_url": http_url, "policy_step": policy_step, "hardware": hardware}
        self._record.update({k: v for k, v in updates.items() if v is not None})
        if held_steps is not None:
            self._record["held_steps"] = sorted({int(s) for s in held_steps})[-64:]
        self._beat_now.set()

    def make_record(self, *, workers: int = 0, roster: bytes = b"") -> NodeRecord:
        """The node record the next heartbeat would publish (without advancing ``seq``).

        Args:
            workers: a hub's attached workers (its roster digest, with ``roster``).
            roster: the content ID of the hub's roster (``b""``: no workers).
        """
        return NodeRecord(
            peer_id=self.peer_id,
            role=self._record["role"],
            seq=self._seq,
            addrs=self._addrs[:16],
            http_url=self._record["http_url"],
            version=__version__,
            policy_step=self._record["policy_step"],
            held_steps=self._record["held_steps"],
            hardware=self._record["hardware"],
            workers=workers if self._record["role"] in HUB_ROLES else 0,
            roster=roster if self._record["role"] in HUB_ROLES else b"",
        )

    async def publish(self, kind: TopicKind, envelope: bytes) -> None:
        """Publish a sealed envelope on the ``kind`` topic after checking it as receivers will.

        Raises:
            PublishError: not running, or the envelope would be rejected (reason
                ``"oversized"``, ``"duplicate"``, ``"bad_signer"``, …).
        """
        if not self._running or self._bridge is None:
            raise PublishError(self.topics[kind], "not_running", "the gossip node is not running")
        try:
            await self._bridge.run(self._trio_publish, kind, envelope, timeout_s=CALL_TIMEOUT_S)
        except TimeoutError:
            raise PublishError(self.topics[kind], "timeout", f"publish did not complete within {CALL_TIMEOUT_S} s") from None

    async def publish_announcement(self, envelope: bytes) -> None:
        """Publish a coordinator-sealed ``CheckpointAnnouncement`` envelope (see :meth:`publish`)."""
        await self.publish("checkpoints", envelope)

    async def publish_verdict(self, envelope: bytes) -> None:
        """Publish a validator-sealed ``Verdict`` envelope (see :meth:`publish`)."""
        await self.publish("verdicts", envelope)

    async def publish_ban_list(self, envelope: bytes) -> None:
        """Publish a coordinator-sealed ``BanList`` envelope (see :meth:`publish`)."""
        await self.publish("bans", envelope)

    def seal(self, body: Message) -> bytes:
        """Seal ``body`` with this node's key for this run (a convenience for :meth:`publish`)."""
        return seal(self.key, self.run_id, body)

    # --- what we hear ------------------------------------------------------------------------

    def on_record(self, handler: Handler) -> None:
        """Call ``handler(envelope)`` for each verified :class:`NodeRecord` of another node (of
        the topics this node reads: a worker hears infrastructure records only)."""
        self._handlers["nodes"].append(handler)
        self._handlers["workers"].append(handler)

    def on_latest_step(self, handler: StepHandler) -> None:
        """Call ``handler(step)`` each time the latest coordinator-signed checkpoint step rises.

        Two signed sources raise it: a checkpoint announcement, and the coordinator's own node
        record (``policy_step``, republished every heartbeat interval). So a node that missed
        an announcement still learns its step within one heartbeat interval of the record that
        follows it (``docs/gossip.md``, lost announcements).
        """
        self._step_handlers.append(handler)

    def on_announcement(self, handler: Handler) -> None:
        """Call ``handler(envelope)`` for each verified :class:`CheckpointAnnouncement`."""
        self._handlers["checkpoints"].append(handler)

    def on_verdict(self, handler: Handler) -> None:
        """Call ``handler(envelope)`` for each verified ``Verdict``."""
        self._handlers["verdicts"].append(handler)

    def on_ban_list(self, handler: Handler) -> None:
        """Call ``handler(envelope)`` for each verified ``BanList``."""
        self._handlers["bans"].append(handler)

    async def stats(self) -> dict[str, Any]:
        """Counters: connections, mesh sizes, bans, delivered and rejected messages by reason.

        Raises:
            GossipError: not running.
        """
        if not self._running or self._bridge is None or self._host is None:
            raise GossipError("the gossip node is not running")
        host = self._host

        def snapshot() -> dict[str, Any]:
            out = {**host.stats(), "rejected": dict(self._rejected)}
            if self._presence_hub is not None:
                out["presence"] = self._presence_hub.stats()
            if self._presence_client is not None:
                out["presence"] = self._presence_client.stats()
            if self._fetcher is not None:
                out["rosters"] = self._fetcher.stats()
            return out

        out = await self._bridge.run_sync(snapshot, timeout_s=CALL_TIMEOUT_S)
        out["delivered"] = dict(self._delivered)
        out["peers_alive"] = len(self.peers)
        return out

    def track_stats(self) -> None:
        """Refresh :attr:`last_stats` every heartbeat interval from now on (off by default: a
        simulated worker in a benchmark should not pay for it)."""
        self._export_stats = True

    @property
    def last_stats(self) -> dict[str, Any]:
        """The :meth:`stats` of the last heartbeat interval (empty until :meth:`track_stats` and
        one interval), readable from any code on the asyncio thread without awaiting."""
        return self._stats_snapshot

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Export this node's counters to ``registry`` as ``intellect_gossip_*`` metrics
        (:class:`~node.p2p.metrics.GossipCollector`: send-queue and delivery drops, rejected
        messages, bans, connections, live peers, attached workers), refreshed every heartbeat interval."""
        from node.p2p.metrics import GossipCollector

        self.track_stats()
        registry.register(GossipCollector(lambda: self._stats_snapshot))

    # --- asyncio side ------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            self._beat_now.clear()
            if self.config.publish_records:
                await self._beat()
            self._vouch()
            self.peers.prune()
            if self._export_stats:
                try:
                    self._stats_snapshot = await self.stats()
                except (TimeoutError, GossipError) as e:
                    logger.debug("gossip stats not refreshed: %s", e)
            remaining = self.heartbeat_interval_s - (loop.time() - started)
            try:
                await asyncio.wait_for(self._beat_now.wait(), max(0.0, remaining))
                await asyncio.sleep(MIN_BEAT_GAP_S)
            except TimeoutError:
                pass

    async def _beat(self) -> None:
        self._seq += 1
        assert self._bridge is not None
        try:
            if self._presence_client is not None:  # a worker: its record goes to its hubs only
                record = self.make_record()
                material = tuple(v for k, v in record.model_dump().items() if k != "seq")
                changed, self._last_material = material != self._last_material, material
                await self._bridge.run_sync(self._presence_client.offer, self.seal(record), changed, timeout_s=CALL_TIMEOUT_S)
                return
            workers, roster = (0, b"")
            if self._presence_hub is not None:
                workers, roster = await self._bridge.run_sync(self._presence_hub.roster, timeout_s=CALL_TIMEOUT_S)
            data = self.seal(self.make_record(workers=workers, roster=roster))
            await self.publish(record_kind(self._record["role"], split=self.config.split_records or self.presence), data)
            self._last_sealed = data
            if self._presence_hub is not None:
                self._view_wanted.set()
        except PublishError as e:
            logger.warning("heartbeat not published: %s", e)
        except (TimeoutError, GossipError) as e:
            logger.warning("heartbeat not sent: %s", e)

    def _vouch(self) -> None:
        """Peers vouched for by a hub count as heard now: a worker's attached hubs (their views),
        a hub's attached workers, and (coordinator, observers) the rosters of live hubs."""
        if not self.presence:
            return
        if self.is_hub:
            self.peers.touch(self._vouchers.members(self.peer_id))
        for hub in self._linked:
            self.peers.touch(self._vouchers.members(hub))

    def _deliver(self, kind: TopicKind, env: Envelope[Any]) -> None:
        """Runs on the asyncio loop for each verified message of another node."""
        if not self._running:
            return
        self._delivered[kind] += 1
        if isinstance(env.body, NodeRecord):
            if self.peers.update(env.body, env.ts_ms):
                logger.debug("peer %s (%s) is alive", env.body.peer_id, env.body.role, extra={"peer_id": env.body.peer_id})
            if self.presence and kind == "nodes":
                self._note_hub(env)
        elif isinstance(env.body, CheckpointAnnouncement) and self.peers.note_announcement(env.body):
            logger.info("checkpoint step %d announced", env.body.step, extra={"step": env.body.step})
        self._call_handlers(kind, env)
        self._check_latest_step()

    def _call_handlers(self, kind: TopicKind, env: Envelope[Any]) -> None:
        for handler in self._handlers[kind]:
            try:
                result = handler(env)
            except Exception:
                logger.exception("%s handler %r failed", kind, handler)
                continue
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._handler_tasks.add(task)
                task.add_done_callback(self._handler_done)

    def _note_hub(self, env: Envelope[NodeRecord]) -> None:
        """A hub's record from ``nodes``: its roster still vouches for its workers, and (a hub) the
        view this node sends its own workers may have changed."""
        record = env.body
        if self.fetch_rosters:
            self.peers.touch(self._vouchers.members(record.peer_id))
        if self._presence_hub is not None:
            self._hub_envs[record.peer_id] = env
            self._view_wanted.set()

    def _deliver_attached(self, env: Envelope[NodeRecord]) -> None:
        """A hub: a worker's verified record arrived on its presence stream."""
        if not self._running:
            return
        self._delivered["presence"] += 1
        self.peers.update(env.body, env.ts_ms)
        self._vouchers.add(self.peer_id, env.body.peer_id)
        self.peers.touch([env.body.peer_id])
        self._call_handlers("workers", env)

    def _deliver_detached(self, peer_id: PeerId) -> None:
        """A hub: a worker's presence stream ended."""
        if self._running and self._vouchers.remove(self.peer_id, peer_id):
            self.peers.expire(peer_id)

    def _deliver_view(self, hub: PeerId, envs: list[Envelope[NodeRecord]]) -> None:
        """A worker: hub ``hub`` sent the live hubs' verified records."""
        if not self._running:
            return
        self._delivered["views"] += 1
        self._linked.add(hub)
        members: list[PeerId] = []
        for env in envs:
            if env.signer == self.key.public_key:
                continue
            members.append(env.body.peer_id)
            self.peers.update(env.body, env.ts_ms)
            self._call_handlers("nodes", env)
        for gone in self._vouchers.set(hub, members):
            self.peers.expire(gone)  # no hub lists it any more: it left
        self.peers.touch(members)
        self._check_latest_step()

    def _deliver_unlinked(self, hub: PeerId) -> None:
        """A worker: the presence stream to ``hub`` ended (what it vouched for ages out normally)."""
        self._linked.discard(hub)
        self._vouchers.set(hub, [])

    def _deliver_roster(self, hub: PeerId, roster_id: bytes, fresh: list[Envelope[NodeRecord]], members: list[PeerId]) -> None:
        """Coordinator, observers: hub ``hub``'s roster ``roster_id`` was fetched and verified."""
        if not self._running:
            return
        self._delivered["rosters"] += 1
        for env in fresh:
            if env.signer == self.key.public_key:
                continue
            self.peers.update(env.body, env.ts_ms)
            self._call_handlers("workers", env)
        for gone in self._vouchers.set(hub, members):
            self.peers.expire(gone)  # the hub dropped it and no other hub lists it
        self.peers.touch(members)

    async def _view_loop(self) -> None:
        """A hub: send attached workers a new view when what they need changed — half an interval
        after the change (the announcement that usually causes it goes out first and alone) and at
        most once per interval — and keep the view new streams get fresh."""
        assert self._bridge is not None and self._presence_hub is not None
        loop = asyncio.get_running_loop()
        interval_s = self.heartbeat_interval_s
        last = -interval_s
        pending_since: float | None = None
        while True:
            await self._view_wanted.wait()
            self._view_wanted.clear()
            if not self._last_sealed:
                continue
            own = open_envelope(self._last_sealed, run_id=self.run_id, expect=NodeRecord)
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
                    await self._bridge.run_sync(self._presence_hub.refresh_view, data, timeout_s=CALL_TIMEOUT_S)
                    continue
                pending_since = now if pending_since is None else pending_since
                due = max(last + interval_s, pending_since + VIEW_SETTLE_INTERVALS * interval_s)
                if now < due:
                    loop.call_later(due - now, self._view_wanted.set)
                    continue
                self._view_key, last, pending_since = key, now, None
                await self._bridge.run_sync(self._presence_hub.set_view, data, timeout_s=CALL_TIMEOUT_S)
            except (TimeoutError, GossipError) as e:
                logger.warning("view not sent: %s", e)

    def _check_latest_step(self) -> None:
        step = self.peers.latest_step()
        if step is None or (self._latest_step is not None and step <= self._latest_step):
            return
        self._latest_step = step
        for handler in self._step_handlers:
            try:
                handler(step)
            except Exception:
                logger.exception("latest-step handler %r failed", handler)

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self._handler_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("gossip handler failed", exc_info=task.exception())

    # --- trio side ---------------------------------------------------------------------------

    async def _trio_main(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        assert self._bridge is not None
        bridge = self._bridge
        host = P2PHost(self.key, self.config, hub=self.is_hub, keepalive_s=self.heartbeat_interval_s)
        self._host = host
        if self.presence and self.is_hub:
            self._presence_hub = PresenceHub(
                self.run_id, peer_id=self.peer_id, heartbeat_interval_s=self.heartbeat_interval_s,
                check_record=lambda data: self._validator.check("workers", data),  # type: ignore[arg-type,return-value]
                on_attach=lambda env: bridge.to_asyncio(self._deliver_attached, env),
                on_detach=lambda peer: bridge.to_asyncio(self._deliver_detached, peer),
                ban=host.ban, max_attached=self.config.max_peers,
            )
            self._presence_hub.install(host)
        async with trio.open_nursery() as nursery:
            addrs = await nursery.start(host.serve)
            for kind in self.subscribed:
                sub = await host.subscribe(self.topics[kind], self._make_validator(kind, host))
                nursery.start_soon(self._read_topic, kind, sub, host)
            if self._presence_hub is not None:
                nursery.start_soon(self._presence_hub.run)
            elif self.presence and self.config.publish_records:
                self._presence_client = PresenceClient(
                    self.run_id, host, heartbeat_interval_s=self.heartbeat_interval_s,
                    on_view=lambda hub, payload: self._on_view(hub, payload, host),
                    on_detach=lambda hub: bridge.to_asyncio(self._deliver_unlinked, hub),
                )
                await nursery.start(self._presence_client.run)
            if self.fetch_rosters:
                self._fetcher = RosterFetcher(
                    self.run_id, host, check_entry=self._check_roster_entry, heartbeat_interval_s=self.heartbeat_interval_s,
                    deliver=lambda hub, rid, fresh, members: bridge.to_asyncio(self._deliver_roster, hub, rid, fresh, members),
                )
                await nursery.start(self._fetcher.run)
            bootstrap = list(dict.fromkeys([*self.config.bootstrap, *self.spec.network.bootstrap]))
            if bootstrap:
                nursery.start_soon(host.keep_connected, bootstrap)
            task_status.started(addrs)

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

    def _on_view(self, hub: PeerId, payload: bytes, host: P2PHost) -> bool:
        """A worker (trio side): verify a hub's view; hand the valid records to the asyncio side.

        Returns:
            ``False`` when the view is malformed or holds a record that fails for any reason but
            its age (a hub verified every record it lists, so that hub lies); the view is dropped
            at that record, so a lying view costs at most one failed check.
        """
        assert self._bridge is not None
        try:
            raws = unpack_view(payload)
        except ProtocolError as e:
            self._rejected["view_malformed"] += 1
            logger.debug("malformed view from %s: %s", hub, e, extra={"peer_id": hub})
            return False
        envs: list[Envelope[NodeRecord]] = []
        for raw in raws:
            eid = bytes(content_id(raw))
            env = self._view_cache.get(eid)
            if env is None:
                try:
                    env = self._validator.check("nodes", raw, remember=False)
                except ProtocolError as e:
                    reason, _ = penalty_for(e)
                    self._rejected[f"view_{reason}"] += 1
                    if reason in ("stale", "duplicate"):  # aged on the way, or seen: skipped, not a lie
                        continue
                    logger.debug("view from %s lists a record that fails: %s", hub, e, extra={"peer_id": hub})
                    return False
                self._view_cache[eid] = env
                while len(self._view_cache) > VIEW_CACHE:
                    self._view_cache.popitem(last=False)
            assert isinstance(env.body, NodeRecord)
            if env.signer != self.key.public_key:
                host.note_peer(env.body.peer_id, env.body.addrs)
            envs.append(env)  # type: ignore[arg-type]
        self._bridge.to_asyncio(self._deliver_view, hub, envs)
        return True

    def _make_validator(self, kind: TopicKind, host: P2PHost) -> Callable[[ID, rpc_pb2.Message], bool]:
        per_interval = float(self.config.max_records_per_interval)

        def over_rate(sender: str, published: bool) -> bool:
            """Node records past the forwarder's budget are dropped before any check (minting costs
            the sender its score, and us almost nothing); what it published itself and what it
            relayed are counted apart."""
            budget = self._own_budget if published else self._forward_budget
            return not budget.allow(sender, now_s=trio.current_time())

        def validate(forwarder: ID, msg: rpc_pb2.Message) -> bool:
            sender = PeerId(forwarder.to_base58())
            try:
                if len(msg.topicIDs) != 1:  # ours go on one topic; py-libp2p's router walks every listed one
                    raise DecodeError(f"message lists {len(msg.topicIDs)} topics, not 1")
                if kind == "nodes" and sender != self.peer_id and over_rate(sender, msg.from_id == forwarder.to_bytes()):
                    raise OverRate(f"more than {per_interval:g} node records in one heartbeat interval")
                env = self._validator.check(kind, msg.data)
            except ProtocolError as e:
                reason, points = penalty_for(e)
                self._rejected[reason] += 1
                logger.debug("rejected %s message from %s: %s", kind, sender, e, extra={"peer_id": sender})
                if reason in ("over_rate", "stale") and msg.from_id != forwarder.to_bytes():
                    # relayed valid records: an honest hub forwards what each of its own peers sent within
                    # their budgets, and what was fresh when it checked it (a record timed to go stale
                    # on the way here); Sybil minters behind it would get it banned here; dropped only
                    points = 0.0
                if points and sender != self.peer_id and self._scores.penalize(sender, points):
                    self._scores.forget(sender)
                    host.ban(sender)
                return False
            self._accepted[host.message_id(msg)] = env
            while len(self._accepted) > ACCEPTED_CACHE:
                self._accepted.popitem(last=False)
            return True

        return validate

    async def _read_topic(self, kind: TopicKind, sub: TrioSubscriptionAPI, host: P2PHost) -> None:
        assert self._bridge is not None
        own = ID.from_base58(self.peer_id).to_bytes()
        while True:
            msg = await sub.get()
            env = self._accepted.pop(host.message_id(msg), None)
            if msg.from_id == own or env is None or env.signer == self.key.public_key:
                continue
            if isinstance(env.body, NodeRecord):
                host.note_peer(env.body.peer_id, env.body.addrs)
                if self._fetcher is not None and kind == "nodes":
                    self._fetcher.note_hub(env.body)
            self._bridge.to_asyncio(self._deliver, kind, env)

    async def _trio_publish(self, kind: TopicKind, data: bytes) -> None:
        assert self._host is not None
        try:
            self._validator.check(kind, data, remember=False)
        except ProtocolError as e:
            reason, _ = penalty_for(e)
            raise PublishError(self.topics[kind], "oversized" if "limit" in str(e) else reason, str(e)) from None
        await self._host.publish(self.topics[kind], data)
