"""Where a devnet writes (``node/devnet/outdir.py``) and the CLI's early refusals: a new folder per
default run, a previous run replaced on request (nested runs kept), nothing else ever deleted; a
``--model`` directory that does not exist is reported as missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from node.devnet.outdir import LATEST, MARKER, OutDirError, claim_out, new_default_out, write_marker


def test_default_runs_get_their_own_folders(tmp_path):
    root = tmp_path / "devnet-out"
    first = new_default_out(root, now=0.0)
    second = new_default_out(root, now=0.0)  # the same second: a suffix, never the same folder
    assert first != second and first.is_dir() and second.is_dir()
    assert (root / LATEST).resolve() == second.resolve()
    assert os.readlink(root / LATEST) == second.name  # relative: the folder can be moved whole


def test_a_previous_run_is_replaced_and_nested_runs_are_kept(tmp_path):
    out = tmp_path / "devnet-out"
    out.mkdir()
    write_marker(out, {"seed": 1})
    (out / "logs").mkdir()
    (out / "logs" / "coordinator.log").write_text("old")
    (out / "report.md").write_text("old")
    crash = out / "crash"  # a chaos example's run inside the default folder
    crash.mkdir()
    write_marker(crash, {"seed": 2})
    (crash / "report.md").write_text("crash run")
    removed = claim_out(out)
    assert sorted(removed) == sorted([MARKER, "logs", "report.md"])
    assert (crash / "report.md").read_text() == "crash run"
    assert not (out / "logs").exists()


@pytest.mark.slow
def test_a_folder_that_is_no_devnet_output_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(OutDirError, match="holds no devnet output"):
        claim_out(mine)
    assert (mine / "notes.txt").read_text() == "keep me"
    r = subprocess.run([sys.executable, "-m", "node", "devnet", "--out", str(mine), "--no-dashboard"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2 and "holds no devnet output" in r.stderr, r.stderr
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_missing_model_directory_is_reported_as_missing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "node", "devnet", "--model", str(tmp_path / "my-qwen2"), "--out", str(tmp_path / "out"),
                        "--no-dashboard"], capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert r.returncode == 2, r.stderr
    assert "no such directory" in r.stderr and "config.json" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gumbel_v2_without_bf16_workers_is_refused_in_one_line(tmp_path):
    """``devnet --sampling-rule gumbel-v2`` replays under a logit bound, which only bf16 workers' specs carry: without
    ``--worker-dtype bf16`` it stops before starting anything, in one line naming the flag to add."""
    r = subprocess.run([sys.executable, "-m", "node", "devnet", "--sampling-rule", "gumbel-v2", "--out", str(tmp_path / "out"),
                        "--no-dashboard"], capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "gumbel-v2" in lines[0] and "--worker-dtype bf16" in lines[0], lines
    assert not (tmp_path / "out").exists()
