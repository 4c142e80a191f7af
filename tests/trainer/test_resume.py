"""Resume: a killed trainer process's saved state continues exactly where it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import trainer_toy as toy

from protocol.models import build_model
from trainer.checkpoint import STATE_FILE, latest_state_dir
from trainer.errors import StateError
from trainer.model import tiny_qwen2_config
from trainer.train import Trainer

HERE = Path(__file__).resolve().parent


def _train_in_child_and_kill(out: Path, steps: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "trainer_toy.py"), "resume", "--out", str(out), "--steps", str(steps)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "SAVED").exists():
            if proc.poll() is not None:
                pytest.fail(f"trainer process exited early: {proc.stdout.read().decode(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("trainer process did not save its state in time")
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()


def _opt_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.clone() for n, p in trainer.model.named_parameters() for k, v in trainer.optimizer.state[p].items()}


@pytest.mark.integration
def test_resume_after_kill_continues_from_saved_step(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _train_in_child_and_kill(tmp_path, steps=2)

    # reference: the same run, uninterrupted
    ref = Trainer(toy.toy_model(seed=0), toy.toy_trainer_config())
    for s in range(2):
        ref.train_step(toy.toy_batch(seed=s, step=s))
    ref_opt = _opt_state(ref)

    resumed = Trainer(toy.toy_model(seed=123), toy.toy_trainer_config())  # other initial weights: all must come from the state
    data_position = resumed.load_state(tmp_path)
    assert data_position == {"next_batch_seed": 2}
    assert resumed.step == 2 and resumed.optimizer_steps == 4
    got = _opt_state(resumed)
    assert set(got) == set(ref_opt)
    for k, v in ref_opt.items():
        assert torch.equal(got[k], v), k  # identical optimizer state
    for (n, p), (_, q) in zip(resumed.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(p, q), n

    # the next step is the one the uninterrupted run takes
    m_ref = ref.train_step(toy.toy_batch(seed=2, step=2))
    m_res = resumed.train_step(toy.toy_batch(seed=2, step=2))
    assert m_res.step == m_ref.step == 3
    assert m_res.loss == m_ref.loss and m_res.lr == m_ref.lr
    for (n, p), (_, q) in zip(resumed.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(p, q), n


def test_state_rotation_and_corruption(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    t = Trainer(toy.toy_model(seed=0, tied=False), toy.toy_trainer_config())
    for s in range(3):
        t.train_step(toy.toy_batch(seed=s, step=s))
        t.save_state(tmp_path, {"s": s}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-2", "step-3"]  # protocol.step_dirs, as policies
    latest = latest_state_dir(tmp_path)
    assert latest is not None and latest.name == "step-3"
    meta = json.loads((latest / STATE_FILE).read_text())
    assert meta["step"] == 3 and meta["data_position"] == {"s": 2}

    # a leftover temporary directory (crash mid-save) is ignored: latest still loads
    (tmp_path / ".tmp-step-4").mkdir()
    fresh = Trainer(toy.toy_model(seed=5, tied=False), toy.toy_trainer_config())
    assert fresh.load_state(tmp_path) == {"s": 2}

    # a flipped byte is detected
    opt = latest / "optimizer.safetensors"
    data = bytearray(opt.read_bytes())
    data[-1] ^= 0xFF
    opt.write_bytes(bytes(data))
    with pytest.raises(StateError, match="SHA-256"):
        fresh.load_state(latest)

    # a state of another shape is refused with a clear error
    other = Trainer(build_model(tiny_qwen2_config(vocab_size=toy.VOCAB, hidden_size=32), seed=0), toy.toy_trainer_config())
    with pytest.raises(StateError, match="shape|names"):
        other.load_state(tmp_path / "step-2")
    with pytest.raises(StateError):
        other.load_state(tmp_path / "missing")


def test_a_state_named_as_an_older_version_did_is_loaded_and_rotated_by_step(tmp_path: Path) -> None:
    """States were named ``step-00000012`` before they shared the policies' layout: ``latest``
    naming one still loads, and rotation orders old and new names by step (``step-10`` after ``step-9``)."""
    torch.set_num_threads(1)
    t = Trainer(toy.toy_model(seed=0, tied=False), toy.toy_trainer_config(), step=8)
    t.train_step(toy.toy_batch(seed=0, step=8))
    t.save_state(tmp_path, {"s": 9}, keep=2)
    (tmp_path / "step-9").rename(tmp_path / "step-00000009")
    (tmp_path / "latest").write_text("step-00000009\n")
    fresh = Trainer(toy.toy_model(seed=5, tied=False), toy.toy_trainer_config())
    assert fresh.load_state(tmp_path) == {"s": 9} and fresh.step == 9
    fresh.train_step(toy.toy_batch(seed=1, step=9))
    fresh.save_state(tmp_path, {"s": 10}, keep=2)
    fresh.train_step(toy.toy_batch(seed=2, step=10))
    fresh.save_state(tmp_path, {"s": 11}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-10", "step-11"]
