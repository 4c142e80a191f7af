"""Directories per policy step (lists directories, not pure): the one layout ``<root>/step-<N>``.

Every holder of something per step names its directories by this rule and finds them with it:
the coordinator's written policies (``policies/step-N``: ``trainer/loop.py`` writes them,
``node/coordinator/publish.py`` prunes them, evaluation and the ban re-check read them), its
training states (``state/step-N``, ``trainer/checkpoint.py``), and a worker's or validator's held
checkpoints (``node/policy.py``). ``N`` is the step in decimal without padding; a name with
leading zeros (``step-00000012``, how training states were named before) still reads as its step.
The names of the files inside are their writers' (``protocol.models``, ``trainer.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PREFIX", "step_dir", "step_dir_name", "step_dirs", "step_of"]

PREFIX = "step-"
"""What every step directory's name starts with."""

_MAX_DIGITS = 13
"""Longest step number read from a name (2**40, the wire's bound on a step, has 13 digits)."""


def step_dir_name(step: int) -> str:
    """``step-<N>``: the name of step ``step``'s directory.

    Raises:
        ValueError: a negative step.
    """
    if step < 0:
        raise ValueError(f"a policy step is ≥ 0, got {step}")
    return f"{PREFIX}{step}"


def step_dir(root: Path, step: int) -> Path:
    """``root/step-<N>``: where step ``step``'s directory is (or will be)."""
    return Path(root) / step_dir_name(step)


def step_of(name: str) -> int | None:
    """The step a directory name names (``"step-12"`` → 12, also ``"step-00000012"``), or ``None``
    for any other name (``".tmp-step-3"``, ``"step-"``, ``"step-1x"``, non-ASCII digits)."""
    if not name.startswith(PREFIX):
        return None
    digits = name[len(PREFIX):]
    if not (digits.isascii() and digits.isdigit() and len(digits) <= _MAX_DIGITS):
        return None
    return int(digits)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every step directory under ``root`` with its step, in ascending step order (reads ``root``;
    ``[]`` when it does not exist). Two names of one step (``step-12`` beside ``step-00000012``)
    are both listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p.name)) is not None and p.is_dir()]
    return sorted(found, key=lambda sp: (sp[0], sp[1].name))
