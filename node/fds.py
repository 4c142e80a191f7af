"""File descriptors: the soft limit raised at start, and connection caps that fit under it.

A node serves HTTP to anyone; every open connection holds a descriptor, and so do the node's
own files (SQLite and its WAL, Shardcast pieces being written, the spool, logs), libp2p
connections and the pipes of reward sandboxes. The usual default soft limit is 1,024, the same
number as the HTTP servers' default connection cap: a crowd of half-open connections used every
descriptor, ``accept()`` failed with EMFILE and asyncio logged an ERROR for each try (169,417
records in 45 s, 73 MB of log), and the node's own files could not be opened (issue #23 item 6).

So the entry points raise the soft limit to the hard limit (:func:`raise_open_files_limit`),
and every HTTP server takes its connection cap from one per-process budget
(:data:`CONNECTION_BUDGET`) that keeps :data:`FD_RESERVE` descriptors for everything else and
:data:`ACCEPT_BURST` for connections accepted over a full cap before they are closed: the
servers' connections then never exhaust the descriptors.
"""

from __future__ import annotations

import logging
import resource
import threading

logger = logging.getLogger(__name__)

FD_RESERVE = 256
"""Descriptors kept out of every connection cap: files, SQLite (database, WAL, shared memory),
pieces in flight, libp2p connections (``max_peers`` 64 and their streams), sandbox pipes."""

ACCEPT_BACKLOG = 128
"""Listen backlog of every HTTP server, which is also how many connections asyncio accepts in one
loop pass before any is refused (the refusal closes them a pass later)."""

ACCEPT_BURST = 2 * ACCEPT_BACKLOG
"""Descriptors that connections over a full cap can hold for a moment: accepted in one pass,
closed in the next, while the next pass accepts as many again."""

MIN_CONNECTIONS = 32
"""A server gets at least this many connections (or what it asked, if less) even when the budget
is spent, so a second server in a process with a low limit still answers ``/status``."""


def _nr_open() -> int:
    """The kernel's ceiling for RLIMIT_NOFILE (``/proc/sys/fs/nr_open``; 1,048,576 where unreadable)."""
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (an unlimited hard limit: to the kernel's
    ``nr_open``). Call once at process start.

    Returns:
        ``(soft, hard)`` after the change (unchanged where it could not be raised).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard if hard != resource.RLIM_INFINITY else _nr_open(), _nr_open())
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.debug("open files limit raised from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open files limit from %d to %d: %s", soft, target, e)
    return soft, hard


class ConnectionBudget:
    """The descriptors a process can give its HTTP servers' connections: the soft limit less
    :data:`FD_RESERVE` and :data:`ACCEPT_BURST`, less what servers already hold. Thread-safe.
    Under ``ulimit -n 1024`` one server gets 512; with a soft limit of 2,048 or more, 1,024.

    Args:
        reserve: descriptors kept for everything else.
    """

    def __init__(self, reserve: int = FD_RESERVE + ACCEPT_BURST) -> None:
        self.reserve = reserve
        self.granted = 0
        self._lock = threading.Lock()

    def grant(self, requested: int) -> int:
        """A connection cap for one more server: ``requested`` if it fits, else what is left
        (at least ``min(requested, MIN_CONNECTIONS)``). Give it back with :meth:`release`."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        room = (1 << 30) if soft == resource.RLIM_INFINITY else soft - self.reserve
        with self._lock:
            n = max(min(requested, room - self.granted), min(requested, MIN_CONNECTIONS))
            self.granted += n
        if n < requested:
            logger.warning(
                "HTTP connections capped at %d (asked %d): the open files limit is %d; raise it (ulimit -n, LimitNOFILE=) "
                "to serve more", n, requested, soft,
            )
        return n

    def release(self, n: int) -> None:
        """Give back a cap from :meth:`grant` (its server stopped)."""
        with self._lock:
            self.granted = max(0, self.granted - n)


CONNECTION_BUDGET = ConnectionBudget()
"""The process's budget (the descriptor limit is per process)."""
