"""The rollout buffer: the submission ledger's trainable view (``trainer/ledger/``, ``docs/trainer.md`` §3).

The ledger owns a submission's state; the buffer turns what it calls *fresh* — accepted, inside
the async window of the step being assembled (the ledger applies :mod:`protocol.window`) — into
rollout records grouped for GRPO, and remembers which groups a trainer step consumed:

* a submission's records are decoded once from the body the ingest verified
  (:meth:`~trainer.ledger.ledger.SubmissionLedger.body`; read back from disk only if no longer
  held, e.g. after a restart);
* a trainer step consumes groups (trained, all-zero advantages, stale); a submission is
  *consumed* in the ledger once every one of its groups is, when the step's state is saved
  (:meth:`RolloutBuffer.retire`); until then its remaining groups stay trainable;
* an accepted submission that can never be trained (file gone, bytes that no longer decode,
  token IDs out of the vocabulary) is retired untrained with a warning.

The consumed-but-not-retired groups are the buffer's only state; they are saved with the trainer
state (:meth:`position`) and restored on resume (:meth:`restore`).
"""

from __future__ import annotations

import logging
from typing import Any

from protocol.errors import ProtocolError
from protocol.runspec import RLSpec
from trainer.batch import Batch, GroupKey, RolloutRecord, assemble_batch, records_from_submission
from trainer.errors import BatchError, TrainerError
from trainer.ledger.ids import SubmissionId
from trainer.ledger.ledger import SubmissionLedger

logger = logging.getLogger(__name__)


class RolloutBuffer:
    """Accepted rollouts of one run, grouped for GRPO, with what each trainer step consumed.

    Runs on the training thread.

    Args:
        ledger: the submission ledger (what is accepted and fresh, the verified bodies).
        rl: the run spec's ``[rl]`` section (async level, group size, groups per batch, advantage ε).
    """

    def __init__(self, ledger: SubmissionLedger, rl: RLSpec) -> None:
        self.ledger = ledger
        self.rl = rl
        self._records: dict[SubmissionId, list[RolloutRecord]] = {}  # submission ID → its rollouts, decoded once
        self._consumed: set[GroupKey] = set()  # consumed groups of submissions not yet retired
        self._unread: dict[SubmissionId, str] = {}  # live submissions a passing failure kept from being read → the error
        self.vocab_size: int | None = None
        """Rows of the policy's embedding, set by the coordinator once the model is built: a
        submission with a token ID at or above it is retired untrained (one accepted after a light
        check, which never loads the model, would otherwise stop the training step with an
        out-of-range embedding lookup)."""

    # --- training thread ----------------------------------------------------------------------

    def fresh_records(self, step: int) -> list[RolloutRecord]:
        """Rollouts trainable at trainer step ``step``: accepted, inside the async window, in a group
        not yet consumed. Freshest policy first, so a batch stays as close to on-policy as the
        workers allow; older groups wait and are retired once they leave the window.

        A stored submission whose file is gone or whose bytes do not decode is retired untrained
        with a warning naming it. Any other
        failure to read it (``EMFILE``, ``ENOMEM``, ``EIO``: this node's state, which a peer can
        provoke for a while, not the submission's) skips it until a later call reads it.
        """
        subs = sorted(self.ledger.trainable(step), key=lambda s: -s.policy_step)
        live = {s.id for s in subs}
        for sid in [sid for sid in self._records if sid not in live]:
            del self._records[sid]  # left the window (the ingest retires it as stale) or retired: never trainable again
        self._unread = {sid: e for sid, e in self._unread.items() if sid in live}
        out: list[RolloutRecord] = []
        for stored in subs:
            recs = self._records.get(stored.id)
            if recs is None:
                try:
                    recs = self._checked(records_from_submission(self.ledger.body(stored.id), stored.id))
                except (OSError, ProtocolError, TrainerError) as e:
                    if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, IsADirectoryError)):
                        if stored.id not in self._unread:  # warned once while it lasts
                            logger.warning("cannot read submission %s now (tried again later): %s", stored.id[:12], e)
                        self._unread[stored.id] = str(e)
                    else:  # gone or undecodable: never trainable
                        logger.warning("cannot train on submission %s: %s", stored.id[:12], e)
                        self.ledger.retire_untrainable(stored.id)
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

    def next_batch(self, step: int) -> Batch:
        """The batch of trainer step ``step`` from the fresh records (:func:`trainer.batch.assemble_batch`).

        Raises:
            NotEnoughRolloutsError: not enough usable whole groups yet (its fields say why).
        """
        return assemble_batch(self.fresh_records(step), step=step, group_size=self.rl.group_size, num_groups=self.rl.batch_groups,
                              adv_eps=self.rl.adv_eps)

    def consume(self, batch: Batch) -> list[SubmissionId]:
        """Mark the batch's groups consumed (trained, all-zero or stale) and return the submissions
        now retired: every group of theirs is consumed. Call :meth:`retire` with them once the
        trainer state that records this step is saved."""
        self._consumed.update(batch.consumed_groups)
        ids = [SubmissionId(sid) for sid in batch.consumed_submission_ids]
        done = [sid for sid in ids if all(r.group_key in self._consumed for r in self._records.get(sid, []))]
        for sid in done:
            self._consumed.difference_update(r.group_key for r in self._records.get(sid, []))
        return done

    def retire(self, submission_ids: list[SubmissionId], step: int) -> None:
        """Record in the ledger that trainer step ``step`` consumed these submissions; forget their rollouts."""
        self.ledger.consumed(submission_ids, step)
        for sid in submission_ids:
            self._records.pop(sid, None)
            self.ledger.forget_body(sid)

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
        return self.ledger.unconsume_after(step)
