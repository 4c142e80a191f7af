"""End-to-end learning: a tiny Qwen2 learns a toy task with the trainer's GRPO steps.

Task: the prompt is ``[p, SEP]`` for one of four prompt tokens p; the reward is 1 when the first
sampled completion token equals ``target(p)``, else 0. A random policy scores ≈ 1/V. Sampling is
plain ``torch.multinomial`` here: it is the trainer under test, not an inference engine.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from protocol.models import build_model
from trainer.batch import RolloutRecord, assemble_batch
from trainer.errors import NotEnoughRolloutsError
from trainer.loss import LossConfig
from trainer.model import tiny_qwen2_config
from trainer.train import Trainer, TrainerConfig

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

VOCAB = 16
SEP = 1
PROMPTS = [4, 5, 6, 7]
GROUP = 8
COMPLETION = 3
TEMPERATURE = 1.0


def target(p: int) -> int:
    return (3 * p + 2) % VOCAB


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` completions of ``COMPLETION`` tokens: ids ``[n, C] int64`` and log-probs ``[n, C] float32``."""
    model.eval()
    ids = torch.tensor(prompt).repeat(n, 1)  # [n, P]
    logps = []
    for _ in range(COMPLETION):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float() / TEMPERATURE  # [n, V]
        probs = torch.softmax(logits, -1)
        tok = torch.multinomial(probs, 1, generator=gen)  # [n, 1]
        logps.append(torch.log(torch.gather(probs, 1, tok)))
        ids = torch.cat([ids, tok], 1)
    model.train()
    return ids[:, len(prompt) :], torch.cat(logps, 1)


def collect(model, step: int, gen: torch.Generator, rng: np.random.Generator, counter: list[int]) -> list[RolloutRecord]:
    p = int(rng.choice(PROMPTS))
    prompt = [p, SEP]
    comp, logp = sample(model, prompt, GROUP, gen)
    counter[0] += 1
    return [
        RolloutRecord(
            submission_id=f"sub{counter[0]}",
            worker="w",
            policy_step=step,
            task_key=str(p),
            group_seed=counter[0],
            sample=i,
            prompt_ids=np.array(prompt),
            completion_ids=comp[i].numpy(),
            logprobs=logp[i].numpy(),
            reward=float(comp[i, 0] == target(p)),
            task_reward=float(comp[i, 0] == target(p)),
        )
        for i in range(GROUP)
    ]


def test_mean_reward_rises() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    model = build_model(tiny_qwen2_config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128), seed=0)
    batch_groups = 4
    cfg = TrainerConfig(
        learning_rate=3e-3,
        warmup_steps=3,
        max_grad_norm=0.1,
        loss=LossConfig(norm_tokens=batch_groups * GROUP * COMPLETION),
        micro_batch_tokens=64,
        temperature=TEMPERATURE,
    )
    trainer = Trainer(model, cfg)
    counter = [0]
    rewards = []  # mean reward of every sampled rollout, per step
    t0 = time.perf_counter()
    steps = 30
    for _ in range(steps):
        pool: list[RolloutRecord] = []
        sampled: list[float] = []
        while True:
            try:
                batch = assemble_batch(pool, step=trainer.step, group_size=GROUP, num_groups=batch_groups, adv_eps=1e-4)
                break
            except NotEnoughRolloutsError:
                if len(pool) > 40 * GROUP:
                    pytest.fail("could not fill a batch")
                recs = collect(trainer.model, trainer.step, gen, rng, counter)
                sampled += [r.reward for r in recs]
                pool += recs
        rewards.append(float(np.mean(sampled)))
        m = trainer.train_step(batch)
        assert np.isfinite(m.loss) and m.grad_norm > 0
    elapsed = time.perf_counter() - t0
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    logger.info("rewards per step (%.1f s): %s", elapsed, np.round(rewards, 2).tolist())
    assert last > first + 0.3, f"reward {first:.3f} → {last:.3f} over {steps} steps ({elapsed:.1f} s): {np.round(rewards, 2)}"
    assert last > 0.5
