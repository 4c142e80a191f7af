"""Which source to ask for the next piece: throughput-weighted choice with exploration.

Each source (origin or relay base URL) has a measured throughput (exponentially weighted mean of
per-piece bytes/second), a count of requests in flight, a cool-down after transport failures
(exponential back-off, an honest relay can restart) and a ban after *evidence* (bytes that
contradict the signed manifest). The choice is random with weights ``throughput / (1 + in
flight)``, so fast sources take most of the load without starving the others; with probability
``exploration`` it is uniform, so a source that was slow once is measured again. A source never
measured is weighted as the best one measured (optimistic start).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_EWMA_ALPHA = 0.3
_MAX_COOLDOWN_S = 30.0
_BASE_COOLDOWN_S = 0.25


@dataclass
class SourceState:
    """What is known about one source.

    Attributes:
        url: base URL (``http://host:port``), no trailing slash.
        throughput_bps: measured throughput in bytes per second (``None``: not measured yet).
        in_flight: requests now running against it.
        consecutive_failures: transport failures since its last success.
        cooldown_until: monotonic time (seconds) before which it is not asked.
        banned_until: monotonic time until which it is banned for evidence (``inf``: for good).
        faulty_reason: the first evidence against it, or ``None``.
        bytes_received: verified piece bytes received from it.
        pieces_ok: verified pieces received from it.
    """

    url: str
    throughput_bps: float | None = None
    in_flight: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    banned_until: float = 0.0
    faulty_reason: str | None = None
    bytes_received: int = 0
    pieces_ok: int = 0
    evidence: list[str] = field(default_factory=list)


def normalise_url(url: str) -> str:
    """``url`` without trailing slashes (the form used as a source's key)."""
    return url.rstrip("/")


class SourcePool:
    """The sources of one fetch (or of a relay's upstream set, which can change at run time).

    Args:
        urls: base URLs of the sources.
        exploration: probability of a uniform choice instead of a throughput-weighted one.
        max_in_flight_per_source: most requests at once to one source.
        ban_s: how long evidence bans a source, in seconds (``None``: for the pool's lifetime).
        rng: random generator (tests pass a seeded one).
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        exploration: float = 0.1,
        max_in_flight_per_source: int = 4,
        ban_s: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.exploration = exploration
        self.max_in_flight_per_source = max_in_flight_per_source
        self.ban_s = ban_s
        self._rng = rng or random.Random()
        self._sources: dict[str, SourceState] = {}
        self.set_urls(urls)

    def set_urls(self, urls: Iterable[str]) -> None:
        """Replace the set of sources; sources kept keep their statistics and bans."""
        wanted = list(dict.fromkeys(normalise_url(u) for u in urls if u))
        self._sources = {u: self._sources.get(u) or SourceState(u) for u in wanted}

    @property
    def urls(self) -> list[str]:
        return list(self._sources)

    def states(self) -> list[SourceState]:
        return list(self._sources.values())

    def get(self, url: str) -> SourceState | None:
        return self._sources.get(normalise_url(url))

    def usable(self, now: float | None = None) -> list[SourceState]:
        """Sources neither banned nor cooling down (regardless of load)."""
        now = time.monotonic() if now is None else now
        return [s for s in self._sources.values() if s.banned_until <= now and s.cooldown_until <= now]

    def all_banned(self) -> bool:
        """Whether every source is banned for evidence (nothing left to try)."""
        now = time.monotonic()
        return all(s.banned_until > now for s in self._sources.values())

    def faulty(self) -> dict[str, str]:
        """Sources with evidence against them, with the first reason."""
        return {s.url: s.faulty_reason for s in self._sources.values() if s.faulty_reason is not None}

    def choose(self, exclude: Iterable[str] = ()) -> SourceState | None:
        """Pick a source for the next request, or ``None`` if none is usable and free now."""
        excluded = set(exclude)
        cands = [
            s for s in self.usable() if s.url not in excluded and s.in_flight < self.max_in_flight_per_source
        ]
        if not cands:
            return None
        if len(cands) == 1 or self._rng.random() < self.exploration:
            return self._rng.choice(cands)
        measured = [s.throughput_bps for s in cands if s.throughput_bps]
        prior = max(measured) if measured else 1.0
        weights = [(s.throughput_bps or prior) / (1 + s.in_flight) for s in cands]
        return self._rng.choices(cands, weights=weights, k=1)[0]

    def record_success(self, src: SourceState, nbytes: int, seconds: float) -> None:
        """A verified piece of ``nbytes`` bytes arrived from ``src`` in ``seconds``."""
        rate = nbytes / max(seconds, 1e-6)
        src.throughput_bps = rate if src.throughput_bps is None else (1 - _EWMA_ALPHA) * src.throughput_bps + _EWMA_ALPHA * rate
        src.consecutive_failures = 0
        src.bytes_received += nbytes
        src.pieces_ok += 1

    def record_failure(self, src: SourceState, reason: str) -> None:
        """A transport failure (refused, reset, timeout, 5xx, truncated): cool the source down."""
        src.consecutive_failures += 1
        delay = min(_MAX_COOLDOWN_S, _BASE_COOLDOWN_S * 2 ** (src.consecutive_failures - 1))
        src.cooldown_until = time.monotonic() + delay
        logger.debug("source %s failed (%s); cooling down %.2f s", src.url, reason, delay)

    def record_evidence(self, src: SourceState, reason: str) -> None:
        """Proof that ``src`` served wrong content: ban it and remember why."""
        src.evidence.append(reason)
        if src.faulty_reason is None:
            src.faulty_reason = reason
            logger.warning("source %s is faulty: %s; not using it any more", src.url, reason)
        src.banned_until = float("inf") if self.ban_s is None else time.monotonic() + self.ban_s
