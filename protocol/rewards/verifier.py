"""Killable math-verify processes (starts processes; not pure).

math-verify bounds its time with ``signal.alarm``, which only works on the main thread, and
sympy holds the GIL while it computes: called in a node's worker thread, one hostile answer such
as ``\\boxed{9^{9^{9^{9}}}}`` froze the event loop for minutes. Here every check runs in a small
pool of long-lived verifier processes (:mod:`protocol.rewards._math_worker`, address space
limited); the caller waits on a pipe (no GIL held) for at most the check's wall limit, and a
verifier that runs over is killed (SIGKILL to its process group) and replaced on the next call.

The pool is per node process, created on first use, ``min(4, cpu count)`` verifiers at most,
started lazily; callers beyond that wait for an idle verifier. Thread-safe.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from protocol.rewards.base import RewardError

logger = logging.getLogger(__name__)

__all__ = ["verify_answer"]

_WORKER_PATH = Path(__file__).with_name("_math_worker.py")
_STARTUP_TIMEOUT_S = 120.0
_RESPONSE_MAX_BYTES = 4096


class _Verifier:
    """One verifier process."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "VIRTUAL_ENV")}
        env["OMP_NUM_THREADS"] = "1"
        try:
            self.proc = subprocess.Popen(
                # -P: the script's folder (which holds math.py) stays off sys.path
                [sys.executable, "-s", "-P", str(_WORKER_PATH), str(memory_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
                cwd="/",
            )
        except OSError as e:
            raise RewardError(f"cannot start a math verifier: {e}") from e
        line = self._read_line(_STARTUP_TIMEOUT_S)
        if not line or b"ready" not in line:
            self.kill()
            raise RewardError("math verifier did not start (is math-verify installed?)")

    def _read_line(self, timeout_s: float) -> bytes | None:
        """One response line; ``b""`` when the verifier closed its end (died), ``None`` when
        ``timeout_s`` passed first."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout_s
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, _RESPONSE_MAX_BYTES)
            if not chunk or len(buf) > _RESPONSE_MAX_BYTES:
                return b""
            buf += chunk
        return buf

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:  # unsent request bytes in a dead verifier's stdin: nothing to do
                    pass

    def check(self, gold: str, answer: str, timeout_s: float) -> tuple[bool, str | None, str]:
        """``(ok, limit_hit, detail)``; kills this verifier on a timeout or a broken pipe."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"gold": gold, "answer": answer, "timeout_s": timeout_s}).encode("utf-8") + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            return False, "memory", "math verifier died"
        line = self._read_line(timeout_s)
        if line is None:
            self.kill()
            return False, "wall", f"math check ran over {timeout_s} s"
        if not line:
            self.kill()
            return False, "memory", "math verifier died"
        try:
            resp = json.loads(line)
        except ValueError:
            self.kill()
            return False, "memory", "math verifier answered garbage"
        if resp.get("limit") == "memory":
            self.kill()  # its heap may be fragmented near the limit: start afresh
            return False, "memory", "math check ran out of memory"
        if resp.get("error"):
            return False, None, f"could not be verified: {resp['error']}"
        return bool(resp.get("ok")), None, ""


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: queue.LifoQueue[_Verifier | None] = queue.LifoQueue()
        for _ in range(size):
            self.idle.put(None)  # a slot; the verifier starts on first use
        self.all: set[_Verifier] = set()
        self.lock = threading.Lock()

    def verify(self, gold: str, answer: str, timeout_s: float, memory_bytes: int) -> tuple[bool, str | None, str]:
        # A verifier that dies is replaced and the check tried once more: something else may
        # have killed it (an operator, a test's reaper); dying twice on one answer is the answer's.
        result: tuple[bool, str | None, str] = (False, "memory", "math verifier died")
        for _ in range(2):
            result = self._verify_once(gold, answer, timeout_s, memory_bytes)
            if result[2] != "math verifier died":
                break
        return result

    def _verify_once(self, gold: str, answer: str, timeout_s: float, memory_bytes: int) -> tuple[bool, str | None, str]:
        slot = self.idle.get()
        try:
            if slot is not None and (not slot.alive() or slot.memory_bytes != memory_bytes):
                slot.kill()
                self._forget(slot)
                slot = None
            if slot is None:
                slot = _Verifier(memory_bytes)
                with self.lock:
                    self.all.add(slot)
            result = slot.check(gold, answer, timeout_s)
            if not slot.alive():
                self._forget(slot)
                slot = None
            return result
        except BaseException:
            if slot is not None:
                slot.kill()
                self._forget(slot)
                slot = None
            raise
        finally:
            self.idle.put(slot)

    def _forget(self, v: _Verifier) -> None:
        with self.lock:
            self.all.discard(v)

    def close(self) -> None:
        with self.lock:
            procs = list(self.all)
            self.all.clear()
        for v in procs:
            v.kill()


_pool: _Pool | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():  # a forked child builds its own
            _pool = _Pool(min(4, os.cpu_count() or 1))
            _pool_pid = os.getpid()
        return _pool


@atexit.register
def _close_pool() -> None:
    if _pool is not None and _pool_pid == os.getpid():
        _pool.close()


def verify_answer(gold: str, answer: str, timeout_s: float, memory_bytes: int) -> tuple[bool, str | None, str]:
    """``math_verify.verify(parse(\\boxed{gold}), parse(\\boxed{answer}))`` in a verifier process.

    Args:
        gold: the ground truth, unboxed LaTeX.
        answer: the extracted answer, unboxed LaTeX (already through the structural pre-checks).
        timeout_s: wall seconds for parsing both and comparing; the verifier is killed after.
        memory_bytes: the verifier's address-space limit, in bytes.

    Returns:
        ``(equal, limit_hit, detail)``: ``limit_hit`` is ``"wall"`` or ``"memory"`` when the check
        was cut off (``equal`` is then False), else ``None``.

    Raises:
        RewardError: if no verifier can be started (math-verify missing).
    """
    return _get_pool().verify(gold, answer, timeout_s, memory_bytes)
