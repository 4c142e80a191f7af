"""Factories for p2p tests: run specs with short heartbeats, swarms of in-process gossip nodes,
a raw (non-validating) attacker host, forged envelopes, and gossip node subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from node.p2p import GossipConfig, GossipNode
from node.p2p.bridge import TrioBridge, make_bridge
from protocol import encoding
from protocol.envelope import DOMAIN, ENVELOPE_VERSION
from protocol.identity import NodeKey
from protocol.runspec import NetworkSpec, RunInfo, RunSpec, dump_run_spec, sign_run_spec

HEARTBEAT_S = 1.0
REPO = Path(__file__).resolve().parents[2]


class Run:
    """A test run: coordinator and validator keys and the spec naming them."""

    def __init__(self, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.coordinator = NodeKey.generate()
        self.validator = NodeKey.generate()
        self.spec = RunSpec(
            run=RunInfo(coordinator=self.coordinator.peer_id, validators=[self.validator.peer_id]),
            network=NetworkSpec(heartbeat_interval_s=heartbeat_s),
        )

    def write(self, path: Path) -> Path:
        """Write the signed spec as TOML (for subprocess nodes)."""
        path.write_text(dump_run_spec(sign_run_spec(self.spec, self.coordinator)))
        return path


def config(**kw: Any) -> GossipConfig:
    """Test gossip settings: fast bootstrap retries, short stop."""
    base: dict[str, Any] = {"bootstrap_backoff_s": 0.2, "bootstrap_backoff_max_s": 1.0, "dial_timeout_s": 3.0, "stop_timeout_s": 3.0}
    base.update(kw)
    return GossipConfig(**base)


@contextlib.asynccontextmanager
async def shared_bridge() -> AsyncIterator[TrioBridge]:
    """One trio thread for several in-process nodes."""
    bridge = make_bridge("thread")
    await bridge.start()
    try:
        yield bridge
    finally:
        await bridge.stop()


@contextlib.asynccontextmanager
async def swarm(
    run: Run, roles: list[tuple[str, NodeKey | None]], bridge: TrioBridge | None = None, **cfg: Any
) -> AsyncIterator[list[GossipNode]]:
    """Start one seed (the first role) and the others bootstrapping from it; stop all on exit."""
    nodes: list[GossipNode] = []
    try:
        role, key = roles[0]
        seed = await GossipNode.create(run.spec, key or NodeKey.generate(), config(**cfg), role=role, bridge=bridge)  # type: ignore[arg-type]
        nodes.append(seed)
        rest = await asyncio.gather(
            *(
                GossipNode.create(run.spec, k or NodeKey.generate(), config(bootstrap=[seed.addrs[0]], **cfg), role=r, bridge=bridge)  # type: ignore[arg-type]
                for r, k in roles[1:]
            )
        )
        nodes.extend(rest)
        yield nodes
    finally:
        await asyncio.gather(*(n.stop() for n in nodes), return_exceptions=True)


def forge(key: NodeKey, run_id: bytes, type_tag: str, body: dict[str, Any], *, ts_ms: int | None = None, corrupt_sig: bool = False) -> bytes:
    """Sign an arbitrary envelope, bypassing ``seal``'s schema and size checks."""
    unsigned = {
        "v": ENVELOPE_VERSION,
        "type": type_tag,
        "run": run_id,
        "signer": key.public_key,
        "ts_ms": int(time.time() * 1000) if ts_ms is None else ts_ms,
        "nonce": os.urandom(16),
        "body": body,
    }
    sig = key.sign(DOMAIN + encoding.packb(unsigned))
    if corrupt_sig:
        sig = bytes([sig[0] ^ 1]) + sig[1:]
    return encoding.packb({**unsigned, "sig": sig})


class NodeProcess:
    """A gossip node in a child process (``python -m node.p2p.standalone``)."""

    def __init__(self, spec_path: Path, key_path: Path, *, role: str = "relay", bootstrap: list[str] = (), extra: list[str] = ()) -> None:  # type: ignore[assignment]
        args = [sys.executable, "-m", "node.p2p.standalone", "--run", str(spec_path), "--key", str(key_path), "--role", role, *extra]
        for b in bootstrap:
            args += ["--bootstrap", b]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        self.addr = ""

    async def ready(self, timeout_s: float = 30.0) -> str:
        """Wait for the ``READY <multiaddr>`` line; returns the multiaddr."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        assert line.startswith("READY "), f"runner said {line!r}"
        self.addr = line.split()[1]
        return self.addr

    def kill(self) -> None:
        """SIGKILL (no goodbye) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM and reap; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise
