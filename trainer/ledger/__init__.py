"""The coordinator's submission ledger: one owner for a submission's life, from its arrival to its retirement.

::

    admitted → stored → leased → judged ┬→ accepted → (fresh) → consumed → retired
             │                          └→ rejected (a cheat reproduced: its worker banned)
             └→ displaced (probation's share full: a lighter address prefix took its place)

* ``states.py`` — the state machine: :class:`State`, the named :class:`Transition` s and their
  source and target states.
* ``ids.py`` — :data:`SubmissionId`, the one form of a submission's ID on the coordinator.
* ``ledger.py`` — :class:`SubmissionLedger`: admission (quotas, probation), leasing, verdicts,
  the async-window and retention rules, the read models (counts, tokens, leaderboard).
* ``prefixes.py`` — the address prefixes (/24, /48) leasing and probation's share are fair over.
* ``leasing.py`` — the fair lease order (established workers first; round robin over address
  prefixes, addresses and keys).
* ``ban_rule.py`` — :class:`BanRule`: which verdicts decide, when a cheat verdict bans, the
  coordinator's re-check queue.
* ``bans.py`` — :class:`BanBook`: the coordinator-signed ban list.
* ``bodies.py`` — verified bodies held in memory (an envelope is verified once).
* ``store.py`` — :class:`SubmissionStore`: files + SQLite index, every query and change of state;
  ``writer.py`` — its write path (the group commit: writer threads, the commit thread); with
  ``schema.py`` (tables, read-model triggers, migration of older indexes) the only SQL.

The rollout buffer (``trainer/buffer.py``) is the ledger's trainable view; the ingest
(``trainer/ingest/``) is its HTTP face.
"""

from trainer.ledger.ban_rule import BanRule, Recheck, RecheckResult
from trainer.ledger.bans import BanBook
from trainer.ledger.ids import SubmissionId
from trainer.ledger.ledger import Quotas, SubmissionLedger
from trainer.ledger.states import State, Transition
from trainer.ledger.store import StoredSubmission, SubmissionStore

__all__ = ["BanBook", "BanRule", "Quotas", "Recheck", "RecheckResult", "State", "StoredSubmission", "SubmissionId",
           "SubmissionLedger", "SubmissionStore", "Transition"]
