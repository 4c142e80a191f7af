"""The coordinator's independent re-check of a submission a validator judged a cheat.

A worker is banned only when a second, independent check reproduces a cheat reason
(``docs/validator.md`` "Ban rule"). With one validator in a run, that second check is this one:
the coordinator re-runs the whole verification pipeline (:class:`validator.pipeline.SubmissionChecker`,
the very code validators run) on the submission, with the policy it published for that step. It
runs in the ban rule's re-check thread (``trainer/ledger/ban_rule.py``), one submission at a time, only
for deciding cheat verdicts, so its cost is bounded by how often validators reject for cheating.

The policy window and the counter were checked by the ingest when the submission arrived, so the
re-check judges the submission as of its own policy step and never calls it a replay of itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from node.policy import HeldModels
from protocol.envelope import open_envelope
from protocol.errors import ProtocolError
from protocol.identity import PeerId
from protocol.messages import Submission
from protocol.models import ModelLoadError, load_model
from protocol.rewards import RewardLimits
from protocol.runspec import RunSpec
from protocol.tasks import Task
from trainer.ledger.ban_rule import RecheckResult
from validator.pipeline import SubmissionChecker

logger = logging.getLogger(__name__)

MODELS_KEPT = 2
"""Policies kept loaded between re-checks (re-checks of one adversary hit the same steps): the
newest one re-checked and the one in use (:class:`node.policy.HeldModels`, ``keep_steps`` 1)."""


class CoordinatorRecheck:
    """Callable ``(submission envelope bytes) → RecheckResult``: the ``recheck`` of :class:`~trainer.ledger.ban_rule.BanRule`.

    Args:
        spec: the run spec; run_id: its 32-byte ID.
        tasks: the run's training tasks in canonical order.
        tokenizer: returns the policy tokenizer (``None`` until the coordinator loaded it).
        policy_dir: returns the directory of the policy the coordinator published for a step
            (``config.json`` + safetensors), or ``None`` if it no longer has it.
        by: the coordinator's peer ID (named in the ban record's evidence).
        reward_limits: sandbox limits for code rewards, as validators use.
        device: torch device for the prefill.
    """

    def __init__(
        self,
        spec: RunSpec,
        run_id: bytes,
        tasks: Sequence[Task],
        tokenizer: Callable[[], Any],
        policy_dir: Callable[[int], Path | None],
        *,
        by: PeerId,
        reward_limits: RewardLimits | None = None,
        device: str = "cpu",
    ) -> None:
        self.spec = spec
        self.run_id = run_id
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.policy_dir = policy_dir
        self.by = by
        self.reward_limits = reward_limits
        self.device = device
        self.models = HeldModels(MODELS_KEPT - 1, lambda path: load_model(path, device=self.device))

    def model(self, step: int) -> Any | None:
        """The float32 policy of ``step`` as a validator loads it (held: :data:`MODELS_KEPT`), ``None`` if gone."""
        held = self.models.get(step)
        if held is not None:
            return held
        path = self.policy_dir(step)
        if path is None:
            return None
        try:
            return self.models.hold(step, path)
        except ModelLoadError as e:
            logger.warning("re-check cannot load policy step %d: %s", step, e)
            return None

    def __call__(self, raw: bytes) -> RecheckResult:
        """Re-run every check on ``raw``; a missing policy or tokenizer is a benign outcome, never a cheat."""
        try:
            env = open_envelope(raw, run_id=self.run_id, expect=Submission)
        except ProtocolError as e:  # it was verified on arrival: our file is damaged
            return RecheckResult(True, "recheck_failed", f"stored submission unreadable: {e}"[:200], self.by)
        tok = self.tokenizer()
        step = env.body.policy_step
        model = self.model(step) if tok is not None else None
        if model is None:
            return RecheckResult(True, "unknown_checkpoint", f"no policy for step {step} to re-check with", self.by)
        checker = SubmissionChecker(self.spec, self.tasks, tok, lambda s: model if s == step else None,
                                    trainer_step=lambda: step, counter_seen=lambda *_: False, reward_limits=self.reward_limits)
        result = checker.check(env)
        detail = ", ".join(f"{k}={v}" for k, v in result.evidence.items())[:200]
        logger.info("re-check of %s: %s %s", env.id.hex()[:12], result.reason, detail, extra={"peer_id": env.body.worker, "step": step})
        return RecheckResult(result.accepted, result.reason, detail, self.by)
