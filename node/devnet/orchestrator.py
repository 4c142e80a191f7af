"""The devnet: every role as its own OS process on 127.0.0.1, talking only through libp2p gossip,
Shardcast HTTP and the ingest — the code paths of a real deployment."""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.devnet.config import devnet_env, devnet_spec
from node.devnet.links import Links
from node.devnet.outdir import claim_out, write_marker
from node.devnet.procs import Proc, ProcessGroup
from node.devnet.profile import prepare_profile_model
from node.devnet.timeline import MemorySampler
from protocol.identity import NodeKey, PeerId
from protocol.runspec import dump_run_spec, sign_run_spec

logger = logging.getLogger(__name__)

DISCOVERY_TIMEOUT_S = 180.0
"""Longest wait for every node to appear on gossip, seconds (a loaded 2-core machine needed > 90 s)."""
FINAL_HOLD_WAIT_S = 20.0
FINAL_HOLD_WAIT_PROFILE_S = 600.0
"""After the last step, how long the nodes may take to hold it before the devnet stops them, seconds."""
STATUS_POLL_S = 0.5
BATCH_TIMEOUT_S = 180.0
"""The coordinator's ``--batch-timeout`` is the devnet's own ``--timeout`` (at least this): the first batch
waits for every process to start, which took > 180 s on a 2-core machine at load 40 (imports and model
loads), and the devnet's deadline already ends a run that cannot fill a batch."""
DOCTOR_TIMEOUT_S = 60.0
"""Longest time the workers' start-up ``doctor`` may take, seconds."""


