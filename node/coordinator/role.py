"""The coordinator (rank 0): wires the parts and is the training loop's hooks.

Parts, each in its own module: the ingest (``trainer/ingest/``) and the Shardcast origin on one
HTTP port with ``/status``, ``/metrics`` and the run page (``node/web/``); the rollout buffer
(``trainer/buffer.py``: what each step trains on); the one training loop every rank runs
(``trainer/loop.py``) in a worker thread, so the event loop stays responsive; publishing
(``node/coordinator/publish.py``); held-out evaluation (``evaluate.py``); the ban re-check
(``recheck.py``); gossip. With ``torchrun --nproc-per-node N`` the other ranks run
:func:`follow_rank`: the trainer built the same way (:func:`build_trainer`) and the same loop
without hooks. Each trainer step: a batch of validator-accepted, fresh, whole groups → GRPO step
→ the policy written as safetensors → published into the origin (signed manifest) → announced on
gossip → the training state saved → the consumed rollouts retired (``docs/trainer.md``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from node.coordinator.base import prepare_base
from node.coordinator.evaluate import EvalResult, eval_row, evaluate
from node.coordinator.probe import PROBE_TASKS, SignalProbe, no_signal_advice, probe_learning_signal
from node.coordinator.publish import PolicyPublisher
from node.coordinator.recheck import CoordinatorRecheck
from node.engine.hf import TransformersEngine
from node.http_server import start_site
from node.p2p import GossipConfig, GossipNode
from node.retry import FailureLog
from node.shardcast import ShardcastServer, ShardcastStore
from node.web.runpage import RunPage
from protocol.dataset import resolve_tasks
from protocol.envelope import Envelope
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import Verdict
from protocol.models import config_int, load_model, load_tokenizer
from protocol.runspec import SignedRunSpec
from protocol.tasks import training_split_warning
from trainer.batch import Batch
from trainer.buffer import RolloutBuffer
from trainer.distributed import DistContext
from trainer.errors import NotEnoughRolloutsError, TrainerError
from trainer.ingest.service import error_middleware, open_ingest
from trainer.loop import LoopPaths, run_training, torch_dtype
from trainer.train import StepMetrics, Trainer, TrainerConfig

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.2
WAIT_LOG_INTERVAL_S = 30.0
"""A wait for a batch is logged (at WARNING, the default level) once it has lasted this many seconds,
then every this many seconds with its reason; shorter waits, the normal pause between steps, are not."""


@dataclass
class CoordinatorOptions:
    """Settings of ``intellect-train``.

    Attributes:
        data_dir: where the ingest store, origin store, policies, state and metrics live.
        host: HTTP interface; port: HTTP port (0: any) for ingest, origin, ``/status``, ``/metrics``.
        public_url: URL other nodes use to reach this server (default ``http://host:port``).
        gossip: gossip settings (``None``: off).
        max_steps: stop after this many trainer steps (``None``: run until stopped).
        resume: continue from the latest saved training state.
        batch_timeout_s: give up (exit with the reason) when no batch filled for this long, seconds.
        eval_samples: samples per held-out task in each evaluation (0: no evaluation).
        eval_every: also evaluate every this many steps (0: only at start and end); each evaluation
            is an ``eval`` row of ``metrics.jsonl`` with its 95 % interval (``evaluate.py``).
        data_root: directory of the public task sets.
        device: torch device of the trainer.
        probe_tasks: training tasks of the start-up learning-signal probe (0: no probe; ``probe.py``).
    """

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    public_url: str = ""
    gossip: GossipConfig | None = field(default_factory=GossipConfig)
    max_steps: int | None = None
    resume: bool = False
    batch_timeout_s: float = 600.0
    eval_samples: int = 8
    eval_every: int = 0
    data_root: Path | None = None
    device: str = "cpu"
    probe_tasks: int = PROBE_TASKS


class Coordinator:
    """Rank 0 of the coordinator: ``__init__`` (no I/O) → ``start`` → ``run`` → ``stop``."""

    def __init__(self, signed: SignedRunSpec, key: NodeKey, options: CoordinatorOptions, ctx: DistContext | None = None) -> None:
        if key.peer_id != signed.spec.run.coordinator:
            raise ValueError(f"key {key.peer_id} is not this run's coordinator ({signed.spec.run.coordinator})")
        self.signed = signed
        self.spec = signed.spec
        self.key = key
        self.options = options
        self.ctx = ctx or DistContext()
        self.data_dir = Path(options.data_dir)
        self.tasks = resolve_tasks(self.spec.data.tasks, options.data_root, self.spec.data.tasks_hash)
        # a validator's cheat verdict bans only once this independent re-check reproduces it
        recheck = CoordinatorRecheck(self.spec, signed.run_id, self.tasks.train, lambda: self.tokenizer,
                                     lambda step: self.publisher.policy_dir(step) if self.publisher else None,
                                     by=key.peer_id, device=options.device)
        self.ingest = open_ingest(self.data_dir, self.spec, key, trainer_step=lambda: self.trainer.step if self.trainer is not None else 0,
                                  latest_policy_step=lambda: self.published_step, recheck=recheck, on_ban=self._gossip_bans,
                                  on_verdict=self._verdict_applied, status_extra=self._status_extra)
        self.ledger = self.ingest.ledger
        self.bans = self.ledger.bans
        self.origin: ShardcastStore | None = None
        self.server: ShardcastServer | None = None
        self.run_page: RunPage | None = None
        self.gossip: GossipNode | None = None
        self.trainer: Trainer | None = None
        self.tokenizer: Any = None
        self.publisher: PolicyPublisher | None = None
        self.state = "starting"
        self.metrics_path = self.data_dir / "metrics.jsonl"
        self.eval_start: EvalResult | None = None
        self.eval_end: EvalResult | None = None
        self.eval_latest: dict[str, Any] | None = None  # the last eval row: step, pass rate, interval
        self._last_eval: EvalResult | None = None
        self.busy_s = 0.0
        self.wait_s = 0.0  # seconds the last batch took to fill (the trainer idle, waiting for accepted rollouts)
        self.started_s = time.monotonic()
        self.buffer = RolloutBuffer(self.ledger, self.spec.rl)
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.error: str | None = None
        self.base_dir: Path | None = None
        self.last_step: dict[str, Any] = {}
        self.signal_probe: SignalProbe | None = None
        self.wait_reason: str | None = None
        self._wait_log = FailureLog(logger, interval_s=WAIT_LOG_INTERVAL_S)
        self.m_train: dict[str, Any] = {}  # Prometheus gauges, made with the ingest's registry in start()
        from rich.console import Console

        self.console = Console(stderr=False, soft_wrap=True)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.state = "preparing the base model"
        trainer, base, self.tokenizer, pos = await asyncio.to_thread(build_trainer, self.signed, self.tasks, self.data_dir, self.ctx,
                                                                     resume=self.options.resume)
        self.trainer, self.base_dir, model = trainer, base, trainer.model
        # out-of-range token IDs are never trained; the bound validators and workers use (the config's vocab_size)
        self.buffer.vocab_size = config_int(model, "vocab_size")
        if pos is not None:
            n = self.buffer.restore(pos, trainer.step)
            logger.info("resumed at step %d; %d submissions from later steps trainable again", trainer.step, n)
        self.origin = await asyncio.to_thread(
            ShardcastStore, self.data_dir / "origin", run_id=self.signed.run_id, authorities=self.spec.authorities,
            keep_steps=self.spec.shardcast.keep_steps,
        )
        # one HTTP port: Shardcast origin routes + ingest + status/metrics
        self.server = ShardcastServer(self.origin, host=self.options.host, port=self.options.port, peer_id=self.key.peer_id)
        from prometheus_client import Gauge

        reg = self.ingest.registry
        self.m_train = {
            name: Gauge(f"intellect_trainer_{name}", doc, registry=reg)
            for name, doc in (
                ("step", "Trainer steps completed (policy step of the current weights)"),
                ("reward_mean", "Mean reward of the last batch"),
                ("pass_rate", "Pass rate (task reward 1) of the last batch"),
                ("loss", "GRPO loss of the last step"),
                ("grad_norm", "Gradient norm of the last step, before clipping"),
                ("clipped_frac", "Fraction of loss tokens clipped in the last step"),
                ("entropy", "Mean policy entropy of the last step, nats"),
                ("tokens_per_s", "Trainer tokens per second in the last step"),
                ("utilization", "Trainer busy time over wall time"),
                ("heldout_pass_rate", "Latest held-out pass rate"),
                ("mismatch_kl", "KL(behavior || trainer) of the last step's sampled tokens (k3 estimate), nats"),
            )
        }
        app = self.server.make_app()
        app.middlewares.append(error_middleware)
        self.ingest.add_routes(app)
        self.run_page = RunPage(self.signed, self.ledger, status=self.ingest.status, metrics_path=self.metrics_path,
                                peer_id=self.key.peer_id, archive_dir=self.data_dir / "run-page")  # final state kept at stop
        self.run_page.add_routes(app)  # GET / (the run page) and GET /api/run
        running = await start_site(app, self.options.host, self.options.port)  # header timeout, per-IP cap, no compressed bodies
        self._runner, port = running.runner, running.port
        self.url = self.options.public_url or f"http://{self.options.host}:{port}"
        self.server.port = port
        self.run_page.url = self.url
        if self.options.gossip is not None:
            self.gossip = await GossipNode.create(self.spec, self.key, self.options.gossip, role="coordinator", http_url=self.url)
            self.gossip.on_verdict(self._apply_gossip_verdict)
            self.run_page.attach_gossip(self.gossip)
        await self.run_page.start()
        self.publisher = PolicyPublisher(self.origin, self.key, self.signed, self.data_dir / "policies", self.url, self._announce)
        await asyncio.to_thread(self.publisher.start, trainer.step, self.base_dir)
        if trainer.step == 0:
            cfg = getattr(model, "config", None)
            self._log_metrics({"event": "run", "tasks": self.spec.data.tasks, "tasks_hash": self.tasks.hash,
                               "train_problems": len(self.tasks.train), "heldout_problems": len(self.tasks.heldout),
                               "model": self.spec.model.base, "dtype": self.spec.model.dtype,
                               "hidden_size": getattr(cfg, "hidden_size", None), "layers": getattr(cfg, "num_hidden_layers", None),
                               "vocab_size": getattr(cfg, "vocab_size", None), "parameters": sum(p.numel() for p in model.parameters()),
                               "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
                               "eval_every": self.options.eval_every, "eval_samples": self.options.eval_samples})
        if (split_warning := training_split_warning(self.spec.data.tasks)) is not None:
            logger.warning(split_warning)
        if self.options.probe_tasks and trainer.step == 0:
            self.state = "probing the base model for a learning signal"
            self.signal_probe = await asyncio.to_thread(self._probe)
            if self.signal_probe.warning:
                logger.warning(self.signal_probe.warning)
            else:
                logger.info("learning-signal probe: %d of %d groups have a reward spread (pass rate %.2f)",
                            self.signal_probe.groups_with_spread, self.signal_probe.groups, self.signal_probe.pass_rate)
        if self.options.eval_samples:
            self.state = "evaluating the initial policy on held-out tasks"
            self.eval_start = await asyncio.to_thread(self._evaluate_and_log)
        self.started_s = time.monotonic()

    async def run(self) -> None:
        """Train until ``max_steps`` or a stop request; raises :class:`TrainerError` on a batch timeout."""
        await asyncio.to_thread(self._train_loop)
        if self._stop.is_set() and self.options.eval_samples:
            # stopped by SIGTERM/Ctrl-C: stop now (a CPU evaluation can take long); --resume continues the run
            logger.warning("stop requested: no final held-out evaluation (the latest is of step %s); state saved at step %d",
                           self.eval_latest["step"] if self.eval_latest else "-", self.trainer.step if self.trainer else 0)
        elif self.options.eval_samples and self.trainer is not None:
            self.state = "evaluating the final policy on held-out tasks"
            if self.eval_latest is not None and self.eval_latest["step"] == self.published_step and self._last_eval is not None:
                self.eval_end = self._last_eval  # the periodic evaluation already covered the last step
            else:
                self.eval_end = await asyncio.to_thread(self._evaluate_and_log)
        self.state = "done" if self.error is None else f"stopped: {self.error}"
        self._log_metrics({"event": "end", "step": self.trainer.step if self.trainer else 0, "error": self.error,
                           "utilization": self.utilization()})
        if self.error:
            raise TrainerError(self.error)

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        self._stop.set()
        if self.run_page is not None:
            await self.run_page.stop()
        if self.gossip is not None:
            await self.gossip.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        self.ingest.close()
        self.ledger.close()

    # --- training (worker thread) --------------------------------------------------------------

    def _train_loop(self) -> None:
        assert self.trainer is not None
        paths = LoopPaths(policies=self.data_dir / "policies", state=self.data_dir / "state", base=self.base_dir)
        run_training(self.trainer, self.ctx, paths, publish_every=self.spec.rl.publish_every, dtype=torch_dtype(self.spec.model.dtype),
                     hooks=self, stop=self._stop, max_steps=self.options.max_steps)

    # --- the loop's hooks (trainer.loop.StepHooks; training thread, never a collective) ----------

    def position(self) -> dict[str, Any]:
        return self.buffer.position()

    def published(self, step: int, files: list[Path]) -> None:
        assert self.publisher is not None
        self.publisher.publish(step, files)

    def step_done(self, batch: Batch, m: StepMetrics) -> None:
        assert self.trainer is not None
        self.busy_s += m.step_time_s
        self.buffer.retire(self.buffer.consume(batch), self.trainer.step)
        row = {"event": "step", **m.as_dict(), "utilization": self.utilization(), "broadcast_s": self.publisher.publish_s.get(self.trainer.step) if self.publisher else None,
               "wait_s": round(self.wait_s, 3), "wall_s": round(time.monotonic() - self.started_s, 3), "verdicts": self.ledger.verdict_reasons(),
               "banned": len(self.bans.entries())}
        self._log_metrics(row)
        self.last_step = {k: row[k] for k in ("step", "reward_mean", "pass_rate", "loss", "staleness", "tokens_per_s", "mismatch_kl",
                                              "is_ratio_mean", "is_ratio_min", "is_ratio_max", "clipped_frac")}
        for name, value in (("step", m.step), ("reward_mean", m.reward_mean), ("pass_rate", m.pass_rate), ("loss", m.loss),
                            ("grad_norm", m.grad_norm), ("clipped_frac", m.clipped_frac), ("entropy", m.entropy_mean),
                            ("tokens_per_s", m.tokens_per_s), ("utilization", self.utilization()), ("mismatch_kl", m.mismatch_kl)):
            self.m_train[name].set(value)
        logger.info("step %d: reward %.3f pass %.3f loss %.4f grad %.3f (%d groups, staleness %s)", m.step, m.reward_mean,
                    m.pass_rate, m.loss, m.grad_norm, m.num_groups, m.staleness, extra={"step": m.step})
        self.console.print(
            f"[bold]step {m.step}[/bold]  reward {m.reward_mean:.3f}  pass {m.pass_rate:.3f}  loss {m.loss:+.4f}  "
            f"grad {m.grad_norm:.3f}  clipped {m.clipped_frac:.3f}  entropy {m.entropy_mean:.3f}  mismatch KL {m.mismatch_kl:.4f}  "
            f"ratio {m.is_ratio_min:.2f}-{m.is_ratio_max:.2f}  {m.tokens_per_s:.0f} tok/s  "
            f"staleness {m.staleness}  utilization {self.utilization():.2f}",
            highlight=False,
        )
        if self.options.eval_every and self.trainer.step % self.options.eval_every == 0 and self.options.eval_samples:
            self.state = f"evaluating policy step {self.trainer.step} on held-out tasks"
            self._evaluate_and_log()

    def next_batch(self) -> Batch | None:
        """Block until the buffer fills the next step's batch; ``None`` on stop or batch timeout."""
        assert self.trainer is not None
        step = self.trainer.step
        t0 = time.monotonic()
        last_reason = ""
        while not self._stop.is_set():
            try:
                batch = self.buffer.next_batch(step)
                self.wait_s = time.monotonic() - t0
                self.state = f"training step {step + 1}"  # not the last wait's reason, which would stay up all run
                self.wait_reason = None
                self._wait_log.recovered(f"batch for step {step} filled")
                return batch
            except NotEnoughRolloutsError as e:
                last_reason = str(e)
                if e.zero_advantage_groups and not e.usable_groups and not e.stale_groups:
                    probe = self.signal_probe
                    last_reason += (f"; every group so far had equal rewards: "
                                    f"{no_signal_advice(self.spec, probe.pass_rate if probe else 0.0, probe.capped_fraction if probe else 0.0)}")
                self.state = f"waiting for a batch: {last_reason}"
                self.wait_reason = last_reason
                if time.monotonic() - t0 >= WAIT_LOG_INTERVAL_S:
                    self._wait_log.failed(f"waiting {time.monotonic() - t0:.0f} s for a batch for step {step + 1}: {last_reason}")
            waited = time.monotonic() - t0
            if waited > self.options.batch_timeout_s:
                self.error = f"no batch for step {step} after {waited:.0f} s: {last_reason}"
                self.wait_reason = self.error
                logger.error(self.error)
                return None
            self._stop.wait(WAIT_POLL_S)
        return None

    @property
    def published_step(self) -> int:
        """The newest policy step published (−1 before the base is)."""
        return self.publisher.published_step if self.publisher is not None else -1

    def _announce(self, step: int, announcement: bytes, publish_s: float) -> None:
        """A policy step is in the origin: show it on the run page and announce it on gossip."""
        if self.run_page is not None:
            self.run_page.propagation.note_published(step, publish_s)
        if self.gossip is not None and self._loop is not None:
            self.gossip.set_record(policy_step=step)
            asyncio.run_coroutine_threadsafe(self.gossip.publish_announcement(announcement), self._loop)

    def _probe(self) -> SignalProbe:
        """The start-up learning-signal probe on the published base (``node/coordinator/probe.py``)."""
        engine = TransformersEngine.from_dir(self.data_dir / "policies" / f"step-{self.published_step}")
        return probe_learning_signal(self.spec, engine, self.tokenizer, self.tasks.train, n_tasks=self.options.probe_tasks)

    def _evaluate(self) -> EvalResult:
        assert self.trainer is not None
        path = self.data_dir / "policies" / f"step-{self.published_step}"
        engine = TransformersEngine.from_dir(path)
        return evaluate(self.spec, engine, self.tokenizer, self.tasks.heldout, self.options.eval_samples)

    def _evaluate_and_log(self) -> EvalResult:
        """Evaluate the published policy on the held-out tasks; log the ``eval`` row (with its 95 % interval)."""
        assert self.trainer is not None
        r = self._evaluate()
        row = eval_row(self.published_step, r)
        self._log_metrics(row)
        self._last_eval = r
        self.eval_latest = {k: row[k] for k in ("step", "heldout_pass_rate", "heldout_ci_low", "heldout_ci_high")}
        logger.warning("held-out pass rate at step %d: %.3f (95%% interval %.3f-%.3f, %d problems x %d samples)", row["step"],
                       r.pass_rate, row["heldout_ci_low"], row["heldout_ci_high"], row["problems"], r.samples_per_task)
        return r

    # --- gossip glue (asyncio loop) ------------------------------------------------------------

    def _verdict_applied(self, env: Envelope[Verdict], gossip: bool) -> None:
        if self.run_page is not None:
            self.run_page.note_verdict(env)  # a ban's evidence on the run page
        if gossip:  # posted over HTTP; one that came on gossip is already there
            self._gossip_verdict(env.raw)

    def _gossip_verdict(self, raw: bytes) -> None:
        if self.gossip is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._safe_publish("verdict", raw)))

    def _gossip_bans(self, raw: bytes) -> None:
        if self.gossip is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._safe_publish("ban", raw)))

    async def _safe_publish(self, kind: str, raw: bytes) -> None:
        assert self.gossip is not None
        try:
            if kind == "verdict":
                await self.gossip.publish_verdict(raw)
            else:
                await self.gossip.publish_ban_list(raw)
        except Exception as e:  # noqa: BLE001 - gossip is best effort: HTTP remains the source of truth
            logger.debug("gossip publish of %s failed: %s", kind, e)

    def _apply_gossip_verdict(self, env: Envelope[Verdict]) -> None:
        """A verdict from gossip, already verified there (signed by a validator of the spec): applied as is."""
        try:
            self.ingest.apply_verdict(env, via_gossip=True)
        except ProtocolError as e:
            logger.debug("ignoring gossiped verdict: %s", e)

    # --- status -------------------------------------------------------------------------------

    def utilization(self) -> float:
        """Trainer busy time / wall time since training started."""
        wall = time.monotonic() - self.started_s
        return round(self.busy_s / wall, 4) if wall > 0 else 0.0

    def _status_extra(self) -> dict[str, Any]:
        peers: dict[str, int] = {}
        if self.gossip is not None:
            for p in self.gossip.peers.alive():
                peers[p.role] = peers.get(p.role, 0) + 1
        return {
            "role": "coordinator",
            "peer_id": self.key.peer_id,
            "state": self.state,
            "published_step": self.published_step,
            "utilization": self.utilization(),
            "heldout_start": self.eval_start.pass_rate if self.eval_start else None,
            "heldout_end": self.eval_end.pass_rate if self.eval_end else None,
            "heldout_latest": self.eval_latest,
            "peers_by_role": peers,
            "broadcast_s": {str(k): round(v, 3) for k, v in list(self.publisher.publish_s.items())[-5:]} if self.publisher else {},
            "last_step": self.last_step,
            "wait_reason": self.wait_reason,
            "signal_probe": self.signal_probe.as_dict() if self.signal_probe else None,
            # the probe's prediction stands until a step trains: then the run has shown it learns
            "warnings": [w for w in (self.signal_probe.warning if self.signal_probe and not self.last_step else None,) if w],
        }

    def _log_metrics(self, row: dict[str, Any]) -> None:
        if row.get("event") == "eval" and self.m_train:
            self.m_train["heldout_pass_rate"].set(row["heldout_pass_rate"])
        row = {"ts": round(time.time(), 3), **row}
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row, default=_json_default) + "\n")


