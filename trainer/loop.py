"""The training loop every rank runs: one code path for rank 0 and the others.

One trainer step (``docs/trainer.md`` §2), identical on every rank of a ``torchrun`` group::

    rank 0: batch = hooks.next_batch()      (waits on the rollout buffer; None ends training)
    all:    control flag (another step?) + broadcast_batch      [collective]
    all:    trainer.train_step(batch)                           [collective]
    all:    save_checkpoint(policies/step-N) when N is due      [collective, rank 0 writes]
    rank 0: hooks.published(N, files)       (publish into the origin, announce)
    rank 0: hooks.consumed(batch, N)        (the ledger records what step N consumed)
    all:    trainer.save_state(state/)                          [collective, rank 0 writes]
    rank 0: hooks.step_done(batch, metrics) (retire what earlier steps consumed, log, evaluate)

Rank 0 differs only by its hooks, which serve (ingest, origin, gossip) and never run a collective.
Ranks > 0 pass ``hooks=None``. A single process is a group of one: no flag, no broadcast.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from protocol.step_dirs import step_dir
from trainer.batch import Batch
from trainer.distributed import DistContext, broadcast_batch
from trainer.train import StepMetrics, Trainer


def policy_due(step: int, publish_every: int) -> bool:
    """Whether the policy after trainer step ``step`` is written and published (step 0, the base,
    always; then every ``rl.publish_every`` steps)."""
    return step == 0 or step % publish_every == 0


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of the run spec's ``model.dtype`` (``float32`` or ``bfloat16``)."""
    return torch.bfloat16 if name == "bfloat16" else torch.float32


class StepHooks(Protocol):
    """What rank 0 adds to the loop. No hook may run a collective (the other ranks do not call them)."""

    def next_batch(self) -> Batch | None:
        """The batch of the next trainer step (blocks until one fills); ``None`` ends training."""

    def published(self, step: int, files: list[Path]) -> None:
        """The policy of ``step`` is written to ``files`` (its directory): publish it."""

    def consumed(self, batch: Batch, step: int) -> None:
        """Trainer step ``step`` trained ``batch``: record what it consumed before the step's state is
        saved (a resume from that state never trains it again; one from an earlier state does)."""

    def step_done(self, batch: Batch, metrics: StepMetrics) -> None:
        """The step's state is saved: retire what earlier steps consumed, log, evaluate."""


@dataclass(frozen=True)
class LoopPaths:
    """Where the loop writes, the same on every rank (rank 0 writes the files).

    Attributes:
        policies: ``policies/step-<N>`` model directories (the published checkpoints; :mod:`protocol.step_dirs`).
        state: trainer state root (``latest`` → the newest ``step-<N>``).
        base: the base model directory (its config and tokenizer files go into each policy).
    """

    policies: Path
    state: Path
    base: Path | None = None


def _control(ctx: DistContext, go: bool) -> bool:
    """Collective: rank 0 tells the other ranks whether another step follows."""
    flag = torch.tensor([1 if go else 0], dtype=torch.long, device=ctx.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def run_training(trainer: Trainer, ctx: DistContext, paths: LoopPaths, *, publish_every: int, dtype: torch.dtype,
                 hooks: StepHooks | None, stop: threading.Event | None = None, max_steps: int | None = None) -> int:
    """Train step after step until rank 0's hooks end it (or ``stop``/``max_steps`` on rank 0). Collective.

    Args:
        trainer: this rank's trainer (same architecture on every rank).
        ctx: where this rank sits.
        paths: where policies and state go.
        publish_every: the run spec's ``rl.publish_every``.
        dtype: weight dtype of written policies (``model.dtype``).
        hooks: rank 0's hooks; ``None`` on the other ranks.
        stop: rank 0 ends the loop before the next step once it is set.
        max_steps: rank 0 ends the loop once the trainer has done this many steps.

    Returns:
        Trainer steps done by this call.

    Raises:
        ValueError: rank 0 without hooks, or another rank with them.
    """
    if ctx.is_main != (hooks is not None):
        raise ValueError("rank 0 runs the loop with hooks, every other rank without")
    done = 0
    while True:
        batch: Batch | None = None
        if hooks is not None:
            ended = (stop is not None and stop.is_set()) or (max_steps is not None and trainer.step >= max_steps)
            batch = None if ended else hooks.next_batch()
        if ctx.distributed:
            if not _control(ctx, batch is not None):
                break
            batch = broadcast_batch(batch, ctx)
        elif batch is None:
            break
        metrics = trainer.train_step(batch)
        step = trainer.step
        if policy_due(step, publish_every):
            files = trainer.save_checkpoint(step_dir(paths.policies, step), dtype=dtype, base_dir=paths.base)
            if hooks is not None:
                hooks.published(step, files)
        if hooks is not None:
            hooks.consumed(batch, step)
        trainer.save_state(paths.state)
        if hooks is not None:
            hooks.step_done(batch, metrics)
        done += 1
    return done
