"""The embedded task set of the one-machine devnet: small-integer addition in the INTELLECT-2 schema.

Prompts are ``"a+b="`` and the ground truth is ``a + b``; the math reward reads the last number
of the completion (GSM8K-style integer answers), so a completion ``"7"`` then EOS solves
``"3+4="``. Held-out problems (every fifth) measure whether the policy learned addition rather than
its training pairs; a 0.3 M-parameter model learns it on a CPU in minutes. Deterministic: every node builds the same list.
"""

from __future__ import annotations

from protocol.tasks import Task, math_task

EMBEDDED_MAX_OPERAND = 9


def embedded_tasks(max_operand: int = EMBEDDED_MAX_OPERAND) -> list[Task]:
    """All problems ``a+b=`` with ``0 ≤ a, b ≤ max_operand``, in a fixed order (100 by default)."""
    return [
        math_task(problem_id=f"add-{a}-{b}", prompt=f"{a}+{b}=", ground_truth=str(a + b))
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def split_heldout(tasks: list[Task], every: int = 5) -> tuple[list[Task], list[Task]]:
    """Split into (train, held-out): every ``every``-th task (by position) is held out."""
    train = [t for i, t in enumerate(tasks) if i % every != every - 1]
    held = [t for i, t in enumerate(tasks) if i % every == every - 1]
    return train, held
