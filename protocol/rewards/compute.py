"""The single reward entry point used by the worker and the validator alike."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from protocol.rewards.base import RewardError, RewardLimits, RewardResult
from protocol.rewards.code import code_reward
from protocol.rewards.length import length_penalty
from protocol.rewards.math import math_reward
from protocol.tasks import ENV_TASK_TYPE, Task, TaskError

logger = logging.getLogger(__name__)

__all__ = ["compute_reward", "compute_rewards"]


def compute_reward(
    task: Task,
    completion_text: str,
    completion_len_tokens: int,
    target_length: int | None,
    lam: float,
    limits: RewardLimits | None = None,
) -> RewardResult:
    """Reward of one completion: r_task by task type, then INTELLECT-2's length penalty.

    Environment tasks (``task_type`` ``environment``) are scored by the run's environment, which
    this process must have opened (:func:`protocol.envs.open_environment`), in its sandbox; a
    failure of the environment's own code scores 0 with ``env_fault`` set.

    Deterministic for given inputs, except where a resource limit (CPU or wall seconds) is hit
    near its boundary: a program that needs about as long as the limit may pass on one machine
    and fail on another. Such results carry ``limit_hit`` (see :class:`RewardResult`). Math
    answers are checked in a killable verifier process and code runs in a bubblewrap sandbox,
    so the calling thread never holds the GIL for long; safe to call from several threads.

    Args:
        task: the task the completion answers.
        completion_text: the decoded completion (without the prompt).
        completion_len_tokens: completion length, in tokens.
        target_length: the length-control target, in tokens, or ``None``.
        lam: λ of the length penalty (INTELLECT-2: 0.0003).
        limits: resource bounds; defaults when ``None``.

    Returns:
        ``RewardResult(task_reward, reward, detail, limit_hit, outcome, env_fault)``.

    Raises:
        RewardError: on a malformed task, bad lengths or λ, a code task where the sandbox is
            unavailable (no bubblewrap: the message says what to install), a math verifier
            that cannot start, or an environment task whose environment this process has not opened.
    """
    limits = limits or RewardLimits()
    try:
        outcome: str | None = None
        env_fault: str | None = None
        if task.task_type == "verifiable_math":
            task_reward, detail, limit_hit = math_reward(completion_text, task.ground_truth, limits)
        elif task.task_type == "prime_rl_code":
            task_reward, detail, limit_hit, outcome = code_reward(completion_text, task.test_cases, limits.sandbox)
        elif task.task_type == ENV_TASK_TYPE:
            from protocol.envs.sandboxed import environment_for  # starts processes: only for environment tasks

            instance, row = task.environment_row
            scored = environment_for(instance).score(row, completion_text)
            task_reward, detail, limit_hit, env_fault = scored.value, scored.detail, None, scored.fault
        else:
            raise RewardError(f"task {task.problem_id}: unknown task_type {task.task_type!r}")
    except TaskError as e:
        raise RewardError(f"task {task.problem_id} cannot be scored: {e}") from e
    reward = length_penalty(task_reward, completion_len_tokens, target_length, lam)
    logger.debug("reward %s: r_task=%.1f r=%.4f (%s)", task.problem_id, task_reward, reward, detail)
    return RewardResult(task_reward=task_reward, reward=reward, detail=detail, limit_hit=limit_hit, outcome=outcome, env_fault=env_fault)


def compute_rewards(items: Sequence[tuple[Task, str, int, int | None]], lam: float, limits: RewardLimits | None = None) -> list[RewardResult]:
    """:func:`compute_reward` of many completions, the same results: environment tasks are scored
    in batches (:meth:`protocol.envs.Environment.score_many`, one sandbox call per 256), every
    other task one by one.

    Args:
        items: ``(task, completion_text, completion_len_tokens, target_length)`` per completion.
        lam: λ of the length penalty.
        limits: resource bounds; defaults when ``None``.

    Returns:
        One result per item, in order.

    Raises:
        RewardError: as :func:`compute_reward`.
    """
    from protocol.envs.sandboxed import environment_for  # starts processes: only for environment tasks

    out: list[RewardResult | None] = [None] * len(items)
    by_env: dict[str, list[int]] = {}
    for i, (task, text, n, target) in enumerate(items):
        if task.task_type == ENV_TASK_TYPE:
            try:
                by_env.setdefault(task.environment_row[0], []).append(i)
            except TaskError as e:
                raise RewardError(f"task {task.problem_id} cannot be scored: {e}") from e
        else:
            out[i] = compute_reward(task, text, n, target, lam, limits)
    for instance, idx in by_env.items():
        scores = environment_for(instance).score_many([(items[i][0].environment_row[1], items[i][1]) for i in idx])
        for i, s in zip(idx, scores, strict=True):
            task, _, n, target = items[i]
            out[i] = RewardResult(task_reward=s.value, reward=length_penalty(s.value, n, target, lam), detail=s.detail, env_fault=s.fault)
    return [r for r in out if r is not None]
