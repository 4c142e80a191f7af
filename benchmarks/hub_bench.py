"""Hub-scale benchmark: one real relay and the coordinator's gossip with many simulated workers.

For each ``--workers`` level (default 30, 120, 500) and each ``--layouts`` entry (default
``presence``, the node's design, then ``split``, issue 18's layout where every worker record is
flooded on the ``workers`` topic), in one invocation:

* a relay (the seed) and the coordinator run in their own processes, as the node runs them
  (``GossipNode``, role ``relay`` / ``coordinator``, the run spec's heartbeat interval, 2 s by
  default; ``max_peers`` raised to carry every worker);
* the workers are real ``GossipNode`` instances of role ``worker``, ``--per-process`` (16) of them
  multiplexed in each of several processes (one asyncio loop and one trio thread per process), each
  with its own key and its own libp2p connection to the relay (``target_peers`` 1: the relay is the
  hub measured; the coordinator learns the workers through it), sealing its real signed record at
  the spec's interval and sending it exactly as the worker role does (``presence``: to its hub, a
  record on change and a beat every 5 intervals; ``split``: on gossip every interval);
* once every worker is listed by the coordinator, the coordinator publishes ``--announcements``
  checkpoint announcements ``--interval-s`` (8) apart (raising its record's policy step, as the
  coordinator role does) and every worker sets its record's policy step 0.5–1.5 intervals after it
  hears one (as the worker role does once it fetched the step); reported: delivered, publish →
  delivered p50 / p99 / max over (announcement, worker) pairs; where that time goes: coordinator
  → relay (the relay's own hearing of each announcement), relay → worker p50 / p99, the spread of
  the p99 over worker processes, and how late each process's trio loop (py-libp2p) and asyncio
  loop woke over the phase (``LagProbe``: p99 / max lateness of a 50 ms sleep in ms, relay and
  coordinator as trio p99/max/asyncio p99/max; and the seconds spent over 100 ms late, summed
  over the worker processes);
* then ``--idle-s`` seconds of idle: CPU of each process as CPU-seconds per wall-second
  (``psutil``; user + system, in % of one core) and RSS — relay, coordinator, and workers as the
  sum of their processes divided by the number of workers; the relay's TCP payload bytes in and
  out per second (noise and yamux included; ``ss -tin`` over the connections to its port) while
  idle and over the announcement phase, and its TCP segments per second while idle (keepalive
  probes included); the relay's and coordinator's CPU over the announcement phase too (each
  announcement, the view and the policy-step change of every worker's record it causes, and the
  roster fetches those changes cause);
* ``--mint N`` (presence only, first level): what minting a worker identity costs. A separate
  process makes N fresh identities one after another; each connects to the relay (noise
  handshake), opens a presence stream, sends one signed record and leaves; then one identity
  sends 200 records as fast as it can on one stream (dropped past its budget, unparsed, then
  banned). Reported: the relay's extra CPU per identity / per frame against the minter's own.

Machine: the relay's and coordinator's CPU figures are CPU-seconds per wall-second of their own
process, so other load slows them but does not inflate them; latency figures do suffer from load.
Every run prints the load average at the start and end of each level.

``--worker-nice 19`` runs the simulated workers' processes at that nice value, so the relay and the
coordinator come first for this machine's cores (what the hubs cost when they do not share their
cores with hundreds of workers); ``--py-spy DIR`` samples the stacks of the relay, the coordinator
and the first worker process over the announcement phase and the idle window (collapsed stacks,
one file per process and phase).

Run: ``python benchmarks/hub_bench.py [--workers 30,120,500] [--layouts presence,split]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = ("presence", "split")
JOIN_BATCH = 8
JOIN_PROCESSES = 4
"""Simulated workers started at once in one process; the next batch starts once these have joined
(a hub's noise handshakes and py-libp2p's per-connection set-up are a burst this machine serves slowly)."""


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0…1) of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


# --- child processes ---------------------------------------------------------------------------


def gossip_config(args: argparse.Namespace, **kw: Any) -> Any:
    from node.p2p import GossipConfig

    return GossipConfig(presence=args.layout == "presence", max_peers=args.max_peers, **kw)


async def stdin_lines() -> asyncio.Queue[str]:
    """Lines of this process's stdin, as an asyncio queue (the driver's commands)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str] = asyncio.Queue()

    def pump() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(queue.put_nowait, line.strip())
        loop.call_soon_threadsafe(queue.put_nowait, "stop")

    threading.Thread(target=pump, daemon=True).start()
    return queue


