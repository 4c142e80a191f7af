"""The ingest's bounds (:class:`IngestLimits`); its per-peer token buckets are :class:`protocol.ratelimit.RateLimiter`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from protocol.messages import Submission
from trainer.ledger.ban_rule import MAX_PENDING_RECHECKS
from trainer.ledger.ledger import Quotas


@dataclass
class IngestLimits:
    """Bounds that keep one peer, one address or many free identities from exhausting the coordinator.

    The admission quotas are the ledger's (:class:`~trainer.ledger.ledger.Quotas`, built by
    :attr:`quotas`); the rest bound the HTTP side.

    Attributes:
        max_submission_bytes: largest accepted submission envelope, bytes.
        requests_per_s: sustained submissions per second per peer (and ×4 per address before decoding).
        burst: bucket size, requests.
        max_pending_bytes_per_worker, max_pending_per_worker, max_pending_bytes_per_ip,
        max_pending_per_ip, max_disk_bytes, max_disk_files, min_free_disk_bytes, probation_share:
            the ledger's :class:`~trainer.ledger.ledger.Quotas` (an address at its
            ``max_pending_per_ip`` is refused before its body is read).
        decode_timeout_s: time allowed to receive one request body, seconds.
        min_body_rate_bytes_per_s: after ``body_grace_s``, a body must have arrived at least this
            fast on average, or it is cut off (408): a slow sender cannot hold what it sent for
            the whole ``decode_timeout_s``, bytes per second.
        body_grace_s: seconds before the rate floor applies (connection set-up, TCP slow start).
        decode_concurrency_per_ip: envelopes from one address decoded at once (more wait).
        decode_concurrency: envelopes decoded at once in all.
        max_body_bytes_in_flight_per_ip: submission bytes received but not yet stored for one
            address, counted as they arrive (``trainer/ingest/body.py``), bytes.
        max_body_bytes_in_flight: the same in all; when full, a body from an address holding
            less than the heaviest address takes the place of that address's largest unfinished
            body (it gets 429 ``busy``), bytes.
        lease_max_age_s: a ``lease_request/1`` older than this is refused, seconds; within it each
            one is accepted once (its ID is remembered that long).
        lease_nonce_capacity: lease-request IDs remembered; when full of unexpired IDs new lease
            requests are refused with 429 until some expire.
        max_pending_rechecks: workers with a cheat verdict waiting for the coordinator's re-check
            (``trainer/ledger/ban_rule.py``).
        unproven_requests_per_s: submissions per second from all addresses none of whose
            submissions was ever accepted, together (checked before the body is read): a flood
            from many new addresses costs the ingest at most this much decoding and storing,
            whatever the number of addresses; addresses with accepted work have only their own
            per-address rate. Shared fairly (``protocol.ratelimit.FairShare``): evenly among the
            address allocations asking in the last 10 s, then among the prefixes of each
            (``trainer/ledger/prefixes.py``), so one flooder cannot starve other newcomers.
        unproven_burst: the capacity shared the same way, requests.
        status_requests_per_s: ``/status`` and ``/metrics`` requests per second per address.
        status_burst: their bucket size, requests.
    """

    max_submission_bytes: int = Submission.MAX_BYTES
    requests_per_s: float = 5.0
    burst: float = 50.0
    max_pending_bytes_per_worker: int = Quotas.max_pending_bytes_per_worker
    max_pending_per_worker: int = Quotas.max_pending_per_worker
    max_pending_bytes_per_ip: int = Quotas.max_pending_bytes_per_ip
    max_pending_per_ip: int = Quotas.max_pending_per_ip
    max_disk_bytes: int = Quotas.max_disk_bytes
    max_disk_files: int = Quotas.max_disk_files
    min_free_disk_bytes: int = Quotas.min_free_disk_bytes
    probation_share: float = Quotas.probation_share
    decode_timeout_s: float = 30.0
    min_body_rate_bytes_per_s: float = 256 << 10
    body_grace_s: float = 5.0
    decode_concurrency_per_ip: int = 2
    decode_concurrency: int = 4
    max_body_bytes_in_flight_per_ip: int = 96 << 20
    max_body_bytes_in_flight: int = 512 << 20
    lease_max_age_s: float = 60.0
    lease_nonce_capacity: int = 4096
    max_pending_rechecks: int = MAX_PENDING_RECHECKS
    unproven_requests_per_s: float = 20.0
    unproven_burst: float = 60.0
    status_requests_per_s: float = 5.0
    status_burst: float = 30.0

    @property
    def quotas(self) -> Quotas:
        """The ledger's admission quotas (the fields of the same names)."""
        return Quotas(**{f.name: getattr(self, f.name) for f in fields(Quotas)})
