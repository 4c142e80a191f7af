"""``GossipNode``: the one object a role uses to be on the run's gossip network.

It owns the node's lifecycle and what it says: it owns (or shares) a trio bridge, runs a
:class:`~node.p2p.host.P2PHost` on it, subscribes the run's topics its role needs
(:func:`~node.p2p.gossip.subscribed_kinds`) with its :class:`~node.p2p.topics.TopicGate` as the
libp2p topic validator (so nothing invalid is delivered or forwarded), publishes, keeps the
:class:`~node.p2p.peers.PeerTable` up to date from what it hears and calls the role's handlers on
the asyncio loop. Liveness beyond records on ``nodes`` (presence streams, views, rosters,
vouching) is its :class:`~node.p2p.liveness.Presence`. Its signed
:class:`~protocol.messages.NodeRecord` goes out every heartbeat interval, by role (``docs/gossip.md``):

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
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.subscription import TrioSubscriptionAPI

from node import __version__
from node.errors import GossipError, PublishError
from node.p2p.bridge import TrioBridge, TrioTaskHandle, make_bridge
from node.p2p.config import GossipConfig
from node.p2p.gossip import TOPIC_KINDS, TopicKind, record_kind, subscribed_kinds, topic_names
from node.p2p.host import P2PHost
from node.p2p.liveness import Presence
from node.p2p.peers import PeerTable
from node.p2p.topics import TopicGate
from protocol.envelope import Envelope, seal
from protocol.identity import NodeKey, PeerId
from protocol.messages import HUB_ROLES, CheckpointAnnouncement, Hardware, Message, NodeRecord, Role
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
MIN_BEAT_GAP_S = 0.05
"""Shortest gap between two records triggered by :meth:`GossipNode.set_record`, seconds."""


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
        subscribed: the topic kinds this node reads (fixed at start).
        gate: what comes in on the topics (validator, budgets, penalties; trio side).
        presence: presence streams, views, rosters and vouching (``None`` in the older layouts,
            ``GossipConfig.presence = False``).

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
    subscribed: tuple[TopicKind, ...]
    gate: TopicGate
    presence: Presence | None

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
        self.is_hub = role in HUB_ROLES
        split = self.config.split_records or self.config.presence
        self.gate = TopicGate(
            self.run_id, spec.authorities, peer_id=self.peer_id, config=self.config,
            heartbeat_interval_s=self.heartbeat_interval_s, split_records=split,
        )
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
        self.subscribed = subscribed_kinds(
            role, split=self.config.split_records, publishes_records=self.config.publish_records, presence=self.config.presence
        )
        self.presence = Presence(
            spec, peer_id=self.peer_id, signer=key.public_key, role=role, config=self.config,
            heartbeat_interval_s=self.heartbeat_interval_s, peers=self.peers, envelopes=self.gate.envelopes,
            deliver=self._call_handlers, step_changed=self._check_latest_step,
        ) if self.config.presence else None
        self._bridge = bridge
        self._owns_bridge = bridge is None
        self._host: P2PHost | None = None
        self._trio_task: TrioTaskHandle | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._beat_now = asyncio.Event()
        self._handler_tasks: set[asyncio.Task[None]] = set()
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
        if self.presence is not None:
            self.presence.start()
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
        views = self.presence.stop() if self.presence is not None else None
        tasks = [t for t in (self._heartbeat, views, *self._handler_tasks) if t is not None]
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
        return self.presence.attached_hubs if self.presence is not None else frozenset()

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

        presence = self.presence

        def snapshot() -> dict[str, Any]:
            out = {**host.stats(), "rejected": self.gate.stats()}
            if presence is not None:
                out.update(presence.stats())
                out["rejected"].update(presence.rejected)
            return out

        out = await self._bridge.run_sync(snapshot, timeout_s=CALL_TIMEOUT_S)
        out["delivered"] = {**self._delivered, **(self.presence.delivered if self.presence is not None else {})}
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
            if self.presence is not None:
                self.presence.vouch()
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
        presence = self.presence
        try:
            if presence is not None and presence.client is not None:  # a worker: its record goes to its hubs only
                record = self.make_record()
                await presence.beat_record(self.seal(record), record)
                return
            workers, roster = await presence.roster() if presence is not None else (0, b"")
            data = self.seal(self.make_record(workers=workers, roster=roster))
            await self.publish(record_kind(self._record["role"], split=self.config.split_records or self.config.presence), data)
            if presence is not None:
                presence.published(data)
        except PublishError as e:
            logger.warning("heartbeat not published: %s", e)
        except (TimeoutError, GossipError) as e:
            logger.warning("heartbeat not sent: %s", e)

    def _deliver(self, kind: TopicKind, env: Envelope[Any]) -> None:
        """Runs on the asyncio loop for each verified message of another node."""
        if not self._running:
            return
        self._delivered[kind] += 1
        if isinstance(env.body, NodeRecord):
            if self.peers.update(env.body, env.ts_ms):
                logger.debug("peer %s (%s) is alive", env.body.peer_id, env.body.role, extra={"peer_id": env.body.peer_id})
            if self.presence is not None and kind == "nodes":
                self.presence.heard_hub(env)
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
        host = P2PHost(self.key, self.config, hub=self.is_hub, keepalive_s=self.heartbeat_interval_s)
        self._host = host
        if self.presence is not None:
            self.presence.prepare(host, self._bridge)  # a hub's stream handlers, before it serves
        async with trio.open_nursery() as nursery:
            addrs = await nursery.start(host.serve)
            for kind in self.subscribed:
                sub = await host.subscribe(self.topics[kind], self.gate.validator(kind, host))
                nursery.start_soon(self._read_topic, kind, sub, host)
            if self.presence is not None:
                await self.presence.run_trio(host, nursery)
            bootstrap = list(dict.fromkeys([*self.config.bootstrap, *self.spec.network.bootstrap]))
            if bootstrap:
                nursery.start_soon(host.keep_connected, bootstrap)
            task_status.started(addrs)

    async def _read_topic(self, kind: TopicKind, sub: TrioSubscriptionAPI, host: P2PHost) -> None:
        assert self._bridge is not None
        own = ID.from_base58(self.peer_id).to_bytes()
        while True:
            msg = await sub.get()
            env = self.gate.take(host.message_id(msg))
            if msg.from_id == own or env is None or env.signer == self.key.public_key:
                continue
            if isinstance(env.body, NodeRecord):
                host.note_peer(env.body.peer_id, env.body.addrs)
                if self.presence is not None and kind == "nodes":
                    self.presence.heard_hub_trio(env.body)
            self._bridge.to_asyncio(self._deliver, kind, env)

    async def _trio_publish(self, kind: TopicKind, data: bytes) -> None:
        assert self._host is not None
        self.gate.check_outgoing(kind, self.topics[kind], data)
        await self._host.publish(self.topics[kind], data)
