"""Self-signed node records can fill the peer table (any key may publish one, up to the gossip
rate limit); the latest-step check that runs for every delivered message must not scan it.

Measured before the fix: with 50 000 flooded worker records, one ``latest_step()`` took ≈ 11 ms
(a sort of every live peer), so 1000 messages/s kept the asyncio loop busy for ≈ 11 s a second.
"""

from __future__ import annotations

import time

import pytest

from node.p2p.peers import PeerTable
from protocol.identity import NodeKey
from protocol.messages import NodeRecord

COORD = NodeKey.from_seed(b"C" * 32)


def test_latest_step_looks_the_coordinator_up_without_scanning_the_flooded_table(monkeypatch: pytest.MonkeyPatch) -> None:
    table = PeerTable(2.0, coordinator=COORD.peer_id)
    ts = int(time.time() * 1000)
    flood = NodeRecord(peer_id=COORD.peer_id, role="worker", seq=1, version="v")
    for i in range(2000):
        table.update(flood.model_copy(update={"peer_id": "12D3KooW" + str(i).rjust(44, "A")}), ts)
    table.update(NodeRecord(peer_id=COORD.peer_id, role="coordinator", seq=1, version="v", policy_step=7), ts)

    def no_scan() -> list[object]:
        raise AssertionError("latest_step() scanned every peer")

    monkeypatch.setattr(table, "alive", no_scan)
    assert table.latest_step() == 7
    assert table.coordinator() is not None and table.coordinator().peer_id == COORD.peer_id


def test_a_coordinator_id_record_with_another_role_is_no_coordinator() -> None:
    table = PeerTable(2.0, coordinator=COORD.peer_id)
    table.update(NodeRecord(peer_id=COORD.peer_id, role="relay", seq=1, version="v", policy_step=9), int(time.time() * 1000))
    assert table.coordinator() is None and table.latest_step() is None
