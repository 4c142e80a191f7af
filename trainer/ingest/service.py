"""The ingest HTTP service (aiohttp), run by the coordinator's rank 0: the HTTP face of the ledger.

Routes (``docs/protocol.md`` §8):

=========  ==============================  =====================================================
method     path                            what
=========  ==============================  =====================================================
POST       ``/ingest/1/submissions``       a ``submission/1`` envelope; 200 ``{"id", "stored", "displaced"}``
POST       ``/ingest/1/lease``             a validator's ``lease_request/1``; msgpack ``{"submissions", "trainer_step"}``
POST       ``/ingest/1/verdicts``          a ``verdict/1`` envelope from a run validator
GET        ``/ingest/1/submissions/{id}``  a submission's state: JSON ``{"id", "state", "reason"}``
GET        ``/ingest/1/bans``              the coordinator-signed ``ban_list/1`` envelope
GET        ``/ingest/1/workers/{peer}``    the coordinator-signed ``worker_standing/1`` of one worker
GET        ``/status``                     JSON view of the coordinator
GET        ``/metrics``                    Prometheus text
=========  ==============================  =====================================================

Routes, the lease answer's format and the error codes with their HTTP statuses are defined once in
:mod:`protocol.ingest_api` (the client, ``node/ingest_client.py``, reads the same module). Errors
are JSON ``{"error": code, "detail": text}``; 429 and 507 carry ``Retry-After``.

This module only moves bytes and bounds what a client may make it do: per-address request rates,
body bytes counted as they arrive (``body.py``), decode slots, lease-request nonces. What is
admitted, leased, judged, banned and retired is the ledger's (``trainer/ledger/``); the ledger's
retirement of work that left the async window runs on a timer here, never inside a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from protocol.addresses import address_key
from protocol.envelope import Envelope, open_envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import PEER_ID_PATTERN, NodeKey
from protocol.ingest_api import (
    BANS_ROUTE,
    LEASE_CONTENT_TYPE,
    LEASE_ROUTE,
    SUBMISSION_ROUTE,
    SUBMISSIONS_ROUTE,
    VERDICTS_ROUTE,
    WORKER_ROUTE,
    pack_lease_answer,
)
from protocol.messages import LeaseRequest, Submission, Verdict, WorkerStanding
from protocol.ratelimit import FairShare, RateLimiter
from protocol.rollout import submission_decode_limits
from protocol.runspec import RunSpec
from trainer.errors import Refused
from trainer.ingest.body import BodyBudget, BodyError, Ticket, read_body
from trainer.ingest.limits import IngestLimits
from trainer.ingest.status import IngestMetrics, IngestStatus
from trainer.ledger.audit import WorkerAudit
from trainer.ledger.ban_rule import BanRule, Recheck
from trainer.ledger.bans import BanBook
from trainer.ledger.ids import SubmissionId
from trainer.ledger.ledger import SubmissionLedger
from trainer.ledger.prefixes import allocation_key, prefix_key
from trainer.ledger.states import public_state

logger = logging.getLogger(__name__)

_PEER_ID = re.compile(f"^{PEER_ID_PATTERN}$")
RETIRE_EVERY_S = 5.0
"""How often the ledger drops pending or accepted work that fell out of the async window, seconds."""


class IngestService:
    """The ingest's routes over a :class:`~trainer.ledger.ledger.SubmissionLedger`.

    Args:
        ledger: the submission ledger.
        ban_rule: applies verdicts (``trainer/ledger/ban_rule.py``).
        limits: :class:`~trainer.ingest.limits.IngestLimits` (its quotas are the ledger's).
        on_verdict: called with a verdict envelope (verified) after it decided a submission, and
            whether it still needs gossiping (``False`` when it arrived on gossip).
        status_extra: callable adding fields to ``/status``.
        key: the coordinator's key, which signs each worker's standing (``None``: no
            ``/ingest/1/workers/{peer_id}`` route).
    """

    def __init__(self, ledger: SubmissionLedger, ban_rule: BanRule, *, limits: IngestLimits | None = None,
                 on_verdict: Callable[[Envelope[Verdict], bool], None] | None = None, status_extra: Callable[[], dict[str, Any]] | None = None,
                 key: NodeKey | None = None) -> None:
        self.ledger = ledger
        self.key = key
        self.ban_rule = ban_rule
        self.run_id = ledger.run_id
        self.authorities = ledger.spec.authorities
        self._body_limits = submission_decode_limits(ledger.spec)  # no array longer than an honest submission's
        self.limits = limits or IngestLimits()
        self.on_verdict = on_verdict
        self.metrics = IngestMetrics()
        self.registry = self.metrics.registry
        self.view = IngestStatus(ledger, ban_rule, self.metrics, status_extra)
        self.metrics.banned.set(len(ledger.bans.entries()))
        ban_rule.on_recheck = lambda outcome: self.metrics.rechecks.labels(outcome).inc()
        lim = self.limits
        self._ip_limiter = RateLimiter(lim.requests_per_s * 4, lim.burst * 4)
        self._peer_limiter = RateLimiter(lim.requests_per_s, lim.burst)
        self._status_limiter = RateLimiter(lim.status_requests_per_s, lim.status_burst)
        # one rate for them all, shared fairly per allocation, then prefix (trainer/ledger/prefixes.py)
        self._unproven_limiter = FairShare(lim.unproven_requests_per_s, lim.unproven_burst)
        self.budget = BodyBudget(lim.max_body_bytes_in_flight_per_ip, lim.max_body_bytes_in_flight)
        self._decode_all = asyncio.Semaphore(lim.decode_concurrency)
        self._decode_ip: dict[str, tuple[asyncio.Semaphore, int]] = {}  # address → (semaphore, users)
        self._lease_seen: OrderedDict[bytes, float] = OrderedDict()  # lease-request ID → forget after (epoch s)
        self._status_slot = asyncio.Semaphore(1)  # /status and /metrics: one executor thread at most

    def add_routes(self, app: web.Application) -> None:
        """Register the ingest routes on ``app``, and the ledger's retirement timer on its lifetime."""
        app.router.add_post(SUBMISSIONS_ROUTE, self.post_submission)
        app.router.add_get(SUBMISSION_ROUTE, self.get_submission)
        app.router.add_post(LEASE_ROUTE, self.post_lease)
        app.router.add_post(VERDICTS_ROUTE, self.post_verdict)
        app.router.add_get(BANS_ROUTE, self.get_bans)
        if self.key is not None:
            app.router.add_get(WORKER_ROUTE, self.get_worker)
        app.router.add_get("/status", self.get_status)
        app.router.add_get("/metrics", self.get_metrics)
        app.cleanup_ctx.append(self._retirement)

    def close(self) -> None:
        """Stop the ban rule's re-check thread."""
        self.ban_rule.close()

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows (blocking)."""
        return self.view.status()

    async def _retirement(self, app: web.Application) -> AsyncIterator[None]:
        async def every() -> None:
            while True:
                await asyncio.sleep(RETIRE_EVERY_S)
                try:
                    await asyncio.to_thread(self.ledger.expire_stale)
                except Exception:  # retried on the next tick; the ingest keeps serving
                    logger.exception("could not retire stale submissions")

        task = asyncio.create_task(every(), name="ledger-retirement")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # --- submissions ---------------------------------------------------------------------------

    async def post_submission(self, request: web.Request) -> web.Response:
        ip = self._ip_gate(request)
        ticket = self.budget.ticket(ip)
        try:
            if not self.ledger.precheck(ip) and not self._unproven_limiter.allow(path := (allocation_key(ip), prefix_key(ip))):
                # before its body is read
                raise Refused("rate_limited", f"addresses with no accepted submission share a submission rate, and {path[1]} has used "
                              "its part of it; retry later", retry_after_s=self._unproven_limiter.retry_after_s(path))
            env = await self._receive(request, ip, ticket)
            return await self._store(env, ip, len(env.raw))
        except Refused as e:
            self.metrics.submissions.labels("stale" if e.code == "stale_policy" else e.code).inc()
            raise
        finally:
            ticket.close()

    async def _receive(self, request: web.Request, ip: str, ticket: Ticket) -> Envelope[Submission]:
        """Read (counted as it arrives), then decode and verify in a decode slot; evictable until decoding starts."""
        try:
            data = await self._read_body(request, self.limits.max_submission_bytes, ticket)
            async with self._decode_slot(ip):
                ticket.settle()
                try:
                    return await asyncio.to_thread(open_envelope, data, run_id=self.run_id, expect=Submission,
                                                   body_limits=self._body_limits)
                except ProtocolError as e:
                    raise Refused("malformed", str(e)) from None
        except asyncio.CancelledError:
            if not ticket.evicted:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            raise Refused("busy", f"request bytes in flight are over the ingest's limit and {ip} holds the most; retry later",
                          retry_after_s=1.0) from None

    async def _store(self, env: Envelope[Submission], ip: str, size: int) -> web.Response:
        sub = env.body
        if not self._peer_limiter.allow(sub.worker):
            raise Refused("rate_limited", f"worker {sub.worker} is over its rate", retry_after_s=self._peer_limiter.retry_after_s(sub.worker))
        admission = self.ledger.admit(env, ip)  # one step of the event loop: checks and counting
        if admission.durable is None:
            self.metrics.submissions.labels("duplicate").inc()
            return web.json_response({"id": admission.sid, "stored": False, "duplicate": True, "state": admission.state,
                                      "displaced": self.ledger.displaced_now(sub.worker)})
        t0 = time.perf_counter()
        # the answer waits for this submission's group commit: a 200 means it survives a crash
        try:
            stored = await asyncio.wrap_future(admission.durable)
        except (OSError, sqlite3.Error) as e:  # nothing was stored (the store dropped its file): the same bytes may come again
            raise Refused("storage_failed", f"the ingest could not store it ({type(e).__name__}: {str(e)[:120]}); retry later",
                          retry_after_s=5.0) from None
        if not stored:
            self.metrics.submissions.labels("duplicate").inc()
            existing = self.ledger.get(admission.sid)
            return web.json_response({"id": admission.sid, "stored": False, "duplicate": True,
                                      "state": public_state(existing.state) if existing else "pending",
                                      "displaced": self.ledger.displaced_now(sub.worker)})
        self.ledger.stored(admission.sid, sub)  # keeps the verified body for the trainer
        self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.bytes.inc(size)
        self.metrics.submissions.labels("stored").inc()
        logger.info("stored submission %s from %s (step %d, %d rollouts)", admission.sid[:12], sub.worker, sub.policy_step,
                    len(sub.rollouts), extra={"peer_id": sub.worker, "step": sub.policy_step})
        # displaced ones are told here, on the worker's next answer (its client dropped them on their 200)
        return web.json_response({"id": admission.sid, "stored": True, "displaced": self.ledger.displaced_now(sub.worker)})

    async def get_submission(self, request: web.Request) -> web.Response:
        """A submission's state (``protocol.ingest_api.SUBMISSION_ROUTE``): what a worker reads to learn
        that one of its submissions was displaced, judged or expired."""
        self._status_gate(request)
        sid = request.match_info["id"]
        if len(sid) != 64 or any(c not in "0123456789abcdef" for c in sid):
            raise Refused("malformed", "a submission ID is 64 lower-case hex digits")
        row = self.ledger.get(SubmissionId(sid))
        if row is None:
            raise Refused("unknown_submission", f"no submission {sid[:16]}… here")
        return web.json_response({"id": sid, "state": public_state(row.state), "reason": row.reason})

    # --- leases and verdicts -------------------------------------------------------------------

    async def post_lease(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        data = await self._read_body(request, LeaseRequest.MAX_BYTES)
        try:
            env = open_envelope(data, run_id=self.run_id, expect=LeaseRequest, authorities=self.authorities,
                                max_age_s=self.limits.lease_max_age_s)
        except ProtocolError as e:
            raise Refused("not_validator", str(e)) from None
        self._remember_lease(bytes(env.id))
        # leased and read in a thread: the lease's commit waits for an fsync, which must not stall the loop
        blobs = await asyncio.to_thread(self._lease_and_read, env.body.limit, env.body.lease_s)
        return web.Response(body=pack_lease_answer(blobs, self.ledger.trainer_step()), content_type=LEASE_CONTENT_TYPE)

    def _lease_and_read(self, limit: int, lease_s: float) -> list[bytes]:
        """Lease up to ``limit`` submissions; their envelopes (one whose file went meanwhile, retired, is left out)."""
        out = []
        for sid in self.ledger.lease(limit, lease_s):
            try:
                out.append(self.ledger.read(sid))
            except OSError as e:
                logger.debug("leased submission %s unreadable: %s", sid[:12], e)
        return out

    def _remember_lease(self, lease_id: bytes) -> None:
        """Accept each signed lease request once while it is fresh (a captured one cannot lease again)."""
        now = time.time()
        while self._lease_seen:
            first, forget_at = next(iter(self._lease_seen.items()))
            if forget_at > now:
                break
            del self._lease_seen[first]
        if lease_id in self._lease_seen:
            raise Refused("replay", "this lease request was already served; sign a new one")
        if len(self._lease_seen) >= self.limits.lease_nonce_capacity:
            raise Refused("busy", "too many lease requests in the last minute", retry_after_s=1.0)
        # remembered past its validity (plus the allowed clock skew of open_envelope's max_future_s)
        self._lease_seen[lease_id] = now + self.limits.lease_max_age_s + 30.0

    async def post_verdict(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        data = await self._read_body(request, Verdict.MAX_BYTES)
        try:
            env = open_envelope(data, run_id=self.run_id, expect=Verdict, authorities=self.authorities)
        except ProtocolError as e:
            raise Refused("malformed", str(e)) from None
        # verified once, here; applied in a thread: the verdict's commit waits for an fsync
        return web.json_response({"applied": await asyncio.to_thread(self.apply_verdict, env)})

    def apply_verdict(self, verdict: bytes | Envelope[Verdict], *, via_gossip: bool = False) -> bool:
        """Apply a verdict envelope (from HTTP or gossip) under the ban rule (``trainer/ledger/ban_rule.py``).

        Args:
            verdict: the envelope's bytes (verified here), or an envelope this process already
                opened with the run's authorities (HTTP handler, gossip): not verified again.
            via_gossip: it arrived on gossip, so it is not gossiped again (``on_verdict`` gets
                ``gossip=False``).

        Returns:
            Whether it decided a submission's state.

        Raises:
            ProtocolError: the bytes are not a valid verdict of a run validator.
        """
        env = verdict if isinstance(verdict, Envelope) else open_envelope(verdict, run_id=self.run_id, expect=Verdict,
                                                                          authorities=self.authorities)
        applied = self.ban_rule.apply(env)
        if applied:
            self.metrics.verdicts.labels(env.body.reason).inc()
            if self.on_verdict:
                self.on_verdict(env, not via_gossip)
        self.metrics.banned.set(len(self.ledger.bans.entries()))
        return applied

    async def get_bans(self, request: web.Request) -> web.Response:
        return web.Response(body=self.ledger.bans.envelope, content_type="application/msgpack")

    async def get_worker(self, request: web.Request) -> web.Response:
        """One worker's standing, signed (``protocol.ingest_api.WORKER_ROUTE``): what ``intellect-node status`` shows a contributor."""
        self._status_gate(request)
        peer = request.match_info["peer_id"]
        if not _PEER_ID.match(peer):
            raise Refused("malformed", "not a peer ID (12D3KooW… and 44 base58 characters)")
        async with self._status_slot:
            doc = await asyncio.to_thread(self.ledger.worker_standing, peer)
        assert self.key is not None
        body = WorkerStanding(worker=peer, trainer_step=max(0, self.ledger.trainer_step()), **doc)
        return web.Response(body=seal(self.key, self.run_id, body), content_type="application/msgpack")

    # --- status --------------------------------------------------------------------------------

    async def get_status(self, request: web.Request) -> web.Response:
        self._status_gate(request)
        # One thread at a time: concurrent requests wait here, not in the default executor, which
        # the submission path decodes in (a burst of /status must not queue submissions).
        async with self._status_slot:
            body = await asyncio.to_thread(self.view.status_body)
        return web.Response(body=body, content_type="application/json")

    async def get_metrics(self, request: web.Request) -> web.Response:
        self._status_gate(request)
        async with self._status_slot:
            history = await asyncio.to_thread(self.view.history_stats)
        self.metrics.pending.set(history["submissions"]["pending"])
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # --- bounds --------------------------------------------------------------------------------

    def _ip_gate(self, request: web.Request) -> str:
        """The request's address key, after its request rate (4 × a worker's) is checked."""
        ip = address_key(request.remote or "?")
        if not self._ip_limiter.allow(ip):
            raise Refused("rate_limited", "too many requests from this address", retry_after_s=self._ip_limiter.retry_after_s(ip))
        return ip

    def _status_gate(self, request: web.Request) -> None:
        ip = address_key(request.remote or "?")
        if not self._status_limiter.allow(ip):
            raise Refused("rate_limited", "too many status requests from this address",
                          retry_after_s=self._status_limiter.retry_after_s(ip))

    async def _read_body(self, request: web.Request, limit: int, ticket: Ticket | None = None) -> bytes:
        enc = request.headers.get("Content-Encoding", "identity").strip().lower()
        if enc not in ("", "identity"):  # nothing is inflated here: a small body stays small
            raise Refused("unsupported_encoding", f"Content-Encoding {enc[:32]!r} refused: send identity bodies")
        lim = self.limits
        try:
            return await read_body(request, limit, lim.decode_timeout_s, ticket=ticket, min_rate_bytes_per_s=lim.min_body_rate_bytes_per_s,
                                   grace_s=lim.body_grace_s)
        except BodyError as e:
            raise Refused(e.code, e.detail) from None

    @contextlib.asynccontextmanager
    async def _decode_slot(self, ip: str) -> AsyncIterator[None]:
        """At most ``decode_concurrency_per_ip`` decodes per address and ``decode_concurrency`` in all."""
        sem, users = self._decode_ip.get(ip) or (asyncio.Semaphore(self.limits.decode_concurrency_per_ip), 0)
        self._decode_ip[ip] = (sem, users + 1)
        try:
            async with sem, self._decode_all:
                yield
        finally:
            sem, users = self._decode_ip[ip]
            if users <= 1:
                del self._decode_ip[ip]
            else:
                self._decode_ip[ip] = (sem, users - 1)


def open_ingest(data_dir: Path, spec: RunSpec, key: NodeKey, *, trainer_step: Callable[[], int], latest_policy_step: Callable[[], int],
                limits: IngestLimits | None = None, recheck: Recheck | None = None, on_ban: Callable[[bytes], None] | None = None,
                on_verdict: Callable[[Envelope[Verdict], bool], None] | None = None,
                status_extra: Callable[[], dict[str, Any]] | None = None) -> IngestService:
    """The coordinator's ingest over its ledger under ``data_dir`` (``ingest/``: files and index;
    ``bans.msgpack``: the signed ban list), wired the one way every coordinator, test and
    benchmark uses. Close with ``service.close()`` then ``service.ledger.close()``.

    Args:
        data_dir: the coordinator's data directory.
        spec: the run spec; key: the coordinator's key (signs the ban list).
        trainer_step, latest_policy_step: the window's inputs (:class:`~trainer.ledger.ledger.SubmissionLedger`).
        limits: :class:`~trainer.ingest.limits.IngestLimits` (its quotas go to the ledger).
        recheck, on_ban: the ban rule's (:class:`~trainer.ledger.ban_rule.BanRule`).
        on_verdict, status_extra: the service's (:class:`IngestService`).
    """
    limits = limits or IngestLimits()
    bans = BanBook(Path(data_dir) / "bans.msgpack", key, spec.run_id)
    ledger = SubmissionLedger(Path(data_dir) / "ingest", spec, bans, trainer_step=trainer_step, latest_policy_step=latest_policy_step,
                              quotas=limits.quotas)
    audit = WorkerAudit(spec.audit, Path(data_dir) / "ingest" / "audit.sqlite", chunk_size=spec.toploc.chunk_size)
    rule = BanRule(ledger, recheck=recheck, max_pending_rechecks=limits.max_pending_rechecks, on_ban=on_ban, audit=audit)
    return IngestService(ledger, rule, limits=limits, on_verdict=on_verdict, status_extra=status_extra, key=key)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Turn :class:`~trainer.errors.Refused` into ``{"error", "detail"}`` JSON responses (add to the app's middlewares)."""
    try:
        return await handler(request)
    except Refused as e:
        headers = {"Retry-After": str(max(1, int(e.retry_after_s + 0.999)))} if e.retry_after_s else None
        return web.json_response({"error": e.code, "detail": e.detail}, status=e.status, headers=headers)
