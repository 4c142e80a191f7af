"""The rollout rule: what a worker must generate for one submission, recomputable by validators.

Given (run spec, dataset, tokenizer, worker peer ID, policy step, submission counter) this module
fixes everything a worker could otherwise choose: which tasks (:func:`protocol.tasks.derive_task_indices`),
each task's length-control target, the exact prompt tokens, and each sample's sampling seed
(:func:`protocol.sampling.derive_sequence_seed`). A submission is honest only if its tasks,
targets, prompts and seeds equal :func:`plan_submission`'s (``docs/protocol.md`` §6).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol import sampling
from protocol.encoding import DecodeLimits
from protocol.identity import PeerId
from protocol.messages import BODY_LIMITS, Submission, max_containers
from protocol.runspec import RunSpec
from protocol.tasks import Task, build_messages, build_prompt_text, derive_task_indices

TARGET_LENGTH_DOMAIN = b"intellect-node/target-length/1\x00"


@dataclass(frozen=True)
class PlannedTask:
    """One task of a submission as the rule fixes it.

    Attributes:
        position: index of the task inside the submission (``Rollout.task``).
        task_index: index in the run's dataset.
        task: the task.
        target_length: length-control target in tokens, or ``None`` (wire value 0).
        prompt_ids: the prompt's token IDs.
        seeds: ``[group_size]`` sequence seeds (u64), one per sample.
    """

    position: int
    task_index: int
    task: Task
    target_length: int | None
    prompt_ids: tuple[int, ...]
    seeds: tuple[int, ...]


def target_length_for(spec: RunSpec, peer_id: PeerId, policy_step: int, counter: int, position: int) -> int | None:
    """The length-control target of task ``position``: uniform over ``spec.sampling.target_lengths``.

    SHA-256 of ``TARGET_LENGTH_DOMAIN || u64be(run seed) || peer_id UTF-8 || 00 || u64be(step)
    || u64be(counter) || u32be(position)``, first 8 bytes big-endian, modulo the number of targets.
    ``None`` when the spec lists no targets.
    """
    targets = spec.sampling.target_lengths
    if not targets:
        return None
    msg = TARGET_LENGTH_DOMAIN + struct.pack(">Q", spec.run.seed) + peer_id.encode() + b"\x00" + struct.pack(">QQI", policy_step, counter, position)
    return targets[int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") % len(targets)]


def encode_prompt(tokenizer: Any, task: Task, target_length: int | None) -> list[int]:
    """Prompt token IDs: the tokenizer's chat template when it has one, else the plain prompt text."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(build_messages(task, target_length), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(build_prompt_text(task, target_length), add_special_tokens=False)["input_ids"]]


def sample_seed(spec: RunSpec, peer_id: PeerId, policy_step: int, counter: int, task_index: int, sample: int) -> int:
    """Sequence seed of one sample: bound to run, step, worker, counter, task and sample index."""
    return sampling.derive_sequence_seed(spec.run.seed, policy_step, peer_id, f"{counter}:{task_index}", sample)


def plan_submission(
    spec: RunSpec, tasks: Sequence[Task], tokenizer: Any, peer_id: PeerId, policy_step: int, counter: int
) -> list[PlannedTask]:
    """Everything fixed for submission ``counter`` of ``peer_id`` at ``policy_step``.

    Args:
        spec: the run spec (seed, tasks per submission, group size, target lengths).
        tasks: the run's dataset, in its canonical order.
        tokenizer: the policy's tokenizer.
        peer_id: the worker's peer ID.
        policy_step: the policy step generating the submission.
        counter: the worker's submission counter (never reused).

    Returns:
        ``spec.data.tasks_per_submission`` planned tasks.
    """
    indices = derive_task_indices(spec.run.seed, peer_id, policy_step, counter, len(tasks), min(spec.data.tasks_per_submission, len(tasks)))
    plan = []
    for position, idx in enumerate(indices):
        target = target_length_for(spec, peer_id, policy_step, counter, position)
        plan.append(
            PlannedTask(
                position=position,
                task_index=idx,
                task=tasks[idx],
                target_length=target,
                prompt_ids=tuple(encode_prompt(tokenizer, tasks[idx], target)),
                seeds=tuple(sample_seed(spec, peer_id, policy_step, counter, idx, s) for s in range(spec.rl.group_size)),
            )
        )
    return plan


