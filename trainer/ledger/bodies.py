"""Verified submission bodies kept in memory, so an envelope the ingest verified is not verified again.

The ingest opens each submission's envelope once, on POST; the ledger keeps the verified body
here until the trainer takes it (:meth:`HeldBodies.take`). Bodies are bounded by the memory they
take (:func:`body_bytes`); the oldest are dropped first and read back from disk when needed
(and after a restart), which is the only other time an envelope is opened.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from protocol.messages import Submission
from trainer.ledger.ids import SubmissionId

MAX_HELD_BODY_BYTES = 256 * 1024 * 1024
"""Verified submission bodies held in memory, by the memory they take (:func:`body_bytes`), bytes."""

_BODY_OVERHEAD_BYTES = 4096
_TASK_OVERHEAD_BYTES = 512
_ROLLOUT_OVERHEAD_BYTES = 1536
_PROOF_OVERHEAD_BYTES = 64
"""Python object overheads of a decoded body, bytes: the envelope and model objects, each task's and
rollout's model, each proof's ``bytes`` object and list slot (above ``tracemalloc`` measurements)."""


def body_bytes(sub: Submission) -> int:
    """Memory a held verified body takes, bytes: its packed arrays, its TOPLOC proofs and its objects.

    Proofs count: a hostile body can be almost all proofs (``⌈max_tokens / chunk⌉`` of up to
    1 KiB per rollout), which counting the arrays alone let hold ~1000× the bound.
    """
    return _BODY_OVERHEAD_BYTES + sum(_TASK_OVERHEAD_BYTES + len(t.problem_id) for t in sub.tasks) + sum(
        _ROLLOUT_OVERHEAD_BYTES + len(r.prompt_ids) + len(r.completion_ids) + len(r.logprobs)
        + sum(len(p) for p in r.proofs) + _PROOF_OVERHEAD_BYTES * len(r.proofs)
        for r in sub.rollouts
    )


class HeldBodies:
    """At most ``max_bytes`` of verified bodies (:func:`body_bytes`), oldest dropped first. Thread-safe.

    Args:
        max_bytes: see :data:`MAX_HELD_BODY_BYTES`.
    """

    def __init__(self, max_bytes: int = MAX_HELD_BODY_BYTES) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[SubmissionId, tuple[Submission, int]] = OrderedDict()
        self.held_bytes = 0
        self._lock = threading.Lock()

    def __contains__(self, sid: object) -> bool:
        with self._lock:
            return sid in self._held

    def hold(self, sid: SubmissionId, body: Submission) -> None:
        """Keep ``body`` (a body larger than the whole bound is not kept)."""
        size = body_bytes(body)
        if size > self.max_bytes:
            return
        with self._lock:
            if sid in self._held:
                return
            self._held[sid] = (body, size)
            self.held_bytes += size
            while self.held_bytes > self.max_bytes and self._held:
                _, (_, old_size) = self._held.popitem(last=False)
                self.held_bytes -= old_size

    def take(self, sid: SubmissionId) -> Submission | None:
        """The held body of ``sid``, no longer held; ``None`` if it is not held."""
        with self._lock:
            entry = self._held.pop(sid, None)
            if entry is None:
                return None
            self.held_bytes -= entry[1]
            return entry[0]
