"""Resolve the run spec's ``data.tasks`` into the training tasks and the held-out tasks (reads task
files under the caller's data root; opens the run's environment, which starts its sandbox; not pure).

``data.tasks`` is ``"embedded"`` (the devnet's addition set), a public set name known to
:func:`protocol.tasks.convert` (``gsm8k`` = the GSM8K test split, ``gsm8k_train``, ``math500``,
``math_train``, ``humaneval``, ``mbpp``: :data:`protocol.tasks.CONVERTER_SPLITS`, read from a
data root the caller passes), or a path to a file in the INTELLECT-2 schema. Every node resolves
it the same way; ``data.tasks_hash`` (when set) pins the training list's content so a node with
different files refuses to start instead of deriving different tasks.

``data.tasks = "environment"``: the run's own environment (the spec's ``[env]``, :mod:`protocol.envs`)
generates or reads its tasks in its sandbox; :func:`resolve_run_tasks` opens it (checking
``env.hash``) and, like any task list, checks ``data.tasks_hash``.
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
from typing import TYPE_CHECKING, BinaryIO

from protocol.artifacts import TASKS_ARTIFACT, build_artifact
from protocol.content import ContentId
from protocol.embedded import embedded_tasks, split_heldout
from protocol.runspec import ENV_TASKS, RunSpec
from protocol.tasks import CONVERTER_NAMES, Task, TaskError, canonical_task_line, convert, dataset_hash, load_tasks, task_set_help

if TYPE_CHECKING:
    from protocol.envs.sandboxed import Environment, EnvLimits

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
        environment: the run's opened environment when its tasks are the environment's (it
            scores them: :func:`protocol.rewards.compute_reward` finds it by the tasks' ID), else ``None``.
    """

    train: list[Task]
    heldout: list[Task]
    hash: str
    environment: Environment | None = None


def resolve_tasks(ref: str, data_root: Path | None = None, expected_hash: str = "") -> RunTasks:
    """Load the run's tasks.

    Args:
        ref: the run spec's ``data.tasks``.
        data_root: directory holding the public sets (``math/…``, ``code/…``) for names.
        expected_hash: the run spec's ``data.tasks_hash``; empty to skip the check.

    Raises:
        TaskError: unknown name, unreadable file, or content that does not match ``expected_hash``.
    """
    if ref == ENV_TASKS:
        raise TaskError('data.tasks "environment" takes its tasks from the run spec\'s [env]: resolve them with resolve_run_tasks(spec)')
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


def resolve_run_tasks(spec: RunSpec, data_root: Path | None = None, env_limits: EnvLimits | None = None,
                      artifacts: dict[str, Path] | None = None) -> RunTasks:
    """The run's tasks, from its ``[env]`` when it names an environment, else :func:`run_tasks`
    (the fetched ``tasks`` artifact when ``artifacts`` holds one, else :func:`resolve_tasks`).

    Args:
        spec: the run spec (``data.tasks``, ``data.tasks_hash``, ``[env]``).
        data_root: directory holding the public sets, for names.
        env_limits: bounds of the environment's code (defaults when ``None``).
        artifacts: fetched artifacts, name → directory of its files (a joining worker or validator).

    Raises:
        TaskError: as :func:`resolve_tasks`; for an environment (``protocol.envs.EnvError``, a
            ``TaskError``): a missing adapter library (naming the extra), an environment hash that
            differs from ``env.hash`` (one line naming both), an environment that fails to load or
            list its tasks, or training tasks that do not match ``data.tasks_hash``.
        protocol.rewards.RewardError: no bubblewrap sandbox on this host.
    """
    if not spec.env.name:
        return run_tasks(spec.data.tasks, data_root, spec.data.tasks_hash, artifacts)
    from protocol.envs.sandboxed import open_environment

    e = spec.env
    env = open_environment(e.name, args=e.args, pinned_hash=e.hash, seed=e.seed, train_size=e.train_size, heldout_size=e.heldout_size,
                           limits=env_limits)
    train, heldout = list(env.tasks.train), list(env.tasks.heldout)
    h = dataset_hash(train)
    if spec.data.tasks_hash and h != spec.data.tasks_hash:
        raise TaskError(f"environment {e.name!r} lists training tasks that hash to {h[:16]}…, the run spec pins {spec.data.tasks_hash[:16]}…: "
                        "its task generator is not deterministic, or its data differs")
    return RunTasks(train=train, heldout=heldout, hash=h, environment=env)
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


def names_a_file(ref: str) -> bool:
    """Whether ``data.tasks`` value ``ref`` names a file on the node's machine (not ``embedded``,
    ``environment`` or a public set read from the data root)."""
    return ref not in ("embedded", ENV_TASKS) and ref not in CONVERTER_NAMES


def run_tasks(ref: str, data_root: Path | None, expected_hash: str, artifacts: dict[str, Path] | None = None) -> RunTasks:
    """The run's tasks as a worker or validator holds them: from the fetched ``tasks`` artifact when
    there is one (``artifacts``: name → directory of its files), else from ``data.tasks`` and the data
    root (:func:`resolve_tasks`).

    From the artifact, ``heldout`` is empty (the coordinator alone evaluates) and the list must hash
    to ``expected_hash`` (``data.tasks_hash``) when the spec pins one.

    A ``data.tasks`` that names a file (:func:`names_a_file`) is read only when ``expected_hash`` pins
    it: the spec comes from the run's coordinator, and the prompts of its tasks leave the node in every
    submission, so an unpinned path would let a spec send out any task-shaped file the node can read.

    Raises:
        TaskError: an unreadable or invalid task file, one that does not hash to ``expected_hash``, or
            a file named without a pin.
    """
    folder = (artifacts or {}).get(TASKS_ARTIFACT)
    if folder is None:
        if not expected_hash and names_a_file(ref):
            raise TaskError(f"data.tasks {ref[:120]!r} names a file on this machine but data.tasks_hash does not pin it: a run spec may "
                            "not make a node read a file of its choosing and send it out as prompts (`intellect-node spec init --tasks` "
                            "pins it)")
        return resolve_tasks(ref, data_root, expected_hash)
    train = load_tasks(Path(folder) / TASKS_FILE)
    h = dataset_hash(train)
    if expected_hash and h != expected_hash:
        raise TaskError(f"the tasks artifact in {folder} hashes to {h[:16]}…, the run spec pins {expected_hash[:16]}…")
    return RunTasks(train=train, heldout=[], hash=h)
