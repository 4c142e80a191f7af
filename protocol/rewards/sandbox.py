"""Run one untrusted Python program in a bubblewrap sandbox (starts processes; not pure).

The boundary is the kernel's, set up by bubblewrap (Debian ``bubblewrap``):

* user, pid, mount, network, IPC, UTS and cgroup namespaces (``--unshare-all``): uid/gid 65534
  inside; no network (only a down loopback); ``/proc`` shows only the sandbox's processes; no
  nested user namespaces (``--disable-userns``);
* a root file system holding only read-only binds of ``/usr`` (with ``/bin``, ``/lib``,
  ``/lib64`` as on the host), the interpreter's prefix (at its own path, because the
  interpreter's ``RUNPATH`` names it), a fresh ``/dev`` and ``/proc``, a private tmpfs ``/tmp``
  as the working folder, and ``/job`` with the harness and its spec (copied in from memfds). No
  key, data folder, project checkout or home folder is visible;
* **one budget for what it can write** (``SandboxLimits.tmpfs_bytes``): the root and ``/dev``
  are remounted read-only once set up (bubblewrap's own tmpfs mounts have no size), and the
  only writable mounts are ``/tmp`` (7/8 of the budget) and ``/dev/shm`` (1/8), each a tmpfs of
  that size. tmpfs pages are memory, so the sandbox can hold at most
  ``processes × memory_bytes + tmpfs_bytes`` bytes;
* **no writable host file**: stdin is a sealed memfd opened read-only, stdout, stderr and the
  harness's record stream are pipes that this process drains with caps (``output_bytes`` for
  stdout and stderr, :data:`RECORDS_MAX_BYTES` for records; over a cap the sandbox is killed).
  A host temporary file opened read-write let the candidate ``fallocate(FALLOC_FL_KEEP_SIZE)``
  gigabytes of the host's disk past RLIMIT_FSIZE;
* ``--die-with-parent --new-session``; the sandbox's pid 1 is bwrap's init; on a wall timeout
  that init is killed directly (a ptrace-ing candidate can clear its parent-death signal), which
  kills the whole pid namespace, daemons included, then bwrap (a process group of its own);
* resource limits the harness sets before the candidate runs: RLIMIT_CPU, RLIMIT_AS,
  RLIMIT_FSIZE, RLIMIT_NPROC (counted per user namespace), RLIMIT_NOFILE, no core dumps. A run
  killed by SIGKILL counts as the CPU limit only when the sandbox used at least ``cpu_time_s``
  of CPU (the hard limit's kill), as memory when the kernel's OOM killer acted meanwhile;
  otherwise (a program that kills itself) it is the program's own failure;
* when the node runs as root, bwrap itself runs as uid 65534 (``setpriv``), so the sandbox's
  processes are uid 65534 on the host as well and RLIMIT_NPROC applies (root is exempt from it).
  An interpreter (or another folder shown inside, :func:`launch_recipe`) under a folder that
  uid cannot traverse (a pyenv under root's 0700 home) is first bind-mounted onto ``/mnt/<i>``,
  on a small tmpfs over ``/mnt``, inside a private mount namespace (``unshare -m``) made for
  this one run; the host's ``/mnt`` is untouched.

The candidate's process prints raw outputs only (see :mod:`protocol.rewards._sandbox_child`);
every comparison with expected values happens in this process. Where bubblewrap or user
namespaces are missing, code rewards raise :class:`RewardError` naming what to install; there is
no weaker fallback. :func:`sandbox_status` is the cheap check for other code (``doctor``).
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from protocol.rewards.base import RewardError, SandboxLimits

logger = logging.getLogger(__name__)

__all__ = ["CHILD_ENV", "SandboxRun", "kill_sandbox", "launch_recipe", "memfd", "require_sandbox", "run_python", "sandbox_command",
           "sandbox_status"]

NOBODY_UID = 65534
RECORDS_MAX_BYTES = 4 * 1024**2
RECORD_FD_ENV = 3
_CHILD_SOURCE_PATH = Path(__file__).with_name("_sandbox_child.py")
_INSTALL_HINT = "code tasks need bubblewrap: apt-get install bubblewrap"
_PRIVATE_MOUNT = "/mnt"  # only ever mounted on inside a private mount namespace
_NAMESPACE_EXIT_S = 5.0  # bound on waiting for a killed sandbox's processes to be reaped


@dataclass(frozen=True, slots=True)
class SandboxRun:
    """What one sandbox run produced.

    Attributes:
        exit_code: the harness's exit status (``128 + n``: killed by signal n), ``None`` if it
            was killed on wall timeout.
        timed_out: the wall limit expired.
        stdout: its stdout (at most ``output_bytes``), decoded as UTF-8 with replacement.
        stderr: the tail of its stderr (2,000 bytes), for details.
        records: the JSON records the harness (or the candidate) wrote, in order; lines that do
            not decode as JSON objects are skipped; at most :data:`RECORDS_MAX_BYTES` are read.
        records_truncated: more than :data:`RECORDS_MAX_BYTES` of records were written.
        limit_hit: ``"wall"``, ``"cpu"``, ``"memory"`` or ``"output"`` when the run stopped at a
            resource limit, else ``None``.
        wall_s: wall-clock seconds the run took.
        cpu_s: CPU seconds the sandbox's processes used (user + system), sampled every 0.2 s.
    """

    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    records: list[dict[str, Any]]
    records_truncated: bool
    limit_hit: str | None
    wall_s: float
    cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _Launch:
    """How to start bwrap on this host (probed once)."""

    prefix_cmd: tuple[str, ...]  # unshare/sh/setpriv in front of bwrap, or ()
    bwrap: str
    python: str  # the interpreter's real path, the same inside the sandbox
    binds: tuple[tuple[str, str], ...]  # (host source, sandbox path), read-only


def _reachable_by_others(path: str) -> bool:
    """Whether a user with no special relation to ``path`` can traverse to it and read it."""
    p = Path(path)
    for d in [*reversed(p.parents), p]:
        try:
            mode = d.stat().st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return bool(p.stat().st_mode & stat.S_IROTH)


def _system_binds() -> list[str]:
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


@functools.cache
def launch_recipe(extra_dirs: tuple[str, ...] = ()) -> _Launch:
    """How to start bwrap on this host (probed once per set of ``extra_dirs``), or :class:`RewardError`
    saying what is missing.

    Args:
        extra_dirs: host folders to show read-only inside the sandbox at their own paths, besides
            the interpreter's prefix (the environment sandbox's site-packages,
            :mod:`protocol.envs.sandboxed`). Folders uid 65534 cannot reach (under a 0700 home)
            are staged on a private tmpfs over ``/mnt`` first, inside a mount namespace made for
            the one run.

    Raises:
        RewardError: no bwrap, or the helpers it needs as root (setpriv, unshare, mount) are missing.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise RewardError(f"{_INSTALL_HINT} (no bwrap on PATH)")
    python = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not python.startswith(prefix + os.sep):
        # a venv made with --copies: run the base interpreter, whose prefix holds the stdlib
        base_python = os.path.realpath(os.path.join(prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"))
        if base_python.startswith(prefix + os.sep) and os.access(base_python, os.X_OK):
            python = base_python
        else:
            prefix = os.path.dirname(os.path.dirname(python))
    dirs: list[str] = []
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        dirs.append(prefix)
    dirs += [d for d in extra_dirs if d not in dirs]
    binds: list[tuple[str, str]] = [(d, d) for d in dirs]
    prefix_cmd: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise RewardError("code sandbox needs setpriv (util-linux) to run bwrap as uid 65534 when the node runs as root")
        uid = str(NOBODY_UID)
        tail = [setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--no-new-privs"]
        hidden = [d for d in dirs if not _reachable_by_others(d)]
        if hidden:
            unshare, mount = shutil.which("unshare"), shutil.which("mount")
            if unshare is None or mount is None or not os.path.isdir(_PRIVATE_MOUNT):
                raise RewardError(f"{hidden[0]} is not readable by uid 65534 and unshare/mount/{_PRIVATE_MOUNT} are missing")
            # a private tmpfs over /mnt, each hidden folder bound on /mnt/<i>: the host's /mnt is untouched
            script = ('mount -t tmpfs -o size=64k,mode=755 intellect-stage "$0" || exit 125; n=$1; shift; i=0; '
                      'while [ "$i" -lt "$n" ]; do mkdir "$0/$i" && mount --bind "$1" "$0/$i" || exit 125; shift; i=$((i+1)); done; '
                      'exec "$@"')
            prefix_cmd = [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, _PRIVATE_MOUNT, str(len(hidden)),
                          *hidden]
            staged = {d: f"{_PRIVATE_MOUNT}/{i}" for i, d in enumerate(hidden)}
            binds = [(staged.get(d, d), d) for d in dirs]
        prefix_cmd += tail
    return _Launch(prefix_cmd=tuple(prefix_cmd), bwrap=bwrap, python=python, binds=tuple(binds))


_launch = launch_recipe  # the code sandbox's recipe: launch_recipe() (its cache_clear() clears both)


CHILD_ENV: dict[str, str] = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # fixed so that set and dict-of-set printing is the same on the worker and the validator
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
"""The whole environment of a sandboxed process (bwrap ``--clearenv``, then these)."""


def _child_env(extra: dict[str, str] | None = None) -> list[str]:
    args = ["--clearenv"]
    for k, v in {**CHILD_ENV, **(extra or {})}.items():
        args += ["--setenv", k, v]
    return args


def sandbox_command(launch: _Launch, limits: SandboxLimits, *, data_files: list[tuple[int, str]], argv: list[str],
                    env: dict[str, str] | None = None) -> list[str]:
    """The command line that starts ``argv`` in a fresh bubblewrap sandbox (the boundary of the module docstring).

    Args:
        launch: :func:`launch_recipe`'s answer for this host.
        limits: only ``tmpfs_bytes`` is used here (the rlimits are the harness's to set).
        data_files: ``(descriptor, path)`` pairs: each descriptor's bytes appear read-only at
            ``path`` inside (bwrap ``--ro-bind-data``; pass the descriptors to the child).
        argv: the program inside, e.g. ``[launch.python, "-s", "-P", "/job/harness.py"]``.
        env: variables added to :data:`CHILD_ENV`.

    Returns:
        The argv for :class:`subprocess.Popen`.
    """
    binds: list[str] = []
    for src, dst in launch.binds:
        binds += ["--ro-bind", src, dst]
    data: list[str] = []
    for fd, path in data_files:
        data += ["--ro-bind-data", str(fd), path]
    shm_bytes = max(limits.tmpfs_bytes // 8, 1 << 20)
    return [
        *launch.prefix_cmd,
        launch.bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid", str(NOBODY_UID),
        "--gid", str(NOBODY_UID),
        "--disable-userns",  # no nested user namespaces: less kernel surface
        "--hostname", "sandbox",
        "--die-with-parent",
        "--new-session",
        "--cap-drop", "ALL",
        *_system_binds(),
        *binds,
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(shm_bytes),
        "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",  # not recursive: /dev/shm stays writable, at its size
        "--size", str(max(limits.tmpfs_bytes - shm_bytes, 1 << 20)),
        "--tmpfs", "/tmp",
        "--chdir", "/tmp",
        *data,
        "--remount-ro", "/",  # bwrap's root tmpfs has no size: nothing may be written there
        *_child_env(env),
        *argv,
    ]  # fmt: skip


def memfd(name: str, data: bytes) -> int:
    """A close-on-exec memfd holding ``data``, positioned at its start (hand it to one child with ``pass_fds``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # pass_fds opens it to our child only, not to other threads' children
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_only_memfd(name: str, data: bytes) -> int:
    """A read-only descriptor of a sealed memfd holding ``data`` (the candidate's stdin): it can
    neither write, grow nor ``fallocate`` it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_sandbox(proc: subprocess.Popen[bytes]) -> None:
    """Kill bwrap and the sandbox's whole pid namespace, and wait until the namespace is gone.

    The sandbox's init (bwrap's child, pid 1 inside) would die with bwrap only through
    ``PR_SET_PDEATHSIG``, which a candidate can clear by ptrace-attaching to it (same uid, same
    namespaces) and making it call ``prctl``; its processes then outlived the wall kill. So the
    init is killed directly (by pidfd: no pid-reuse race): when a pid namespace's init dies the
    kernel kills every process in it, and the init's pidfd turns readable only after they are
    all reaped.
    """
    pidfds: list[int] = []
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children", encoding="ascii") as f:
            children = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        children = []
    for child in children:
        try:
            pidfds.append(os.pidfd_open(child))
        except OSError:
            continue  # already gone
    try:
        for fd in pidfds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _kill_group(proc.pid)
        proc.wait()
        for fd in pidfds:
            select.select([fd], [], [], _NAMESPACE_EXIT_S)
    finally:
        for fd in pidfds:
            os.close(fd)


def _parse_records(raw: bytes) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for line in raw[:RECORDS_MAX_BYTES].split(b"\n"):
        if not line:
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            records.append(obj)
    return records


def _oom_kills() -> int:
    """The kernel's count of OOM kills (``/proc/vmstat`` ``oom_kill``; 0 where it cannot be read)."""
    try:
        with open("/proc/vmstat", encoding="ascii") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _limit_of(exit_code: int | None, timed_out: bool, records: list[dict[str, Any]], *, cpu_s: float, cpu_limit_s: int,
              oom_killed: bool, over: str | None) -> str | None:
    if timed_out:
        return "wall"
    if over is not None:
        return over
    if exit_code == 128 + signal.SIGXCPU:
        return "cpu"
    if exit_code == 128 + signal.SIGKILL:
        # RLIMIT_CPU's hard limit kills with SIGKILL only after cpu_time_s of CPU (soft + 1 s);
        # the OOM killer with SIGKILL too. Any other SIGKILL is the program's own doing.
        if oom_killed:
            return "memory"
        return "cpu" if cpu_s >= cpu_limit_s else None
    if exit_code == 128 + signal.SIGXFSZ:
        return "output"
    for kind in ("memory", "output"):
        if any(r.get("limit") == kind for r in records):
            return kind
    return None


class _Drain:
    """Bytes read from one pipe, with a cap: ``keep_tail`` keeps only the last bytes (stderr)."""

    def __init__(self, limit: int, keep_tail: int | None = None) -> None:
        self.limit = limit
        self.keep_tail = keep_tail
        self.total = 0
        self.data = bytearray()

    def add(self, chunk: bytes) -> bool:
        """Take ``chunk``; ``False`` once more than ``limit`` bytes came."""
        self.total += len(chunk)
        room = self.limit + 1 - len(self.data)
        self.data += chunk[: max(room, 0)] if self.keep_tail is None else chunk
        if self.keep_tail is not None and len(self.data) > self.keep_tail:
            del self.data[: len(self.data) - self.keep_tail]
        return self.total <= self.limit


_CLK_TCK = os.sysconf("SC_CLK_TCK")
_CPU_SAMPLE_S = 0.2
"""How often the sandbox's CPU time is sampled from ``/proc``, wall seconds."""


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, own and of reaped children) of ``root`` and its descendants,
    from ``/proc`` (kernel numbers the candidate cannot forge; processes gone meanwhile are skipped)."""
    total, todo, seen = 0.0, [root], set[int]()
    while todo and len(seen) < 4096:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / _CLK_TCK  # utime stime cutime cstime
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def _wait_and_drain(proc: subprocess.Popen[bytes], pipes: dict[int, tuple[str, _Drain]], wall_s: float) -> tuple[bool, str | None, float]:
    """Read the pipes until each ends and wait for the sandbox, all within ``wall_s`` seconds.

    The sandbox's CPU time is sampled every :data:`_CPU_SAMPLE_S` while it runs (bwrap does not
    pass its namespace's CPU time on to ``wait4``), so the largest sample is within that much
    CPU per process of what it used.

    Returns:
        ``(timed_out, over, cpu_s)``: ``over`` names the pipe that passed its cap (the caller
        kills the sandbox), ``cpu_s`` the largest CPU time sampled, seconds.
    """
    deadline = time.monotonic() + wall_s
    poller = select.poll()
    for fd in pipes:
        poller.register(fd, select.POLLIN)
    pidfd = os.pidfd_open(proc.pid)
    poller.register(pidfd, select.POLLIN)
    open_fds = set(pipes)
    cpu_s, next_sample = 0.0, 0.0
    try:
        while open_fds or proc.returncode is None:
            now = time.monotonic()
            if proc.returncode is None and now >= next_sample:
                cpu_s = max(cpu_s, _tree_cpu_s(proc.pid))
                next_sample = now + _CPU_SAMPLE_S
            left = deadline - now
            if left <= 0:
                return True, None, cpu_s
            for fd, _ in poller.poll(min(left, _CPU_SAMPLE_S) * 1000):
                if fd == pidfd:
                    poller.unregister(pidfd)
                    proc.wait()  # exited: returns at once
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                elif not pipes[fd][1].add(chunk):
                    return False, pipes[fd][0], cpu_s
        return False, None, cpu_s
    finally:
        os.close(pidfd)


def run_python(
    mode: Literal["stdio", "call", "assert"],
    code: str,
    tests: dict[str, Any],
    limits: SandboxLimits,
    stdin_text: str = "",
    wall_time_s: float | None = None,
) -> SandboxRun:
    """Run ``code`` once in a fresh bubblewrap sandbox.

    Args:
        mode: ``"stdio"`` runs ``code`` as ``__main__`` with ``stdin_text`` on stdin;
            ``"call"`` calls a function per input; ``"assert"`` runs rewritten assert tests.
        code: the candidate program.
        tests: ``{}`` for stdio; ``{"inputs", "fn_name"}`` for call (no expected outputs);
            ``{"prelude", "setup_code", "snippets"}`` for assert (from
            :func:`protocol.rewards.asserts.plan_asserts`; no expected literals).
        limits: the sandbox limits.
        stdin_text: the program's stdin (stdio mode).
        wall_time_s: wall limit for this run, in seconds; ``limits.wall_time_s`` when ``None``.

    Returns:
        The run's outcome; a candidate's failure is an outcome, not an exception.

    Raises:
        RewardError: if the sandbox is unavailable on this host (the message says what to
            install) or cannot be started.
    """
    launch = _launch()
    wall = limits.wall_time_s if wall_time_s is None else min(wall_time_s, limits.wall_time_s)
    spec: dict[str, Any] = {
        "mode": mode,
        "code": code,
        "record_fd": -1,
        "limits": {
            "cpu_time_s": limits.cpu_time_s,
            "memory_bytes": limits.memory_bytes,
            "output_bytes": limits.output_bytes,
            "processes": limits.processes,
            "open_files": limits.open_files,
        },
    }
    if mode == "call":
        spec["call"] = {"inputs": tests["inputs"], "fn_name": tests["fn_name"]}
    elif mode == "assert":
        spec["assert"] = {k: tests[k] for k in ("prelude", "setup_code", "snippets")}
    fds: list[int] = []  # ours, closed at the end
    child_fds: list[int] = []  # the child's ends, closed once it started
    proc: subprocess.Popen[bytes] | None = None
    t0 = time.monotonic()
    try:
        out_r, out_w = os.pipe()
        fds.append(out_r)
        child_fds.append(out_w)
        err_r, err_w = os.pipe()
        fds.append(err_r)
        child_fds.append(err_w)
        rec_r, rec_w = os.pipe()
        fds.append(rec_r)
        child_fds.append(rec_w)
        spec["record_fd"] = rec_w
        stdin_fd = _read_only_memfd("intellect-sandbox-stdin", stdin_text.encode("utf-8"))
        child_fds.append(stdin_fd)
        spec_fd = memfd("intellect-sandbox-spec", json.dumps(spec).encode("utf-8"))
        child_fds.append(spec_fd)
        child_fd = memfd("intellect-sandbox-harness", _CHILD_SOURCE_PATH.read_bytes())
        child_fds.append(child_fd)
        cmd = sandbox_command(launch, limits, data_files=[(spec_fd, "/job/spec.json"), (child_fd, "/job/harness.py")],
                              argv=[launch.python, "-s", "-P", "/job/harness.py"])
        oom_before = _oom_kills()
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=stdin_fd,
                stdout=out_w,
                stderr=err_w,
                cwd="/",
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                pass_fds=(spec_fd, child_fd, rec_w),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            raise RewardError(f"cannot start the code sandbox: {e}") from e
        for fd in child_fds:
            os.close(fd)
        child_fds.clear()
        stdout, stderr, records_raw = _Drain(limits.output_bytes), _Drain(limits.output_bytes, keep_tail=2000), _Drain(RECORDS_MAX_BYTES)
        timed_out, over, cpu_s = _wait_and_drain(proc, {out_r: ("output", stdout), err_r: ("output", stderr), rec_r: ("records", records_raw)}, wall)
        if proc.returncode is None:  # over the wall or a cap: kill it (a reaped one is gone with its namespace)
            kill_sandbox(proc)
        wall_s = time.monotonic() - t0
        truncated = over == "records"
        records = _parse_records(bytes(records_raw.data))
        exit_code = None if timed_out else proc.returncode
        limit = _limit_of(exit_code, timed_out, records, cpu_s=cpu_s, cpu_limit_s=limits.cpu_time_s,
                          oom_killed=_oom_kills() > oom_before, over=None if truncated else over)
        return SandboxRun(exit_code, timed_out, bytes(stdout.data[: limits.output_bytes]).decode("utf-8", "replace"),
                          bytes(stderr.data).decode("utf-8", "replace"), records, truncated, limit, wall_s, cpu_s)
    finally:
        if proc is not None and proc.returncode is None and proc.poll() is None:
            kill_sandbox(proc)
        for fd in [*fds, *child_fds]:
            os.close(fd)


@functools.cache
def _probe() -> tuple[bool, str]:
    try:
        launch = _launch()
        run = run_python("stdio", "import os\nprint(os.getuid())", {}, SandboxLimits(cpu_time_s=5, wall_time_s=20.0))
    except RewardError as e:
        return False, str(e)
    if run.exit_code != 0 or run.stdout.strip() != str(NOBODY_UID):
        detail = run.stderr.strip().splitlines()[-1:] or [f"exit status {run.exit_code}"]
        return False, f"{_INSTALL_HINT} and allow user namespaces (bwrap failed: {detail[0][:200]})"
    how = "as uid 65534 via setpriv" if launch.prefix_cmd else "as this user"
    return True, f"bubblewrap sandbox works ({how}; interpreter {launch.python})"


def sandbox_status() -> tuple[bool, str]:
    """Whether code rewards can run on this host: a real bubblewrap sandbox, probed once per
    process by running a tiny program in it (≈ 0.1 s the first time, then cached).

    Returns:
        ``(ok, reason)``: ``reason`` is one line; when not ok it says what to install or allow.
    """
    return _probe()


def require_sandbox() -> None:
    """Raise unless :func:`sandbox_status` is ok.

    Raises:
        RewardError: naming what to install.
    """
    ok, reason = sandbox_status()
    if not ok:
        raise RewardError(reason)
