"""Posts spooled submissions to the coordinator's ingest with retry and backoff."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from node.retry import Backoff, FailureLog
from node.worker.spool import Spool

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
    """

    path: Path
    status: int
    final: bool
    detail: str


class Submitter:
    """Sends the spool to the first ingest URL that answers.

    Acknowledged (200) and permanently refused (400 malformed, 403 banned, 409 stale) submissions
    leave the spool; refusals that may pass later (408, 429, 5xx, 507, connection errors) stay
    and are retried with exponential backoff (``base_backoff_s`` doubling up to ``max_backoff_s``, with jitter).

    Args:
        spool: the spool.
        ingest_urls: base URLs of the coordinator's ingest (``http://host:port``).
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, spool: Spool, ingest_urls: list[str], *, timeout_s: float = 60.0, base_backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        self.spool = spool
        self.ingest_urls = [u.rstrip("/") for u in ingest_urls]
        self.timeout_s = timeout_s
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.acked = 0
        self.refused: dict[str, int] = {}
        self.banned = False
        self._session: aiohttp.ClientSession | None = None
        self._failures = FailureLog(logger, interval_s=FAILURE_LOG_INTERVAL_S)
        self._deferred = FailureLog(logger, interval_s=FAILURE_LOG_INTERVAL_S, level=logging.INFO)
        self._sleep = asyncio.sleep  # the backoff wait (a test records the delays instead)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def send_one(self, path: Path) -> SubmitOutcome:
        """Try each ingest URL once for ``path``."""
        data = await asyncio.to_thread(path.read_bytes)
        last = SubmitOutcome(path, 0, False, "no ingest URL")
        for url in self.ingest_urls:
            try:
                async with self._http().post(f"{url}/ingest/1/submissions", data=data, headers={"Content-Type": "application/octet-stream"}) as r:
                    text = await r.text()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError) as e:
                last = SubmitOutcome(path, 0, False, f"{url}: {type(e).__name__}: {e}")
                continue
            if status == 200:
                self.acked += 1
                self.spool.remove(path)
                return SubmitOutcome(path, status, True, text)
            if status in (400, 403, 409):
                code = {400: "malformed", 403: "banned", 409: "stale"}[status]
                self.refused[code] = self.refused.get(code, 0) + 1
                self.banned = self.banned or status == 403
                logger.warning("ingest refused %s for good (%d): %s", path.name, status, text[:300])
                self.spool.remove(path)
                return SubmitOutcome(path, status, True, text)
            last = SubmitOutcome(path, status, False, text[:300])
        return last

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
                    break
            if progress:
                self._failures.recovered("ingest reachable")
                self._deferred.recovered("ingest accepting")
                backoff.reset()
                continue
            delay = backoff.next_delay()
            if end is not None and loop.time() + delay > end:
                return done
            await self._sleep(delay)
