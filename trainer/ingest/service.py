"""The ingest HTTP service (aiohttp), run by the coordinator's rank 0.

Routes (``docs/protocol.md`` §8):

=========  ==============================  =====================================================
method     path                            what
=========  ==============================  =====================================================
POST       ``/ingest/1/submissions``       a ``submission/1`` envelope; 200 ``{"id", "stored"}``
POST       ``/ingest/1/lease``             a validator's ``lease_request/1``; msgpack ``{"submissions": [bin…]}``
POST       ``/ingest/1/verdicts``          a ``verdict/1`` envelope from a run validator
GET        ``/ingest/1/bans``              the coordinator-signed ``ban_list/1`` envelope
GET        ``/status``                     JSON view of the coordinator
GET        ``/metrics``                    Prometheus text
=========  ==============================  =====================================================

Errors are JSON ``{"error": code, "detail": text}`` with 400 (malformed), 403 (banned or not a
validator), 409 (stale policy), 413 (too large), 429 (rate limited, with
``Retry-After``), 507 (the worker's pending quota is full).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from protocol import encoding
from protocol.envelope import open_envelope
from protocol.errors import ProtocolError
from protocol.messages import LeaseRequest, Submission, Verdict
from protocol.runspec import RunSpec
from protocol.verdicts import is_cheat
from trainer.ingest.bans import BanBook
from trainer.ingest.limits import RateLimiter
from trainer.ingest.store import SubmissionStore

logger = logging.getLogger(__name__)

PREFIX = "/ingest/1"


@dataclass
class IngestLimits:
    """Bounds that keep one peer from exhausting the coordinator.

    Attributes:
        max_submission_bytes: largest accepted submission envelope, bytes.
        requests_per_s: sustained submissions per second per peer (and per IP before decoding).
        burst: bucket size, requests.
        max_pending_bytes_per_worker: a worker's unjudged submissions may not exceed this, bytes.
        max_pending_per_worker: nor this many submissions: backpressure, so workers generate no
            faster than validators judge (their excess would only turn stale).
        decode_timeout_s: time allowed to read and decode one request body, seconds.
    """

    max_submission_bytes: int = Submission.MAX_BYTES
    requests_per_s: float = 5.0
    burst: float = 50.0
    max_pending_bytes_per_worker: int = 256 << 20
    max_pending_per_worker: int = 4
    decode_timeout_s: float = 30.0


class IngestService:
    """Accepts submissions and verdicts; serves validators; keeps the ban list.

    Args:
        spec: the run spec (run ID, async level, validators).
        store: durable submission store.
        bans: the ban book.
        trainer_step: callable returning the trainer's current step (for the staleness window).
        latest_policy_step: callable returning the newest published policy step.
        on_verdict: called with verdict envelope bytes after one is applied (to gossip it).
        on_ban: called with the new ban-list envelope bytes after a ban (to gossip it).
        status_extra: callable adding fields to ``/status``.
        limits: :class:`IngestLimits`.
    """

    def __init__(
        self,
        spec: RunSpec,
        store: SubmissionStore,
        bans: BanBook,
        *,
        trainer_step: Callable[[], int],
        latest_policy_step: Callable[[], int],
        on_verdict: Callable[[bytes], None] | None = None,
        on_ban: Callable[[bytes], None] | None = None,
        status_extra: Callable[[], dict[str, Any]] | None = None,
        limits: IngestLimits | None = None,
    ) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self.authorities = spec.authorities
        self.store = store
        self.bans = bans
        self.trainer_step = trainer_step
        self.latest_policy_step = latest_policy_step
        self.on_verdict = on_verdict
        self.on_ban = on_ban
        self.status_extra = status_extra
        self.limits = limits or IngestLimits()
        self._ip_limiter = RateLimiter(self.limits.requests_per_s * 4, self.limits.burst * 4)
        self._peer_limiter = RateLimiter(self.limits.requests_per_s, self.limits.burst)
        self.started_s = time.time()
        self.registry = CollectorRegistry()
        self.m_submissions = Counter("intellect_ingest_submissions", "Submissions received, by outcome", ["outcome"], registry=self.registry)
        self.m_verdicts = Counter("intellect_ingest_verdicts", "Verdicts applied, by reason", ["reason"], registry=self.registry)
        self.m_bytes = Counter("intellect_ingest_bytes", "Submission bytes stored", registry=self.registry)
        self.m_pending = Gauge("intellect_ingest_pending", "Submissions waiting for a verdict", registry=self.registry)
        self.m_banned = Gauge("intellect_banned_peers", "Peers on the ban list", registry=self.registry)
        self.m_latency = Histogram("intellect_ingest_store_seconds", "Time to store a submission durably", registry=self.registry)

    def add_routes(self, app: web.Application) -> None:
        """Register the ingest routes on ``app``."""
        app.router.add_post(f"{PREFIX}/submissions", self.post_submission)
        app.router.add_post(f"{PREFIX}/lease", self.post_lease)
        app.router.add_post(f"{PREFIX}/verdicts", self.post_verdict)
        app.router.add_get(f"{PREFIX}/bans", self.get_bans)
        app.router.add_get("/status", self.get_status)
        app.router.add_get("/metrics", self.get_metrics)

    # --- handlers ----------------------------------------------------------------------------

    async def _read_body(self, request: web.Request, limit: int) -> bytes:
        if request.content_length is not None and request.content_length > limit:
            raise _error(413, "too_large", f"body of {request.content_length} bytes exceeds {limit} bytes")
        try:
            async with asyncio.timeout(self.limits.decode_timeout_s):
                body = await request.content.read(limit + 1)
        except TimeoutError:
            raise _error(408, "timeout", f"body not received within {self.limits.decode_timeout_s} s") from None
        if len(body) > limit:
            raise _error(413, "too_large", f"body exceeds {limit} bytes")
        return body

    def _ip_gate(self, request: web.Request) -> None:
        ip = request.remote or "?"
        if not self._ip_limiter.allow(ip):
            raise _error(429, "rate_limited", "too many requests from this address", retry_after=self._ip_limiter.retry_after_s(ip))

    async def post_submission(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        data = await self._read_body(request, self.limits.max_submission_bytes)
        try:
            env = await asyncio.to_thread(open_envelope, data, run_id=self.run_id, expect=Submission)
        except ProtocolError as e:
            self.m_submissions.labels("malformed").inc()
            raise _error(400, "malformed", str(e)) from None
        sub = env.body
        if not self._peer_limiter.allow(sub.worker):
            self.m_submissions.labels("rate_limited").inc()
            raise _error(429, "rate_limited", f"worker {sub.worker} is over its rate", retry_after=self._peer_limiter.retry_after_s(sub.worker))
        if self.bans.is_banned(sub.worker):
            self.m_submissions.labels("banned").inc()
            raise _error(403, "banned", f"worker {sub.worker} is banned")
        lo = self.trainer_step() - self.spec.rl.async_level
        hi = self.latest_policy_step()
        if not lo <= sub.policy_step <= hi:
            self.m_submissions.labels("stale").inc()
            raise _error(409, "stale_policy", f"policy step {sub.policy_step} outside the window [{lo}, {hi}]")
        sid = env.id.hex()
        existing = self.store.get(sid)
        if existing is not None:
            self.m_submissions.labels("duplicate").inc()
            return web.json_response({"id": sid, "stored": False, "duplicate": True, "state": existing.state})
        if self.store.pending_count(sub.worker) >= self.limits.max_pending_per_worker:
            self.m_submissions.labels("backpressure").inc()
            raise _error(429, "backpressure", f"worker {sub.worker} has {self.limits.max_pending_per_worker} submissions awaiting verdicts; retry later",
                         retry_after=1.0)
        if self.store.pending_bytes(sub.worker) + len(data) > self.limits.max_pending_bytes_per_worker:
            self.m_submissions.labels("quota").inc()
            raise _error(507, "quota", f"worker {sub.worker} has too many unjudged bytes; retry later", retry_after=10.0)
        t0 = time.perf_counter()
        await asyncio.to_thread(self.store.add, env)
        self.m_latency.observe(time.perf_counter() - t0)
        self.m_bytes.inc(len(data))
        self.m_submissions.labels("stored").inc()
        logger.info("stored submission %s from %s (step %d, %d rollouts)", sid[:12], sub.worker, sub.policy_step, len(sub.rollouts),
                    extra={"peer_id": sub.worker, "step": sub.policy_step})
        return web.json_response({"id": sid, "stored": True})

    async def post_lease(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        data = await self._read_body(request, LeaseRequest.MAX_BYTES)
        try:
            env = open_envelope(data, run_id=self.run_id, expect=LeaseRequest, authorities=self.authorities, max_age_s=60.0)
        except ProtocolError as e:
            raise _error(403, "not_validator", str(e)) from None
        ids = self.store.lease_pending(env.body.limit, env.body.lease_s)
        blobs = [await asyncio.to_thread(self.store.read, i) for i in ids]
        return web.Response(body=encoding.packb({"submissions": blobs}), content_type="application/msgpack")

    async def post_verdict(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        data = await self._read_body(request, Verdict.MAX_BYTES)
        try:
            env = open_envelope(data, run_id=self.run_id, expect=Verdict, authorities=self.authorities)
        except ProtocolError as e:
            raise _error(400, "malformed", str(e)) from None
        applied = self.apply_verdict(env.raw)
        return web.json_response({"applied": applied})

    def apply_verdict(self, data: bytes) -> bool:
        """Apply a verified-or-not verdict envelope (from HTTP or gossip); bans on cheat evidence.

        Returns:
            Whether it decided a submission's state.
        """
        env = open_envelope(data, run_id=self.run_id, expect=Verdict, authorities=self.authorities)
        v = env.body
        sid = v.submission_id.hex()
        stored = self.store.get(sid)
        if stored is None or stored.worker != v.worker:
            return False
        applied = self.store.record_verdict(env.id.hex(), sid, env.peer_id, v.accepted, v.reason)
        if applied:
            self.m_verdicts.labels(v.reason).inc()
            if self.on_verdict:
                self.on_verdict(env.raw)
        if not v.accepted and is_cheat(v.reason) and self.bans.ban(v.worker, v.reason, env.id):
            self.store.reject_worker_pending(v.worker, "banned")
            self.m_banned.set(len(self.bans.entries()))
            if self.on_ban:
                self.on_ban(self.bans.envelope)
        return applied

    async def get_bans(self, request: web.Request) -> web.Response:
        return web.Response(body=self.bans.envelope, content_type="application/msgpack")

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows."""
        counts = self.store.counts()
        self.m_pending.set(counts["pending"])
        out: dict[str, Any] = {
            "run_id": self.run_id.hex(),
            "trainer_step": self.trainer_step(),
            "latest_policy_step": self.latest_policy_step(),
            "async_level": self.spec.rl.async_level,
            "submissions": counts,
            "verdicts_by_reason": self.store.verdict_reasons(),
            "banned": [{"peer_id": e.peer_id, "reason": e.reason} for e in self.bans.entries()],
            "workers": self.store.worker_stats(),
            "uptime_s": round(time.time() - self.started_s, 1),
        }
        if self.status_extra:
            out.update(self.status_extra())
        return out

    async def get_status(self, request: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(self.status), dumps=lambda o: json.dumps(o, default=str))

    async def get_metrics(self, request: web.Request) -> web.Response:
        self.m_pending.set(self.store.counts()["pending"])
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class Rejected(Exception):
    """A request refused with an HTTP status, an error code and a human-readable detail."""

    def __init__(self, status: int, code: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.retry_after = status, code, detail, retry_after


def _error(status: int, code: str, detail: str, retry_after: float | None = None) -> Rejected:
    return Rejected(status, code, detail, retry_after)


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Turn :class:`Rejected` into ``{"error", "detail"}`` JSON responses (add to the app's middlewares)."""
    try:
        return await handler(request)
    except Rejected as e:
        headers = {"Retry-After": str(max(1, int(e.retry_after + 0.999)))} if e.retry_after else None
        return web.json_response({"error": e.code, "detail": e.detail}, status=e.status, headers=headers)
