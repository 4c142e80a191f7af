"""The audit's calibration: honest reference submissions, generated and checked by the coordinator.

The per-worker audit (``protocol/audit.py``, ``trainer/ledger/audit.py``) tests each worker's
replay statistics against upper bounds of the rates honest compute produces. Those bounds are
measured here, on the run itself: after each published policy step the coordinator generates
``audit.calibration_submissions`` submissions with the honest worker's own code
(:func:`node.worker.rollouts.build_submission`) in the run's worker dtype
(``toploc.worker_dtype``), round-robin over the decode batch sizes of ``audit.calibration_batches``
(honest replay statistics depend on the decode configuration; the baseline bounds each event by the
largest of the configurations' bounds, ``docs/toploc.md`` §11.1), under a throwaway key (its tasks derive like any worker's), checks them
with the validators' pipeline against the float32 policy, and counts their statistics into the
baseline; the first calibrated step makes as many more as the baseline needs before the audit may
flag anyone (``audit.min_calibration_tokens``) and, under ``eprocess-v2``, until the baseline holds
``audit.min_calibration_decisive`` decisive twins (the validators' pipeline decodes and counts them on
the reference work as on any worker's; ``docs/toploc.md`` §11.2). A calibration submission that is rejected is reported loudly (``/status``
``audit.calibration``): the run's bounds do not hold for honest compute, and the operator
re-measures them (``spec init --measure-precision``, ``docs/operators.md``).

It runs in its own thread, one step at a time, the newest step first: when policies come faster
than it checks, older steps are skipped (the baseline pools the newest
``audit.calibration_window_steps`` steps that were calibrated).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from node.engine.hf import TransformersEngine
from node.worker.rollouts import build_submission
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission
from protocol.runspec import RunSpec
from protocol.tasks import Task
from trainer.ledger.audit import WorkerAudit
from validator.pipeline import SubmissionChecker

logger = logging.getLogger(__name__)

MAX_BURST_SUBMISSIONS = 256
"""Most reference submissions one step's calibration makes *per decode batch size* of
``audit.calibration_batches`` while the baseline is below ``audit.min_calibration_tokens`` (the first
calibrated step fills it; a run whose completions are too short to reach it in this many says so in
``/status``: the audit stays not ready, and no step trains). Per batch size, since each must reach the
minimum on its own: a cap shared by three batch sizes left the devnet's baseline at ≈ 8,200 of its
10,000 tokens per batch size (measured 7 Dec 2026)."""


def worker_engine(spec: RunSpec, model_dir: Path, device: str = "cpu", max_batch: int = 64) -> TransformersEngine:
    """The honest worker's transformers engine on ``model_dir`` as the run's tolerances assume it: computing in
    ``toploc.worker_dtype``, with float32 logits where ``toploc.fp32_logits`` says so (``node/worker/role.py``)."""
    dtype = spec.toploc.worker_dtype
    return TransformersEngine.from_dir(model_dir, device=device, max_batch=max_batch, compute_dtype=getattr(torch, dtype),
                                       fp32_head=dtype == "bfloat16" and spec.toploc.fp32_logits)


class AuditCalibration:
    """Generates and checks honest reference submissions after each published step (see the module docstring).

    Args:
        spec: the run spec; run_id: its 32-byte ID.
        tasks: the run's training tasks in canonical order.
        tokenizer: returns the policy tokenizer (``None`` until loaded).
        policy_dir: the directory of a published step (``None`` if gone).
        validator_model: the float32 policy of a step as a validator loads it (``None`` if gone).
        audit: the ledger's audit, which receives the statistics.
        device: torch device of the reference worker.
    """

    def __init__(self, spec: RunSpec, run_id: bytes, tasks: Sequence[Task], tokenizer: Callable[[], Any],
                 policy_dir: Callable[[int], Path | None], validator_model: Callable[[int], Any], audit: WorkerAudit,
                 *, device: str = "cpu") -> None:
        self.spec = spec
        self.run_id = run_id
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.policy_dir = policy_dir
        self.validator_model = validator_model
        self.audit = audit
        self.device = device
        self.key = NodeKey.generate()  # a throwaway identity: its tasks derive like any worker's
        self.counter = 0
        self.by_batch: Counter[int] = Counter()
        """Calibration submissions made by decode batch size (``audit.calibration_batches``)."""
        self.outcomes: Counter[str] = Counter()
        """Calibration submissions by verdict reason (``ok`` expected; anything else: the bounds do not hold)."""
        self.steps_done = 0
        self._pending: int | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.audit.enabled and self.spec.audit.calibration_submissions > 0

    def published(self, step: int) -> None:
        """Queue step ``step`` for calibration (replaces a step still waiting)."""
        if not self.enabled:
            return
        with self._cv:
            self._pending = step
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="audit-calibration", daemon=True)
                self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                step, self._pending = self._pending, None
            try:
                self.calibrate(step)
            except Exception:  # the next step tries again; the audit only lacks evidence meanwhile
                logger.exception("audit calibration of step %d failed", step)

    def calibrate(self, step: int) -> int:
        """Generate and check this step's reference submissions now; returns how many were counted."""
        tok = self.tokenizer()
        path = self.policy_dir(step)
        model = self.validator_model(step)
        if tok is None or path is None or model is None:
            return 0
        # one engine per decode configuration (audit.calibration_batches): honest statistics depend on the batch size.
        # They share one load of the step's weights (max_batch only splits generate()'s batches): memory as one engine's
        loaded = worker_engine(self.spec, path, self.device)
        engines = {b: copy.copy(loaded) for b in self.spec.audit.calibration_batches}
        for b, engine in engines.items():
            engine.max_batch = b
        checker = SubmissionChecker(self.spec, self.tasks, tok, lambda s: model if s == step else None,
                                    trainer_step=lambda: step, counter_seen=lambda *_: False, twin_share=1.0)  # every reference twin
        counted = 0
        made = 0
        # the step's share, and at first as many more as the baseline needs to flag anyone (audit.min_calibration_tokens)
        # and, at the first calibrated step under eprocess-v2, to hold audit.min_calibration_decisive decisive twins
        first = self.steps_done == 0
        burst = MAX_BURST_SUBMISSIONS * len(self.spec.audit.calibration_batches)
        while made < self.spec.audit.calibration_submissions or (
                (not self.audit.ready() or (first and self.audit.wants_decisive())) and made < burst):
            if self._stop:
                break
            made += 1
            batches = self.spec.audit.calibration_batches
            batch = batches[self.counter % len(batches)]  # round-robin over the configurations, across steps too
            raw = build_submission(self.spec, self.run_id, self.key, engines[batch], tok, self.tasks, step, self.counter)
            self.counter += 1
            self.by_batch[batch] += 1
            result = checker.check(open_envelope(raw, run_id=self.run_id, expect=Submission))
            self.outcomes[result.reason] += 1
            if not result.accepted:
                logger.warning("audit calibration: an honest %s reference submission at step %d was rejected (%s %s): the run's "
                               "tolerances do not hold for honest compute here; re-measure them (docs/operators.md)",
                               self.spec.toploc.worker_dtype, step, result.reason, result.evidence)
            if result.stats is not None and result.accepted:  # as the audit counts workers' verdicts: accepted ones only
                self.audit.calibrate(step, result.stats, config=batch)
                counted += 1
        self.steps_done += 1
        return counted

    def status(self) -> dict[str, Any]:
        """For ``/status``: steps calibrated and the reference submissions' verdicts by reason."""
        return {"steps": self.steps_done, "submissions": sum(self.outcomes.values()), "by_reason": dict(self.outcomes),
                "by_batch": {str(b): n for b, n in sorted(self.by_batch.items())}}
