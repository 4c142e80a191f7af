"""Retry pacing shared by every loop that talks to a peer that may be down.

:class:`Backoff` spaces attempts exponentially with jitter (so many nodes that lost the same
coordinator do not retry in lockstep); :class:`FailureLog` logs a repeated failure once per
interval with a count instead of once per attempt, and says when it recovered;
:func:`first_success` asks several sources at once and takes the first answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

K = TypeVar("K")
T = TypeVar("T")


class Backoff:
    """Exponential backoff with jitter: delays ``base_s``, ``2·base_s``, … capped at ``max_s``, each
    multiplied by a uniform factor in [0.5, 1.5).

    Args:
        base_s: first delay, seconds.
        max_s: largest delay before jitter, seconds.
        rng: returns uniform floats in [0, 1) (tests pass a fixed one).
    """

    def __init__(self, base_s: float = 0.5, max_s: float = 30.0, rng: Callable[[], float] = random.random) -> None:
        if not 0 < base_s <= max_s:
            raise ValueError(f"need 0 < base_s ≤ max_s, got {base_s}, {max_s}")
        self.base_s = base_s
        self.max_s = max_s
        self._rng = rng
        self._next = base_s
        self.failures = 0

    def next_delay(self) -> float:
        """The delay before the next attempt, seconds; doubles the following one (up to ``max_s``)."""
        delay = self._next * (0.5 + self._rng())
        self._next = min(self.max_s, self._next * 2)
        self.failures += 1
        return delay

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits ``base_s`` again."""
        self._next = self.base_s
        self.failures = 0


class FailureLog:
    """Log a failure that repeats at most once per ``interval_s`` (with how often it happened).

    The first failure of a streak is logged at once; later ones only when ``interval_s`` passed
    since the last line, as "… (N times in the last T s)". :meth:`recovered` ends the streak and
    logs once at INFO that it recovered.

    Args:
        logger: where to log.
        interval_s: shortest time between two lines about the same failure, seconds.
        level: level of the failure lines.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0, *, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.level = level
        self._clock = clock
        self._streak = 0
        self._unlogged = 0
        self._last_logged = 0.0
        self._first = 0.0

    def failed(self, message: str) -> bool:
        """Record one failure; returns whether a line was logged."""
        now = self._clock()
        self._streak += 1
        if self._streak == 1:
            self._first = self._last_logged = now
            self._unlogged = 0
            self.logger.log(self.level, "%s", message)
            return True
        self._unlogged += 1
        if now - self._last_logged >= self.interval_s:
            self.logger.log(self.level, "%s (%d times in the last %.0f s; still failing after %.0f s)", message, self._unlogged,
                            now - self._last_logged, now - self._first)
            self._last_logged = now
            self._unlogged = 0
            return True
        return False

    def recovered(self, what: str) -> None:
        """End a failure streak (logs once if there was one)."""
        if self._streak:
            self.logger.info("%s again after %d failed attempts over %.0f s", what, self._streak, self._clock() - self._first)
        self._streak = 0
        self._unlogged = 0

    @property
    def failing(self) -> bool:
        return self._streak > 0


async def first_success(attempts: Mapping[K, Awaitable[T]], expected: tuple[type[BaseException], ...]) -> tuple[tuple[K, T] | None,
                                                                                                               list[tuple[K, BaseException]]]:
    """Run ``attempts`` at once (one per source); the first that returns wins and the others are
    cancelled (without penalty: they were only slower).

    Args:
        attempts: source → the awaitable asking it.
        expected: failures that mean "this source did not give it" (collected); any other is raised.

    Returns:
        ``((source, result) or None when every attempt failed, [(source, failure), …] of those that failed first)``.
    """
    tasks = {asyncio.ensure_future(a): k for k, a in attempts.items()}
    failures: list[tuple[K, BaseException]] = []
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is None:
                    return (tasks[t], t.result()), failures
                if not isinstance(exc, expected):
                    raise exc
                failures.append((tasks[t], exc))
    finally:
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return None, failures
