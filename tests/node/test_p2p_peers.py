"""The peer table: liveness by heartbeats, record ordering, queries, and upstream choice."""

from __future__ import annotations

from node.p2p.peers import PeerTable, Vouchers, pick_upstreams
from protocol.identity import NodeKey
from protocol.messages import CheckpointAnnouncement, NodeRecord

HB = 2.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def rec(key: NodeKey, role: str = "relay", seq: int = 1, **kw: object) -> NodeRecord:
    return NodeRecord(peer_id=key.peer_id, role=role, seq=seq, version="t", **kw)  # type: ignore[arg-type]


def ann(step: int, origin_url: str = "") -> CheckpointAnnouncement:
    return CheckpointAnnouncement(step=step, manifest_id=b"\1" * 32, checkpoint_hash=b"\2" * 32, origin_url=origin_url)


def test_dead_after_three_missed_heartbeats_and_back_after_restart() -> None:
    clock = Clock()
    table = PeerTable(HB, coordinator=None, clock=clock)
    a = NodeKey.generate()
    assert table.update(rec(a, seq=5), ts_ms=1_000)
    assert not table.update(rec(a, seq=6), ts_ms=2_000)  # not new
    clock.t += 3 * HB - 0.01
    assert a.peer_id in table
    clock.t += 0.02
    assert a.peer_id not in table and len(table) == 0 and table.get(a.peer_id) is None
    # a restarted process counts seq from 0 again but its clock moved on
    assert table.update(rec(a, seq=0), ts_ms=9_000)
    assert table.get(a.peer_id).seq == 0  # type: ignore[union-attr]
    # an older (replayed) record changes nothing
    assert not table.update(rec(a, seq=7, http_url="http://old"), ts_ms=8_000)
    assert table.get(a.peer_id).http_url == ""  # type: ignore[union-attr]
    clock.t += 10 * 3 * HB + 1
    assert table.prune() == [a.peer_id]


def test_a_peer_a_hub_vouches_for_stays_alive_and_dies_when_no_hub_does() -> None:
    """Workers' records reach a hub once per change; the hub's roster (or open presence stream)
    vouches for them in between (``docs/gossip.md``, presence)."""
    clock = Clock()
    table = PeerTable(HB, clock=clock)
    vouchers = Vouchers()
    w, x = NodeKey.generate(), NodeKey.generate()
    table.update(rec(w, role="worker"), ts_ms=1_000)
    table.update(rec(x, role="worker"), ts_ms=1_000)
    assert vouchers.set("hubA", [w.peer_id, x.peer_id]) == [] and vouchers.set("hubB", [w.peer_id]) == []
    for _ in range(10):  # each hub record re-vouches: alive long past three intervals of its own silence
        clock.t += HB
        table.touch(vouchers.members("hubA") | vouchers.members("hubB"))
    assert w.peer_id in table and x.peer_id in table
    table.touch(["12D3KooWunknown"])  # nobody enters the table on a hub's word alone
    assert len(table) == 2
    assert vouchers.set("hubA", [w.peer_id]) == [x.peer_id]  # x left hub A's roster and no hub lists it
    table.expire(x.peer_id)
    assert x.peer_id not in table and table.get(x.peer_id) is None
    assert vouchers.set("hubA", []) == []  # w is still on hub B's roster
    assert vouchers.remove("hubB", w.peer_id) and not vouchers.vouched(w.peer_id)
    clock.t += 3 * HB + 0.01  # no vouching, no record: dead like any silent peer
    assert w.peer_id not in table


def test_queries() -> None:
    clock = Clock()
    coord, v, r1, r2, w = (NodeKey.generate() for _ in range(5))
    table = PeerTable(HB, coordinator=coord.peer_id, clock=clock)
    assert table.latest_step() is None and table.coordinator() is None
    table.update(rec(coord, "coordinator", http_url="http://origin", policy_step=4), 1)
    table.update(rec(v, "validator"), 1)
    table.update(rec(r1, http_url="http://r1", held_steps=[3, 4]), 1)
    table.update(rec(r2, http_url="http://r2", held_steps=[3]), 1)
    table.update(rec(w, "worker", policy_step=3), 1)
    assert [p.peer_id for p in table.validators()] == [v.peer_id]
    assert table.coordinator().peer_id == coord.peer_id  # type: ignore[union-attr]
    assert {p.peer_id for p in table.relays_holding(3)} == {r1.peer_id, r2.peer_id}
    assert [p.peer_id for p in table.relays_holding(4)] == [r1.peer_id]
    assert table.latest_step() == 4
    assert table.note_announcement(ann(5)) and not table.note_announcement(ann(2))
    assert table.latest_step() == 5 and table.latest_announcement.step == 5  # type: ignore[union-attr]
    assert {p["role"] for p in (x.to_json(clock()) for x in table)} == {"coordinator", "validator", "relay", "worker"}


