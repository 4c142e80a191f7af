"""The live peer table: what each node's latest signed record says, and when it was last heard.

Fed by the gossip layer with verified records and checkpoint announcements, and by hubs' views and
rosters (``docs/gossip.md``); read by the roles (which relays hold step N, who validates, what the
latest step is). A peer is *alive* while it was last heard less than
``missed_heartbeats × heartbeat_interval_s`` seconds ago: its own record, or a hub that vouches
for it (:meth:`PeerTable.touch`: the hub's roster lists it, or its presence stream is open);
dead peers are hidden from every query and dropped from the table after ten times that.

Plain object, no I/O: use it from one thread (the asyncio loop).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from protocol.identity import PeerId
from protocol.messages import CheckpointAnnouncement, Hardware, NodeRecord, Role

FORGET_AFTER_DEAD_FACTOR = 10
"""A peer silent for this many expiry windows is removed from the table altogether."""

MAX_PEERS = 10_000
"""Peers the table holds at most (≈ 1 KiB a peer). Records are self-signed, so anyone can make any
number of peer IDs. Past this bound a new peer takes the place of a dead one if there is any,
else of the most recently *first seen* live peer whose role was not key-checked: a flood of new
IDs churns among its own newest entries while the peers that were there before it (relays,
workers) keep their places, and the coordinator and the run's validators are never pushed out."""

KEY_CHECKED_ROLES = ("coordinator", "validator")
"""Roles whose claims the gossip layer checked against the run spec's keys."""


@dataclass
class PeerInfo:
    """One peer as its latest record describes it.

    Attributes:
        peer_id: the peer's ID (also its record's signer).
        role: what it says it does (``coordinator`` and ``validator`` claims are key-checked).
        http_url: its HTTP endpoint (relays, coordinator origin), or ``""``.
        addrs: its libp2p multiaddrs.
        version: its software version.
        policy_step: the policy step it works with (−1: none).
        held_steps: checkpoint steps it serves (relays).
        hardware: what it reports about its machine (not verified).
        seq: heartbeat sequence number of the record.
        ts_ms: the record's signed timestamp, milliseconds since the epoch.
        first_seen: local monotonic time of its first record, seconds.
        last_seen: local monotonic time of its latest record, seconds.
    """

    peer_id: PeerId
    role: Role
    http_url: str
    addrs: list[str]
    version: str
    policy_step: int
    held_steps: list[int]
    hardware: Hardware | None
    seq: int
    ts_ms: int
    first_seen: float
    last_seen: float = field(default=0.0)

    def to_json(self, now: float) -> dict[str, object]:
        """A JSON-ready dict (``last_seen_s``: seconds since its latest record)."""
        return {
            "peer_id": self.peer_id,
            "role": self.role,
            "http_url": self.http_url,
            "addrs": list(self.addrs),
            "version": self.version,
            "policy_step": self.policy_step,
            "held_steps": list(self.held_steps),
            "hardware": self.hardware.model_dump() if self.hardware is not None else None,
            "seq": self.seq,
            "last_seen_s": round(max(0.0, now - self.last_seen), 3),
        }


