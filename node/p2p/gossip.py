"""Per-run gossip topics, the envelope check every message passes before delivery or forwarding,
and penalty scores for peers that forward invalid messages.

Topics (``/intellect/<first 16 hex digits of the run ID>/<kind>/1``):

============ =============================== =================== ============================
kind         message type                    signer              limit (bytes)
============ =============================== =================== ============================
nodes        ``node_record/1`` (infra roles) the record's node   8 KiB
workers      ``node_record/1`` (worker,      the record's node   8 KiB
             observer)
checkpoints  ``checkpoint_announcement/1``   coordinator         4 KiB
verdicts     ``verdict/1``                   a run validator     64 KiB
bans         ``ban_list/1``                  coordinator         :data:`BAN_GOSSIP_MAX_BYTES` (128 KiB)
============ =============================== =================== ============================

Records are split by who needs them (:func:`record_kind`, :func:`subscribed_kinds`): records
of the *hubs* (coordinator, relay, validator: few) go on ``nodes``, read by hubs and silent
observers; workers never put their records on gossip — they send them to the hubs they are
connected to over a presence stream (``node.p2p.presence``), and each hub's record names its
roster. ``workers`` carries worker and observer records only in the issue-18 layout kept for
benchmark comparison (``GossipConfig.presence=False``). A record on the wrong topic for its role
is rejected.

A node record claiming role ``coordinator`` must be signed by the run's coordinator key, and one
claiming ``validator`` by a validator key of the run. Messages are never larger than
:data:`GOSSIP_MAX_BYTES` (py-libp2p silently drops RPCs of 1 MiB or more). Each topic has its own
cap, checked before anything is decoded; ban lists larger than theirs travel over HTTP only
(``GET /ingest/1/bans``).

Nothing here touches sockets or event loops: :class:`EnvelopeValidator` and :class:`PeerScores`
are plain objects used from the libp2p topic validator (on the trio side).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from protocol.envelope import Authorities, Envelope, open_envelope
from protocol.errors import DecodeError, ProtocolError, SchemaError, SignatureError, TooLarge, WrongRunError
from protocol.identity import PeerId
from protocol.messages import HUB_ROLES, BanList, CheckpointAnnouncement, KiB, Message, MiB, NodeRecord, Verdict

TopicKind = Literal["nodes", "workers", "checkpoints", "verdicts", "bans"]
TOPIC_KINDS: tuple[TopicKind, ...] = ("nodes", "workers", "checkpoints", "verdicts", "bans")
INFRA_ROLES = frozenset(HUB_ROLES)
"""Roles whose records go on the ``nodes`` topic (every node subscribes); the rest use ``workers``."""
TOPIC_VERSION = 1
GOSSIP_MAX_BYTES = 1 * MiB - 64 * KiB
"""Largest gossip payload, in bytes: under py-libp2p's 1 MiB RPC limit with room for framing."""
BAN_GOSSIP_MAX_BYTES = 128 * KiB
"""Largest ban list gossiped, in bytes (a few hundred entries with their evidence): a bigger
message would hold the trio loop while it is verified and decoded."""
SEEN_CAPACITY = 1 << 16
"""Envelope IDs remembered for deduplication (entries, not bytes)."""


@dataclass(frozen=True)
class TopicRule:
    """What one topic carries: the message class and its size limit in bytes."""

    kind: TopicKind
    message: type[Message]
    max_bytes: int


TOPIC_RULES: dict[TopicKind, TopicRule] = {
    "nodes": TopicRule("nodes", NodeRecord, NodeRecord.MAX_BYTES),
    "workers": TopicRule("workers", NodeRecord, NodeRecord.MAX_BYTES),
    "checkpoints": TopicRule("checkpoints", CheckpointAnnouncement, CheckpointAnnouncement.MAX_BYTES),
    "verdicts": TopicRule("verdicts", Verdict, Verdict.MAX_BYTES),
    "bans": TopicRule("bans", BanList, min(BanList.MAX_BYTES, BAN_GOSSIP_MAX_BYTES)),
}


def topic_name(run_id: bytes, kind: TopicKind) -> str:
    """The gossipsub topic of ``kind`` in run ``run_id`` (32 bytes), e.g. ``/intellect/3fa2…/nodes/1``."""
    if kind not in TOPIC_RULES:
        raise ValueError(f"unknown topic kind {kind!r}")
    return f"/intellect/{run_id.hex()[:16]}/{kind}/{TOPIC_VERSION}"


