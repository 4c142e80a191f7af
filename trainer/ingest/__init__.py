"""The coordinator's ingest: the HTTP face of the submission ledger (``trainer/ledger/``).

* ``service.py`` — :class:`IngestService`: the aiohttp routes (``/ingest/1/…``, ``/status``, ``/metrics``).
* ``limits.py`` — :class:`RateLimiter`: per-peer token buckets for requests and bytes.
"""

from trainer.ingest.limits import RateLimiter

__all__ = ["RateLimiter"]
