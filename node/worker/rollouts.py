"""One submission, end to end: plan, generate, prove, score, sign."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from node.engine.base import Engine, Generation, SamplingParams
from protocol import toploc
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask
from protocol.rewards import RewardLimits, compute_rewards
from protocol.rollout import PlannedTask, completion_text, pack_f32, pack_u32, plan_submission
from protocol.runspec import RunSpec
from protocol.tasks import Task

logger = logging.getLogger(__name__)


@dataclass
class BuildStats:
    """Timing of one submission, seconds, and its size in tokens."""

    generate_s: float = 0.0
    proof_s: float = 0.0
    reward_s: float = 0.0
    tokens: int = 0
    task_rewards: list[float] = field(default_factory=list)


def sampling_params(spec: RunSpec, eos_id: int) -> SamplingParams:
    """The run's sampling parameters for an engine."""
    s = spec.sampling
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, eos_id=eos_id, min_eos_prob=spec.toploc.eos_min_prob,
                          rule=s.rule)


def generate_rollouts(
    spec: RunSpec,
    engine: Engine,
    tokenizer: Any,
    plan: Sequence[PlannedTask],
    reward_limits: RewardLimits | None = None,
    stats: BuildStats | None = None,
) -> list[Rollout]:
    """Generate the group of every planned task in one batch, prove and score it.

    Args:
        spec: the run spec.
        engine: the inference engine holding the policy.
        tokenizer: the policy's tokenizer.
        plan: the planned tasks (from :func:`protocol.rollout.plan_submission`).
        reward_limits: sandbox limits for code rewards.
        stats: filled with timings if given.

    Returns:
        ``len(plan) × group_size`` rollouts, task-major.
    """
    stats = stats if stats is not None else BuildStats()
    eos_id = int(tokenizer.eos_token_id)
    prompts = [list(p.prompt_ids) for p in plan for _ in p.seeds]
    seeds = [s for p in plan for s in p.seeds]
    t0 = time.perf_counter()
    gens = engine.generate(prompts, seeds, sampling_params(spec, eos_id))
    stats.generate_s += time.perf_counter() - t0
    return prove_and_score(spec, tokenizer, plan, gens, reward_limits, stats)


def prove_and_score(
    spec: RunSpec,
    tokenizer: Any,
    plan: Sequence[PlannedTask],
    gens: Sequence[Generation],
    reward_limits: RewardLimits | None = None,
    stats: BuildStats | None = None,
) -> list[Rollout]:
    """The rollouts of ``gens`` (one per planned sample, task-major): TOPLOC proofs of their committed
    rows, rewards of their completions.

    Args:
        spec: the run spec (TOPLOC chunk size and top-k, length penalty).
        tokenizer: the policy's tokenizer (completion text for the reward).
        plan: the planned tasks.
        gens: ``len(plan) × group_size`` generations in plan order.
        reward_limits: sandbox limits for code rewards.
        stats: filled with proof and reward timings, tokens and task rewards if given.

    Raises:
        ValueError: not one generation per planned sample.
    """
    stats = stats if stats is not None else BuildStats()
    eos_id = int(tokenizer.eos_token_id)
    if len(gens) != sum(len(p.seeds) for p in plan):
        raise ValueError(f"{len(gens)} generations for {sum(len(p.seeds) for p in plan)} planned samples")
    owners = [p for p in plan for _ in p.seeds]
    ids_all = [g.completion_ids.tolist() for g in gens]
    t1 = time.perf_counter()
    scored = compute_rewards([(p.task, completion_text(tokenizer, ids, eos_id), len(ids), p.target_length) for p, ids in zip(owners, ids_all)],
                             spec.sampling.length_penalty, reward_limits)
    stats.reward_s += time.perf_counter() - t1
    rollouts = []
    i = 0
    for p in plan:
        for sample, seed in enumerate(p.seeds):
            g, ids, r = gens[i], ids_all[i], scored[i]
            i += 1
            t2 = time.perf_counter()
            proofs = toploc.build_proofs(g.hidden, chunk_size=spec.toploc.chunk_size, topk=spec.toploc.topk)
            stats.proof_s += time.perf_counter() - t2
            stats.tokens += len(ids)
            stats.task_rewards.append(r.task_reward)
            rollouts.append(
                Rollout(
                    task=p.position,
                    sample=sample,
                    seed=seed,
                    prompt_ids=pack_u32(p.prompt_ids),
                    completion_ids=pack_u32(ids),
                    logprobs=pack_f32(g.logprobs.tolist()),
                    finish=g.finish,
                    task_reward=float(r.task_reward),
                    reward=float(r.reward),
                    proofs=proofs,
                )
            )
    return rollouts


def build_submission(
    spec: RunSpec,
    run_id: bytes,
    key: NodeKey,
    engine: Engine,
    tokenizer: Any,
    tasks: Sequence[Task],
    policy_step: int,
    counter: int,
    reward_limits: RewardLimits | None = None,
    stats: BuildStats | None = None,
) -> bytes:
    """Plan, generate, prove, score and sign submission ``counter`` at ``policy_step``.

    Returns:
        The signed ``submission/1`` envelope bytes.
    """
    plan = plan_submission(spec, tasks, tokenizer, key.peer_id, policy_step, counter)
    rollouts = generate_rollouts(spec, engine, tokenizer, plan, reward_limits, stats)
    return seal_submission(run_id, key, policy_step, counter, plan, rollouts)


def seal_submission(run_id: bytes, key: NodeKey, policy_step: int, counter: int, plan: Sequence[PlannedTask], rollouts: list[Rollout]) -> bytes:
    """Sign the ``submission/1`` of ``rollouts`` answering ``plan`` (task-major)."""
    body = Submission(
        worker=key.peer_id,
        policy_step=policy_step,
        counter=counter,
        tasks=[SubmissionTask(task_index=p.task_index, problem_id=p.task.problem_id[:256], target_length=p.target_length or 0) for p in plan],
        rollouts=rollouts,
    )
    return seal(key, run_id, body)
