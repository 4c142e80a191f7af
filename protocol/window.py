"""The async window: which policy steps' rollouts are still fresh enough to train on.

Written once here and used by every role that must agree on it (``docs/trainer.md`` §3, the
async-RL rule of INTELLECT-2 §2 / prime-rl's ``async_level``):

* the worker (``node/worker/role.py``) keeps generating with a held policy while it is in the window;
* on the coordinator, the submission ledger (``trainer/ledger/ledger.py``), and nothing else there,
  applies it: admission refuses (409 ``stale_policy``) what is outside it, a timer retires what
  left it, and its trainable view offers the rollout buffer and batch assembly only what is in it;
* the validator pipeline (``validator/pipeline.py``) rejects them with ``stale_policy``.

**Trainer step** has one meaning everywhere: ``n``, the number of optimizer steps the coordinator
has completed, which is also the policy step of the weights it now holds (published as step ``n``
when ``rl.publish_every`` allows, so every published step is ≤ ``n``). The coordinator knows ``n``
exactly; the ingest tells validators its value in each lease answer
(:func:`protocol.ingest_api.unpack_lease_answer`); a worker knows only the newest announced policy
step, a lower bound of ``n`` that it uses in its place.

With ``k = rl.async_level``, a rollout of policy step ``p`` is fresh for trainer step ``n`` when
``n − k ≤ p ≤ newest``, where ``newest`` is ``n`` for training and the newest *published* step
for the ingest (nothing newer exists to sample from).

**Retention** follows from the window: at most ``k + 1`` policy steps (``n − k … n``) are fresh
at once, so a node that holds checkpoints to generate or judge rollouts needs no more than the
newest ``k + 1`` (:func:`fresh_steps`); the run spec's ``shardcast.keep_steps`` is that value
unless the spec states a larger one, and never less. Every holder — the relay's store, a
worker's or validator's fetched checkpoints, a validator's loaded models — keeps what
:func:`retained_steps` says.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["fresh_steps", "in_window", "oldest_fresh_step", "retained_steps"]


def oldest_fresh_step(trainer_step: int, async_level: int) -> int:
    """The oldest policy step still fresh at ``trainer_step``: ``n − k`` (may be negative early on)."""
    return trainer_step - async_level


def in_window(policy_step: int, *, trainer_step: int, async_level: int, newest_step: int | None = None) -> bool:
    """Whether a rollout of ``policy_step`` is fresh at ``trainer_step``: ``n − k ≤ p ≤ newest``.

    Args:
        policy_step: ``p``, the policy step the rollout was sampled with.
        trainer_step: ``n`` (see the module docstring).
        async_level: ``k`` (``rl.async_level`` of the run spec).
        newest_step: the newest step a rollout can come from; ``None`` means ``n``.
    """
    newest = trainer_step if newest_step is None else newest_step
    return oldest_fresh_step(trainer_step, async_level) <= policy_step <= newest


def fresh_steps(async_level: int) -> int:
    """How many consecutive policy steps are fresh at once: ``k + 1`` (``n − k … n``).

    The floor and default of the run spec's ``shardcast.keep_steps``. ``k + 1`` and not more: a
    step older than the newest ``k + 1`` published ones is stale for every trainer step that has
    published them (every published step is ≤ ``n``), so the ingest has retired its rollouts and a
    validator rejects them whatever it holds. Not fewer: a validator must be able to judge
    rollouts of each of the ``k + 1`` steps while they are still in the window.
    """
    return async_level + 1


def retained_steps(held: Iterable[int], keep_steps: int, *, in_use: int | None = None) -> set[int]:
    """The retention rule: which of the held policy steps a node keeps.

    Args:
        held: policy steps the node holds (checkpoints on disk, models in memory, complete steps
            in a relay's store).
        keep_steps: how many to keep: the run spec's ``shardcast.keep_steps``
            (≥ :func:`fresh_steps` of its ``rl.async_level``).
        in_use: a step a caller is using right now (e.g. just fetched to judge an older
            submission); it is kept even when it is not among the newest.

    Returns:
        The newest ``keep_steps`` of ``held``, plus ``in_use`` when it is held.
    """
    steps = sorted(set(held))
    kept = set(steps[-keep_steps:]) if keep_steps > 0 else set()
    if in_use is not None and in_use in steps:
        kept.add(in_use)
    return kept
