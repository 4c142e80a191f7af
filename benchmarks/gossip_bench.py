"""Gossip benchmark: announcement propagation over libp2p on loopback, idle cost, and the bridge.

Modes:

* ``propagation`` (default): ``--nodes`` gossip nodes in child processes (one seed, the rest
  bootstrapping from it) plus this process as the coordinator. The coordinator publishes
  ``--announcements`` checkpoint announcements; every node logs when it delivered each one.
  Reports publish → delivered latency over all (announcement, node) pairs (p50/p99), the time until
  *every* node had an announcement (p50/p99), delivery ratio, then per-node CPU and memory after
  ``--idle-s`` seconds of idle heartbeats.
* ``bridge``: asyncio → trio → asyncio round trips through each bridge kind, and how long libp2p's
  side (a 10 ms trio ticker) stalls while the asyncio thread blocks for 200 ms.

Run: ``python benchmarks/gossip_bench.py [--nodes 16] [--bridge thread|guest]`` or
``python benchmarks/gossip_bench.py bridge``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "node" / "gossip_runner.py"


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0…1) of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def propagation(args: argparse.Namespace) -> None:
    import psutil

    from node.p2p import GossipConfig, GossipNode
    from protocol.identity import NodeKey
    from protocol.messages import CheckpointAnnouncement
    from protocol.runspec import NetworkSpec, RunInfo, RunSpec, dump_run_spec, sign_run_spec

    tmp = Path(tempfile.mkdtemp(prefix="gossip-bench-"))
    coord = NodeKey.generate()
    spec = RunSpec(run=RunInfo(coordinator=coord.peer_id), network=NetworkSpec(heartbeat_interval_s=args.heartbeat_s))
    (tmp / "run.toml").write_text(dump_run_spec(sign_run_spec(spec, coord)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[str]] = []
    lines: list[tuple[int, str]] = []  # (node index, stdout line)
    lock = threading.Lock()

    def start(i: int, bootstrap: list[str]) -> subprocess.Popen[str]:
        key = NodeKey.generate()
        key.save(tmp / f"k{i}")
        cmd = [sys.executable, str(RUNNER), "--run", str(tmp / "run.toml"), "--key", str(tmp / f"k{i}"), "--role", "relay",
               "--bridge", args.bridge, "--log-announcements"]
        for b in bootstrap:
            cmd += ["--bootstrap", b]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                with lock:
                    lines.append((i, line.strip()))

        threading.Thread(target=pump, daemon=True).start()
        procs.append(p)
        return p

    def ready_addr(i: int) -> str | None:
        with lock:
            for j, line in lines:
                if j == i and line.startswith("READY "):
                    return line.split()[1]
        return None

    node = None
    try:
        t0 = time.monotonic()
        start(0, [])
        while (seed := ready_addr(0)) is None:
            if time.monotonic() - t0 > 60:
                raise SystemExit("seed did not start within 60 s")
            await asyncio.sleep(0.05)
        for i in range(1, args.nodes):
            start(i, [seed])
        node = await GossipNode.create(spec, coord, GossipConfig(bootstrap=[seed]), role="coordinator")
        while len(node.peers) < args.nodes:
            if time.monotonic() - t0 > args.join_timeout_s:
                raise SystemExit(f"only {len(node.peers)}/{args.nodes} nodes joined within {args.join_timeout_s} s")
            await asyncio.sleep(0.1)
        print(f"{args.nodes} nodes up and seen by the coordinator after {time.monotonic() - t0:.1f} s (bridge: {args.bridge})")
        await asyncio.sleep(2 * args.heartbeat_s)  # let meshes settle
        sent_ns: dict[int, int] = {}
        for step in range(1, args.announcements + 1):
            ann = CheckpointAnnouncement(step=step, manifest_id=step.to_bytes(32, "big"), checkpoint_hash=b"\0" * 32)
            env_bytes = node.seal(ann)
            sent_ns[step] = time.time_ns()
            await node.publish_announcement(env_bytes)
            await asyncio.sleep(args.interval_s)
        await asyncio.sleep(2.0)
        per_pair: list[float] = []
        per_ann: dict[int, list[float]] = {s: [] for s in sent_ns}
        per_node = [0] * args.nodes
        with lock:
            for i, line in lines:
                if line.startswith("{"):
                    rec = json.loads(line)
                    if rec["step"] in sent_ns:
                        lat = (rec["recv_ns"] - sent_ns[rec["step"]]) / 1e9
                        per_pair.append(lat)
                        per_ann[rec["step"]].append(lat)
                        per_node[i] += 1
        expected = args.nodes * args.announcements
        complete = [max(v) for v in per_ann.values() if len(v) == args.nodes]
        print(f"delivered {len(per_pair)}/{expected} (announcement, node) pairs; per node: {per_node}")
        if per_pair:
            print(f"publish → delivered at a node:   p50 {pct(per_pair, 0.5) * 1e3:7.1f} ms   p99 {pct(per_pair, 0.99) * 1e3:7.1f} ms   max {max(per_pair) * 1e3:7.1f} ms")
        if complete:
            print(f"publish → delivered at every node: p50 {pct(complete, 0.5) * 1e3:7.1f} ms   p99 {pct(complete, 0.99) * 1e3:7.1f} ms   ({len(complete)}/{args.announcements} reached all)")
        # idle: heartbeats only
        ps = [psutil.Process(p.pid) for p in procs]
        for p in ps:
            p.cpu_percent(None)
        await asyncio.sleep(args.idle_s)
        cpu = [p.cpu_percent(None) for p in ps]
        rss = [p.memory_info().rss / 2**20 for p in ps]
        stats = await node.stats()
        print(
            f"idle ({args.idle_s:.0f} s, heartbeat {args.heartbeat_s:g} s, {args.nodes} peers): CPU per node mean {statistics.mean(cpu):.1f}% "
            f"max {max(cpu):.1f}% of one core; RSS per node mean {statistics.mean(rss):.0f} MiB max {max(rss):.0f} MiB; "
            f"coordinator connections {stats['connected']}, rejected {stats['rejected']}"
        )
    finally:
        if node is not None:
            await node.stop()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


async def bridge_bench(args: argparse.Namespace) -> None:
    import trio

    from node.p2p.bridge import make_bridge

    for kind in ("thread", "guest"):
        bridge = make_bridge(kind)  # type: ignore[arg-type]
        await bridge.start()
        try:
            async def noop() -> None:
                await trio.lowlevel.checkpoint()

            rtts: list[float] = []
            for _ in range(args.calls):
                t = time.perf_counter()
                await bridge.run(noop, timeout_s=5)
                rtts.append(time.perf_counter() - t)
            gaps: list[float] = []

            async def ticker(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED, gaps: list[float] = gaps) -> None:
                task_status.started(None)
                last = time.perf_counter()
                while True:
                    await trio.sleep(0.01)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            handle = await bridge.start_task(ticker, timeout_s=5)
            await asyncio.sleep(0.2)
            time.sleep(0.2)  # noqa: ASYNC251 - on purpose: the asyncio thread blocks, e.g. a forward pass left on the loop
            await asyncio.sleep(0.2)
            await handle.cancel()
            print(
                f"{kind:6s}: asyncio→trio→asyncio round trip p50 {pct(rtts, 0.5) * 1e6:6.0f} µs p99 {pct(rtts, 0.99) * 1e6:6.0f} µs; "
                f"longest trio tick gap while asyncio blocked 200 ms: {max(gaps) * 1e3:.0f} ms"
            )
        finally:
            await bridge.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="propagation", choices=["propagation", "bridge"])
    p.add_argument("--nodes", type=int, default=16, help="gossip nodes in child processes (default 16)")
    p.add_argument("--announcements", type=int, default=40, help="announcements to publish (default 40)")
    p.add_argument("--interval-s", type=float, default=0.25, help="seconds between announcements (default 0.25)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="node record interval, seconds (default 2, the spec default)")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle measurement window, seconds (default 10)")
    p.add_argument("--join-timeout-s", type=float, default=120.0, help="seconds for all nodes to start and be seen")
    p.add_argument("--bridge", default="thread", choices=["thread", "guest"], help="bridge used by the child nodes")
    p.add_argument("--calls", type=int, default=2000, help="bridge mode: round trips per bridge kind")
    args = p.parse_args()
    asyncio.run(propagation(args) if args.mode == "propagation" else bridge_bench(args))


if __name__ == "__main__":
    main()
