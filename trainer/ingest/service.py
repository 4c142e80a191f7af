"""The ingest HTTP service (aiohttp), run by the coordinator's rank 0.

Routes (``docs/protocol.md`` §8):

=========  ==============================  =====================================================
method     path                            what
=========  ==============================  =====================================================
POST       ``/ingest/1/submissions``       a ``submission/1`` envelope; 200 ``{"id", "stored"}``
POST       ``/ingest/1/lease``             a validator's ``lease_request/1``; msgpack ``{"submissions", "trainer_step"}``
POST       ``/ingest/1/verdicts``          a ``verdict/1`` envelope from a run validator
GET        ``/ingest/1/bans``              the coordinator-signed ``ban_list/1`` envelope
GET        ``/status``                     JSON view of the coordinator
GET        ``/metrics``                    Prometheus text
=========  ==============================  =====================================================

Routes, the lease answer's format and the error codes with their HTTP statuses are defined once in
:mod:`protocol.ingest_api` (the client, ``node/ingest_client.py``, reads the same module). Errors
are JSON ``{"error": code, "detail": text}``; 429 and 507 carry ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from protocol.addresses import address_key
from protocol.envelope import Envelope, open_envelope
from protocol.errors import ProtocolError
from protocol.identity import PeerId
from protocol.ingest_api import (
    BANS_ROUTE,
    ERROR_CODES,
    LEASE_CONTENT_TYPE,
    LEASE_ROUTE,
    SUBMISSIONS_ROUTE,
    VERDICTS_ROUTE,
    pack_lease_answer,
)
from protocol.messages import BanEvidence, LeaseRequest, Submission, Verdict
from protocol.rollout import submission_decode_limits
from protocol.runspec import RunSpec
from protocol.verdicts import is_cheat
from protocol.window import in_window, oldest_fresh_step
from trainer.ingest.limits import RateLimiter
from trainer.ledger.bans import BanBook
from trainer.ledger.store import DecidingVerdict, SubmissionStore

logger = logging.getLogger(__name__)

RETIRE_EVERY_S = 5.0
"""How often the ingest drops pending or accepted work that fell out of the async window, seconds."""
STATUS_DUTY_FACTOR = 20
"""``/status``'s whole-history counts are rebuilt at most 1/20 of the time: ``/status`` is public
(workers reach the ingest) and each rebuild scans every submission of the run."""
STATUS_CACHE_MIN_S = 0.005
"""A rebuild faster than this (seconds) is not cached: small stores answer exactly."""

Recheck = Callable[[bytes], "RecheckResult"]
"""Re-runs every check of a submission envelope independently of the validator that judged it."""


@dataclass(frozen=True)
class RecheckResult:
    """What an independent re-check of a submission found.

    Attributes:
        accepted: whether every check passed.
        reason: ``"ok"`` or the first failing check's reason code (``protocol.verdicts``).
        detail: a short summary of the evidence (which rollout, the numbers), ≤ 200 characters.
        by: peer ID of whoever re-checked (the coordinator; empty when the re-check itself failed).
    """

    accepted: bool
    reason: str
    detail: str
    by: PeerId


@dataclass
class IngestLimits:
    """Bounds that keep one peer, one address or many free identities from exhausting the coordinator.

    Attributes:
        max_submission_bytes: largest accepted submission envelope, bytes.
        requests_per_s: sustained submissions per second per peer (and ×4 per IP before decoding).
        burst: bucket size, requests.
        max_pending_bytes_per_worker: a worker's unjudged submissions may not exceed this, bytes.
        max_pending_per_worker: nor this many submissions: backpressure, so workers generate no
            faster than validators judge (their excess would only turn stale).
        max_pending_bytes_per_ip: unjudged bytes posted from one IP address, whatever the keys.
        max_pending_per_ip: unjudged submissions posted from one IP address.
        max_disk_bytes: submission bytes on disk in all (pending, and accepted not yet trained on).
        max_disk_files: submission files on disk in all.
        min_free_disk_bytes: refuse submissions that would leave less free space than this, bytes.
        decode_timeout_s: time allowed to receive one request body, seconds.
        decode_concurrency_per_ip: envelopes from one IP address decoded at once (more wait).
        decode_concurrency: envelopes decoded at once in all.
        max_body_bytes_in_flight_per_ip: submission bytes being received, decoded or stored at
            once for one address (the declared length is reserved before reading), bytes.
        max_body_bytes_in_flight: the same in all, bytes.
        lease_max_age_s: a ``lease_request/1`` older than this is refused, seconds; within it each
            one is accepted once (its ID is remembered that long).
        lease_nonce_capacity: lease-request IDs remembered; when full of unexpired IDs new lease
            requests are refused with 429 until some expire.
        max_pending_rechecks: workers with a cheat verdict waiting for the coordinator's re-check
            (one submission each: one reproduction bans a worker, so a worker's further cheat
            verdicts while it waits add nothing); a cheat verdict against a further worker
            rejects its submission without a ban (its next cheat verdict is queued again).
    """

    max_submission_bytes: int = Submission.MAX_BYTES
    requests_per_s: float = 5.0
    burst: float = 50.0
    max_pending_bytes_per_worker: int = 256 << 20
    max_pending_per_worker: int = 4
    max_pending_bytes_per_ip: int = 1 << 30
    max_pending_per_ip: int = 64
    max_disk_bytes: int = 8 << 30
    max_disk_files: int = 4096
    min_free_disk_bytes: int = 256 << 20
    decode_timeout_s: float = 30.0
    decode_concurrency_per_ip: int = 2
    decode_concurrency: int = 4
    max_body_bytes_in_flight_per_ip: int = 96 << 20
    max_body_bytes_in_flight: int = 512 << 20
    lease_max_age_s: float = 60.0
    lease_nonce_capacity: int = 4096
    max_pending_rechecks: int = 64


class IngestService:
    """Accepts submissions and verdicts; serves validators; keeps the ban list.

    Args:
        spec: the run spec (run ID, async level, validators).
        store: durable submission store.
        bans: the ban book.
        trainer_step: callable returning the trainer's current step (for the staleness window).
        latest_policy_step: callable returning the newest published policy step.
        on_verdict: called with a verdict envelope's bytes after it decided a submission, and
            whether it still needs gossiping (``False`` when it arrived on gossip).
        on_ban: called with the new ban-list envelope bytes after a ban (to gossip it).
        on_stored: called with a new submission's ID and its verified body once it is durable
            (the coordinator's rollout buffer keeps it, so the envelope is verified once).
        status_extra: callable adding fields to ``/status``.
        limits: :class:`IngestLimits`.
        recheck: the coordinator's independent re-check of a submission (:data:`Recheck`), run
            in a background thread for each deciding cheat verdict; ``None``: only a second
            validator's verdict can confirm a cheat (``docs/validator.md`` "Ban rule").
    """

    def __init__(
        self,
        spec: RunSpec,
        store: SubmissionStore,
        bans: BanBook,
        *,
        trainer_step: Callable[[], int],
        latest_policy_step: Callable[[], int],
        on_verdict: Callable[[bytes, bool], None] | None = None,
        on_ban: Callable[[bytes], None] | None = None,
        on_stored: Callable[[str, Submission], None] | None = None,
        status_extra: Callable[[], dict[str, Any]] | None = None,
        limits: IngestLimits | None = None,
        recheck: Recheck | None = None,
    ) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self._body_limits = submission_decode_limits(spec)  # no array longer than an honest submission's
        self.authorities = spec.authorities
        self.store = store
        self.bans = bans
        self.trainer_step = trainer_step
        self.latest_policy_step = latest_policy_step
        self.on_verdict = on_verdict
        self.on_ban = on_ban
        self.on_stored = on_stored
        self.status_extra = status_extra
        self.limits = limits or IngestLimits()
        self.recheck = recheck
        self._ip_limiter = RateLimiter(self.limits.requests_per_s * 4, self.limits.burst * 4)
        self._peer_limiter = RateLimiter(self.limits.requests_per_s, self.limits.burst)
        self._decode_all = asyncio.Semaphore(self.limits.decode_concurrency)
        self._decode_ip: dict[str, tuple[asyncio.Semaphore, int]] = {}  # address → (semaphore, users)
        self._inflight_ip: dict[str, int] = {}  # address → body bytes reserved
        self._inflight = 0
        self._admit = asyncio.Lock()  # quota and counter checks and the store's add are one step
        self._lease_seen: OrderedDict[bytes, float] = OrderedDict()  # lease-request ID → forget after (epoch s)
        self._retired_s = 0.0
        self._history_lock = threading.Lock()
        self._history: dict[str, Any] | None = None
        self._history_due = 0.0
        self._status_slot = asyncio.Semaphore(1)  # /status and /metrics: one executor thread at most
        # worker → submission ID, oldest first: IDs, not bytes (64 queued 32 MiB submissions would hold
        # 2 GiB; read when re-checked), and one per worker, so one cheater cannot fill it for others
        self._recheck_wait: OrderedDict[str, str] = OrderedDict()
        self._recheck_cv = threading.Condition()
        self._recheck_stop = False
        self._recheck_thread: threading.Thread | None = None
        self.rechecks = {"queued": 0, "reproduced": 0, "not_reproduced": 0, "coalesced": 0, "dropped": 0}
        self.started_s = time.time()
        self.registry = CollectorRegistry()
        self.m_submissions = Counter("intellect_ingest_submissions", "Submissions received, by outcome", ["outcome"], registry=self.registry)
        self.m_verdicts = Counter("intellect_ingest_verdicts", "Verdicts applied, by reason", ["reason"], registry=self.registry)
        self.m_rechecks = Counter("intellect_ingest_rechecks", "Re-checks of cheat verdicts, by outcome", ["outcome"], registry=self.registry)
        self.m_bytes = Counter("intellect_ingest_bytes", "Submission bytes stored", registry=self.registry)
        self.m_pending = Gauge("intellect_ingest_pending", "Submissions waiting for a verdict", registry=self.registry)
        self.m_banned = Gauge("intellect_banned_peers", "Peers on the ban list", registry=self.registry)
        self.m_latency = Histogram("intellect_ingest_store_seconds", "Time to store a submission durably", registry=self.registry)

    def add_routes(self, app: web.Application) -> None:
        """Register the ingest routes on ``app``."""
        app.router.add_post(SUBMISSIONS_ROUTE, self.post_submission)
        app.router.add_post(LEASE_ROUTE, self.post_lease)
        app.router.add_post(VERDICTS_ROUTE, self.post_verdict)
        app.router.add_get(BANS_ROUTE, self.get_bans)
        app.router.add_get("/status", self.get_status)
        app.router.add_get("/metrics", self.get_metrics)

    def close(self) -> None:
        """Stop the re-check thread (queued re-checks are dropped: those submissions stay rejected, unbanned)."""
        if self._recheck_thread is not None:
            with self._recheck_cv:
                self._recheck_stop = True
                self._recheck_cv.notify()
            self._recheck_thread.join(timeout=5.0)
            self._recheck_thread = None

    # --- handlers ----------------------------------------------------------------------------

    async def _read_body(self, request: web.Request, limit: int) -> bytes:
        enc = request.headers.get("Content-Encoding", "identity").strip().lower()
        if enc not in ("", "identity"):  # nothing is inflated here: a small body stays small
            raise _error("unsupported_encoding", f"Content-Encoding {enc[:32]!r} refused: send identity bodies")
        try:
            return await read_body(request, limit, self.limits.decode_timeout_s)
        except BodyError as e:
            raise _error(e.code, e.detail) from None

    def _ip_gate(self, request: web.Request) -> None:
        ip = address_key(request.remote or "?")
        if not self._ip_limiter.allow(ip):
            raise _error("rate_limited", "too many requests from this address", retry_after=self._ip_limiter.retry_after_s(ip))

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

    async def _retire(self) -> None:
        now = time.monotonic()
        if now - self._retired_s < RETIRE_EVERY_S:
            return
        self._retired_s = now
        n = await asyncio.to_thread(self.store.retire_stale, oldest_fresh_step(self.trainer_step(), self.spec.rl.async_level))
        if n:
            logger.info("deleted %d submission files that fell out of the async window", n)

    @contextlib.contextmanager
    def _body_budget(self, request: web.Request, limit: int) -> Iterator[None]:
        """Reserve the body's bytes (declared length, or ``limit`` for a chunked body) while it is
        read, decoded and stored: at most ``max_body_bytes_in_flight_per_ip`` per address and
        ``max_body_bytes_in_flight`` in all are held in memory; beyond, 429 ``busy``."""
        ip = address_key(request.remote or "?")
        n = min(request.content_length if request.content_length is not None else limit, limit)
        lim = self.limits
        if self._inflight_ip.get(ip, 0) + n > lim.max_body_bytes_in_flight_per_ip or self._inflight + n > lim.max_body_bytes_in_flight:
            self.m_submissions.labels("busy").inc()
            raise _error("busy", f"too many request bytes in flight from {ip} or in all; retry later", retry_after=1.0)
        self._inflight_ip[ip] = self._inflight_ip.get(ip, 0) + n
        self._inflight += n
        try:
            yield
        finally:
            self._inflight -= n
            self._inflight_ip[ip] -= n
            if not self._inflight_ip[ip]:
                del self._inflight_ip[ip]

    async def post_submission(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        with self._body_budget(request, self.limits.max_submission_bytes):
            return await self._post_submission(request)

    async def _post_submission(self, request: web.Request) -> web.Response:
        ip = address_key(request.remote or "?")
        data = await self._read_body(request, self.limits.max_submission_bytes)
        async with self._decode_slot(ip):
            try:
                env = await asyncio.to_thread(open_envelope, data, run_id=self.run_id, expect=Submission, body_limits=self._body_limits)
            except ProtocolError as e:
                self.m_submissions.labels("malformed").inc()
                raise _error("malformed", str(e)) from None
        sub = env.body
        if not self._peer_limiter.allow(sub.worker):
            self.m_submissions.labels("rate_limited").inc()
            raise _error("rate_limited", f"worker {sub.worker} is over its rate", retry_after=self._peer_limiter.retry_after_s(sub.worker))
        if self.bans.is_banned(sub.worker):
            self.m_submissions.labels("banned").inc()
            raise _error("banned", f"worker {sub.worker} is banned")
        now, hi = self.trainer_step(), self.latest_policy_step()
        if not in_window(sub.policy_step, trainer_step=now, async_level=self.spec.rl.async_level, newest_step=hi):
            lo = oldest_fresh_step(now, self.spec.rl.async_level)
            self.m_submissions.labels("stale").inc()
            raise _error("stale_policy", f"policy step {sub.policy_step} outside the window [{lo}, {hi}]")
        await self._retire()
        sid = env.id.hex()
        # Admission is one step of the event loop (no await inside): the checks see every earlier
        # admitted submission, durable or still being written (the store counts staged ones), and
        # this one is counted before the next request is checked. The durable write happens after,
        # group-committed with whatever else is being stored (trainer/ledger/store.py).
        async with self._admit:
            # staged first, then the index: a submission goes staged → (both, while committing) → index
            if not self.store.storing(sid):  # the same bytes being stored now: a duplicate, answered when they are durable
                existing = self.store.get(sid)
                if existing is not None:
                    self.m_submissions.labels("duplicate").inc()
                    return web.json_response({"id": sid, "stored": False, "duplicate": True, "state": existing.state})
                if self.store.counter_used(sub.worker, sub.counter, sid):
                    self.m_submissions.labels("replay").inc()
                    raise _error("replay", f"worker {sub.worker} already submitted counter {sub.counter} in another submission")
                self._check_quotas(sub.worker, ip, len(data))
            t0 = time.perf_counter()
            durable = self.store.submit(env, None, ip)
        # the answer waits for this submission's group commit: a 200 means it survives a crash
        try:
            stored = await asyncio.wrap_future(durable)
        except (OSError, sqlite3.Error) as e:  # nothing was stored (the store dropped its file): the same bytes may come again
            self.m_submissions.labels("storage_failed").inc()
            raise _error("storage_failed", f"the ingest could not store it ({type(e).__name__}: {str(e)[:120]}); retry later",
                         retry_after=5.0) from None
        if not stored:
            existing = self.store.get(sid)
            self.m_submissions.labels("duplicate").inc()
            return web.json_response({"id": sid, "stored": False, "duplicate": True, "state": existing.state if existing else "pending"})
        if self.bans.is_banned(sub.worker):  # banned while it was being stored: the ban's rejection of its pending work missed it
            await asyncio.to_thread(self.store.reject_worker_pending, sub.worker, "banned")
            self.m_submissions.labels("banned").inc()
            raise _error("banned", f"worker {sub.worker} is banned")
        self.m_latency.observe(time.perf_counter() - t0)
        self.m_bytes.inc(len(data))
        self.m_submissions.labels("stored").inc()
        if self.on_stored:
            self.on_stored(sid, sub)
        logger.info("stored submission %s from %s (step %d, %d rollouts)", sid[:12], sub.worker, sub.policy_step, len(sub.rollouts),
                    extra={"peer_id": sub.worker, "step": sub.policy_step})
        return web.json_response({"id": sid, "stored": True})

    def _check_quotas(self, worker: str, ip: str, size: int) -> None:
        """Per-key, per-IP and global count and byte quotas, and the free disk space."""
        lim = self.limits
        u = self.store.usage(worker, ip)
        if u.worker_pending >= lim.max_pending_per_worker:
            self.m_submissions.labels("backpressure").inc()
            raise _error("backpressure", f"worker {worker} has {lim.max_pending_per_worker} submissions awaiting verdicts; retry later",
                         retry_after=1.0)
        if u.worker_bytes + size > lim.max_pending_bytes_per_worker:
            self.m_submissions.labels("quota").inc()
            raise _error("quota", f"worker {worker} has too many unjudged bytes; retry later", retry_after=10.0)
        if u.ip_pending >= lim.max_pending_per_ip or u.ip_bytes + size > lim.max_pending_bytes_per_ip:
            self.m_submissions.labels("ip_quota").inc()
            raise _error("ip_quota", f"address {ip} has {u.ip_pending} submissions ({u.ip_bytes} bytes) awaiting verdicts; retry later",
                         retry_after=10.0)
        if u.disk_files >= lim.max_disk_files or u.disk_bytes + size > lim.max_disk_bytes:
            self.m_submissions.labels("disk_quota").inc()
            raise _error("disk_quota", f"the ingest holds {u.disk_files} submissions ({u.disk_bytes} bytes), its limit; retry later",
                         retry_after=10.0)
        # minus what admitted submissions are still writing: the file system does not show it yet
        free = shutil.disk_usage(self.store.dir).free - u.writing_bytes
        if free - size < lim.min_free_disk_bytes:
            self.m_submissions.labels("disk_full").inc()
            raise _error("disk_full", f"only {free} bytes free on the ingest's disk; retry later", retry_after=30.0)

    async def post_lease(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        data = await self._read_body(request, LeaseRequest.MAX_BYTES)
        try:
            env = open_envelope(data, run_id=self.run_id, expect=LeaseRequest, authorities=self.authorities, max_age_s=self.limits.lease_max_age_s)
        except ProtocolError as e:
            raise _error("not_validator", str(e)) from None
        self._remember_lease(bytes(env.id))
        await self._retire()
        ids = self.store.lease_pending(env.body.limit, env.body.lease_s)
        blobs = [await asyncio.to_thread(self.store.read, i) for i in ids]
        return web.Response(body=pack_lease_answer(blobs, self.trainer_step()), content_type=LEASE_CONTENT_TYPE)

    def _remember_lease(self, lease_id: bytes) -> None:
        """Accept each signed lease request once while it is fresh (a captured one cannot lease again)."""
        now = time.time()
        while self._lease_seen:
            first, forget_at = next(iter(self._lease_seen.items()))
            if forget_at > now:
                break
            del self._lease_seen[first]
        if lease_id in self._lease_seen:
            raise _error("replay", "this lease request was already served; sign a new one")
        if len(self._lease_seen) >= self.limits.lease_nonce_capacity:
            raise _error("busy", "too many lease requests in the last minute", retry_after=1.0)
        # remembered past its validity (plus the allowed clock skew of open_envelope's max_future_s)
        self._lease_seen[lease_id] = now + self.limits.lease_max_age_s + 30.0

    async def post_verdict(self, request: web.Request) -> web.Response:
        self._ip_gate(request)
        data = await self._read_body(request, Verdict.MAX_BYTES)
        try:
            env = open_envelope(data, run_id=self.run_id, expect=Verdict, authorities=self.authorities)
        except ProtocolError as e:
            raise _error("malformed", str(e)) from None
        applied = self.apply_verdict(env)  # verified once, here
        return web.json_response({"applied": applied})

    def apply_verdict(self, verdict: bytes | Envelope[Verdict], *, via_gossip: bool = False) -> bool:
        """Apply a verdict envelope (from HTTP or gossip) under the ban rule of ``docs/validator.md``.

        The first verdict on a pending submission decides it. A deciding cheat verdict bans only
        once a second, independent check reproduces a cheat reason: the coordinator's re-check
        (:attr:`recheck`, queued here) or a later verdict of *another* validator on the same
        submission. A verdict that does not decide its submission is never applied and, unless
        it corroborates the deciding cheat verdict, changes nothing (a contradicting second
        verdict neither applies nor bans).

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
        if isinstance(verdict, Envelope):
            env = verdict
        else:
            env = open_envelope(verdict, run_id=self.run_id, expect=Verdict, authorities=self.authorities)
        v = env.body
        sid = v.submission_id.hex()
        stored = self.store.get(sid)
        if stored is None or stored.worker != v.worker:
            return False
        applied = self.store.record_verdict(env.id.hex(), sid, env.peer_id, v.accepted, v.reason, evidence=_summary(v.evidence))
        if applied:
            self.m_verdicts.labels(v.reason).inc()
            if self.on_verdict:
                self.on_verdict(env.raw, not via_gossip)
        cheat = not v.accepted and is_cheat(v.reason)
        if applied and not v.accepted and (not cheat or self.bans.is_banned(v.worker)):
            self.store.delete_files([sid])  # final: nothing will read it again
        if not cheat or self.bans.is_banned(v.worker):
            return applied
        if applied:
            self._queue_recheck(sid, v.worker)
            return applied
        # not deciding: a second validator's cheat verdict corroborates a deciding cheat verdict
        decision = self.store.deciding_verdict(sid)
        if decision is not None and decision.validator != env.peer_id and not decision.accepted and is_cheat(decision.reason):
            self._ban(v.worker, sid, decision, BanEvidence(by=env.peer_id, verdict_id=bytes(env.id), reason=v.reason,
                                                          detail=_summary(v.evidence)))
        return applied

    def _queue_recheck(self, sid: str, worker: str) -> None:
        if self.recheck is None:
            return  # only another validator's verdict can confirm it
        if self._recheck_thread is None:
            self._recheck_thread = threading.Thread(target=self._recheck_loop, name="ingest-recheck", daemon=True)
            self._recheck_thread.start()
        with self._recheck_cv:
            if worker in self._recheck_wait:
                outcome = "coalesced"  # its earlier cheat verdict is already waiting
            elif len(self._recheck_wait) >= self.limits.max_pending_rechecks:
                outcome = "dropped"
            else:
                self._recheck_wait[worker] = sid
                self._recheck_cv.notify()
                self.rechecks["queued"] += 1
                return
        self.rechecks[outcome] += 1
        self.m_rechecks.labels(outcome).inc()
        if outcome == "dropped":
            logger.warning("no re-check of %s (%d workers already wait for one): its worker is not banned on this verdict", sid[:12],
                           self.limits.max_pending_rechecks, extra={"peer_id": worker})
        self.store.delete_files([sid])  # rejected and never re-checked: nothing will read it again

    def _next_recheck(self) -> str | None:
        """The oldest waiting submission (blocks); ``None`` once the service closes."""
        with self._recheck_cv:
            while not self._recheck_wait and not self._recheck_stop:
                self._recheck_cv.wait()
            if self._recheck_stop:
                return None
            return self._recheck_wait.popitem(last=False)[1]

    def _recheck_loop(self) -> None:
        """Re-check queued submissions one at a time (a background thread)."""
        assert self.recheck is not None
        while True:
            sid = self._next_recheck()
            if sid is None:
                return
            try:
                decision = self.store.deciding_verdict(sid)
                stored = self.store.get(sid)
                if decision is None or stored is None or self.bans.is_banned(stored.worker):
                    self.store.delete_files([sid])  # banned meanwhile (or gone): rejected, never read again
                    continue
                try:
                    raw = self.store.read(sid)
                except OSError as e:
                    self.rechecks["dropped"] += 1
                    self.m_rechecks.labels("dropped").inc()
                    logger.warning("no re-check of %s (%s): its worker is not banned on one verdict", sid[:12], type(e).__name__)
                    continue
                try:
                    result = self.recheck(raw)
                except Exception as e:  # noqa: BLE001 - the re-check's own failure is no evidence against the worker
                    logger.warning("re-check of %s failed: %s", sid[:12], e)
                    result = RecheckResult(True, "recheck_failed", str(e)[:200], PeerId(""))  # by nobody: benign, never evidence
                if not result.accepted and is_cheat(result.reason):
                    self.rechecks["reproduced"] += 1
                    self.m_rechecks.labels("reproduced").inc()
                    self._ban(stored.worker, sid, decision, BanEvidence(by=result.by, reason=result.reason, detail=result.detail[:200]))
                else:
                    self.rechecks["not_reproduced"] += 1
                    self.m_rechecks.labels("not_reproduced").inc()
                    logger.warning("%s's %s verdict on %s was not reproduced by the re-check (%s): no ban", decision.validator,
                                   decision.reason, sid[:12], result.reason, extra={"peer_id": stored.worker})
                self.store.delete_files([sid])
            except Exception:  # keep the thread alive for the next one
                logger.exception("re-check of %s could not be applied", sid[:12])

    def _ban(self, worker: str, sid: str, decision: DecidingVerdict, second: BanEvidence) -> None:
        first = BanEvidence(by=decision.validator, verdict_id=bytes.fromhex(decision.verdict_id), reason=decision.reason,
                            detail=decision.evidence[:200])
        if self.bans.ban(worker, decision.reason, bytes.fromhex(decision.verdict_id), submission_id=bytes.fromhex(sid), evidence=[first, second]):
            self.store.reject_worker_pending(worker, "banned")
            self.store.delete_files([sid])
            self.m_banned.set(len(self.bans.entries()))
            if self.on_ban:
                self.on_ban(self.bans.envelope)

    async def get_bans(self, request: web.Request) -> web.Response:
        return web.Response(body=self.bans.envelope, content_type="application/msgpack")

    def history_stats(self) -> dict[str, Any]:
        """``submissions`` (counts by state), ``verdicts_by_reason``, ``workers`` (per-worker
        counts) and ``workers_json`` (``workers`` as JSON text): whole-history store scans (≈ 2 s at 10^6 submissions), so rebuilt at most
        1/:data:`STATUS_DUTY_FACTOR` of the time; a scan under :data:`STATUS_CACHE_MIN_S` is not
        kept (a small store answers exactly). Concurrent callers share one rebuild. Thread-safe."""
        with self._history_lock:
            if self._history is not None and time.monotonic() < self._history_due:
                return self._history
            t0 = time.monotonic()
            doc = {"submissions": self.store.counts(), "verdicts_by_reason": self.store.verdict_reasons(),
                   "workers": self.store.worker_stats()}
            # encoded here, once per rebuild and counted in its cost: O(workers), 112 ms at 10^5
            doc["workers_json"] = json.dumps(doc["workers"], default=str)
            t1 = time.monotonic()
            if t1 - t0 >= STATUS_CACHE_MIN_S:
                self._history, self._history_due = doc, t1 + (STATUS_DUTY_FACTOR - 1) * (t1 - t0)
            else:
                self._history = None
            return doc

    def status(self, history: dict[str, Any] | None = None) -> dict[str, Any]:
        """What ``/status`` shows (blocking: store reads; :meth:`history_stats`, or ``history`` when
        given, may be up to 19× its last scan time old)."""
        history = self.history_stats() if history is None else history
        self.m_pending.set(history["submissions"]["pending"])
        out: dict[str, Any] = {
            "run_id": self.run_id.hex(),
            "trainer_step": self.trainer_step(),
            "latest_policy_step": self.latest_policy_step(),
            "async_level": self.spec.rl.async_level,
            "submissions": history["submissions"],
            "verdicts_by_reason": history["verdicts_by_reason"],
            "banned": [{"peer_id": e.peer_id, "reason": e.reason, "evidence": [f"{x.reason} by {x.by}" for x in e.evidence]}
                       for e in self.bans.entries()],
            "rechecks": dict(self.rechecks),
            "workers": history["workers"],
            "uptime_s": round(time.time() - self.started_s, 1),
        }
        if self.status_extra:
            out.update(self.status_extra())
        return out

    def status_body(self) -> bytes:
        """``/status`` as UTF-8 JSON (blocking). ``workers`` (every worker of the run) is spliced in
        as encoded by the last :meth:`history_stats` rebuild, not encoded per request: at 10^5
        workers that took 112 ms of the event loop for each GET of a public route."""
        history = self.history_stats()
        doc = self.status(history)
        del doc["workers"]
        head = json.dumps(doc, default=str)  # a non-empty object: "{...}"
        workers: str = history["workers_json"]
        return (head[:-1] + ', "workers": ' + workers + "}").encode()

    async def get_status(self, request: web.Request) -> web.Response:
        # One thread at a time: concurrent requests wait here, not in the default executor, which
        # the submission path decodes in (a burst of /status must not queue submissions).
        async with self._status_slot:
            body = await asyncio.to_thread(self.status_body)
        return web.Response(body=body, content_type="application/json")

    async def get_metrics(self, request: web.Request) -> web.Response:
        async with self._status_slot:
            history = await asyncio.to_thread(self.history_stats)
        self.m_pending.set(history["submissions"]["pending"])
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class Rejected(Exception):
    """A request refused with an HTTP status, an error code and a human-readable detail."""

    def __init__(self, status: int, code: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.retry_after = status, code, detail, retry_after


def _error(code: str, detail: str, retry_after: float | None = None) -> Rejected:
    """A refusal with one of :data:`protocol.ingest_api.ERROR_CODES` (which fixes its HTTP status)."""
    return Rejected(ERROR_CODES[code][0], code, detail, retry_after)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Turn :class:`Rejected` into ``{"error", "detail"}`` JSON responses (add to the app's middlewares)."""
    try:
        return await handler(request)
    except Rejected as e:
        headers = {"Retry-After": str(max(1, int(e.retry_after + 0.999)))} if e.retry_after else None
        return web.json_response({"error": e.code, "detail": e.detail}, status=e.status, headers=headers)


def _summary(evidence: dict[str, Any]) -> str:
    """A verdict's evidence map as one ≤ 200-character line for a ban record."""
    return ", ".join(f"{k}={v}" for k, v in evidence.items())[:200]


class BodyError(Exception):
    """A request body refused while reading it: ``status`` 408 (too slow), 413 (too large) or 400 (cut short)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = ERROR_CODES[code][0], code, detail


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """Read the whole request body, at most ``limit`` bytes, within ``timeout_s`` seconds.

    Unlike ``request.content.read(n)``, which returns only what is already buffered (so bodies
    over ≈ 384 KiB came back cut and were refused as malformed), this waits for every byte the
    client declared or, for a chunked body, for its end.

    Raises:
        BodyError: 413 over ``limit`` (declared or sent), 408 not received in time, 400 cut short.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError("too_large", f"body of {declared} bytes exceeds {limit} bytes")
    chunks: list[bytes] = []
    got = 0
    try:
        async with asyncio.timeout(timeout_s):
            if declared is not None:
                chunks.append(await request.content.readexactly(declared))
            else:
                while True:
                    data = await request.content.read(min(1 << 20, limit + 1 - got))
                    if not data:
                        break
                    chunks.append(data)
                    got += len(data)
                    if got > limit:
                        raise BodyError("too_large", f"body exceeds {limit} bytes")
    except TimeoutError:
        raise BodyError("timeout", f"body not received within {timeout_s} s") from None
    except asyncio.IncompleteReadError as e:
        raise BodyError("truncated", f"body ended after {len(e.partial)} of {declared} bytes") from None
    return b"".join(chunks)