def topic_names(run_id: bytes) -> dict[TopicKind, str]:
    """Every topic of the run, by kind."""
    return {kind: topic_name(run_id, kind) for kind in TOPIC_KINDS}


def record_kind(role: str, *, split: bool = True) -> TopicKind:
    """The topic a node of ``role`` publishes its records on (``split=False``: always ``nodes``,
    the single-topic layout kept for benchmark comparison)."""
    return "nodes" if role in INFRA_ROLES or not split else "workers"


def subscribed_kinds(role: str, *, split: bool = True, publishes_records: bool = True, presence: bool = False) -> tuple[TopicKind, ...]:
    """Topics a node of ``role`` subscribes to.

    With ``presence`` (the default layout, ``docs/gossip.md``): hubs (coordinator, relays,
    validators) and silent observers read ``nodes`` (hubs' records), ``checkpoints``, ``verdicts``
    and ``bans``; workers read ``checkpoints``, ``verdicts`` and ``bans`` only — they learn the
    hubs from the views their hubs send, and nobody reads ``workers``.

    Without it (the issue-18 layout, kept for benchmarks): everyone reads ``nodes``,
    ``checkpoints``, ``verdicts``, ``bans``; ``workers`` only infrastructure roles and a silent
    observer (``publishes_records=False``). ``split=False``: every topic.
    """
    if presence:
        shared: tuple[TopicKind, ...] = ("checkpoints", "verdicts", "bans")
        return ("nodes", *shared) if role in INFRA_ROLES or not publishes_records else shared
    if not split or role in INFRA_ROLES or not publishes_records:
        return TOPIC_KINDS
    return tuple(k for k in TOPIC_KINDS if k != "workers")


class DuplicateEnvelope(ProtocolError):
    """An envelope already accepted once (a replay within the freshness window, or an echo)."""


class OverRate(ProtocolError):
    """A forwarder sent more node records than its budget per heartbeat interval (dropped unverified)."""


class EnvelopeValidator:
    """Checks gossip payloads for one run: signature, run ID, type for the topic, size, freshness,
    signer allowed, and no replay of an already accepted envelope.

    Args:
        run_id: the run's 32-byte ID.
        authorities: coordinator and validator keys of the run spec.
        max_age_s: oldest accepted timestamp, seconds before now.
        max_future_s: newest accepted timestamp, seconds after now (clock skew).
        clock: wall clock in seconds since the epoch (tests pass a fake one).
        split_records: records must be on their role's topic (:func:`record_kind`); ``False``
            accepts every record on ``nodes`` only (the single-topic layout).
    """

    def __init__(
        self,
        run_id: bytes,
        authorities: Authorities,
        *,
        max_age_s: float,
        max_future_s: float,
        clock: Callable[[], float] = time.time,
        split_records: bool = True,
    ) -> None:
        self.split_records = split_records
        self.run_id = run_id
        self.authorities = authorities
        self.max_age_s = max_age_s
        self.max_future_s = max_future_s
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # envelope ID → forget after (epoch s)

    def check(self, kind: TopicKind, data: bytes, *, remember: bool = True) -> Envelope[Message]:
        """Verify ``data`` received on the ``kind`` topic.

        Args:
            kind: the topic it came on.
            data: the gossip payload (an envelope).
            remember: record its ID so a second copy is rejected as a duplicate.

        Returns:
            The verified envelope.

        Raises:
            DuplicateEnvelope: this exact envelope was accepted before (not misbehaviour).
            DecodeError, SchemaError, WrongRunError, SignatureError: invalid (misbehaviour,
                except a ``ts_ms`` :class:`SchemaError`, which may be clock skew).
        """
        rule = TOPIC_RULES[kind]
        if len(data) > rule.max_bytes:
            raise TooLarge(f"{len(data)} bytes on the {kind} topic, over its limit of {rule.max_bytes}")
        now = self._clock()
        env = open_envelope(
            data,
            run_id=self.run_id,
            authorities=self.authorities,
            expect=rule.message,
            max_bytes=rule.max_bytes,
            now_ms=int(now * 1000),
            max_age_s=self.max_age_s,
            max_future_s=self.max_future_s,
        )
        if isinstance(env.body, NodeRecord):
            self._check_role(env.body, env.signer)
            if kind != record_kind(env.body.role, split=self.split_records):
                raise SchemaError(f"a {env.body.role} record on the {kind} topic (it belongs on {record_kind(env.body.role, split=self.split_records)})",
                                  "body.role")
        env_id = bytes(env.id)
        self._expire(now)
        if env_id in self._seen:
            raise DuplicateEnvelope(f"{env.type} envelope {env_id.hex()[:16]}… already seen")
        if remember:
            self._seen[env_id] = now + self.max_age_s + self.max_future_s
            while len(self._seen) > SEEN_CAPACITY:
                self._seen.popitem(last=False)
        return env

    def _check_role(self, record: NodeRecord, signer: bytes) -> None:
        if record.role == "coordinator" and signer != self.authorities.coordinator:
            raise SignatureError(f"{record.peer_id} claims role coordinator but is not the run's coordinator")
        if record.role == "validator" and signer not in self.authorities.validators:
            raise SignatureError(f"{record.peer_id} claims role validator but is not a validator of the run")

    def _expire(self, now: float) -> None:
        while self._seen:
            env_id, forget_at = next(iter(self._seen.items()))
            if forget_at > now:
                break
            del self._seen[env_id]


