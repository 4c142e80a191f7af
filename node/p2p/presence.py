"""Worker presence at its hubs, and hubs' rosters (trio side; wire format in ``protocol.presence``).

Why: a worker record flooded on gossip costs every hub ≈ 1 ms of py-libp2p CPU per record it takes
in and again per peer it forwards to, every heartbeat interval, so a relay paid ≈ 0.3 % of a core
per worker attached (``docs/gossip.md``). Here a worker tells only the hubs it is connected to that
it is alive, over a stream on that connection, and what the rest of the network learns is one
signed record per hub per interval naming the hub's roster by content ID:

* :class:`PresenceHub` (coordinator, relays, validators) accepts ``presence/1`` streams: a worker's
  ``RECORD`` is verified (signature, run, freshness, role ``worker``, its subject is the stream's
  authenticated peer, newer than the last one) before it is counted; ``BEAT`` frames and the open
  connection keep it attached. Frames over a per-stream budget are dropped unread-as-records and a
  peer that keeps sending them is banned. The verified records of the attached workers form the
  *roster*, served on ``roster/1`` by its ID. The hub sends each worker a ``VIEW`` — the live hubs'
  signed records — when the stream opens and whenever it changes.
* :class:`PresenceClient` (workers) keeps one stream to every connected peer that speaks the
  protocol, sends its record when it changes and a beat every ``PRESENCE_BEAT_INTERVALS``
  intervals, and hands received views to the node.
* :class:`RosterFetcher` (coordinator, ``node status``) fetches a hub's roster when the ID in its
  record changes — the changes since the roster it holds of that hub when the hub still has that
  one, else the whole roster —, checks the result hashes to the ID, and verifies every record it
  has not verified before.

Everything here runs on the trio thread of the node's bridge; results cross to asyncio through
callbacks the node passes in (its ``to_asyncio``).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from node.p2p.gossip import DuplicateEnvelope, OverRate
from node.p2p.host import P2PHost, libp2p_id, parse_peer_addr
from protocol.envelope import Envelope
from protocol.errors import DecodeError, ProtocolError, SchemaError, TooLarge
from protocol.identity import PeerId
from protocol.messages import NodeRecord
from protocol.presence import (
    BEAT,
    DELTA,
    FRAME_MAX_BYTES,
    HUB_KINDS,
    LENGTH_BYTES,
    MISSED_BEATS,
    PRESENCE_BEAT_INTERVALS,
    RECORD,
    ROSTER_MAX_BYTES,
    ROSTER_REQUEST_BYTES,
    VIEW,
    VIEW_MAX_BYTES,
    VIEW_MAX_ENTRIES,
    WORKER_FRAME_MAX_BYTES,
    WORKER_KINDS,
    frame,
    frame_length,
    pack_roster,
    pack_roster_answer,
    pack_roster_delta,
    parse_roster_request,
    presence_protocol,
    read_roster_answer,
    roster_protocol,
    roster_request,
    split_frame,
    unpack_envelopes,
)
from protocol.ratelimit import RateLimiter, TokenBucket

logger = logging.getLogger(__name__)

__all__ = ["PresenceClient", "PresenceHub", "RosterFetcher"]

READ_CHUNK_BYTES = 64 * 1024
OPEN_TIMEOUT_S = 5.0
"""Opening a stream (protocol negotiation included), seconds."""
WRITE_TIMEOUT_S = 10.0
"""One frame written to a peer, seconds; a peer that does not read is dropped."""
ROSTER_TIMEOUT_S = 10.0
"""A whole roster request (open, ask, read the answer), seconds."""
NOT_A_HUB_S = 60.0
"""After a peer refused the presence protocol, seconds before trying it again."""
RETRY_OPEN_S = 2.0
"""After opening a presence stream failed otherwise (timeout, reset), seconds before trying again."""
FRAMES_PER_INTERVAL = 2.0
"""Frame budget of one presence stream, per heartbeat interval (an honest worker sends a beat every
five intervals and a record when its policy step changes)."""
FRAME_BURST = 8.0
"""Frames a presence stream may send at once."""
OVER_BUDGET_LIMIT = 16
"""Frames over budget after which the peer is banned (each is dropped unparsed)."""
VIEWS_PER_INTERVAL = 2.0
"""Views a worker takes from one hub per heartbeat interval: twice what an honest hub sends (one when
the stream opens, then at most one per interval: ``node.p2p.liveness.VIEW_SETTLE_INTERVALS``). Each
view may make a worker verify up to 256 signatures, so a peer posing as a hub must not choose how many."""
VIEW_BURST = 4.0
"""Views a hub may send at once."""
OPENS_PER_INTERVAL = 1.0
"""Presence streams a hub accepts from one peer per heartbeat interval. Each new stream replaces the
peer's last one and is sent the hub's view (up to 1 MiB) at once, so streams opened back to back
cost the hub CPU and upload for a few bytes each (one identity opened 220 a second: 0.7 of the
hub's core); an honest worker opens one per connection, and again only after it ended."""
OPEN_BURST = 4.0
"""Presence streams a peer may open at once."""
ROSTERS_KEPT = 4
"""Recent rosters a hub still serves by ID (a fetch may name one that just changed)."""
ROSTER_REQUESTS_PER_INTERVAL = 1.0
ROSTER_REQUEST_BURST = 4.0
VERIFIED_CACHE = 16384
"""Roster entries (envelope IDs) a fetcher remembers as verified, so an unchanged worker costs no check."""
FETCH_CONCURRENCY = 4
ENTRY_CHECKS_PER_S = 1024.0
"""Roster entries a fetcher verifies per second, over all hubs (≈ 0.15 ms of CPU each: ≈ 15 % of a
core). Anyone may run a hub and roster entries have no age limit, so a fake hub can serve rosters
of 4,096 records minted once, in advance, each time its record names a new roster: 4 such hubs
kept a coordinator's process at 0.95 of a core. An honest load is one check per worker record
change (a worker's record changes with its policy step), so this follows ≈ 30,000 workers at one
policy step per 30 s; a roster whose new entries exceed what is left waits for the next try."""
ENTRY_CHECK_BURST = 4096.0
"""Entry checks a fetcher may spend at once: one full roster (``ROSTER_MAX_ENTRIES``)."""
HUBS_REMEMBERED = 4096
"""Hubs whose fetched roster a fetcher remembers (and vouches for), least recently heard dropped
first: a dropped hub's roster is fetched again when its record next arrives. Before, every record
on ``nodes`` left an entry for good, and identities are free (≈ 128 a second through one
forwarder's budget)."""
FETCHES_WANTED_MAX = 1024
"""Roster fetches waiting for a slot; past it the longest-waiting one of a hub never fetched and not
connected is dropped (its next record asks again). Any record may name a roster and addresses, and
each fetch of an unreachable one holds a slot for the dial timeout: before, every such record queued
a task for good (512 minted records in 15 s kept an honest relay's new worker from the coordinator
for over 2 minutes)."""
HELD_ROSTERS_MAX_BYTES = 64 * 1024 * 1024
"""Bytes of hubs' roster entries a fetcher keeps to apply deltas to (beyond it, the hubs fetched
longest ago are fetched whole next time): anyone may run a relay, so their number is not bounded."""


class StreamReader:
    """Exact reads from a libp2p stream, buffered (raises ``EOFError`` if the stream ends first)."""

    def __init__(self, stream: INetStream) -> None:
        self.stream = stream
        self._buf = bytearray()

    async def exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = await self.stream.read(READ_CHUNK_BYTES)
            if not chunk:
                raise EOFError("stream ended")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def frame(self, *, max_bytes: int, kinds: frozenset[int]) -> tuple[int, bytes]:
        """The next presence frame's ``(kind, payload)``.

        Raises:
            DecodeError: a length over ``max_bytes`` or a kind not in ``kinds``.
            EOFError, libp2p stream errors: the stream ended.
        """
        n = frame_length(await self.exactly(LENGTH_BYTES), max_bytes=max_bytes, kinds=kinds)
        return split_frame(await self.exactly(n), kinds=kinds)


async def _close(stream: INetStream) -> None:
    with trio.move_on_after(1.0):
        try:
            await stream.reset()
        except Exception as e:  # noqa: BLE001 - already gone
            logger.debug("closing a presence stream: %r", e)


def _peer_of(stream: INetStream) -> PeerId:
    return PeerId(stream.muxed_conn.peer_id.to_base58())


@dataclass
class _Attached:
    """One worker's presence stream at a hub."""

    peer_id: PeerId
    stream: INetStream
    budget: TokenBucket
    last_frame: float
    envelope: bytes = b""
    order: tuple[int, int] = (-1, -1)  # (ts_ms, seq) of the record held
    over_budget: int = 0
    view_version: int = -1
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class PresenceHub:
    """The hub side of presence (see the module docstring).

    Args:
        run_id: the run's 32-byte ID.
        peer_id: this hub's peer ID.
        heartbeat_interval_s: the run's heartbeat interval, seconds.
        check_record: verifies a worker's ``node_record/1`` envelope and returns it (raises
            :class:`~protocol.errors.ProtocolError`; a duplicate of an accepted envelope included).
        on_attach: called with each accepted record envelope (the worker's newest).
        on_detach: called with a worker's peer ID when it is no longer attached.
        ban: disconnect and blacklist a peer (by peer ID).
        max_attached: most workers attached at once (the hub's connection limit).
        clock: trio clock, seconds (tests may pass another).
    """

    def __init__(
        self,
        run_id: bytes,
        *,
        peer_id: PeerId,
        heartbeat_interval_s: float,
        check_record: Callable[[bytes], Envelope[NodeRecord]],
        on_attach: Callable[[Envelope[NodeRecord]], None],
        on_detach: Callable[[PeerId], None],
        ban: Callable[[PeerId], None],
        max_attached: int,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.run_id = run_id
        self.peer_id = peer_id
        self.interval_s = heartbeat_interval_s
        self.check_record = check_record
        self.on_attach = on_attach
        self.on_detach = on_detach
        self.ban = ban
        self.max_attached = max_attached
        self._clock = clock
        self._attached: dict[PeerId, _Attached] = {}
        self._roster_dirty = True
        self._roster: tuple[int, bytes] = (0, b"")
        self._rosters: OrderedDict[bytes, tuple[bytes, list[bytes]]] = OrderedDict()  # ID → (packed, entries)
        # per-peer budgets, the least recently used forgotten past 4 × the workers a hub holds
        self._roster_budget = RateLimiter(ROSTER_REQUESTS_PER_INTERVAL / self.interval_s, ROSTER_REQUEST_BURST,
                                          max_peers=4 * max_attached)
        self._opens = RateLimiter(OPENS_PER_INTERVAL / self.interval_s, OPEN_BURST, max_peers=4 * max_attached)
        self._view = b""
        self._view_version = 0
        self._view_changed = trio.Event()
        self.counters: Counter[str] = Counter()

    @property
    def beat_timeout_s(self) -> float:
        """A worker silent (no frame) this long is detached, seconds."""
        return MISSED_BEATS * PRESENCE_BEAT_INTERVALS * self.interval_s

    def install(self, host: P2PHost) -> None:
        """Register the presence and roster stream handlers on ``host`` (before it serves)."""
        host.host.set_stream_handler(TProtocol(presence_protocol(self.run_id)), self._handle_presence)
        host.host.set_stream_handler(TProtocol(roster_protocol(self.run_id)), self._handle_roster)

    async def run(self) -> None:
        """Detach workers whose beats stopped (their connection still up); runs until cancelled."""
        while True:
            await trio.sleep(self.interval_s)
            now = self._clock()
            for a in [a for a in self._attached.values() if now - a.last_frame > self.beat_timeout_s]:
                self.counters["beat_timeouts"] += 1
                logger.debug("worker %s sent nothing for %.0f s; detaching it", a.peer_id, now - a.last_frame, extra={"peer_id": a.peer_id})
                a.scope.cancel()  # its handler ends (a read blocked on a reset stream is not always woken)

    # --- roster ---------------------------------------------------------------------------

    def roster(self) -> tuple[int, bytes]:
        """``(workers, roster ID)`` of the attached workers with a verified record (``(0, b"")``: none)."""
        if self._roster_dirty:
            self._roster_dirty = False
            envelopes = [a.envelope for a in self._attached.values() if a.envelope]
            if not envelopes:
                self._roster = (0, b"")
            else:
                roster_id, data = pack_roster(envelopes)
                self._roster = (len(envelopes), bytes(roster_id))
                self._rosters[bytes(roster_id)] = (data, envelopes)
                self._rosters.move_to_end(bytes(roster_id))
                while len(self._rosters) > ROSTERS_KEPT:
                    self._rosters.popitem(last=False)
        return self._roster

    def attached(self) -> list[PeerId]:
        """Peer IDs of the workers attached with a verified record."""
        return [a.peer_id for a in self._attached.values() if a.envelope]

    # --- views ----------------------------------------------------------------------------

    def set_view(self, view: bytes) -> None:
        """Send ``view`` (a packed list of hub record envelopes) to every attached worker."""
        self._view = view
        self._view_version += 1
        changed, self._view_changed = self._view_changed, trio.Event()
        changed.set()

    def refresh_view(self, view: bytes) -> None:
        """Newer copies of the same view: streams opened from now on get them; none is resent."""
        self._view = view

    async def _send_views(self, a: _Attached) -> None:
        while True:
            if self._view and a.view_version != self._view_version:
                a.view_version = self._view_version
                with trio.move_on_after(WRITE_TIMEOUT_S) as scope:
                    await a.stream.write(frame(VIEW, self._view))
                if scope.cancelled_caught:
                    self.counters["view_write_timeouts"] += 1
                    return
                self.counters["views_sent"] += 1
            await self._view_changed.wait()

    # --- streams --------------------------------------------------------------------------

    async def _handle_presence(self, stream: INetStream) -> None:
        peer = _peer_of(stream)
        now = self._clock()
        if not self._may_open(peer, now):
            await _close(stream)
            return
        old = self._attached.get(peer)
        if old is None and len(self._attached) >= self.max_attached:
            self.counters["refused_full"] += 1
            await _close(stream)
            return
        a = _Attached(peer, stream, TokenBucket(FRAMES_PER_INTERVAL / self.interval_s, FRAME_BURST, now), now)
        self._attached[peer] = a
        if old is not None:  # the newest stream of a peer wins; its record and budget carry over
            a.envelope, a.order, a.budget, a.over_budget = old.envelope, old.order, old.budget, old.over_budget
            old.scope.cancel()
        self.counters["streams_accepted"] += 1
        try:
            with a.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_views, a)
                    try:
                        await self._read_frames(a)
                    finally:
                        nursery.cancel_scope.cancel()
        except Exception as e:  # noqa: BLE001 - whatever ended the stream ends only this worker's attachment
            logger.debug("presence stream of %s ended: %r", peer, e, extra={"peer_id": peer})
        finally:
            if self._attached.get(peer) is a:
                del self._attached[peer]
                if a.envelope:
                    self._roster_dirty = True
                    self.on_detach(peer)
            await _close(stream)

    async def _read_frames(self, a: _Attached) -> None:
        reader = StreamReader(a.stream)
        while True:
            try:
                kind, payload = await reader.frame(max_bytes=WORKER_FRAME_MAX_BYTES, kinds=WORKER_KINDS)
            except DecodeError as e:
                self._offence(a, "malformed", str(e))
                return
            except Exception as e:  # noqa: BLE001 - EOF or libp2p's stream errors: the stream is over
                logger.debug("presence stream of %s: %r", a.peer_id, e)
                return
            now = self._clock()
            if not a.budget.take(now):
                a.over_budget += 1
                self.counters["over_budget"] += 1
                if a.over_budget > OVER_BUDGET_LIMIT:
                    self._offence(a, "over_budget", f"{a.over_budget} frames over {FRAMES_PER_INTERVAL:g} per interval")
                    return
                continue  # dropped before any decoding or signature check
            a.last_frame = now
            if kind == BEAT:
                self.counters["beats"] += 1
                continue
            if not self._take_record(a, payload):
                return

    def _take_record(self, a: _Attached, payload: bytes) -> bool:
        """Verify and hold a worker's record; ``False`` when the peer was cut off for it."""
        try:
            env = self.check_record(payload)
        except SchemaError as e:
            if e.field == "ts_ms":  # stale or ahead: clock skew or a slow worker, not forgery
                self.counters["records_stale"] += 1
                return True
            self._offence(a, "bad_record", str(e))
            return False
        except DuplicateEnvelope:
            self.counters["records_replayed"] += 1
            return True
        except ProtocolError as e:
            self._offence(a, "bad_record", str(e))
            return False
        record = env.body
        if record.peer_id != a.peer_id:
            self._offence(a, "not_own_record", f"sent the record of {record.peer_id}")
            return False
        if record.role not in ("worker", "observer"):
            self._offence(a, "bad_record", f"a {record.role} record on a presence stream")
            return False
        order = (env.ts_ms, record.seq)
        if order <= a.order:
            self.counters["records_replayed"] += 1
            return True
        a.order = order
        a.envelope = env.raw
        self._roster_dirty = True
        self.counters["records"] += 1
        self.on_attach(env)
        return True

    def _may_open(self, peer: PeerId, now: float) -> bool:
        """Whether ``peer`` may open another presence stream now (:data:`OPENS_PER_INTERVAL`). One
        over it is closed before anything is sent, and the peer is not banned for it: a full hub
        closes honest workers' streams too, and they open them again every second."""
        if self._opens.allow(peer, now_s=now):
            return True
        self.counters["opens_over_budget"] += 1
        return False

    def _offence(self, a: _Attached, reason: str, detail: str) -> None:
        self.counters[f"refused_{reason}"] += 1
        logger.info("presence: cutting off %s (%s): %s", a.peer_id, reason, detail[:200], extra={"peer_id": a.peer_id})
        self.ban(a.peer_id)

    async def _handle_roster(self, stream: INetStream) -> None:
        peer = _peer_of(stream)
        now = self._clock()
        try:
            if not self._roster_budget.allow(peer, now_s=now):
                self.counters["roster_over_budget"] += 1
                return
            with trio.move_on_after(ROSTER_TIMEOUT_S):
                wanted, held = parse_roster_request(await StreamReader(stream).exactly(ROSTER_REQUEST_BYTES))
                self.roster()
                answer = self._roster_answer(wanted, held)
                await stream.write(len(answer).to_bytes(LENGTH_BYTES, "big") + answer)
                await stream.close()
        except Exception as e:  # noqa: BLE001 - a malformed request, or a requester that went away
            logger.debug("roster request from %s: %r", peer, e)
        finally:
            await _close(stream)

    def _roster_answer(self, wanted: bytes, held: bytes) -> bytes:
        """The answer to a request for roster ``wanted`` from a reader holding roster ``held``: the
        changes since ``held`` when this hub still has it and they are smaller, else the whole
        roster; ``b""`` when ``wanted`` is not one of the last :data:`ROSTERS_KEPT`."""
        if wanted not in self._rosters:
            self.counters["rosters_unknown"] += 1
            return b""
        data, entries = self._rosters[wanted]
        full = pack_roster_answer(data)
        if held and held != wanted and held in self._rosters:
            delta = pack_roster_delta(self._rosters[held][1], entries)
            if len(delta) < len(full):
                self.counters["roster_deltas_served"] += 1
                return delta
        self.counters["rosters_served"] += 1
        return full

    def stats(self) -> dict[str, Any]:
        workers, roster_id = self.roster()
        return {"attached": workers, "streams": len(self._attached), "roster": roster_id.hex()[:16], **self.counters}


@dataclass
class _Link:
    """A worker's presence stream to one hub."""

    hub: PeerId
    stream: INetStream
    budget: TokenBucket
    sent_version: int = -1
    last_write: float = 0.0
    over_budget: int = 0


class PresenceClient:
    """The worker side of presence (see the module docstring).

    Args:
        run_id: the run's 32-byte ID.
        host: this worker's libp2p host.
        heartbeat_interval_s: the run's heartbeat interval, seconds.
        on_view: called with ``(hub peer ID, view payload)`` for each ``VIEW`` frame within the
            hub's budget (unverified); returns ``False`` when the view held something no honest hub
            sends (the hub is then banned).
        on_detach: called with a hub's peer ID when its stream ended.
        clock: trio clock, seconds.
    """

    def __init__(
        self,
        run_id: bytes,
        host: P2PHost,
        *,
        heartbeat_interval_s: float,
        on_view: Callable[[PeerId, bytes], bool],
        on_detach: Callable[[PeerId], None],
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.protocol = TProtocol(presence_protocol(run_id))
        self.host = host
        self.interval_s = heartbeat_interval_s
        self.on_view = on_view
        self.on_detach = on_detach
        self._clock = clock
        self._record = b""
        self._version = 0
        self._changed = trio.Event()
        self._links: dict[PeerId, _Link] = {}
        self._opening: set[PeerId] = set()
        self._not_hub: dict[PeerId, float] = {}
        self.counters: Counter[str] = Counter()

    @property
    def beat_interval_s(self) -> float:
        return PRESENCE_BEAT_INTERVALS * self.interval_s

    def offer(self, record: bytes, changed: bool) -> None:
        """The worker's newest sealed record (sealed every interval, so a new stream sends a fresh
        one); ``changed``: its content changed, so send it to every hub now."""
        self._record = record
        if changed or self._version == 0:
            self._version += 1
            wake, self._changed = self._changed, trio.Event()
            wake.set()

    def hubs(self) -> list[PeerId]:
        """Peer IDs of the hubs this worker holds a presence stream to."""
        return list(self._links)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open a presence stream to every connected peer that speaks the protocol; until cancelled."""
        async with trio.open_nursery() as nursery:
            task_status.started(None)
            while True:
                now = self._clock()
                for pid in self.host.host.get_connected_peers():
                    peer = PeerId(pid.to_base58())
                    if peer in self._links or peer in self._opening or self._not_hub.get(peer, 0.0) > now:
                        continue
                    self._opening.add(peer)
                    nursery.start_soon(self._link, pid)
                await trio.sleep(1.0)

    async def _link(self, pid: ID) -> None:
        hub = PeerId(pid.to_base58())
        stream: INetStream | None = None
        retry_s = RETRY_OPEN_S  # a timeout or a connection still coming up: try again soon
        try:
            with trio.move_on_after(OPEN_TIMEOUT_S):
                stream = await self.host.host.new_stream(pid, [self.protocol])
        except Exception as e:  # noqa: BLE001 - not a hub (a worker, an observer) or gone
            logger.debug("no presence stream to %s: %r", hub, e)
            if "not supported" in repr(e) or "not supported" in str(getattr(e, "__cause__", "")):  # the peer answered: it does not speak presence
                retry_s = NOT_A_HUB_S
        finally:
            self._opening.discard(hub)
        if stream is None:
            self._not_hub[hub] = self._clock() + retry_s
            return
        link = _Link(hub, stream, TokenBucket(VIEWS_PER_INTERVAL / self.interval_s, VIEW_BURST, self._clock()))
        self._links[hub] = link
        self.counters["links"] += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, link)
                try:
                    await self._read_views(link)
                finally:
                    nursery.cancel_scope.cancel()
        except Exception as e:  # noqa: BLE001 - a hub that went away
            logger.debug("presence stream to %s ended: %r", hub, e)
        finally:
            if self._links.get(hub) is link:
                del self._links[hub]
            self.on_detach(hub)
            await _close(stream)

    async def _write(self, link: _Link) -> None:
        while True:
            if not self._record:
                await self._changed.wait()
                continue
            now = self._clock()
            data = b""
            if self._record and link.sent_version != self._version:
                link.sent_version = self._version
                data = frame(RECORD, self._record)
                self.counters["records_sent"] += 1
            elif self._record and now - link.last_write >= self.beat_interval_s:
                data = frame(BEAT)
                self.counters["beats_sent"] += 1
            if data:
                with trio.fail_after(WRITE_TIMEOUT_S):
                    await link.stream.write(data)
                link.last_write = now
            with trio.move_on_after(max(0.05, link.last_write + self.beat_interval_s - self._clock())):
                await self._changed.wait()

    async def _read_views(self, link: _Link) -> None:
        reader = StreamReader(link.stream)
        while True:
            try:
                kind, payload = await reader.frame(max_bytes=FRAME_MAX_BYTES, kinds=HUB_KINDS)
            except Exception as e:  # noqa: BLE001 - the hub went away or sent junk: drop the link
                logger.debug("presence stream from %s: %r", link.hub, e)
                return
            if kind != VIEW:
                continue
            if not link.budget.take(self._clock()):
                link.over_budget += 1
                self.counters["views_over_budget"] += 1
                if link.over_budget > OVER_BUDGET_LIMIT:
                    self._cut_off(link, f"{link.over_budget} views over {VIEWS_PER_INTERVAL:g} per interval")
                    return
                continue  # dropped before any decoding or signature check
            self.counters["views"] += 1
            if not self.on_view(link.hub, payload):
                self._cut_off(link, "a view no honest hub sends")
                return

    def _cut_off(self, link: _Link, detail: str) -> None:
        self.counters["hubs_cut_off"] += 1
        logger.info("presence: cutting off hub %s: %s", link.hub, detail, extra={"peer_id": link.hub})
        self.host.ban(link.hub)

    def stats(self) -> dict[str, Any]:
        return {"hubs": len(self._links), **self.counters}


def unpack_view(payload: bytes) -> list[bytes]:
    """The envelopes of a ``VIEW`` payload, bounded (:data:`VIEW_MAX_ENTRIES`, :data:`VIEW_MAX_BYTES`).

    Raises:
        DecodeError: not a bounded packed list of envelopes.
    """
    return unpack_envelopes(payload, max_entries=VIEW_MAX_ENTRIES, max_bytes=VIEW_MAX_BYTES)


class RosterFetcher:
    """Fetches hubs' rosters when the IDs in their records change (see the module docstring).

    Args:
        run_id: the run's 32-byte ID.
        host: this node's libp2p host (dials a hub it is not connected to).
        check_entry: verifies one roster entry (a worker's ``node_record/1`` envelope) and returns it.
        deliver: called with ``(hub peer ID, roster ID, newly verified envelopes, member peer IDs)``.
        heartbeat_interval_s: the run's heartbeat interval (the back-off after a failed fetch), seconds.
        clock: trio clock, seconds.
    """

    def __init__(
        self,
        run_id: bytes,
        host: P2PHost,
        *,
        check_entry: Callable[[bytes], Envelope[NodeRecord]],
        deliver: Callable[[PeerId, bytes, list[Envelope[NodeRecord]], list[PeerId]], None],
        heartbeat_interval_s: float,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.protocol = TProtocol(roster_protocol(run_id))
        self.host = host
        self.check_entry = check_entry
        self.deliver = deliver
        self.interval_s = heartbeat_interval_s
        self._clock = clock
        self._have: OrderedDict[PeerId, bytes] = OrderedDict()  # hub → roster ID fetched, least recently heard first
        self._held: OrderedDict[PeerId, tuple[bytes, dict[bytes, bytes], int]] = OrderedDict()  # hub → (roster ID, entries by ID, bytes)
        self._held_bytes = 0
        self._busy: set[PeerId] = set()
        self._wanted: OrderedDict[PeerId, tuple[bytes, int, list[str]]] = OrderedDict()  # hub → (roster ID, workers, addrs) to fetch
        self._idle = trio.lowlevel.ParkingLot()  # fetch slots waiting for work
        self._retry_at: dict[PeerId, float] = {}
        self._verified: OrderedDict[bytes, PeerId] = OrderedDict()  # envelope ID → peer ID
        self._checks = TokenBucket(ENTRY_CHECKS_PER_S, ENTRY_CHECK_BURST, clock())
        self._nursery: trio.Nursery | None = None
        self.counters: Counter[str] = Counter()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery fetches run in; until cancelled."""
        async with trio.open_nursery() as nursery:
            for _ in range(FETCH_CONCURRENCY):
                nursery.start_soon(self._slot)
            self._nursery = nursery
            task_status.started(None)
            await trio.sleep_forever()

    async def _slot(self) -> None:
        """One fetch at a time: hubs this node fetched before or is connected to first (an honest
        hub's roster changes as its workers do), then the one named most recently."""
        while True:
            hub = self._next()
            if hub is None:
                await self._idle.park()
                continue
            roster_id, workers, addrs = self._wanted.pop(hub)
            self._busy.add(hub)
            await self._fetch(hub, roster_id, workers, addrs)

    def _known(self, hub: PeerId) -> bool:
        return hub in self._have or self.host.is_connected(hub)

    def _next(self) -> PeerId | None:
        if not self._wanted:
            return None
        return next((h for h in reversed(self._wanted) if self._known(h)), next(reversed(self._wanted)))

    def note_hub(self, record: NodeRecord) -> None:
        """A hub's verified record: fetch its roster if the ID is new to us."""
        hub = record.peer_id
        if self._nursery is None:
            return
        if not record.roster:
            self._wanted.pop(hub, None)
            if self._have.pop(hub, None) is not None:  # its roster emptied: it vouches for no one now
                self._drop_held(hub)
                self.deliver(hub, b"", [], [])
            return
        if hub in self._have:
            self._have.move_to_end(hub)
        if self._have.get(hub) == record.roster or hub in self._busy or self._retry_at.get(hub, 0.0) > self._clock():
            return
        self._wanted[hub] = (record.roster, record.workers, list(record.addrs))
        self._wanted.move_to_end(hub)
        if len(self._wanted) > FETCHES_WANTED_MAX:
            drop = next((h for h in self._wanted if not self._known(h)), next(iter(self._wanted)))
            del self._wanted[drop]
            self.counters["fetches_dropped"] += 1
        self._idle.unpark()

    def forget(self, hub: PeerId) -> None:
        """A hub is gone: its roster is fetched again (whole) if it comes back."""
        self._have.pop(hub, None)
        self._wanted.pop(hub, None)
        self._retry_at.pop(hub, None)
        self._drop_held(hub)

    def _remember(self, hub: PeerId, roster_id: bytes) -> None:
        """``hub``'s roster ``roster_id`` is the one delivered; within :data:`HUBS_REMEMBERED` hubs
        (one dropped vouches for no one until it is fetched again)."""
        self._have[hub] = roster_id
        self._have.move_to_end(hub)
        while len(self._have) > HUBS_REMEMBERED:
            old = next(iter(self._have))
            self.forget(old)
            self.deliver(old, b"", [], [])

    def _drop_held(self, hub: PeerId) -> None:
        gone = self._held.pop(hub, None)
        if gone is not None:
            self._held_bytes -= gone[2]

    def _keep_held(self, hub: PeerId, roster_id: bytes, entries: dict[bytes, bytes]) -> None:
        """Keep ``entries`` as the roster a delta from ``hub`` applies to, within :data:`HELD_ROSTERS_MAX_BYTES`."""
        self._drop_held(hub)
        size = sum(len(e) for e in entries.values()) + 32 * len(entries)
        self._held[hub] = (roster_id, entries, size)
        self._held_bytes += size
        while self._held_bytes > HELD_ROSTERS_MAX_BYTES and self._held:
            self._drop_held(next(iter(self._held)))

    async def _fetch(self, hub: PeerId, roster_id: bytes, workers: int, addrs: list[str]) -> None:
        try:
            held_id, held = self._held.get(hub, (b"", None, 0))[:2]
            with trio.fail_after(ROSTER_TIMEOUT_S):
                answer = await self._ask(hub, roster_request(roster_id, held_id), addrs)
            entries = read_roster_answer(roster_id, answer, held)
            members, fresh = self._verify(entries, workers)
            self.counters["deltas" if answer[0] == DELTA else "full"] += 1
            self.counters["bytes"] += len(answer)
        except (ProtocolError, OSError, trio.TooSlowError, EOFError, Exception) as e:  # noqa: BLE001 - a hub that fails is asked again later
            self.counters["failed"] += 1
            now = self._clock()
            if len(self._retry_at) >= HUBS_REMEMBERED:  # past retry times decide nothing
                self._retry_at = {h: t for h, t in self._retry_at.items() if t > now}
            self._retry_at[hub] = now + self.interval_s
            logger.debug("roster %s… of %s: %r", roster_id.hex()[:12], hub, e, extra={"peer_id": hub})
            return
        finally:
            self._busy.discard(hub)
        self._remember(hub, roster_id)
        self._keep_held(hub, roster_id, entries)
        self.counters["fetched"] += 1
        self.deliver(hub, roster_id, fresh, members)

    async def _ask(self, hub: PeerId, request: bytes, addrs: list[str]) -> bytes:
        pid = libp2p_id(hub)
        if not self.host.is_connected(hub):
            infos = []
            for a in addrs[:4]:
                try:
                    infos.append(parse_peer_addr(a if "/p2p/" in a else f"{a}/p2p/{hub}"))
                except ValueError:
                    continue
            if not infos or not await self.host.dial(infos[0]):
                raise OSError(f"cannot reach hub {hub}")
        stream = await self.host.host.new_stream(pid, [self.protocol])
        try:
            await stream.write(request)
            reader = StreamReader(stream)
            n = int.from_bytes(await reader.exactly(LENGTH_BYTES), "big")
            if n == 0:
                raise DecodeError("the hub no longer has that roster")
            if n > ROSTER_MAX_BYTES:
                raise TooLarge(f"roster of {n} bytes exceeds {ROSTER_MAX_BYTES}")
            return await reader.exactly(n)
        finally:
            await _close(stream)

    def _verify(self, entries: dict[bytes, bytes], workers: int) -> tuple[list[PeerId], list[Envelope[NodeRecord]]]:
        """Members and newly verified envelopes of a roster (its entries by content ID, already
        checked against the roster ID); raises on anything wrong."""
        if len(entries) != workers:
            raise DecodeError(f"roster lists {len(entries)} workers, its hub's record says {workers}")
        unchecked = sum(1 for eid in entries if eid not in self._verified)
        if unchecked and not self._checks.take(self._clock(), unchecked):
            self.counters["deferred"] += 1  # asked again after an interval (the fetch's failure path)
            raise OverRate(f"{unchecked} new roster entries, over the {ENTRY_CHECKS_PER_S:g} entry checks per second left")
        members: list[PeerId] = []
        fresh: list[Envelope[NodeRecord]] = []
        for eid, raw in entries.items():
            peer = self._verified.get(eid)
            if peer is None:
                env = self.check_entry(raw)
                if env.body.role != "worker":
                    raise SchemaError(f"a {env.body.role} record in a roster", "body.role")
                peer = env.body.peer_id
                self._verified[eid] = peer
                while len(self._verified) > VERIFIED_CACHE:
                    self._verified.popitem(last=False)
                fresh.append(env)
                self.counters["entries_verified"] += 1
            else:
                self._verified.move_to_end(eid)
            members.append(peer)
        if len(set(members)) != len(members):
            raise DecodeError("a worker listed twice in one roster")
        return members, fresh

    def stats(self) -> dict[str, Any]:
        return {"hubs": len(self._have), "held_bytes": self._held_bytes, "fetches_waiting": len(self._wanted), **self.counters}
