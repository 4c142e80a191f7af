"""Judging a reported reward: recompute it, and re-run a disagreement until it reproduces or not.

A worker's reported reward is compared with the validator's own scoring
(:func:`protocol.rewards.compute_reward`). A code program whose result is not a function of its
input (unseeded ``random``, a set of objects ordered by ``id()``, the clock, thread timing) can
pass on the worker and fail here with both sides honest, so one disagreement is no evidence.
The rule (``docs/validator.md`` "Rewards that do not reproduce"):

1. The first scoring agrees with the report → ``ok``.
2. It disagrees and a resource limit may explain it (this scoring hit one, or the worker
   reported less than recomputed) → ``limit_hit`` (benign).
3. Otherwise the completion is scored again, up to :data:`REWARD_RERUNS` more times (each a
   fresh sandbox). A re-run that agrees with the report, or whose outcome differs from the
   first scoring's (``RewardResult.outcome``: the program's exit statuses and outputs), shows a
   program that does not reproduce → ``nondeterministic`` (benign; the rollout is rejected, so
   it is not trained on). A re-run that hits a limit leaves too little evidence → ``limit_hit``
   (benign); so does a re-run that would not fit in what is left of ``budget_s``: one is started
   only when the re-runs so far plus the longest scoring measured so far (the first included)
   fit in it, so a program that takes as long each time costs at most ``budget_s`` beyond its
   first scoring, not one more run over it.
4. Only when every one of the ``1 + REWARD_RERUNS`` scorings gives the very same outcome, and it
   disagrees with the report, is the disagreement deterministic → ``reward`` (a cheat reason).

Environment tasks (a run's own reward code, ``protocol.envs``): a scoring whose environment code
failed (``RewardResult.env_fault``: it crashed, ran over a limit, returned no score in [0, 1]) is
the environment's fault → ``environment`` (benign), whatever the worker reported; and a re-run that
does not reproduce is the environment's nondeterminism → ``environment`` too (``environment=True``).

The coordinator's re-check runs the same pipeline and so the same rule: a ban needs two
independent deterministic disagreements. For an honest worker whose program passes with
probability ``p`` and otherwise prints one and the same failing output, the chance that a
reported pass ends in a ban is ``(1 − p)^(2·(1 + REWARD_RERUNS))`` (the table in
``docs/validator.md``); a program with several failing outputs shows itself sooner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.rewards import RewardResult
from protocol.verdicts import OK

logger = logging.getLogger(__name__)

_clock = time.monotonic
"""The clock of every reward budget, seconds: :func:`judge_reward`'s re-runs and the per-submission budget of
``validator/pipeline.py``. Tests replace it (one seam for both), so no test sleeps."""

REWARD_RERUNS = 9
"""Extra scorings of a completion whose first recomputed reward disagrees with the report (k):
``1 + k`` identical outcomes make a disagreement deterministic (a ``reward`` cheat)."""


@dataclass(frozen=True)
class RewardJudgement:
    """The verdict on one rollout's reported reward.

    Attributes:
        reason: ``"ok"``, ``"limit_hit"``, ``"nondeterministic"``, ``"environment"`` (benign) or ``"reward"`` (cheat).
        result: the first recomputed reward.
        runs: scorings done (1 when the first agreed).
        detail: what decided it, one line.
    """

    reason: str
    result: RewardResult
    runs: int
    detail: str


def agrees(result: RewardResult, reported_task: float, reported_reward: float, reward_tol: float) -> bool:
    """Whether a recomputed reward equals the reported one (task reward exactly, reward within ``reward_tol``)."""
    return result.task_reward == reported_task and abs(result.reward - reported_reward) <= reward_tol


def mismatch_reason(reported_task: float, recomputed_task: float, limit_hit: str | None) -> str:
    """The reason of a first disagreement before any re-run: ``limit_hit`` or ``reward``.

    ``limit_hit`` (benign) when a resource limit may explain the difference rather than the
    worker: this scoring hit one (``RewardResult.limit_hit``: wall, CPU, memory or output; wall
    and CPU depend on this machine's load), or the worker reported less than the recomputed task
    reward (a limit hit on the worker's side looks exactly so, and an under-report gains a
    worker nothing). Otherwise ``reward``, which :func:`judge_reward` then re-runs.
    """
    if limit_hit is not None or reported_task < recomputed_task:
        return "limit_hit"
    return "reward"


def judge_reward(
    score: Callable[[], RewardResult],
    reported_task: float,
    reported_reward: float,
    *,
    reward_tol: float,
    budget_s: float,
    reruns: int = REWARD_RERUNS,
    environment: bool = False,
) -> RewardJudgement:
    """Judge a reported reward by the rule of this module.

    Args:
        score: computes the reward of the completion once (a fresh sandbox per call).
        reported_task: the worker's task reward; reported_reward: its reward after the length penalty.
        reward_tol: tolerance on the reward, absolute.
        budget_s: wall seconds the re-runs may take together, as predicted: a re-run starts only where the
            re-runs so far plus the longest scoring so far fit in it, else the verdict is ``limit_hit`` (a slow
            program is rejected, never banned on a short count). A run is not stopped by this budget, only by
            its sandbox, so a re-run slower than every run before it ends past it: the re-runs take at most
            ``budget_s`` − (the longest run before the last) + one run's sandbox limit, and the whole judgement
            at most ``budget_s`` + that limit (with the pipeline's ``budget_s`` = the 60 s sandbox wall limit:
            ≤ 120 s; e.g. nine 6.6 s runs then a 59.9 s one: 119.3 s, re-runs 112.7 s).
        reruns: extra scorings before a disagreement counts as deterministic (k).
        environment: the task is an environment task: a score that does not reproduce is the
            environment's (``environment``), not a program's (``nondeterministic``).

    Returns:
        The judgement.

    Raises:
        protocol.rewards.RewardError: from ``score`` (the caller's own failure to score).
    """
    unstable = "environment" if environment else "nondeterministic"
    t0 = _clock()
    first = score()
    longest_s = _clock() - t0  # the next run is predicted to take as long as the longest so far
    if first.env_fault is not None:  # no score to compare: the environment's failure, not the worker's
        return RewardJudgement("environment", first, 1, first.detail)
    if agrees(first, reported_task, reported_reward, reward_tol):
        return RewardJudgement(OK, first, 1, "")
    why = mismatch_reason(reported_task, first.task_reward, first.limit_hit)
    if why != "reward":
        return RewardJudgement(why, first, 1, first.detail)
    reruns_start = _clock()
    for i in range(reruns):
        spent_s = _clock() - reruns_start
        if spent_s + longest_s > budget_s:  # checked before a run only, a run that did not fit would overrun the budget
            return RewardJudgement("limit_hit", first, 1 + i, f"re-run {2 + i} would not fit: runs take up to {longest_s:.0f} s, "
                                                              f"{max(0.0, budget_s - spent_s):.0f} s of {budget_s:.0f} s left after {i} of {reruns}")
        t = _clock()
        again = score()
        longest_s = max(longest_s, _clock() - t)
        if again.env_fault is not None:
            return RewardJudgement("environment", first, 2 + i, f"run {2 + i}: {again.detail}")
        if agrees(again, reported_task, reported_reward, reward_tol):
            return RewardJudgement(unstable, first, 2 + i, f"run {2 + i} reproduced the reported reward")
        if again.limit_hit is not None:
            return RewardJudgement("limit_hit", first, 2 + i, f"run {2 + i} hit the {again.limit_hit} limit")
        if (again.task_reward, again.reward, again.outcome) != (first.task_reward, first.reward, first.outcome):
            return RewardJudgement(unstable, first, 2 + i, f"run {2 + i} behaved differently from run 1")
    logger.debug("reward disagreement reproduced %d times: %s", 1 + reruns, first.detail)
    return RewardJudgement("reward", first, 1 + reruns, first.detail)
