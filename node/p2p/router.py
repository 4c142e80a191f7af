"""py-libp2p's gossipsub router with IWANT answers bounded and send-queue drops counted (trio side;
used by ``node/p2p/host.py``; what it overrides in py-libp2p is listed in ``node/p2p/libp2p_patches.py``).

py-libp2p 0.8 answers an IWANT by copying every listed message it holds into one reply, once per
listed ID, duplicates included, as often as asked (10 IWANTs per second per peer). One IWANT of
~240 KB naming a 25 KB verdict 5,000 times took a relay from 101 to 555 MB; a 1 MiB IWANT naming a
64 KiB verdict ~20,000 times asks for 1.3 GB. go-libp2p-pubsub answers each ID once per IWANT and
each message at most ``GossipRetransmission`` (3) times per peer (``handleIWant``);
:class:`BoundedGossipSub` does the same. See ``docs/gossip.md``, "Transport rules".

Queues (``docs/gossip.md``, "Send queues"): py-libp2p gives every peer an outbound queue of 32 RPCs
(go-libp2p-pubsub's ``OutboundQueueSize``) and every subscription a delivery channel of 32
messages, and drops past either silently (a burst of 300 verdicts from one validator: 260
arrived). Here the outbound queue holds :data:`SEND_QUEUE_RPCS`, the delivery channel
:data:`DELIVERY_QUEUE_MESSAGES`, every drop is counted (:attr:`BoundedGossipSub.send_drops`,
:attr:`CountingPubsub.delivery_drops`; ``GossipNode.stats``), and our own publishes wait (up to
:data:`PUBLISH_WAIT_S`) while a mesh peer's queue is past :data:`SEND_QUEUE_HIGH_WATER`, so a
burst we publish is paced by the slowest reader instead of being cut. A peer that reads nothing
for that long loses messages (counted), never the others.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections import Counter
from typing import Any

import multibase
import trio
from libp2p.encoding_config import get_default_encoding
from libp2p.peer.id import ID
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.score import PeerScorer
from libp2p.pubsub.utils import safe_bytes_from_hex

from node.p2p.libp2p_patches import adopt

__all__ = ["GOSSIP_RETRANSMISSION", "SEND_QUEUE_RPCS", "BoundedGossipSub", "CountingPubsub", "content_message_id", "sender_record"]

SEND_QUEUE_RPCS = 512
"""RPCs queued for one peer before new ones are dropped (py-libp2p: 32). Each queued RPC is one
message of ≤ 1 MiB (ours: ≤ 64 KiB but the rare 128 KiB ban list), so a stalled peer holds at most
≈ 512 × 64 KiB = 32 MiB of ours (and far less in practice: records and announcements are < 4 KiB)."""
SEND_QUEUE_HIGH_WATER = SEND_QUEUE_RPCS // 2
"""A mesh peer's queue length above which our own publishes wait (:meth:`BoundedGossipSub.wait_for_room`)."""
PUBLISH_WAIT_S = 2.0
"""Longest a publish waits for room in mesh peers' queues, seconds; then it goes out and a peer
still full loses it (counted)."""
DELIVERY_QUEUE_MESSAGES = 1024
"""Verified messages waiting for the node's topic reader, per topic (py-libp2p: 32)."""


SENDER_RECORD_REFRESH_S = 1.0
"""How long a host's signed peer record, attached to every RPC it publishes, is reused before its
listen addresses are looked at again, seconds."""


@functools.lru_cache(maxsize=8192)
def _encoded_digest(digest: bytes, encoding: str) -> bytes:
    return bytes(multibase.encode(encoding, digest))


def content_message_id(msg: rpc_pb2.Message) -> bytes:
    """The gossipsub ID of a message: py-libp2p's content-addressed ID (the multibase encoding of the
    SHA-256 of its data, ``get_content_addressed_msg_id``), byte for byte, with the encoding of each
    digest computed once (the 8,192 most recent kept).

    py-libp2p asks for a message's ID four to five times as it passes a node (seen cache, message
    cache, forwarding, our topic validator and delivery), and the multibase encoding (base58 in pure
    Python) took ≈ 100 µs each time: ≈ 0.5 ms per message at every node, for every simulated worker
    of a hub benchmark at each announcement. The SHA-256 (≈ 1 µs per KiB) is still taken each time,
    so the ID is always that of the bytes asked about.
    """
    return _encoded_digest(hashlib.sha256(msg.data).digest(), get_default_encoding())