class LagProbe:
    """How late this process's event loops wake: a trio task (the bridge's thread, where py-libp2p
    runs) and an asyncio task each sleep ``PROBE_S`` in a loop and record by how much each sleep
    overran (wall-clock ns at the wake, seconds late). A loop blocked by its own work, starved of
    the GIL by the other thread, or of a core by other processes, shows as lateness. It probes only
    while ``active`` (the announcement phase, whose CPU figures include it): at 100 wake-ups a
    second on two loops it cost a hub ≈ 3 % of a core, so it wakes 20 times a second, and the idle
    figures never carry it (inactive it checks once a second)."""

    PROBE_S = 0.05

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[int, float]]] = {"trio": [], "asyncio": []}
        self.active = False

    async def start(self, bridge: Any) -> None:
        import trio

        async def trio_probe(task_status: Any = None) -> None:
            task_status.started()
            while True:
                if not self.active:
                    await trio.sleep(1.0)
                    continue
                t = trio.current_time()
                await trio.sleep(self.PROBE_S)
                self.samples["trio"].append((time.time_ns(), trio.current_time() - t - self.PROBE_S))

        async def asyncio_probe() -> None:
            loop = asyncio.get_running_loop()
            while True:
                if not self.active:
                    await asyncio.sleep(1.0)
                    continue
                t = loop.time()
                await asyncio.sleep(self.PROBE_S)
                self.samples["asyncio"].append((time.time_ns(), loop.time() - t - self.PROBE_S))

        await bridge.start_task(trio_probe, timeout_s=30)
        self._task = asyncio.get_running_loop().create_task(asyncio_probe())

    def summary(self, from_ns: int, to_ns: int) -> dict[str, Any]:
        """Per loop over [from_ns, to_ns]: p99 and max lateness (ms), and seconds spent > 100 ms late."""
        out: dict[str, Any] = {}
        for name, xs in self.samples.items():
            lags = [lag for at, lag in xs if from_ns <= at <= to_ns]
            if lags:
                out[name] = {"p99_ms": round(1e3 * pct(lags, 0.99)), "max_ms": round(1e3 * max(lags)),
                             "late_s": round(sum(lag for lag in lags if lag > 0.1), 2)}
        return out


async def child_hub(args: argparse.Namespace) -> None:
    """The relay (seed) or the coordinator, answering ``status`` / ``announce STEP`` / ``stop``."""
    from node.p2p import GossipNode
    from node.p2p.bridge import make_bridge
    from protocol.identity import NodeKey
    from protocol.messages import CheckpointAnnouncement
    from protocol.runspec import load_run_spec

    spec = load_run_spec(Path(args.run)).spec
    key = NodeKey.load(Path(args.key)) if args.key else NodeKey.generate()
    config = gossip_config(args, bootstrap=[args.bootstrap] if args.bootstrap else [])
    bridge = make_bridge("thread")
    await bridge.start()
    probe = LagProbe()
    await probe.start(bridge)
    node = await GossipNode.create(spec, key, config, role=args.child, bridge=bridge)
    node.on_announcement(lambda env: emit({"hub_heard": env.body.step, "ns": time.time_ns()}))
    emit({"ready": node.addrs[0]})
    commands = await stdin_lines()
    try:
        while (cmd := await commands.get()) != "stop":
            if cmd == "status":
                stats = await node.stats()
                by_role: dict[str, int] = {}
                for p in node.peers:
                    by_role[p.role] = by_role.get(p.role, 0) + 1
                emit({"status": {"by_role": by_role, "connected": stats["connected"], "presence": stats.get("presence"),
                                 "rosters": stats.get("rosters"), "rejected": stats["rejected"], "send_drops": stats["send_drops"]}})
            elif cmd.startswith("announce "):
                step = int(cmd.split()[1])
                ann = CheckpointAnnouncement(step=step, manifest_id=step.to_bytes(32, "big"), checkpoint_hash=b"\0" * 32)
                data = node.seal(ann)
                sent_ns = time.time_ns()
                node.set_record(policy_step=step)  # as the coordinator role does when it announces
                await node.publish_announcement(data)
                emit({"announced": step, "sent_ns": sent_ns})
            elif cmd.startswith("probe "):
                probe.active = cmd == "probe 1"
            elif cmd.startswith("lag "):
                emit({"lag": probe.summary(*(int(x) for x in cmd.split()[1:]))})
    finally:
        await node.stop()
        await bridge.stop()


