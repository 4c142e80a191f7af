"""The validator role: lease submissions from the ingest, check them, sign and publish verdicts.

Wires its parts: the checks (:mod:`validator.pipeline`), what it judged (:mod:`validator.judgements`),
spot-check selection (:mod:`validator.spot`), held checkpoints and models (:mod:`node.policy`), the
ingest client (:mod:`node.ingest_client`) with :mod:`node.retry`'s pacing, and the resource-failure
rule (:mod:`node.validator.resources`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from node.errors import FetchError
from node.ingest_client import IngestClient, IngestUnavailable
from node.lifecycle import require_sandbox_for, sleep_unless, start_status_server
from node.p2p import GossipConfig, GossipNode
from node.policy import GossipSources, HeldModels, PolicyFollower
from node.retry import Backoff, FailureLog
from node.status_http import StatusServer
from node.validator.resources import ResourceFailures, resource_failure
from protocol.dataset import resolve_run_tasks
from protocol.envelope import open_envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import BanList, LeaseRequest, Submission, Verdict
from protocol.models import load_model, load_tokenizer
from protocol.rollout import submission_decode_limits
from protocol.runspec import SignedRunSpec
from validator.judgements import Judgements
from validator.pipeline import CheckResult, SubmissionChecker
from validator.spot import SpotCheckPolicy, selected

logger = logging.getLogger(__name__)

LEASE_S = 120.0
IDLE_POLL_S = 0.5
LEASE_BACKOFF_MAX_S = 15.0
"""Longest wait between lease attempts while no ingest answers, seconds (before jitter)."""
VERDICT_TRIES = 5
"""Posts of one verdict while the ingest answers *retry* or not at all; then the lease expires and
the submission is judged again (a verdict is cheap to sign again, and the ingest may be down)."""
VERDICT_BACKOFF_BASE_S = 0.5
VERDICT_BACKOFF_MAX_S = 10.0
"""The pacing of those posts (:class:`node.retry.Backoff`: doubling from the base, with jitter), seconds."""
FAILURE_LOG_INTERVAL_S = 30.0
"""A repeated lease failure is logged at most once per this many seconds."""
MODEL_CACHE_BYTES = 2560 * 1024 * 1024
"""Float32 model parameters kept in memory for prefill (2.5 GiB; :class:`node.policy.HeldModels`), on top of the retention rule:
the embedded devnet keeps every retained step, a 0.5B-shape model (1.98 GB) only the one in use;
a submission of another step loads its checkpoint from disk again (seconds) instead of doubling
the validator's memory (``docs/validator.md``)."""


@dataclass
class ValidatorOptions:
    """Settings of a validator process.

    Attributes:
        data_dir: node data directory (checkpoints, ledger).
        data_root: directory of the public task sets, for named ``data.tasks``.
        artifacts: fetched artifacts of the run (name → folder): ``tasks`` replaces ``data_root``.
        gossip: gossip settings (``None``: off).
        http_port: status port (``None``: no status server).
        spot: which submissions are checked in full (reputation-weighted spot checks,
            :mod:`validator.spot`; ``SpotCheckPolicy(min_share=1.0)`` checks every one; see
            ``docs/validator.md`` §5 for the detection probability).
        batch: submissions leased at once.
        ingest_urls: override of the run spec's ingest URLs.
        device: torch device for prefill.
    """

    data_dir: Path
    data_root: Path | None = None
    artifacts: dict[str, Path] = field(default_factory=dict)
    gossip: GossipConfig | None = field(default_factory=GossipConfig)
    http_port: int | None = 0
    spot: SpotCheckPolicy = field(default_factory=SpotCheckPolicy)
    batch: int = 8
    ingest_urls: list[str] = field(default_factory=list)
    device: str = "cpu"


