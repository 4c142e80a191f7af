"""Resolve the run spec's ``data.tasks`` into the training tasks and the held-out tasks (reads task
files under the caller's data root; not pure).

``data.tasks`` is ``"embedded"`` (the devnet's addition set), a public set name known to
:func:`protocol.tasks.convert` (``gsm8k`` = the GSM8K test split, ``gsm8k_train``, ``math500``,
``math_train``, ``humaneval``, ``mbpp``: :data:`protocol.tasks.CONVERTER_SPLITS`, read from a
data root the caller passes), or a path to a file in the INTELLECT-2 schema. Every node resolves
it the same way; ``data.tasks_hash`` (when set) pins the training list's content so a node with
different files refuses to start instead of deriving different tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.embedded import embedded_tasks, split_heldout
from protocol.tasks import CONVERTER_NAMES, Task, TaskError, convert, dataset_hash, load_tasks, task_set_help

HELDOUT_EVERY_EMBEDDED = 10
HELDOUT_EVERY_PUBLIC = 50


@dataclass(frozen=True)
class RunTasks:
    """The tasks of a run.

    Attributes:
        train: tasks workers are assigned (the derivation indexes into this list).
        heldout: tasks only the coordinator evaluates on (never trained on).
        hash: :func:`protocol.tasks.dataset_hash` of ``train``.
    """

    train: list[Task]
    heldout: list[Task]
    hash: str


def resolve_tasks(ref: str, data_root: Path | None = None, expected_hash: str = "") -> RunTasks:
    """Load the run's tasks.

    Args:
        ref: the run spec's ``data.tasks``.
        data_root: directory holding the public sets (``math/…``, ``code/…``) for names.
        expected_hash: the run spec's ``data.tasks_hash``; empty to skip the check.

    Raises:
        TaskError: unknown name, unreadable file, or content that does not match ``expected_hash``.
    """
    if ref == "embedded":
        tasks, every = embedded_tasks(), HELDOUT_EVERY_EMBEDDED
    elif ref in CONVERTER_NAMES:
        tasks, every = convert(ref, data_root), HELDOUT_EVERY_PUBLIC
    else:
        path = Path(ref)
        if not path.exists():
            raise TaskError(f"data.tasks {ref!r} is neither 'embedded', a known set ({task_set_help()}) nor an existing file")
        try:
            tasks = load_tasks(path)
        except TaskError:
            tasks = convert(path, data_root)
        every = HELDOUT_EVERY_PUBLIC
    train, heldout = split_heldout(tasks, every)
    h = dataset_hash(train)
    if expected_hash and h != expected_hash:
        raise TaskError(f"tasks {ref!r} hash to {h[:16]}…, the run spec pins {expected_hash[:16]}…: different files")
    return RunTasks(train=train, heldout=heldout, hash=h)
