"""Run one untrusted Python program in a child process with hard limits.

Layers, from hardest to softest:

* a separate process (``sys.executable -s -P`` with a fresh environment; not ``-I`` because
  ``-I`` ignores ``PYTHONHASHSEED``, which must be fixed at 0 so that set and dict-of-set
  printing is identical on the worker and the validator) in a new session, whose whole process
  group is killed with SIGKILL on wall timeout and after every run;
* resource limits set by the child before the candidate runs: RLIMIT_CPU, RLIMIT_AS (memory),
  RLIMIT_FSIZE (stdout, stderr and any file it writes), no core dumps;
* a fresh temporary working folder (also ``HOME`` and ``TMPDIR``), removed afterwards;
* no network: the child runs under ``unshare -n`` (a network namespace with only a down
  loopback) where that works — as root, ``unshare -n`` and, when the interpreter is readable by
  it, also ``--setuid/--setgid 65534`` (nobody); otherwise ``unshare -rn`` (user namespace);
  otherwise nothing at this layer;
* inside the child (Python level, best effort, see :mod:`protocol.rewards._sandbox_child`):
  sockets refused, an audit hook refusing writes, renames and deletes outside the working
  folder, process creation, signals, ctypes and raising of limits.

What this does not protect against: code that defeats the in-process audit hook (it runs in the
same interpreter, so introspection can in principle reach it) can write wherever the child's
user may write and read any file that user can read; without a network namespace, a native
extension could open sockets. The child's user is root where nothing else is available. Run
workers and validators as an unprivileged user in a container for a real boundary.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from protocol.rewards.base import RewardError, SandboxLimits

logger = logging.getLogger(__name__)

__all__ = ["SandboxRun", "isolation_prefix", "run_python"]

NOBODY_UID = 65534
RESULT_MAX_BYTES = 64 * 1024
_CHILD_SOURCE_PATH = Path(__file__).with_name("_sandbox_child.py")


@dataclass(frozen=True, slots=True)
class SandboxRun:
    """What one child run produced.

    Attributes:
        exit_code: the child's exit status (negative: killed by that signal), ``None`` if it
            was killed on wall timeout.
        timed_out: the wall limit expired.
        stdout: the child's stdout (at most ``output_bytes``), decoded as UTF-8 with replacement.
        stderr: the tail of its stderr, for details.
        result: the nonce-checked result line of ``call``/``assert`` mode, else ``None``.
        wall_s: wall-clock seconds the child ran.
    """

    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    result: dict[str, Any] | None
    wall_s: float


def _python_cmd() -> list[str]:
    return [sys.executable, "-s", "-P"] if sys.version_info >= (3, 11) else [sys.executable, "-s"]


@functools.cache
def isolation_prefix() -> tuple[str, ...]:
    """The command prefix that puts the child in its own network namespace (probed once).

    Returns:
        The first of ``unshare -n --setuid 65534 --setgid 65534`` (root only), ``unshare -n``
        (root only), ``unshare -rn`` that runs this interpreter, or ``()`` when none does.
    """
    unshare = shutil.which("unshare")
    candidates: list[tuple[str, ...]] = []
    if unshare:
        if os.geteuid() == 0:
            uid = str(NOBODY_UID)
            candidates += [(unshare, "-n", "--setuid", uid, "--setgid", uid), (unshare, "-n")]
        candidates.append((unshare, "-rn"))
    for prefix in candidates:
        try:
            probe = subprocess.run(
                [*prefix, *_python_cmd(), "-c", "pass"],
                check=False,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
                cwd="/",
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            logger.info("code sandbox isolation: %s", " ".join(prefix[1:]))
            return prefix
    logger.warning("code sandbox: no network namespace available (unshare failed); relying on in-process blocking")
    return ()


def _child_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONUNBUFFERED": "0",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(
    mode: Literal["stdio", "call", "assert"],
    code: str,
    tests: dict[str, Any],
    limits: SandboxLimits,
    stdin_text: str = "",
    wall_time_s: float | None = None,
) -> SandboxRun:
    """Run ``code`` once in a fresh sandboxed child process.

    Args:
        mode: ``"stdio"`` runs ``code`` as ``__main__`` with ``stdin_text`` on stdin;
            ``"call"`` / ``"assert"`` run ``tests`` (the parsed test-case object) inside the child
            and report through a nonce-tagged result line.
        code: the candidate program.
        tests: ``{}`` for stdio; ``{"inputs", "outputs", "fn_name"}`` for call;
            ``{"assert_tests", "setup_code", "prelude"}`` for assert.
        limits: the sandbox limits.
        stdin_text: the child's stdin (stdio mode).
        wall_time_s: wall limit for this run, in seconds; ``limits.wall_time_s`` when ``None``.

    Returns:
        The run's outcome; a candidate's failure is an outcome, not an exception.

    Raises:
        RewardError: if the child cannot be started at all.
    """
    wall = limits.wall_time_s if wall_time_s is None else min(wall_time_s, limits.wall_time_s)
    prefix = isolation_prefix()
    drops_uid = "--setuid" in prefix
    # base/ holds the spec and the stdin/stdout/stderr files; base/work/ is the child's folder,
    # so the candidate cannot overwrite its own captured output.
    base = tempfile.mkdtemp(prefix="intellect-sandbox-", dir=limits.tmp_root)
    workdir = os.path.join(base, "work")
    os.mkdir(workdir)
    nonce = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    proc: subprocess.Popen[bytes] | None = None
    t0 = time.monotonic()
    try:
        spec = {
            "mode": mode,
            "code": code,
            "tests": tests,
            "nonce": nonce,
            "result_fd": write_fd,
            "cpu_time_s": limits.cpu_time_s,
            "memory_bytes": limits.memory_bytes,
            "output_bytes": limits.output_bytes,
        }
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        stdin_path = os.path.join(base, "stdin")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin_text)
        if drops_uid:
            os.chmod(base, 0o711)
            os.chown(workdir, NOBODY_UID, NOBODY_UID)
            os.chown(spec_path, NOBODY_UID, NOBODY_UID)
        out_path = os.path.join(base, "stdout")
        err_path = os.path.join(base, "stderr")
        child_src = _CHILD_SOURCE_PATH.read_text(encoding="utf-8")
        with open(stdin_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            try:
                proc = subprocess.Popen(
                    [*prefix, *_python_cmd(), "-c", child_src],
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    cwd=workdir,
                    env=_child_env(workdir),
                    pass_fds=(write_fd,),
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as e:
                raise RewardError(f"cannot start the code sandbox: {e}") from e
        os.close(write_fd)
        write_fd = -1
        timed_out = False
        try:
            exit_code: int | None = proc.wait(timeout=wall)
        except subprocess.TimeoutExpired:
            timed_out, exit_code = True, None
            _kill_group(proc.pid)
            proc.wait()
        _kill_group(proc.pid)
        wall_s = time.monotonic() - t0
        os.set_blocking(read_fd, False)
        raw = b""
        try:
            while len(raw) < RESULT_MAX_BYTES and (chunk := os.read(read_fd, RESULT_MAX_BYTES)):
                raw += chunk
        except BlockingIOError:
            pass
        result = None
        for line in raw.decode("utf-8", "replace").splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("nonce") == nonce:
                result = obj
        stdout = Path(out_path).read_bytes()[: limits.output_bytes].decode("utf-8", "replace")
        stderr = Path(err_path).read_bytes()[-2000:].decode("utf-8", "replace")
        return SandboxRun(exit_code, timed_out, stdout, stderr, result, wall_s)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        shutil.rmtree(base, ignore_errors=True)