def submission_decode_limits(spec: RunSpec) -> DecodeLimits:
    """Decoder bounds of a ``submission/1`` body in this run (``docs/protocol.md`` §2).

    No array may be longer than an honest submission's longest: its ``tasks_per_submission``
    tasks, their ``tasks_per_submission × group_size`` rollouts, or a rollout's
    ``⌈max_tokens / chunk_size⌉`` proofs; every other bound is the schema's
    (:data:`protocol.messages.BODY_LIMITS`). The schema alone allows 65,536-element arrays, so a
    signed 31 MB body of 240 rollouts × 65,536 empty proofs made a node build 16 M objects
    (≈ 6 s and ≈ 330 MB to decode); under these bounds the C decoder refuses it at once. Arrays
    of 16 nested deeper than the schema allows made the same per byte (the depth is checked after
    the value is built): the container budget stops them at an honest submission's count.
    """
    base = BODY_LIMITS[Submission.TYPE]
    n_tasks = spec.data.tasks_per_submission
    longest = max(n_tasks, n_tasks * spec.rl.group_size, -(-spec.sampling.max_tokens // spec.toploc.chunk_size))
    containers = max_containers(Submission, {"tasks": n_tasks, "rollouts": n_tasks * spec.rl.group_size})
    return dataclasses.replace(base, max_array_len=min(base.max_array_len, longest), max_containers=min(base.max_containers, containers))


def completion_text(tokenizer: Any, completion_ids: Sequence[int], eos_id: int | None) -> str:
    """The text a reward is computed on: the completion without its final EOS, special tokens dropped."""
    ids = list(completion_ids)
    if ids and eos_id is not None and ids[-1] == eos_id:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=True))


# The packed arrays of a rollout, one codec for every reader (worker, validator, trainer):
# ``prompt_ids`` / ``completion_ids`` little-endian uint32, ``logprobs`` little-endian float32
# (``docs/protocol.md`` §6; ``Rollout`` checks the length is a multiple of 4 bytes).
U32_DTYPE = np.dtype("<u4")
F32_DTYPE = np.dtype("<f4")


def pack_u32(values: Sequence[int]) -> bytes:
    """Little-endian uint32 array (``Rollout.prompt_ids``, ``completion_ids``).

    Raises:
        struct.error: a value outside ``[0, 2**32)`` (never wrapped silently).
    """
    return struct.pack(f"<{len(values)}I", *values)


def pack_f32(values: Sequence[float]) -> bytes:
    """Little-endian float32 array (``Rollout.logprobs``)."""
    return struct.pack(f"<{len(values)}f", *values)


def u32_array(data: bytes) -> npt.NDArray[np.uint32]:
    """A packed uint32 array as a read-only ``[N] uint32`` view of ``data`` (no copy).

    Raises:
        ValueError: ``len(data)`` is not a multiple of 4.
    """
    return np.frombuffer(data, dtype=U32_DTYPE)


def f32_array(data: bytes) -> npt.NDArray[np.float32]:
    """A packed float32 array as a read-only ``[N] float32`` view of ``data`` (no copy).

    Raises:
        ValueError: ``len(data)`` is not a multiple of 4.
    """
    return np.frombuffer(data, dtype=F32_DTYPE)


def unpack_u32(data: bytes) -> list[int]:
    """A packed uint32 array as Python ints."""
    return [int(v) for v in u32_array(data).tolist()]


def unpack_f32(data: bytes) -> list[float]:
    """A packed float32 array as Python floats (each exactly the float32 value)."""
    return [float(v) for v in f32_array(data).tolist()]