class ValidatorNode:
    """A validator process: ``__init__`` (no I/O) → ``start`` → ``run`` → ``stop``.

    Raises:
        ValueError: from ``__init__`` when the key is not a validator of the run spec.
    """

    def __init__(self, signed: SignedRunSpec, key: NodeKey, options: ValidatorOptions) -> None:
        if not signed.spec.is_validator(key.peer_id):
            raise ValueError(f"key {key.peer_id} is not a validator of this run; the run spec names {signed.spec.run.validators or 'none'}")
        self.signed = signed
        self.spec = signed.spec
        self.key = key
        self.options = options
        self.data_dir = Path(options.data_dir)
        self.ingest_urls = [u.rstrip("/") for u in (options.ingest_urls or self.spec.network.ingest_urls)]
        self.tasks = resolve_run_tasks(self.spec, options.data_root, artifacts=options.artifacts).train
        self.judgements = Judgements(self.data_dir / "validator.sqlite")
        self.follower = PolicyFollower(self.spec, self.data_dir / "checkpoints", GossipSources(lambda: self.gossip, self.spec))
        self.gossip: GossipNode | None = None
        self.judged_step = -1  # the newest policy step of a submission this validator judged
        self.tokenizer: Any = None
        self.models = HeldModels(self.spec.shardcast.keep_steps, self._load_model, max_bytes=MODEL_CACHE_BYTES)
        """Loaded checkpoints (node/policy.py: the retention rule, bounded by MODEL_CACHE_BYTES)."""
        self.banned: set[str] = set()
        self._stop = asyncio.Event()
        self.ingest = IngestClient(self.ingest_urls)  # node.timeouts.INGEST_REQUEST_TIMEOUT_S
        self._body_limits = submission_decode_limits(self.spec)
        self._lease_retry_after_s = 0.0
        self.state = "starting"
        self.checked = 0
        self.checked_by_depth = {"full": 0, "light": 0}
        self.reasons: dict[str, int] = {}
        self.check_seconds = 0.0
        self.queue = 0
        self.registry = CollectorRegistry()
        self.m_checked = Counter("intellect_validator_checked", "Submissions judged", registry=self.registry)
        self.m_depth = Counter("intellect_validator_checks", "Submissions judged by check depth (full, light)", ["depth"],
                               registry=self.registry)
        self.m_verdicts = Counter("intellect_validator_verdicts", "Verdicts by reason", ["reason"], registry=self.registry)
        self.m_seconds = Histogram("intellect_validator_seconds", "Seconds to judge one submission", registry=self.registry,
                                   buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100))
        self.m_queue = Gauge("intellect_validator_queue", "Leased submissions waiting to be judged", registry=self.registry)
        self.status_server: StatusServer | None = None
        self._lease_backoff = Backoff(base_s=IDLE_POLL_S, max_s=LEASE_BACKOFF_MAX_S)
        self._lease_failures = FailureLog(logger, interval_s=FAILURE_LOG_INTERVAL_S)
        self._resource_failures = ResourceFailures()

    async def start(self) -> None:
        await require_sandbox_for(self.tasks)  # code tasks only in a real sandbox: RewardError naming what to install
        if self.options.gossip is not None:
            self.gossip = await GossipNode.create(self.spec, self.key, self.options.gossip, role="validator")
            self.gossip.on_announcement(self._on_announcement)
            self.gossip.on_ban_list(self._on_ban_list)
            self.gossip.register_metrics(self.registry)  # intellect_gossip_*: drops, refusals, attached workers
        self.status_server = await start_status_server(self.status, self.registry, self.options.http_port)

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        self._stop.set()
        await self.ingest.close()
        await self.follower.close()
        if self.gossip is not None:
            await self.gossip.stop()
        if self.status_server is not None:
            await self.status_server.stop()
        self.judgements.close()

    async def run(self) -> None:
        """Lease, judge and report until stopped."""
        while not self._stop.is_set():
            blobs = await self._lease()
            self.queue = len(blobs)
            self.m_queue.set(self.queue)
            if not blobs:
                if self._lease_failures.failing:  # no ingest leased: back off with jitter, never sooner than its Retry-After
                    await self._sleep(max(self._lease_backoff.next_delay(), self._lease_retry_after_s))
                    continue
                self.state = "idle: no pending submissions"
                await self._sleep(IDLE_POLL_S)
                continue
            for blob in blobs:
                if self._stop.is_set():
                    break
                try:
                    await self._judge(blob)
                except Exception:  # a bug or a resource failure on one submission must not stop the validator
                    logger.exception("checking a submission failed; its lease will expire and it will be retried")
                self.queue -= 1
                self.m_queue.set(self.queue)

    # --- work ----------------------------------------------------------------------------------

    async def _lease(self) -> list[bytes]:
        req = seal(self.key, self.signed.run_id, LeaseRequest(limit=self.options.batch, lease_s=LEASE_S))
        try:
            answer = await self.ingest.lease(req, self.options.batch)
        except IngestUnavailable as e:
            self._lease_retry_after_s = e.retry_after_s or 0.0
            self.state = f"ingest unreachable: {e}"
            self._lease_failures.failed(f"lease failed: {e}")
            return []
        self._lease_failures.recovered("ingest reachable")
        self._lease_backoff.reset()
        self._lease_retry_after_s = 0.0
        return answer.submissions  # its trainer_step is unsigned: not trusted (_trainer_step)

    async def _judge(self, blob: bytes) -> None:
        try:
            # the ingest's bounds (no array longer than an honest submission's): a lease answer is unsigned
            env = open_envelope(blob, run_id=self.signed.run_id, expect=Submission, body_limits=self._body_limits)
        except ProtocolError as e:
            logger.warning("ingest handed out an invalid submission: %s", e)
            return
        sub = env.body
        sid = env.id.hex()
        self.state = f"checking {sid[:12]} from {sub.worker[-8:]} (step {sub.policy_step})"
        # spot check: decided now, after the ingest stored the submission, from this validator's key
        share = self.options.spot.share(self.judgements.verified(sub.worker))
        full = selected(self.key.sign, env.id, share)
        if sub.worker in self.banned:
            result = CheckResult(False, "banned_worker", {})
        else:
            await self._prepare(sub.policy_step)
            if sub.policy_step not in self.models:
                # no checkpoint, no judgement: our failure to fetch is no evidence about the worker,
                # and with no checkpoint loaded nothing signed bounds the lease answer's trainer step
                logger.warning("no checkpoint for step %d; leaving %s to a later lease", sub.policy_step, sid[:12])
                return
            checker = SubmissionChecker(self.spec, self.tasks, self.tokenizer, self.models.get, trainer_step=self._trainer_step,
                                        counter_seen=self.judgements.counter_seen)
            try:
                result = await asyncio.to_thread(checker.check, env, full=full)
            except (MemoryError, OSError, RuntimeError) as e:
                kind = resource_failure(e)
                if kind is None:
                    raise
                failures, later = self._resource_failures.failed(sid)
                if later:
                    logger.warning("ran out of resources checking %s (%s: %s); leaving it to a later lease", sid[:12], kind, str(e)[:200])
                    return
                result = CheckResult(False, "resources", {"error": kind, "failures": failures, "detail": str(e)[:200]})
        if result.reason == "banned_worker":
            return  # the coordinator already rejects a banned worker's pending work
        if result.reason == "unknown_checkpoint":
            # our failure to fetch is no evidence about the worker: no verdict, the lease expires and
            # the submission is retried (or turns stale_policy once it leaves the async window)
            logger.warning("no checkpoint for step %d yet; leaving %s to a later lease", sub.policy_step, sid[:12])
            return
        if result.accepted:
            result.evidence.update({"check": "full" if full else "light", "share": round(share, 6)})
        self.judgements.record(sub.worker, sub.counter, sid, result.reason, full=full)
        self.checked += 1
        self.checked_by_depth["full" if full else "light"] += 1
        self.m_depth.labels("full" if full else "light").inc()
        self.check_seconds += result.seconds
        self.reasons[result.reason] = self.reasons.get(result.reason, 0) + 1
        self.m_checked.inc()
        self.m_verdicts.labels(result.reason).inc()
        self.m_seconds.observe(result.seconds)
        verdict = seal(self.key, self.signed.run_id, Verdict(
            submission_id=env.id, worker=sub.worker, policy_step=sub.policy_step, counter=sub.counter,
            accepted=result.accepted, reason=result.reason, evidence={k: v for k, v in result.evidence.items()}, stats=result.stats,
        ))
        log = logger.info if result.accepted else logger.warning
        log("verdict %s on %s from %s (step %d, checked in %.2f s): %s %s", "accept" if result.accepted else "reject", sid[:12], sub.worker,
            sub.policy_step, result.seconds, result.reason, result.evidence or "", extra={"peer_id": sub.worker, "step": sub.policy_step})
        await self._post_verdict(verdict)
        if sub.policy_step > self.judged_step:
            self.judged_step = sub.policy_step
            if self.gossip is not None:
                self.gossip.set_record(policy_step=sub.policy_step)  # its record shows the newest step it judged (status, run page)
        if self.gossip is not None:
            try:
                await self.gossip.publish_verdict(verdict)
            except Exception as e:  # noqa: BLE001 - gossip is best effort; the ingest got the verdict over HTTP
                logger.debug("verdict gossip failed: %s", e)

    def _trainer_step(self) -> int:
        """The trainer step the async window is judged against (:mod:`protocol.window`): the
        newest coordinator-signed policy step this validator knows, ``s`` — announced, or of a
        checkpoint it loaded (each came with a coordinator-signed manifest). The lease answer's
        ``trainer_step`` is unsigned and not trusted: a lying ingest could otherwise push fresh
        work out of the window. Every published step is ≤ the coordinator's ``n``, so ``s ≤ n``:
        the window judged here reaches at least as far back as the coordinator's (a submission it
        accepts that is stale by ``n`` is retired by the coordinator, never trained on), and it
        always covers the submission being judged, whose checkpoint is loaded (``p ≤ s``)."""
        return max(self.follower.latest_step, max(self.models.steps(), default=-1))

    def _on_announcement(self, env: Any) -> None:
        """A new step: note it, and fetch it now (submissions of it follow; only the files, the
        model is loaded when the first of them is checked)."""
        self.follower.note_step(env.body.step)
        self.follower.prefetch(env.body.step)

    def _load_model(self, path: Path) -> torch.nn.Module:
        """A checkpoint's model for prefill: float32 on the validator's device (blocking)."""
        return load_model(path, torch.float32, self.options.device)

    async def _prepare(self, step: int) -> None:
        """Load the checkpoint of ``step`` (fetching it through Shardcast) unless held
        (:class:`node.policy.HeldModels`: the retention rule, within :data:`MODEL_CACHE_BYTES`)."""
        if step in self.models:
            return
        if step > self.follower.latest_step:
            await self.follower.poll_latest()
        try:
            path = await self.follower.fetch(step)
        except FetchError as e:
            logger.warning("cannot fetch policy step %d: %s", step, e)
            return
        await asyncio.to_thread(self.models.hold, step, path)
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, path)

    async def _post_verdict(self, verdict: bytes) -> None:
        """Post a verdict to the ingest: up to :data:`VERDICT_TRIES` tries while it answers *retry*
        or not at all, paced by :class:`node.retry.Backoff` (never sooner than its ``Retry-After``);
        a final refusal is logged and not retried."""
        backoff = Backoff(base_s=VERDICT_BACKOFF_BASE_S, max_s=VERDICT_BACKOFF_MAX_S)
        for _ in range(VERDICT_TRIES):
            answer = await self.ingest.post_verdict(verdict)
            if answer.ok:
                return
            if answer.outcome == "final":
                logger.warning("verdict refused by %s: %d %s", answer.url, answer.status, answer.detail[:200])
                return
            logger.info("verdict post to %s not taken (%s): %s", answer.url or "no ingest", answer.code or "unreachable", answer.detail[:200])
            await self._sleep(max(backoff.next_delay(), answer.retry_after_s or 0.0))

    def _on_ban_list(self, env: Any) -> None:
        if isinstance(env.body, BanList):
            self.banned = {e.peer_id for e in env.body.entries}

    async def _sleep(self, seconds: float) -> None:
        await sleep_unless(self._stop, seconds)

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows."""
        return {
            "role": "validator",
            "peer_id": self.key.peer_id,
            "state": self.state,
            "checked": self.checked,
            "verdicts_by_reason": self.reasons,
            "seconds_per_submission": round(self.check_seconds / self.checked, 4) if self.checked else None,
            "queue": self.queue,
            "latest_step": self.follower.latest_step,
            "judged_step": self.judged_step,
            "reputation": self.judgements.reputation(),
            "spot_checks": {"full_checks": self.options.spot.full_checks, "min_share": self.options.spot.min_share,
                            "checked": self.checked_by_depth},
        }