class PeerTable:
    """Live view of the run's peers (see the module docstring).

    Args:
        heartbeat_interval_s: the run's heartbeat interval, seconds.
        missed_heartbeats: intervals of silence after which a peer is dead.
        coordinator: the run's coordinator peer ID (its records and announcements set the latest step).
        clock: monotonic clock, seconds.
        max_peers: see :data:`MAX_PEERS`.
    """

    def __init__(
        self,
        heartbeat_interval_s: float,
        *,
        missed_heartbeats: int = 3,
        coordinator: PeerId | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_peers: int = MAX_PEERS,
    ) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.expiry_s = missed_heartbeats * heartbeat_interval_s
        self.coordinator_id = coordinator
        self._clock = clock
        self._peers: dict[PeerId, PeerInfo] = {}  # insertion order = order of the latest record (moved to the end on update)
        self._arrivals: dict[PeerId, None] = {}  # insertion order = first seen (alive since), newest last
        self.max_peers = max_peers
        self.evicted = 0
        """Peers pushed out by newer ones because the table was full."""
        self._announced_step: int | None = None
        self._announcement: CheckpointAnnouncement | None = None

    # --- updates (from the gossip layer) -----------------------------------------------------

    def update(self, record: NodeRecord, ts_ms: int) -> bool:
        """Apply a verified record signed at ``ts_ms``; older or equal records are ignored.

        Records are ordered by ``(ts_ms, seq)``, so a restarted node (``seq`` from 0 again) is
        taken back as soon as its clock moved on.

        Returns:
            Whether the peer is new or was dead before this record.
        """
        now = self._clock()
        old = self._peers.get(record.peer_id)
        if old is not None and (ts_ms, record.seq) <= (old.ts_ms, old.seq):
            return False
        revived = old is None or not self._alive(old, now)
        if old is None and len(self._peers) >= self.max_peers and not self._make_room(now):
            return False
        self._peers.pop(record.peer_id, None)  # re-inserted last: the dict stays ordered by last record
        if revived:
            self._arrivals.pop(record.peer_id, None)
            self._arrivals[record.peer_id] = None
        self._peers[record.peer_id] = PeerInfo(
            peer_id=PeerId(record.peer_id),
            role=record.role,
            http_url=record.http_url,
            addrs=list(record.addrs),
            version=record.version,
            policy_step=record.policy_step,
            held_steps=sorted(set(record.held_steps)),
            hardware=record.hardware,
            seq=record.seq,
            ts_ms=ts_ms,
            first_seen=now if revived or old is None else old.first_seen,
            last_seen=now,
        )
        return revived

    def _make_room(self, now: float) -> bool:
        """Drop the least recently heard peer if it is dead, else the newest arrival whose role was
        not key-checked (:data:`MAX_PEERS`); ``False`` if only key-checked peers are alive."""
        oldest = next(iter(self._peers.values()))
        victim = oldest if not self._alive(oldest, now) else next(
            (self._peers[pid] for pid in reversed(self._arrivals) if self._peers[pid].role not in KEY_CHECKED_ROLES), None)
        if victim is None:
            return False
        self._forget(victim.peer_id)
        self.evicted += 1
        return True

    def _forget(self, peer_id: PeerId) -> None:
        self._peers.pop(peer_id, None)
        self._arrivals.pop(peer_id, None)

    def touch(self, peer_ids: Iterable[PeerId]) -> None:
        """A hub vouches that these peers are still attached to it: count them as heard now.

        Unknown peer IDs are ignored (a peer enters the table only with its own signed record).
        """
        now = self._clock()
        for peer_id in peer_ids:
            p = self._peers.pop(peer_id, None)
            if p is None:
                continue
            if not self._alive(p, now):
                self._arrivals.pop(peer_id, None)
                self._arrivals[peer_id] = None
                p.first_seen = now
            p.last_seen = now
            self._peers[peer_id] = p  # last: the dict stays ordered by last heard

    def expire(self, peer_id: PeerId) -> None:
        """No hub vouches for ``peer_id`` any more (it left, its stream closed): dead from now on,
        kept in the table like any dead peer until :meth:`prune`."""
        p = self._peers.get(peer_id)
        if p is not None and self._alive(p, self._clock()):
            p.last_seen = self._clock() - self.expiry_s - 1e-3

    def note_announcement(self, announcement: CheckpointAnnouncement) -> bool:
        """Record a verified checkpoint announcement; returns whether it raised the latest step."""
        if self._announced_step is None or announcement.step > self._announced_step:
            self._announced_step = announcement.step
            self._announcement = announcement
            return True
        return False

    def remove(self, peer_id: PeerId) -> None:
        """Forget a peer now (e.g. banned)."""
        self._forget(peer_id)

    def prune(self) -> list[PeerId]:
        """Drop peers dead for ``FORGET_AFTER_DEAD_FACTOR`` expiry windows; returns their IDs."""
        cutoff = self._clock() - FORGET_AFTER_DEAD_FACTOR * self.expiry_s
        gone: list[PeerId] = [p.peer_id for p in self._peers.values() if p.last_seen < cutoff]
        for peer_id in gone:
            self._forget(peer_id)
        return gone

    # --- queries -----------------------------------------------------------------------------

    def alive(self) -> list[PeerInfo]:
        """Every live peer, ordered by role then peer ID."""
        now = self._clock()
        return sorted((p for p in self._peers.values() if self._alive(p, now)), key=lambda p: (p.role, p.peer_id))

    def get(self, peer_id: PeerId) -> PeerInfo | None:
        """The live peer ``peer_id``, or ``None`` if unknown or dead."""
        p = self._peers.get(peer_id)
        return p if p is not None and self._alive(p, self._clock()) else None

    def by_role(self, role: Role) -> list[PeerInfo]:
        """Live peers of one role."""
        return [p for p in self.alive() if p.role == role]

    def relays_holding(self, step: int) -> list[PeerInfo]:
        """Live relays with an HTTP endpoint that say they hold checkpoint ``step``, most recently heard first."""
        found = [p for p in self.by_role("relay") if step in p.held_steps and p.http_url]
        return sorted(found, key=lambda p: -p.last_seen)

    def validators(self) -> list[PeerInfo]:
        """Live validators (their role claims were checked against the run's validator keys)."""
        return self.by_role("validator")

    def coordinator(self) -> PeerInfo | None:
        """The run's coordinator, if alive (looked up by ID when known: called for every delivered
        message, so it must not scan a table that self-signed records can fill)."""
        if self.coordinator_id is not None:
            p = self.get(self.coordinator_id)
            return p if p is not None and p.role == "coordinator" else None
        found = self.by_role("coordinator")
        return found[0] if found else None

    def latest_step(self) -> int | None:
        """The newest checkpoint step the coordinator announced or reports (``None``: none yet)."""
        steps = [s for s in (self._announced_step,) if s is not None]
        coord = self.coordinator()
        if coord is not None and coord.policy_step >= 0:
            steps.append(coord.policy_step)
        return max(steps) if steps else None

    @property
    def latest_announcement(self) -> CheckpointAnnouncement | None:
        """The announcement of the highest step seen, if any."""
        return self._announcement

    def __len__(self) -> int:
        return len(self.alive())

    def __contains__(self, peer_id: object) -> bool:
        return isinstance(peer_id, str) and self.get(PeerId(peer_id)) is not None

    def __iter__(self) -> Iterator[PeerInfo]:
        return iter(self.alive())

    def _alive(self, p: PeerInfo, now: float) -> bool:
        return now - p.last_seen <= self.expiry_s


