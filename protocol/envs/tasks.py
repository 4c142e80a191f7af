"""An environment's tasks as :class:`~protocol.tasks.Task` rows (pure).

An environment (``protocol/envs/``) produces two lists of rows, training and held-out, each row
``{"id": str | None, "prompt": str, "row": {...}}`` (what the sandboxed harness answers to
``describe``, :mod:`protocol.envs._env_child`). :func:`env_tasks` turns them into tasks of type
``environment`` whose ``verification_info`` is ``{"environment": <env hash>, "row": <row>}``, so
the dataset hash (``data.tasks_hash``) covers the environment's hash, every row and prompt, and
a task names the one environment that may score it.

Held out means never given to a worker: the environment's own held-out split (a verifiers
``eval_dataset``, a plain file's ``HELDOUT_FILE``) or its generator at a disjoint seed range
(:data:`HELDOUT_SEED_OFFSET`); a held-out task whose prompt a training task also has is dropped,
because a small problem space draws the same problem under two seeds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.embedded import split_heldout
from protocol.envs.ref import EnvError
from protocol.tasks.schema import ENV_TASK_TYPE, Task, TaskError

__all__ = ["HELDOUT_EVERY_ENV", "HELDOUT_SEED_OFFSET", "MAX_PROMPT_CHARS", "EnvTasks", "env_task", "env_tasks", "row_answer"]

HELDOUT_SEED_OFFSET = 1 << 32
"""A generator's held-out tasks are drawn at ``env.seed + HELDOUT_SEED_OFFSET``: reasoning-gym's
item ``i`` of seed ``s`` uses ``Random(s + i)``, so training items (``s .. s + train_size − 1``) and
held-out ones never share a random stream."""
HELDOUT_EVERY_ENV = 50
"""An environment with a task file and no held-out file holds out about one task in 50 (by hash of
its ID, as task files do: ``protocol.embedded.split_heldout``)."""
MAX_PROMPT_CHARS = 65536
MAX_ID_CHARS = 256


@dataclass(frozen=True)
class EnvTasks:
    """The tasks of an environment.

    Attributes:
        train: tasks workers are assigned, in the environment's order.
        heldout: tasks only the coordinator evaluates on.
        dropped: held-out tasks left out because a training task has the same prompt.
    """

    train: list[Task]
    heldout: list[Task]
    dropped: int = 0


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """``value`` if it is plain JSON (dicts with string keys, lists, strings, finite numbers, booleans, null)."""
    if depth > 32:
        raise EnvError(f"{where}: nested more than 32 deep")
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise EnvError(f"{where}: {value!r} is not a finite number")
        return value
    if isinstance(value, list):
        return [_plain(v, where, depth + 1) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise EnvError(f"{where}: a row's keys must be strings")
        return {k: _plain(v, where, depth + 1) for k, v in value.items()}
    raise EnvError(f"{where}: a {type(value).__name__} is not JSON")


def env_task(env_hash: str, problem_id: str, prompt: str, row: Mapping[str, Any]) -> Task:
    """One environment task.

    Args:
        env_hash: the environment's content hash (:func:`protocol.envs.pin.environment_hash`).
        problem_id: unique within the environment's tasks, at most 256 characters.
        prompt: the text the policy is prompted with (the environment built it).
        row: the task as the environment's ``score`` receives it (plain JSON).

    Raises:
        EnvError: a bad ID, an empty or over-long prompt, or a row that is not plain JSON.
    """
    if not isinstance(problem_id, str) or not 0 < len(problem_id) <= MAX_ID_CHARS:
        raise EnvError(f"environment task ID {str(problem_id)[:80]!r} must be a string of 1-{MAX_ID_CHARS} characters")
    if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > MAX_PROMPT_CHARS:
        raise EnvError(f"environment task {problem_id!r}: its prompt must be a non-empty string of at most {MAX_PROMPT_CHARS} characters")
    if not isinstance(row, Mapping):
        raise EnvError(f"environment task {problem_id!r}: its row must be a JSON object")
    info = json.dumps({"environment": env_hash, "row": _plain(dict(row), f"environment task {problem_id!r}")},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    task = Task(problem_id=problem_id, task_type=ENV_TASK_TYPE, prompt=prompt, verification_info=info)
    try:
        task.validate(problem_id)
    except TaskError as e:
        raise EnvError(str(e)) from None
    return task


def _tasks(env_hash: str, rows: Any, split: str, label: str) -> list[Task]:
    if not isinstance(rows, list):
        raise EnvError(f"environment {label!r}: its {split} tasks must be a list")
    out: list[Task] = []
    seen: set[str] = set()
    for i, item in enumerate(rows):
        if not isinstance(item, dict) or not isinstance(item.get("row"), dict):
            raise EnvError(f"environment {label!r}: {split} task {i} is not an object with a row")
        pid = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else f"{label}/{split}/{i}"
        if pid in seen:
            raise EnvError(f"environment {label!r}: task ID {pid!r} appears twice in its {split} tasks")
        seen.add(pid)
        out.append(env_task(env_hash, pid, item.get("prompt"), item["row"]))
    return out


def env_tasks(env_hash: str, described: Mapping[str, Any], label: str) -> EnvTasks:
    """The training and held-out tasks of an environment from its ``describe`` answer.

    Args:
        env_hash: the environment's content hash.
        described: ``{"train": [item, ...], "heldout": [item, ...] | None}``; ``None``: the
            environment has no held-out split of its own, so about one training task in
            :data:`HELDOUT_EVERY_ENV` is held out by hash of its ID.
        label: the environment's short name, for default IDs (``label/train/17``) and errors.

    Raises:
        EnvError: no training task, a malformed item, duplicate IDs, or an ID in both lists.
    """
    train = _tasks(env_hash, described.get("train"), "train", label)
    if described.get("heldout") is None:
        train, heldout = split_heldout(train, HELDOUT_EVERY_ENV)
    else:
        heldout = _tasks(env_hash, described["heldout"], "heldout", label)
    if not train:
        raise EnvError(f"environment {label!r} produced no training tasks")
    ids = {t.problem_id for t in train}
    if clash := next((t.problem_id for t in heldout if t.problem_id in ids), None):
        raise EnvError(f"environment {label!r}: task ID {clash!r} is both a training and a held-out task")
    prompts = {t.prompt for t in train}
    kept = [t for t in heldout if t.prompt not in prompts]
    return EnvTasks(train=train, heldout=kept, dropped=len(heldout) - len(kept))


def row_answer(task: Task) -> str | None:
    """A completion that should score 1 on ``task``: the row's ``reference`` (the reasoning-gym
    adapter writes its answer in the environment's answer format there), else its ``answer`` when
    a string (verifiers rows, plain files that give one), else ``None``. Only the devnet's warm
    start of its tiny model uses it; scoring never does."""
    _, row = task.environment_row
    for key in ("reference", "answer"):
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None

