"""The coordinator-signed ban list (``ban_list/1``), persisted and versioned."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from protocol.durable import atomic_write
from protocol.envelope import Authorities, open_envelope, seal
from protocol.errors import ProtocolError, SchemaError
from protocol.identity import NodeKey, PeerId
from protocol.messages import BanEntry, BanEvidence, BanList

logger = logging.getLogger(__name__)


class BanBook:
    """Banned peer IDs with reasons; every change bumps the version and re-signs the list.

    The signed list is written to ``path`` atomically so a restarted coordinator keeps its bans.

    Args:
        path: file holding the latest signed ``ban_list/1`` envelope.
        key: the coordinator key (signs the list).
        run_id: the run's 32-byte ID.
    """

    def __init__(self, path: Path, key: NodeKey, run_id: bytes) -> None:
        self.path = Path(path)
        self.key = key
        self.run_id = run_id
        self._lock = threading.Lock()
        self._entries: dict[str, BanEntry] = {}
        self.version = 0
        self.envelope: bytes = b""
        if self.path.exists():
            try:
                env = open_envelope(self.path.read_bytes(), run_id=run_id, expect=BanList, authorities=_self_auth(key))
                self.version = env.body.version
                self._entries = {e.peer_id: e for e in env.body.entries}
                self.envelope = env.raw
            except (OSError, ProtocolError) as e:
                logger.error("ignoring unreadable ban list %s: %s", self.path, e)
        if not self.envelope:
            self._publish()

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self._entries

    def ban(self, peer_id: str, reason: str, verdict_id: bytes = b"", *, submission_id: bytes = b"",
            evidence: list[BanEvidence] | None = None) -> bool:
        """Ban ``peer_id``; returns ``False`` if it already was.

        Args:
            peer_id: the worker.
            reason: the cheat reason of the deciding verdict.
            verdict_id: content ID of the deciding verdict envelope.
            submission_id: content ID of the submission both checks judged.
            evidence: the two agreeing checks (deciding verdict, then the re-check).
        """
        with self._lock:
            if peer_id in self._entries:
                return False
            self._entries[peer_id] = BanEntry(peer_id=PeerId(peer_id), reason=reason[:64], since_ms=int(time.time() * 1000), verdict_id=verdict_id,
                                              submission_id=submission_id, evidence=list(evidence or [])[:2])
            self._publish()
        logger.warning("banned %s (%s)", peer_id, reason, extra={"peer_id": peer_id})
        return True

    def entries(self) -> list[BanEntry]:
        return list(self._entries.values())

    def _publish(self) -> None:
        self.version += 1
        self.envelope = self._seal_fitting()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # atomic, not flushed (as before): the list is re-signed and rewritten on every ban, by the
        # thousand under attack
        atomic_write(self.path, self.envelope, durable=False)


    def _seal_fitting(self) -> bytes:
        """Seal the list; when it would exceed ``ban_list/1``'s size, the oldest entries lose their
        evidence (still in the ingest's verdict table) until it fits; past the entry limit the
        newest bans stay only in memory (still refused at the ingest) and an error is logged."""
        entries = sorted(self._entries.values(), key=lambda e: e.since_ms)
        if len(entries) > MAX_ENTRIES:
            logger.error("ban list holds %d entries, over the %d a signed list may carry: the newest are enforced but not published",
                         len(entries), MAX_ENTRIES)
            entries = entries[:MAX_ENTRIES]
        stripped = 0
        while True:
            try:
                return seal(self.key, self.run_id, BanList(version=self.version, entries=sorted(entries, key=lambda e: e.peer_id)))
            except SchemaError:
                if stripped >= len(entries):
                    raise
                step = max(1, len(entries) // 8)
                for i in range(stripped, min(len(entries), stripped + step)):
                    entries[i] = entries[i].model_copy(update={"evidence": []})
                stripped += step


MAX_ENTRIES = 1 << 14
"""Most entries of a signed ban list (``protocol.messages.BanList``)."""


def _self_auth(key: NodeKey) -> Authorities:
    return Authorities(coordinator=key.public_key, validators=frozenset())