def test_pick_upstreams_prefers_relays_holding_the_latest_step() -> None:
    clock = Clock()
    coord = NodeKey.generate()
    me = NodeKey.generate()
    relays = [NodeKey.generate() for _ in range(5)]
    table = PeerTable(HB, coordinator=coord.peer_id, clock=clock)
    # nothing known: serve the own store
    assert pick_upstreams(table, own_peer_id=me.peer_id) == []
    table.update(rec(coord, "coordinator", http_url="http://origin"), 1)
    assert pick_upstreams(table, own_peer_id=me.peer_id) == ["http://origin"]
    table.note_announcement(ann(7))
    for i, r in enumerate(relays):
        table.update(rec(r, http_url=f"http://r{i}", held_steps=[6, 7] if i < 4 else [6]), 1)
    table.update(rec(me, http_url="http://me", held_steps=[7]), 1)
    chosen = pick_upstreams(table, own_peer_id=me.peer_id, own_url="http://me", fanout=3)
    assert len(chosen) == 4 and chosen[-1] == "http://origin", "3 relays, and the origin always"
    assert "http://me" not in chosen and "http://r4" not in chosen
    assert chosen == pick_upstreams(table, own_peer_id=me.peer_id, own_url="http://me", fanout=3)  # stable
    other = pick_upstreams(table, own_peer_id=NodeKey.generate().peer_id, fanout=4)  # another relay's view: "me" is a holder too
    assert len(other) == 5 and set(other[:4]) <= {"http://r0", "http://r1", "http://r2", "http://r3", "http://me"}
    # too few holders: the origin is still there
    assert pick_upstreams(table, own_peer_id=me.peer_id, own_url="http://me", fanout=6)[-1] == "http://origin"
    # Sybil relays holding the step (many self-signed records) never push the origin out
    for i in range(40):
        table.update(rec(NodeKey.generate(), http_url=f"http://sybil{i}", held_steps=[7]), 1)
    sybil_view = pick_upstreams(table, own_peer_id=me.peer_id, own_url="http://me", fanout=3)
    assert len(sybil_view) == 4 and sybil_view[-1] == "http://origin"


def test_a_flood_of_new_peer_ids_is_bounded_and_never_pushes_out_the_peers_that_were_there() -> None:
    clock = Clock()
    coord, validator, honest = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    table = PeerTable(HB, coordinator=coord.peer_id, clock=clock, max_peers=6)
    assert table.update(rec(coord, role="coordinator", policy_step=3), ts_ms=1)
    assert table.update(rec(validator, role="validator"), ts_ms=1)
    assert table.update(rec(honest, role="relay"), ts_ms=1)
    flood = [NodeKey.generate() for _ in range(6)]
    for k in flood:
        table.update(rec(k, role="worker"), ts_ms=1)
    # full after flood[2]; each later ID took the place of the newest arrival before it
    assert {p.peer_id for p in table.alive()} == {coord.peer_id, validator.peer_id, honest.peer_id, flood[0].peer_id,
                                                   flood[1].peer_id, flood[5].peer_id}
    assert table.evicted == 3 and table.latest_step() == 3
    # once some are dead, a newcomer takes a dead one's place (the least recently heard)
    clock.t += 3 * HB + 1
    for k, role in ((coord, "coordinator"), (validator, "validator"), (honest, "relay"), (flood[0], "worker"), (flood[5], "worker")):
        table.update(rec(k, role=role, seq=2), ts_ms=2)
    newcomer = NodeKey.generate()
    assert table.update(rec(newcomer, role="relay"), ts_ms=2)
    assert flood[1].peer_id not in {p.peer_id for p in table.alive()} and table.get(newcomer.peer_id) is not None
    assert len(table.alive()) == 6 and table.evicted == 4
    # a table of key-checked peers only refuses a newcomer instead of dropping one of them
    full = PeerTable(HB, coordinator=coord.peer_id, clock=clock, max_peers=2)
    full.update(rec(coord, role="coordinator"), ts_ms=1)
    full.update(rec(validator, role="validator"), ts_ms=1)
    assert not full.update(rec(flood[0], role="worker"), ts_ms=1)
    assert {p.peer_id for p in full.alive()} == {coord.peer_id, validator.peer_id}
