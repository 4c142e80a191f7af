"""Dataset hashing and task derivation (pure): what pins a run's tasks (:func:`dataset_hash`, in
the run spec) and which tasks a worker must solve (:func:`derive_task_indices`, recomputed by every
validator), so a worker cannot choose its tasks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from protocol.identity import PeerId
from protocol.tasks.schema import Task, TaskError

TASK_DERIVATION_DOMAIN = b"intellect-node/task-derivation/v1\x00"
"""Domain-separation prefix of :func:`derive_task_indices`'s hash input."""

MAX_PEER_ID_BYTES = 255
MAX_U64 = 2**64 - 1


def canonical_task_line(task: Task) -> bytes:
    """One task as a canonical JSON line: sorted keys, no spaces, UTF-8, ``\\n``-terminated,
    ``solve_rate`` as a JSON number or ``null``."""
    return (json.dumps(task.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode(
        "utf-8"
    )


def dataset_hash(tasks: Iterable[Task]) -> str:
    """Content hash of a task list, for the run spec to pin.

    SHA-256 over the concatenation of :func:`canonical_task_line` of every task in order (order
    matters: derived indices point into it).

    Args:
        tasks: the dataset, in the order the run uses.

    Returns:
        64 lowercase hex digits.
    """
    h = hashlib.sha256()
    for task in tasks:
        h.update(canonical_task_line(task))
    return h.hexdigest()


def _u64(value: int, name: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_U64:
        raise TaskError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return value.to_bytes(8, "big")


def derive_task_indices(
    run_seed: int,
    peer_id: PeerId,
    policy_step: int,
    counter: int,
    n_tasks_in_dataset: int,
    tasks_per_submission: int,
) -> list[int]:
    """The dataset indices a worker must solve for one submission; validators recompute them.

    Hash input ("seed bytes"), all integers unsigned big-endian::

        b"intellect-node/task-derivation/v1\\x00"
        || run_seed (8 bytes) || len(peer_id UTF-8) (1 byte) || peer_id UTF-8
        || policy_step (8 bytes) || counter (8 bytes)
        || n_tasks_in_dataset (8 bytes) || tasks_per_submission (8 bytes)

    Block ``j`` (j = 0, 1, ...) is ``SHA-256(seed bytes || j as 4 bytes)``; each block yields four
    64-bit big-endian words. A word ``w`` is rejected when ``w >= 2**64 - 2**64 % n`` (no modulo
    bias), otherwise ``w % n`` is the next candidate; candidates already drawn are skipped. The
    first ``tasks_per_submission`` distinct candidates, in draw order, are the result.

    Args:
        run_seed: the run spec's seed, in [0, 2**64).
        peer_id: the worker's peer ID string (``12D3KooW…``), at most 255 UTF-8 bytes.
        policy_step: the policy step the submission is generated with, in [0, 2**64).
        counter: the worker's submission counter for that step, in [0, 2**64).
        n_tasks_in_dataset: dataset size, ≥ 1.
        tasks_per_submission: how many distinct tasks, 1 ≤ it ≤ n_tasks_in_dataset.

    Returns:
        ``tasks_per_submission`` distinct indices in [0, n_tasks_in_dataset).

    Raises:
        TaskError: on an argument out of range.
    """
    if not isinstance(peer_id, str) or not peer_id:
        raise TaskError("peer_id must be a non-empty string")
    pid = peer_id.encode("utf-8")
    if len(pid) > MAX_PEER_ID_BYTES:
        raise TaskError(f"peer_id is {len(pid)} bytes, at most {MAX_PEER_ID_BYTES} allowed")
    n, k = n_tasks_in_dataset, tasks_per_submission
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TaskError(f"n_tasks_in_dataset must be a positive integer, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise TaskError(f"tasks_per_submission must be in [1, {n}], got {k!r}")
    seed = b"".join(
        (
            TASK_DERIVATION_DOMAIN,
            _u64(run_seed, "run_seed"),
            len(pid).to_bytes(1, "big"),
            pid,
            _u64(policy_step, "policy_step"),
            _u64(counter, "counter"),
            _u64(n, "n_tasks_in_dataset"),
            _u64(k, "tasks_per_submission"),
        )
    )
    limit = 2**64 - (2**64 % n)
    chosen: list[int] = []
    seen: set[int] = set()
    block = 0
    while len(chosen) < k:
        digest = hashlib.sha256(seed + block.to_bytes(4, "big")).digest()
        block += 1
        for off in range(0, 32, 8):
            word = int.from_bytes(digest[off : off + 8], "big")
            if word >= limit:
                continue
            idx = word % n
            if idx not in seen:
                seen.add(idx)
                chosen.append(idx)
                if len(chosen) == k:
                    break
    return chosen