def sender_record(host: Any) -> tuple[bytes, bool]:
    """py-libp2p's ``env_to_send_in_RPC``: the host's signed peer record attached to each RPC it
    publishes, and whether it was newly made; reused for :data:`SENDER_RECORD_REFRESH_S` seconds.

    py-libp2p rebuilt the host's advertised addresses (multiaddrs with the ``/p2p`` suffix) and
    re-serialized the record for every message it published or forwarded, ≈ 0.2-0.3 ms each, at
    every node and for each message whether or not it had anyone to forward it to. The record only
    changes when the host's listen addresses do; one a second old is still this host's.
    """
    now = time.monotonic()
    cached: tuple[bytes, float] | None = getattr(host, "_intellect_sender_record", None)
    if cached is not None and now - cached[1] < SENDER_RECORD_REFRESH_S:
        return cached[0], False
    record, created = env_to_send_in_RPC(host)
    host._intellect_sender_record = (record, now)
    return record, created


class _BoundedRpcQueue(RpcQueue):
    """py-libp2p's per-peer outbound queue with room for :data:`SEND_QUEUE_RPCS` RPCs."""

    def __init__(self, max_size: int = SEND_QUEUE_RPCS, **kwargs: Any) -> None:
        super().__init__(max_size=max_size, **kwargs)


# py-libp2p builds each peer's queue as ``RpcQueue()`` and each subscription's channel with the
# module's SUBSCRIPTION_CHANNEL_SIZE, and attaches env_to_send_in_RPC(host) to what it publishes, each
# looked up by name at that moment: node/p2p/libp2p_patches.py points those names at _BoundedRpcQueue,
# DELIVERY_QUEUE_MESSAGES and sender_record.


