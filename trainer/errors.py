"""The exception family of ``trainer/``.

:class:`TrainerError` is the root; a coordinator catches it at its own fault-tolerance points
(log, report the status, retry the step or stop cleanly). Programming errors (wrong shapes,
wrong types) stay ``ValueError`` / ``TypeError`` and are never caught.
"""

from __future__ import annotations

from protocol.ingest_api import ERROR_CODES

__all__ = ["BatchError", "NotEnoughRolloutsError", "Refused", "StateError", "TrainerError"]


class TrainerError(Exception):
    """Root of every error raised by ``trainer/``."""


class BatchError(TrainerError):
    """A rollout record or batch that cannot be trained on (inconsistent group, bad lengths)."""


class NotEnoughRolloutsError(BatchError):
    """Batch assembly found fewer usable groups than a trainer step needs.

    The fields say why, so a waiting coordinator can show it in its status and time out with a
    reason instead of hanging silently.

    Attributes:
        step: the trainer step the batch was for.
        needed_groups: whole groups the step needs.
        usable_groups: groups that passed every filter.
        zero_advantage_groups: groups dropped because every advantage was zero.
        incomplete_groups: groups skipped because they hold fewer (or more) than group_size rollouts.
    """

    def __init__(
        self,
        *,
        step: int,
        needed_groups: int,
        usable_groups: int,
        zero_advantage_groups: int,
        incomplete_groups: int,
    ) -> None:
        super().__init__(
            f"step {step}: {usable_groups}/{needed_groups} usable groups "
            f"(not counted: {zero_advantage_groups} all-zero advantage, {incomplete_groups} incomplete); "
            "wait for more accepted submissions"
        )
        self.step = step
        self.needed_groups = needed_groups
        self.usable_groups = usable_groups
        self.zero_advantage_groups = zero_advantage_groups
        self.incomplete_groups = incomplete_groups


class StateError(TrainerError):
    """A training-state or checkpoint directory that is missing, incomplete, or does not match the
    model and optimizer it is loaded into (other shapes, parameter names, world size).

    Attributes:
        path: the file or directory at fault.
    """

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class Refused(TrainerError):
    """A submission, lease request or verdict the coordinator refuses, with one of the ingest's
    error codes (:data:`protocol.ingest_api.ERROR_CODES`, which fixes its HTTP status and what a
    client does with it).

    Attributes:
        code: the error code; detail: what was wrong, for the client; retry_after_s: when to retry
            (flow control), seconds, or ``None``.
    """

    def __init__(self, code: str, detail: str, retry_after_s: float | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown ingest error code {code!r}")
        super().__init__(detail)
        self.code, self.detail, self.retry_after_s = code, detail, retry_after_s
        self.status = ERROR_CODES[code][0]
