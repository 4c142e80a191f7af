"""Running an environment's third-party code: persistent bubblewrap sandboxes fed over a pipe
(starts processes; not pure).

Every line of an environment's own code — a plain file's ``score``, reasoning-gym's generators and
``score_answer``, a verifiers environment's dataset and rubric — runs in the sandbox the code
rewards use (:mod:`protocol.rewards.sandbox`: uid 65534, no network, no host files but read-only
``/usr``, the interpreter and this interpreter's site-packages, a bounded tmpfs), inside the
harness :mod:`protocol.envs._env_child`. The environment's own files are shown under ``/env``
from memory: the very bytes :func:`protocol.envs.pin.environment_hash` hashed.

A harness loads the environment once and stays up; each request runs in a fork of it. Per call:

* **time** — the harness kills a call after ``score_wall_s`` (and RLIMIT_CPU stops its CPU at
  ``cpu_time_s``); this process waits ``score_wall_s + GRACE_S`` for the answer, then kills the whole
  sandbox (its pid namespace) and starts another on the next call;
* **memory** — RLIMIT_AS ``memory_bytes`` per process, at most ``processes`` processes;
* **output** — the environment's stdout and stderr are drained here and counted per call: past
  ``output_bytes`` the sandbox is killed; an answer longer than the request's bound is refused;
* **leftovers** — after each call the harness kills every other process of the sandbox.

A fault (crash, a limit, a score that is not a number in [0, 1]) is the environment's, never the
completion's: :meth:`Environment.score` returns it in :class:`EnvScore.fault`, the reward path
sets ``RewardResult.env_fault``, and validators reject with the benign reason ``environment``
(``protocol.verdicts``). Environments are opened once per process (:func:`open_environment`) and
found by their instance ID (:func:`environment_for`), the ID each of their tasks carries.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import select
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import encoding
from protocol.envs.files import EnvSource, environment_source, site_dirs
from protocol.envs.pin import check_environment_hash
from protocol.envs.ref import EnvError, EnvRef, parse_env_ref
from protocol.envs.tasks import HELDOUT_SEED_OFFSET, EnvTasks, env_tasks
from protocol.rewards.base import GIB, MIB, RewardError, SandboxLimits
from protocol.rewards.sandbox import kill_sandbox, launch_recipe, memfd, require_sandbox, sandbox_command

logger = logging.getLogger(__name__)

__all__ = ["ENV_FAULTS", "EnvLimits", "EnvScore", "Environment", "close_environments", "environment_for", "instance_id",
           "open_environment"]

ENV_FAULTS = ("crash", "wall", "cpu", "memory", "output", "value", "died")
"""What can go wrong in an environment's code (:attr:`EnvScore.fault`)."""
BATCH_ITEMS = 256
"""Completions scored per sandbox call by :meth:`Environment.score_many`."""
BATCH_WALL_S = 120.0
"""Wall seconds of one batch at most (less: ``score_wall_s`` per completion)."""
GRACE_S = 5.0
"""Seconds this process waits beyond a call's own wall limit (the harness's fork, answer and sweep)."""
INSTANCE_DOMAIN = b"intellect-node/environment-instance/1\x00"
_HARNESS_PATH = Path(__file__).with_name("_env_child.py")
_SANDBOX_ENV = {"MPLCONFIGDIR": "/tmp", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "INTELLECT_ENV_SANDBOX": "1"}


@dataclass(frozen=True)
class EnvLimits:
    """Bounds of an environment's code (node-local: a limit hit is benign, never evidence).

    Attributes:
        score_wall_s: wall seconds for one ``score`` call.
        cpu_time_s: CPU seconds for one ``score`` call (RLIMIT_CPU of its fork).
        start_wall_s: wall seconds for a sandbox to start and load the environment (imports).
        describe_wall_s: wall seconds for generating the task lists.
        memory_bytes: address space per process (RLIMIT_AS), bytes.
        processes: processes and threads at once (RLIMIT_NPROC, in the sandbox's user namespace).
        open_files: descriptors per process (RLIMIT_NOFILE).
        output_bytes: stdout + stderr of one call (and of the load), bytes; also the largest file it may write.
        answer_bytes: largest answer of one ``score`` call, bytes.
        describe_bytes: largest answer of ``describe`` (the task lists as JSON), bytes.
        tmpfs_bytes: everything the sandbox may write to its ``/tmp`` and ``/dev/shm``, bytes.
        pool: sandboxes per environment at most (started when needed, each a few seconds and
            ≈ 100-300 MB), so that threads of one node score side by side.
    """

    score_wall_s: float = 10.0
    cpu_time_s: int = 10
    start_wall_s: float = 120.0
    describe_wall_s: float = 300.0
    memory_bytes: int = 4 * GIB
    processes: int = 32
    open_files: int = 256
    output_bytes: int = 1 * MIB
    answer_bytes: int = 64 * 1024
    describe_bytes: int = 256 * MIB
    tmpfs_bytes: int = 64 * MIB
    pool: int = 2

    def __post_init__(self) -> None:
        if min(self.score_wall_s, self.start_wall_s, self.describe_wall_s) <= 0 or self.cpu_time_s < 1 or self.pool < 1:
            raise EnvError("environment limits: wall limits > 0, cpu_time_s ≥ 1 and pool ≥ 1")
        if self.memory_bytes < 256 * MIB or self.output_bytes < 1024 or not 4 <= self.processes <= 4096:
            raise EnvError("environment limits: memory_bytes ≥ 256 MiB, output_bytes ≥ 1 KiB and 4-4096 processes")


