"""The worker role: follow the policy, generate proven rollouts, submit them (``docs/operators.md``)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from node.engine import Engine, create_engine
from node.engine.fit import EnginePlan, ModelShape, Workload, plan_engine, smallest_machine
from node.errors import FetchError, NodeError
from node.lifecycle import require_sandbox_for, run_until_stopped, sleep_unless, start_status_server
from node.p2p import GossipConfig, GossipNode
from node.policy import POLL_INTERVAL_S, GossipSources, PolicyFollower
from node.retry import Backoff, FailureLog
from node.status_http import StatusServer
from node.worker.rollouts import BuildStats, build_submission
from node.worker.spool import Spool
from node.worker.submitter import Submitter
from protocol.dataset import resolve_run_tasks
from protocol.envelope import Envelope
from protocol.identity import NodeKey
from protocol.messages import Verdict
from protocol.models import load_tokenizer
from protocol.runspec import SignedRunSpec
from protocol.window import in_window, oldest_fresh_step

logger = logging.getLogger(__name__)

LATE_RETRY_S = 2.0
LATE_RETRY_MAX_S = 15.0
"""While too late to generate and the fetch fails, retries back off from LATE_RETRY_S to this (seconds, before jitter)."""
"""Wait between fetch attempts while the held policy is too old to generate with, seconds."""
MAX_SPOOL_AHEAD = 2
"""Generate no further while this many submissions wait in the spool (the ingest pushes back)."""


@dataclass
class WorkerOptions:
    """Settings of a worker process (``join --role worker`` flags).

    Attributes:
        data_dir: node data directory (checkpoints, spool).
        engine: ``transformers`` or ``vllm``.
        device: ``cpu`` or ``cuda``.
        data_root: directory of the public task sets, for named ``data.tasks``.
        artifacts: fetched artifacts of the run (name → folder): ``tasks`` replaces ``data_root``.
        gpu_memory_share: the engine's share of the GPU (``--gpu-memory-share``); ``None``: planned.
        max_batch: most sequences decoded at once (``--max-batch``); ``None``: planned.
        gossip: gossip settings (``None``: static sources only, from the run spec).
        http_port: status port (``None``: no status server).
        max_submissions: stop after this many submissions (``None``: run until stopped).
        ingest_urls: override of the run spec's ingest URLs.
        adversary: cheat on purpose (``node.worker.adversary``; devnet chaos mode), ``None`` when honest.
        dtype: the engine's compute dtype, ``float32`` or ``bfloat16`` (``None``: the engine's default,
            ``node.engine.create_engine``); the run spec's replay rule must tolerate it (``docs/toploc.md`` §6).
        fp32_head: a bf16 transformers engine computes its logits with the float32 LM head.
        steer_rate: the ``steer`` adversary's share of chances taken, in [0, 1].
    """

    data_dir: Path
    engine: str = "transformers"
    device: str = "cpu"
    data_root: Path | None = None
    artifacts: dict[str, Path] = field(default_factory=dict)
    gpu_memory_share: float | None = None
    max_batch: int | None = None
    gossip: GossipConfig | None = field(default_factory=GossipConfig)
    http_port: int | None = 0
    max_submissions: int | None = None
    ingest_urls: list[str] = field(default_factory=list)
    adversary: str | None = None
    dtype: str | None = None
    fp32_head: bool = False
    steer_rate: float = 1.0


class Worker:
    """A contributor node.

    Lifecycle: ``Worker(signed, key, options)`` (no I/O) → ``await start()`` → ``await run()`` →
    ``await stop()``. ``run`` loops: make sure the engine holds a policy no older than
    ``latest − async_level`` (fetching and hot-swapping newer ones), build one submission
    (:func:`node.worker.rollouts.build_submission`), spool it, and let the submitter deliver it.
    """

    def __init__(self, signed: SignedRunSpec, key: NodeKey, options: WorkerOptions) -> None:
        self.signed = signed
        self.spec = signed.spec
        self.key = key
        self.options = options
        self.data_dir = Path(options.data_dir)
        self.gossip: GossipNode | None = None
        self.follower = PolicyFollower(self.spec, self.data_dir / "checkpoints", GossipSources(lambda: self.gossip, self.spec))
        self.spool = Spool(self.data_dir / "spool")
        self.submitter = Submitter(self.spool, options.ingest_urls or list(self.spec.network.ingest_urls), max_backoff_s=5.0)
        self.engine: Engine | None = None
        self.tokenizer: Any = None
        self.tasks = resolve_run_tasks(self.spec, options.data_root, artifacts=options.artifacts).train
        self.plan: EnginePlan | None = None
        self.policy_step = -1
        self.state = "starting"
        self.submissions = 0
        self.tokens = 0
        self.generate_s = 0.0
        self.verdicts: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._kick = asyncio.Event()
        self._last_poll = 0.0  # monotonic time of the last manifest poll
        # what this start did with the spool it found (found 0: it was empty); None until that is decided
        self.spool_restart: dict[str, Any] | None = None
        self._late_backoff = Backoff(base_s=LATE_RETRY_S, max_s=LATE_RETRY_MAX_S)
        self._late_log = FailureLog(logger, interval_s=30.0)
        self._sender: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        self.m_tokens = Counter("intellect_worker_tokens", "Completion tokens generated", registry=self.registry)
        self.m_submissions = Counter("intellect_worker_submissions", "Submissions built", registry=self.registry)
        self.m_verdicts = Counter("intellect_worker_verdicts", "Verdicts on this worker's submissions", ["reason"], registry=self.registry)
        self.m_step = Gauge("intellect_worker_policy_step", "Policy step held by the engine", registry=self.registry)
        self.m_spool = Gauge("intellect_worker_spool", "Submissions waiting in the spool", registry=self.registry)
        self.status_server: StatusServer | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await require_sandbox_for(self.tasks)  # code tasks only in a real sandbox: RewardError naming what to install
        if self.options.dtype == "bfloat16" and self.spec.toploc.worker_dtype == "float32":
            logger.warning("this run's tolerances are for float32 workers (toploc.worker_dtype): computing in bfloat16, this worker's "
                           "submissions will be rejected and may get it banned; run with --dtype float32")
        if self.options.gossip is not None:
            self.gossip = await GossipNode.create(self.spec, self.key, self.options.gossip, role="worker")
            self.gossip.on_announcement(self._on_announcement)
            self.gossip.on_latest_step(self.follower.note_step)  # a missed announcement: the coordinator's next record
            self.gossip.on_verdict(self._on_verdict)
            self.gossip.register_metrics(self.registry)  # intellect_gossip_*: drops, refusals, hubs
        self.status_server = await start_status_server(self.status, self.registry, self.options.http_port)
        if self.spool.pending():
            await self._triage_spool()
        else:
            self.spool_restart = {"found": 0, "resent": 0, "dropped_stale": 0, "latest_step": None}
        self._sender = asyncio.create_task(self._send_loop(), name="worker-submitter")
        if self.spool.pending():
            self._kick.set()

    async def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._sender is not None:
            try:
                await asyncio.wait_for(self._sender, timeout=5.0)
            except (TimeoutError, asyncio.CancelledError):
                self._sender.cancel()
        await self.submitter.close()
        await self.follower.close()
        if self.gossip is not None:
            await self.gossip.stop()
        if self.status_server is not None:
            await self.status_server.stop()

    def request_stop(self) -> None:
        self._stop.set()
        self._kick.set()

    async def run(self) -> None:
        """Generate and submit until stopped (or ``max_submissions`` reached and delivered)."""
        while not self._stop.is_set():
            if self.options.max_submissions is not None and self.submissions >= self.options.max_submissions:
                break
            if len(self.spool.pending()) >= MAX_SPOOL_AHEAD:
                self.state = f"waiting: {len(self.spool.pending())} submissions not yet taken by the ingest"
                self._kick.set()
                await self._sleep(0.5)
                continue
            if not await self._ensure_policy():
                continue
            counter = self.spool.next_counter()
            self.state = f"generating (step {self.policy_step}, counter {counter})"
            stats = BuildStats()
            assert self.engine is not None
            if self.options.adversary:
                from node.worker.adversary import build_dishonest_submission

                data = await asyncio.to_thread(
                    build_dishonest_submission, self.options.adversary, self.spec, self.signed.run_id, self.key, self.engine,
                    self.tokenizer, self.tasks, self.policy_step, counter, stats,
                )
            else:
                data = await asyncio.to_thread(
                    build_submission, self.spec, self.signed.run_id, self.key, self.engine, self.tokenizer, self.tasks,
                    self.policy_step, counter, None, stats,
                )
            await asyncio.to_thread(self.spool.put, counter, data)
            self.submissions += 1
            self.tokens += stats.tokens
            self.generate_s += stats.generate_s
            self.m_tokens.inc(stats.tokens)
            self.m_submissions.inc()
            logger.info("submission %d at step %d: %d tokens in %.2f s, mean task reward %.2f", counter, self.policy_step, stats.tokens,
                        stats.generate_s, sum(stats.task_rewards) / max(1, len(stats.task_rewards)), extra={"step": self.policy_step})
            self._kick.set()
        if self.options.max_submissions is not None:
            await self.submitter.drain(deadline_s=30.0)

    async def _triage_spool(self) -> None:
        """After a restart: drop spooled submissions that left the async window while this worker was
        down, re-send the rest; one log line says which (``docs/devnet.md`` § Chaos).

        The newest announced policy step stands in for the trainer step (a lower bound of it,
        ``protocol/window.py``), so what is dropped here the ingest would refuse as ``stale_policy``;
        what is kept may still be refused if the trainer is further ahead than announced.
        """
        latest = await self.follower.poll_latest()
        k = self.spec.rl.async_level
        if latest < 0:
            n = len(self.spool.pending())
            self.spool_restart = {"found": n, "resent": n, "dropped_stale": 0, "latest_step": None}
            logger.warning("restart: re-sending %d spooled submissions (the newest policy step is not known yet)", n)
            return
        kept, dropped = await asyncio.to_thread(self.spool.drop_stale, self.signed.run_id,
                                                lambda p: in_window(p, trainer_step=latest, async_level=k))
        self.spool_restart = {"found": len(kept) + len(dropped), "resent": len(kept), "dropped_stale": len(dropped), "latest_step": latest,
                              "resent_steps": kept, "dropped_steps": dropped}
        window = f"[{max(0, oldest_fresh_step(latest, k))}, {latest}]"
        logger.warning("restart: found %d spooled submissions; re-sending %d (policy steps %s), dropping %d already stale "
                       "(policy steps %s, outside the async window %s: the newest policy is step %d, async level %d)",
                       len(kept) + len(dropped), len(kept), _steps(kept), len(dropped), _steps(dropped), window, latest, k)

    # --- policy --------------------------------------------------------------------------------

    async def _ensure_policy(self) -> bool:
        """Hold a policy no older than latest − async_level; ``False`` means 'waited, try again'."""
        latest = self.follower.latest_step
        if latest < 0 or time.monotonic() - self._last_poll > POLL_INTERVAL_S * 5:
            self._last_poll = time.monotonic()
            latest = await self.follower.poll_latest()
        if latest < 0:
            self.state = "waiting for the first policy announcement"
            await self._sleep(LATE_RETRY_S)
            return False
        if self.policy_step >= latest:
            return True
        try:
            path = await self.follower.fetch(latest)
            await asyncio.to_thread(self._load, path)
            self.policy_step = latest
            self.m_step.set(latest)
            if self.gossip is not None:
                self.gossip.set_record(policy_step=latest)
            self._late_backoff.reset()
            self._late_log.recovered(f"policy step {latest} fetched")
            return True
        except FetchError as e:
            # the newest announced step stands in for the trainer step (a lower bound of it): protocol.window
            if in_window(self.policy_step, trainer_step=latest, async_level=self.spec.rl.async_level):
                logger.info("cannot fetch step %d yet (%s); generating with step %d", latest, e, self.policy_step)
                return True
            need = oldest_fresh_step(latest, self.spec.rl.async_level)
            self.state = f"late: hold step {self.policy_step}, need ≥ {need}; fetch failed: {e}"
            self._late_log.failed(self.state)
            await self._sleep(self._late_backoff.next_delay())
            return False

    def fp32_head(self) -> bool:
        """Whether the engine takes its logits from the float32 head: asked for, or a bf16 engine in a run
        whose tolerances were measured with float32 logits (``toploc.fp32_logits``; without them an
        honest bf16 worker's noise is larger than the run's bounds and the audit's baseline)."""
        return self.options.fp32_head or (self.options.dtype == "bfloat16" and self.spec.toploc.fp32_logits)

    def _load(self, path: Path) -> None:
        if self.engine is None:
            self.tokenizer = load_tokenizer(path)
            self.plan = self._fit(path)
            # vLLM pre-allocates its share, so it gets the plan's; torch's allocator is capped only at a share the operator set
            share = self.plan.memory_share if self.options.engine == "vllm" else self.options.gpu_memory_share
            engine = create_engine(self.options.engine, path, device=self.options.device, dtype=self.options.dtype,
                                   fp32_head=self.fp32_head(), max_batch=self.plan.max_batch, gpu_memory_share=share,
                                   max_model_len=self.plan.max_model_len)
            if self.options.adversary:
                from node.worker.adversary import adversary_engine

                engine = adversary_engine(self.options.adversary, engine, path, steer_rate=self.options.steer_rate, seed=self.key.peer_id)
            self.engine = engine
        else:
            self.engine.load_weights(path)
        logger.info("engine holds policy from %s", path)

    def _fit(self, path: Path) -> EnginePlan:
        """Size the engine for this machine (``node/engine/fit.py``) and say what was chosen.

        Raises:
            MachineTooSmall: the model and one sequence do not fit (naming the smallest machine that can).
        """
        import json

        from node.machine import probe_machine

        shape = ModelShape.from_config(json.loads((path / "config.json").read_text()), name=self.spec.model.base)
        work = Workload(sequences=self.spec.data.tasks_per_submission * self.spec.rl.group_size,
                        prompt_tokens=longest_prompt_tokens(self.tokenizer, self.tasks, self.spec),
                        completion_tokens=self.spec.sampling.max_tokens)
        device = "cuda" if self.options.device == "cuda" else "cpu"
        plan = plan_engine(shape, probe_machine(use_torch=True), work, engine="vllm" if self.options.engine == "vllm" else "transformers",
                           device=device, memory_share=self.options.gpu_memory_share, max_batch=self.options.max_batch,
                           dtype=self.options.dtype, fp32_head=self.fp32_head())
        if not plan.fits:
            raise MachineTooSmall(f"this machine cannot run the run's model: {plan.reason}; the smallest machine that can: "
                                  f"{smallest_machine(shape, work)}")
        print(f"worker fits the machine: {plan.line()}", flush=True)
        logger.info("engine plan: %s", plan.line())
        return plan

    def _on_announcement(self, env: Envelope[Any]) -> None:
        self.follower.note_step(env.body.step)
        if self.policy_step >= 0:  # fetch while generating with the held step (the first one the run loop fetches)
            self.follower.prefetch(env.body.step)

    def _on_verdict(self, env: Envelope[Verdict]) -> None:
        if env.body.worker == self.key.peer_id:
            self.verdicts[env.body.reason] = self.verdicts.get(env.body.reason, 0) + 1
            self.m_verdicts.labels(env.body.reason).inc()

    async def _send_loop(self) -> None:
        while not self._stop.is_set() or self.spool.pending():
            await self._kick.wait()
            self._kick.clear()
            await self.submitter.drain(deadline_s=None if not self._stop.is_set() else 5.0)
            self.m_spool.set(len(self.spool.pending()))
            if self.submitter.banned:
                logger.error("the coordinator banned this worker; stopping")
                self._stop.set()
            if self._stop.is_set():
                break

    async def _sleep(self, seconds: float) -> None:
        await sleep_unless(self._stop, seconds)

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows."""
        return {
            "role": "worker",
            "peer_id": self.key.peer_id,
            "state": self.state,
            "policy_step": self.policy_step,
            "latest_step": self.follower.latest_step,
            "submissions": self.submissions,
            "acked": self.submitter.acked,
            "refused": self.submitter.refused,
            "displaced": self.submitter.displaced,  # the ingest's count: its place taken, no verdict (docs/protocol.md "Quotas")
            "spooled": len(self.spool.pending()),
            "spool_restart": self.spool_restart,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.generate_s, 1) if self.generate_s else 0.0,
            "verdicts": self.verdicts,
            "peers": len(self.gossip.peers) if self.gossip is not None else 0,
            "engine_plan": self.plan.line() if self.plan is not None else None,
            **self._adversary_status(),
        }

    def _adversary_status(self) -> dict[str, Any]:
        """``adversary`` (its kind) and, for ``steer``, ``steering`` (its running counts); nothing for an honest worker."""
        if not self.options.adversary:
            return {}
        totals = getattr(self.engine, "totals", None)
        return {"adversary": self.options.adversary, **({"steering": totals.to_json()} if totals is not None else {})}


class MachineTooSmall(NodeError):
    """The run's model does not fit this machine (the message names the smallest machine that can)."""


PROMPT_MARGIN_TOKENS = 16
"""Added to the longest measured prompt: the length-control line and template vary by a few tokens."""
PROMPTS_MEASURED = 64
"""Prompts tokenized to bound the longest (the longest by characters; tokens follow characters closely)."""


def longest_prompt_tokens(tokenizer: Any, tasks: list[Any], spec: Any) -> int:
    """An upper estimate of the longest prompt a worker will encode, tokens: the exact encoding
    (:func:`protocol.rollout.encode_prompt`, with the longest target length) of the
    :data:`PROMPTS_MEASURED` longest prompts by characters, plus :data:`PROMPT_MARGIN_TOKENS`."""
    from protocol.rollout import encode_prompt

    target = max(spec.sampling.target_lengths, default=None)
    longest = sorted(tasks, key=lambda t: len(t.prompt), reverse=True)[:PROMPTS_MEASURED]
    return max((len(encode_prompt(tokenizer, t, target)) for t in longest), default=0) + PROMPT_MARGIN_TOKENS


def _steps(steps: list[int]) -> str:
    """``9, 10`` or ``none``; ``-1`` (an unreadable file) as ``unreadable``."""
    return ", ".join("unreadable" if s < 0 else str(s) for s in steps) or "none"


def run_worker_from_args(args: Any) -> int:
    """``join --role worker``: open the run (address or spec), load the key, run a :class:`Worker`
    until SIGINT/SIGTERM. Exit 1 with one line when the model does not fit this machine."""
    from node.cli import CliError, gossip_config, load_key, open_run_arg
    from node.paths import default_data_dir
    from protocol.artifacts import TASKS_ARTIFACT

    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if args.gpu_memory_share is not None and not 0.0 < args.gpu_memory_share <= 0.95:
        raise CliError("--gpu-memory-share must be in (0, 0.95]")
    if args.max_batch is not None and args.max_batch < 1:
        raise CliError("--max-batch must be at least 1")
    joined = open_run_arg(args, data_dir, artifacts=() if args.data_root else (TASKS_ARTIFACT,))  # before anything is written
    signed = joined.signed
    key = load_key(args.key, str(data_dir), create=True)
    gossip = gossip_config(args)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    ingest = list(args.ingest_url) or ([] if signed.spec.network.ingest_urls else joined.http_urls)
    options = WorkerOptions(
        data_dir=data_dir, engine=args.engine, device=device, data_root=Path(args.data_root) if args.data_root else None,
        artifacts=joined.artifacts, gpu_memory_share=args.gpu_memory_share, max_batch=args.max_batch,
        gossip=gossip, http_port=args.http_port, max_submissions=args.max_submissions, ingest_urls=ingest, adversary=args.adversary,
        dtype=args.dtype, fp32_head=args.fp32_logits, steer_rate=args.steer_rate,
    )
    try:
        asyncio.run(run_until_stopped(Worker(signed, key, options), f"worker {key.peer_id}"))
    except MachineTooSmall as e:
        import sys

        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
