"""Synthetic rollouts and batches (random tokens, fixed reward pattern) that drive the trainer
without workers: tests of batch assembly, the loss and FSDP, and benchmarks that need real
optimizer steps (``benchmarks/delta_bench.py``: step deltas of a trained policy). Nothing here
touches a real run.
"""

from __future__ import annotations

import numpy as np

from trainer.batch import Batch, RolloutRecord, assemble_batch

VOCAB = 32
"""Token IDs are below this (any model with at least this vocabulary can train on them)."""
GROUP = 4
"""Rollouts per group."""


def synthetic_records(seed: int, step: int, n_groups: int = 4, group: int = GROUP) -> list[RolloutRecord]:
    """Random rollouts of ``n_groups`` groups, interleaved, with varied lengths and 0/1 rewards."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(group):
        for g in range(n_groups):
            p, c = int(rng.integers(2, 7)), int(rng.integers(1, 9))
            reward = float(i % 2) if g % 2 == 0 else float(rng.random())
            out.append(
                RolloutRecord(
                    submission_id=f"sub{seed}-{g}",
                    worker="w",
                    policy_step=step,
                    task_key=f"task{g}",
                    group_seed=seed * 1000 + g,
                    sample=i,
                    prompt_ids=rng.integers(3, VOCAB, p),
                    completion_ids=rng.integers(3, VOCAB, c),
                    logprobs=np.zeros(c, np.float32),
                    reward=reward,
                    task_reward=reward,
                )
            )
    return out


def synthetic_batch(seed: int, step: int) -> Batch:
    return assemble_batch(synthetic_records(seed, step), step=step, group_size=GROUP, num_groups=4, adv_eps=1e-4)
