"""Child processes of a devnet: each in its own session (process group), logging to a file."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass
class Proc:
    """One child: its name, role, command line, log file and process."""

    name: str
    role: str
    args: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class ProcessGroup:
    """Starts, watches and stops the devnet's processes; never leaves one behind.

    Every child runs in a new session so a signal reaches its whole process tree; :meth:`stop_all`
    sends SIGTERM, waits ``grace_s`` seconds, then SIGKILLs what is left.
    """

    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)

    def start(self, proc: Proc) -> Proc:
        proc.log.parent.mkdir(parents=True, exist_ok=True)
        with open(proc.log, "ab") as log:
            proc.popen = subprocess.Popen(proc.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=self.env, preexec_fn=_die_with_parent)
        if proc not in self.procs:
            self.procs.append(proc)
        logger.info("started %s (pid %d)", proc.name, proc.popen.pid)
        return proc

    def kill(self, proc: Proc) -> None:
        """SIGKILL ``proc``'s process group (a crash, for chaos testing)."""
        if proc.popen is not None and proc.popen.poll() is None:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)

    def restart(self, proc: Proc) -> None:
        proc.restarts += 1
        self.start(proc)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every child (SIGTERM, then SIGKILL after ``grace_s``), children last-started first."""
        for p in reversed(self.procs):
            if p.popen is not None and p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            if p.popen is None:
                continue
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.popen is None:
                continue
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)  # the group: nothing a child spawned survives
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("%s (pid %d) did not exit", p.name, p.popen.pid)


def _die_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the devnet process dies, even by SIGKILL
    (each child has its own session, so a signal to the devnet's group would not reach it)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: stop_all is the only cleanup
        pass
