"""What a node lets in from the run's gossip topics (trio side): :class:`TopicGate`.

One object owns everything a message meets between py-libp2p and the node's handlers
(``docs/gossip.md``, "Topics and validation" and "Scoring"):

* the :class:`~node.p2p.gossip.EnvelopeValidator` (signature, run, type for the topic, size,
  freshness, signer allowed, no replay), registered as each subscribed topic's libp2p validator so
  it runs before a message is delivered or forwarded; presence uses the same one for workers'
  records and hubs' views, so one dedupe set covers them all;
* the node-record budgets per forwarder on ``nodes`` (one for the records a forwarder published
  itself, one for those it relayed), spent before any signature check;
* the penalty points of forwarders (:class:`~node.p2p.gossip.PeerScores`), and the ban past the limit;
* the envelopes verified and not yet delivered (each message is decoded once), and the count of
  rejected messages by reason.

Everything here runs on the trio thread of the node's bridge.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from node.errors import PublishError
from node.p2p.config import GossipConfig
from node.p2p.gossip import EnvelopeValidator, OverRate, PeerScores, TopicKind, penalty_for
from node.p2p.host import P2PHost
from protocol.envelope import Authorities, Envelope
from protocol.errors import DecodeError, ProtocolError
from protocol.identity import PeerId
from protocol.messages import Message
from protocol.ratelimit import RateLimiter

logger = logging.getLogger(__name__)

__all__ = ["ACCEPTED_CACHE", "TopicGate"]

ACCEPTED_CACHE = 4096
"""Envelopes verified by the topic validator kept for delivery (entries), so each is decoded once."""


class TopicGate:
    """The checks, budgets and penalties of a node's gossip topics (see the module docstring).

    Args:
        run_id: the run's 32-byte ID.
        authorities: coordinator and validator keys of the run spec.
        peer_id: this node's peer ID (its own messages are never budgeted or penalized).
        config: gossip settings (freshness, budgets, penalty limit and half-life).
        heartbeat_interval_s: the run's heartbeat interval, seconds (the budgets' period).
        split_records: records must be on their role's topic (``node.p2p.gossip.record_kind``).

    Attributes:
        envelopes: the envelope validator (shared with presence: one dedupe set).
        scores: forwarders' penalty points.
        rejected: messages rejected on the topics, by reason (trio side).
    """

    def __init__(
        self,
        run_id: bytes,
        authorities: Authorities,
        *,
        peer_id: PeerId,
        config: GossipConfig,
        heartbeat_interval_s: float,
        split_records: bool,
    ) -> None:
        self.peer_id = peer_id
        max_age_s = config.missed_heartbeats * heartbeat_interval_s + config.freshness_slack_s
        self.envelopes = EnvelopeValidator(
            run_id, authorities, max_age_s=max_age_s, max_future_s=config.max_future_s, split_records=split_records,
        )
        self.scores = PeerScores(config.penalty_limit, config.penalty_half_life_s)
        self.records_per_interval = float(config.max_records_per_interval)
        # each forwarder's budgets of node records (the least recently heard forgotten past 4 × max_peers):
        # one for records it published itself, one for records it relayed, so records minted behind an
        # honest hub cannot spend the budget its own heartbeat record needs
        rate = self.records_per_interval / heartbeat_interval_s
        self._own_budget = RateLimiter(rate, self.records_per_interval, max_peers=4 * config.max_peers)
        self._forward_budget = RateLimiter(rate, self.records_per_interval, max_peers=4 * config.max_peers)
        self._accepted: OrderedDict[bytes, Envelope[Message]] = OrderedDict()
        self.rejected: Counter[str] = Counter()

    def validator(self, kind: TopicKind, host: P2PHost) -> Callable[[ID, rpc_pb2.Message], bool]:
        """The libp2p topic validator of ``kind``: ``True`` lets a message be delivered and forwarded.

        A rejected message costs its forwarder the points of :func:`~node.p2p.gossip.penalty_for`
        (none for what it only relayed past a budget or stale: ``docs/gossip.md``, scoring); past
        the limit the forwarder is banned on ``host``.
        """
        own_id = self.peer_id

        def validate(forwarder: ID, msg: rpc_pb2.Message) -> bool:
            sender = PeerId(forwarder.to_base58())
            published = msg.from_id == forwarder.to_bytes()
            try:
                if len(msg.topicIDs) != 1:  # ours go on one topic; py-libp2p's router walks every listed one
                    raise DecodeError(f"message lists {len(msg.topicIDs)} topics, not 1")
                if kind == "nodes" and sender != own_id and self._over_budget(sender, published):
                    raise OverRate(f"more than {self.records_per_interval:g} node records in one heartbeat interval")
                env = self.envelopes.check(kind, msg.data)
            except ProtocolError as e:
                self._reject(kind, sender, e, published, host)
                return False
            self._accepted[host.message_id(msg)] = env
            while len(self._accepted) > ACCEPTED_CACHE:
                self._accepted.popitem(last=False)
            return True

        return validate

    def _over_budget(self, sender: PeerId, published: bool) -> bool:
        """Node records past the forwarder's budget are dropped before any check (minting costs
        the sender its score, and us almost nothing); what it published itself and what it
        relayed are counted apart."""
        budget = self._own_budget if published else self._forward_budget
        return not budget.allow(sender, now_s=trio.current_time())

    def _reject(self, kind: TopicKind, sender: PeerId, error: ProtocolError, published: bool, host: P2PHost) -> None:
        reason, points = penalty_for(error)
        self.rejected[reason] += 1
        logger.debug("rejected %s message from %s: %s", kind, sender, error, extra={"peer_id": sender})
        if reason in ("over_rate", "stale") and not published:
            # relayed valid records: an honest hub forwards what each of its own peers sent within
            # their budgets, and what was fresh when it checked it (a record timed to go stale on
            # the way here); Sybil minters behind it would get it banned here; dropped only
            points = 0.0
        if points and sender != self.peer_id and self.scores.penalize(sender, points):
            self.scores.forget(sender)
            host.ban(sender)

    def take(self, message_id: bytes) -> Envelope[Message] | None:
        """The envelope the validator verified for the delivered message ``message_id`` (once)."""
        return self._accepted.pop(message_id, None)

    def check_outgoing(self, kind: TopicKind, topic: str, data: bytes) -> None:
        """Check an envelope this node is about to publish as its receivers will (not remembered).

        Raises:
            PublishError: receivers would reject it (reason ``"oversized"``, ``"duplicate"``, ``"bad_signer"``, …).
        """
        try:
            self.envelopes.check(kind, data, remember=False)
        except ProtocolError as e:
            reason, _ = penalty_for(e)
            raise PublishError(topic, reason, str(e)) from None

    def stats(self) -> dict[str, Any]:
        """Rejected messages by reason (call on the trio side)."""
        return dict(self.rejected)
