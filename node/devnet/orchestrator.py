"""The devnet: every role as its own OS process on 127.0.0.1, talking only through libp2p gossip,
Shardcast HTTP and the ingest — the code paths of a real deployment."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
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

from node.devnet.config import WORKER_DTYPES, devnet_env, devnet_spec
from node.devnet.links import Links
from node.devnet.outdir import claim_out, write_marker
from node.devnet.procs import Proc, ProcessGroup
from node.devnet.profile import prepare_profile_model
from node.devnet.timeline import MemorySampler
from protocol.identity import NodeKey, PeerId
from protocol.runspec import ToplocSpec, dump_run_spec, sign_run_spec

logger = logging.getLogger(__name__)

DISCOVERY_TIMEOUT_S = 180.0
"""Longest wait for every node to appear on gossip, seconds (a loaded 2-core machine needed > 90 s)."""
FINAL_HOLD_WAIT_S = 20.0
FINAL_HOLD_WAIT_PROFILE_S = 600.0
"""After the last step, how long the nodes may take to hold it before the devnet stops them, seconds."""
LINGER_MARGIN_S = 30.0
"""The coordinator serves its last step (``intellect-train --linger``) this much longer than the devnet waits for
the nodes to hold it: the origin stays a source until the devnet stops it (it closed at once before, and a node
whose fetch of the last steps had started from the origin and Sybil relays alone then held none)."""
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
        link_mbit: with ``links``, role → link rate in Mb/s instead of ``LINK_MBIT``'s (``--link-mbit``).
        deltas: publish and fetch step deltas (bf16 models; ``False``: every step in full, for comparison).
        model: a local Hugging Face Qwen2 directory to train instead of the embedded model (``None``: embedded).
        rl: overrides of the run spec's ``[rl]`` fields (``--rl KEY=VALUE``; e.g. the off-policy
            correction ``is_correction``), checked like a spec file's.
        env: the run's own environment (``--env``: ``reasoning_gym:NAME``, ``verifiers:MODULE`` or a
            ``.py`` file; ``protocol.envs``), opened here once to pin its hash; ``None``: ``tasks``.
        env_args: its ``env.args`` (``--env-arg KEY=VALUE``).
        worker_dtype: what every worker and the adversary compute in, ``float32`` or ``bfloat16``;
            the run spec is made fit for it (``node.devnet.config.precision_toploc``).
        steer_rate: the ``steer`` adversary's share of chances taken.
        sampling_rule: the run spec's ``sampling.rule`` (``gumbel-v2`` with bf16 workers only).
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
    link_mbit: dict[str, int] = field(default_factory=dict)
    deltas: bool = True
    eval_every: int | None = None
    eval_samples: int = 16
    model: Path | None = None
    rl: dict[str, Any] = field(default_factory=dict)
    env: str | None = None
    env_args: dict[str, Any] = field(default_factory=dict)
    worker_dtype: str = "float32"
    steer_rate: float = 1.0
    sampling_rule: str = "icdf-v1"

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


DEVNET_MEASURE_SUBMISSIONS = 12
DEVNET_MEASURE_BATCHES = (8, 64)
"""The devnet measures its bf16 tolerances on 12 honest submissions at each of decode batch 8 and 64 (its
workers decode 64 at a time; ≈ 4,500 tokens of the embedded task; batch 1 triples the time and adds
nothing its workers do): ``spec init --measure-precision`` measures 20 at each of 1, 8 and 64."""


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


def hold_port() -> socket.socket:
    """A TCP port on 127.0.0.1 held for a child that must be told its port before it starts (the
    coordinator: the signed spec names its URL and bootstrap address).

    The socket is bound with ``SO_REUSEADDR`` and never listens: the child binds the same port (its
    servers set ``SO_REUSEADDR``: ``node/http_server.py``, py-libp2p's TCP listener) while nobody else
    can: a plain ``bind`` fails and the kernel hands the port out neither for another ``bind(0)`` nor
    as a connection's local port. Picking a free port and closing it before the child started let
    another process take it in between. Close the socket when the child has stopped.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


SERVING_RE = re.compile(r" serving (http://\S+) ")
"""A relay's start line (``node/relay/role.py``): the URL it serves on, its bound port included."""
STATUS_RE = re.compile(r" started; status (http://\S+)")
"""A worker's or validator's start line (``node/lifecycle.py``): its status URL, bound port included."""


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
        self._held_ports: list[socket.socket] = []  # the coordinator's two ports, held until every child stopped
        self._url_from: dict[str, int] = {}  # node → log offset of its current process's start line (a restart appends)
        # peer ID → (trainer step, seconds since start) when the devnet first saw it on the ban list
        self.banned_seen: dict[str, tuple[int, float]] = {}

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
            self.links = Links(roles, mbit=self.o.link_mbit)
            self.links.setup()
            self.events.append(f"{time.monotonic() - self.started:.0f}s links: " + ", ".join(
                f"{n.name} {n.ip} {n.mbit} Mb/s" for n in self.links.nodes.values()))
        self._held_ports = [hold_port(), hold_port()]
        self.http_port, self.p2p_port = (int(h.getsockname()[1]) for h in self._held_ports)
        host = self._host("coordinator")
        self.coord_url = f"http://{host}:{self.http_port}"
        bootstrap = f"/ip4/{host}/tcp/{self.p2p_port}/p2p/{coord.peer_id}"
        env_kw: dict[str, Any] = {}
        if self.o.env is not None:
            self.events.append(f"{time.monotonic() - self.started:.0f}s opening environment {self.o.env} (its sandbox) to pin it")
            section, tasks_hash, max_tokens = devnet_env(self.o.env, self.o.env_args)
            env_kw = {"env": section, "tasks_hash": tasks_hash, "env_max_tokens": max_tokens}
            self.events.append(f"{time.monotonic() - self.started:.0f}s environment hash {section.hash[:16]}…, tasks {tasks_hash[:16]}…")
        elif self.o.tasks is not None:
            from protocol.dataset import names_a_file, resolve_tasks

            if names_a_file(self.o.tasks):  # nodes read a task file only where the spec pins it (protocol.dataset.run_tasks)
                env_kw = {"tasks_hash": resolve_tasks(self.o.tasks, self.o.data_root).hash}

        def make(measured: Any = None) -> Any:
            return devnet_spec(coord, validators, tasks=self.o.tasks, http_url=self.coord_url, bootstrap=bootstrap,
                               seed=self.seed, async_level=self.o.async_level, model=self.o.model, rl_overrides=self.o.rl,
                               profile=self.o.profile is not None, deltas=self.o.deltas, worker_dtype=self.o.worker_dtype, measured=measured,
                               sampling_rule=self.o.sampling_rule, **env_kw)

        spec = make() if WORKER_DTYPES[self.o.worker_dtype] == "float32" else make(self._measure_precision(make(ToplocSpec(
            replay_rule="logit-bound-v3", replay_logit_bound=1.0, worker_dtype="bfloat16"))))
        signed = sign_run_spec(spec, coord)
        self.run_id = signed.run_id.hex()
        write_marker(self.out, {"seed": self.seed, "run_id": self.run_id, "started": round(time.time(), 3)})
        path = self.out / "run.toml"
        path.write_text(dump_run_spec(signed))
        return path

    def _measure_precision(self, draft: Any) -> Any:
        """The bf16 tolerances of this run, measured on its base once per machine (``node/precision.py``;
        ``spec init --measure-precision bfloat16 --fp32-logits`` does the same): the table goes to the events."""
        from node.coordinator.base import base_cache_root, prepare_base
        from node.precision import cached_measurement
        from protocol.dataset import resolve_run_tasks
        from protocol.models import load_tokenizer

        self.events.append(f"{time.monotonic() - self.started:.0f}s measuring the bf16 workers' tolerances on the base (once per machine)")
        tasks = resolve_run_tasks(draft, self.o.data_root)  # the run's own environment too (--env)
        work = self.out / "precision-base"
        try:
            base = prepare_base(draft, tasks, work)
            m, cached = cached_measurement(draft, base, tasks.train, load_tokenizer(base), "bfloat16", fp32_logits=True,
                                           cache_dir=base_cache_root().parent / "precision", submissions=DEVNET_MEASURE_SUBMISSIONS,
                                           batches=DEVNET_MEASURE_BATCHES)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        toploc = m.toploc(draft.toploc, draft.sampling.temperature)
        self.events.append(f"{time.monotonic() - self.started:.0f}s " + ("(cached) " if cached else "") + "\n  ".join(m.lines(toploc)))
        return toploc

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
            "--linger", f"{self._final_hold_wait_s() + LINGER_MARGIN_S:.0f}",
            "--eval-samples", str(self.o.eval_samples), "--eval-every", str(self.o.eval_interval()), "-v", *self._data_root(),
            *(["--probe-tasks", "0"] if self.o.profile else []), *(["--host", self._host("coordinator")] if self.links else []),
        ]), out / "logs" / "coordinator.log")
        self.group.start(coord)
        self._wait(lambda: get_json(f"{self.coord_url}/status") is not None, 300.0, "the coordinator to come up", coord)
        print(f"run page: {self.coord_url}/", flush=True)
        self.events.append(f"{time.monotonic() - self.started:.0f}s run page at {self.coord_url}/")
        # relays: a tree under the origin (relay i follows relay (i-1)//2, relay 0 the origin). Every node binds
        # any free port (--http-port 0) and prints its URL; a relay's children start once it printed it
        relays = [Proc(f"relay-{i}", "relay", [], out / "logs" / f"relay-{i}.log") for i in range(self.o.relays)]

        def start_relay(i: int) -> None:
            upstream = self.coord_url if i == 0 else self._wait_url(relays[(i - 1) // 2], SERVING_RE)
            relays[i].args = self._cmd(f"relay-{i}", [
                *self._bin("intellect-node"), "-v", "join", "--role", "relay", "--run", str(run), "--key", str(out / "keys" / f"relay-{i}.key"),
                "--data-dir", str(out / f"relay-{i}"), "--http-port", "0", "--upstream", upstream,
                *(["--host", self._host(f"relay-{i}")] if self.links else []),
            ])
            self._start_node(relays[i])

        if relays:
            start_relay(0)
        for i in range(self.o.validators):
            self._start_node(Proc(f"validator-{i}", "validator", self._cmd(f"validator-{i}", [
                *self._bin("intellect-node"), "-v", "validate", "--run", str(run), "--key", str(out / "keys" / f"validator-{i}.key"),
                "--data-dir", str(out / f"validator-{i}"), "--http-port", "0", *self._data_root(),
            ]), out / "logs" / f"validator-{i}.log"))
        names = [f"worker-{i}" for i in range(self.o.workers)] + (["adversary"] if self.o.adversary else [])
        self._doctor(run, names)
        for i in range(1, self.o.relays):  # relay 0 printed its URL meanwhile (the doctor takes longer)
            start_relay(i)
        for name in names:
            extra = ["--adversary", self.o.adversary] if name == "adversary" and self.o.adversary else []
            if extra and self.o.adversary == "steer":
                extra += ["--steer-rate", f"{self.o.steer_rate:g}"]
            if self.o.worker_dtype != "float32":
                extra += ["--dtype", self.o.worker_dtype]
            self._start_node(Proc(name, "worker", self._cmd(name, [
                *self._bin("intellect-node"), "-v", "join", "--role", "worker", "--run", str(run), "--key", str(out / "keys" / f"{name}.key"),
                "--data-dir", str(out / name), "--http-port", "0", *extra, *self._data_root(),
            ]), out / "logs" / f"{name}.log"))

    def _start_node(self, proc: Proc) -> None:
        """Start a relay, validator or worker; its status URL is read from its start line (:meth:`_read_urls`)."""
        self._url_from[proc.name] = proc.log.stat().st_size if proc.log.exists() else 0
        self.node_urls.pop(proc.name, None)
        self.group.start(proc)

    def _url(self, proc: Proc, pattern: re.Pattern[str]) -> str | None:
        """The URL ``proc``'s current process printed in its start line, or ``None`` (not yet)."""
        try:
            with open(proc.log, "rb") as f:
                f.seek(self._url_from.get(proc.name, 0))
                m = pattern.search(f.read().decode(errors="replace"))
        except OSError:
            return None
        return m.group(1) if m else None

    def _wait_url(self, proc: Proc, pattern: re.Pattern[str]) -> str:
        self._wait(lambda: self._url(proc, pattern) is not None, DISCOVERY_TIMEOUT_S, f"{proc.name} to print its URL", proc)
        return self._url(proc, pattern) or ""

    def _read_urls(self) -> None:
        """Status URLs of the nodes that printed their start line since they (re)started. With ``--links``
        a worker's or validator's status server is on its namespace's loopback, out of this process's reach."""
        for p in self.group.procs:
            if p.role == "coordinator" or p.name in self.node_urls:
                continue
            if p.role == "relay" and (url := self._url(p, SERVING_RE)):
                self.node_urls[p.name] = f"{url}/shardcast/1/held"
            elif p.role != "relay" and self.links is None and (url := self._url(p, STATUS_RE)):
                self.node_urls[p.name] = f"{url}/status"

    def _doctor(self, run: Path, names: list[str]) -> None:
        """``intellect-node doctor --role worker`` for every worker at once, each into its worker's log."""
        running = []
        for name in names:
            log = self.out / "logs" / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as f:
                argv = [*self._bin("intellect-node"), "doctor", "--run", str(run), "--role", "worker", "--data-dir", str(self.out / name),
                        "--http-port", "0", "--gossip-wait", "0"]
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
            for b in st.get("banned") or []:
                if isinstance(b, dict) and isinstance(b.get("peer_id"), str) and b["peer_id"] not in self.banned_seen:
                    self.banned_seen[b["peer_id"]] = (int(st.get("trainer_step", 0) or 0), time.monotonic() - self.started)
        self._read_urls()
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
            while coord.alive and self.status.get("state") != "done":  # done: it lingers, serving the last step (--linger)
                if time.monotonic() > deadline:
                    return DevnetResult(False, time.monotonic() - self.started, f"timed out after {self.o.timeout_s:.0f} s",
                                        self.status, self.node_status)
                if (why := workers_all_banned(self.status, self.peer_ids)) is not None:
                    return DevnetResult(False, time.monotonic() - self.started, why, self.status, self.node_status)
                self._chaos()
                self._tick()
                time.sleep(STATUS_POLL_S)
            self._tick()
            rc = 0 if coord.alive else coord.popen.returncode if coord.popen else -1
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
            for held in self._held_ports:
                held.close()
            if self.links is not None:
                left = self.links.teardown()
                self.events.append(f"{time.monotonic() - self.started:.0f}s links removed" + (f"; NOT removed: {left}" if left else ""))
            for sig, handler in restore.items():
                signal.signal(sig, handler)

    def _final_hold_wait_s(self) -> float:
        return FINAL_HOLD_WAIT_PROFILE_S if self.o.profile else FINAL_HOLD_WAIT_S

    def _await_final_holds(self) -> None:
        """After the coordinator's last step: wait (bounded) until every running node holds the last
        policy step (its hold line; the coordinator still serves it, lingering), so the report's
        timeline has the whole propagation of every step."""
        from node.devnet.report import read_metrics
        from node.devnet.timeline import read_node_log

        steps = [r["step"] for r in read_metrics(self.out / "coordinator" / "metrics.jsonl") if r.get("event") == "step"]
        if not steps or self.o.relays == 0:
            return
        last = max(steps)
        end = time.monotonic() + self._final_hold_wait_s()
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
        self._url_from[victim.name] = victim.log.stat().st_size if victim.log.exists() else 0  # on a new port: read its new line
        self.node_urls.pop(victim.name, None)
        self.group.restart(victim)
        self._tick()
        self.restarted_at = int(self.status.get("trainer_step", step) or step)
        self.events.append(f"{time.monotonic() - self.started:.0f}s restarted worker-0 at step {self.restarted_at} (same key and data "
                           "directory): it drops spooled work the async window left behind and re-sends the rest")

    def worker_outcomes(self) -> dict[str, dict[str, Any]]:
        """Per worker process (``worker-<i>``, ``adversary``): what the coordinator made of its work.

        Keys: ``peer_id``; the ledger's submission counts (``accepted``, ``rejected``, ``stale``,
        ``pending``, ``trained``: submissions a step consumed) and ``rollouts_trained``, from the run
        page's leaderboard in its final snapshot (``coordinator/run-page/snapshot.js``, written when
        the coordinator stops), else from the last ``/status`` (``stale`` always; ``rollouts_trained``
        ``None`` then); ``banned`` (the ban reason or ``None``) and ``banned_at_step`` /
        ``banned_after_s`` (the trainer step and run time when this devnet first saw the ban;
        ``None`` if never) and ``ban_evidence`` (the banning verdict's evidence from the run page's
        snapshot, ``None`` when not there); for the adversary its own ``steering`` counts when it
        reported them.
        """
        st = self.status
        snapshot = _run_page_snapshot(self.out)
        board = {row.get("peer_id"): row for row in snapshot.get("leaderboard") or [] if isinstance(row, dict)}
        evidence = {b.get("peer_id"): b.get("evidence") for b in snapshot.get("bans") or [] if isinstance(b, dict)}
        banned = {b.get("peer_id"): str(b.get("reason", "")) for b in st.get("banned") or [] if isinstance(b, dict)}
        out: dict[str, dict[str, Any]] = {}
        for name, pid in sorted(self.peer_ids.items()):
            if not name.startswith(("worker-", "adversary")):
                continue
            counts = dict((st.get("workers") or {}).get(pid) or {})
            if pid in board:  # the final snapshot is newer than the last /status read: its counts, where it has them
                final = board[pid]
                counts.update({k: final[src] for k, src in (("accepted", "accepted"), ("rejected", "rejected"), ("pending", "pending"),
                                                            ("trained", "submissions_trained")) if isinstance(final.get(src), int)})
            seen = self.banned_seen.get(pid)
            row: dict[str, Any] = {"peer_id": pid, **{k: int(counts.get(k, 0)) for k in ("accepted", "rejected", "stale", "pending", "trained")},
                                   "rollouts_trained": board[pid].get("rollouts_trained") if pid in board else None,
                                   "banned": banned.get(pid), "banned_at_step": seen[0] if seen else None,
                                   "banned_after_s": round(seen[1], 1) if seen else None,
                                   "ban_evidence": evidence.get(pid) if isinstance(evidence.get(pid), dict) else None}
            steering = (self.node_status.get(name) or {}).get("steering")
            if isinstance(steering, dict):
                row["steering"] = steering
            out[name] = row
        return out

    def adversary_summary(self) -> str | None:
        """One sentence on the adversary: its accepted, rejected and trained-on work and whether and when
        it was banned; ``None`` without ``--adversary``."""
        if not self.o.adversary:
            return None
        row = self.worker_outcomes().get("adversary")
        if row is None:
            return None
        rollouts = "?" if row["rollouts_trained"] is None else row["rollouts_trained"]
        ban = (f"banned at trainer step {row['banned_at_step']} ({row['banned']})" if row["banned"] else "never banned")
        text = (f"adversary {self.o.adversary}: {row['accepted']} submissions accepted, {row['rejected']} rejected, {row['pending']} pending, "
                f"{row['trained']} trained on ({rollouts} rollouts); {ban}")
        steering = row.get("steering")
        if isinstance(steering, dict) and steering.get("rollouts"):
            text += (f"; steered {steering.get('taken')} of {steering.get('chances')} chances over {steering.get('rollouts')} rollouts "
                     f"({steering.get('tokens')} tokens, rate {self.o.steer_rate:g})")
        return text

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


def _run_page_snapshot(out: Path) -> dict[str, Any]:
    """The coordinator's final run-page document (``coordinator/run-page/snapshot.js``, written when it
    stops: ``window.RUN_SNAPSHOT = {…};``), ``{}`` when it is missing or unreadable."""
    path = out / "coordinator" / "run-page" / "snapshot.js"
    try:
        text = path.read_text()
        doc = json.loads(text[text.index("{") : text.rindex("}") + 1])
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


_INTERRUPTED = threading.Event()
"""Set by SIGTERM/SIGINT. The handler also raises KeyboardInterrupt, but a raise that lands in an
"exception ignored" context (logging's at-fork hook while a child is being forked, a ``__del__``)
is lost, so :meth:`Devnet._tick` raises again from this flag."""


def _raise_interrupt(signum: int, frame: Any) -> None:
    _INTERRUPTED.set()
    raise KeyboardInterrupt
