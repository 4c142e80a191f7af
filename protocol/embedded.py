"""The embedded task set of the one-machine devnet: two-digit plus one-digit addition, in the INTELLECT-2 schema.

Prompts are ``"a+b="`` with ``0 ≤ a ≤ 99`` and ``0 ≤ b ≤ 9`` (1,000 problems) and the ground truth
is ``a + b``; the math reward reads the last number of the completion (GSM8K-style integer
answers), so a completion ``"73"`` then EOS solves ``"68+5="``. About half of the problems carry
into the tens (or hundreds) digit, so the skill is digit-wise addition with carries, not a table
of facts. Held-out problems (about one in ten, chosen by hash of the *unordered* operand pair, so
``3+7=`` and ``7+3=`` are held out together) never appear in training, in either order: a policy
that solves them has learned to add, not memorized its training pairs. Deterministic: every node
builds the same list.
"""

from __future__ import annotations

import hashlib
import re

from protocol.tasks import Task, math_task

EMBEDDED_MAX_A = 99
EMBEDDED_MAX_B = 9
_ADD_ID = re.compile(r"add-(\d+)-(\d+)")


def embedded_tasks(max_a: int = EMBEDDED_MAX_A, max_b: int = EMBEDDED_MAX_B) -> list[Task]:
    """All problems ``a+b=`` with ``0 ≤ a ≤ max_a`` and ``0 ≤ b ≤ max_b``, in a fixed order (1,000 by default)."""
    return [
        math_task(problem_id=f"add-{a}-{b}", prompt=f"{a}+{b}=", ground_truth=str(a + b))
        for a in range(max_a + 1)
        for b in range(max_b + 1)
    ]


def heldout_key(problem_id: str) -> str:
    """What the held-out choice hashes: the problem ID, or for an addition ``add-a-b`` the unordered
    pair ``add-min-max`` (a commuted copy of a held-out problem is held out too)."""
    m = _ADD_ID.fullmatch(problem_id)
    if m is None:
        return problem_id
    a, b = sorted((int(m.group(1)), int(m.group(2))))
    return f"add-{a}-{b}"


def is_heldout(task: Task, every: int) -> bool:
    """Whether ``task`` is held out: SHA-256 of its :func:`heldout_key`, first 8 bytes, modulo ``every`` is 0.

    Hashing (rather than taking every n-th row) keeps the held-out problems unrelated to the
    dataset's order, so they do not share a pattern (such as one operand) the model never sees.
    """
    return int.from_bytes(hashlib.sha256(heldout_key(task.problem_id).encode()).digest()[:8], "big") % every == 0


def split_heldout(tasks: list[Task], every: int = 10) -> tuple[list[Task], list[Task]]:
    """Split into (train, held-out), about one task in ``every`` held out (:func:`is_heldout`)."""
    held = [is_heldout(t, every) for t in tasks]
    return [t for t, h in zip(tasks, held) if not h], [t for t, h in zip(tasks, held) if h]