async def child_workers(args: argparse.Namespace) -> None:
    """``--count`` workers sharing one bridge; each logs the announcements it hears."""
    from node.p2p import GossipNode
    from node.p2p.bridge import make_bridge
    from protocol.identity import NodeKey
    from protocol.runspec import load_run_spec

    spec = load_run_spec(Path(args.run)).spec
    bridge = make_bridge("thread")
    await bridge.start()
    probe = LagProbe()
    await probe.start(bridge)
    nodes: list[Any] = []
    # Each simulated worker attaches to the relay only (target_peers 1): the relay is the hub measured, and
    # the coordinator hears them as it would through any hub (presence: the relay's roster; split: the
    # flooded records the relay forwards). Bootstrap retries capped at 5 s instead of 30 s: under this
    # machine's load a handshake may time out.
    config = gossip_config(args, bootstrap=[args.bootstrap], bootstrap_backoff_max_s=5.0, dial_timeout_s=15.0, target_peers=1)
    try:
        loop = asyncio.get_running_loop()
        rng = random.Random()

        def attach(node: Any, i: int) -> Any:
            def heard(env: Any) -> None:
                emit({"step": env.body.step, "recv_ns": time.time_ns(), "w": i})
                # as a worker does once it fetched the step (a fetch takes a while: 0.5-1.5 intervals here)
                loop.call_later(rng.uniform(0.5, 1.5) * spec.network.heartbeat_interval_s, lambda: node.set_record(policy_step=env.body.step))

            node.on_announcement(heard)
            return node

        def joined(node: Any) -> bool:
            return bool(node.attached_hubs) if node.presence else node.peers.coordinator() is not None

        for start in range(0, args.count, JOIN_BATCH):  # a ramp: each batch attached before the next starts
            batch = range(start, min(args.count, start + JOIN_BATCH))
            made = await asyncio.gather(*(GossipNode.create(spec, NodeKey.generate(), config, role="worker", bridge=bridge) for _ in batch))
            nodes.extend(attach(n, i) for n, i in zip(made, batch))
            deadline = time.monotonic() + 60.0
            while not all(joined(n) for n in made) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            emit({"progress": len(nodes)})
        emit({"started": len(nodes)})
        commands = await stdin_lines()
        while (cmd := await commands.get()) != "stop":
            if cmd == "status":
                hubs = [len(n.attached_hubs) if n.presence else len(n.peers) for n in nodes]
                emit({"status": {"workers": len(nodes), "min_hubs": min(hubs), "mean_hubs": round(statistics.mean(hubs), 2)}})
            elif cmd.startswith("probe "):
                probe.active = cmd == "probe 1"
            elif cmd.startswith("lag "):
                emit({"lag": probe.summary(*(int(x) for x in cmd.split()[1:]))})
    finally:
        await asyncio.gather(*(n.stop() for n in nodes), return_exceptions=True)
        await bridge.stop()


