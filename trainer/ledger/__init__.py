"""The coordinator's submission ledger: what happens to a submission from its arrival to its retirement.

* ``store.py`` — :class:`SubmissionStore`: files + SQLite index; an acknowledged submission
  survives a crash; pending/leased/accepted/rejected states; verdicts; consumption by the trainer.
* ``bans.py`` — :class:`BanBook`: the coordinator-signed ban list.
"""

from trainer.ledger.bans import BanBook
from trainer.ledger.store import StoredSubmission, SubmissionStore

__all__ = ["BanBook", "StoredSubmission", "SubmissionStore"]