@dataclass(frozen=True)
class EnvScore:
    """One score from an environment.

    Attributes:
        value: the score in [0, 1]; 0.0 when ``fault`` is set.
        detail: a short reason (the fault's message), for logs and verdict evidence.
        fault: ``None``, or what went wrong in the environment's code (one of :data:`ENV_FAULTS`).
    """

    value: float
    detail: str = ""
    fault: str | None = None


class _Broken(Exception):
    """The sandbox itself must go: it ran over, wrote too much, or died."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class _Harness:
    """One sandbox with the environment loaded; used by one thread at a time."""

    def __init__(self, source: EnvSource, args: Mapping[str, Any], limits: EnvLimits) -> None:
        self.limits = limits
        launch = launch_recipe(site_dirs())
        rec_r, rec_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        spec = {"kind": source.ref.kind, "record_fd": rec_w, "entry": source.entry, "module": source.ref.module,
                "datasets": [list(d) for d in source.ref.datasets], "args": dict(args), "site_dirs": list(site_dirs()),
                "env_root": "/env" if source.bound else "",
                "limits": {"memory_bytes": limits.memory_bytes, "processes": limits.processes, "open_files": limits.open_files,
                           "output_bytes": limits.output_bytes, "cpu_time_s": limits.cpu_time_s}}
        fds = [memfd("intellect-env-spec", json.dumps(spec).encode()), memfd("intellect-env-harness", _HARNESS_PATH.read_bytes())]
        data = [(fds[0], "/job/spec.json"), (fds[1], "/job/harness.py")]
        for f in source.bound:
            fds.append(memfd("intellect-env-file", f.data))
            data.append((fds[-1], f"/env/{f.path}"))
        cmd = sandbox_command(launch, SandboxLimits(tmpfs_bytes=limits.tmpfs_bytes), data_files=data,
                              argv=[launch.python, "-s", "-P", "/job/harness.py"], env=_SANDBOX_ENV)
        try:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=out_w, stderr=err_w, cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                pass_fds=(*fds, rec_w), start_new_session=True, close_fds=True)
        except OSError as e:
            for fd in (rec_r, out_r, err_r):
                os.close(fd)
            raise RewardError(f"cannot start the environment sandbox: {e}") from e
        finally:
            for fd in (*fds, rec_w, out_w, err_w):
                os.close(fd)
        self.rec, self.out, self.err = rec_r, out_r, err_r
        self.stdin = self.proc.stdin.fileno() if self.proc.stdin is not None else -1
        os.set_blocking(self.stdin, False)
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.pending = bytearray()
        self.stderr_tail = bytearray()
        try:
            hello = self._exchange(b"", time.monotonic() + limits.start_wall_s, 4096)
        except _Broken as e:
            self.kill()
            raise EnvError(f"environment {source.ref.text!r} did not start in its sandbox ({e.kind}: {e.detail})") from None
        if not hello.get("ready"):
            self.kill()
            raise EnvError(f"environment {source.ref.text!r} failed to load in its sandbox: {str(hello.get('fatal', hello))[:300]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _exchange(self, line: bytes, deadline: float, max_bytes: int) -> dict[str, Any]:
        """Write ``line`` while draining stdout/stderr (counted) and reading one answer line, by ``deadline``.

        Raises:
            _Broken: time ran out, output or answer over its bound, or the sandbox died.
        """
        to_send = memoryview(line)
        output = 0
        poller = select.poll()
        for fd in (self.rec, self.out, self.err, self.pidfd):
            poller.register(fd, select.POLLIN)
        if to_send:
            poller.register(self.stdin, select.POLLOUT)
        while True:
            nl = self.pending.find(b"\n")
            if nl >= 0:
                raw, self.pending = bytes(self.pending[:nl]), self.pending[nl + 1:]
                try:
                    answer = json.loads(raw)
                except ValueError:
                    raise _Broken("crash", "the harness answered garbage") from None
                if not isinstance(answer, dict):
                    raise _Broken("crash", "the harness answered garbage")
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Broken("wall", "no answer in time")
            for fd, ev in poller.poll(left * 1000):
                if fd == self.stdin:
                    try:
                        n = os.write(self.stdin, to_send)
                    except BlockingIOError:
                        continue
                    except OSError:
                        raise _Broken("died", self._tail()) from None
                    to_send = to_send[n:]
                    if not to_send:
                        poller.unregister(self.stdin)
                    continue
                if fd == self.pidfd:
                    # drain what it said last before calling it dead
                    self._drain_quiet()
                    if b"\n" in self.pending:
                        break
                    raise _Broken("died", self._tail())
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    poller.unregister(fd)
                    continue
                if fd == self.rec:
                    self.pending += chunk
                    if len(self.pending) > max_bytes + 1024:
                        raise _Broken("output", f"answer over {max_bytes} bytes")
                else:
                    output += len(chunk)
                    if fd == self.err:
                        self.stderr_tail = (self.stderr_tail + chunk)[-2000:]
                    if output > self.limits.output_bytes:
                        raise _Broken("output", f"printed over {self.limits.output_bytes} bytes")

    def _drain_quiet(self) -> None:
        for fd in (self.rec, self.err):
            while select.select([fd], [], [], 0)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                if fd == self.rec and len(self.pending) < self.limits.describe_bytes:
                    self.pending += chunk
                elif fd == self.err:
                    self.stderr_tail = (self.stderr_tail + chunk)[-2000:]

    def _tail(self) -> str:
        lines = bytes(self.stderr_tail).decode("utf-8", "replace").strip().splitlines()
        return f"the sandbox exited ({self.proc.poll()}){': ' + lines[-1][:200] if lines else ''}"

    def call(self, request: dict[str, Any], wall_s: float, max_bytes: int) -> dict[str, Any]:
        """One request; the harness's answer (possibly a fault).

        Raises:
            _Broken: the sandbox must be killed (the caller does).
        """
        line = json.dumps({**request, "wall_s": wall_s, "max_bytes": max_bytes}, ensure_ascii=False).encode("utf-8", "surrogatepass")
        return self._exchange(line + b"\n", time.monotonic() + wall_s + GRACE_S, max_bytes)

    def kill(self) -> None:
        if self.proc.returncode is None:
            kill_sandbox(self.proc)
        for fd in (self.rec, self.out, self.err, self.pidfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.rec = self.out = self.err = self.pidfd = -1
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def instance_id(env_hash: str, name: str, args: Mapping[str, Any]) -> str:
    """The ID an environment's tasks carry: SHA-256 over its content hash, its name and its
    arguments (two configurations of one library score differently), 64 hex digits."""
    return hashlib.sha256(INSTANCE_DOMAIN + encoding.packb({"hash": env_hash, "name": name, "args": dict(args)})).hexdigest()


class Environment:
    """An opened environment: its files' hash, its tasks, and a pool of sandboxed harnesses.

    Build with :func:`open_environment`. Thread-safe: up to ``limits.pool`` calls run at once.

    Attributes:
        source: what was hashed (:class:`~protocol.envs.files.EnvSource`).
        args: the adapter's arguments (``env.args``).
        id: :func:`instance_id`, the ``environment`` field of every task it made.
        tasks: training and held-out tasks (after :meth:`load_tasks`).
        faults: faults seen so far, by kind (node-local counts).
    """

    def __init__(self, source: EnvSource, args: Mapping[str, Any], limits: EnvLimits | None = None) -> None:
        self.source = source
        self.args = dict(args)
        self.limits = limits or EnvLimits()
        self.id = instance_id(source.hash, source.ref.text, self.args)
        self.tasks = EnvTasks(train=[], heldout=[])
        self.faults: dict[str, int] = {}
        self._task_lists: dict[tuple[int, int, int], EnvTasks] = {}
        self._idle: queue.LifoQueue[_Harness | None] = queue.LifoQueue()
        for _ in range(self.limits.pool):
            self._idle.put(None)
        self._all: set[_Harness] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def hash(self) -> str:
        """The content hash of its files and package versions (``env.hash``)."""
        return self.source.hash

    def _run(self, request: dict[str, Any], wall_s: float, max_bytes: int) -> dict[str, Any]:
        """One request on an idle harness (started when none is), a broken one killed and forgotten.

        Raises:
            EnvError: the environment does not load in a fresh sandbox.
            RewardError: the sandbox cannot run on this host.
        """
        if self._closed:
            raise EnvError(f"environment {self.source.ref.text!r} was closed")
        slot = self._idle.get()
        try:
            if slot is not None and not slot.alive():
                self._forget(slot)
                slot = None
            if slot is None:
                slot = _Harness(self.source, self.args, self.limits)
                with self._lock:
                    self._all.add(slot)
            return slot.call(request, wall_s, max_bytes)
        except _Broken as e:
            if slot is not None:
                self._forget(slot)
                slot = None
            return {"fault": e.kind, "detail": e.detail}
        except BaseException:
            if slot is not None:
                self._forget(slot)
                slot = None
            raise
        finally:
            self._idle.put(slot)

    def _forget(self, h: _Harness) -> None:
        h.kill()
        with self._lock:
            self._all.discard(h)

    def load_tasks(self, seed: int, train_size: int, heldout_size: int) -> EnvTasks:
        """Generate (or read) the environment's tasks in its sandbox: training tasks at ``seed``,
        held-out ones from its own split or at ``seed +`` :data:`~protocol.envs.tasks.HELDOUT_SEED_OFFSET`.

        Raises:
            EnvError: the environment failed, ran over a limit, or produced malformed tasks (one line).
        """
        key = (seed, train_size, heldout_size)
        if key in self._task_lists:
            self.tasks = self._task_lists[key]
            return self.tasks
        answer = self._run({"op": "describe", "train": [seed, train_size], "heldout": [seed + HELDOUT_SEED_OFFSET, heldout_size]},
                           self.limits.describe_wall_s, self.limits.describe_bytes)
        if "items" not in answer:
            raise EnvError(f"environment {self.source.ref.text!r} could not list its tasks ({answer.get('fault')}: "
                           f"{str(answer.get('detail', ''))[:300]})")
        self.tasks = self._task_lists[key] = env_tasks(self.id, answer["items"], self.source.ref.label)
        return self.tasks

    def score(self, row: Mapping[str, Any], completion: str) -> EnvScore:
        """The environment's score of ``completion`` for the task ``row``; never raises for the
        environment's own failures (they come back as :attr:`EnvScore.fault`).

        Raises:
            RewardError: the sandbox cannot run on this host (bubblewrap missing).
        """
        try:
            answer = self._run({"op": "score", "row": dict(row), "completion": completion}, self.limits.score_wall_s, self.limits.answer_bytes)
        except EnvError as e:  # it no longer loads (it did at open): its own doing
            answer = {"fault": "crash", "detail": str(e)}
        return self._judged(answer)

    def score_many(self, items: Sequence[tuple[Mapping[str, Any], str]]) -> list[EnvScore]:
        """:meth:`score` of many ``(row, completion)`` pairs, :data:`BATCH_ITEMS` per sandbox call.

        The same scores as one by one, by construction: inside the batch each item still runs in
        its own fork of the loaded environment, seeded alike, with its own CPU and wall limit
        (``score_wall_s``), and what it left running is killed before the next, so state an
        environment keeps in its globals cannot make a worker's batch differ from a validator's
        one-by-one re-check. What a batch saves is the round trips to this process and its sweeps:
        256 reasoning-gym ``basic_arithmetic`` scores took 3.3 s in one batch vs 3.6 s one by one
        (7 Dec 2026, load 0.1; the fork per item, ≈ 4.5 ms with reasoning-gym loaded, dominates).
        A batch that fails as a whole (it ran over its total time or output) is scored one by one,
        so each fault lands on the completion that caused it.

        Raises:
            RewardError: the sandbox cannot run on this host.
        """
        out: list[EnvScore] = []
        for start in range(0, len(items), BATCH_ITEMS):
            chunk = items[start:start + BATCH_ITEMS]
            if len(chunk) == 1:
                out.append(self.score(*chunk[0]))
                continue
            try:
                answer = self._run({"op": "score_many", "items": [{"row": dict(r), "completion": c} for r, c in chunk],
                                    "item_wall_s": self.limits.score_wall_s},
                                   min(self.limits.score_wall_s * len(chunk), BATCH_WALL_S), self.limits.answer_bytes * len(chunk))
            except EnvError:
                answer = {}
            scores = answer.get("scores")
            if not isinstance(scores, list) or len(scores) != len(chunk) or not all(isinstance(a, dict) for a in scores):
                out += [self.score(r, c) for r, c in chunk]
                continue
            out += [self._judged(a) for a in scores]
        return out

    def _judged(self, answer: Mapping[str, Any]) -> EnvScore:
        """An answer as an :class:`EnvScore`; a fault counted in :attr:`faults`."""
        value = answer.get("score")
        if "fault" in answer or not isinstance(value, float) or not 0.0 <= value <= 1.0:
            kind = str(answer.get("fault", "value"))
            kind = kind if kind in ENV_FAULTS else "crash"
            with self._lock:
                self.faults[kind] = self.faults.get(kind, 0) + 1
            detail = f"environment {kind}: {str(answer.get('detail', ''))[:200]}"
            logger.info("%s", detail)
            return EnvScore(0.0, detail, kind)
        return EnvScore(value, str(answer.get("detail", ""))[:200])

    def close(self) -> None:
        """Kill its sandboxes and forget it (:func:`environment_for` no longer finds it)."""
        self._closed = True
        with self._lock:
            harnesses = list(self._all)
            self._all.clear()
        for h in harnesses:
            h.kill()
        with _registry_lock:
            if _registry.get(self.id) is self:
                del _registry[self.id]


_registry: dict[str, Environment] = {}
_registry_lock = threading.Lock()


def environment_for(instance: str) -> Environment:
    """The environment this process opened with instance ID ``instance`` (the ``environment`` field of its tasks).

    Raises:
        RewardError: no such environment is open here (a node scores environment tasks only after
            opening the run's environment, which every role does at start).
    """
    with _registry_lock:
        env = _registry.get(instance)
    if env is None:
        raise RewardError(f"no environment {instance[:16]}… is open in this process: open the run's environment first "
                          "(protocol.envs.open_environment)")
    return env


def open_environment(name: str, *, args: Mapping[str, Any] | None = None, pinned_hash: str = "", seed: int = 0,
                     train_size: int = 1000, heldout_size: int = 100, limits: EnvLimits | None = None) -> Environment:
    """Open an environment: find its files, check them against the run spec's pin, start its
    sandbox, generate its tasks; reused when this process already opened the same one.

    Args:
        name: ``env.name`` (:func:`protocol.envs.ref.parse_env_ref`).
        args: ``env.args``, the adapter's arguments.
        pinned_hash: ``env.hash``; ``""`` to skip the check (``spec init`` computes it).
        seed: ``env.seed``; train_size: ``env.train_size``; heldout_size: ``env.heldout_size``.
        limits: bounds of its code (defaults when ``None``).

    Raises:
        EnvError: an unknown name, a missing adapter library (one line naming the extra), a hash
            that differs from ``pinned_hash`` (one line naming both), or an environment that fails
            to load or to list its tasks.
        RewardError: no bubblewrap sandbox on this host (the message says what to install).
    """
    ref: EnvRef = parse_env_ref(name)
    args = dict(args or {})
    if ref.kind == "file" and args:
        raise EnvError(f"env.args is for reasoning_gym and verifiers environments; {ref.path} takes none (put its settings in the file)")
    source = environment_source(ref)
    if pinned_hash:
        check_environment_hash(ref.text, source.hash, pinned_hash)
    key = instance_id(source.hash, ref.text, args)
    with _registry_lock:
        env = _registry.get(key)
    if env is None:
        require_sandbox()
        env = Environment(source, args, limits)
    t0 = time.monotonic()
    tasks = env.load_tasks(seed, train_size, heldout_size)
    logger.info("environment %s (hash %s…) opened: %d training and %d held-out tasks (%d held-out dropped: also a training "
                "prompt) in %.1f s", ref.text, source.hash[:16], len(tasks.train), len(tasks.heldout), tasks.dropped,
                time.monotonic() - t0)
    with _registry_lock:
        _registry.setdefault(key, env)
    return env


def close_environments() -> None:
    """Close every environment this process opened (at exit)."""
    with _registry_lock:
        envs = list(_registry.values())
    for env in envs:
        env.close()


_pid = os.getpid()


@atexit.register
def _close_at_exit() -> None:
    if os.getpid() == _pid:
        close_environments()
