"""protocol.durable: the one atomic, durable write."""

from __future__ import annotations

import os

import pytest

from protocol.durable import atomic_write, fsync_dir, tmp_path_for


def test_bytes_replace_the_file_and_leave_no_temporary(tmp_path):
    target = tmp_path / "a.sub"
    target.write_bytes(b"old")
    atomic_write(target, b"new" * 1000)
    assert target.read_bytes() == b"new" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.sub"]


def test_a_writer_function_gets_the_hidden_temporary_path(tmp_path):
    target = tmp_path / "model.safetensors"
    seen = []

    def write(p):
        seen.append(p)
        p.write_bytes(b"weights")

    atomic_write(target, write, sync_dir=False)
    fsync_dir(tmp_path)
    assert seen == [tmp_path_for(target)] and seen[0].name.startswith(".") and seen[0].name.endswith(".tmp")
    assert target.read_bytes() == b"weights"


def test_explicit_temporary_and_not_durable(tmp_path):
    target, tmp = tmp_path / "m", tmp_path / "tmp.1.m"
    atomic_write(target, b"x", tmp=tmp, durable=False)
    assert target.read_bytes() == b"x" and not tmp.exists()


def test_a_failing_writer_leaves_the_target_unchanged(tmp_path):
    target = tmp_path / "latest"
    target.write_text("step-1\n")

    def write(p):
        p.write_text("step-2")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, write)
    assert target.read_text() == "step-1\n"
    # the leftover is a *.tmp the owners' crash sweeps remove
    assert [p.name for p in tmp_path.glob("*.tmp")] == [".latest.tmp"]
    os.unlink(tmp_path / ".latest.tmp")
