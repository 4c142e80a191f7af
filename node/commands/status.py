"""`status`: join the run's gossip briefly as a silent observer and print the peer table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from node.cli import CliError, command, load_spec

DEFAULT_WAIT_S = 10.0
QUIET_HEARTBEATS = 1.5
"""Stop collecting once no new peer appeared for this many heartbeat intervals (after the first record)."""
MIN_HEARTBEATS = 2.5
"""…but collect at least this many heartbeat intervals after the first record, so every live peer
(each publishes one record per interval) had a chance to be heard, even on a slow mesh."""


@command
def _status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="join the run's gossip as an observer and print its live peers and latest step")
    p.add_argument("--run", required=True, help="the signed run spec (TOML)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help="bootstrap peer, added to the spec's (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="S", help=f"longest time to collect records, seconds (default {DEFAULT_WAIT_S:g})")
    p.add_argument("--listen-host", default="127.0.0.1", help="interface for the observer's libp2p host (default 127.0.0.1)")
    p.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    import asyncio

    signed = load_spec(args.run)
    if not 0 < args.wait <= 3600:
        raise CliError("--wait must be between 0 and 3600 seconds")
    if not args.bootstrap and not signed.spec.network.bootstrap:
        raise CliError("no bootstrap peer: pass --bootstrap MULTIADDR or set network.bootstrap in the run spec")
    for addr in args.bootstrap:
        if "/p2p/" not in addr:
            raise CliError(f"--bootstrap {addr!r} must end in /p2p/<peer ID>")
    report = asyncio.run(_collect(signed.spec, args.bootstrap, args.wait, args.listen_host))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    if not report["peers"]:
        print(f"no node records heard within {args.wait:g} s (are the bootstrap peers up?)", file=sys.stderr)
        return 1
    return 0


async def _collect(spec: Any, bootstrap: list[str], wait_s: float, listen_host: str) -> dict[str, Any]:
    """Run an observer node until the peer table settles or ``wait_s`` seconds pass; return a report."""
    import asyncio
    import time

    from node.p2p import GossipConfig, GossipNode
    from protocol.identity import NodeKey

    config = GossipConfig(bootstrap=bootstrap, listen_host=listen_host, publish_records=False)
    node = await GossipNode.create(spec, NodeKey.generate(), config, role="observer")
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        quiet_s = QUIET_HEARTBEATS * node.heartbeat_interval_s
        min_s = MIN_HEARTBEATS * node.heartbeat_interval_s
        seen: set[str] = set()
        last_change = first_record = loop.time()
        while loop.time() < deadline:
            now_ids = {p.peer_id for p in node.peers}
            if now_ids - seen:
                if not seen:
                    first_record = loop.time()
                seen |= now_ids
                last_change = loop.time()
            elif seen and loop.time() - last_change >= quiet_s and loop.time() - first_record >= min_s:
                break
            await asyncio.sleep(0.05)
        stats = await node.stats()
        now = time.monotonic()
        peers = [p.to_json(now) for p in node.peers]
        return {
            "run_id": spec.run_id.hex(),
            "observer": node.peer_id,
            "latest_step": latest_step(node.peers.latest_step(), peers),
            "peers": peers,
            "connected": stats["connected"],
        }
    finally:
        await node.stop()


def latest_step(announced: int | None, peers: list[dict[str, Any]]) -> int | None:
    """The newest policy step any peer knows: the coordinator's announcement, any peer's policy
    step, or any relay's newest held step (``None``: nobody knows one yet)."""
    steps = [announced] if announced is not None else []
    for p in peers:
        if p["policy_step"] >= 0:
            steps.append(p["policy_step"])
        if p["held_steps"]:
            steps.append(max(p["held_steps"]))
    return max(steps) if steps else None


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from node.terminal import printable

    latest = report["latest_step"]
    table = Table(title=f"run {report['run_id'][:16]}…  latest step: {'—' if latest is None else latest}  peers: {len(report['peers'])}")
    for col in ("peer ID", "role", "HTTP", "step", "held steps", "last seen", "version"):
        table.add_column(col, no_wrap=col == "peer ID")
    for p in report["peers"]:
        held = p["held_steps"]
        cells = (
            p["peer_id"],
            p["role"],
            p["http_url"] or "—",
            "—" if p["policy_step"] < 0 else str(p["policy_step"]),
            ", ".join(map(str, held[-8:])) + (" …" if len(held) > 8 else "") if held else "—",
            f"{p['last_seen_s']:.1f} s ago",
            p["version"],
        )
        # peers' self-signed strings: as Text (no rich markup), control characters escaped
        table.add_row(*(Text(printable(c)) for c in cells))
    Console(width=max(160, Console().width)).print(table)
