"""The async window: which policy steps' rollouts are still fresh enough to train on.

Written once here and used by every role that must agree on it (``docs/trainer.md`` §3, the
async-RL rule of INTELLECT-2 §2 / prime-rl's ``async_level``):

* the worker (``node/roles/worker.py``) keeps generating with a held policy while it is in the window;
* the ingest (``trainer/ingest/service.py``) refuses (409 ``stale_policy``) and retires submissions outside it;
* the validator pipeline (``validator/pipeline.py``) rejects them with ``stale_policy``;
* batch assembly (``trainer/batch.py``) and the coordinator's buffer (``node/coordinator/role.py``)
  train only groups all of whose rollouts are in it.

**Trainer step** has one meaning everywhere: ``n``, the number of optimizer steps the coordinator
has completed, which is also the policy step of the weights it now holds (published as step ``n``
when ``rl.publish_every`` allows, so every published step is ≤ ``n``). The coordinator knows ``n``
exactly; the ingest tells validators its value in each lease answer
(:func:`protocol.ingest_api.unpack_lease_answer`); a worker knows only the newest announced policy
step, a lower bound of ``n`` that it uses in its place.

With ``k = rl.async_level``, a rollout of policy step ``p`` is fresh for trainer step ``n`` when
``n − k ≤ p ≤ newest``, where ``newest`` is ``n`` for training and the newest *published* step
for the ingest (nothing newer exists to sample from).
"""

from __future__ import annotations

__all__ = ["in_window", "oldest_fresh_step"]


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