def origin_urls_of(peers: PeerTable, origin_urls: list[str] | tuple[str, ...] = (), own_url: str = "") -> list[str]:
    """The run's origins as coordinator-signed sources name them, deduplicated.

    The coordinator's record ``http_url`` (its role is key-checked), the latest announcement's
    ``origin_url`` (coordinator-signed) and ``origin_urls`` from the run spec; never ``own_url``.
    """
    origins: list[str] = []
    coord = peers.coordinator()
    if coord is not None and coord.http_url:
        origins.append(coord.http_url)
    ann = peers.latest_announcement
    if ann is not None and ann.origin_url:
        origins.append(ann.origin_url)
    origins.extend(origin_urls)
    return [u for u in dict.fromkeys(origins) if u and u != own_url]


def pick_upstreams(
    peers: PeerTable,
    *,
    own_peer_id: PeerId,
    own_url: str = "",
    origin_urls: list[str] | tuple[str, ...] = (),
    fanout: int = 3,
) -> list[str]:
    """Choose the HTTP sources a relay should follow, from gossip (relays form a tree).

    Wanted step: the latest announced step. Up to ``fanout`` live relays that already hold it are
    chosen, so most pieces come from them and the origin's upload is not the bottleneck; the
    origins (:func:`origin_urls_of`) are always added after them, so relay records (self-signed:
    anyone can make many) can never push the origin out of a relay's sources. Among holders the
    choice is a rendezvous hash of (``own_peer_id``, their peer ID): stable for one relay, spread
    across relays. With nothing announced and no origin known the answer is empty (serve only
    the own store).

    Args:
        peers: the live peer table.
        own_peer_id: this relay's peer ID (never chosen).
        own_url: this relay's HTTP URL (never chosen).
        origin_urls: origin URLs from the run spec.
        fanout: how many relays to follow besides the origins.

    Returns:
        Base URLs, relays first, then every origin.
    """
    origins = origin_urls_of(peers, origin_urls, own_url)
    step = peers.latest_step()
    holders: list[PeerInfo] = []
    if step is not None:
        holders = [p for p in peers.relays_holding(step) if p.peer_id != own_peer_id and p.http_url != own_url and p.http_url not in origins]

    def rank(p: PeerInfo) -> bytes:
        return hashlib.sha256(f"{own_peer_id}|{p.peer_id}".encode()).digest()

    chosen = list(dict.fromkeys(p.http_url for p in sorted(holders, key=rank)))[:fanout]
    return chosen + origins


class Vouchers:
    """Which hubs vouch for which peers (plain bookkeeping for :class:`PeerTable`).

    A peer stays alive while at least one hub vouches for it; when the last one stops, the caller
    expires it (:meth:`PeerTable.expire`).
    """

    def __init__(self) -> None:
        self._by_hub: dict[PeerId, set[PeerId]] = {}
        self._count: dict[PeerId, int] = {}

    def set(self, hub: PeerId, members: Iterable[PeerId]) -> list[PeerId]:
        """Hub ``hub`` now vouches for exactly ``members``; returns peers no hub vouches for any more."""
        new = set(members)
        old = self._by_hub.pop(hub, set())
        for p in new - old:
            self._count[p] = self._count.get(p, 0) + 1
        orphans = [p for p in old - new if self._drop(p)]
        if new:
            self._by_hub[hub] = new
        return orphans

    def add(self, hub: PeerId, peer_id: PeerId) -> None:
        """Hub ``hub`` also vouches for ``peer_id``."""
        members = self._by_hub.setdefault(hub, set())
        if peer_id not in members:
            members.add(peer_id)
            self._count[peer_id] = self._count.get(peer_id, 0) + 1

    def remove(self, hub: PeerId, peer_id: PeerId) -> bool:
        """Hub ``hub`` no longer vouches for ``peer_id``; returns whether no hub does now."""
        members = self._by_hub.get(hub)
        if members is None or peer_id not in members:
            return False
        members.discard(peer_id)
        if not members:
            del self._by_hub[hub]
        return self._drop(peer_id)

    def _drop(self, peer_id: PeerId) -> bool:
        self._count[peer_id] -= 1
        if self._count[peer_id] <= 0:
            del self._count[peer_id]
            return True
        return False

    def members(self, hub: PeerId) -> frozenset[PeerId]:
        """The peers ``hub`` vouches for."""
        return frozenset(self._by_hub.get(hub, ()))

    def vouched(self, peer_id: PeerId) -> bool:
        """Whether any hub vouches for ``peer_id``."""
        return peer_id in self._count

    def hubs(self) -> list[PeerId]:
        """Hubs vouching for at least one peer."""
        return list(self._by_hub)
