"""Supervised warm start: a few steps of next-token training on (prompt, answer) pairs.

The embedded devnet model starts from random weights; RL needs a policy that sometimes solves
its tasks (GRPO learns nothing from groups whose rewards are all equal). The coordinator runs
this once on the training tasks' ground truths and caches the result as the run's base model.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartConfig:
    """Attributes: steps (optimizer steps), batch_size (examples per step), learning_rate, seed."""

    steps: int = 40
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0


def warm_start(model: torch.nn.Module, examples: Sequence[tuple[list[int], list[int]]], config: WarmStartConfig) -> list[float]:
    """Train ``model`` in place on ``(prompt_ids, answer_ids)`` pairs (loss on answer tokens only).

    Args:
        model: a causal LM (float32, CPU or GPU).
        examples: prompts and answers as token IDs; answers should end with EOS.
        config: steps, batch size, learning rate, seed.

    Returns:
        The loss of each step (cross-entropy, nats per answer token).

    Raises:
        ValueError: no examples.
    """
    if not examples:
        raise ValueError("warm start needs at least one example")
    rng = random.Random(config.seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    model.train()
    losses = []
    for _ in range(config.steps):
        batch = rng.sample(list(examples), min(config.batch_size, len(examples)))
        t = max(len(p) + len(a) for p, a in batch)
        ids = torch.zeros((len(batch), t), dtype=torch.long)  # [B, T], right-padded
        labels = torch.full((len(batch), t), -100, dtype=torch.long)  # [B, T]
        for i, (p, a) in enumerate(batch):
            seq = list(p) + list(a)
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(list(a))
        ids, labels = ids.to(device), labels.to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()  # [B, T-1, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    logger.info("warm start: %d steps, loss %.3f → %.3f", config.steps, losses[0], losses[-1])
    return losses


def answer_examples(tokenizer: Any, prompts: Sequence[str], answers: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """Token pairs for :func:`warm_start`: each answer followed by the tokenizer's EOS."""
    eos = int(tokenizer.eos_token_id)
    return [
        (list(tokenizer(p, add_special_tokens=False)["input_ids"]), list(tokenizer(a, add_special_tokens=False)["input_ids"]) + [eos])
        for p, a in zip(prompts, answers)
    ]
