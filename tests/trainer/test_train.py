"""Trainer settings from the run spec, the warmup schedule and step metrics."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import trainer_toy as toy

from protocol.runspec import RLSpec, RunInfo, RunSpec, SamplingSpec
from trainer.loss import LossConfig
from trainer.train import Trainer, TrainerConfig

PEER = "12D3KooW" + "A" * 44


def test_config_from_spec_and_defaults() -> None:
    spec = RunSpec(run=RunInfo(coordinator=PEER), sampling=SamplingSpec(max_tokens=100, temperature=0.8))
    cfg = TrainerConfig.from_spec(spec)
    rl = RLSpec()
    assert (rl.clip_eps, rl.clip_delta, rl.max_grad_norm, rl.async_level, rl.kl_beta) == (0.2, 4.0, 0.1, 2, 0.0)
    assert cfg.loss.clip_eps == 0.2 and cfg.loss.clip_delta == 4.0 and cfg.max_grad_norm == 0.1
    assert cfg.loss.norm_tokens == rl.batch_groups * rl.group_size * 100  # Dr. GRPO constant
    assert cfg.temperature == 0.8
    spec2 = RunSpec(run=RunInfo(coordinator=PEER), rl=RLSpec(loss_norm_tokens=4096, optimizer_steps_per_batch=2))
    assert TrainerConfig.from_spec(spec2).loss.norm_tokens == 4096
    with pytest.raises(ValueError, match="optimizer_steps_per_batch"):
        RLSpec(batch_groups=2, optimizer_steps_per_batch=3)


def test_warmup_and_metrics() -> None:
    torch.set_num_threads(1)
    t = Trainer(toy.toy_model(seed=0), toy.toy_trainer_config(learning_rate=1e-3, warmup_steps=4, optimizer_steps_per_batch=2))
    assert [t.lr_at(i) for i in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    batch = toy.toy_batch(seed=0, step=0)
    m = t.train_step(batch)
    assert t.step == 1 and t.optimizer_steps == 2 and m.step == 1
    assert m.lr == pytest.approx(5e-4)
    assert m.num_groups == 4 and m.num_rollouts == 4 * toy.GROUP
    assert m.loss_tokens == sum(s.record.completion_ids.size for s in batch.sequences)
    assert m.tokens == batch.num_tokens
    assert m.staleness == {0: 4 * toy.GROUP}
    assert m.ratio_mean == pytest.approx(1.0, abs=0.05) and 0 <= m.clipped_frac <= 1 and m.entropy_mean > 0
    assert m.grad_norm > 0 and m.tokens_per_s > 0
    assert set(m.as_dict()["staleness"]) == {"0"}
    assert any(not torch.equal(p, before[n]) for n, p in t.model.named_parameters())


@pytest.mark.parametrize("reference", ["old", "base"])
def test_kl_reference(reference: str) -> None:
    torch.set_num_threads(1)
    cfg = toy.toy_trainer_config(loss=LossConfig(norm_tokens=64.0, kl_beta=0.1), kl_reference=reference, optimizer_steps_per_batch=1)
    t = Trainer(toy.toy_model(seed=0), cfg)
    m1 = t.train_step(toy.toy_batch(seed=0, step=0))
    assert m1.kl_mean == pytest.approx(0.0, abs=1e-6)  # first step: the reference equals the weights
    m2 = t.train_step(toy.toy_batch(seed=0, step=1))
    if reference == "base":
        assert m2.kl_mean > 0  # the weights moved away from the frozen base
    else:
        assert m2.kl_mean == pytest.approx(0.0, abs=1e-6)  # one update per batch: old == current


def _true_logprobs(model: torch.nn.Module, prompt, completion) -> np.ndarray:
    """log π(completion | prompt) per completion token (temperature 1), by a plain forward."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]  # [T-1]
    return lp[len(prompt) - 1:].numpy().astype(np.float32)


