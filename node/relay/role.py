"""The relay role: serve a Shardcast store and follow upstreams until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node import __version__
from node.cli import CliError, gossip_config, load_key, open_run_arg
from node.errors import NodeError
from node.p2p import GossipConfig, GossipNode
from node.p2p.follow import follow_relay
from node.p2p.metrics import gossip_summary
from node.paths import default_data_dir
from node.shardcast.relay import Relay, RelayConfig
from node.shardcast.store import ShardcastStore
from protocol.identity import NodeKey, PeerId
from protocol.runspec import SignedRunSpec, dump_run_spec

logger = logging.getLogger(__name__)


async def run_relay(
    signed: SignedRunSpec,
    key: NodeKey,
    *,
    data_dir: Path,
    host: str,
    port: int,
    upstreams: Sequence[str],
    gossip: GossipConfig | None = None,
    public_url: str = "",
) -> None:
    """Run a relay until SIGINT or SIGTERM.

    Args:
        signed: the verified run spec (run ID, coordinator key, ``shardcast.keep_steps``).
        key: this node's key (its peer ID is reported by ``/held``).
        data_dir: node data directory; the store lives below it.
        host: interface to serve on.
        port: TCP port (0: any free one).
        upstreams: base URLs to follow; empty makes this node the origin, or (with ``gossip``)
            lets it pick its sources from gossip.
        gossip: join the run's gossip with these settings: heartbeats carry the relay's URL and
            held steps (``None``: stay off gossip).
        public_url: URL other nodes reach this relay at (default: ``http://host:port``; set it
            when serving on ``0.0.0.0``).

    ``GET /status`` on the Shardcast port answers the relay's JSON status (:func:`relay_status`),
    ``GET /run/1/spec`` the signed spec. The artifacts the spec pins (``[artifacts]``) are mirrored
    and served like steps (``docs/shardcast.md`` §10).
    """
    spec = signed.spec
    store = await asyncio.to_thread(
        ShardcastStore, data_dir, run_id=signed.run_id, authorities=spec.authorities, keep_steps=spec.shardcast.keep_steps
    )
    relay = Relay(store, RelayConfig(host=host, port=port, upstreams=tuple(upstreams), origins=tuple(spec.network.origin_urls),
                                     peer_id=key.peer_id, artifacts=tuple(bytes.fromhex(a) for a in spec.artifacts.values())))
    relay.server.run_spec = dump_run_spec(signed).encode()  # newcomers may fetch the signed spec from any relay (run address)
    started = time.monotonic()
    node: GossipNode | None = None
    relay.server.status = lambda: relay_status(relay, key.peer_id, public_url or relay.url, started,
                                                gossip=node.last_stats if node is not None else None)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(relay.stop()))
    await relay.start()
    follow: asyncio.Task[None] | None = None
    try:
        if gossip is not None:
            node = await GossipNode.create(spec, key, gossip, role="relay", http_url=public_url or relay.url)
            node.track_stats()  # its counters in /status
            follow = asyncio.create_task(follow_relay(node, relay, pick_sources=not upstreams, own_url=public_url or relay.url),
                                         name="relay-gossip-follow")
            print(f"relay {key.peer_id} on gossip at {' '.join(node.addrs)}", flush=True)
        role = f"following {', '.join(relay.pool.urls)}" if relay.pool.urls else "origin" if gossip is None else "sources from gossip"
        print(f"relay {key.peer_id} serving {relay.url} ({role}); holds steps {store.held_steps()}"
              + (f"; public URL {public_url}" if public_url else ""), flush=True)
        logger.info("relay started", extra={"peer_id": key.peer_id, "url": relay.url, "keep_steps": store.keep_steps})
        await relay.run()
    finally:
        if follow is not None:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
        if node is not None:
            await node.stop()
        await relay.stop()


def relay_status(relay: Relay, peer_id: PeerId, url: str, started_s: float, *, gossip: dict[str, Any] | None = None) -> dict[str, Any]:
    """The relay's ``GET /status`` JSON: role, peer ID, URL, held steps (ascending), latest held
    step (``None``: none yet), upstreams, piece responses served, uptime in seconds, and with
    ``gossip`` (the gossip node's :attr:`~node.p2p.service.GossipNode.last_stats`) its counters:
    connections, workers attached, send-queue and delivery drops, rejected messages by reason."""
    held = relay.held_steps()
    out: dict[str, Any] = {
        "role": "relay",
        "peer_id": peer_id,
        "version": __version__,
        "url": url,
        "held_steps": held,
        "latest_step": held[-1] if held else None,
        "upstreams": list(relay.pool.urls),
        "pieces_served": relay.server.pieces_served,
        "uptime_s": round(time.monotonic() - started_s, 1),
    }
    if gossip:
        out["gossip"] = gossip_summary(gossip)
    return out


def run_relay_from_args(args: argparse.Namespace) -> int:
    """``join --role relay``: open the run (address or spec), load the key, then :func:`run_relay`."""
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    signed = open_run_arg(args, data_dir).signed  # before anything is written
    key = load_key(args.key, str(data_dir), create=True)
    if not 0 <= args.http_port <= 65535:
        raise CliError("--http-port must be 0…65535")
    gossip = gossip_config(args)
    try:
        asyncio.run(
            run_relay(signed, key, data_dir=data_dir, host=args.host, port=args.http_port, upstreams=args.upstream, gossip=gossip,
                      public_url=args.public_url)
        )
    except OSError as e:
        print(f"error: cannot serve on {args.host}:{args.http_port}: {e.strerror}", file=sys.stderr)
        return 1
    except NodeError as e:
        raise CliError(str(e)) from None
    return 0
