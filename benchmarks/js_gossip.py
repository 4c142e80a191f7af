"""A gossip node on js-libp2p with the node's envelope validation in Python (benchmark only).

``JsGossipNode`` runs one Node.js process (``benchmarks/js/gossip_node.mjs``: libp2p 2.9 with
``@chainsafe/libp2p-gossipsub`` 14.1, TCP, noise, yamux) and speaks to it over its stdin/stdout
(length-prefixed frames, described in that file). This Python process is the node's application
side, as a js-libp2p *sidecar* would be in a real node:

* the libp2p identity is the node's ed25519 key: the Node process gets the 32-byte seed and its
  peer ID is checked against :attr:`protocol.identity.NodeKey.peer_id` (a mismatch is an error);
* every message gossipsub receives is checked by the real
  :meth:`node.p2p.gossip.EnvelopeValidator.check` (signature, run ID, type for the topic, size,
  freshness, signer allowed, role on the right topic, dedupe) **before** gossipsub delivers or
  forwards it (a gossipsub topic validator that awaits the answer: accept, reject, or ignore for
  a duplicate);
* node records (``node_record/1``, sealed with :func:`protocol.envelope.seal`) go out every
  heartbeat on the role's topic (the split layout), received ones feed a
  :class:`node.p2p.peers.PeerTable` and the addresses in them are handed to the Node process to
  dial while it has fewer than ``target_peers`` connections.

Not done here (what a switch of the node would add): penalty points per forwarder and bans
(``PeerScores``; the forwarder's peer ID would travel in the validate frame), verdict and ban
topics' handlers, the HTTP status routes. Imports only pure parts of ``node.p2p`` (no py-libp2p).

Install: ``npm ci --prefix benchmarks/js``. Run as a child node:
``python benchmarks/js_gossip.py --run RUN.toml --key KEY --role worker --bootstrap MULTIADDR``
(prints ``READY <multiaddr>`` and, with ``--log-announcements``, JSON lines as
``node/p2p/standalone.py``). ``python benchmarks/js_gossip.py --self-check`` starts three nodes
and checks the identity and that a forged message is rejected before it is forwarded
(:func:`self_check`; a few seconds). ``JS_GOSSIP_NODE_ARGS`` adds options to every ``node``
command line, e.g. ``--cpu-prof --cpu-prof-dir=DIR`` to profile the nodes of a benchmark run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import shutil
import struct
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from node import __version__
from node.p2p.config import GossipConfig
from node.p2p.gossip import (
    TOPIC_KINDS,
    DuplicateEnvelope,
    EnvelopeValidator,
    TopicKind,
    record_kind,
    subscribed_kinds,
    topic_names,
)
from node.p2p.peers import PeerTable
from protocol.envelope import Envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import CheckpointAnnouncement, Hardware, Message, NodeRecord, Role
from protocol.runspec import RunSpec

JS_NODE = Path(__file__).resolve().parent / "js" / "gossip_node.mjs"
ACCEPT, REJECT, IGNORE = 0, 1, 2
ACCEPTED_CACHE = 4096
"""Envelopes verified and not yet delivered (entries), as in ``node.p2p.service``."""
MAX_FRAME = 2 << 20
"""Largest frame accepted from the Node process, bytes (gossip payloads are under 1 MiB)."""
START_TIMEOUT_S = 60.0
_HARDWARE = Hardware(cpu_count=os.cpu_count() or 0, memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
"""What the record reports, as ``node.p2p.service.local_hardware`` (same record size)."""


def _frame(op: bytes, *parts: bytes) -> bytes:
    body = op + b"".join(parts)
    return struct.pack(">I", len(body)) + body


class JsGossipNode:
    """A node's gossip on a js-libp2p process (see the module docstring).

    Args:
        spec: the run spec (topics, authorities, heartbeat interval).
        key: the node key (libp2p identity and record signer).
        role: the role announced in records; hubs (coordinator, relay, validator) keep every
            worker that grafts them in their gossipsub mesh.
        bootstrap: multiaddrs with ``/p2p/<peer ID>``, dialed forever.
        drop_announcements: ignore every checkpoint announcement (a node that loses them all,
            to measure learning the step from the coordinator's record).
        target_peers: dial peers learned from records while below this many connections
            (default ``GossipConfig.target_peers``, 3).

    Raises (from :meth:`start`):
        RuntimeError: the Node process did not start, or its peer ID is not ``key.peer_id``.
    """

    def __init__(self, spec: RunSpec, key: NodeKey, *, role: Role, bootstrap: list[str] | None = None,
                 drop_announcements: bool = False, target_peers: int | None = None) -> None:
        self.config = GossipConfig() if target_peers is None else GossipConfig(target_peers=target_peers)
        self.spec, self.key, self.role = spec, key, role
        self.peer_id = key.peer_id
        self.run_id = spec.run_id
        self.topics = topic_names(self.run_id)
        self.heartbeat_interval_s = spec.network.heartbeat_interval_s
        self.peers = PeerTable(self.heartbeat_interval_s, missed_heartbeats=self.config.missed_heartbeats,
                               coordinator=spec.run.coordinator)
        max_age_s = self.config.missed_heartbeats * self.heartbeat_interval_s + self.config.freshness_slack_s
        self._validator = EnvelopeValidator(self.run_id, spec.authorities, max_age_s=max_age_s,
                                            max_future_s=self.config.max_future_s)
        self.subscribed = subscribed_kinds(role)
        self.bootstrap = list(bootstrap or [])
        self.drop_announcements = drop_announcements
        self.addrs: list[str] = []
        self._record: dict[str, Any] = {"policy_step": -1}
        self._seq = 0
        self._accepted: OrderedDict[bytes, tuple[TopicKind, Envelope[Any]]] = OrderedDict()
        self._dialed: dict[str, tuple[str, ...]] = {}
        self._handlers: dict[TopicKind, list[Callable[[Envelope[Any]], None]]] = {k: [] for k in TOPIC_KINDS}
        self._step_handlers: list[Callable[[int], None]] = []
        self._latest_step: int | None = None
        self.delivered: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._beat_now = asyncio.Event()
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._stats: asyncio.Future[dict[str, Any]] | None = None

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> JsGossipNode:
        """Construct and :meth:`start` a node (arguments as for the class)."""
        node = cls(*args, **kwargs)
        await node.start()
        return node

    async def start(self) -> None:
        """Start the Node process, wait until it listens (≤ 60 s), check its peer ID, begin heartbeats."""
        cfg = {
            "seed": self.key.seed().hex(),
            "port": 0,
            "topics": [self.topics[k] for k in TOPIC_KINDS],
            "subscribe": [TOPIC_KINDS.index(k) for k in self.subscribed],
            "hub": self.role in ("coordinator", "relay", "validator"),
            "bootstrap": self.bootstrap,
            "target_peers": self.config.target_peers,
            "max_peers": self.config.max_peers,
            # an answer later than the freshness window is moot (the envelope would be stale): ignore it then
            "validate_timeout_ms": round(self._validator.max_age_s * 1000),
        }
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.proc = await asyncio.create_subprocess_exec(
            "node", *shlex.split(os.environ.get("JS_GOSSIP_NODE_ARGS", "")), str(JS_NODE), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None, limit=MAX_FRAME,
            env={**os.environ, "INTELLECT_JS_GOSSIP": json.dumps(cfg)})  # the seed: not on the command line (ps shows it)
        self._tasks.append(asyncio.create_task(self._read_frames()))
        try:
            ready = await asyncio.wait_for(self._ready, START_TIMEOUT_S)
        except (TimeoutError, EOFError) as e:
            await self.stop()
            raise RuntimeError(f"js-libp2p node did not start: {e or 'timeout'}") from None
        if ready["peer_id"] != self.peer_id:
            await self.stop()
            raise RuntimeError(f"js-libp2p peer ID {ready['peer_id']} is not the node key's {self.peer_id}")
        self.addrs = [a if "/p2p/" in a else f"{a}/p2p/{self.peer_id}" for a in ready["addrs"]]
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))

    async def stop(self) -> None:
        """Stop heartbeats, close the Node process's stdin (it stops its libp2p node), wait ≤ 5 s, else kill."""
        for t in self._tasks:
            t.cancel()
        self._tasks.clear()
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    # --- what we say -------------------------------------------------------------------------

    def seal(self, body: Message) -> bytes:
        """Seal ``body`` with this node's key for this run."""
        return seal(self.key, self.run_id, body)

    def set_record(self, *, policy_step: int) -> None:
        """Change the record's ``policy_step``; a record with the change goes out at once."""
        self._record["policy_step"] = policy_step
        self._beat_now.set()

    def make_record(self) -> NodeRecord:
        """The node record the next heartbeat publishes."""
        return NodeRecord(peer_id=self.peer_id, role=self.role, seq=self._seq, addrs=self.addrs[:16], version=__version__,
                          policy_step=self._record["policy_step"],
                          hardware=_HARDWARE)

    async def publish(self, kind: TopicKind, data: bytes) -> None:
        """Check ``data`` as receivers will (raises :class:`ProtocolError`), then hand it to gossipsub."""
        self._validator.check(kind, data, remember=False)
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(_frame(b"P", bytes([TOPIC_KINDS.index(kind)]), data))
        await self.proc.stdin.drain()

    async def publish_announcement(self, data: bytes) -> None:
        """Publish a coordinator-sealed ``CheckpointAnnouncement`` envelope."""
        await self.publish("checkpoints", data)

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            self._beat_now.clear()
            self._seq += 1
            await self.publish(record_kind(self.role), self.seal(self.make_record()))
            self.peers.prune()
            try:
                await asyncio.wait_for(self._beat_now.wait(), max(0.0, self.heartbeat_interval_s - (loop.time() - started)))
                await asyncio.sleep(0.05)
            except TimeoutError:
                pass

    # --- what we hear ------------------------------------------------------------------------

    def on_announcement(self, handler: Callable[[Envelope[Any]], None]) -> None:
        """Call ``handler(envelope)`` for each verified announcement delivered."""
        self._handlers["checkpoints"].append(handler)

    def on_latest_step(self, handler: Callable[[int], None]) -> None:
        """Call ``handler(step)`` when the latest coordinator-signed step rises (announcement or record)."""
        self._step_handlers.append(handler)

    async def stats(self) -> dict[str, Any]:
        """Connections and mesh sizes from the Node process, and delivered/rejected counts by topic kind."""
        assert self.proc is not None and self.proc.stdin is not None
        self._stats = asyncio.get_running_loop().create_future()
        self.proc.stdin.write(_frame(b"S"))
        await self.proc.stdin.drain()
        out = await asyncio.wait_for(self._stats, 5)
        return {**out, "delivered": dict(self.delivered), "rejected": dict(self.rejected), "peers_alive": len(self.peers)}

    async def _read_frames(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stdin is not None
        out, stdin = self.proc.stdout, self.proc.stdin
        try:
            while True:
                (n,) = struct.unpack(">I", await out.readexactly(4))
                if not 1 <= n <= MAX_FRAME:
                    raise ValueError(f"frame of {n} bytes from the js-libp2p node")
                body = await out.readexactly(n)
                op, p = body[:1], body[1:]
                if op == b"V":
                    k = p[4]  # p[:4] is the request ID, echoed back
                    stdin.write(_frame(b"v", p[:4], bytes([self._validate(TOPIC_KINDS[k], p[5:])])))
                elif op == b"D":
                    self._deliver(p[1:33])
                elif op == b"R" and self._ready is not None and not self._ready.done():
                    self._ready.set_result(json.loads(p))
                elif op == b"S" and self._stats is not None and not self._stats.done():
                    self._stats.set_result(json.loads(p))
        except asyncio.IncompleteReadError:
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(EOFError("the js-libp2p process exited"))

    def _validate(self, kind: TopicKind, data: bytes) -> int:
        """The topic validator: the node's envelope check, answered before gossipsub forwards."""
        if kind == "checkpoints" and self.drop_announcements:
            self.rejected["dropped"] += 1
            return IGNORE
        try:
            env = self._validator.check(kind, data)
        except DuplicateEnvelope:
            self.rejected["duplicate"] += 1
            return IGNORE
        except ProtocolError as e:
            self.rejected[type(e).__name__] += 1
            return REJECT
        self._accepted[hashlib.sha256(data).digest()] = (kind, env)
        while len(self._accepted) > ACCEPTED_CACHE:
            self._accepted.popitem(last=False)
        return ACCEPT

    def _deliver(self, msg_id: bytes) -> None:
        item = self._accepted.pop(msg_id, None)
        if item is None:
            return
        kind, env = item
        if env.signer == self.key.public_key:
            return
        self.delivered[kind] += 1
        if isinstance(env.body, NodeRecord):
            self.peers.update(env.body, env.ts_ms)
            addrs = tuple(env.body.addrs)
            if addrs and self._dialed.get(env.body.peer_id) != addrs and self.proc is not None and self.proc.stdin is not None:
                self._dialed[env.body.peer_id] = addrs
                self.proc.stdin.write(_frame(b"C", addrs[0].encode()))
        elif isinstance(env.body, CheckpointAnnouncement):
            self.peers.note_announcement(env.body)
        for handler in self._handlers[kind]:
            handler(env)
        step = self.peers.latest_step()
        if step is not None and (self._latest_step is None or step > self._latest_step):
            self._latest_step = step
            for h in self._step_handlers:
                h(step)


async def self_check() -> None:
    """Three js-libp2p nodes in a line, worker — relay — coordinator (each dials only its
    bootstrap peer). Checks that each Node process's peer ID is its node key's (``start`` refuses
    otherwise), that a forged announcement (sealed by a key that is not the coordinator's, handed
    to gossipsub without the publisher's own check) is rejected by the relay's Python validator and
    never reaches the worker, and that the valid announcement published after it does.

    Raises:
        SystemExit: a check failed (one line saying which), or an event did not come within 60 s.
    """
    from protocol.runspec import NetworkSpec, RunInfo

    coord = NodeKey.generate()
    spec = RunSpec(run=RunInfo(coordinator=coord.peer_id), network=NetworkSpec(heartbeat_interval_s=1.0))
    relay = await JsGossipNode.create(spec, NodeKey.generate(), role="relay")
    nodes = [relay]
    try:
        worker = await JsGossipNode.create(spec, NodeKey.generate(), role="worker", bootstrap=relay.addrs[:1], target_peers=1)
        nodes.append(worker)
        c = await JsGossipNode.create(spec, coord, role="coordinator", bootstrap=relay.addrs[:1], target_peers=1)
        nodes.append(c)
        got: list[int] = []
        arrived = asyncio.Event()
        worker.on_announcement(lambda env: (got.append(env.body.step), arrived.set()))
        deadline = time.monotonic() + 60
        while not ((await worker.stats())["mesh"].get(str(TOPIC_KINDS.index("checkpoints")), 0) >= 1
                   and (await c.stats())["mesh"].get(str(TOPIC_KINDS.index("checkpoints")), 0) >= 1):
            if time.monotonic() > deadline:
                raise SystemExit("self-check: no checkpoints mesh within 60 s")
            await asyncio.sleep(0.2)
        ann = CheckpointAnnouncement(step=1, manifest_id=b"\1" * 32, checkpoint_hash=b"\0" * 32)
        forged = seal(NodeKey.generate(), spec.run_id, ann)  # any key but the coordinator's
        assert c.proc is not None and c.proc.stdin is not None
        c.proc.stdin.write(_frame(b"P", bytes([TOPIC_KINDS.index("checkpoints")]), forged))  # past publish()'s own check
        await c.publish_announcement(c.seal(CheckpointAnnouncement(step=2, manifest_id=b"\2" * 32, checkpoint_hash=b"\0" * 32)))
        try:
            await asyncio.wait_for(arrived.wait(), 60)
        except TimeoutError:
            raise SystemExit("self-check: the valid announcement did not reach the worker within 60 s") from None
        ids = [n.peer_id for n in nodes]
        if got != [2]:
            raise SystemExit(f"self-check: the worker delivered steps {got}, expected only [2]")
        if relay.rejected.get("SignatureError", 0) < 1:
            raise SystemExit(f"self-check: the relay's validator did not reject the forged announcement ({dict(relay.rejected)})")
        if worker.rejected:
            raise SystemExit(f"self-check: the forged announcement was forwarded to the worker ({dict(worker.rejected)})")
        print(f"self-check passed: peer IDs {', '.join(i[-8:] for i in ids)} are the node keys'; the relay rejected the forged "
              f"announcement ({dict(relay.rejected)}) and did not forward it; the worker delivered only the valid one")
    finally:
        for n in reversed(nodes):
            await n.stop()


async def _main(args: argparse.Namespace) -> None:
    from protocol.runspec import load_run_spec

    spec = load_run_spec(Path(args.run)).spec
    node = await JsGossipNode.create(spec, NodeKey.load(Path(args.key)), role=args.role, bootstrap=args.bootstrap,
                                     drop_announcements=args.drop_announcements)
    from node.p2p.standalone import serve_until_signalled  # the same READY/announcement lines as the py-libp2p nodes

    def report() -> None:
        print(f"{node.peer_id} {node.role}: delivered {dict(node.delivered)}, rejected {dict(node.rejected)}", file=sys.stderr, flush=True)

    await serve_until_signalled(node, log_announcements=args.log_announcements, on_stop=report)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--self-check", action="store_true", help="run three nodes and check identity and validation before forwarding, then exit")
    p.add_argument("--run")
    p.add_argument("--key")
    p.add_argument("--role", default="relay")
    p.add_argument("--bootstrap", action="append", default=[])
    p.add_argument("--log-announcements", action="store_true")
    p.add_argument("--drop-announcements", action="store_true", help="ignore every checkpoint announcement (learn steps from records)")
    args = p.parse_args()
    if shutil.which("node") is None or not (JS_NODE.parent / "node_modules" / "libp2p").is_dir():
        raise SystemExit("js_gossip needs Node.js ≥ 20 and its packages: npm ci --prefix benchmarks/js")
    if args.self_check:
        asyncio.run(self_check())
    elif not (args.run and args.key):
        p.error("--run and --key are needed (or --self-check)")
    else:
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
