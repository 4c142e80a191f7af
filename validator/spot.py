"""Reputation-weighted spot checks: which submissions a validator checks in full (``docs/validator.md`` §5).

A *full* check is the whole pipeline (prefill, TOPLOC, sampling replay, log-probs, termination by
the policy, rewards); a *light* check is everything that needs no model: policy window, counter
replay, task derivation, format and bounds, declared termination and the rewards recomputed
(:meth:`validator.pipeline.SubmissionChecker.check` with ``full=False``). A worker's submissions
are all checked in full until it has :attr:`SpotCheckPolicy.full_checks` fully checked, accepted
submissions since its last doubt; after that a share ``full_checks / verified`` of them, never
below :attr:`SpotCheckPolicy.min_share`. Any doubt (a cheat verdict, or a reward that differs
where a resource limit might explain it) starts the count again from zero.

Which submissions are checked in full is decided when the validator judges one (after the
ingest stored it), from the validator's ed25519 signature of the submission ID
(:func:`selected`): deterministic, so a re-leased submission gets the same decision, and
unpredictable to the worker, who does not hold the validator's key. A hash of public data would
let a worker grind its envelope until a cheat falls outside the checked share.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from protocol.verdicts import CHEAT_REASONS, OK

SPOT_DOMAIN = b"intellect-node/validator-sample/1\x00"
"""Prefix of what a validator signs to decide whether a submission is checked in full."""
DOUBT_REASONS = CHEAT_REASONS | {"limit_hit"}
"""Verdict reasons that reset a worker's verified count: evidence of cheating, and a reward that
differed where a resource limit might explain it (not a cheat, but not verified either). The
validator's own failures (``reward_error``, ``resources``) and ``stale_policy`` (the
coordinator's clock) say nothing about the worker."""
DEFAULT_FULL_CHECKS = 20
"""Fully checked, accepted submissions since its last doubt before a worker's share starts to fall."""
DEFAULT_MIN_SHARE = 0.05
"""The lowest share of a worker's submissions checked in full."""


@dataclass(frozen=True)
class SpotCheckPolicy:
    """The share of a worker's submissions a validator checks in full, from its verified history.

    Attributes:
        full_checks: ``N``: a worker with fewer than ``N`` fully checked, accepted submissions
            since its last doubt has every submission checked in full (≥ 1).
        min_share: ``f_min`` in ``(0, 1]``: the share never falls below this; 1 checks every
            submission in full.
    """

    full_checks: int = DEFAULT_FULL_CHECKS
    min_share: float = DEFAULT_MIN_SHARE

    def __post_init__(self) -> None:
        if self.full_checks < 1:
            raise ValueError(f"full_checks must be ≥ 1, got {self.full_checks}")
        if not 0.0 < self.min_share <= 1.0:
            raise ValueError(f"min_share must be in (0, 1], got {self.min_share}")

    def share(self, verified: int) -> float:
        """``max(f_min, min(1, N / verified))``: 1 for a new or doubted worker, falling as ``1/verified``.

        Args:
            verified: fully checked, accepted submissions of the worker since its last doubt.
        """
        if verified <= self.full_checks:
            return 1.0
        return max(self.min_share, self.full_checks / verified)


def is_doubt(reason: str) -> bool:
    """Whether a verdict with ``reason`` resets the worker's verified count (:data:`DOUBT_REASONS`)."""
    return reason in DOUBT_REASONS


def next_verified(verified: int, reason: str, full: bool) -> int:
    """A worker's verified count after one more verdict on it: +1 for an accept after a full check,
    0 after a doubt, unchanged otherwise (an accept after a light check verifies no model work; a
    benign rejection says nothing about the worker). The validator's ledger applies this once per
    judged submission (:meth:`validator.judgements.Judgements.record`)."""
    if is_doubt(reason):
        return 0
    return verified + 1 if reason == OK and full else verified


def selected(sign: Callable[[bytes], bytes], submission_id: bytes, share: float) -> bool:
    """Whether the submission is checked in full at ``share``.

    ``SHA-256(sign(SPOT_DOMAIN || submission ID))``'s first 8 bytes, big-endian, ``< share · 2^64``.
    ed25519 signatures are deterministic (RFC 8032), so the same validator decides the same way
    for the same submission; without the validator's private key the worker cannot tell which of
    its submissions will be checked, before or after it signs them.

    Args:
        sign: the validator's ed25519 signing function (:meth:`protocol.identity.NodeKey.sign`).
        submission_id: the stored submission's 32-byte content ID.
        share: in ``(0, 1]``.
    """
    if share >= 1.0:
        return True
    h = hashlib.sha256(sign(SPOT_DOMAIN + submission_id)).digest()
    return int.from_bytes(h[:8], "big") < share * 2**64


def submissions_to_catch(cheat_fraction: float, share: float, probability: float = 0.999, detection: float = 1.0) -> int:
    """How many submissions a worker that cheats in a fraction ``c`` of them makes before a full
    check catches one, with the given probability: the smallest ``n`` with
    ``1 − (1 − c · f · q)^n ≥ p`` (each submission independently cheats with ``c``, is checked in
    full with ``f`` — the spot-check decision is a keyed hash the worker cannot predict — and a
    full check catches the cheat with ``q``).

    Args:
        cheat_fraction: ``c`` in ``(0, 1]``.
        share: ``f`` in ``(0, 1]``, the worker's share of full checks (at most ``min_share``
            below it never falls, :class:`SpotCheckPolicy`).
        probability: ``p`` in ``(0, 1)``.
        detection: ``q`` in ``(0, 1]``, the probability that a full check of a cheating
            submission rejects it (1 for the cheats of ``node/worker/adversary.py``; for a
            one-token deviation ``1 − P(pass)``, ``docs/toploc.md`` §6.1).
    """
    per = cheat_fraction * share * detection
    if not (0.0 < per <= 1.0 and 0.0 < probability < 1.0):
        raise ValueError("need 0 < c·f·q ≤ 1 and 0 < p < 1")
    if per == 1.0:
        return 1
    return max(1, math.ceil(math.log1p(-probability) / math.log1p(-per)))


def expected_accepted_cheats(share: float, detection: float = 1.0) -> float:
    """Expected cheating submissions accepted before the first one a full check catches:
    ``(1 − f · q) / (f · q)``, whatever the cheat fraction ``c`` (each cheating submission is
    caught independently with ``f · q``); of them ``(1 − f) / (1 − f · q)`` were not checked in
    full. With the ban rule (``docs/validator.md`` §4) the catch bans the worker once the
    coordinator's re-check reproduces it."""
    per = share * detection
    if not 0.0 < per <= 1.0:
        raise ValueError("need 0 < f·q ≤ 1")
    return (1.0 - per) / per
