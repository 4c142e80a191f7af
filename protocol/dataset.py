"""Resolve the run spec's ``data.tasks`` into the training tasks and the held-out tasks (reads task
files under the caller's data root; not pure).

``data.tasks`` is ``"embedded"`` (the devnet's addition set), a public set name known to
:func:`protocol.tasks.convert` (``gsm8k`` = the GSM8K test split, ``gsm8k_train``, ``math500``,
``math_train``, ``humaneval``, ``mbpp``: :data:`protocol.tasks.CONVERTER_SPLITS`, read from a
data root the caller passes), or a path to a file in the INTELLECT-2 schema. Every node resolves
it the same way; ``data.tasks_hash`` (when set) pins the training list's content so a node with
different files refuses to start instead of deriving different tasks.

A node that has no task files gets the training list as the run's ``tasks`` artifact
(:mod:`protocol.artifacts`): one file, :data:`TASKS_FILE`, the canonical lines of the training
tasks (:func:`protocol.tasks.canonical_task_line`), so its SHA-256 is ``data.tasks_hash`` itself.
The coordinator builds it from its files (:func:`tasks_artifact_files`); a worker or validator reads the
fetched copy (:func:`run_tasks`). The held-out tasks are not in it: no worker is ever given them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from protocol.artifacts import TASKS_ARTIFACT, build_artifact
from protocol.content import ContentId
from protocol.embedded import embedded_tasks, split_heldout
from protocol.tasks import CONVERTER_NAMES, Task, TaskError, canonical_task_line, convert, dataset_hash, load_tasks, task_set_help

HELDOUT_EVERY_EMBEDDED = 10
HELDOUT_EVERY_PUBLIC = 50
TASKS_FILE = "tasks.jsonl"
"""The one file of the ``tasks`` artifact: the training tasks' canonical JSON lines, in order."""


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


def tasks_artifact_files(train: list[Task]) -> list[tuple[str, BinaryIO]]:
    """The files of the ``tasks`` artifact of a training list: :data:`TASKS_FILE` holding its
    canonical lines, in order (what :func:`protocol.artifacts.build_artifact` and the origin's
    ``node.shardcast.publish_artifact`` cut into pieces).

    Args:
        train: the run's training tasks, in order (``RunTasks.train``).
    """
    return [(TASKS_FILE, io.BytesIO(b"".join(canonical_task_line(t) for t in train)))]


def tasks_artifact_id(train: list[Task]) -> ContentId:
    """The artifact ID of a training list's ``tasks`` artifact: what ``spec init`` pins as ``artifacts.tasks``."""
    return build_artifact(TASKS_ARTIFACT, tasks_artifact_files(train))[2]


def run_tasks(ref: str, data_root: Path | None, expected_hash: str, artifacts: dict[str, Path] | None = None) -> RunTasks:
    """The run's tasks as a worker or validator holds them: from the fetched ``tasks`` artifact when
    there is one (``artifacts``: name → directory of its files), else from ``data.tasks`` and the data
    root (:func:`resolve_tasks`).

    From the artifact, ``heldout`` is empty (the coordinator alone evaluates) and the list must hash
    to ``expected_hash`` (``data.tasks_hash``) when the spec pins one.

    Raises:
        TaskError: an unreadable or invalid task file, or one that does not hash to ``expected_hash``.
    """
    folder = (artifacts or {}).get(TASKS_ARTIFACT)
    if folder is None:
        return resolve_tasks(ref, data_root, expected_hash)
    train = load_tasks(Path(folder) / TASKS_FILE)
    h = dataset_hash(train)
    if expected_hash and h != expected_hash:
        raise TaskError(f"the tasks artifact in {folder} hashes to {h[:16]}…, the run spec pins {expected_hash[:16]}…")
    return RunTasks(train=train, heldout=[], hash=h)
