"""Posts spooled submissions to the coordinator's ingest (through the one ingest client) with retry and backoff."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from node.ingest_client import IngestClient
from node.retry import Backoff, FailureLog
from node.timeouts import INGEST_REQUEST_TIMEOUT_S
from node.worker.spool import Spool
from protocol.ingest_api import TRANSIENT_RETRIES

FAILURE_LOG_INTERVAL_S = 30.0
"""A repeated delivery failure is logged at most once per this many seconds."""

logger = logging.getLogger(__name__)


@dataclass
class SubmitOutcome:
    """What happened to one spooled submission.

    Attributes:
        path: the spool file.
        status: HTTP status, or 0 when no ingest answered.
        final: ``True`` if the file left the spool (acknowledged, or refused for good).
        detail: the ingest's answer or the connection error.
        code: the ingest's error code (``protocol.ingest_api.ERROR_CODES``), ``""`` when none.
        retry_after_s: the ingest's ``Retry-After``, seconds, or ``None``.
    """

    path: Path
    status: int
    final: bool
    detail: str
    code: str = ""
    retry_after_s: float | None = None


class Submitter:
    """Sends the spool to the first ingest URL that answers, through :class:`node.ingest_client.IngestClient`.

    What each answer means is :func:`protocol.ingest_api.disposition`'s: acknowledged (200) and
    *final* refusals (malformed, banned, stale, replay, too large, …) leave the spool and are never
    retried; *retry* answers (429, 507, 5xx) and connection errors keep the file and are retried with
    exponential backoff (``base_backoff_s`` doubling up to ``max_backoff_s``, with jitter), never
    sooner than the ingest's ``Retry-After``; a *transient* one (408, a body cut short) is retried
    at most :data:`protocol.ingest_api.TRANSIENT_RETRIES` times, then dropped.

    Args:
        spool: the spool.
        ingest_urls: base URLs of the coordinator's ingest (``http://host:port``).
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, spool: Spool, ingest_urls: list[str], *, timeout_s: float = INGEST_REQUEST_TIMEOUT_S, base_backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0) -> None:
        self.spool = spool
        self.ingest = IngestClient(ingest_urls, timeout_s=timeout_s)
        self.ingest_urls = self.ingest.urls
        self.timeout_s = timeout_s
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.acked = 0
        self.displaced = 0
        """How many of this worker's submissions the ingest said were displaced, as of its last answer
        (``protocol.ingest_api.SUBMISSIONS_ROUTE``: no verdict, never trained, no penalty)."""
        self.refused: dict[str, int] = {}
        self.banned = False
        self._transient: dict[str, int] = {}  # spool file name → transient failures so far
        self._failures = FailureLog(logger, interval_s=FAILURE_LOG_INTERVAL_S)
        self._deferred = FailureLog(logger, interval_s=FAILURE_LOG_INTERVAL_S, level=logging.INFO)
        self._sleep = asyncio.sleep  # the backoff wait (a test records the delays instead)

    async def close(self) -> None:
        await self.ingest.close()

    async def send_one(self, path: Path) -> SubmitOutcome:
        """Try each ingest URL once for ``path`` (until one accepts it or refuses it for good)."""
        data = await asyncio.to_thread(path.read_bytes)
        a = await self.ingest.post_submission(data)
        if a.ok:
            self._note_displaced(a.json)
            self.acked += 1
            self._transient.pop(path.name, None)
            self.spool.remove(path)
            return SubmitOutcome(path, a.status, True, a.detail)
        transient = a.outcome == "transient" and self._transient.get(path.name, 0) >= TRANSIENT_RETRIES
        if a.outcome == "final" or transient:
            self.refused[a.code] = self.refused.get(a.code, 0) + 1
            self.banned = self.banned or a.code == "banned"
            logger.warning("ingest refused %s for good (%d %s): %s", path.name, a.status, a.code, a.detail[:300])
            self._transient.pop(path.name, None)
            self.spool.remove(path)
            return SubmitOutcome(path, a.status, True, a.detail, a.code, a.retry_after_s)
        if a.outcome == "transient":
            self._transient[path.name] = self._transient.get(path.name, 0) + 1
        detail = f"{a.url}: {a.detail}" if a.status == 0 and a.url else a.detail[:300]
        return SubmitOutcome(path, a.status, False, detail, a.code, a.retry_after_s)

    def _note_displaced(self, answer: object) -> None:
        """Take the ingest's count of this worker's displaced submissions from a 200 answer; say so
        when it rose (an ingest that does not send it leaves the count as it was)."""
        n = answer.get("displaced") if isinstance(answer, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return
        if n > self.displaced:
            logger.warning("the ingest displaced %d more of this worker's submissions (%d now): workers with no accepted "
                           "submission yet hold their whole share of the coordinator's disk and a lighter address allocation or "
                           "prefix took their place; they get no verdict and no penalty, and are not trained on", n - self.displaced, n)
        self.displaced = n

    async def drain(self, deadline_s: float | None = None) -> int:
        """Send everything in the spool, retrying with backoff; returns how many left the spool.

        Args:
            deadline_s: stop retrying after this many seconds (``None``: until empty).
        """
        loop = asyncio.get_running_loop()
        end = None if deadline_s is None else loop.time() + deadline_s
        done = 0
        backoff = Backoff(self.base_backoff_s, self.max_backoff_s)
        while True:
            pending = self.spool.pending()
            if not pending:
                return done
            progress = False
            wait_s = 0.0  # the ingest's Retry-After, if it gave one
            for path in pending:
                out = await self.send_one(path)
                if out.final:
                    done += 1
                    progress = True
                elif out.status == 0:
                    self._failures.failed(f"ingest not reachable ({out.detail[:200]}); {len(pending)} spooled submissions kept for retry")
                    break
                else:  # answered but deferred (backpressure 429, 5xx): normal flow control, quieter
                    self._deferred.failed(f"ingest deferred a submission ({out.status}: {out.detail[:200]}); retrying with backoff")
                    wait_s = out.retry_after_s or 0.0
                    break
            if progress:
                self._failures.recovered("ingest reachable")
                self._deferred.recovered("ingest accepting")
                backoff.reset()
                continue
            delay = max(backoff.next_delay(), wait_s)
            if end is not None and loop.time() + delay > end:
                return done
            await self._sleep(delay)