class CountingPubsub(Pubsub):
    """py-libp2p's :class:`Pubsub` that counts messages its subscription channels had no room for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delivery_drops = 0

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        for topic in publish_message.topicIDs:
            channel = self.subscribed_topics_send.get(topic)
            if channel is not None and channel.statistics().current_buffer_used >= channel.statistics().max_buffer_size:
                self.delivery_drops += 1
        super().notify_subscriptions(publish_message)

class _DefaultScorer(PeerScorer):
    """py-libp2p's gossipsub peer scorer, cheap while its parameters are inert (py-libp2p's defaults, ours).

    The node runs it with py-libp2p's default parameters: every weight 0, every decay factor 1 and
    every threshold -inf, so no score decides anything. Yet py-libp2p 0.8 computed them all the same:
    at each router heartbeat (1 s) it multiplied every counter of every peer and topic by its decay
    factor (~6 values per peer and topic rewritten to themselves: at a relay with 500 workers the
    largest single part of its idle CPU by py-spy, 26 of ~115 samples), and for every message it
    published it scored each peer it was about to send to against the publish threshold (≈ 3 µs a
    peer: 1.5 ms of each announcement a hub forwards to 500 workers). Here a decay by 1 is skipped,
    and a gate whose threshold is -inf answers at once what comparing any score with it would
    (every score is finite: weights and counters are). Other parameters work as before.
    """

    def on_heartbeat(self, dt_seconds: float = 1.0) -> None:
        p = self.params
        decays = (p.p1_time_in_mesh.decay, p.p2_first_message_deliveries.decay, p.p3_mesh_message_deliveries.decay,
                  p.p4_invalid_messages.decay, p.p5_behavior_penalty_decay, p.p6_appl_slack_decay)
        if all(d == 1.0 for d in decays):
            return  # multiplying by 1 changes nothing
        super().on_heartbeat(dt_seconds)

    def allow_publish(self, peer: ID, topics: list[str]) -> bool:
        if topics and self.params.publish_threshold == -math.inf:
            return True
        return super().allow_publish(peer, topics)

    def allow_gossip(self, peer: ID, topics: list[str]) -> bool:
        if topics and self.params.gossip_threshold == -math.inf:
            return True
        return super().allow_gossip(peer, topics)

    def is_graylisted(self, peer: ID, topics: list[str]) -> bool:
        if self.params.graylist_threshold == -math.inf:
            return False
        return super().is_graylisted(peer, topics)


GOSSIP_RETRANSMISSION = 3
"""Most times one message is sent to one peer in answer to its IWANTs (go-libp2p-pubsub's default)."""


class BoundedGossipSub(GossipSub):
    """:class:`GossipSub` whose IWANT answers hold each message once, at most
    :data:`GOSSIP_RETRANSMISSION` times per peer while the message is in the message cache."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # py-libp2p 0.8's "GRAFT flood" check (not in the gossipsub v1.1 spec) records when a peer
        # PRUNEd *us* and then refuses that peer's GRAFT for 10 s: a node that pruned an
        # oversubscribed mesh and later needs peers again is refused and penalized by honest
        # peers ("GRAFT flood detected … applying penalty"), and meshes around a busy seed keep
        # churning. The spec's prune backoff (60 s, honoured by the pruned side) stays in force.
        self.graft_flood_threshold = 0.0
        if self.scorer is not None:
            adopt(self.scorer, PeerScorer, _DefaultScorer)
        self._iwant_served: dict[ID, Counter[bytes]] = {}
        self.send_drops: Counter[str] = Counter()
        """Outbound RPCs dropped, by reason (``queue_full``, ``oversized``); ``messages``: the
        published messages they carried."""

    def _handle_dropped_rpc(self, peer_id: ID, rpc: rpc_pb2.RPC, reason: str) -> None:
        self.send_drops[reason] += 1
        self.send_drops["messages"] += len(rpc.publish)
        super()._handle_dropped_rpc(peer_id, rpc, reason)

    async def wait_for_room(self, topic: str, timeout_s: float = PUBLISH_WAIT_S) -> bool:
        """Wait until no mesh peer of ``topic`` has more than :data:`SEND_QUEUE_HIGH_WATER` RPCs
        queued, at most ``timeout_s`` seconds; returns whether there is room now."""
        if self.pubsub is None:
            return True
        with trio.move_on_after(timeout_s):
            while True:
                queues = self.pubsub.peer_queues
                if all(len(queues[p]) <= SEND_QUEUE_HIGH_WATER for p in self.mesh.get(topic, ()) if p in queues):
                    return True
                await trio.sleep(0.01)
        self.send_drops["publish_waits_expired"] += 1
        return False

    async def handle_iwant(self, iwant_msg: rpc_pb2.ControlIWant, sender_peer_id: ID) -> None:
        served = self._iwant_served.setdefault(sender_peer_id, Counter())
        for gone in [m for m in served if self.mcache.get(m) is None]:  # left the cache: forget
            del served[gone]
        keep: list[bytes] = []
        asked: set[bytes] = set()
        for wire in iwant_msg.messageIDs:
            mid = safe_bytes_from_hex(wire)
            if mid is None or mid in asked or self.mcache.get(mid) is None:
                continue
            asked.add(mid)
            if served[mid] >= GOSSIP_RETRANSMISSION:
                continue
            served[mid] += 1
            keep.append(wire)
        if keep:
            await super().handle_iwant(rpc_pb2.ControlIWant(messageIDs=keep), sender_peer_id)

    def remove_peer(self, peer_id: ID) -> None:
        self._iwant_served.pop(peer_id, None)
        super().remove_peer(peer_id)

    # py-libp2p 0.8 runs, every heartbeat (1 s) and for every topic, "opportunistic grafting" and
    # "peer replacement" (the latter not in the gossipsub spec), each scoring every mesh peer
    # before looking for a subscribed peer outside the mesh to graft or swap in. A hub keeps every
    # peer in its mesh (docs/gossip.md, "Mesh of a star"), so there is none, and the scoring is all
    # they do: measured with py-spy at a relay with 500 workers attached, about a third of its idle
    # CPU (benchmarks/gossip_results.md). Both now return at once when every subscribed peer is
    # already in the mesh, which is what they would have concluded; otherwise they run as before.

    def _every_subscriber_in_mesh(self, topic: str) -> bool:
        """Whether no peer subscribed to ``topic`` is outside our mesh for it (O(subscribers))."""
        if self.pubsub is None:
            return False
        mesh = self.mesh.get(topic, set())
        return all(p in mesh for p in self.pubsub.peer_topics.get(topic, ()))

    def _perform_opportunistic_grafting(self, topic: str, peers_to_graft: Any) -> int:
        if self._every_subscriber_in_mesh(topic):
            return 0
        return super()._perform_opportunistic_grafting(topic, peers_to_graft)

    async def _consider_peer_replacement(self, topic: str) -> None:
        if self._every_subscriber_in_mesh(topic):
            return
        await super()._consider_peer_replacement(topic)
