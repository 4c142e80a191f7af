"""The rollout buffer: the submission ledger's trainable view (``trainer/ledger/``, ``docs/trainer.md`` §3).

The ledger owns a submission's state, and which of its GRPO groups a trainer step consumed; the
buffer turns what it calls *fresh* — accepted, inside the async window of the step being
assembled (the ledger applies :mod:`protocol.window`) — into rollout records grouped for GRPO,
leaving out the groups the ledger says were consumed:

* a submission's records are decoded once from the body the ingest verified
  (:meth:`~trainer.ledger.ledger.SubmissionLedger.body`; read back from disk only if no longer
  held, e.g. after a restart);
* a trainer step consumes groups (trained, or all-zero advantages): :meth:`RolloutBuffer.consume`
  records them in the ledger before the step's state is saved, and a submission every group of
  which is consumed is *consumed* there; :meth:`RolloutBuffer.retire` retires what earlier steps
  consumed once the state is saved; a resume forgets what later steps consumed
  (:meth:`RolloutBuffer.resume`);
* an accepted submission that can never be trained (file gone, bytes that no longer decode,
  token IDs out of the vocabulary) is retired untrained with a warning.

The buffer holds no state of its own beyond the decoded records (a cache): nothing of it is saved
with the trainer state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.errors import ProtocolError
from protocol.runspec import RLSpec
from trainer.batch import Batch, RolloutRecord, assemble_batch, records_from_submission
from trainer.errors import BatchError, TrainerError
from trainer.ledger.ids import GroupKey, SubmissionId
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
        self._records: dict[SubmissionId, list[RolloutRecord]] = {}  # submission ID → its rollouts, decoded once (a cache)
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
        consumed = self.ledger.consumed_groups()
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
            out.extend(r for r in recs if r.group_key not in consumed)
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

    def consume(self, batch: Batch, step: int) -> list[SubmissionId]:
        """Record in the ledger that trainer step ``step`` consumed the batch's groups (trained or
        all-zero); call it before the state of ``step`` is saved. A submission every group of which
        is now consumed is consumed whole, and its records are dropped.

        Returns:
            The submissions consumed whole now.
        """
        return self._consume(step, batch.consumed_groups, batch.group_submissions)

    def _consume(self, step: int, keys: Iterable[GroupKey], sources: Mapping[GroupKey, Iterable[str]]) -> list[SubmissionId]:
        keys = set(keys)
        consumed = self.ledger.consumed_groups() | keys
        groups: dict[SubmissionId, list[GroupKey]] = {}
        for key in keys:
            for sid in sources.get(key, ()):
                groups.setdefault(SubmissionId(sid), []).append(key)
        finished = [sid for sid in groups if all(r.group_key in consumed for r in self._records.get(sid, []))]
        done = self.ledger.consume(step, groups, finished)
        for sid in finished:
            self._records.pop(sid, None)
            self.ledger.forget_body(sid)
        return done

    def retire(self, step: int) -> int:
        """The state of trainer step ``step`` is saved: the ledger retires what earlier steps consumed
        (their files go); returns how many."""
        return self.ledger.retire_superseded(step)

    def resume(self, step: int, legacy_position: Mapping[str, Any] | None = None) -> int:
        """Resume at trainer step ``step`` (the state loaded): groups and submissions consumed by later
        steps (trained by a step whose state was never saved) become trainable again.

        Args:
            step: the loaded state's trainer step.
            legacy_position: the ``data_position`` of a state an older version saved, whose
                ``consumed_groups`` (consumed groups of unretired submissions, then kept there and
                not in the ledger) are recorded in the ledger as consumed by ``step``.

        Returns:
            How many submissions became trainable again.
        """
        n = self.ledger.unconsume_after(step)
        legacy = {(str(k), int(s)) for k, s in (legacy_position or {}).get("consumed_groups", [])}
        if legacy:
            self.fresh_records(step)  # decodes every trainable submission: which one each group is of
            sources = {r.group_key: [sid] for sid, recs in self._records.items() for r in recs if r.group_key in legacy}
            self._consume(step, sources, sources)
            logger.info("recorded %d consumed groups from the saved state of step %d in the ledger", len(sources), step)
        return n
