"""Test-only helpers for the trainer tests: a tiny model, synthetic batches, and a worker process.

As a script (``python tests/trainer/trainer_toy.py fsdp|resume ...``) it runs one training process
for ``test_fsdp.py`` (one rank of a gloo group) or ``test_resume.py`` (train, save, wait to be
killed). Results go to safetensors/JSON files only. The fsdp ranks meet through a file
(``--rendezvous``), not a TCP port.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocol.models import build_model
from trainer.batch import Batch, RolloutRecord, assemble_batch
from trainer.loss import LossConfig
from trainer.model import tiny_qwen2_config
from trainer.synthetic import GROUP, VOCAB
from trainer.synthetic import synthetic_batch as toy_batch
from trainer.synthetic import synthetic_records as toy_records  # noqa: F401 - the trainer tests use toy.toy_records
from trainer.train import Trainer, TrainerConfig


def toy_config(tied: bool = True):
    return tiny_qwen2_config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=tied)


def toy_model(seed: int = 0, tied: bool = True):
    return build_model(toy_config(tied), seed=seed)


def toy_uneven_batch(step: int) -> Batch:
    """Two groups whose sequences (20, 20, 20, 3 tokens) split over 2 ranks as 2 rows vs 1 row at
    24 tokens per row: the second rank must run a padding row."""
    rng = np.random.default_rng(100 + step)
    recs = [
        RolloutRecord(
            submission_id=f"uneven{g}",
            worker="w",
            policy_step=step,
            task_key=f"uneven{g}",
            group_seed=g,
            sample=i,
            prompt_ids=rng.integers(3, VOCAB, 2),
            completion_ids=rng.integers(3, VOCAB, n - 2),
            logprobs=np.zeros(n - 2, np.float32),
            reward=float(i % 2),
            task_reward=float(i % 2),
        )
        for g in range(2)
        for i, n in enumerate((20, 20, 20, 3))
    ]
    return assemble_batch(recs, step=step, group_size=GROUP, num_groups=2, adv_eps=1e-4)


def toy_batches() -> list[Batch]:
    """The batches of the FSDP parity run (the last one forces padding rows)."""
    return [toy_batch(seed=0, step=0), toy_batch(seed=1, step=1), toy_uneven_batch(step=2)]


def toy_trainer_config(**kw) -> TrainerConfig:
    base = {
        "learning_rate": 1e-3,
        "warmup_steps": 2,
        "max_grad_norm": 0.1,
        "loss": LossConfig(norm_tokens=64.0),
        "micro_batch_tokens": 24,
        "optimizer_steps_per_batch": 2,
    }
    base.update(kw)
    return TrainerConfig(**base)


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full parameters (collective under FSDP; full on every rank)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().cpu().clone()
    return out


def _fsdp(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from trainer.distributed import broadcast_batch, init_distributed

    torch.set_num_threads(1)
    # a rendezvous through a file of the test's own folder: no MASTER_PORT chosen in advance that
    # another process could take first (gloo's own connections bind at port 0)
    dist.init_process_group("gloo", init_method=f"file://{Path(args.rendezvous).resolve()}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    ctx = init_distributed("gloo")  # joins the group made above
    trainer = Trainer(toy_model(seed=ctx.rank + 7), toy_trainer_config(), ctx)  # rank 0's weights win
    losses, rows = [], []
    for b in toy_batches():
        m = trainer.train_step(broadcast_batch(b if ctx.is_main else None, ctx))
        losses.append(m.loss)
        rows.append(m.micro_batches)
    out = Path(args.out)
    params = params_of(trainer)
    trainer.save_checkpoint(out / "ckpt")
    state_dir = trainer.save_state(out / "state", {"rank_written": ctx.rank})
    if ctx.is_main:
        save_file(params, str(out / "params.safetensors"))
        (out / "metrics.json").write_text(json.dumps({"losses": losses, "micro_batches": rows, "state_dir": str(state_dir)}))


def _resume(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(toy_model(seed=0), toy_trainer_config())
    for step in range(args.steps):
        trainer.train_step(toy_batch(seed=step, step=step))
    trainer.save_state(Path(args.out), {"next_batch_seed": args.steps})
    (Path(args.out) / "SAVED").write_text("1")
    time.sleep(600)  # wait to be killed (the test does at once; bounded, should the test die first)
    sys.exit(1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["fsdp", "resume"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rendezvous", help="fsdp: the file:// rendezvous both ranks share (absent or empty at start)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"fsdp": _fsdp, "resume": _resume}[a.mode](a)