@dataclass
class DevnetOptions:
    """What ``intellect-node devnet`` runs (its flags).

    Attributes:
        out: directory for keys, the run spec, per-process logs and data, and the report.
        workers, relays, validators: how many of each role.
        steps: trainer steps to run.
        tasks: ``embedded``, a public set name (``gsm8k``, ``math500``, ``humaneval``, ``mbpp``, …) or a path.
        data_root: where the public sets are (``math/…``, ``code/…``).
        adversary: add one dishonest worker of this kind.
        kill_worker_at: SIGKILL worker 0 when the trainer reaches this step, then restart it.
        dashboard: show the live terminal view.
        timeout_s: give up after this many seconds in total.
        seed: run seed (default random).
        async_level: override of the run spec's ``rl.async_level`` (``None``: the devnet default, 2).
        eval_every: held-out evaluation every this many trainer steps (``None``: :meth:`eval_interval`,
            so the held-out curve has at least 6 points besides the start).
        eval_samples: samples per held-out problem in each evaluation.
        profile: a real-shape model profile (``node/devnet/profile.py``, e.g. ``qwen2.5-0.5b``) built
            (cached) and trained instead; ``None``: no profile.
        profile_layers: decoder layers of the profile's model (``None``: the profile's; fewer keep its
            vocabulary, width and tokenizer at a fraction of the cost).
        links: every node in its own network namespace behind a capped link (``node/devnet/links.py``; root only).
        deltas: publish and fetch step deltas (bf16 models; ``False``: every step in full, for comparison).
        model: a local Hugging Face Qwen2 directory to train instead of the embedded model (``None``: embedded).
        rl: overrides of the run spec's ``[rl]`` fields (``--rl KEY=VALUE``; e.g. the off-policy
            correction ``is_correction``), checked like a spec file's.
        env: the run's own environment (``--env``: ``reasoning_gym:NAME``, ``verifiers:MODULE`` or a
            ``.py`` file; ``protocol.envs``), opened here once to pin its hash; ``None``: ``tasks``.
        env_args: its ``env.args`` (``--env-arg KEY=VALUE``).
    """

    out: Path
    workers: int = 2
    relays: int = 2
    validators: int = 1
    steps: int = 60
    tasks: str = "embedded"
    data_root: Path | None = None
    adversary: str | None = None
    kill_worker_at: int | None = None
    dashboard: bool = True
    timeout_s: float = 900.0
    seed: int | None = None
    async_level: int | None = None
    profile: str | None = None
    profile_layers: int | None = None
    links: bool = False
    deltas: bool = True
    eval_every: int | None = None
    eval_samples: int = 16
    model: Path | None = None
    rl: dict[str, Any] = field(default_factory=dict)
    env: str | None = None
    env_args: dict[str, Any] = field(default_factory=dict)

    def eval_interval(self) -> int:
        """Trainer steps between held-out evaluations: ``eval_every``, else ``ceil(steps / 6)``."""
        return self.eval_every if self.eval_every else max(1, -(-self.steps // 6))


@dataclass
class DevnetResult:
    """Outcome: exit status, wall seconds, the coordinator's last status, per-process final status."""

    ok: bool
    wall_s: float
    reason: str
    coordinator: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)


def workers_all_banned(status: dict[str, Any], peer_ids: dict[str, str]) -> str | None:
    """Why the run cannot go on when the coordinator has banned every worker the devnet started
    (the adversary aside), or ``None``. No rollout can arrive after that, so the devnet stops
    instead of waiting out its ``--timeout``.

    Args:
        status: the coordinator's ``/status`` JSON (its ``banned`` list: ``peer_id``, ``reason``).
        peer_ids: node name → peer ID, as the devnet made the keys (``worker-<i>``, ``adversary``, …).
    """
    banned = {b.get("peer_id"): str(b.get("reason", "")) for b in status.get("banned") or [] if isinstance(b, dict)}
    workers = {name: pid for name, pid in peer_ids.items() if name.startswith("worker-")}
    if not workers or not all(pid in banned for pid in workers.values()):
        return None
    said = "; ".join(f"{name} ({pid[-8:]}): {banned[pid]}" for name, pid in sorted(workers.items()))
    return f"every worker was banned, so no rollout can arrive: {said}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """GET ``url`` as JSON, ``None`` on any failure (nodes come and go; a port another process took
    may answer something other than HTTP, or JSON that is no object)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # loopback URLs we built
            doc = json.loads(r.read())
    except (OSError, ValueError, urllib.error.URLError, http.client.HTTPException):
        return None
    return doc if isinstance(doc, dict) else None


class Devnet:
    """Runs one devnet. ``Devnet(options).run()`` → :class:`DevnetResult`; always stops every child."""

    def __init__(self, options: DevnetOptions, on_tick: Callable[[Devnet], None] | None = None) -> None:
        self.o = options
        self.out = Path(options.out).resolve()
        self.on_tick = on_tick
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self.group = ProcessGroup(env=env)
        self.coord_url = ""
        self.status: dict[str, Any] = {}
        self.node_urls: dict[str, str] = {}
        self.node_status: dict[str, dict[str, Any]] = {}
        self.memory = MemorySampler()
        self.links: Links | None = None
        self.events: list[str] = []
        self.started = time.monotonic()
        self.killed_at: int | None = None
        self.restarted_at: int | None = None
        self.peer_ids: dict[str, str] = {}
        self.seed: int | None = options.seed
        self.run_id = ""
        self.replaced: list[str] = []

    # --- set-up --------------------------------------------------------------------------------

    def _bin(self, name: str) -> list[str]:
        exe = shutil.which(name)
        if exe is not None and Path(exe).parent == Path(sys.executable).parent:
            return [exe]
        module = "node" if name == "intellect-node" else "node.train_cli"
        return [sys.executable, "-c", f"import sys; from {'node.cli' if module == 'node' else module} import main; sys.exit(main())"]

    def setup(self) -> Path:
        """Create keys and the signed run spec in ``out``; returns the spec path.

        ``out`` may hold a previous devnet's output, which is replaced (``node/devnet/outdir.py``).

        Raises:
            node.devnet.outdir.OutDirError: ``out`` holds something other than a devnet's output.
        """
        self.replaced = claim_out(self.out)
        if self.replaced:
            print(f"replacing the previous devnet run in {self.out}", flush=True)
        if self.seed is None:
            self.seed = secrets.randbits(62)
        write_marker(self.out, {"seed": self.seed, "started": round(time.time(), 3)})
        (self.out / "keys").mkdir(parents=True, exist_ok=True)
        coord = NodeKey.generate()
        coord.save(self.out / "keys" / "coordinator.key")
        self.peer_ids["coordinator"] = coord.peer_id
        validators: list[PeerId] = []  # as the run spec lists them
        for i in range(self.o.validators):
            k = NodeKey.generate()
            k.save(self.out / "keys" / f"validator-{i}.key")
            validators.append(k.peer_id)
            self.peer_ids[f"validator-{i}"] = k.peer_id
        n_workers = self.o.workers + (1 if self.o.adversary else 0)
        for i in range(n_workers):
            name = f"worker-{i}" if i < self.o.workers else "adversary"
            k = NodeKey.generate()
            k.save(self.out / "keys" / f"{name}.key")
            self.peer_ids[name] = k.peer_id
        for i in range(self.o.relays):
            k = NodeKey.generate()
            k.save(self.out / "keys" / f"relay-{i}.key")
            self.peer_ids[f"relay-{i}"] = k.peer_id
        if self.o.profile is not None:
            if self.o.data_root is None:
                raise FileNotFoundError(f"--profile {self.o.profile} trains its tokenizer on the public task text: pass --data-root")
            self.events.append(f"{time.monotonic() - self.started:.0f}s preparing the {self.o.profile} model (built once per machine, then cached)")
            self.o.model = prepare_profile_model(self.o.profile, self.o.data_root, layers=self.o.profile_layers)
            self.events.append(f"{time.monotonic() - self.started:.0f}s model ready: {self.o.model}")
        if self.o.links:
            roles = {"coordinator": "coordinator", **{n: ("worker" if n.startswith(("worker", "adversary")) else n.split("-")[0])
                                                     for n in self.peer_ids if n != "coordinator"}}
            self.links = Links(roles)
            self.links.setup()
            self.events.append(f"{time.monotonic() - self.started:.0f}s links: " + ", ".join(
                f"{n.name} {n.ip} {n.mbit} Mb/s" for n in self.links.nodes.values()))
        self.http_port, self.p2p_port = free_port(), free_port()
        host = self._host("coordinator")
        self.coord_url = f"http://{host}:{self.http_port}"
        bootstrap = f"/ip4/{host}/tcp/{self.p2p_port}/p2p/{coord.peer_id}"
        env_kw: dict[str, Any] = {}
        if self.o.env is not None:
            self.events.append(f"{time.monotonic() - self.started:.0f}s opening environment {self.o.env} (its sandbox) to pin it")
            section, tasks_hash, max_tokens = devnet_env(self.o.env, self.o.env_args)
            env_kw = {"env": section, "tasks_hash": tasks_hash, "env_max_tokens": max_tokens}
            self.events.append(f"{time.monotonic() - self.started:.0f}s environment hash {section.hash[:16]}…, tasks {tasks_hash[:16]}…")
        spec = devnet_spec(coord, validators, tasks=self.o.tasks, http_url=self.coord_url, bootstrap=bootstrap,
                           seed=self.seed, async_level=self.o.async_level, model=self.o.model, rl_overrides=self.o.rl,
                           profile=self.o.profile is not None, deltas=self.o.deltas, **env_kw)
        signed = sign_run_spec(spec, coord)
        self.run_id = signed.run_id.hex()
        write_marker(self.out, {"seed": self.seed, "run_id": self.run_id, "started": round(time.time(), 3)})
        path = self.out / "run.toml"
        path.write_text(dump_run_spec(signed))
        return path

    def _data_root(self) -> list[str]:
        return ["--data-root", str(self.o.data_root)] if self.o.data_root else []

    def _host(self, name: str) -> str:
        """The address node ``name`` listens on: its namespace's with ``--links``, else loopback."""
        return self.links.ip(name) if self.links is not None else "127.0.0.1"

    def _cmd(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` of node ``name``: in its namespace with ``--links``, listening on its address."""
        if self.links is None:
            return argv
        return self.links.wrap(name, [*argv, "--listen-host", self.links.ip(name)])

    def start_all(self, run: Path) -> None:
        out = self.out
        coord = Proc("coordinator", "coordinator", self._cmd("coordinator", [
            *self._bin("intellect-train"), "--run", str(run), "--key", str(out / "keys" / "coordinator.key"),
            "--data-dir", str(out / "coordinator"), "--http-port", str(self.http_port), "--p2p-port", str(self.p2p_port),
            "--max-steps", str(self.o.steps), "--batch-timeout", f"{max(BATCH_TIMEOUT_S, self.o.timeout_s):.0f}",
            "--eval-samples", str(self.o.eval_samples), "--eval-every", str(self.o.eval_interval()), "-v", *self._data_root(),
            *(["--probe-tasks", "0"] if self.o.profile else []), *(["--host", self._host("coordinator")] if self.links else []),
        ]), out / "logs" / "coordinator.log")
        self.group.start(coord)
        self._wait(lambda: get_json(f"{self.coord_url}/status") is not None, 300.0, "the coordinator to come up", coord)
        print(f"run page: {self.coord_url}/", flush=True)
        self.events.append(f"{time.monotonic() - self.started:.0f}s run page at {self.coord_url}/")
        # relays: a tree under the origin (relay i follows relay (i-1)//2, relay 0 the origin)
        relay_urls: list[str] = []
        for i in range(self.o.relays):
            port = free_port()
            upstream = self.coord_url if i == 0 else relay_urls[(i - 1) // 2]
            relay_urls.append(f"http://{self._host(f'relay-{i}')}:{port}")
            self.group.start(Proc(f"relay-{i}", "relay", self._cmd(f"relay-{i}", [
                *self._bin("intellect-node"), "-v", "join", "--role", "relay", "--run", str(run), "--key", str(out / "keys" / f"relay-{i}.key"),
                "--data-dir", str(out / f"relay-{i}"), "--http-port", str(port), "--upstream", upstream,
                *(["--host", self._host(f"relay-{i}")] if self.links else []),
            ]), out / "logs" / f"relay-{i}.log"))
            self.node_urls[f"relay-{i}"] = f"{relay_urls[-1]}/shardcast/1/held"
        for i in range(self.o.validators):
            port = free_port()
            self.group.start(Proc(f"validator-{i}", "validator", self._cmd(f"validator-{i}", [
                *self._bin("intellect-node"), "-v", "validate", "--run", str(run), "--key", str(out / "keys" / f"validator-{i}.key"),
                "--data-dir", str(out / f"validator-{i}"), "--http-port", str(port), *self._data_root(),
            ]), out / "logs" / f"validator-{i}.log"))
            if self.links is None:  # a status server on the namespace's loopback is out of the devnet process's reach
                self.node_urls[f"validator-{i}"] = f"http://127.0.0.1:{port}/status"
        names = [f"worker-{i}" for i in range(self.o.workers)] + (["adversary"] if self.o.adversary else [])
        ports = {name: free_port() for name in names}
        self._doctor(run, ports)
        for name in names:
            port = ports[name]
            cheat = ["--adversary", self.o.adversary] if name == "adversary" and self.o.adversary else []
            self.group.start(Proc(name, "worker", self._cmd(name, [
                *self._bin("intellect-node"), "-v", "join", "--role", "worker", "--run", str(run), "--key", str(out / "keys" / f"{name}.key"),
                "--data-dir", str(out / name), "--http-port", str(port), *cheat, *self._data_root(),
            ]), out / "logs" / f"{name}.log"))
            if self.links is None:
                self.node_urls[name] = f"http://127.0.0.1:{port}/status"

    def _doctor(self, run: Path, ports: dict[str, int]) -> None:
        """``intellect-node doctor --role worker`` for every worker at once, each into its worker's log."""
        running = []
        for name, port in ports.items():
            log = self.out / "logs" / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as f:
                argv = [*self._bin("intellect-node"), "doctor", "--run", str(run), "--role", "worker", "--data-dir", str(self.out / name),
                        "--http-port", str(port), "--gossip-wait", "0"]
                argv = self.links.wrap(name, argv) if self.links is not None else argv
                running.append((name, log, subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                            env=self.group.env)))
        for name, log, p in running:
            try:
                rc = p.wait(timeout=DOCTOR_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = -1
            summary = next((line for line in reversed(log.read_text(errors="replace").splitlines()) if line.startswith("doctor (")), "no summary")
            self.events.append(f"{time.monotonic() - self.started:.0f}s {name} {summary}" + ("" if rc == 0 else f" (exit {rc}; see {log})"))

    def _wait(self, cond: Callable[[], bool], timeout_s: float, what: str, proc: Proc | None = None) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if cond():
                return
            if proc is not None and not proc.alive:
                raise RuntimeError(f"{proc.name} exited while waiting for {what}; see {proc.log}")
            self._tick()
            time.sleep(STATUS_POLL_S)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    # --- the run -------------------------------------------------------------------------------

    def _tick(self) -> None:
        if _INTERRUPTED.is_set():
            raise KeyboardInterrupt
        st = get_json(f"{self.coord_url}/status")
        if st is not None:
            self.status = st
        for name, url in self.node_urls.items():
            s = get_json(url, timeout_s=0.5)
            if s is not None:
                self.node_status[name] = s
        self.memory.sample([(p.name, p.role, p.popen.pid) for p in self.group.procs if p.popen is not None and p.alive],
                           int(self.status.get("trainer_step", 0) or 0))
        if self.on_tick is not None:
            self.on_tick(self)

    def expected_peers(self) -> dict[str, int]:
        return {"relay": self.o.relays, "validator": self.o.validators, "worker": self.o.workers + (1 if self.o.adversary else 0)}

    def run(self) -> DevnetResult:
        """Set up, start everything, run the steps, stop everything, and say how it went."""
        coord: Proc | None = None
        restore: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            # SIGTERM and SIGINT (even where a shell started us with SIGINT ignored) stop the devnet
            # like Ctrl-C: every child is stopped (and with --links every namespace removed) in the finally below
            _INTERRUPTED.clear()
            restore = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            run = self.setup()
            self.start_all(run)
            coord = self.group.procs[0]
            self.events.append(f"{time.monotonic() - self.started:.0f}s all processes started")

            def discovered() -> bool:
                seen = self.status.get("peers_by_role", {})
                return all(seen.get(role, 0) >= n for role, n in self.expected_peers().items())

            self._wait(discovered, DISCOVERY_TIMEOUT_S, "all nodes to discover each other over gossip", coord)
            self.events.append(f"{time.monotonic() - self.started:.0f}s all peers discovered: {self.status.get('peers_by_role')}")
            deadline = self.started + self.o.timeout_s
            while coord.alive:
                if time.monotonic() > deadline:
                    return DevnetResult(False, time.monotonic() - self.started, f"timed out after {self.o.timeout_s:.0f} s",
                                        self.status, self.node_status)
                if (why := workers_all_banned(self.status, self.peer_ids)) is not None:
                    return DevnetResult(False, time.monotonic() - self.started, why, self.status, self.node_status)
                self._chaos()
                self._tick()
                time.sleep(STATUS_POLL_S)
            self._tick()
            rc = coord.popen.returncode if coord.popen else -1
            ok = rc == 0
            if ok:
                self._await_final_holds()
                self._await_restart_triage()
            reason = "completed" if ok else f"coordinator exited with status {rc}; see {coord.log}"
            return DevnetResult(ok, time.monotonic() - self.started, reason, self.status, self.node_status)
        finally:
            for sig in restore:  # a second signal must not cut the clean-up short (it is bounded: ≈ 15 s)
                signal.signal(sig, signal.SIG_IGN)
            self.group.stop_all()
            if self.links is not None:
                left = self.links.teardown()
                self.events.append(f"{time.monotonic() - self.started:.0f}s links removed" + (f"; NOT removed: {left}" if left else ""))
            for sig, handler in restore.items():
                signal.signal(sig, handler)

    def _await_final_holds(self) -> None:
        """After the coordinator's last step: wait (bounded) until every running node holds the last
        policy step (its hold line; the relays serve it once the origin is gone), so the report's
        timeline has the whole propagation of every step."""
        from node.devnet.report import read_metrics
        from node.devnet.timeline import read_node_log

        steps = [r["step"] for r in read_metrics(self.out / "coordinator" / "metrics.jsonl") if r.get("event") == "step"]
        if not steps or self.o.relays == 0:
            return
        last = max(steps)
        end = time.monotonic() + (FINAL_HOLD_WAIT_PROFILE_S if self.o.profile else FINAL_HOLD_WAIT_S)
        while time.monotonic() < end:
            waiting = [p.name for p in self.group.procs if p.role != "coordinator" and p.alive and last not in read_node_log(p.log).held]
            if not waiting:
                self.events.append(f"{time.monotonic() - self.started:.0f}s every node holds the last policy step {last}")
                return
            self._tick()
            time.sleep(STATUS_POLL_S)
        self.events.append(f"{time.monotonic() - self.started:.0f}s gave up waiting for {', '.join(waiting)} to hold policy step {last}")

    def _await_restart_triage(self) -> None:
        """After a ``--kill-worker-at`` restart: wait (bounded) until the restarted worker's status says
        what it did with its spool, so the summary can say it (a short run can end while it still loads)."""
        if self.killed_at is None:
            return
        end = time.monotonic() + FINAL_HOLD_WAIT_S
        while time.monotonic() < end and not isinstance((self.node_status.get("worker-0") or {}).get("spool_restart"), dict):
            self._tick()
            time.sleep(STATUS_POLL_S)

    def _chaos(self) -> None:
        k = self.o.kill_worker_at
        step = int(self.status.get("trainer_step", 0) or 0)
        if k is None or self.killed_at is not None or step < k or self.o.workers == 0:
            return
        victim = next(p for p in self.group.procs if p.name == "worker-0")
        self.group.kill(victim)
        self.killed_at = step
        self.events.append(f"{time.monotonic() - self.started:.0f}s killed worker-0 at step {step} (SIGKILL)")
        time.sleep(1.0)
        self.node_status.pop("worker-0", None)  # what it said before the kill is not what the restart did
        self.group.restart(victim)
        self._tick()
        self.restarted_at = int(self.status.get("trainer_step", step) or step)
        self.events.append(f"{time.monotonic() - self.started:.0f}s restarted worker-0 at step {self.restarted_at} (same key and data "
                           "directory): it drops spooled work the async window left behind and re-sends the rest")

    def chaos_summary(self) -> str | None:
        """One sentence on the kill and restart of ``--kill-worker-at`` (``None`` without it)."""
        if self.o.kill_worker_at is None:
            return None
        if self.killed_at is None:
            return f"worker-0 was to be killed at step {self.o.kill_worker_at}, but the run ended before it got there"
        spool = (self.node_status.get("worker-0") or {}).get("spool_restart")
        if not isinstance(spool, dict):
            after = "its status after the restart was never read (see logs/worker-0.log)"
        elif spool.get("found", 0) == 0:
            after = "its spool was empty (the ingest had answered every submission signed before the kill): nothing to re-send or drop"
        else:
            after = (f"of {spool.get('found')} spooled submissions it re-sent {spool.get('resent')} and dropped {spool.get('dropped_stale')} "
                     f"already outside the async window (newest policy step {spool.get('latest_step')})")
        return f"worker-0 killed (SIGKILL) at step {self.killed_at} and restarted at step {self.restarted_at}; {after}"


_INTERRUPTED = threading.Event()
"""Set by SIGTERM/SIGINT. The handler also raises KeyboardInterrupt, but a raise that lands in an
"exception ignored" context (logging's at-fork hook while a child is being forked, a ``__del__``)
is lost, so :meth:`Devnet._tick` raises again from this flag."""


def _raise_interrupt(signum: int, frame: Any) -> None:
    _INTERRUPTED.set()
    raise KeyboardInterrupt
