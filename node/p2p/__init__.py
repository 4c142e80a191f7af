"""The node's libp2p layer: host, asyncio↔trio bridge, per-run gossip topics, live peer table.

* ``service``  — :class:`GossipNode`, the facade roles use (start/stop, records, publish, handlers).
* ``config``   — :class:`GossipConfig` (listen address, bootstrap, timing, penalties).
* ``peers``    — :class:`PeerTable` / :class:`PeerInfo` and :func:`pick_upstreams` (pure).
* ``gossip``   — topic names, the envelope validator and peer penalty scores (pure).
* ``topics``   — ``TopicGate``: what a message passes on the topics (validator, budgets, penalties).
* ``liveness`` — ``Presence``: the node's side of presence streams, views, rosters and vouching.
* ``presence`` — the presence and roster stream protocols (hub, worker, roster fetcher; trio side).
* ``follow``   — :func:`follow_relay`: a relay's held steps and upstreams kept in step with gossip.
* ``host``     — the libp2p host on trio (gossipsub, bootstrap with backoff, dialing, bans).
* ``router``, ``transport`` — bounded gossipsub queues and answers; what a connection may speak.
* ``libp2p_patches`` — every override of py-libp2p's own code, for the pinned version only.
* ``bridge``   — :class:`TrioBridge`: the one asyncio↔trio crossing (``docs/gossip.md``).
* ``standalone`` — one gossip node as its own process (``python -m node.p2p.standalone``; tests, benchmarks).

Names are loaded lazily: ``from node.p2p import PeerTable`` does not import libp2p or trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from node.p2p.bridge import TrioBridge, make_bridge
    from node.p2p.config import GossipConfig
    from node.p2p.gossip import topic_name
    from node.p2p.peers import PeerInfo, PeerTable, pick_upstreams
    from node.p2p.service import GossipNode

_WHERE = {
    "GossipConfig": "node.p2p.config",
    "GossipNode": "node.p2p.service",
    "PeerInfo": "node.p2p.peers",
    "PeerTable": "node.p2p.peers",
    "pick_upstreams": "node.p2p.peers",
    "TrioBridge": "node.p2p.bridge",
    "make_bridge": "node.p2p.bridge",
    "topic_name": "node.p2p.gossip",
}

__all__ = ["GossipConfig", "GossipNode", "PeerInfo", "PeerTable", "TrioBridge", "make_bridge", "pick_upstreams", "topic_name"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'node.p2p' has no attribute {name!r}")
