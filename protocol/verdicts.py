"""Verdict reason codes, shared by validators (who emit them) and the coordinator (who bans on them).

A reason is a CHEAT reason when an honest worker on the agreed software cannot produce it. It is
BENIGN when the rejection may come from either side's circumstances rather than the worker's
honesty: the validator's own failure (its reward error, its resources, a checkpoint it could
not fetch), a wall/CPU/memory limit hit by either side (code rewards depend on the clock), a
program whose result does not reproduce when the validator re-runs it, the run's environment's
own reward code failing or not reproducing (``environment``: the environment's fault, never the
worker's), or a stale policy. Benign rejections only lower a worker's reputation, and count as
non-cheats there.

Even a cheat reason does not ban on its own: the coordinator bans only when a second,
independent check of the same submission reproduces a cheat reason (another validator's
verdict, or the coordinator's re-check). See ``docs/validator.md`` "Ban rule".
"""

from __future__ import annotations

from typing import Final

OK: Final = "ok"
PRECISION: Final = "precision"
"""Benign reason under replay rule ``logit-bound-v2``: a value beyond its bound but within the hard factor."""

CHEAT_REASONS: Final[frozenset[str]] = frozenset(
    {
        "malformed",  # fields inconsistent with each other or the run spec (wrong counts, lengths)
        "bounds",  # token IDs ≥ vocab, lengths > max_tokens, rewards out of range
        "task_mismatch",  # tasks or seeds are not the ones derived for (run, peer, step, counter)
        "replay",  # a submission counter the worker already used
        "toploc",  # a TOPLOC proof that does not match the validator's prefill
        "sampling",  # a token the seeded sampler would not have drawn
        "logprobs",  # reported sampling log-probs differ from the recomputed ones
        "termination",  # EOS where P(EOS) < threshold, or an early stop without EOS
        "reward",  # a reported reward that differs from the recomputed one
    }
)

BENIGN_REASONS: Final[frozenset[str]] = frozenset(
    {
        "stale_policy",  # policy step outside the async window
        "unknown_checkpoint",  # the validator could not get the checkpoint of that step
        "timeout",  # validation did not finish in time
        "reward_error",  # the validator could not compute the reward (its sandbox, its task data)
        "limit_hit",  # a wall/CPU/memory limit of the reward was hit on either side
        "nondeterministic",  # the reward disagreed but re-runs did not reproduce it (validator/rewards.py)
        "environment",  # the run's environment's own reward code crashed, hit a limit or did not reproduce (protocol.envs)
        "resources",  # the validator ran out of memory, disk or descriptors while checking
        "precision",  # logit-bound-v2: a value beyond its bound within the hard factor (an honest worker's rare numeric tail; the audit counts it)
    }
)

AUDIT_BAN_REASON: Final = "audit"
"""The ban reason of a worker the per-worker audit flagged (``protocol.audit``, ``docs/toploc.md`` §11):
its replay statistics, over many verdicts, are beyond what honest compute produces at the run's
false-alarm rate. Not a verdict reason: no single submission shows it."""

ALL_REASONS: Final[frozenset[str]] = CHEAT_REASONS | BENIGN_REASONS | {OK}


def is_cheat(reason: str) -> bool:
    """Whether ``reason`` is evidence of cheating (grounds for a ban once a second check reproduces it)."""
    return reason in CHEAT_REASONS
