"""FSDP2 over 2 gloo processes gives the same losses, weights and optimizer state as 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trainer_toy as toy
from safetensors.torch import load_file

from trainer.batch import pack_sequences, shard_sequences
from trainer.checkpoint import latest_state_dir
from trainer.train import Trainer

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent


def _run_two_ranks(out: Path) -> None:
    rendezvous = out / "rendezvous"  # a file rendezvous: no port to choose before rank 0 binds it
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "trainer_toy.py"), "fsdp", "--out", str(out), "--rendezvous", str(rendezvous)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    hung = False
    try:
        for p, timeout_s in zip(procs, (150, 30)):
            p.communicate(timeout=timeout_s)  # drains the pipe; the output is read again below
    except subprocess.TimeoutExpired:
        hung = True  # kill both and show what each printed (a rank waiting on the other says nothing more)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [p.communicate()[0].decode(errors="replace") for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert not hung and p.returncode == 0, f"rank {rank} (exit {p.returncode}, hung: {hung}):\n{log[-3000:]}"


def test_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _run_two_ranks(tmp_path)
    result = json.loads((tmp_path / "metrics.json").read_text())
    dist_losses = result["losses"]
    dist_params = load_file(str(tmp_path / "params.safetensors"))

    ref = Trainer(toy.toy_model(seed=7), toy.toy_trainer_config())  # rank 0 of the group built seed 7
    ref_losses = [ref.train_step(b).loss for b in toy.toy_batches()]
    uneven = toy.toy_batches()[-1].slices(2)[0]
    assert [len(pack_sequences(shard_sequences(uneven, 2, r), 24)) for r in range(2)] == [2, 1]  # rank 1 pads
    assert dist_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    ref_params = toy.params_of(ref)
    assert set(dist_params) == set(ref_params)
    for name, t in ref_params.items():
        torch.testing.assert_close(dist_params[name], t, rtol=1e-5, atol=1e-6, msg=name)

    # the published checkpoint holds the gathered full weights (tied lm_head stored once)
    ckpt = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert "lm_head.weight" not in ckpt
    torch.testing.assert_close(ckpt["model.embed_tokens.weight"], ref_params["model.embed_tokens.weight"], rtol=1e-5, atol=1e-6)
    assert (tmp_path / "ckpt" / "config.json").is_file()

    # the 2-rank training state loads into 1 process (states are unsharded) and matches its optimizer
    state_dir = latest_state_dir(tmp_path / "state")
    assert state_dir is not None
    fresh = Trainer(toy.toy_model(seed=99), toy.toy_trainer_config())
    fresh.load_state(state_dir)
    assert fresh.step == ref.step == 3
    assert fresh.optimizer_steps == ref.optimizer_steps == 6
    ref_opt = {n: ref.optimizer.state[p] for n, p in ref.model.named_parameters()}
    for n, p in fresh.model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fresh.optimizer.state[p][key], ref_opt[n][key], rtol=1e-5, atol=1e-7, msg=f"{n}.{key}")
