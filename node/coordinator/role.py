"""The coordinator (rank 0): wires the parts and is the training loop's hooks.

Parts, each in its own module: the ingest (``trainer/ingest/``, the HTTP face of the submission
ledger ``trainer/ledger/``) and the Shardcast origin on one HTTP port with ``/status``,
``/metrics`` and the run page (``node/web/``); the rollout buffer (``trainer/buffer.py``: what
each step trains on); the one training loop every rank runs (``trainer/loop.py``) in a worker
thread, so the event loop stays responsive; publishing (``publish.py``); held-out evaluation and
its schedule (``evaluate.py``); the learning-signal probe (``probe.py``); the ban re-check
(``recheck.py``); gossip (``gossip.py``); Prometheus gauges and ``metrics.jsonl``
(``metrics.py``); the console line per step (``console.py``). With ``torchrun --nproc-per-node N`` the other ranks run
:func:`follow_rank`: the trainer built the same way (:func:`build_trainer`) and the same loop
without hooks. Each trainer step: a batch of validator-accepted, fresh, whole groups → GRPO step
→ the policy written as safetensors → published into the origin (signed manifest) → announced on
gossip → the training state saved → the consumed rollouts retired (``docs/trainer.md``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from node.coordinator.base import prepare_base
from node.coordinator.calibrate import AuditCalibration
from node.coordinator.console import StepConsole
from node.coordinator.evaluate import HeldOutSchedule
from node.coordinator.gossip import CoordinatorGossip
from node.coordinator.metrics import MetricsLog, TrainerGauges
from node.coordinator.probe import PROBE_TASKS, SignalProbe, no_signal_advice, probe_learning_signal
from node.coordinator.publish import PolicyPublisher
from node.coordinator.recheck import CoordinatorRecheck
from node.engine.hf import TransformersEngine
from node.errors import ShardcastError
from node.http_server import start_site
from node.p2p import GossipConfig
from node.reach import DialBack
from node.retry import FailureLog
from node.shardcast import ShardcastServer, ShardcastStore
from node.shardcast.publish import publish_artifact
from node.web.runpage import RunPage
from protocol.address import format_run_address
from protocol.artifacts import TASKS_ARTIFACT
from protocol.dataset import resolve_run_tasks, tasks_artifact_files
from protocol.envelope import Envelope
from protocol.identity import NodeKey
from protocol.messages import Verdict
from protocol.models import config_int, load_model, load_tokenizer
from protocol.runspec import SignedRunSpec, dump_run_spec
from protocol.step_dirs import step_dir
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
then every this many seconds with its reason; shorter waits, the normal pause between steps, are not
(the default of ``CoordinatorOptions.wait_log_interval_s``, ``intellect-train --wait-log-every``)."""


