"""The coordinator's ingest: the HTTP face of the submission ledger (``trainer/ledger/``).

* ``service.py`` — :class:`IngestService`: the aiohttp routes (``/ingest/1/…``, ``/status``, ``/metrics``).
* ``limits.py`` — :class:`IngestLimits`: the bounds of the HTTP side and the ledger's quotas;
  per-peer token buckets are :class:`protocol.ratelimit.RateLimiter`.
"""