async def child_mint(args: argparse.Namespace) -> None:
    """Mint ``--count`` worker identities against the relay, one after another, then flood one stream."""
    import trio
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    from node.p2p.bridge import make_bridge
    from node.p2p.config import GossipConfig
    from node.p2p.host import P2PHost, parse_peer_addr
    from protocol.envelope import seal
    from protocol.identity import NodeKey
    from protocol.messages import NodeRecord
    from protocol.presence import RECORD, frame, presence_protocol
    from protocol.runspec import load_run_spec

    spec = load_run_spec(Path(args.run)).spec
    relay = parse_peer_addr(args.bootstrap)
    proto = TProtocol(presence_protocol(spec.run_id))
    bridge = make_bridge("thread")
    await bridge.start()

    async def one(key: NodeKey, frames: int) -> None:
        host = P2PHost(key, GossipConfig())
        async with trio.open_nursery() as nursery:
            await nursery.start(host.serve)
            await host.host.connect(relay)
            stream = await host.host.new_stream(ID.from_base58(relay.peer_id.to_base58()), [proto])
            for seq in range(frames):
                rec = NodeRecord(peer_id=key.peer_id, role="worker", seq=seq, version="mint")
                try:
                    await stream.write(frame(RECORD, seal(key, spec.run_id, rec)))
                except Exception:  # noqa: BLE001 - banned: the relay hung up
                    break
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    try:
        commands = await stdin_lines()
        emit({"ready": True})
        while (cmd := await commands.get()) != "stop":
            kind, n = cmd.split()
            t0, c0 = time.monotonic(), time.process_time()
            for _ in range(int(n) if kind == "identities" else 1):
                await bridge.run(one, NodeKey.generate(), 1 if kind == "identities" else int(n), timeout_s=60)
            emit({"done": kind, "n": int(n), "wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - c0})
    finally:
        await bridge.stop()


# --- driver ------------------------------------------------------------------------------------


class Child:
    """A child process of this benchmark speaking JSON lines on stdout, commands on stdin."""

    log_dir: Path | None = None
    """Where children's stderr goes (``--log-dir``); None: discarded."""

    def __init__(self, argv: list[str], env: dict[str, str], nice: int = 0) -> None:
        err: Any = subprocess.DEVNULL
        if Child.log_dir is not None:
            Child.log_dir.mkdir(parents=True, exist_ok=True)
            err = open(Child.log_dir / f"{argv[1]}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err, text=True, env=env, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                with self._lock:
                    self.lines.append(json.loads(line))

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def take(self, key: str) -> list[dict[str, Any]]:
        with self._lock:
            return [x for x in self.lines if key in x]

    async def wait(self, key: str, timeout_s: float, after: int = 0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.take(key)
            if len(got) > after:
                return got[after]
            if self.proc.poll() is not None:
                raise RuntimeError(f"child {self.proc.args[2:5]} exited with {self.proc.returncode}")
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no {key!r} from {self.proc.args[2:5]} within {timeout_s} s")

    async def status(self, timeout_s: float = 30.0) -> dict[str, Any]:
        n = len(self.take("status"))
        self.send("status")
        return (await self.wait("status", timeout_s, after=n))["status"]

    def stop(self) -> None:
        self.send("stop")
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def tcp_counters(port: int) -> tuple[int, int, int]:
    """Payload bytes received, bytes sent (acknowledged) and TCP segments in + out, summed over the
    established TCP connections whose local port is ``port`` (the relay's listening port: every
    worker's and the coordinator's connection to it), from ``ss -tin`` (the kernel's tcp_info)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    got = {k: sum(int(v) for v in re.findall(rf"\b{k}:(\d+)", out)) for k in ("bytes_received", "bytes_acked", "segs_in", "segs_out")}
    return got["bytes_received"], got["bytes_acked"], got["segs_in"] + got["segs_out"]


def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """Sample ``pid``'s Python stacks for ``seconds`` with py-spy (``--py-spy DIR``), not stopping
    it (``--nonblocking``), into ``out`` as collapsed stacks (one line per stack: frames;…; count).
    Only the thread holding the GIL is sampled (``--gil``): a hub runs py-libp2p's trio thread
    beside its asyncio thread, and a thread waiting for the GIL would otherwise be counted where it
    happened to stop, as if it ran there."""
    exe = Path(sys.executable).with_name("py-spy")
    if not exe.exists():
        raise SystemExit(f"--py-spy: {exe} not found (pip install py-spy)")
    return subprocess.Popen([str(exe), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "100",
                             "--format", "raw", "--nonblocking", "--threads", "--gil", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def rss_mib(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).memory_info().rss / 2**20)


async def level(args: argparse.Namespace, workers: int, layout: str, tmp: Path) -> dict[str, Any]:
    """One network: relay, coordinator, ``workers`` simulated workers in ``layout``; returns its numbers."""
    from protocol.identity import NodeKey
    from protocol.runspec import NetworkSpec, RunInfo, RunSpec, dump_run_spec, sign_run_spec

    coord_key = NodeKey.generate()
    key_path = tmp / f"coord-{workers}-{layout}.key"
    coord_key.save(key_path)
    spec = RunSpec(run=RunInfo(coordinator=coord_key.peer_id), network=NetworkSpec(heartbeat_interval_s=args.heartbeat_s))
    spec_path = tmp / f"run-{workers}-{layout}.toml"
    spec_path.write_text(dump_run_spec(sign_run_spec(spec, coord_key)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    common = ["--run", str(spec_path), "--layout", layout, "--max-peers", str(workers + 64)]
    out: dict[str, Any] = {"workers": workers, "layout": layout, "load_start": round(os.getloadavg()[0], 1)}
    children: list[Child] = []
    try:
        relay = Child(["--child", "relay", *common], env)
        children.append(relay)
        seed = (await relay.wait("ready", 60))["ready"]
        coord = Child(["--child", "coordinator", "--key", str(key_path), "--bootstrap", seed, *common], env)
        children.append(coord)
        await coord.wait("ready", 60)
        t0 = time.monotonic()
        procs = math.ceil(workers / args.per_process)
        pools = []
        for first in range(0, procs, JOIN_PROCESSES):  # a few processes at a time, each ramping its workers up in batches
            group = []
            for i in range(first, min(procs, first + JOIN_PROCESSES)):
                count = min(args.per_process, workers - i * args.per_process)
                group.append(Child(["--child", "workers", "--count", str(count), "--bootstrap", seed, *common], env, nice=args.worker_nice))
            pools.extend(group)
            children.extend(group)
            for p in group:
                await p.wait("started", args.join_timeout_s)
        seen = 0
        while True:  # every worker listed by the coordinator
            seen = (await coord.status(60))["by_role"].get("worker", 0)
            if seen >= workers:
                break
            if time.monotonic() - t0 > args.join_timeout_s:
                out["joined"] = f"{seen}/{workers} in {args.join_timeout_s:.0f} s"
                out["load_end"] = round(os.getloadavg()[0], 1)
                return out
            await asyncio.sleep(1.0)
        out["joined"] = f"{workers}/{workers} in {time.monotonic() - t0:.0f} s"
        await asyncio.sleep(2 * args.heartbeat_s)  # meshes settle

        # announcements
        port = int(seed.split("/tcp/")[1].split("/")[0])
        for c in (relay, coord, *pools):
            c.send("probe 1")
        await asyncio.sleep(1.5)  # every probe awake (they check once a second while off)
        spies = []
        if args.py_spy:
            phase_s = args.announcements * args.interval_s + 3.0 + args.heartbeat_s
            spies += [py_spy(c.proc.pid, phase_s, Path(args.py_spy) / f"{name}-{workers}-{layout}-announcing.txt")
                      for name, c in (("relay", relay), ("coord", coord), ("workers0", pools[0]))]
        a_io, a_w = tcp_counters(port), time.monotonic()
        a_cpu = (cpu_s(relay.proc.pid), cpu_s(coord.proc.pid))
        a_ns = time.time_ns()
        sent: dict[int, int] = {}
        for step in range(1, args.announcements + 1):
            coord.send(f"announce {step}")
            sent[step] = (await coord.wait("announced", 30, after=step - 1))["sent_ns"]
            await asyncio.sleep(args.interval_s)
        await asyncio.sleep(3.0 + args.heartbeat_s)
        b_io, b_w = tcp_counters(port), time.monotonic()
        out["relay_announcing_cpu_pct"] = round(100 * (cpu_s(relay.proc.pid) - a_cpu[0]) / (b_w - a_w), 2)
        out["coord_announcing_cpu_pct"] = round(100 * (cpu_s(coord.proc.pid) - a_cpu[1]) / (b_w - a_w), 2)
        out["relay_announcing_in_b_s"] = round((b_io[0] - a_io[0]) / (b_w - a_w))
        out["relay_announcing_out_b_s"] = round((b_io[1] - a_io[1]) / (b_w - a_w))
        lat = [(x["recv_ns"] - sent[x["step"]]) / 1e9 for p in pools for x in p.take("recv_ns") if x["step"] in sent]
        out["delivered"] = f"{len(lat)}/{workers * args.announcements}"
        b_ns = time.time_ns()
        for c in (relay, coord, *pools):
            c.send("probe 0")
        out.update(await where_the_time_went(relay, coord, pools, sent, a_ns, b_ns))
        if lat:
            out["p50_ms"], out["p99_ms"], out["max_ms"] = (round(pct(lat, q) * 1e3) for q in (0.5, 0.99, 1.0))
            out["over_1s"] = sum(x > 1.0 for x in lat)
            by_step = {s: [(x["recv_ns"] - sent[s]) / 1e9 for p in pools for x in p.take("recv_ns") if x["step"] == s] for s in sent}
            out["p99_by_step_ms"] = "/".join(str(round(pct(v, 0.99) * 1e3)) if v else "-" for v in by_step.values())
        await asyncio.sleep(2 * args.heartbeat_s)  # the records the steps changed have gone out

        # idle
        pids = {"relay": [relay.proc.pid], "coordinator": [coord.proc.pid], "workers": [p.proc.pid for p in pools]}
        c0 = {k: sum(cpu_s(p) for p in v) for k, v in pids.items()}
        io0 = tcp_counters(port)
        if args.py_spy:
            spies += [py_spy(c.proc.pid, args.idle_s, Path(args.py_spy) / f"{name}-{workers}-{layout}-idle.txt")
                      for name, c in (("relay", relay), ("coord", coord), ("workers0", pools[0]))]
        w0 = time.monotonic()
        await asyncio.sleep(args.idle_s)
        wall = time.monotonic() - w0
        c1 = {k: sum(cpu_s(p) for p in v) for k, v in pids.items()}
        io1 = tcp_counters(port)
        out["relay_idle_in_b_s"] = round((io1[0] - io0[0]) / wall)
        out["relay_idle_out_b_s"] = round((io1[1] - io0[1]) / wall)
        out["relay_idle_segments_s"] = round((io1[2] - io0[2]) / wall, 1)
        out["relay_cpu_pct"] = round(100 * (c1["relay"] - c0["relay"]) / wall, 2)
        out["coord_cpu_pct"] = round(100 * (c1["coordinator"] - c0["coordinator"]) / wall, 2)
        out["worker_cpu_pct"] = round(100 * (c1["workers"] - c0["workers"]) / wall / workers, 3)
        out["relay_rss_mib"] = round(rss_mib(relay.proc.pid))
        out["coord_rss_mib"] = round(rss_mib(coord.proc.pid))
        out["worker_rss_mib"] = round(sum(rss_mib(p) for p in pids["workers"]) / workers, 1)
        st = await relay.status()
        out["relay_connected"] = st["connected"]
        out["relay_send_drops"] = sum(v for k, v in st["send_drops"].items() if k != "messages")
        cst = await coord.status()
        out["coord_workers_listed"] = cst["by_role"].get("worker", 0)
        for spy in spies:
            if spy is not None:
                spy.wait(60)

        if args.mint and layout == "presence" and workers == min(args.levels):
            out.update(await mint(args, spec_path, seed, relay, env))
        out["load_end"] = round(os.getloadavg()[0], 1)
        return out
    finally:
        for c in children:
            c.send("stop")
        for c in children:
            c.stop()


async def lag_of(child: Child, from_ns: int, to_ns: int) -> dict[str, Any]:
    n = len(child.take("lag"))
    child.send(f"lag {from_ns} {to_ns}")
    return (await child.wait("lag", 30, after=n))["lag"]


async def where_the_time_went(relay: Child, coord: Child, pools: list[Child], sent: dict[int, int], a_ns: int, b_ns: int) -> dict[str, Any]:
    """The announcement latency split at the relay, per worker process, and how late each process's
    event loops woke over the announcement phase (:class:`LagProbe`)."""
    out: dict[str, Any] = {}
    heard = {x["hub_heard"]: x["ns"] for x in relay.take("hub_heard") if x["hub_heard"] in sent}
    if heard:
        hop1 = [(heard[s] - sent[s]) / 1e9 for s in heard]
        hop2 = [(x["recv_ns"] - heard[x["step"]]) / 1e9 for p in pools for x in p.take("recv_ns") if x["step"] in heard]
        out["coord_to_relay_p99_ms"] = round(1e3 * pct(hop1, 0.99))
        if hop2:
            out["relay_to_worker_p50_p99_ms"] = f"{round(1e3 * pct(hop2, 0.5))}/{round(1e3 * pct(hop2, 0.99))}"
    per_proc = []
    for p in pools:
        v = [(x["recv_ns"] - sent[x["step"]]) / 1e9 for x in p.take("recv_ns") if x["step"] in sent]
        if v:
            per_proc.append(round(1e3 * pct(v, 0.99)))
    if per_proc:
        out["p99_per_process_ms"] = f"{min(per_proc)}-{max(per_proc)}"
    for name, child in (("relay", relay), ("coord", coord)):
        lag = await lag_of(child, a_ns, b_ns)
        out[f"{name}_lag_ms"] = "/".join(f"{lag[k]['p99_ms']}/{lag[k]['max_ms']}" for k in ("trio", "asyncio") if k in lag)
    lags = [await lag_of(p, a_ns, b_ns) for p in pools]
    for k in ("trio", "asyncio"):
        got = [x[k] for x in lags if k in x]
        if got:
            out[f"workers_{k}_lag_ms"] = f"{max(g['p99_ms'] for g in got)}/{max(g['max_ms'] for g in got)}"
            out[f"workers_{k}_late_s"] = round(sum(g["late_s"] for g in got), 1)
    return out


async def mint(args: argparse.Namespace, spec_path: Path, seed: str, relay: Child, env: dict[str, str]) -> dict[str, Any]:
    """The relay's CPU per minted identity and per flooded frame, against the minter's."""
    minter = Child(["--child", "mint", "--run", str(spec_path), "--bootstrap", seed], env)
    out: dict[str, Any] = {}
    try:
        await minter.wait("ready", 60)
        base_w = time.monotonic()
        base_c = cpu_s(relay.proc.pid)
        await asyncio.sleep(5.0)
        idle_rate = (cpu_s(relay.proc.pid) - base_c) / (time.monotonic() - base_w)
        for i, (kind, n) in enumerate((("identities", args.mint), ("frames", 200))):
            c0, w0 = cpu_s(relay.proc.pid), time.monotonic()
            minter.send(f"{kind} {n}")
            done = await minter.wait("done", 600, after=i)
            await asyncio.sleep(1.0)
            extra = cpu_s(relay.proc.pid) - c0 - idle_rate * (time.monotonic() - w0)
            out[f"mint_{kind}_relay_us"] = round(1e6 * extra / n)
            out[f"mint_{kind}_minter_us"] = round(1e6 * done["cpu_s"] / n)
        st = await relay.status()
        out["mint_relay_counters"] = {k: v for k, v in (st.get("presence") or {}).items() if k.startswith(("refused", "over", "records"))}
    finally:
        minter.stop()
    return out


async def drive(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="hub-bench-"))
    results = []
    for workers in args.levels:
        for layout in args.layouts:
            try:
                r = await level(args, workers, layout, tmp)
            except (RuntimeError, TimeoutError) as e:
                r = {"workers": workers, "layout": layout, "error": str(e)[:200], "load_end": round(os.getloadavg()[0], 1)}
            emit(r)
            results.append(r)
    keys = list(dict.fromkeys(k for r in results for k in r if k not in ("workers", "layout", "mint_relay_counters")))
    print(f"\nhub benchmark, {time.strftime('%Y-%m-%d %H:%M')}: 1 relay + coordinator, heartbeat {args.heartbeat_s:g} s, "
          f"{args.announcements} announcements every {args.interval_s:g} s, idle window {args.idle_s:g} s, CPU in % of one core "
          f"(CPU-seconds per wall-second); workers: per worker")
    print(f"{'':24s}" + "".join(f"{str(r['workers']) + ' ' + r['layout']:>16s}" for r in results))
    for k in keys:
        print(f"{k:24s}" + "".join(f"{r.get(k, '-')!s:>16s}" for r in results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="30,120,500", help="worker counts, comma-separated (default 30,120,500)")
    p.add_argument("--layouts", default="presence,split", help=f"layouts in order, comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--per-process", type=int, default=16, help="simulated workers per process (default 16)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="the run spec's heartbeat interval, seconds (default 2, the spec default)")
    p.add_argument("--announcements", type=int, default=10, help="checkpoint announcements per level (default 10)")
    p.add_argument("--interval-s", type=float, default=8.0, help="seconds between announcements (default 8: a run publishes a checkpoint every few minutes, and each is a burst of work for every simulated worker process)")
    p.add_argument("--idle-s", type=float, default=30.0, help="idle measurement window, seconds (default 30)")
    p.add_argument("--join-timeout-s", type=float, default=900.0, help="seconds for every worker to start and be listed (default 900)")
    p.add_argument("--mint", type=int, default=50, help="identities minted against the relay at the first level (0: skip)")
    p.add_argument("--worker-nice", type=int, default=0, help="run the simulated workers' processes at this nice value (e.g. 19: the relay and coordinator first for the CPU; shows what the hubs cost when the machine's cores are not shared with the workers)")
    p.add_argument("--py-spy", default="", help="sample the stacks of the relay, the coordinator and the first worker process with py-spy over the announcement phase and the idle window into files in this folder (their CPU figures then include py-spy's sampling)")
    p.add_argument("--log-dir", default="", help="write each child's log (stderr, INFO) to a file here")
    # child processes
    p.add_argument("--child", choices=["relay", "coordinator", "workers", "mint"], help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--key", default="", help=argparse.SUPPRESS)
    p.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="presence", help=argparse.SUPPRESS)
    p.add_argument("--max-peers", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        for noisy in ("libp2p", "multiaddr"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.child in ("relay", "coordinator"):
        asyncio.run(child_hub(args))
    elif args.child == "workers":
        asyncio.run(child_workers(args))
    elif args.child == "mint":
        asyncio.run(child_mint(args))
    else:
        Child.log_dir = Path(args.log_dir) if args.log_dir else None
        if args.py_spy:
            Path(args.py_spy).mkdir(parents=True, exist_ok=True)
        args.levels = [int(x) for x in args.workers.split(",") if x]
        args.layouts = [x for x in args.layouts.split(",") if x]
        if not set(args.layouts) <= set(LAYOUTS):
            raise SystemExit(f"--layouts: each of {', '.join(LAYOUTS)}")
        asyncio.run(drive(args))


if __name__ == "__main__":
    main()
