"""Held-out evaluation: pass rate of a policy on tasks it is never trained on, with its 95 % interval.

The interval is a percentile bootstrap over *problems* (resample the held-out problems with
replacement, keep each problem's own samples): the samples of one problem are strongly correlated
(a problem the policy has learned passes in most of its samples), so a binomial (Wilson) interval
over all samples would be far too narrow. The gain between two evaluations of the same problems
gets a paired bootstrap over the same resampled problems.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from node.engine.base import Engine
from node.worker.rollouts import sampling_params
from protocol.rewards import RewardLimits, compute_rewards
from protocol.rollout import completion_text, encode_prompt
from protocol.runspec import RunSpec
from protocol.tasks import Task

logger = logging.getLogger(__name__)

BOOTSTRAP_RESAMPLES = 2000
"""Bootstrap resamples of the held-out problems per interval (≈ 1 ms for 20 problems)."""
CONFIDENCE = 0.95


@dataclass
class EvalResult:
    """One evaluation of a policy on the held-out problems.

    Attributes:
        pass_rate: fraction of samples with task reward 1.
        reward_mean: mean reward (length penalty included).
        samples: completions scored (problems × samples per problem).
        tokens: completion tokens generated.
        passes: per held-out problem, in the task order given, how many of its samples passed.
        samples_per_task: samples per problem.
    """

    pass_rate: float
    reward_mean: float
    samples: int
    tokens: int
    passes: list[int] = field(default_factory=list)
    samples_per_task: int = 0

    def interval(self) -> tuple[float, float]:
        """95 % bootstrap interval of :attr:`pass_rate` over problems (:func:`pass_rate_interval`)."""
        return pass_rate_interval(self.passes, self.samples_per_task)


def _resampled_problems(n: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, n]`` int64 problem indices drawn with replacement (fixed seed: reproducible intervals)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def pass_rate_interval(passes: Sequence[int], samples_per_task: int, *, resamples: int = BOOTSTRAP_RESAMPLES,
                       confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of a pass rate, resampling problems (not samples).

    Args:
        passes: per problem, samples that passed (each in ``0..samples_per_task``).
        samples_per_task: samples per problem (> 0).
        resamples: bootstrap resamples.
        confidence: interval coverage (0.95: the 2.5 % and 97.5 % percentiles).
        seed: resampling seed.

    Returns:
        ``(low, high)`` pass rates; ``(0.0, 0.0)`` with no problems.
    """
    if not passes or samples_per_task <= 0:
        return 0.0, 0.0
    rates = np.asarray(passes, dtype=np.float64) / samples_per_task  # [n]
    means = rates[_resampled_problems(len(rates), resamples, seed)].mean(axis=1)  # [resamples]
    a = (1.0 - confidence) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def gain_interval(start: Sequence[int], end: Sequence[int], samples_start: int, samples_end: int, *,
                  resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:
    """Held-out gain ``end − start`` with a paired percentile-bootstrap interval over the same problems.

    Args:
        start, end: per problem passes of two evaluations of the same problems, same order.
        samples_start, samples_end: samples per problem of each.

    Returns:
        ``(gain, low, high)``.

    Raises:
        ValueError: the two evaluations have a different number of problems.
    """
    if len(start) != len(end):
        raise ValueError(f"evaluations of {len(start)} and {len(end)} problems cannot be paired")
    if not start or samples_start <= 0 or samples_end <= 0:
        return 0.0, 0.0, 0.0
    diff = np.asarray(end, dtype=np.float64) / samples_end - np.asarray(start, dtype=np.float64) / samples_start  # [n]
    means = diff[_resampled_problems(len(diff), resamples, seed)].mean(axis=1)
    a = (1.0 - confidence) / 2
    return float(diff.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def eval_row(step: int, r: EvalResult) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of an evaluation (``event = "eval"``): pass rate, its interval, per-problem passes."""
    lo, hi = r.interval()
    return {"event": "eval", "step": step, "heldout_pass_rate": r.pass_rate, "heldout_ci_low": round(lo, 4),
            "heldout_ci_high": round(hi, 4), "heldout_reward_mean": r.reward_mean, "samples": r.samples,
            "problems": len(r.passes), "samples_per_problem": r.samples_per_task, "passes": list(r.passes),
            "interval": "95% percentile bootstrap over problems"}


def evaluate(spec: RunSpec, engine: Engine, tokenizer: Any, tasks: Sequence[Task], samples_per_task: int = 8,
             reward_limits: RewardLimits | None = None) -> EvalResult:
    """Sample ``samples_per_task`` completions per task with the run's sampling rule and score them.

    Seeds are fixed (``SHA-256("eval" || run seed || task || sample)``), so two policies are
    compared on the same noise.

    Returns:
        :class:`EvalResult` with per-problem passes (for the bootstrap intervals).
    """
    prompts, seeds, owners = [], [], []
    for t in tasks:
        ids = encode_prompt(tokenizer, t, None)
        for s in range(samples_per_task):
            prompts.append(ids)
            h = hashlib.sha256(f"eval|{spec.run.seed}|{t.problem_id}|{s}".encode()).digest()
            seeds.append(int.from_bytes(h[:8], "big") >> 1)
            owners.append(t)
    if not prompts:
        return EvalResult(0.0, 0.0, 0, 0)
    eos = int(tokenizer.eos_token_id)
    gens = engine.generate(prompts, seeds, sampling_params(spec, eos))
    passed, total_r, tokens = 0, 0.0, 0
    per_task = [0] * len(tasks)
    ids_all = [g.completion_ids.tolist() for g in gens]
    scored = compute_rewards([(t, completion_text(tokenizer, ids, eos), len(ids), None) for ids, t in zip(ids_all, owners)], 0.0, reward_limits)
    for i, (ids, r) in enumerate(zip(ids_all, scored)):
        ok = r.task_reward == 1.0
        passed += ok
        per_task[i // samples_per_task] += ok
        total_r += r.reward
        tokens += len(ids)
    return EvalResult(passed / len(gens), total_r / len(gens), len(gens), tokens, per_task, samples_per_task)


class HeldOutSchedule:
    """When the coordinator evaluates its published policy on the held-out tasks, and what it found:
    at start, every ``every`` trainer steps, and at the end (unless the last periodic evaluation
    already covered the last published step). Each evaluation is an ``eval`` row of
    ``metrics.jsonl`` (:func:`eval_row`) and a WARNING line with its 95 % interval.

    Runs on the training thread (and once from the event loop's executor at start and end).

    Args:
        spec: the run spec; tasks: the held-out tasks.
        samples: samples per task (0: never evaluate).
        every: evaluate after every this many trainer steps too (0: only at start and end).
        policy_dir: the directory of a published policy step.
        tokenizer: returns the policy tokenizer.
        log: writes a ``metrics.jsonl`` row (``node/coordinator/metrics.py`` ``MetricsLog.write``).
    """

    def __init__(self, spec: RunSpec, tasks: Sequence[Task], *, samples: int, every: int, policy_dir: Callable[[int], Path],
                 tokenizer: Callable[[], Any], log: Callable[[dict[str, Any]], None]) -> None:
        self.spec = spec
        self.tasks = tasks
        self.samples = samples
        self.every = every
        self.policy_dir = policy_dir
        self.tokenizer = tokenizer
        self.log = log
        self.start: EvalResult | None = None
        self.end: EvalResult | None = None
        self.latest: dict[str, Any] | None = None
        """The last ``eval`` row's step, pass rate and interval (``/status`` ``heldout_latest``)."""
        self._last: EvalResult | None = None

    def due(self, step: int) -> bool:
        """Whether trainer step ``step`` is followed by a periodic evaluation."""
        return bool(self.samples and self.every and step % self.every == 0)

    def run(self, step: int) -> EvalResult:
        """Evaluate published policy step ``step``; log its ``eval`` row."""
        from node.engine.hf import TransformersEngine

        r = evaluate(self.spec, TransformersEngine.from_dir(self.policy_dir(step)), self.tokenizer(), self.tasks, self.samples)
        row = eval_row(step, r)
        self.log(row)
        self._last = r
        self.latest = {k: row[k] for k in ("step", "heldout_pass_rate", "heldout_ci_low", "heldout_ci_high")}
        logger.warning("held-out pass rate at step %d: %.3f (95%% interval %.3f-%.3f, %d problems x %d samples)", row["step"],
                       r.pass_rate, row["heldout_ci_low"], row["heldout_ci_high"], row["problems"], r.samples_per_task)
        return r

    def initial(self, step: int) -> None:
        """The start-of-run evaluation of published step ``step``."""
        self.start = self.run(step)

    def final(self, step: int) -> None:
        """The end-of-run evaluation of published step ``step`` (the last periodic one when it was of that step)."""
        if self.latest is not None and self.latest["step"] == step and self._last is not None:
            self.end = self._last
        else:
            self.end = self.run(step)
