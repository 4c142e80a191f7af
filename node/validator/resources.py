"""A check that ran the validator out of memory, disk or descriptors: this node's state, not the
worker's fault, until it repeats.

The first time a submission's check fails so, it is left to a later lease (the failure may pass:
another process freed memory, a disk was cleaned); the next time, it gets a ``resources`` verdict
(benign: ``protocol/verdicts.py``), so one submission that cannot be checked here cannot hold a
validator's lease loop forever. Any other exception is a bug, no verdict's business: the lease
expires and the submission is judged again (``docs/validator.md``).
"""

from __future__ import annotations

import errno
from collections import OrderedDict

import torch

__all__ = ["RESOURCE_ERRNOS", "RESOURCE_FAILURES_KEPT", "RESOURCE_RETRIES", "ResourceFailures", "resource_failure"]

RESOURCE_ERRNOS = frozenset({errno.ENOMEM, errno.ENOSPC, errno.EMFILE, errno.ENFILE, errno.EDQUOT})
"""``OSError`` numbers that mean this validator ran out of memory, disk or descriptors."""
RESOURCE_RETRIES = 1
"""Times a submission whose check ran this validator out of resources is left to a later lease
(the failure may be passing); the next failure on it gets a ``resources`` verdict (benign)."""
RESOURCE_FAILURES_KEPT = 1024
"""Submissions whose resource failures are remembered (oldest forgotten first)."""


def resource_failure(e: BaseException) -> str | None:
    """The name of the resource a check ran out of (memory, disk, descriptors), else ``None``
    (a bug, which is no verdict's business: the lease expires)."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):  # torch's (a RuntimeError): an accelerator's memory
        return type(e).__name__
    if isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS:
        return errno.errorcode.get(e.errno or 0, "OSError")
    return None


class ResourceFailures:
    """How often each submission's check ran out of resources (the newest
    :data:`RESOURCE_FAILURES_KEPT` submissions remembered)."""

    def __init__(self) -> None:
        self._failures: OrderedDict[str, int] = OrderedDict()  # submission ID -> failed checks

    def failed(self, submission_id: str) -> tuple[int, bool]:
        """Count one more failure of ``submission_id``'s check.

        Returns:
            ``(failures so far, whether to leave it to a later lease)``: the latter while it has
            failed at most :data:`RESOURCE_RETRIES` times; after that it gets a ``resources`` verdict.
        """
        failures = self._failures.pop(submission_id, 0) + 1
        self._failures[submission_id] = failures
        while len(self._failures) > RESOURCE_FAILURES_KEPT:
            self._failures.popitem(last=False)
        return failures, failures <= RESOURCE_RETRIES
