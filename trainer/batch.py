"""From accepted rollouts to packed micro-batches: records, grouping, advantages, sharding over
ranks and sequence packing.

Pipeline of one trainer step ``n`` (``docs/trainer.md`` §3–§5)::

    RolloutRecord*  --assemble_batch(step=n)-->  Batch (whole groups, advantages)
    Batch.slices(k)                             one slice of whole groups per optimizer step
    shard_sequences(slice, world, rank)         this rank's sequences (balanced by tokens)
    pack_sequences(seqs, micro_batch_tokens)    MicroBatch rows: several sequences per row

Rules:
    * **Freshness is not decided here**: the records come from the submission ledger's trainable
      view (``trainer/buffer.py`` over :meth:`trainer.ledger.ledger.SubmissionLedger.trainable`), which
      applies the async window (:mod:`protocol.window`, ``n − async_level ≤ policy_step ≤ n``) and
      is the one place on the coordinator that does; a group is one submission's answer to one task,
      so all its rollouts share one policy step.
    * **Grouping**: by ``(task_key, group_seed)``, never by position (see ``advantages.py``).
    * **Whole groups only**: a group must hold exactly ``group_size`` rollouts; a group with all-zero
      advantages is dropped whole.
    * **Packing**: sequences are concatenated into rows of at most ``micro_batch_tokens`` tokens
      with ``position_ids`` restarting at 0 for each sequence and no attention mask. transformers
      (≥ 4.53, here 5.x) detects the restarts and builds a block-diagonal causal mask for sdpa and
      eager attention, and uses variable-length kernels for flash attention, so a packed forward
      equals the per-sequence forwards (tested in ``tests/trainer/test_batch.py``).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.messages import Submission
from protocol.rollout import f32_array, u32_array
from trainer.advantages import compute_group_advantages
from trainer.errors import BatchError, NotEnoughRolloutsError
from trainer.ledger.ids import GroupKey

logger = logging.getLogger(__name__)

__all__ = [
    "Batch",
    "GroupKey",
    "MicroBatch",
    "RolloutRecord",
    "TrainSequence",
    "assemble_batch",
    "group_seed_of",
    "pack_sequences",
    "records_from_submission",
    "shard_sequences",
]

GROUP_SEED_DOMAIN = b"intellect-node/group-seed/1\x00"
"""Domain-separation prefix of :func:`group_seed_of`."""


@dataclass(frozen=True, eq=False)
class RolloutRecord:
    """One accepted rollout as the ingest stores it and the trainer reads it.

    Attributes:
        submission_id: hex content ID of the submission that carried it.
        worker: peer ID of the worker that generated it.
        policy_step: the policy step it was generated with.
        task_key: identity of the task (``"<dataset index>:<problem_id>"`` from
            :func:`records_from_submission`).
        group_seed: 64-bit identity of the sampling event of its group; rows with equal
            ``(task_key, group_seed)`` form one GRPO group.
        sample: index of the rollout within its group.
        prompt_ids: ``[P] int64`` prompt token IDs, P ≥ 1.
        completion_ids: ``[C] int64`` completion token IDs, C ≥ 0.
        logprobs: ``[C] float32`` sampling log-probs reported by the worker (diagnostic only; the
            trainer recomputes old log-probs itself).
        reward: total reward (task reward plus length penalty); what advantages are computed from.
        task_reward: task reward alone (1.0 = solved); the pass rate counts ``task_reward == 1``.
        finish: ``"eos"`` or ``"length"``.
    """

    submission_id: str
    worker: str
    policy_step: int
    task_key: str
    group_seed: int
    sample: int
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    reward: float
    task_reward: float
    finish: str = "eos"

    def __post_init__(self) -> None:
        if self.prompt_ids.ndim != 1 or self.prompt_ids.size < 1:
            raise BatchError(f"rollout {self.submission_id}/{self.task_key}/{self.sample}: prompt must hold ≥ 1 token")
        if self.completion_ids.ndim != 1 or self.logprobs.shape != self.completion_ids.shape:
            raise BatchError(
                f"rollout {self.submission_id}/{self.task_key}/{self.sample}: {self.completion_ids.shape} completion "
                f"tokens but {self.logprobs.shape} log-probs"
            )
        if not (np.isfinite(self.reward) and np.isfinite(self.task_reward)):
            raise BatchError(f"rollout {self.submission_id}/{self.task_key}/{self.sample}: non-finite reward")
        # the validator's bounds rule (docs/validator.md §2, step 4) again: the coordinator must not depend
        # on every validator applying it (spot checks accept most submissions after a light check), and one NaN would reach the weights
        if not (np.all(np.isfinite(self.logprobs)) and np.all(self.logprobs <= 0.0)):
            raise BatchError(f"rollout {self.submission_id}/{self.task_key}/{self.sample}: log-probs must be finite and ≤ 0")

    @property
    def group_key(self) -> GroupKey:
        return (self.task_key, self.group_seed)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.size + self.completion_ids.size)


def group_seed_of(worker: str, policy_step: int, counter: int, task_position: int) -> int:
    """The group seed of the rollouts a submission gives for one of its tasks.

    ``SHA-256(GROUP_SEED_DOMAIN || worker UTF-8 || 0x00 || policy_step u64 BE || counter u64 BE ||
    task_position u32 BE)``, first 8 bytes, big-endian, top bit cleared (fits a signed int64).
    Unique per sampling event: a worker's submission counter never repeats within a policy step.
    """
    h = hashlib.sha256(
        GROUP_SEED_DOMAIN
        + worker.encode("utf-8")
        + b"\x00"
        + policy_step.to_bytes(8, "big")
        + counter.to_bytes(8, "big")
        + task_position.to_bytes(4, "big")
    ).digest()
    return int.from_bytes(h[:8], "big") & (2**63 - 1)


def records_from_submission(submission: Submission, submission_id: str) -> list[RolloutRecord]:
    """Unpack an accepted submission into rollout records (one per rollout, in submission order).

    Args:
        submission: the validated submission body.
        submission_id: its content ID, hex.

    Returns:
        One record per rollout; the rollouts answering ``submission.tasks[t]`` share the group key
        ``("<task_index>:<problem_id>", group_seed_of(worker, policy_step, counter, t))``.

    Raises:
        BatchError: a rollout names a task position the submission does not have, or its
            log-probs do not match its completion length, or its prompt is empty.
    """
    out = []
    for ro in submission.rollouts:
        if ro.task >= len(submission.tasks):
            raise BatchError(f"submission {submission_id}: rollout names task {ro.task} of {len(submission.tasks)}")
        task = submission.tasks[ro.task]
        out.append(
            RolloutRecord(
                submission_id=submission_id,
                worker=submission.worker,
                policy_step=submission.policy_step,
                task_key=f"{task.task_index}:{task.problem_id}",
                group_seed=group_seed_of(submission.worker, submission.policy_step, submission.counter, ro.task),
                sample=ro.sample,
                prompt_ids=u32_array(ro.prompt_ids).astype(np.int64),
                completion_ids=u32_array(ro.completion_ids).astype(np.int64),
                logprobs=f32_array(ro.logprobs).astype(np.float32),
                reward=ro.reward,
                task_reward=ro.task_reward,
                finish=ro.finish,
            )
        )
    return out


@dataclass(frozen=True, eq=False)
class TrainSequence:
    """One rollout with its advantage, ready to pack.

    Attributes:
        record: the source rollout.
        advantage: its GRPO advantage (float32 value).
    """

    record: RolloutRecord
    advantage: float

    @property
    def num_tokens(self) -> int:
        return self.record.num_tokens

    @property
    def input_ids(self) -> np.ndarray:
        """``[P + C] int64`` prompt followed by completion."""
        return np.concatenate([self.record.prompt_ids, self.record.completion_ids])


@dataclass
class Batch:
    """The training data of one trainer step: whole groups with advantages, plus statistics.

    Attributes:
        step: the trainer step it was assembled for.
        sequences: every rollout of the selected groups, grouped (a group's rows are contiguous).
        group_keys: the selected groups, in selection order.
        zero_advantage_groups: groups dropped because every advantage was zero.
        incomplete_groups: groups skipped this time (not ``group_size`` rollouts).
        reward_mean: mean reward over the groups examined (selected + zero-advantage).
        pass_rate: fraction of those rollouts with ``task_reward == 1``.
        completion_len_mean: their mean completion length in tokens.
        group_submissions: examined group → IDs of the submissions its rollouts came from.
    """

    step: int
    sequences: list[TrainSequence]
    group_keys: list[GroupKey]
    zero_advantage_groups: list[GroupKey] = field(default_factory=list)
    incomplete_groups: list[GroupKey] = field(default_factory=list)
    reward_mean: float = 0.0
    pass_rate: float = 0.0
    completion_len_mean: float = 0.0
    group_submissions: dict[GroupKey, frozenset[str]] = field(default_factory=dict)

    @property
    def consumed_groups(self) -> list[GroupKey]:
        """Groups this step consumed (the ledger records them): trained, or all-zero (never trainable)."""
        return self.group_keys + self.zero_advantage_groups

    @property
    def consumed_submission_ids(self) -> list[str]:
        """Submission IDs of :attr:`consumed_groups`, sorted (only on the rank that assembled the batch).

        A submission answering several tasks may also hold groups this batch did not examine (the
        batch was full); a store that retires whole submissions loses those, a store that tracks
        groups does not.
        """
        return sorted({sid for key in self.consumed_groups for sid in self.group_submissions.get(key, ())})

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    def staleness_histogram(self) -> dict[int, int]:
        """``step − policy_step`` → number of trained rollouts."""
        return dict(sorted(Counter(self.step - s.record.policy_step for s in self.sequences).items()))

    def slices(self, n: int) -> list[list[TrainSequence]]:
        """Split into ``n`` slices of whole groups, as equal in group count as possible (earlier
        slices get the extra group), one per optimizer step.

        Raises:
            ValueError: ``n`` < 1 or more slices than groups.
        """
        groups: dict[GroupKey, list[TrainSequence]] = {}
        for s in self.sequences:
            groups.setdefault(s.record.group_key, []).append(s)
        ordered = list(groups.values())
        if not 1 <= n <= max(1, len(ordered)):
            raise ValueError(f"cannot split {len(ordered)} groups into {n} slices")
        base, extra = divmod(len(ordered), n)
        out, i = [], 0
        for k in range(n):
            size = base + (1 if k < extra else 0)
            out.append([s for g in ordered[i : i + size] for s in g])
            i += size
        return out


def assemble_batch(
    records: Iterable[RolloutRecord],
    *,
    step: int,
    group_size: int,
    num_groups: int,
    adv_eps: float,
    allow_partial: bool = False,
) -> Batch:
    """Select whole, informative groups for trainer step ``step``.

    Groups are examined in order of their first record (the caller's order: the rollout buffer
    passes the freshest policy first); examination stops once ``num_groups`` are selected.

    Args:
        records: accepted rollouts fresh at ``step`` (the ledger's trainable view applied the async
            window), any order (interleaved groups are fine).
        step: trainer step ``n`` about to run (= the policy step of the current weights).
        group_size: rollouts per group; other sizes are skipped.
        num_groups: groups the step needs.
        adv_eps: ε of the advantage normalisation.
        allow_partial: return fewer than ``num_groups`` groups instead of raising (≥ 1 still needed).

    Returns:
        The batch.

    Raises:
        NotEnoughRolloutsError: fewer usable groups than needed (or none with ``allow_partial``).
    """
    groups: dict[GroupKey, list[RolloutRecord]] = {}
    for rec in records:
        groups.setdefault(rec.group_key, []).append(rec)

    batch = Batch(step=step, sequences=[], group_keys=[])
    examined: list[RolloutRecord] = []
    for key, rows in groups.items():
        if len(batch.group_keys) >= num_groups:
            break
        batch.group_submissions[key] = frozenset(r.submission_id for r in rows)
        if len(rows) != group_size:
            logger.debug("group %s has %d rollouts, expected %d; skipped", key, len(rows), group_size)
            batch.incomplete_groups.append(key)
            continue
        rows = sorted(rows, key=lambda r: r.sample)
        (adv,) = compute_group_advantages([key] * len(rows), [r.reward for r in rows], adv_eps)
        examined.extend(rows)
        if adv.all_zero:
            batch.zero_advantage_groups.append(key)
            continue
        batch.group_keys.append(key)
        batch.sequences.extend(TrainSequence(record=r, advantage=float(a)) for r, a in zip(rows, adv.advantages))

    usable = len(batch.group_keys)
    if usable < num_groups and not (allow_partial and usable > 0):
        raise NotEnoughRolloutsError(
            step=step,
            needed_groups=num_groups,
            usable_groups=usable,
            zero_advantage_groups=len(batch.zero_advantage_groups),
            incomplete_groups=len(batch.incomplete_groups),
        )
    if examined:
        batch.reward_mean = float(np.mean([r.reward for r in examined]))
        batch.pass_rate = float(np.mean([r.task_reward == 1.0 for r in examined]))
        batch.completion_len_mean = float(np.mean([r.completion_ids.size for r in examined]))
    logger.debug(
        "step %d batch: %d groups, %d zero-advantage, %d skipped",
        step,
        usable,
        len(batch.zero_advantage_groups),
        len(batch.incomplete_groups),
    )
    return batch


def shard_sequences(sequences: Sequence[TrainSequence], world_size: int, rank: int) -> list[TrainSequence]:
    """This rank's share of ``sequences``, balancing token counts across ranks.

    Longest first, each to the rank with the fewest tokens so far (ties: lowest rank);
    deterministic, so every rank computes the same assignment without communicating.

    Raises:
        ValueError: ``rank`` not in ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    load = [0] * world_size
    mine: list[tuple[int, TrainSequence]] = []
    order = sorted(range(len(sequences)), key=lambda i: (-sequences[i].num_tokens, i))
    for i in order:
        r = min(range(world_size), key=lambda j: (load[j], j))
        load[r] += sequences[i].num_tokens
        if r == rank:
            mine.append((i, sequences[i]))
    return [s for _, s in sorted(mine, key=lambda t: t[0])]


@dataclass
class MicroBatch:
    """One packed row: several sequences concatenated, trained as one forward/backward.

    Token ``t`` predicts ``targets[t]``, the next token *of the same sequence*; the last token of a
    sequence predicts nothing (``loss_mask`` False there).

    Attributes:
        input_ids: ``[1, T] int64``.
        position_ids: ``[1, T] int64``, restarting at 0 at each sequence start.
        targets: ``[1, T] int64`` next token within the sequence (0 where there is none).
        loss_mask: ``[1, T] bool``, True where ``targets[t]`` is a completion token.
        advantages: ``[1, T] float32``, the sequence's advantage on each of its tokens.
        sequence_index: ``[1, T] int64``, position of the source sequence in the packed list
            (``-1`` in a padding row).
        behavior_logprobs: ``[1, T] float32``, the worker's sampling log-prob of ``targets[t]``
            where ``loss_mask`` is True (validated against the policy it names), 0 elsewhere.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    sequence_index: torch.Tensor
    behavior_logprobs: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @classmethod
    def padding(cls, pad_token_id: int = 0) -> MicroBatch:
        """A one-token row with no loss tokens: keeps a rank with no data in step with the others
        (FSDP collectives need the same number of forwards on every rank)."""
        z = torch.zeros(1, 1, dtype=torch.long)
        return cls(
            input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long),
            position_ids=z.clone(),
            targets=z.clone(),
            loss_mask=torch.zeros(1, 1, dtype=torch.bool),
            advantages=torch.zeros(1, 1, dtype=torch.float32),
            sequence_index=torch.full((1, 1), -1, dtype=torch.long),
            behavior_logprobs=torch.zeros(1, 1, dtype=torch.float32),
        )

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(**{k: getattr(self, k).to(device) for k in self.__dataclass_fields__})


def _build_row(sequences: Sequence[TrainSequence], indices: Sequence[int]) -> MicroBatch:
    ids, pos, tgt, mask, adv, sidx, blp = [], [], [], [], [], [], []
    for i in indices:
        s = sequences[i]
        x = s.input_ids  # [L]
        length, prompt_len = x.size, s.record.prompt_ids.size
        ids.append(x)
        pos.append(np.arange(length, dtype=np.int64))
        nxt = np.zeros(length, dtype=np.int64)
        nxt[:-1] = x[1:]
        tgt.append(nxt)
        m = np.zeros(length, dtype=bool)
        m[prompt_len - 1 : length - 1] = True  # positions whose next token is a completion token
        mask.append(m)
        adv.append(np.full(length, s.advantage, dtype=np.float32))
        sidx.append(np.full(length, i, dtype=np.int64))
        b = np.zeros(length, dtype=np.float32)
        b[prompt_len - 1 : length - 1] = s.record.logprobs
        blp.append(b)

    def row(parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts))[None, :]

    return MicroBatch(
        input_ids=row(ids), position_ids=row(pos), targets=row(tgt), loss_mask=row(mask), advantages=row(adv), sequence_index=row(sidx),
        behavior_logprobs=row(blp),
    )


def pack_sequences(sequences: Sequence[TrainSequence], micro_batch_tokens: int) -> list[MicroBatch]:
    """Pack sequences into rows of at most ``micro_batch_tokens`` tokens (first-fit decreasing).

    A sequence longer than ``micro_batch_tokens`` gets a row of its own (logged at WARNING: raise
    ``rl.micro_batch_tokens`` to ≥ prompt + ``sampling.max_tokens``).

    Args:
        sequences: the sequences to pack.
        micro_batch_tokens: row capacity in tokens.

    Returns:
        The rows, fullest first; ``sequence_index`` refers to positions in ``sequences``.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be ≥ 1, got {micro_batch_tokens}")
    order = sorted(range(len(sequences)), key=lambda i: (-sequences[i].num_tokens, i))
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        n = sequences[i].num_tokens
        if n > micro_batch_tokens:
            logger.warning("sequence of %d tokens exceeds micro_batch_tokens %d; packed alone", n, micro_batch_tokens)
        for r, used in enumerate(fill):
            if used + n <= micro_batch_tokens:
                rows[r].append(i)
                fill[r] += n
                break
        else:
            rows.append([i])
            fill.append(n)
    return [_build_row(sequences, r) for r in rows]
