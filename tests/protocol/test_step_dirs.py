"""The one layout of per-step directories (``protocol/step_dirs.py``): policies, training states
and held checkpoints are all ``<root>/step-<N>``, found by step, not by name order."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.step_dirs import step_dir, step_dir_name, step_dirs, step_of


def test_names_and_their_steps() -> None:
    assert step_dir_name(0) == "step-0" and step_dir_name(12) == "step-12"
    assert step_dir(Path("/x/policies"), 3) == Path("/x/policies/step-3")
    assert [step_of(n) for n in ("step-12", "step-00000012", "step-0")] == [12, 12, 0]
    for other in (".tmp-step-3", "step-", "step--1", "step-1x", "step-١", "latest", "step-" + "9" * 14):
        assert step_of(other) is None, other
    with pytest.raises(ValueError):
        step_dir_name(-1)


def test_step_dirs_lists_directories_in_step_order(tmp_path: Path) -> None:
    for name in ("step-10", "step-9", "step-00000011", ".tmp-step-12", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-13").write_text("a file, not a step directory")
    assert [(s, p.name) for s, p in step_dirs(tmp_path)] == [(9, "step-9"), (10, "step-10"), (11, "step-00000011")]
    assert step_dirs(tmp_path / "missing") == []
