"""The libp2p host: identity equals the node key, bootstrap retries forever, bad ports fail cleanly."""

from __future__ import annotations

import logging
import socket

import pytest
from p2p_helpers import Run, config
from waiting import wait_until

from node.errors import GossipError
from node.p2p import GossipNode
from node.p2p.host import libp2p_key_pair, parse_peer_addr
from protocol.identity import NodeKey


def test_libp2p_peer_id_equals_node_key_peer_id() -> None:
    from libp2p.peer.id import ID

    for _ in range(5):
        key = NodeKey.generate()
        pair = libp2p_key_pair(key)
        assert ID.from_pubkey(pair.public_key).to_base58() == key.peer_id
        assert pair.public_key.to_bytes() == key.public_key


def test_parse_peer_addr_rejects_addresses_without_peer() -> None:
    key = NodeKey.generate()
    assert parse_peer_addr(f"/ip4/127.0.0.1/tcp/4001/p2p/{key.peer_id}").peer_id.to_base58() == key.peer_id
    for bad in ("/ip4/127.0.0.1/tcp/4001", "not a multiaddr", ""):
        with pytest.raises(ValueError):
            parse_peer_addr(bad)


@pytest.mark.integration
async def test_node_survives_a_dead_bootstrap_and_joins_when_it_appears(caplog: pytest.LogCaptureFixture, held_port) -> None:
    caplog.set_level(logging.INFO, logger="node.p2p.host")
    run = Run()
    seed_key = NodeKey.generate()
    port = held_port()  # dead until the seed binds it
    seed_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{seed_key.peer_id}"
    joiner = await GossipNode.create(run.spec, NodeKey.generate(), config(bootstrap=[seed_addr, "/ip4/127.0.0.1/tcp/1"]), role="worker")
    try:
        assert joiner.addrs[0].startswith("/ip4/127.0.0.1/tcp/") and joiner.addrs[0].endswith(joiner.peer_id)
        # the event: the dial to the dead bootstrap failed (and is retried with backoff); the node keeps running
        def dial_failed() -> bool:
            return any("unreachable" in r.getMessage() and seed_key.peer_id in r.getMessage() for r in caplog.records)

        await wait_until(dial_failed, 10.0)
        assert joiner.running and len(joiner.peers) == 0
        seed = await GossipNode.create(run.spec, seed_key, config(p2p_port=port), role="relay")
        try:
            await wait_until(lambda: seed.peer_id in joiner.peers and joiner.peer_id in seed.peers, 10)
            assert joiner.peers.get(seed.peer_id).role == "relay"  # type: ignore[union-attr]
        finally:
            await seed.stop()
    finally:
        await joiner.stop()


@pytest.mark.integration
async def test_port_in_use_is_a_gossip_error() -> None:
    run = Run()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(GossipError):
            await GossipNode.create(run.spec, NodeKey.generate(), config(p2p_port=s.getsockname()[1], start_timeout_s=5))


def test_a_full_mesh_hub_does_not_score_its_mesh_every_heartbeat() -> None:
    """py-libp2p's opportunistic grafting and peer replacement scored every mesh peer of every
    topic each heartbeat before finding no peer outside the mesh to graft or swap in, which is
    always so for a hub's full mesh: about a third of a relay's idle CPU with 500 workers
    attached. With every subscriber in the mesh neither scores anyone; with one subscriber outside
    it they run as before."""
    from collections import defaultdict
    from types import SimpleNamespace

    import trio
    from libp2p.peer.id import ID
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11

    from node.p2p.router import BoundedGossipSub

    router = BoundedGossipSub(protocols=[PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=200)
    topic = "t"
    peers = [ID(i.to_bytes(8, "big")) for i in range(100)]
    router.mesh[topic] = set(peers)
    router.peer_protocol.update(dict.fromkeys(peers, PROTOCOL_ID_V11))
    router.pubsub = SimpleNamespace(peer_topics={topic: set(peers)})  # type: ignore[assignment]
    scored: list[ID] = []
    assert router.scorer is not None
    real_score = router.scorer.score
    router.scorer.score = lambda p, topics: scored.append(p) or real_score(p, topics)  # type: ignore[method-assign]

    assert router._perform_opportunistic_grafting(topic, defaultdict(list)) == 0
    trio.run(router._consider_peer_replacement, topic)
    assert scored == []  # old code: each of the 100 mesh peers scored, twice

    outsider = ID(b"outsider")
    router.peer_protocol[outsider] = PROTOCOL_ID_V11
    router.pubsub.peer_topics[topic].add(outsider)
    router._perform_opportunistic_grafting(topic, defaultdict(list))
    assert len(scored) >= len(peers)  # runs as before when there is someone to graft


def test_a_stopping_host_closes_its_connections_together() -> None:
    """Each yamux close takes 0.1-0.2 s: closed one after another, a relay with 4 peers spent
    0.7-0.8 s of its stop there and a hub with hundreds said goodbye to only the first few within
    its close budget. Here every close waits until all of them have begun, which only closing
    them together satisfies (one after another, the first never returns and the test fails)."""
    import trio

    from node.p2p.host import P2PHost

    n = 6
    begun: list[int] = []
    everyone = trio.Event()

    class Muxer:
        async def close(self) -> None:
            begun.append(1)
            if len(begun) == n:
                everyone.set()
            await everyone.wait()

    class Conn:
        muxed_conn = Muxer()

    class Network:
        def __init__(self) -> None:
            self.connections = {f"peer{i}": [Conn()] if i % 2 else Conn() for i in range(n)}  # py-libp2p has held both shapes

    class Host:
        def get_network(self) -> Network:
            return Network()

    host = object.__new__(P2PHost)
    host.host = Host()  # type: ignore[assignment]

    async def main() -> None:
        with trio.fail_after(5):
            await host._close_connections()

    trio.run(main)
    assert len(begun) == n
