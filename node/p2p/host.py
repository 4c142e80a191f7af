"""The libp2p host of a node (trio side): TCP, noise, yamux, gossipsub, bootstrap and dialing.

Everything in this module runs on the trio loop of the bridge (``node/p2p/bridge.py``); the
asyncio side reaches it only through :class:`node.p2p.service.GossipNode`.

* The host key is the node's ed25519 key (:func:`libp2p_key_pair`), so the libp2p peer ID is the
  node's peer ID.
* Gossipsub is tuned for a run of tens to thousands of peers with small control traffic:
  mesh degree 6 (4–12), a 1 s router heartbeat, content-addressed message IDs (two copies of one
  envelope are one message), a raised per-topic rate limit (py-libp2p's default of 10 messages/s
  per peer drops messages silently) and IP-diversity checks off (every local test peer shares
  127.0.0.1).
* Connections are kept few: peers learned from records are dialed only while we hold fewer than
  ``target_peers`` (default 3), inbound ones are capped at ``max_peers``, and py-libp2p's own
  auto-connector (which dials every known peer up to 50–100 connections) is switched off.
  py-libp2p's per-connection cost is high: eight nodes that all dial each other fall behind their
  own gossip on a 2-core machine (``docs/gossip.md``).
* py-libp2p's resource manager does not limit connections (:func:`resource_manager`): its count
  leaks and its "graceful degradation" then halves the limit, and its default lifecycle limits
  (256 inbound) closed every worker past the 256th, so a hub refused new workers.
* Bootstrap peers are dialed forever while the host runs, with exponential backoff and jitter
  (:meth:`P2PHost.keep_connected`); a node whose bootstrap peers are all down keeps serving.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterable
from typing import Any, cast

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.subscription import TrioSubscriptionAPI
from libp2p.rcmgr import ResourceLimits, ResourceManager, new_resource_manager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.address_validation import expand_wildcard_address

from node.errors import GossipError
from node.p2p import libp2p_patches
from node.p2p.config import GossipConfig
from node.p2p.router import BoundedGossipSub, CountingPubsub, content_message_id
from node.p2p.transport import MAX_INBOUND_STREAMS, PerAddressCap, install_inbound_rules, muxer_options, secure_transports
from protocol.identity import NodeKey, PeerId

logger = logging.getLogger(__name__)

GOSSIPSUB_PROTOCOLS = (PROTOCOL_ID_V11, PROTOCOL_ID)
MESH_DEGREE, MESH_DEGREE_LOW, MESH_DEGREE_HIGH = 6, 4, 12
ROUTER_HEARTBEAT_S = 1
"""Gossipsub router heartbeat (mesh maintenance, IHAVE gossip), seconds."""
SEEN_TTL_S = 300
"""How long gossipsub remembers message IDs it has seen, seconds (longer than any freshness window)."""
PENDING_MESSAGES_TTL_S = 2.0
"""How long py-libp2p's router keeps a message for a connected peer that has not (yet) subscribed to
its topic, seconds. It is meant for the subscription race of a new connection, but it also queues
every ``workers``-topic record for every connected worker, which by design never subscribes to
that topic: with py-libp2p's 30 s default each relay held 100 such records per worker, re-filtered
and logged a warning per worker per record (7.5 % of a core idle at 32 nodes). 2 s covers the
race; a message missed in it is covered by the coordinator's next heartbeat (``docs/gossip.md``)."""
MAINTAIN_INTERVAL_S = 1.0
"""How often the connection count is topped up from known peers, seconds."""
KNOWN_PEER_TTL_S = 60.0
"""Addresses of a peer not heard from for this long are forgotten, seconds."""
CLOSE_TIMEOUT_S = 1.0
"""How long a stopping host spends closing its connections, seconds."""
CONNECTED_CHECK_S = 2.0
"""How often a connected bootstrap peer is re-checked, seconds."""

SyncValidator = Callable[[ID, rpc_pb2.Message], bool]


