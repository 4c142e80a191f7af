"""The coordinator's rollout buffer: the one owner of what is trainable, consumed and retired.

Life of a submission on the coordinator (``docs/trainer.md`` §3):

1. **stored** — the ingest verified its envelope and stored it durably (``pending``). The ingest
   hands the verified body to :meth:`RolloutBuffer.note_stored`, so the buffer never verifies the
   same envelope again (it keeps the body while it is small enough to hold; others are read back
   from the store and re-opened, e.g. after a restart).
2. **accepted** — a validator's verdict accepted it (the ingest records that).
3. **fresh** — its policy step is inside the async window of the step being assembled
   (:mod:`protocol.window`, the one rule). Accepted submissions that fall out of the window are
   retired as ``stale_policy`` by the ingest; groups of them that are still here are dropped by
   :func:`trainer.batch.assemble_batch` and counted as consumed.
4. **consumed** — a trainer step trained on one of its groups, or dropped the group (all-zero
   advantages, stale). A submission is **retired** (``consumed_step`` in the store) once every one
   of its groups is consumed; until then its remaining groups stay trainable.

The consumed-but-not-retired groups are the buffer's only state beyond the store; they are saved
with the trainer state (:meth:`position`) and restored on resume (:meth:`restore`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from protocol.envelope import open_envelope
from protocol.errors import ProtocolError
from protocol.messages import Submission
from protocol.runspec import RLSpec
from protocol.window import oldest_fresh_step
from trainer.batch import Batch, GroupKey, RolloutRecord, assemble_batch, records_from_submission
from trainer.errors import BatchError, TrainerError
from trainer.ledger.store import SubmissionStore

logger = logging.getLogger(__name__)

MAX_HELD_BODY_BYTES = 256 * 1024 * 1024
"""Verified submission bodies the buffer holds in memory, by the memory they take (arrays, proofs
and object overheads, :func:`_body_bytes`); older ones are dropped first and read back from the
store when needed."""


_BODY_OVERHEAD_BYTES = 4096
_TASK_OVERHEAD_BYTES = 512
_ROLLOUT_OVERHEAD_BYTES = 1536
_PROOF_OVERHEAD_BYTES = 64
"""Python object overheads of a decoded body, bytes: the envelope and model objects, each task's and
rollout's model, each proof's ``bytes`` object and list slot (above ``tracemalloc`` measurements)."""


def _body_bytes(sub: Submission) -> int:
    """Memory a held verified body takes, bytes: its packed arrays, its TOPLOC proofs and its objects.

    Proofs count: a hostile body can be almost all proofs (``⌈max_tokens / chunk⌉`` of up to
    1 KiB per rollout), which counting the arrays alone let hold ~1000× the bound.
    """
    return _BODY_OVERHEAD_BYTES + sum(_TASK_OVERHEAD_BYTES + len(t.problem_id) for t in sub.tasks) + sum(
        _ROLLOUT_OVERHEAD_BYTES + len(r.prompt_ids) + len(r.completion_ids) + len(r.logprobs)
        + sum(len(p) for p in r.proofs) + _PROOF_OVERHEAD_BYTES * len(r.proofs)
        for r in sub.rollouts
    )


class RolloutBuffer:
    """Accepted rollouts of one run, grouped for GRPO, with what each trainer step consumed.

    Thread-safety: :meth:`note_stored` runs on the event loop, the rest on the training thread;
    the held bodies are guarded by a lock.

    Args:
        store: the ingest's durable submission store (states, policy steps, bytes).
        run_id: the run's ID (for envelopes read back from the store).
        rl: the run spec's ``[rl]`` section (async level, group size, groups per batch, advantage ε).
        max_held_bytes: see :data:`MAX_HELD_BODY_BYTES`.
    """

    def __init__(self, store: SubmissionStore, run_id: bytes, rl: RLSpec, *, max_held_bytes: int = MAX_HELD_BODY_BYTES) -> None:
        self.store = store
        self.run_id = run_id
        self.rl = rl
        self.max_held_bytes = max_held_bytes
        self._held: OrderedDict[str, tuple[Submission, int]] = OrderedDict()  # verified bodies and their sizes, oldest first
        self._held_bytes = 0
        self._lock = threading.Lock()
        self._records: dict[str, list[RolloutRecord]] = {}  # submission ID → its rollouts, decoded once
        self._consumed: set[GroupKey] = set()  # consumed groups of submissions not yet retired
        self._unread: dict[str, str] = {}  # live submissions a passing failure kept from being read → the error
        self.reopened = 0
        """Submissions read back from the store and verified again (not held, or after a restart)."""
        self.vocab_size: int | None = None
        """Rows of the policy's embedding, set by the coordinator once the model is built: a
        submission with a token ID at or above it is retired untrained (one accepted after a light
        check, which never loads the model, would otherwise stop the training step with an
        out-of-range embedding lookup)."""

    # --- intake (event loop) ------------------------------------------------------------------

    def note_stored(self, submission_id: str, submission: Submission) -> None:
        """The ingest stored a submission whose envelope it verified: keep the body (no second check)."""
        size = _body_bytes(submission)
        if size > self.max_held_bytes:
            return
        with self._lock:
            if submission_id in self._held:
                return
            self._held[submission_id] = (submission, size)
            self._held_bytes += size
            while self._held_bytes > self.max_held_bytes and self._held:
                _, (_, old_size) = self._held.popitem(last=False)
                self._held_bytes -= old_size

    def _take_held(self, submission_id: str) -> Submission | None:
        with self._lock:
            entry = self._held.pop(submission_id, None)
            if entry is None:
                return None
            self._held_bytes -= entry[1]
            return entry[0]

    # --- training thread ----------------------------------------------------------------------

    def fresh_records(self, step: int) -> list[RolloutRecord]:
        """Rollouts trainable at trainer step ``step``: accepted, inside the async window, in a group
        not yet consumed. Freshest policy first, so a batch stays as close to on-policy as the
        workers allow; older groups wait and are retired once they leave the window.

        A stored submission whose file is gone or whose bytes do not decode is retired
        (``consumed_step = -2``) with a warning naming it; it is never trained on. Any other
        failure to read it (``EMFILE``, ``ENOMEM``, ``EIO``: this node's state, which a peer can
        provoke for a while, not the submission's) skips it until a later call reads it.
        """
        subs = sorted(self.store.accepted_unconsumed(oldest_fresh_step(step, self.rl.async_level)), key=lambda s: -s.policy_step)
        live = {s.id for s in subs}
        for sid in [sid for sid in self._records if sid not in live]:
            del self._records[sid]  # left the window (the ingest retires it as stale) or retired: never trainable again
        self._unread = {sid: e for sid, e in self._unread.items() if sid in live}
        out: list[RolloutRecord] = []
        for stored in subs:
            recs = self._records.get(stored.id)
            if recs is None:
                try:
                    recs = self._checked(records_from_submission(self._submission(stored.id), stored.id))
                except (OSError, ProtocolError, TrainerError) as e:
                    if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, IsADirectoryError)):
                        if stored.id not in self._unread:  # warned once while it lasts
                            logger.warning("cannot read submission %s now (tried again later): %s", stored.id[:12], e)
                        self._unread[stored.id] = str(e)
                    else:  # gone or undecodable: never trainable
                        logger.warning("cannot train on submission %s: %s", stored.id[:12], e)
                        self.store.mark_consumed([stored.id], -2)
                    continue
                self._records[stored.id] = recs
                self._unread.pop(stored.id, None)
            out.extend(r for r in recs if r.group_key not in self._consumed)
        return out

    def _checked(self, recs: list[RolloutRecord]) -> list[RolloutRecord]:
        """``recs`` unchanged, after checking their token IDs against :attr:`vocab_size`.

        Raises:
            BatchError: a prompt or completion token ID ≥ ``vocab_size``.
        """
        if self.vocab_size is not None:
            for r in recs:
                top = max(int(r.prompt_ids.max(initial=0)), int(r.completion_ids.max(initial=0)))
                if top >= self.vocab_size:
                    raise BatchError(f"rollout {r.submission_id}/{r.task_key}/{r.sample}: token ID {top} ≥ vocabulary size {self.vocab_size}")
        return recs

    def _submission(self, submission_id: str) -> Submission:
        held = self._take_held(submission_id)
        if held is not None:
            return held
        self.reopened += 1
        return open_envelope(self.store.read(submission_id), run_id=self.run_id, expect=Submission).body

    def next_batch(self, step: int) -> Batch:
        """The batch of trainer step ``step`` from the fresh records (:func:`trainer.batch.assemble_batch`).

        Raises:
            NotEnoughRolloutsError: not enough usable whole groups yet (its fields say why).
        """
        return assemble_batch(self.fresh_records(step), step=step, async_level=self.rl.async_level, group_size=self.rl.group_size,
                              num_groups=self.rl.batch_groups, adv_eps=self.rl.adv_eps)

    def consume(self, batch: Batch) -> list[str]:
        """Mark the batch's groups consumed (trained, all-zero or stale) and return the submissions
        now retired: every group of theirs is consumed. Call :meth:`retire` with them once the
        trainer state that records this step is saved."""
        self._consumed.update(batch.consumed_groups)
        done = [sid for sid in batch.consumed_submission_ids if all(r.group_key in self._consumed for r in self._records.get(sid, []))]
        for sid in done:
            self._consumed.difference_update(r.group_key for r in self._records.get(sid, []))
        return done

    def retire(self, submission_ids: list[str], step: int) -> None:
        """Record in the store that trainer step ``step`` retired these submissions; forget their rollouts."""
        self.store.mark_consumed(submission_ids, step)
        for sid in submission_ids:
            self._records.pop(sid, None)
            self._take_held(sid)

    def position(self) -> dict[str, Any]:
        """What the trainer state must save for a resume: consumed groups of unretired submissions."""
        return {"consumed_groups": sorted([list(k) for k in self._consumed])}

    def restore(self, position: dict[str, Any], step: int) -> int:
        """Resume at trainer step ``step`` from a saved :meth:`position`: submissions retired by later
        steps (trained by a step whose state was never saved) become trainable again.

        Returns:
            How many submissions became trainable again.
        """
        self._consumed = {(str(k), int(s)) for k, s in position.get("consumed_groups", [])}
        return self.store.unconsume_after(step)