Penalty = float

PENALTY_INVALID: Penalty = 10.0
"""Points for a forged, malformed, wrong-run, wrong-type, oversized or wrongly signed message."""
PENALTY_OVER_RATE: Penalty = 1.0
"""Points for a node record past a forwarder's budget (:class:`OverRate`) that the forwarder
published itself: 50 of them and it is disconnected, so minting records costs an attacker its
connection. One it only relayed costs nothing (``node/p2p/service.py``): minters behind an honest
relay, each within its budget there, would otherwise get the relay banned."""
PENALTY_STALE: Penalty = 0.5
"""Points for a message outside the freshness window: an honest peer's clock can be off, or an
overloaded peer forward late, so it takes a hundred of them to reach the default limit. A stale
one the forwarder only relayed costs nothing (``node/p2p/service.py``): a minter behind an honest
relay times its records to be fresh at the relay and stale one hop later, a hundred of them in a
second."""


def penalty_for(error: ProtocolError) -> tuple[str, Penalty]:
    """The reason tag and penalty points for a rejected message (0 points: not misbehaviour)."""
    if isinstance(error, DuplicateEnvelope):
        return "duplicate", 0.0
    if isinstance(error, OverRate):
        return "over_rate", PENALTY_OVER_RATE
    if isinstance(error, SchemaError) and error.field == "ts_ms":
        return "stale", PENALTY_STALE
    if isinstance(error, WrongRunError):
        return "wrong_run", PENALTY_INVALID
    if isinstance(error, SignatureError):
        return "bad_signer", PENALTY_INVALID
    if isinstance(error, TooLarge):
        return "oversized", PENALTY_INVALID
    if isinstance(error, DecodeError):
        return "malformed", PENALTY_INVALID
    if isinstance(error, SchemaError):
        return "bad_schema", PENALTY_INVALID
    return "invalid", PENALTY_INVALID


class PeerScores:
    """Penalty points per peer, decaying exponentially; a peer over the limit is to be disconnected.

    Args:
        limit: points at which :meth:`penalize` reports the peer as over the limit.
        half_life_s: points halve every this many seconds.
        clock: monotonic clock in seconds.
    """

    def __init__(self, limit: float, half_life_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.half_life_s = half_life_s
        self._clock = clock
        self._points: dict[PeerId, tuple[float, float]] = {}  # peer → (points, at)

    def points(self, peer_id: PeerId) -> float:
        """Current points of ``peer_id`` (0 for an unknown peer)."""
        points, at = self._points.get(peer_id, (0.0, 0.0))
        if points == 0.0:
            return 0.0
        return points * math.pow(0.5, (self._clock() - at) / self.half_life_s)

    def penalize(self, peer_id: PeerId, points: float) -> bool:
        """Add ``points`` to ``peer_id``; returns whether it is now at or over the limit."""
        total = self.points(peer_id) + points
        self._points[peer_id] = (total, self._clock())
        return total >= self.limit

    def forget(self, peer_id: PeerId) -> None:
        """Drop a peer's points (after it was disconnected and banned)."""
        self._points.pop(peer_id, None)

    def prune(self, below: float = 0.01) -> None:
        """Forget peers whose points decayed under ``below``."""
        for peer_id in [p for p in self._points if self.points(p) < below]:
            del self._points[peer_id]
