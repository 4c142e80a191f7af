"""Test-only gossip node process: ``python tests/node/gossip_runner.py --run R --key K [...]``.

Prints one line ``READY <multiaddr>`` on stdout once listening, then runs until SIGTERM/SIGINT.
Used by the p2p tests and the gossip benchmark to run nodes in separate processes (a real kill).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path


async def _main(args: argparse.Namespace) -> None:
    from node.p2p import GossipConfig, GossipNode
    from protocol.identity import NodeKey
    from protocol.runspec import load_run_spec

    spec = load_run_spec(Path(args.run)).spec
    config = GossipConfig(
        p2p_port=args.port,
        bootstrap=args.bootstrap,
        heartbeat_interval_s=args.heartbeat,
        bridge=args.bridge,
    )
    node = await GossipNode.create(spec, NodeKey.load(Path(args.key)), config, role=args.role, http_url=args.http_url)
    if args.log_announcements:
        # one JSON line per announcement: {"step", "recv_ns"} (wall clock, for the benchmark)
        node.on_announcement(lambda env: print(json.dumps({"step": env.body.step, "recv_ns": time.time_ns()}), flush=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {node.addrs[0]}", flush=True)
    try:
        await stop.wait()
    finally:
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
    asyncio.run(_main(p.parse_args()))
    sys.exit(0)


if __name__ == "__main__":
    main()