def libp2p_key_pair(key: NodeKey) -> KeyPair:
    """The libp2p ed25519 key pair of ``key`` (same seed, hence same public key and peer ID)."""
    return create_new_key_pair(key.seed())


@functools.lru_cache(maxsize=4096)
def libp2p_id(peer_id: PeerId) -> ID:
    """The libp2p :class:`ID` of a peer ID string, decoded once (base58 decoding costs ≈ 55 µs, and
    the connection checks of every node ask for the same few peers every second; the least
    recently used of 4,096 are decoded again)."""
    return ID.from_base58(peer_id)


def listen_multiaddr(host: str, port: int) -> multiaddr.Multiaddr:
    """``/ip4/<host>/tcp/<port>`` (or ``/ip6/…`` when ``host`` contains a colon)."""
    family = "ip6" if ":" in host else "ip4"
    return multiaddr.Multiaddr(f"/{family}/{host}/tcp/{port}")


def parse_peer_addr(addr: str) -> PeerInfo:
    """Parse ``/ip4/…/tcp/…/p2p/12D3KooW…`` into a libp2p :class:`PeerInfo`.

    Raises:
        ValueError: not a multiaddr that ends in ``/p2p/<peer ID>`` (a one-line message).
    """
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as e:  # noqa: BLE001 - multiaddr raises a zoo of types for bad input
        why = " ".join(str(e).split())[:120]  # multiaddr's messages repeat the input over several lines
        raise ValueError(f"{addr[:256]!r} is not a multiaddr ending in /p2p/<peer ID>: {why}") from None


def resource_manager(max_peers: int) -> ResourceManager:
    """py-libp2p's resource manager with no connection limit of its own and a stream limit the
    node's own caps reach first; no graceful degradation, no circuit breaker; its per-peer
    connection rate (10/s, burst 50) stays.

    The connection limits are ours: ``max_peers`` (py-libp2p's connection config), the per-address
    cap and the inbound slot freed when a connection closes (``node/p2p/transport.py``). What
    py-libp2p 0.8 would add, each measured as a ceiling below ``max_peers``:

    * its connection count (default 1,000) is not given back when a connection fails while it is
      being set up (6 counted after 30 had come and gone on a loaded machine), and at the limit it
      "degrades": lowers the limit, down to half, and refuses new connections. A relay carrying
      500 simulated workers stopped accepting any at 258.
    * its connection-lifecycle limits (``new_connection_limits_with_defaults``): at most 256
      established inbound connections, 256 outbound, 1,024 in all. Past 256 a hub closed each new
      connection after its handshake (``[ADDCONN_DENY]`` at WARNING, demoted by our log filter):
      300 peers dialing a relay with ``max_peers`` 600 left it at 256 connections.
    * its stream count, 10,000 per process in both directions, and a semaphore of that size that
      new streams *wait* on: at ~4 streams per peer a hub of ~2,500 peers, or ~160 peers each
      holding :data:`MAX_INBOUND_STREAMS`, would stall every new stream. The limit is set to
      ``2 × MAX_INBOUND_STREAMS`` per allowed peer (inbound capped per connection, outbound ours).

    Args:
        max_peers: the node's connection cap (``GossipConfig.max_peers``).
    """
    return new_resource_manager(
        limits=ResourceLimits(max_connections=2**62, max_streams=max(10_000, 2 * MAX_INBOUND_STREAMS * max_peers)),
        connection_limits=ConnectionLimits(),  # None everywhere: the node's caps (above) are the limits
        enable_graceful_degradation=False,
        enable_circuit_breaker=False,  # a tripped breaker refuses every connection for 60 s
    )


