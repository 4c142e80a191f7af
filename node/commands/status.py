"""`status`: this node's own work in the run (from the coordinator's signed account), and the run's live
peers (joining its gossip briefly as a silent observer)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from node.cli import CliError, add_run_argument, command
from node.paths import default_data_dir, default_key_path

DEFAULT_WAIT_S = 10.0
QUIET_HEARTBEATS = 1.5
"""Stop collecting once no new peer appeared for this many heartbeat intervals (after the first record)."""
MIN_HEARTBEATS = 2.5
"""…but collect at least this many heartbeat intervals after the first record, so every live peer
(each publishes one record per interval) had a chance to be heard, even on a slow mesh."""


@command
def _status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="this node's accepted, rejected and trained submissions and leaderboard place (signed by the "
                                      "coordinator), and the run's live peers and latest step")
    add_run_argument(p)
    p.add_argument("--data-dir", default=None, help=f"node data directory, where its key is (default: {default_data_dir()})")
    p.add_argument("--key", default=None, help=f"this node's key (default: <data-dir>/{default_key_path().name}); "
                                                "its work is shown when the key exists")
    p.add_argument("--mine", action="store_true", help="only this node's work: do not join gossip for the peer table")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help="bootstrap peer, added to the spec's (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="S", help=f"longest time to collect records, seconds (default {DEFAULT_WAIT_S:g})")
    p.add_argument("--listen-host", default="127.0.0.1", help="interface for the observer's libp2p host (default 127.0.0.1)")
    p.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from node.bootstrap import JoinError, read_run

    if not 0 < args.wait <= 3600:
        raise CliError("--wait must be between 0 and 3600 seconds")
    if bool(args.address) == bool(args.run):
        raise CliError("name the run once: its address (intellect1:…) or --run run.toml")
    for addr in args.bootstrap:
        if "/p2p/" not in addr:
            raise CliError(f"--bootstrap {addr!r} must end in /p2p/<peer ID>")
    data_dir = Path(args.data_dir) if args.data_dir else None
    try:
        signed, address = read_run(args.address or args.run, data_dir or default_data_dir())
    except JoinError as e:
        raise CliError(str(e)) from None
    mine = _my_work(signed, address, data_dir, args.key)
    if args.mine and mine is None:
        raise CliError(f"--mine: this machine has no node key at {default_key_path(data_dir)} (it has not joined a run; or pass --key)")
    bootstrap = list(dict.fromkeys([*args.bootstrap, *(address.bootstrap if address else ())]))
    report: dict[str, Any] = {"run_id": signed.run_id.hex()}
    if mine is not None:
        report["mine"] = mine
    if not args.mine:
        if not bootstrap and not signed.spec.network.bootstrap:
            if mine is None:
                raise CliError("no bootstrap peer: pass --bootstrap MULTIADDR or set network.bootstrap in the run spec")
        else:
            report.update(asyncio.run(_collect(signed.spec, bootstrap, args.wait, args.listen_host)))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if mine is not None:
            _print_mine(mine)
        if "peers" in report:
            _print_table(report)
    if "peers" in report and not report["peers"]:
        print(f"no node records heard within {args.wait:g} s (are the bootstrap peers up?)", file=sys.stderr)
        return 1
    if mine is not None and "error" in mine and (args.mine or args.key):  # asked for: its failure is the command's
        return 1
    return 0


def _my_work(signed: Any, address: Any, data_dir: Any, key_path: str | None) -> dict[str, Any] | None:
    """This node's standing as the coordinator signed it (``None`` when this machine has no key)."""
    import asyncio
    from pathlib import Path

    from node.cli import load_key

    path = Path(key_path) if key_path else default_key_path(data_dir)
    if not path.exists() and key_path is None:
        return None
    key = load_key(str(path))
    urls = list(dict.fromkeys([*(address.http_urls if address else ()), *signed.spec.network.ingest_urls]))
    try:
        return asyncio.run(fetch_standing(urls, signed, key.peer_id))
    except OSError as e:
        return {"peer_id": key.peer_id, "error": str(e)}


STANDING_TIMEOUT_S = 10.0
STANDING_MAX_AGE_S = 600.0
"""A signed standing older than this is refused (a replay of an old one), seconds."""
"""Whole-request deadline of one standing request, seconds."""


async def fetch_standing(urls: list[str], signed: Any, peer_id: str) -> dict[str, Any]:
    """Ask the coordinator's URLs in turn for ``peer_id``'s ``worker_standing/1`` and verify it: signed
    by the run's coordinator key, of this run, about this peer. Returns its fields (and ``signed_at_ms``).

    Raises:
        OSError: no URL, or none answered with a valid signed standing (one line with the reasons).
    """
    import aiohttp

    from node.http_read import BodyTooLarge, read_body
    from protocol.envelope import open_envelope
    from protocol.errors import ProtocolError
    from protocol.ingest_api import worker_path
    from protocol.messages import WorkerStanding

    if not urls:
        raise OSError("the run spec names no ingest URL to ask (join with the run's address)")
    problems = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STANDING_TIMEOUT_S)) as session:
        for url in urls[:4]:
            try:
                async with session.get(f"{url.rstrip('/')}{worker_path(peer_id)}", allow_redirects=False) as r:
                    try:
                        raw = await read_body(r, WorkerStanding.MAX_BYTES)
                    except BodyTooLarge as e:
                        problems.append(f"{url}: {e}")
                        continue
                    status = r.status
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                problems.append(f"{url}: unreachable ({type(e).__name__})")
                continue
            if status != 200:
                problems.append(f"{url}: HTTP {status}")
                continue
            try:
                env = open_envelope(raw, run_id=signed.run_id, expect=WorkerStanding, authorities=signed.spec.authorities,
                                    max_age_s=STANDING_MAX_AGE_S)
            except ProtocolError as e:
                problems.append(f"{url}: not a standing signed by this run's coordinator ({str(e)[:120]})")
                continue
            if env.body.worker != peer_id:
                problems.append(f"{url}: a standing of another worker")
                continue
            return {"peer_id": peer_id, **env.body.model_dump(exclude={"worker"}), "signed_at_ms": env.ts_ms}
    raise OSError("no coordinator URL gave this node's signed standing: " + "; ".join(problems))


def _print_mine(mine: dict[str, Any]) -> None:
    from node.terminal import printable

    if "error" in mine:
        print(f"this node {mine['peer_id']}: {printable(mine['error'])}", file=sys.stderr)
        return
    reasons = ", ".join(f"{printable(k)} {v}" for k, v in sorted(mine["rejected_by_reason"].items(), key=lambda kv: -kv[1])) or "none"
    place = f"{mine['place']} of {mine['workers']}" if mine["place"] else f"— (no submission yet; {mine['workers']} workers)"
    print(f"this node {mine['peer_id']} (signed by the coordinator at trainer step {mine['trainer_step']}):")
    print(f"  accepted {mine['accepted']}, rejected {mine['rejected']} ({reasons}), pending {mine['pending']}, "
          f"trained on {mine['trained']} submissions ({mine['rollouts_trained']} rollouts), displaced {mine['displaced']}")
    print(f"  leaderboard place {place}" + (f"; BANNED: {printable(mine['ban_reason'])}" if mine["banned"] else ""))


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
