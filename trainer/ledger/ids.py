"""The one form of a submission's ID on the coordinator, and of a GRPO group's key.

A submission is named by the content ID of its envelope bytes (``protocol.content``: 32 bytes of
SHA-256). The wire carries those bytes (a verdict's ``submission_id``, a ban record's); the
coordinator keys its index, file names, logs and JSON answers by their lowercase hex. The
conversion happens here and only at those two edges, so no other module switches between forms.
"""

from __future__ import annotations

from typing import NewType

from protocol.content import ContentId

SubmissionId = NewType("SubmissionId", str)
"""A submission's content ID as 64 lowercase hex characters."""

GroupKey = tuple[str, int]
"""``(task_key, group_seed)``: the identity of one GRPO group (``trainer.batch``: one submission's
rollouts for one of its tasks). The ledger records which groups a trainer step consumed by it."""

__all__ = ["GroupKey", "SubmissionId", "content_id", "submission_id"]


def submission_id(cid: bytes) -> SubmissionId:
    """The :data:`SubmissionId` of a content ID from the wire (an envelope's ``id``, a verdict's ``submission_id``).

    Raises:
        ValueError: ``cid`` is not 32 bytes.
    """
    if len(cid) != 32:
        raise ValueError(f"a submission ID is 32 bytes, not {len(cid)}")
    return SubmissionId(bytes(cid).hex())


def content_id(sid: SubmissionId) -> ContentId:
    """The 32 wire bytes of ``sid`` (for a signed ban record)."""
    return ContentId(bytes.fromhex(sid))
