"""GRPO advantages, computed per group and never by position in a batch.

A *group* is the set of rollouts sampled for one task in one sampling event; it is identified by
its key ``(task_key, group_seed)``. Rows of one group may arrive interleaved with other groups in
any order (the ingest stores submissions as they come, validators accept them out of order), so
grouping is by key only. prime-rl issue #600 built groups from consecutive batch positions and
silently mixed prompts when the order was not the sampling order; this module cannot do that.

Advantage (GRPO, DeepSeekMath arXiv 2402.03300 §4.1.2, as used by INTELLECT-2 arXiv 2505.07291 §3)::

    A_i = (r_i − mean(r_group)) / (std(r_group) + ε)

with the population standard deviation (``ddof = 0``). Groups whose advantages are all zero (every
rollout got the same reward) carry no learning signal and are dropped whole (INTELLECT-2's online
advantage filtering, §3.2).

Pure numpy: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["GroupAdvantages", "compute_group_advantages", "group_advantages", "group_indices"]


def group_advantages(rewards: np.ndarray, eps: float) -> np.ndarray:
    """Advantages of one group.

    Args:
        rewards: ``[G] float`` rewards of the group's rollouts, G ≥ 1.
        eps: ε added to the standard deviation (> 0), so a group of equal rewards gives zeros.

    Returns:
        ``[G] float32`` advantages ``(r − mean) / (std + ε)``; exactly zero when all rewards are equal.

    Raises:
        ValueError: an empty group, a non-finite reward, or ``eps ≤ 0``.
    """
    r = np.asarray(rewards, dtype=np.float64)  # [G]
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    # (r − mean) / (std + ε) is unchanged when r and ε are scaled together; scaling by the largest
    # |r| keeps the mean and std finite for any finite rewards (unchecked rewards of 1e308 made
    # NaN advantages, then NaN weights). |r| ≤ 1: no scaling, the same bits as without it.
    scale = max(1.0, float(np.abs(r).max()))
    r, eps = r / scale, eps / scale
    centered = r - r.mean()  # [G]
    if not np.any(centered):
        return np.zeros(r.shape, dtype=np.float32)
    advantages: np.ndarray = (centered / (r.std() + eps)).astype(np.float32)  # [G]
    return advantages


def group_indices(keys: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Positions of each group's rows, grouped by key.

    Args:
        keys: the group key of every row, in any order (``(task_key, group_seed)`` tuples).

    Returns:
        key → row positions, keys in order of first appearance, positions ascending.
    """
    out: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return out


@dataclass(frozen=True)
class GroupAdvantages:
    """One group's rows and advantages.

    Attributes:
        key: the group key.
        indices: ``[G]`` row positions in the input (ascending).
        advantages: ``[G] float32`` advantages, aligned with ``indices``.
    """

    key: Hashable
    indices: tuple[int, ...]
    advantages: np.ndarray

    @property
    def all_zero(self) -> bool:
        """True when no row of the group carries a learning signal."""
        return not bool(np.any(self.advantages))


def compute_group_advantages(keys: Sequence[Hashable], rewards: Sequence[float], eps: float) -> list[GroupAdvantages]:
    """Per-group advantages of rows given in any order.

    Args:
        keys: ``[N]`` group key per row.
        rewards: ``[N]`` reward per row.
        eps: ε of :func:`group_advantages`.

    Returns:
        One :class:`GroupAdvantages` per distinct key, in order of first appearance (including
        all-zero groups; callers filter with :attr:`GroupAdvantages.all_zero`).

    Raises:
        ValueError: ``keys`` and ``rewards`` differ in length, or a reward is not finite.
    """
    if len(keys) != len(rewards):
        raise ValueError(f"{len(keys)} keys but {len(rewards)} rewards")
    r = np.asarray(rewards, dtype=np.float64)  # [N]
    out = []
    for key, idx in group_indices(keys).items():
        out.append(GroupAdvantages(key=key, indices=tuple(idx), advantages=group_advantages(r[idx], eps)))
    return out
