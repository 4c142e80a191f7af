"""Dishonest worker variants: the cheats validators must catch (``docs/validator.md``).

Each is a real worker that signs valid envelopes but breaks one rule of the protocol. They
exist for the devnet's chaos mode (``devnet --adversary KIND``) and the validator's tests; an
honest node never uses this module.

* ``other-model`` — generates with a cheaper model (fresh random weights), then prefills the real
  policy to make TOPLOC proofs that verify: caught by the sampling replay.
* ``tampered-token`` — changes one completion token after generation: caught by TOPLOC/replay.
* ``inflated-reward`` — reports reward 1 for every rollout: caught by the reward recompute.
* ``cherry-pick`` — answers the easiest tasks instead of the derived ones: caught by task derivation.
* ``replay`` — re-uses submission counter 0 for new content: caught by the replay check.
* ``fake-eos`` — cuts every completion short with EOS at the position where the policy gives EOS
  the least probability (proofs and log-probs from an honest prefill): caught by the termination check.
* ``steer`` — samples honestly but emits the right answer's next token wherever the validator's
  replay would accept it (:mod:`node.worker.steering`): every check passes one submission at a
  time; only statistics over many of its tokens can tell it from numeric noise (issue 33).

:func:`perturbed_model` makes the "slightly different model" a worker might run instead of the
policy (the validator's tests and ``benchmarks/logprob_tolerance.py`` measure how it is caught).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from node.engine.base import Engine, Generation, SamplingParams
from node.engine.hf import TransformersEngine
from node.worker import ADVERSARIES
from node.worker.rollouts import BuildStats, generate_rollouts, seal_submission
from node.worker.steering import SteeringEngine
from protocol import toploc
from protocol.identity import NodeKey
from protocol.inference import prefill_completions
from protocol.models import build_model
from protocol.rewards import compute_reward
from protocol.rollout import PlannedTask, completion_text, pack_f32, pack_u32, plan_submission
from protocol.runspec import RunSpec
from protocol.tasks import Task


def perturbed_model(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of ``scale`` × each tensor's std added to every weight.

    Args:
        model: the policy (left unchanged).
        scale: noise standard deviation relative to each parameter tensor's own std (0.03: 3 %).
        seed: seed of the noise (its own generator; the global RNG is left alone).

    Returns:
        The perturbed copy (same dtypes and device as ``model``).
    """
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return out


