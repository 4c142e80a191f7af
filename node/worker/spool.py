"""The worker's spool: every signed submission is on disk before it is sent.

Files are ``<counter:012d>-<id>.sub`` written atomically and durably
(:func:`protocol.durable.atomic_write`). A file leaves the spool only when the ingest acknowledged
it, or refused it for good (stale, malformed). After a crash the worker drops what left the
async window while it was down (:meth:`Spool.drop_stale`, one log line), re-sends the rest in
counter order, and resumes its counter past the highest counter ever spooled (kept in ``counter``
so a reused counter is never signed twice).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from protocol.content import content_id
from protocol.durable import atomic_write
from protocol.envelope import open_envelope
from protocol.errors import ProtocolError
from protocol.messages import Submission

logger = logging.getLogger(__name__)


class Spool:
    """A directory of pending submission envelopes.

    Args:
        root: spool directory (created).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        self._counter_file = self.root / "counter"

    def next_counter(self) -> int:
        """The next unused submission counter, persisted before it is returned (never reused)."""
        try:
            n = int(self._counter_file.read_text().strip() or 0)
        except (OSError, ValueError):
            n = 0
        highest = max((int(p.name.split("-", 1)[0]) + 1 for p in self.pending()), default=0)
        n = max(n, highest)
        atomic_write(self._counter_file, str(n + 1).encode())
        return n

    def put(self, counter: int, envelope: bytes) -> Path:
        """Store ``envelope`` durably; returns its path."""
        path = self.root / f"{counter:012d}-{content_id(envelope).hex()[:16]}.sub"
        atomic_write(path, envelope)
        return path

    def pending(self) -> list[Path]:
        """Spooled submissions, oldest counter first."""
        return sorted(self.root.glob("*.sub"))

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)


    def policy_step(self, path: Path, run_id: bytes) -> int | None:
        """The policy step of the spooled submission at ``path``; ``None`` when it cannot be read or opened."""
        try:
            env = open_envelope(path.read_bytes(), run_id=run_id, expect=Submission)
        except (OSError, ProtocolError) as e:
            logger.debug("spooled %s is unreadable: %s", path.name, e)
            return None
        return int(env.body.policy_step)

    def drop_stale(self, run_id: bytes, fresh: Callable[[int], bool]) -> tuple[list[int], list[int]]:
        """Remove spooled submissions whose policy step is not ``fresh`` (or that cannot be opened).

        Args:
            run_id: the run's ID (spooled envelopes are opened and checked against it).
            fresh: whether a policy step is still inside the async window (``protocol.window.in_window``).

        Returns:
            ``(kept, dropped)``: the policy steps of the submissions kept and of those removed
            (``-1`` for an unreadable file), in counter order.
        """
        kept: list[int] = []
        dropped: list[int] = []
        for path in self.pending():
            step = self.policy_step(path, run_id)
            if step is not None and fresh(step):
                kept.append(step)
            else:
                dropped.append(-1 if step is None else step)
                self.remove(path)
        return kept, dropped
