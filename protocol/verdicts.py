"""Verdict reason codes, shared by validators (who emit them) and the coordinator (who bans on them).

A reason is *evidence of cheating* when an honest worker on the agreed software cannot produce
it: the coordinator bans the worker. Other rejections (a stale policy, a timeout) only lower the
worker's reputation. See ``docs/protocol.md`` §8.
"""

from __future__ import annotations

from typing import Final

OK: Final = "ok"

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
    }
)

ALL_REASONS: Final[frozenset[str]] = CHEAT_REASONS | BENIGN_REASONS | {OK}


def is_cheat(reason: str) -> bool:
    """Whether ``reason`` is evidence of cheating (grounds for a ban)."""
    return reason in CHEAT_REASONS