@dataclass
class CoordinatorOptions:
    """Settings of ``intellect-train``.

    Attributes:
        data_dir: where the ingest store, origin store, policies, state and metrics live.
        host: HTTP interface; port: HTTP port (0: any) for ingest, origin, ``/status``, ``/metrics``.
        public_url: URL other nodes use to reach this server (default ``http://host:port``).
        gossip: gossip settings (``None``: off).
        max_steps: stop after this many trainer steps (``None``: run until stopped).
        linger_s: after the last step, keep serving for up to this many seconds or until stopped (:meth:`Coordinator.linger`).
        resume: continue from the latest saved training state.
        batch_timeout_s: give up (exit with the reason) when no batch filled for this long, seconds.
        eval_samples: samples per held-out task in each evaluation (0: no evaluation).
        eval_every: also evaluate every this many steps (0: only at start and end); each evaluation
            is an ``eval`` row of ``metrics.jsonl`` with its 95 % interval (``evaluate.py``).
        data_root: directory of the public task sets.
        device: torch device of the trainer.
        probe_tasks: training tasks of the start-up learning-signal probe (0: no probe; ``probe.py``).
        wait_log_interval_s: a wait for a batch is logged at WARNING once it lasted this long, then
            this often, seconds (:data:`WAIT_LOG_INTERVAL_S`).
    """

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    public_url: str = ""
    gossip: GossipConfig | None = field(default_factory=GossipConfig)
    max_steps: int | None = None
    linger_s: float = 0.0
    resume: bool = False
    batch_timeout_s: float = 600.0
    eval_samples: int = 8
    eval_every: int = 0
    data_root: Path | None = None
    device: str = "cpu"
    probe_tasks: int = PROBE_TASKS
    wait_log_interval_s: float = WAIT_LOG_INTERVAL_S


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
        self.tasks = resolve_run_tasks(self.spec, options.data_root)
        # a validator's cheat verdict bans only once this independent re-check reproduces it
        recheck = CoordinatorRecheck(self.spec, signed.run_id, self.tasks.train, lambda: self.tokenizer,
                                     lambda step: self.publisher.policy_dir(step) if self.publisher else None,
                                     by=key.peer_id, device=options.device)
        self.ingest = open_ingest(self.data_dir, self.spec, key, trainer_step=lambda: self.trainer.step if self.trainer is not None else 0,
                                  latest_policy_step=lambda: self.published_step, recheck=recheck, on_ban=self._gossip_bans,
                                  on_verdict=self._verdict_applied, status_extra=self._status_extra)
        self.ledger = self.ingest.ledger
        self.bans = self.ledger.bans
        audit = self.ingest.ban_rule.audit
        # the audit's honest baseline, measured on this run's own policies in the workers' dtype
        self.calibration = AuditCalibration(self.spec, signed.run_id, self.tasks.train, lambda: self.tokenizer,
                                            lambda step: self.publisher.policy_dir(step) if self.publisher else None, recheck.model, audit,
                                            device=options.device) if audit is not None else None
        self.origin: ShardcastStore | None = None
        self.server: ShardcastServer | None = None
        self.run_page: RunPage | None = None
        self.gossip: CoordinatorGossip | None = None
        self.trainer: Trainer | None = None
        self.tokenizer: Any = None
        self.publisher: PolicyPublisher | None = None
        self.state = "starting"
        self.metrics_path = self.data_dir / "metrics.jsonl"
        self.gauges = TrainerGauges(self.ingest.registry)  # one /metrics: the ingest's registry
        self.metrics = MetricsLog(self.metrics_path, self.gauges)
        self.console = StepConsole()
        self.heldout = HeldOutSchedule(self.spec, self.tasks.heldout, samples=options.eval_samples, every=options.eval_every,
                                       policy_dir=lambda step: step_dir(self.data_dir / "policies", step), tokenizer=lambda: self.tokenizer,
                                       log=self.metrics.write)
        self.busy_s = 0.0
        self.wait_s = 0.0  # seconds the last batch took to fill (the trainer idle, waiting for accepted rollouts)
        self.started_s = time.monotonic()
        self.buffer = RolloutBuffer(self.ledger, self.spec.rl)
        self._stop = threading.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.error: str | None = None
        self.base_dir: Path | None = None
        self.last_step: dict[str, Any] = {}
        self.signal_probe: SignalProbe | None = None
        self.wait_reason: str | None = None
        self._wait_log = FailureLog(logger, interval_s=options.wait_log_interval_s)
        self._timing: dict[str, float] = {}  # monotonic marks of the current step: batch ready, policy written, published

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.origin = await asyncio.to_thread(
            ShardcastStore, self.data_dir / "origin", run_id=self.signed.run_id, authorities=self.spec.authorities,
            keep_steps=self.spec.shardcast.keep_steps,
        )
        await asyncio.to_thread(self._publish_artifacts)  # before the model: files that are not the pinned ones refuse at once
        self.state = "preparing the base model"
        trainer, base, self.tokenizer, pos = await asyncio.to_thread(build_trainer, self.signed, self.tasks, self.data_dir, self.ctx,
                                                                     resume=self.options.resume)
        self.trainer, self.base_dir, model = trainer, base, trainer.model
        # out-of-range token IDs are never trained; the bound validators and workers use (the config's vocab_size)
        self.buffer.vocab_size = config_int(model, "vocab_size")
        if pos is not None:
            n = await asyncio.to_thread(self.buffer.resume, trainer.step, pos)
            logger.info("resumed at step %d; %d submissions from later steps trainable again", trainer.step, n)
        # one HTTP port: Shardcast origin routes + ingest + status/metrics + the signed spec (a run address's newcomers read it)
        self.server = ShardcastServer(self.origin, host=self.options.host, port=self.options.port, peer_id=self.key.peer_id)
        self.server.run_spec = dump_run_spec(self.signed).encode()
        app = self.server.make_app()
        app.middlewares.append(error_middleware)
        self.ingest.add_routes(app)
        DialBack(self.signed.run_id).add_routes(app)  # doctor --role relay: "can others reach me?" (node/reach.py: its bounds)
        self.run_page = RunPage(self.signed, self.ledger, status=self.ingest.status, metrics_path=self.metrics_path,
                                peer_id=self.key.peer_id, archive_dir=self.data_dir / "run-page")  # final state kept at stop
        self.run_page.add_routes(app)  # GET / (the run page) and GET /api/run
        running = await start_site(app, self.options.host, self.options.port)  # header timeout, per-IP cap, no compressed bodies
        self._runner, port = running.runner, running.port
        self.url = self.options.public_url or f"http://{self.options.host}:{port}"
        self.server.port = port
        self.run_page.url = self.url
        if self.options.gossip is not None:
            ingest = self.ingest
            self.gossip = await CoordinatorGossip.create(self.spec, self.key, self.options.gossip, http_url=self.url,
                                                         apply_verdict=lambda env: ingest.apply_verdict(env, via_gossip=True))
            self.run_page.attach_gossip(self.gossip.node)
            self.gossip.node.register_metrics(self.ingest.registry)  # intellect_gossip_* on the one /metrics
        await self.run_page.start()
        self.publisher = PolicyPublisher(self.origin, self.key, self.signed, self.data_dir / "policies", self.url, self._announce)
        await asyncio.to_thread(self.publisher.start, trainer.step, self.base_dir)
        if self.calibration is not None:
            self.calibration.published(self.published_step)  # the baseline from the first policy workers run
        if trainer.step == 0:
            cfg = getattr(model, "config", None)
            self.metrics.write({"event": "run", "tasks": self.spec.data.tasks, "tasks_hash": self.tasks.hash,
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
            await asyncio.to_thread(self.heldout.initial, self.published_step)
        self.started_s = time.monotonic()

    def _publish_artifacts(self) -> None:
        """Serve the artifacts the spec pins from the origin (``docs/shardcast.md`` §10): the training
        task list as the ``tasks`` artifact, built from this coordinator's task files.

        Raises:
            TrainerError: the files here make another artifact than the spec pins (one line naming both).
        """
        assert self.origin is not None
        expected = self.spec.artifact_id(TASKS_ARTIFACT)
        if expected is None:
            return
        try:
            publish_artifact(self.origin, TASKS_ARTIFACT, tasks_artifact_files(self.tasks.train), expected_id=expected)
        except ShardcastError as e:
            raise TrainerError(str(e)) from None

    def run_address(self) -> str:
        """The run's address (``protocol.address``): this coordinator's peer ID, the run ID's prefix, its
        public HTTP URL and its libp2p addresses (loopback ones only when it has no other)."""
        boot = list(self.gossip.node.addrs) if self.gossip is not None else []
        routable = [a for a in boot if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
        return format_run_address(self.key.peer_id, self.signed.run_id, [self.url], (routable or boot)[:8])

    async def run(self) -> None:
        """Train until ``max_steps`` or a stop request; raises :class:`TrainerError` on a batch timeout."""
        await asyncio.to_thread(self._train_loop)
        if self._stop.is_set() and self.options.eval_samples:
            # stopped by SIGTERM/Ctrl-C: stop now (a CPU evaluation can take long); --resume continues the run
            logger.warning("stop requested: no final held-out evaluation (the latest is of step %s); state saved at step %d",
                           self.heldout.latest["step"] if self.heldout.latest else "-", self.trainer.step if self.trainer else 0)
        elif self.options.eval_samples and self.trainer is not None:
            self.state = "evaluating the final policy on held-out tasks"
            await asyncio.to_thread(self.heldout.final, self.published_step)
        self.state = "done" if self.error is None else f"stopped: {self.error}"
        self.metrics.write({"event": "end", "step": self.trainer.step if self.trainer else 0, "error": self.error,
                           "utilization": self.utilization()})
        if self.error:
            raise TrainerError(self.error)

    async def linger(self) -> None:
        """After :meth:`run` ended at ``max_steps``: keep the origin, ``/status`` and gossip serving for up to
        ``options.linger_s`` seconds or until a stop request (SIGTERM, Ctrl-C). The last step is announced the
        moment it is published, and relays and nodes fetch it after that: an origin that closed at once could
        leave a node holding no source of it (the devnet waits here until every node holds it, then stops the
        coordinator). Polls the stop request every 0.2 s."""
        if self.options.linger_s <= 0 or self._stop.is_set():
            return
        logger.info("run done: serving the final policy step %d for up to %.0f s (--linger) or until stopped",
                    self.published_step, self.options.linger_s)
        end = time.monotonic() + self.options.linger_s
        while time.monotonic() < end and not self._stop.is_set():
            await asyncio.sleep(0.2)

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
        if self.calibration is not None:
            await asyncio.to_thread(self.calibration.close)
        self.ingest.close()
        self.ledger.close()

    # --- training (worker thread) --------------------------------------------------------------

    def _train_loop(self) -> None:
        assert self.trainer is not None
        paths = LoopPaths(policies=self.data_dir / "policies", state=self.data_dir / "state", base=self.base_dir)
        run_training(self.trainer, self.ctx, paths, publish_every=self.spec.rl.publish_every, dtype=torch_dtype(self.spec.model.dtype),
                     hooks=self, stop=self._stop, max_steps=self.options.max_steps)

    # --- the loop's hooks (trainer.loop.StepHooks; training thread, never a collective) ----------

    def consumed(self, batch: Batch, step: int) -> None:
        self.buffer.consume(batch, step)

    def published(self, step: int, files: list[Path]) -> None:
        assert self.publisher is not None
        self._timing["written"] = time.monotonic()
        self.publisher.publish(step, files)
        self._timing["published"] = time.monotonic()
        if self.calibration is not None:
            self.calibration.published(step)

    def step_done(self, batch: Batch, m: StepMetrics) -> None:
        assert self.trainer is not None
        self.busy_s += m.step_time_s
        self.buffer.retire(self.trainer.step)
        row = {"event": "step", **m.as_dict(), "utilization": self.utilization(), "broadcast_s": self.publisher.publish_s.get(self.trainer.step) if self.publisher else None,
               "wait_s": round(self.wait_s, 3), "wall_s": round(time.monotonic() - self.started_s, 3), "verdicts": self.ledger.verdict_reasons(),
               "banned": len(self.bans.entries()), **self._step_timing(m)}
        self.metrics.write(row)
        self.last_step = {k: row[k] for k in ("step", "reward_mean", "pass_rate", "loss", "staleness", "tokens_per_s", "mismatch_kl",
                                              "is_ratio_mean", "is_ratio_min", "is_ratio_max", "clipped_frac")}
        self.gauges.step(m, self.utilization())
        logger.info("step %d: reward %.3f pass %.3f loss %.4f grad %.3f (%d groups, staleness %s)", m.step, m.reward_mean,
                    m.pass_rate, m.loss, m.grad_norm, m.num_groups, m.staleness, extra={"step": m.step})
        self.console.step(m, self.utilization())
        if self.heldout.due(self.trainer.step):
            self.state = f"evaluating policy step {self.trainer.step} on held-out tasks"
            self.heldout.run(self.published_step)

    def _step_timing(self, m: StepMetrics) -> dict[str, Any]:
        """The rest of the step's timeline on the coordinator (``docs/devnet.md``; the batch wait is
        ``wait_s``), seconds: ``save_s`` (writing the policy, from the end of the train step),
        ``state_s`` (saving the training state), and from the publisher ``published_at`` (Unix
        seconds of the announcement), ``checkpoint_bytes`` and ``delta_bytes`` (``None``: no delta)."""
        t = self._timing
        out: dict[str, Any] = {}
        if "written" in t and "batch" in t:
            out["save_s"] = round(max(0.0, t["written"] - t["batch"] - m.step_time_s), 3)
        if "published" in t:
            out["state_s"] = round(time.monotonic() - t["published"], 3)
        step = self.trainer.step if self.trainer is not None else -1
        if self.publisher is not None and step in self.publisher.sizes:
            out["checkpoint_bytes"], out["delta_bytes"] = self.publisher.sizes[step]
            out["published_at"] = round(self.publisher.published_at[step], 3)
        self._timing = {}
        return out

    def next_batch(self) -> Batch | None:
        """Block until the buffer fills the next step's batch; ``None`` on stop or batch timeout."""
        assert self.trainer is not None
        step = self.trainer.step
        t0 = time.monotonic()
        last_reason = ""
        while not self._stop.is_set():
            held = self._audit_hold()
            if held is not None:
                last_reason = held
                self.state = f"waiting for a batch: {held}"
                self.wait_reason = held
            else:
                try:
                    batch = self.buffer.next_batch(step)
                    self.wait_s = time.monotonic() - t0
                    self._timing = {"batch": time.monotonic()}
                    self.state = f"training step {step + 1}"  # not the last wait's reason, which would stay up all run
                    self.wait_reason = None
                    self._wait_log.recovered(f"batch for step {step} filled")
                    return batch
                except NotEnoughRolloutsError as e:
                    last_reason = str(e)
                    if e.zero_advantage_groups and not e.usable_groups:
                        probe = self.signal_probe
                        last_reason += (f"; every group so far had equal rewards: "
                                        f"{no_signal_advice(self.spec, probe.pass_rate if probe else 0.0, probe.capped_fraction if probe else 0.0)}")
                    self.state = f"waiting for a batch: {last_reason}"
                    self.wait_reason = last_reason
            if time.monotonic() - t0 >= self.options.wait_log_interval_s:
                self._wait_log.failed(f"waiting {time.monotonic() - t0:.0f} s for a batch for step {step + 1}: {last_reason}")
            waited = time.monotonic() - t0
            if waited > self.options.batch_timeout_s:
                self.error = f"no batch for step {step} after {waited:.0f} s: {last_reason}"
                self.wait_reason = self.error
                logger.error(self.error)
                return None
            self._stop.wait(WAIT_POLL_S)
        return None

    def _audit_hold(self) -> str | None:
        """Why no step may train yet because of the per-worker audit (``docs/toploc.md`` §11), or ``None``.

        Until the audit's honest baseline is ready, verdicts are kept, not counted, so nothing may be
        trained: a worker whose work all arrived before the baseline would otherwise be trained on
        before its test could run. Once ready, the kept verdicts are counted and every worker they
        convict is banned (its accepted work withdrawn) before the batch is assembled."""
        audit = self.ingest.ban_rule.audit if self.ingest is not None else None
        if audit is None or not audit.enabled:
            return None
        if not audit.ready():
            return (f"the audit's honest baseline holds {audit.baseline.tokens():,} of the {audit.spec.min_calibration_tokens:,} "
                    "reference tokens it needs (in each calibrated decode batch size) before any step may train "
                    "(the coordinator is generating them)")
        self.ingest.ban_rule.audit_catch_up()
        return None

    @property
    def published_step(self) -> int:
        """The newest policy step published (−1 before the base is)."""
        return self.publisher.published_step if self.publisher is not None else -1

    def _announce(self, step: int, announcement: bytes, publish_s: float) -> None:
        """A policy step is in the origin: show it on the run page and announce it on gossip."""
        if self.run_page is not None:
            self.run_page.propagation.note_published(step, publish_s)
        if self.gossip is not None:
            self.gossip.announce(step, announcement)

    def _probe(self) -> SignalProbe:
        """The start-up learning-signal probe on the published base (``node/coordinator/probe.py``)."""
        engine = TransformersEngine.from_dir(step_dir(self.data_dir / "policies", self.published_step))
        return probe_learning_signal(self.spec, engine, self.tokenizer, self.tasks.train, n_tasks=self.options.probe_tasks)

    # --- the ingest's callbacks (event loop or the ban rule's thread) ----------------------------

    def _verdict_applied(self, env: Envelope[Verdict], gossip: bool) -> None:
        if self.run_page is not None:
            self.run_page.note_verdict(env)  # a ban's evidence on the run page
        if gossip and self.gossip is not None:  # posted over HTTP; one that came on gossip is already there
            self.gossip.publish_verdict(env.raw)

    def _gossip_bans(self, raw: bytes) -> None:
        if self.gossip is not None:
            self.gossip.publish_bans(raw)

    # --- status -------------------------------------------------------------------------------

    def utilization(self) -> float:
        """Trainer busy time / wall time since training started."""
        wall = time.monotonic() - self.started_s
        return round(self.busy_s / wall, 4) if wall > 0 else 0.0

    def _status_extra(self) -> dict[str, Any]:
        peers: dict[str, int] = {}
        if self.gossip is not None:
            for p in self.gossip.node.peers.alive():
                peers[p.role] = peers.get(p.role, 0) + 1
        return {
            "role": "coordinator",
            "peer_id": self.key.peer_id,
            "run_address": self.run_address() if self.url else None,
            "state": self.state,
            "published_step": self.published_step,
            "utilization": self.utilization(),
            "heldout_start": self.heldout.start.pass_rate if self.heldout.start else None,
            "heldout_end": self.heldout.end.pass_rate if self.heldout.end else None,
            "heldout_latest": self.heldout.latest,
            "peers_by_role": peers,
            "broadcast_s": {str(k): round(v, 3) for k, v in list(self.publisher.publish_s.items())[-5:]} if self.publisher else {},
            "last_step": self.last_step,
            "wait_reason": self.wait_reason,
            "signal_probe": self.signal_probe.as_dict() if self.signal_probe else None,
            "calibration": self.calibration.status() if self.calibration is not None and self.calibration.enabled else None,
            # the probe's prediction stands until a step trains: then the run has shown it learns
            "warnings": [w for w in (self.signal_probe.warning if self.signal_probe and not self.last_step else None,) if w],
        }


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
    tasks = resolve_run_tasks(spec, data_root)
    trainer, base, _, _ = build_trainer(signed, tasks, data_dir, ctx, resume=resume)
    paths = LoopPaths(policies=Path(data_dir) / "policies", state=Path(data_dir) / "state", base=base)
    run_training(trainer, ctx, paths, publish_every=spec.rl.publish_every, dtype=torch_dtype(spec.model.dtype), hooks=None)
