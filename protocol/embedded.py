"""The embedded task set of the one-machine devnet: small-integer addition in the INTELLECT-2 schema.

Prompts are ``"a+b="`` and the ground truth is ``a + b``; the math reward reads the last number
of the completion (GSM8K-style integer answers), so a completion ``"7"`` then EOS solves
``"3+4="``. Held-out problems (about one in five, chosen by hash) measure whether the policy learned addition rather than
its training pairs; a 0.3 M-parameter model learns it on a CPU in minutes. Deterministic: every node builds the same list.
"""

from __future__ import annotations

import hashlib

from protocol.tasks import Task, math_task

EMBEDDED_MAX_OPERAND = 9


def embedded_tasks(max_operand: int = EMBEDDED_MAX_OPERAND) -> list[Task]:
    """All problems ``a+b=`` with ``0 ≤ a, b ≤ max_operand``, in a fixed order (100 by default)."""
    return [
        math_task(problem_id=f"add-{a}-{b}", prompt=f"{a}+{b}=", ground_truth=str(a + b))
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def is_heldout(task: Task, every: int) -> bool:
    """Whether ``task`` is held out: SHA-256 of its problem ID, first 8 bytes, modulo ``every`` is 0.

    Hashing (rather than taking every n-th row) keeps the held-out problems unrelated to the
    dataset's order, so they do not share a pattern (such as one operand) the model never sees.
    """
    return int.from_bytes(hashlib.sha256(task.problem_id.encode()).digest()[:8], "big") % every == 0


def split_heldout(tasks: list[Task], every: int = 5) -> tuple[list[Task], list[Task]]:
    """Split into (train, held-out), about one task in ``every`` held out (:func:`is_heldout`)."""
    held = [is_heldout(t, every) for t in tasks]
    return [t for t, h in zip(tasks, held) if not h], [t for t, h in zip(tasks, held) if h]
