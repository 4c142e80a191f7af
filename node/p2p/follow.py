"""Keep a relay's gossip presence and its Shardcast upstreams in step with the peer table.

:func:`follow_relay` is the glue a relay role runs next to its :class:`GossipNode`: every
heartbeat it puts the relay's complete steps into the node record (``held_steps``), tells the
relay the latest coordinator-signed step (upstreams' unsigned ``/held`` offers above it are
ignored) and, for a relay started without ``--upstream``, re-picks its sources with
:func:`pick_upstreams` (the origins always among them, on reserved slots).
The relay is only seen through :class:`RelayLike`, so this module does not import Shardcast.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from node.p2p.peers import origin_urls_of, pick_upstreams
from node.p2p.service import GossipNode

logger = logging.getLogger(__name__)

DEFAULT_FANOUT = 3
"""Sources a gossip-following relay fetches from."""


class RelayLike(Protocol):
    """What :func:`follow_relay` needs of a relay (``node.shardcast.relay.Relay`` fits)."""

    @property
    def url(self) -> str: ...

    def held_steps(self) -> list[int]: ...

    def set_upstreams(self, urls: Iterable[str], *, origins: Iterable[str] | None = None) -> None: ...

    def note_latest_step(self, step: int | None) -> None: ...


async def follow_relay(
    node: GossipNode, relay: RelayLike, *, pick_sources: bool, fanout: int = DEFAULT_FANOUT, own_url: str = ""
) -> None:
    """Run until cancelled: announce the relay's held steps and (if ``pick_sources``) choose its upstreams.

    Args:
        node: the relay's started gossip node.
        relay: the relay.
        pick_sources: choose upstreams from gossip (a relay started without ``--upstream``).
        fanout: how many sources to follow.
        own_url: the URL peers know this relay by (its public URL; default ``relay.url``), never
            picked as its own source.
    """
    held: list[int] | None = None
    upstreams: list[str] | None = None
    origin_urls = list(node.spec.network.origin_urls)
    while True:
        now_held = relay.held_steps()
        if now_held != held:
            held = now_held
            node.set_record(held_steps=now_held)
        relay.note_latest_step(node.peers.latest_step())  # coordinator-signed: bounds the steps /held answers may offer
        if pick_sources:
            chosen = pick_upstreams(node.peers, own_peer_id=node.peer_id, own_url=own_url or relay.url, origin_urls=origin_urls, fanout=fanout)
            if chosen != upstreams:
                upstreams = chosen
                relay.set_upstreams(chosen, origins=origin_urls_of(node.peers, origin_urls, own_url or relay.url))
                logger.info("upstreams from gossip: %s", ", ".join(chosen) or "none (serving own store)")
        await asyncio.sleep(min(0.25, node.heartbeat_interval_s))  # a newly held step is announced at once
