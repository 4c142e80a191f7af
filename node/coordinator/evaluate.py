"""Held-out evaluation: pass rate of a policy on tasks it is never trained on."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from node.engine.base import Engine
from node.worker.rollouts import sampling_params
from protocol.rewards import RewardLimits, compute_reward
from protocol.rollout import completion_text, encode_prompt
from protocol.runspec import RunSpec
from protocol.tasks import Task


@dataclass
class EvalResult:
    """Attributes: pass_rate (fraction of samples with task reward 1), reward_mean, samples, tokens."""

    pass_rate: float
    reward_mean: float
    samples: int
    tokens: int


def evaluate(spec: RunSpec, engine: Engine, tokenizer: Any, tasks: Sequence[Task], samples_per_task: int = 8,
             reward_limits: RewardLimits | None = None) -> EvalResult:
    """Sample ``samples_per_task`` completions per task with the run's sampling rule and score them.

    Seeds are fixed (``SHA-256("eval" || run seed || task || sample)``), so two policies are
    compared on the same noise.
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
    for g, t in zip(gens, owners):
        ids = g.completion_ids.tolist()
        r = compute_reward(t, completion_text(tokenizer, ids, eos), len(ids), None, 0.0, reward_limits)
        passed += r.task_reward == 1.0
        total_r += r.reward
        tokens += len(ids)
    return EvalResult(passed / len(gens), total_r / len(gens), len(gens), tokens)