@pytest.mark.parametrize("old", ["behavior", "recompute"])
def test_off_policy_statistics(old: str) -> None:
    """mismatch KL is 0 and every importance ratio 1 when the workers' log-probs are the trainer's;
    with other behavior log-probs it is the mean of exp(d) − d − 1 over the sampled tokens."""
    torch.set_num_threads(1)
    from trainer.batch import assemble_batch

    model = toy.toy_model(seed=0)
    records = toy.toy_records(seed=0, step=0)
    exact = [dataclasses.replace(r, logprobs=_true_logprobs(model, r.prompt_ids, r.completion_ids)) for r in records]
    cfg = toy.toy_trainer_config(loss=LossConfig(norm_tokens=64.0, old_logprobs=old), optimizer_steps_per_batch=1)
    t = Trainer(toy.toy_model(seed=0), cfg)
    m = t.train_step(assemble_batch(exact, step=0, group_size=toy.GROUP, num_groups=4, adv_eps=1e-4))
    assert m.mismatch_kl == pytest.approx(0.0, abs=1e-5)
    assert m.is_ratio_min == pytest.approx(1.0, abs=1e-3) and m.is_ratio_max == pytest.approx(1.0, abs=1e-3)
    # behavior log-probs 0 (the workers claim probability 1): d = log π_trainer
    t = Trainer(toy.toy_model(seed=0), cfg)
    batch = assemble_batch(records, step=0, group_size=toy.GROUP, num_groups=4, adv_eps=1e-4)
    m = t.train_step(batch)
    d = np.concatenate([_true_logprobs(model, s.record.prompt_ids, s.record.completion_ids) for s in batch.sequences]).astype(np.float64)
    assert m.mismatch_kl == pytest.approx(float(np.mean(np.exp(d) - d - 1)), rel=1e-3)
    assert m.is_ratio_min == pytest.approx(float(np.exp(d).min()), rel=1e-3)
    assert m.is_ratio_max == pytest.approx(float(np.exp(d).max()), rel=1e-3)
    assert m.is_ratio_mean == pytest.approx(float(np.exp(d).mean()), rel=1e-3)
    assert set(m.as_dict()) >= {"mismatch_kl", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "clipped_frac", "staleness"}


def test_off_policy_correction_on_stale_and_zero_advantage_groups() -> None:
    """A step-2 batch at async level 1 from hand-built groups: a fresh one (behavior log-probs = the
    trainer's), a 1-step-stale one whose behavior log-probs are log 90 below the trainer's (ratio 90
    on every token) and an all-equal-reward one with absurd log-probs (−1e30). The last is dropped
    (counted), the loss stays finite, and truncation bounds the stale group's weight at C = 2: its
    tokens count exactly twice (one optimizer step: r = 1). (A 2-step-stale group never reaches
    assembly: the ledger's trainable view leaves it out, ``test_buffer.py``.)"""
    torch.set_num_threads(1)
    from trainer.batch import assemble_batch

    model = toy.toy_model(seed=0)
    recs = toy.toy_records(seed=0, step=2)
    exact = {id(r): _true_logprobs(model, r.prompt_ids, r.completion_ids) for r in recs}
    fresh = [dataclasses.replace(r, logprobs=exact[id(r)]) for r in recs if r.task_key == "task0"]
    stale1 = [dataclasses.replace(r, policy_step=1, logprobs=exact[id(r)] - np.float32(np.log(90.0))) for r in recs if r.task_key == "task2"]
    flat = [dataclasses.replace(r, reward=1.0, task_reward=1.0, logprobs=np.full(r.completion_ids.size, -1e30, np.float32))
            for r in recs if r.task_key == "task1"]

    def step(records: list, correction: str, groups: int):
        cfg = toy.toy_trainer_config(loss=LossConfig(norm_tokens=64.0, is_correction=correction, is_cap=2.0), optimizer_steps_per_batch=1)
        batch = assemble_batch(records, step=2, group_size=toy.GROUP, num_groups=groups, adv_eps=1e-4)
        return Trainer(toy.toy_model(seed=0), cfg, step=2).train_step(batch)

    m = step(flat + fresh + stale1, "truncate", 2)
    assert (m.num_groups, m.zero_advantage_groups) == (2, 1)
    assert m.staleness == {0: toy.GROUP, 1: toy.GROUP}
    assert math.isfinite(m.loss) and math.isfinite(m.mismatch_kl)
    assert m.is_ratio_max == pytest.approx(90.0, rel=1e-3) and m.is_ratio_min == pytest.approx(1.0, abs=1e-3)
    assert m.is_weight_max == pytest.approx(2.0)  # bounded at C, not 90
    stale_tokens = sum(r.completion_ids.size for r in stale1)
    assert m.is_bounded_frac == pytest.approx(stale_tokens / m.loss_tokens)
    # the stale group's tokens weigh C = 2: its loss counts twice
    plain = step(fresh + stale1, "none", 2).loss
    stale_only = step(stale1, "none", 1).loss
    assert m.loss == pytest.approx(plain + stale_only, rel=1e-4, abs=1e-7)
    # masking drops the stale group: only the fresh group's loss is left
    fresh_only = step(fresh, "none", 1).loss
    assert step(fresh + stale1, "mask", 2).loss == pytest.approx(fresh_only, rel=1e-4, abs=1e-7)
