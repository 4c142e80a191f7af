"""The coordinator's rollout ingest: durable submission store, HTTP service, bans, rate limits.

* ``store.py`` — :class:`SubmissionStore`: files + SQLite index; an acknowledged submission
  survives a crash; pending/leased/accepted/rejected states; verdicts; consumption by the trainer.
* ``bans.py`` — :class:`BanBook`: the coordinator-signed ban list.
* ``limits.py`` — :class:`RateLimiter`: per-peer token buckets for requests and bytes.
* ``service.py`` — :class:`IngestService`: the aiohttp routes (``/ingest/1/…``, ``/status``, ``/metrics``).
"""

from trainer.ingest.bans import BanBook
from trainer.ingest.limits import RateLimiter
from trainer.ingest.store import StoredSubmission, SubmissionStore

__all__ = ["BanBook", "RateLimiter", "StoredSubmission", "SubmissionStore"]
