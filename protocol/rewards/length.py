"""INTELLECT-2's length penalty (INTELLECT-2 report §3.3, "controllable thinking budgets")."""

from __future__ import annotations

import math

from protocol.rewards.base import RewardError

__all__ = ["INTELLECT2_LENGTH_PENALTY_LAMBDA", "length_penalty"]

INTELLECT2_LENGTH_PENALTY_LAMBDA = 0.0003
"""λ (reward per token of deviation) used by INTELLECT-2."""


def length_penalty(reward: float, length: int, target: int | None, lam: float) -> float:
    """r = r_task − λ·|length − target|.

    Args:
        reward: r_task.
        length: completion length, in tokens (≥ 0).
        target: target length from the length-control prompt, in tokens; ``None`` for none,
            which returns ``reward`` unchanged.
        lam: λ ≥ 0, reward per token of deviation (INTELLECT-2: 0.0003).

    Returns:
        The penalised reward (not clipped: it can be negative).

    Raises:
        RewardError: on a negative length or target, or a negative or non-finite λ.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise RewardError(f"length must be a non-negative number of tokens, got {length!r}")
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise RewardError(f"lambda must be finite and ≥ 0, got {lam!r}")
    if target is None:
        return float(reward)
    if isinstance(target, bool) or not isinstance(target, int) or target < 0:
        raise RewardError(f"target must be a non-negative number of tokens, got {target!r}")
    return float(reward) - float(lam) * abs(length - target)