class _CheapModelEngine(Engine):
    """Samples with a different model, then makes the proofs from an honest prefill of the policy."""

    def __init__(self, policy: TransformersEngine) -> None:
        self.policy = policy
        cheap = build_model(policy.model.config, seed=12345)
        self.cheap = TransformersEngine(cheap, policy.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.policy.vocab_size

    def load_weights(self, model_dir: Any) -> None:
        self.policy.load_weights(model_dir)

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[Generation]:
        gens = self.cheap.generate(prompts, seeds, params)
        pre = prefill_completions(self.policy.model, prompts, [g.completion_ids.tolist() for g in gens], self.policy.pad_id)
        out = []
        for g, p in zip(gens, pre):
            lp = torch.log_softmax(p.logits / params.temperature, dim=-1).gather(-1, g.completion_ids[:, None])[:, 0]
            out.append(replace(g, hidden=p.hidden, logprobs=lp.float()))
        return out


def build_dishonest_submission(
    kind: str,
    spec: RunSpec,
    run_id: bytes,
    key: NodeKey,
    engine: Engine,
    tokenizer: Any,
    tasks: Sequence[Task],
    policy_step: int,
    counter: int,
    stats: BuildStats | None = None,
) -> bytes:
    """A signed submission that breaks the rule ``kind`` names (one of :data:`ADVERSARIES`).

    ``steer`` steers with the engine's rate and RNG when it is a :class:`SteeringEngine`
    (:func:`adversary_engine`); a float32 transformers engine is wrapped for this one submission
    (rate 1.0, its own model as the validator's float32 policy).

    Raises:
        ValueError: unknown ``kind``, or an engine this cheat cannot wrap.
    """
    if kind not in ADVERSARIES:
        raise ValueError(f"unknown adversary {kind!r}; choose one of {', '.join(ADVERSARIES)}")
    if kind == "replay":
        counter = 0
    plan = plan_submission(spec, tasks, tokenizer, key.peer_id, policy_step, counter)
    if kind == "cherry-pick":
        easiest = min(range(len(tasks)), key=lambda i: len(tasks[i].prompt))
        plan = [replace(p, task_index=easiest, task=tasks[easiest]) for p in plan]
    if kind == "steer":
        if not isinstance(engine, (SteeringEngine, TransformersEngine)):
            raise ValueError("steer needs the transformers engine")
        steering = engine if isinstance(engine, SteeringEngine) else SteeringEngine(engine)
        steered = steering.steer(spec, tokenizer, plan, None, stats)
        return seal_submission(run_id, key, policy_step, counter, plan, steered.rollouts)
    eng = engine
    if kind == "other-model":
        if not isinstance(engine, TransformersEngine):
            raise ValueError("other-model needs the transformers engine")
        eng = _CheapModelEngine(engine)
    rollouts = generate_rollouts(spec, eng, tokenizer, plan, None, stats)
    if kind == "tampered-token":
        r = rollouts[0]
        ids = bytearray(r.completion_ids)
        ids[0] = (ids[0] + 1) % max(2, min(255, engine.vocab_size))
        rollouts[0] = r.model_copy(update={"completion_ids": bytes(ids)})
    elif kind == "inflated-reward":
        rollouts = [r.model_copy(update={"reward": 1.0, "task_reward": 1.0}) for r in rollouts]
    elif kind == "fake-eos":
        rollouts = [_fake_eos(spec, engine, tokenizer, plan, r) for r in rollouts]
    return seal_submission(run_id, key, policy_step, counter, plan, rollouts)


def adversary_engine(kind: str | None, engine: Engine, model_dir: Path, *, steer_rate: float = 1.0, seed: str = "") -> Engine:
    """The engine a worker of adversary ``kind`` generates with: for ``steer`` a :class:`SteeringEngine`
    around ``engine`` (a float32 policy loaded from ``model_dir`` beside a bf16 one; its RNG seeded
    with ``seed``, e.g. the worker's peer ID), else ``engine`` itself.

    Raises:
        ValueError: ``steer`` on an engine other than transformers, or a rate outside [0, 1].
    """
    if kind != "steer":
        return engine
    if not isinstance(engine, TransformersEngine):
        raise ValueError("steer needs the transformers engine")  # noqa: TRY004 - documented: ValueError for an engine a cheat cannot wrap
    return SteeringEngine.from_dir(engine, model_dir, steer_rate, random.Random(f"steer/{seed}"))


def _fake_eos(spec: RunSpec, engine: Engine, tokenizer: Any, plan: Sequence[PlannedTask], r: Any) -> Any:
    """Cut the completion with EOS where P(EOS) is lowest, with honest proofs and log-probs."""
    if not isinstance(engine, TransformersEngine):
        raise ValueError("fake-eos needs the transformers engine")  # noqa: TRY004 - documented: ValueError for an engine a cheat cannot wrap
    eos = int(tokenizer.eos_token_id)
    p = plan[r.task]
    sampled = [int.from_bytes(r.completion_ids[i : i + 4], "little") for i in range(0, len(r.completion_ids), 4)]
    pre = prefill_completions(engine.model, [list(p.prompt_ids)], [sampled], engine.pad_id)[0]
    p_eos = torch.softmax(pre.logits / spec.sampling.temperature, dim=-1)[:, eos]  # [n]
    cut = int(p_eos.argmin())
    ids = sampled[:cut] + [eos]
    pre = prefill_completions(engine.model, [list(p.prompt_ids)], [ids], engine.pad_id)[0]
    lp = torch.log_softmax(pre.logits / spec.sampling.temperature, dim=-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    res = compute_reward(p.task, completion_text(tokenizer, ids, eos), len(ids), p.target_length, spec.sampling.length_penalty)
    return r.model_copy(update={
        "completion_ids": pack_u32(ids), "logprobs": pack_f32(lp.tolist()), "finish": "eos",
        "proofs": toploc.build_proofs(pre.hidden, chunk_size=spec.toploc.chunk_size, topk=spec.toploc.topk),
        "task_reward": float(res.task_reward), "reward": float(res.reward),
    })
