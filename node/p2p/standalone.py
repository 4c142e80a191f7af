"""One gossip node as its own process, for tests and benchmarks that need real processes (a real
kill, one interpreter per node): ``python -m node.p2p.standalone --run R --key K [--role relay] [...]``.

Prints one line ``READY <multiaddr>`` on stdout once listening, then runs until SIGTERM/SIGINT.
Used by the p2p tests (``tests/node/p2p_helpers.py``), ``benchmarks/gossip_bench.py`` and, for
:func:`serve_until_signalled`, the js-libp2p benchmark node (``benchmarks/js_gossip.py``). Not an
operator command: a node joins a run with ``intellect-node join``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def _main(args: argparse.Namespace) -> None:
    from node.p2p import GossipConfig, GossipNode
    from node.p2p.gossip import DuplicateEnvelope
    from protocol.identity import NodeKey
    from protocol.runspec import load_run_spec

    spec = load_run_spec(Path(args.run)).spec
    config = GossipConfig(
        p2p_port=args.port,
        bootstrap=args.bootstrap,
        heartbeat_interval_s=args.heartbeat,
        bridge=args.bridge,
        split_records=not args.flat,
        presence=not (args.flat or args.old_mesh or args.no_presence),
        hub_full_mesh=not args.old_mesh,
        max_peers=args.max_peers,
    )
    node = await GossipNode.create(spec, NodeKey.load(Path(args.key)), config, role=args.role, http_url=args.http_url)
    if args.drop_announcements:  # a node that loses every announcement (benchmark of the record path)
        real_check = node.gate.envelopes.check

        def drop(kind: str, data: bytes, *, remember: bool = True) -> object:
            if kind == "checkpoints":
                raise DuplicateEnvelope("dropped on purpose")
            return real_check(kind, data, remember=remember)  # type: ignore[arg-type]

        node.gate.envelopes.check = drop  # type: ignore[method-assign,assignment]
    await serve_until_signalled(node, log_announcements=args.log_announcements)


async def serve_until_signalled(node: Any, *, log_announcements: bool, on_stop: Callable[[], None] | None = None) -> None:
    """Print ``READY <multiaddr>``, run until SIGTERM/SIGINT, then ``on_stop()`` and ``node.stop()``.

    With ``log_announcements`` one JSON line per announcement, ``{"step", "recv_ns"}`` (wall clock,
    for the benchmark), and one per rise of the latest signed step, ``{"latest", "recv_ns"}``.
    ``node`` is a :class:`~node.p2p.GossipNode` or anything with its ``addrs``, ``on_announcement``,
    ``on_latest_step`` and ``stop`` (the js-libp2p benchmark node).
    """
    if log_announcements:
        node.on_announcement(lambda env: print(json.dumps({"step": env.body.step, "recv_ns": time.time_ns()}), flush=True))
        node.on_latest_step(lambda step: print(json.dumps({"latest": step, "recv_ns": time.time_ns()}), flush=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {node.addrs[0]}", flush=True)
    try:
        await stop.wait()
    finally:
        if on_stop is not None:
            on_stop()
        await node.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--role", default="relay")
    p.add_argument("--http-url", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bootstrap", action="append", default=[])
    p.add_argument("--heartbeat", type=float, default=None)
    p.add_argument("--bridge", default="thread", choices=["thread", "guest"])
    p.add_argument("--log-announcements", action="store_true")
    p.add_argument("--flat", action="store_true", help="every record on one topic every node reads (the layout before issue 18)")
    p.add_argument("--no-presence", action="store_true", help="worker records on the workers gossip topic (the layout of issue 18, before presence streams)")
    p.add_argument("--max-peers", type=int, default=64, help="most connections (a hub carrying many workers needs more)")
    p.add_argument("--old-mesh", action="store_true", help="hubs bound their mesh at 12 peers (before issue 18's mesh fix); set PY_YAMUX_RELEASE_ON_READ=1 too for the old window updates")
    p.add_argument("--drop-announcements", action="store_true", help="reject every checkpoint announcement (learn steps from records)")
    asyncio.run(_main(p.parse_args()))
    sys.exit(0)


if __name__ == "__main__":
    main()