def build_trainer(signed: SignedRunSpec, tasks: Any, data_dir: Path, ctx: DistContext, *,
                  resume: bool = False) -> tuple[Trainer, Path, Any, dict[str, Any] | None]:
    """The trainer every rank builds the same way: base model (``node/coordinator/base.py``; ranks
    > 0 prepare their own copy, the weights come from rank 0 when sharding), tokenizer's pad ID,
    the spec's trainer config, and the saved state when resuming. Collective when distributed.

    Returns:
        ``(trainer, base directory, tokenizer, data position)``; the position is ``None`` unless a
        state was loaded (and ``{}`` on ranks > 0).
    """
    spec = signed.spec
    if ctx.distributed and not ctx.is_main:
        _barrier()  # rank 0 builds (or finds) the machine-wide cached base first; the others copy it
    base = prepare_base(spec, tasks, Path(data_dir) / ("base" if ctx.is_main else f"base-rank{ctx.rank}"))
    if ctx.distributed and ctx.is_main:
        _barrier()
    tokenizer = load_tokenizer(base)
    cfg = TrainerConfig.from_spec(spec)
    cfg = TrainerConfig(**{**cfg.__dict__, "pad_token_id": int(tokenizer.pad_token_id or 0)})
    trainer = Trainer(load_model(base), cfg, ctx)
    pos = None
    if resume and (Path(data_dir) / "state" / "latest").exists():
        pos = trainer.load_state(Path(data_dir) / "state")
    return trainer, base, tokenizer, pos


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def follow_rank(signed: SignedRunSpec, data_dir: Path, ctx: DistContext, *, resume: bool = False, data_root: Path | None = None) -> None:
    """Ranks > 0 under torchrun: the trainer built as on rank 0 (:func:`build_trainer`) and the same
    loop (:func:`trainer.loop.run_training`) without hooks; it ends when rank 0's does.

    ``data_root`` is the directory of the public task sets (``--data-root``), needed for a named
    ``data.tasks`` exactly as on rank 0.
    """
    spec = signed.spec
    tasks = resolve_tasks(spec.data.tasks, data_root, spec.data.tasks_hash)
    trainer, base, _, _ = build_trainer(signed, tasks, data_dir, ctx, resume=resume)
    paths = LoopPaths(policies=Path(data_dir) / "policies", state=Path(data_dir) / "state", base=base)
    run_training(trainer, ctx, paths, publish_every=spec.rl.publish_every, dtype=torch_dtype(spec.model.dtype), hooks=None)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)
