"""The worker's spool: every signed submission is on disk before it is sent.

Files are ``<counter:012d>-<id>.sub`` written atomically and durably
(:func:`protocol.durable.atomic_write`). A file leaves the spool only when the ingest acknowledged
it, or refused it for good (stale, malformed). After a crash the worker re-sends the spool in
counter order, and resumes its counter past the highest counter ever spooled (kept in ``counter``
so a reused counter is never signed twice).
"""

from __future__ import annotations

import logging
from pathlib import Path

from protocol.content import content_id
from protocol.durable import atomic_write

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

