"""py-libp2p's gossipsub router with IWANT answers bounded (trio side; used by ``node/p2p/host.py``).

py-libp2p 0.8 answers an IWANT by copying every listed message it holds into one reply, once per
listed ID, duplicates included, as often as asked (10 IWANTs per second per peer). One IWANT of
~240 KB naming a 25 KB verdict 5,000 times took a relay from 101 to 555 MB; a 1 MiB IWANT naming a
64 KiB verdict ~20,000 times asks for 1.3 GB. go-libp2p-pubsub answers each ID once per IWANT and
each message at most ``GossipRetransmission`` (3) times per peer (``handleIWant``);
:class:`BoundedGossipSub` does the same. See ``docs/gossip.md``, "Transport rules".
"""

from __future__ import annotations

from collections import Counter

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.utils import safe_bytes_from_hex

__all__ = ["GOSSIP_RETRANSMISSION", "BoundedGossipSub"]

GOSSIP_RETRANSMISSION = 3
"""Most times one message is sent to one peer in answer to its IWANTs (go-libp2p-pubsub's default)."""


class BoundedGossipSub(GossipSub):
    """:class:`GossipSub` whose IWANT answers hold each message once, at most
    :data:`GOSSIP_RETRANSMISSION` times per peer while the message is in the message cache."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._iwant_served: dict[ID, Counter[bytes]] = {}

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
