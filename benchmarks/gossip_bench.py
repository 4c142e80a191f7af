"""Gossip benchmark: announcement propagation over libp2p on loopback, idle cost, and the bridge.

Modes:

* ``propagation`` (default): ``--nodes`` gossip nodes in child processes (``--relays`` relays,
  the first the seed, the rest workers bootstrapping from it) plus this process as the
  coordinator. The coordinator publishes ``--announcements`` checkpoint announcements (and its
  record's ``policy_step``, as the coordinator role does); every node logs when it delivered each
  one, and ``--lossy`` workers drop every announcement and log when the coordinator's record
  told them the step instead. Reports delivery ratio, publish → delivered latency over all
  (announcement, node) pairs (p50/p99/max), the p99 time until *every* node had an announcement,
  then per-node CPU (workers and relays apart) and memory over ``--idle-s`` seconds of idle
  heartbeats, and the records per second the coordinator receives. ``--layout presence`` is the
  node's layout (workers' records only to their hubs, over presence streams; hubs' records on
  gossip); ``split`` is issue 18's (worker records flooded on the ``workers`` topic), ``flat``
  the one before it (every record to every node). ``--layout both`` (default) runs ``split`` and
  ``presence`` in one invocation and prints them side by side, with the load average at the
  start and end of each. ``--layout mesh`` runs the split
  layout before and after issue 18's mesh fixes (hubs' meshes bounded at 12, a yamux
  WINDOW_UPDATE per read) side by side. ``--layout all --p2pd PATH`` adds
  the same workload (single topic) on go-libp2p daemons (``p2pd`` from the ``hivemind`` wheel:
  ``pip download hivemind==1.1.12 --no-deps`` and unzip ``hivemind/hivemind_cli/p2pd`` and
  ``hivemind/proto/p2pd_pb2.py``; protobuf ≥ 5.27 imports it). ``--layout jscompare`` runs ``split``
  and ``js`` side by side: ``js`` is the same split workload (2 relays as hubs, workers connected
  only to hubs, worker records on ``workers``, the coordinator in this process) on js-libp2p
  2.9 nodes (``@chainsafe/libp2p-gossipsub`` 14.1, TCP, noise, yamux; ``benchmarks/js``), each a
  Node.js process whose identity is the node's ed25519 seed and whose gossipsub topic validator
  waits for the node's real ``EnvelopeValidator.check`` in a Python process
  (``benchmarks/js_gossip.py``, which also seals and publishes the node's records); a node's CPU
  and RSS are both processes together (``*_py_part``: the Python one). Install once:
  ``npm ci --prefix benchmarks/js`` (Node.js ≥ 20).
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
OLD_MESH = ("flat", "split-old-mesh")
"""Layouts run as before issue 18's mesh fixes: hubs' meshes bounded at 12, a yamux WINDOW_UPDATE per read."""
JS_RUNNER = REPO / "benchmarks" / "js_gossip.py"
"""Child node of the ``js`` layout: js-libp2p in a Node.js process, the envelope validator in this Python one."""


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0…1) of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def propagation_once(args: argparse.Namespace, layout: str) -> dict[str, object]:
    """One network of ``args.nodes`` child nodes in ``layout`` (``split``, ``flat``, ``split-old-mesh``, or
    ``js``: the split workload on js-libp2p nodes with the Python envelope validator); returns its numbers."""
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
    roles: list[str] = []
    lossy: set[int] = set()
    lines: list[tuple[int, str]] = []  # (node index, stdout line)
    lock = threading.Lock()
    out: dict[str, object] = {"layout": layout, "load_start": round(os.getloadavg()[0], 1)}
    # the old layouts ran py-libp2p's default yamux credit (a WINDOW_UPDATE per read); read at call time
    yamux_env = {"PY_YAMUX_RELEASE_ON_READ": "1" if layout in OLD_MESH else "0"}
    os.environ.update(yamux_env)

    def start(i: int, bootstrap: list[str]) -> subprocess.Popen[str]:
        key = NodeKey.generate()
        key.save(tmp / f"k{i}")
        role = "relay" if i < args.relays else "worker"
        drop = role == "worker" and i >= args.nodes - args.lossy
        if layout == "js":
            cmd = [sys.executable, str(JS_RUNNER), "--run", str(tmp / "run.toml"), "--key", str(tmp / f"k{i}"), "--role", role,
                   "--log-announcements"]
        else:
            cmd = [sys.executable, "-m", "node.p2p.standalone", "--run", str(tmp / "run.toml"), "--key", str(tmp / f"k{i}"), "--role", role,
                   "--bridge", args.bridge, "--log-announcements"]
        cmd += ["--flat"] if layout == "flat" else []
        cmd += ["--old-mesh"] if layout in OLD_MESH else []
        cmd += ["--no-presence"] if layout == "split" else []
        cmd += ["--drop-announcements"] if drop else []
        for b in bootstrap:
            cmd += ["--bootstrap", b]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env | yamux_env)

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                with lock:
                    lines.append((i, line.strip()))

        threading.Thread(target=pump, daemon=True).start()
        procs.append(p)
        roles.append(role)
        if drop:
            lossy.add(i)
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
        if layout == "js":
            from js_gossip import JsGossipNode  # benchmarks/ is this script's directory

            node = await JsGossipNode.create(spec, coord, role="coordinator", bootstrap=[seed])
        else:
            config = GossipConfig(bootstrap=[seed], split_records=layout != "flat", hub_full_mesh=layout not in OLD_MESH,
                                  presence=layout == "presence")
            node = await GossipNode.create(spec, coord, config, role="coordinator")
        while len(node.peers) < args.nodes:
            if time.monotonic() - t0 > args.join_timeout_s:
                out["joined"] = f"{len(node.peers)}/{args.nodes} in {args.join_timeout_s:.0f} s"
                return out
            await asyncio.sleep(0.1)
        out["joined"] = f"{args.nodes}/{args.nodes} in {time.monotonic() - t0:.0f} s"
        await asyncio.sleep(2 * args.heartbeat_s)  # let meshes settle
        sent_ns: dict[int, int] = {}
        for step in range(1, args.announcements + 1):
            ann = CheckpointAnnouncement(step=step, manifest_id=step.to_bytes(32, "big"), checkpoint_hash=b"\0" * 32)
            env_bytes = node.seal(ann)
            sent_ns[step] = time.time_ns()
            node.set_record(policy_step=step)  # as the coordinator role does: its next record carries the step
            await node.publish_announcement(env_bytes)
            await asyncio.sleep(args.interval_s)
        await asyncio.sleep(2.0 + args.heartbeat_s)
        listening = [i for i in range(args.nodes) if i not in lossy]
        per_pair: list[float] = []
        per_ann: dict[int, list[float]] = {s: [] for s in sent_ns}
        learned: dict[int, int] = {}  # lossy node → newest step it learned from records
        learn_lat: list[float] = []
        with lock:
            for i, line in lines:
                if not line.startswith("{"):
                    continue
                rec = json.loads(line)
                if "step" in rec and rec["step"] in sent_ns and i not in lossy:
                    lat = (rec["recv_ns"] - sent_ns[rec["step"]]) / 1e9
                    per_pair.append(lat)
                    per_ann[rec["step"]].append(lat)
                elif "latest" in rec and i in lossy and rec["latest"] in sent_ns:
                    learned[i] = max(learned.get(i, 0), rec["latest"])
                    learn_lat.append((rec["recv_ns"] - sent_ns[rec["latest"]]) / 1e9)
        complete = [max(v) for v in per_ann.values() if len(v) == len(listening)]
        out["delivered"] = f"{len(per_pair)}/{len(listening) * args.announcements}"
        out["delivered_ratio"] = len(per_pair) / max(1, len(listening) * args.announcements)
        if per_pair:
            out["p50_ms"], out["p99_ms"], out["max_ms"] = (round(pct(per_pair, q) * 1e3) for q in (0.5, 0.99, 1.0))
        if complete:
            out["all_p99_ms"] = round(pct(complete, 0.99) * 1e3)
        if lossy:
            ok = sum(1 for i in lossy if learned.get(i) == args.announcements)
            out["lossy_learned_last"] = f"{ok}/{len(lossy)}"
            out["lossy_learn_p99_ms"] = round(pct(learn_lat, 0.99) * 1e3) if learn_lat else None
        # idle: heartbeats only. A node is its process and its children (js: the Node.js process; the
        # Python parent is its envelope validator and record publisher), CPU and RSS summed
        ps = [psutil.Process(p.pid) for p in procs]
        kids = [q.children(recursive=True) for q in ps]
        for q in [*ps, *(k for ks in kids for k in ks)]:
            q.cpu_percent(None)
        stats0 = await node.stats()
        await asyncio.sleep(args.idle_s)
        cpu_py = [q.cpu_percent(None) for q in ps]
        cpu_kids = [sum(k.cpu_percent(None) for k in ks) for ks in kids]
        cpu = [a + b for a, b in zip(cpu_py, cpu_kids)]
        rss_py = [q.memory_info().rss / 2**20 for q in ps]
        rss_kids = [sum(k.memory_info().rss for k in ks) / 2**20 for ks in kids]
        rss = [a + b for a, b in zip(rss_py, rss_kids)]
        stats1 = await node.stats()
        for role in ("worker", "relay"):
            c = [x for x, r in zip(cpu, roles) if r == role]
            if c:
                out[f"idle_cpu_{role}_mean"] = round(statistics.mean(c), 1)
                out[f"idle_cpu_{role}_max"] = round(max(c), 1)
            if layout == "js" and c:  # of which the Python validator process
                out[f"idle_cpu_{role}_py_part"] = round(statistics.mean(x for x, r in zip(cpu_py, roles) if r == role), 1)
        out["rss_mean_mib"] = round(statistics.mean(rss))
        if layout == "js":
            out["rss_py_part_mib"] = round(statistics.mean(rss_py))
        got = {k: stats1["delivered"].get(k, 0) - stats0["delivered"].get(k, 0) for k in ("nodes", "workers")}
        out["coordinator_records_per_s"] = round(sum(got.values()) / args.idle_s, 1)
        out["load_end"] = round(os.getloadavg()[0], 1)
        return out
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


class P2PDaemon:
    """One go-libp2p daemon (``p2pd``) and its control socket (varint-delimited protobufs of
    ``p2pd.proto``). Used only by the ``p2pd`` layout of this benchmark."""

    def __init__(self, binary: str, sock: Path) -> None:
        self.sock = sock
        self.proc = subprocess.Popen([binary, f"-listen=/unix{sock}", "-hostAddrs=/ip4/127.0.0.1/tcp/0", "-pubsub",
                                      "-pubsubRouter=gossipsub", "-gossipsubHeartbeatInterval=1s", "-q"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.peer = b""
        self.addrs: list[bytes] = []
        self._kept: list[asyncio.StreamWriter] = []

    @staticmethod
    async def _read_msg(reader: asyncio.StreamReader, cls: type) -> object:
        shift, size = 0, 0
        while True:
            b = (await reader.readexactly(1))[0]
            size |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
        msg = cls()
        msg.ParseFromString(await reader.readexactly(size))
        return msg

    @staticmethod
    def _frame(msg: object) -> bytes:
        data = msg.SerializeToString()  # type: ignore[attr-defined]
        n, out = len(data), bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out) + data

    async def request(self, pb: object, req: object, *, keep: bool = False) -> tuple[object, asyncio.StreamReader | None]:
        reader, writer = await asyncio.open_unix_connection(str(self.sock))
        writer.write(self._frame(req))
        await writer.drain()
        resp = await self._read_msg(reader, pb.Response)  # type: ignore[attr-defined]
        if resp.type != pb.Response.OK:  # type: ignore[attr-defined]
            raise RuntimeError(f"p2pd: {resp.error.msg}")  # type: ignore[attr-defined]
        if keep:
            self._kept.append(writer)  # a dropped StreamWriter closes its connection, and the daemon ends the subscription
            return resp, reader
        writer.close()
        return resp, None


async def propagation_p2pd(args: argparse.Namespace) -> dict[str, object]:
    """The same workload on go-libp2p daemons: ``args.nodes`` daemons (star on the first plus two
    random earlier peers each), every daemon publishes a 512-byte record every heartbeat on one
    topic every daemon reads (the single-topic layout), one publishes the announcements.

    What is *not* the same: the daemon's control protocol has no topic validator hook, so no
    envelope is checked before it is forwarded (the application could only check after
    delivery); the records are random bytes; the driving Python client (this process) is not
    counted in the daemons' CPU.
    """
    import random

    import psutil

    sys.path.insert(0, str(Path(args.p2pd).resolve().parents[1] / "proto"))
    import p2pd_pb2 as pb  # from the hivemind wheel, next to the binary

    tmp = Path(tempfile.mkdtemp(prefix="p2pd-bench-"))
    out: dict[str, object] = {"layout": "p2pd", "load_start": round(os.getloadavg()[0], 1)}
    daemons = [P2PDaemon(args.p2pd, tmp / f"d{i}.sock") for i in range(args.nodes + 1)]  # the last one publishes announcements
    readers: list[asyncio.Task[None]] = []
    recv: list[tuple[int, int, int]] = []  # (daemon, step, recv_ns)
    try:
        t0 = time.monotonic()
        for d in daemons:
            while True:
                try:
                    resp, _ = await d.request(pb, pb.Request(type=pb.Request.IDENTIFY))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if time.monotonic() - t0 > 60:
                        raise SystemExit("p2pd did not start within 60 s") from None
                    await asyncio.sleep(0.05)
            d.peer, d.addrs = resp.identify.id, list(resp.identify.addrs)  # type: ignore[attr-defined]
        rng = random.Random(0)
        for i, d in enumerate(daemons[1:], start=1):
            for j in {0, *rng.sample(range(i), min(2, i))}:
                await d.request(pb, pb.Request(type=pb.Request.CONNECT, connect=pb.ConnectRequest(peer=daemons[j].peer, addrs=daemons[j].addrs, timeout=10)))

        async def read(i: int, reader: asyncio.StreamReader) -> None:
            while True:
                msg = await P2PDaemon._read_msg(reader, pb.PSMessage)
                if msg.data[:1] == b"A":  # type: ignore[attr-defined]
                    recv.append((i, int.from_bytes(msg.data[1:9], "big"), time.time_ns()))  # type: ignore[attr-defined]

        for i, d in enumerate(daemons[: args.nodes]):
            for topic in ("nodes", "checkpoints"):
                _, reader = await d.request(pb, pb.Request(type=pb.Request.PUBSUB, pubsub=pb.PSRequest(type=pb.PSRequest.SUBSCRIBE, topic=topic)), keep=True)
                assert reader is not None
                readers.append(asyncio.create_task(read(i, reader)))
        out["joined"] = f"{args.nodes}/{args.nodes} in {time.monotonic() - t0:.0f} s"

        async def heartbeats() -> None:
            while True:
                for d in daemons[: args.nodes]:
                    await d.request(pb, pb.Request(type=pb.Request.PUBSUB, pubsub=pb.PSRequest(type=pb.PSRequest.PUBLISH, topic="nodes", data=b"R" + os.urandom(511))))
                await asyncio.sleep(args.heartbeat_s)

        beats = asyncio.create_task(heartbeats())
        try:
            await asyncio.sleep(2 * args.heartbeat_s + 3)  # meshes settle
            pub = daemons[-1]
            sent_ns: dict[int, int] = {}
            for step in range(1, args.announcements + 1):
                sent_ns[step] = time.time_ns()
                data = b"A" + step.to_bytes(8, "big") + os.urandom(300)
                await pub.request(pb, pb.Request(type=pb.Request.PUBSUB, pubsub=pb.PSRequest(type=pb.PSRequest.PUBLISH, topic="checkpoints", data=data)))
                await asyncio.sleep(args.interval_s)
            await asyncio.sleep(2.0 + args.heartbeat_s)
            lat = [(ns - sent_ns[step]) / 1e9 for _, step, ns in recv if step in sent_ns]
            out["delivered"] = f"{len(lat)}/{args.nodes * args.announcements}"
            out["delivered_ratio"] = len(lat) / (args.nodes * args.announcements)
            if lat:
                out["p50_ms"], out["p99_ms"], out["max_ms"] = (round(pct(lat, q) * 1e3) for q in (0.5, 0.99, 1.0))
            ps = [psutil.Process(d.proc.pid) for d in daemons[: args.nodes]]
            for p in ps:
                p.cpu_percent(None)
            await asyncio.sleep(args.idle_s)
            cpu = [p.cpu_percent(None) for p in ps]
            out["idle_cpu_daemon_mean"] = round(statistics.mean(cpu), 1)
            out["idle_cpu_daemon_max"] = round(max(cpu), 1)
            out["rss_mean_mib"] = round(statistics.mean(p.memory_info().rss / 2**20 for p in ps))
        finally:
            beats.cancel()
        out["load_end"] = round(os.getloadavg()[0], 1)
        return out
    finally:
        for t in readers:
            t.cancel()
        for d in daemons:
            d.proc.terminate()
        for d in daemons:
            try:
                d.proc.wait(10)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait(5)


async def propagation(args: argparse.Namespace) -> None:
    """Run each layout in turn in this one invocation and print them side by side."""
    layouts = {"both": ["split", "presence"], "all": ["flat", "split", "presence", "p2pd"], "mesh": ["split-old-mesh", "split"],
               "jscompare": ["split", "js"]}.get(args.layout, [args.layout])
    if "p2pd" in layouts and not args.p2pd:
        raise SystemExit("--p2pd PATH (the p2pd binary of the hivemind wheel) is needed for the p2pd layout")
    if "js" in layouts and not (REPO / "benchmarks" / "js" / "node_modules" / "libp2p").is_dir():
        raise SystemExit("the js layout needs Node.js ≥ 20 and its packages: npm ci --prefix benchmarks/js")
    results = []
    for layout in layouts:
        r = await (propagation_p2pd(args) if layout == "p2pd" else propagation_once(args, layout))
        print(json.dumps(r), flush=True)
        results.append(r)
    keys = list(dict.fromkeys(k for r in results for k in r))
    print(f"\n{args.nodes} nodes ({args.relays} relays, {args.lossy} dropping every announcement), heartbeat {args.heartbeat_s:g} s, "
          f"{args.announcements} announcements every {args.interval_s:g} s, idle window {args.idle_s:g} s, CPU in % of one core")
    print(f"{'':28s}" + "".join(f"{r['layout']:>22s}" for r in results))
    for k in keys:
        if k != "layout":
            print(f"{k:28s}" + "".join(f"{str(r.get(k, '-')):>22s}" for r in results))


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
    p.add_argument("--announcements", type=int, default=20, help="announcements to publish (default 20)")
    p.add_argument("--interval-s", type=float, default=0.25, help="seconds between announcements (default 0.25)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="node record interval, seconds (default 2, the spec default)")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle measurement window, seconds (default 10)")
    p.add_argument("--join-timeout-s", type=float, default=120.0, help="seconds for all nodes to start and be seen")
    p.add_argument("--bridge", default="thread", choices=["thread", "guest"], help="bridge used by the child nodes")
    p.add_argument("--layout", default="both", choices=["both", "all", "mesh", "jscompare", "presence", "split", "split-old-mesh", "flat", "p2pd", "js"],
                   help="presence: workers' records go only to their hubs over presence streams, hubs publish roster digests (the node's layout); "
                        "split: worker records flooded on their own gossip topic (issue 18); flat: every record to every node (before issue 18); "
                        "split-old-mesh: split, but hubs' meshes bounded at 12 and a yamux WINDOW_UPDATE per read (before the mesh fixes); "
                        "mesh: split-old-mesh then split; "
                        "p2pd: the flat workload on go-libp2p daemons; js: the split workload on js-libp2p nodes (validator in Python); "
                        "both: split then presence; all: flat, split, presence, p2pd; jscompare: split then js — in one run")
    p.add_argument("--p2pd", default="", help="p2pd binary (hivemind wheel: hivemind/hivemind_cli/p2pd, p2pd_pb2.py in ../proto)")
    p.add_argument("--relays", type=int, default=2, help="child nodes that are relays (the seed is one); the rest are workers (default 2)")
    p.add_argument("--lossy", type=int, default=2, help="workers that drop every announcement and must learn steps from the coordinator's record (default 2)")
    p.add_argument("--calls", type=int, default=2000, help="bridge mode: round trips per bridge kind")
    args = p.parse_args()
    asyncio.run(propagation(args) if args.mode == "propagation" else bridge_bench(args))


if __name__ == "__main__":
    main()