class P2PHost:
    """A running libp2p host with gossipsub, driven from the trio loop.

    Use :meth:`serve` as a trio task (``nursery.start``); the other methods are valid while it runs.

    Constructing one applies the node's overrides of py-libp2p (``node/p2p/libp2p_patches.py``).

    Args:
        key: the node key (host identity).
        config: listen address, bootstrap and dialing settings.
        hub: an infrastructure node (coordinator, relay, validator) that workers connect to; its
            mesh keeps up to ``config.max_peers`` peers per topic instead of 12.
        keepalive_s: TCP keepalive interval of its connections, seconds (the run's heartbeat
            interval: a peer whose machine vanished is dropped within ≈ 4 of them); None: off.

    Raises:
        Libp2pMismatchError: the installed py-libp2p is not the one the overrides were written for.
        GossipError: libp2p derived another peer ID from the key, or ``ip_limit_exempt`` is malformed.
    """

    def __init__(self, key: NodeKey, config: GossipConfig, *, hub: bool = False, keepalive_s: float | None = None) -> None:
        libp2p_patches.apply()  # before anything of py-libp2p is built; once per process
        self.key = key
        self.config = config
        self.peer_id = key.peer_id
        # py-libp2p's connection manager otherwise dials every peer it has heard of until it holds
        # 50–100 connections, which is exactly what overloads it (see the module docstring).
        connections = ConnectionConfig(
            min_connections=0,
            low_watermark=0,
            high_watermark=config.max_peers,
            max_connections=config.max_peers,
            dial_timeout=config.dial_timeout_s,
        )
        # noise only (py-libp2p also offers /plaintext/2.0.0, which lets a peer claim any peer ID)
        # and only the configured muxer, a yamux that enforces its windows: node/p2p/transport.py
        key_pair = libp2p_key_pair(key)
        self.host: IHost = new_host(
            key_pair=key_pair, connection_config=connections, disable_identify_address_discovery=True,
            sec_opt=secure_transports(key_pair), muxer_opt=muxer_options(config.muxer),
            resource_manager=resource_manager(config.max_peers),
        )
        if self.host.get_id().to_base58() != key.peer_id:
            raise GossipError(f"libp2p derived peer ID {self.host.get_id()} from key {key.peer_id}")
        try:
            self.address_cap = PerAddressCap(config.max_peers_per_ip, config.ip_limit_exempt)
        except ValueError as e:
            raise GossipError(f"ip_limit_exempt: {e}") from None
        # inbound handlers end with their connection; the per-address cap applies from accept, before the handshake
        install_inbound_rules(self.host.get_network(), self.address_cap, keepalive_s=keepalive_s)
        # IWANT answers bounded (each message once per IWANT, 3 times per peer): node/p2p/router.py
        self.router = BoundedGossipSub(
            protocols=list(GOSSIPSUB_PROTOCOLS),
            degree=MESH_DEGREE,
            degree_low=MESH_DEGREE_LOW,
            # A hub (coordinator, relay, validator) keeps every peer that grafts it in its mesh, up
            # to max_peers: workers connect only to hubs, and a worker a hub prunes is left to IHAVE
            # gossip (6 peers per heartbeat, 3 heartbeats): at 32 nodes 10-20 % of announcements
            # never arrived. See docs/gossip.md, "Mesh of a star".
            degree_high=max(MESH_DEGREE_HIGH, config.max_peers) if hub and config.hub_full_mesh else MESH_DEGREE_HIGH,
            heartbeat_interval=ROUTER_HEARTBEAT_S,
            heartbeat_initial_delay=0.1,
            adaptive_gossip_enabled=False,
            max_messages_per_topic_per_second=config.max_messages_per_topic_per_second,
            eclipse_protection_enabled=False,
            pending_messages_ttl=PENDING_MESSAGES_TTL_S,
            # Peer exchange off: py-libp2p dials up to px_peers_count peers named in any PRUNE
            # (signed by keys the sender makes up, at addresses it chooses, accepted from every
            # peer), so one peer could make a hub dial anywhere and fill its connection slots.
            # Peers come from verified node records and bootstrap only (docs/gossip.md).
            px_peers_count=0,
        )
        self.pubsub = CountingPubsub(
            self.host,
            self.router,
            seen_ttl=SEEN_TTL_S,
            strict_signing=True,
            msg_id_constructor=content_message_id,
        )
        self._banned_until: dict[PeerId, float] = {}
        self._dialing: set[PeerId] = set()
        self._known: dict[PeerId, tuple[list[str], float]] = {}  # peer → (addrs, trio time heard)
        self._nursery: trio.Nursery | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, start gossipsub, report the advertised addresses, then run until cancelled.

        Raises:
            GossipError: the listen address is unusable (port taken, bad interface); trio may
                wrap it in exception groups.
        """
        listen = listen_multiaddr(self.config.listen_host, self.config.p2p_port)
        try:
            async with (
                self.host.run(listen_addrs=[listen]),
                background_trio_service(self.pubsub),
                background_trio_service(self.router),
            ):
                if not self.host.get_transport_addrs():  # py-libp2p logs a failed bind instead of raising
                    raise GossipError(f"cannot listen on {listen} (port in use or no such interface)")
                with trio.fail_after(self.config.start_timeout_s):
                    await self.pubsub.wait_until_ready()
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        nursery.start_soon(self._unban_loop)
                        nursery.start_soon(self._maintain_loop)
                        task_status.started(self.advertised_addrs())
                        await trio.sleep_forever()
                finally:
                    # py-libp2p's cancelled services leave the connections open until the process
                    # ends; closing them tells peers at once (a hub detaches a stopped worker).
                    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                        await self._close_connections()
        finally:
            self._nursery = None
            # py-libp2p never stops the sweeper thread of its seen-message cache; we do.
            self.pubsub.seen_messages.stop()

    async def _close_connections(self) -> None:
        """Close every connection's muxer (yamux GO_AWAY, then the socket), all at once: each
        close takes py-libp2p's yamux 0.1-0.2 s, so one after another a relay with 4 peers took
        0.7-0.8 s of its stop, and a hub with hundreds closed only the first few within
        ``CLOSE_TIMEOUT_S``. py-libp2p's own ``Swarm.close`` left the sockets open here when its
        services were already cancelled."""
        network = self.host.get_network()
        conns = [conn for group in list(getattr(network, "connections", {}).values())
                 for conn in list(group if isinstance(group, list) else [group])]

        async def close(conn: Any) -> None:
            try:
                await conn.muxed_conn.close()
            except Exception as e:  # noqa: BLE001 - best effort on the way down
                logger.debug("closing a connection: %r", e)

        async with trio.open_nursery() as nursery:
            for conn in conns:
                nursery.start_soon(close, conn)

    def advertised_addrs(self) -> list[str]:
        """Multiaddrs others can dial, each ending in ``/p2p/<our peer ID>``."""
        suffix = f"/p2p/{self.peer_id}"
        if self.config.announce_addrs:
            return [a if a.endswith(suffix) else a + suffix for a in self.config.announce_addrs]
        out: list[str] = []
        for addr in self.host.get_transport_addrs():
            for concrete in expand_wildcard_address(addr) if _is_wildcard(addr) else [addr]:
                text = str(concrete) + suffix
                if text not in out:
                    out.append(text)
        return out

    # --- peers -------------------------------------------------------------------------------

    def is_connected(self, peer_id: PeerId) -> bool:
        """Whether a connection to ``peer_id`` is open."""
        return bool(self.host.get_network().get_connections(libp2p_id(peer_id)))

    async def dial(self, info: PeerInfo) -> bool:
        """Connect to a peer within ``dial_timeout_s`` seconds; returns whether it worked.

        Never raises for an unreachable or misbehaving peer (logged at DEBUG).
        """
        pid = PeerId(info.peer_id.to_base58())
        if pid == self.peer_id or self.is_banned(pid) or pid in self._dialing:
            return False
        self._dialing.add(pid)
        try:
            # py-libp2p refuses to re-dial a peer for 60 s after a failure; we pace dials ourselves
            self.host.get_network().unblock_peer(info.peer_id)  # type: ignore[attr-defined]
            with trio.move_on_after(self.config.dial_timeout_s) as scope:
                await self.host.connect(info)
            if scope.cancelled_caught:
                logger.debug("dial to %s timed out after %.1f s", pid, self.config.dial_timeout_s, extra={"peer_id": pid})
                return False
            return True
        except Exception as e:  # noqa: BLE001 - any dial failure is the peer's problem, not ours
            logger.debug("dial to %s failed: %r", pid, e, extra={"peer_id": pid})
            return False
        finally:
            self._dialing.discard(pid)

    def note_peer(self, peer_id: PeerId, addrs: Iterable[str]) -> None:
        """Remember where a peer (from a verified record) listens, and dial it if we want more connections."""
        if peer_id == self.peer_id:
            return
        addrs = list(addrs)[:16]
        self._known[peer_id] = (addrs, trio.current_time())
        self.dial_soon(peer_id, addrs)

    async def _maintain_loop(self) -> None:
        """Keep ``target_peers`` connections: re-dial peers heard from recently (heals a mesh that
        lost its seed or split), and forget addresses not refreshed for ``KNOWN_PEER_TTL_S``."""
        while True:
            await trio.sleep(MAINTAIN_INTERVAL_S)
            now = trio.current_time()
            for peer_id in [p for p, (_, at) in self._known.items() if now - at > KNOWN_PEER_TTL_S]:
                del self._known[peer_id]
            if len(self.host.get_connected_peers()) + len(self._dialing) >= self.config.target_peers:
                continue  # nothing to top up (the usual case): no need to look at every known peer
            candidates = [p for p in self._known if not self.is_connected(p) and not self.is_banned(p)]
            random.shuffle(candidates)
            for peer_id in candidates:
                if len(self.host.get_connected_peers()) + len(self._dialing) >= self.config.target_peers:
                    break
                self.dial_soon(peer_id, self._known[peer_id][0])

    def dial_soon(self, peer_id: PeerId, addrs: Iterable[str]) -> None:
        """Dial a peer in the background if we have fewer than ``target_peers`` connections.

        Only TCP multiaddrs that name ``peer_id`` (or no peer) are used; anything else is ignored.
        """
        if self._nursery is None or peer_id == self.peer_id or peer_id in self._dialing or self.is_banned(peer_id):
            return
        if len(self.host.get_connected_peers()) + len(self._dialing) >= self.config.target_peers or self.is_connected(peer_id):
            return
        maddrs = []
        for a in list(addrs)[:16]:
            try:
                m = multiaddr.Multiaddr(a)
                named = m.get_peer_id()
                if named is not None and named != peer_id:
                    continue
                if named is not None:
                    m = m.decapsulate(multiaddr.Multiaddr(f"/p2p/{named}"))
                if "tcp" not in [p.name for p in m.protocols()]:
                    continue
                maddrs.append(m)
            except Exception as e:  # noqa: BLE001 - a peer's garbage address is just skipped
                logger.debug("skipping address %r of %s: %r", a[:256], peer_id, e)
                continue
        if maddrs:
            self._dialing.add(peer_id)  # counted from now on, so a burst of records starts few dials
            self._nursery.start_soon(self._dial_learned, PeerInfo(libp2p_id(peer_id), maddrs))

    async def _dial_learned(self, info: PeerInfo) -> None:
        self._dialing.discard(PeerId(info.peer_id.to_base58()))
        await self.dial(info)

    async def keep_connected(self, addrs: list[str]) -> None:
        """Dial every bootstrap address and re-dial any that drops, with backoff, until cancelled.

        Unparseable addresses and our own address are skipped with a warning / silently.
        """
        async with trio.open_nursery() as nursery:
            for addr in addrs:
                try:
                    info = parse_peer_addr(addr)
                except ValueError as e:
                    logger.warning("ignoring bootstrap address: %s", e)
                    continue
                if info.peer_id.to_base58() != self.peer_id:
                    nursery.start_soon(self._keep_one, info, addr)

    async def _keep_one(self, info: PeerInfo, addr: str) -> None:
        pid = PeerId(info.peer_id.to_base58())
        delay_s = self.config.bootstrap_backoff_s
        failures = 0
        while True:
            if self.is_connected(pid):
                delay_s = self.config.bootstrap_backoff_s
                await trio.sleep(CONNECTED_CHECK_S)
                continue
            if await self.dial(info):
                if failures:
                    logger.info("connected to bootstrap peer %s after %d failed attempts", addr, failures)
                failures = 0
                continue
            failures += 1
            if failures == 1 or failures % 10 == 0:
                logger.info("bootstrap peer %s unreachable (%d attempts); retrying", addr, failures, extra={"peer_id": pid})
            await trio.sleep(delay_s * random.uniform(0.8, 1.2))
            delay_s = min(delay_s * 2, self.config.bootstrap_backoff_max_s)

    # --- bans --------------------------------------------------------------------------------

    def is_banned(self, peer_id: PeerId) -> bool:
        """Whether ``peer_id`` is blacklisted now."""
        until = self._banned_until.get(peer_id)
        return until is not None and until > trio.current_time()

    def ban(self, peer_id: PeerId) -> None:
        """Blacklist ``peer_id`` for ``ban_s`` seconds and close its connections."""
        if self.is_banned(peer_id) or peer_id == self.peer_id:
            return
        pid = libp2p_id(peer_id)
        self._banned_until[peer_id] = trio.current_time() + self.config.ban_s
        self.pubsub.add_to_blacklist(pid)
        logger.warning("disconnected and banned peer %s for %.0f s", peer_id, self.config.ban_s, extra={"peer_id": peer_id})
        if self._nursery is not None:
            self._nursery.start_soon(self._disconnect, pid)

    async def _disconnect(self, pid: ID) -> None:
        with trio.move_on_after(self.config.dial_timeout_s):
            try:
                await self.host.disconnect(pid)
            except Exception as e:  # noqa: BLE001 - already gone is fine
                logger.debug("disconnecting %s: %r", pid, e)

    async def _unban_loop(self) -> None:
        while True:
            await trio.sleep(max(1.0, min(self.config.ban_s, 30.0)))
            now = trio.current_time()
            for peer_id in [p for p, until in self._banned_until.items() if until <= now]:
                del self._banned_until[peer_id]
                self.pubsub.remove_from_blacklist(libp2p_id(peer_id))
                logger.info("ban of peer %s expired", peer_id, extra={"peer_id": peer_id})

    # --- pubsub ------------------------------------------------------------------------------

    async def subscribe(self, topic: str, validator: SyncValidator) -> TrioSubscriptionAPI:
        """Register ``validator`` for ``topic`` (run before delivery and forwarding) and subscribe."""
        self.pubsub.set_topic_validator(topic, validator, False)
        return cast(TrioSubscriptionAPI, await self.pubsub.subscribe(topic))

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` on ``topic`` (our own validator runs on it first), after waiting (a
        bounded time) for room in mesh peers' send queues (``node/p2p/router.py``)."""
        await self.router.wait_for_room(topic)
        await self.pubsub.publish(topic, data)

    def message_id(self, msg: rpc_pb2.Message) -> bytes:
        """The gossipsub ID of a message (SHA-256 of its data, multibase-encoded)."""
        return self.pubsub.get_message_id(msg)

    def mesh_sizes(self) -> dict[str, int]:
        """Gossipsub mesh size per subscribed topic."""
        return {topic: len(peers) for topic, peers in self.router.mesh.items()}

    def stats(self) -> dict[str, Any]:
        """Connection and mesh counters for status output and tests."""
        return {
            "connected": len(self.host.get_connected_peers()),
            "mesh": self.mesh_sizes(),
            "banned": sorted(p for p in self._banned_until if self.is_banned(p)),
            "refused_per_ip": self.address_cap.refused,
            "send_drops": dict(self.router.send_drops),
            "delivery_drops": self.pubsub.delivery_drops,
        }


def _is_wildcard(addr: multiaddr.Multiaddr) -> bool:
    text = str(addr)
    return text.startswith(("/ip4/0.0.0.0/", "/ip6/::/"))
