"""Which source to ask for the next piece: choice weighted by delivered bytes/s, with exploration.

Each source (origin or relay base URL) has a measured rate (``throughput_bps``: an exponentially
weighted mean of the bytes/second its piece requests delivered, completed or not), a count of
requests in flight, a cool-down after transport failures (exponential back-off, an honest relay
can restart) and a ban after *evidence* (bytes that contradict the signed manifest). The choice
is random with weights ``rate / (1 + in flight)``, so fast sources take most of the load without
starving the others; with probability ``exploration`` it is uniform, so a source that was slow
once is measured again.

Hostile sources (issue #12: Sybil relay records, tarpits, relays that advertise what they cannot
serve; issue #23: relays that answer at once and then trickle bytes) are contained by these rules:

* **Origins are reserved.** Sources named as origins (the run spec's / coordinator's URLs) are
  always in the pool and have their own request slots (``max_in_flight_per_source`` each) that
  relay candidates never take; the shared concurrency bound applies to relay candidates only.
* **Bounded candidates.** At most ``max_candidates`` relay URLs (default 8) are kept, chosen at
  random from what was offered (sticky: a kept candidate stays while it is offered and not banned).
* **Probation.** A relay that has not yet delivered a verified piece gets one request at a time.
* **Weight is earned by delivering.** A relay never measured weighs ``untried_weight`` (1/8) of
  the best measured source (an unmeasured origin weighs as the best), and a request cut off as
  too slow sets its source's rate to what it delivered (:meth:`SourcePool.record_slow`), so a
  trickling relay weighs next to nothing however fast it once was.
* **Cool-down.** Transport failures (refused, timeout, no answer, too slow) and answers of "not
  held" (404) for a piece it was asked for cool the source down with exponential back-off
  (bounded), so a tarpit, a trickler or a relay advertising a step it cannot serve is asked less
  and less, not once per piece.
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
_MAX_MISS_COOLDOWN_S = 10.0
_BASE_MISS_COOLDOWN_S = 0.5

DEFAULT_MAX_CANDIDATES = 8
"""Relay candidates kept per pool (origins come on top)."""

UNTRIED_WEIGHT = 1 / 8
"""A relay never measured weighs this fraction of the best measured source's rate."""

_MIN_WEIGHT_BPS = 1.0
"""Floor of a choice weight, bytes/s (a source measured at 0 can still be drawn by exploration)."""


@dataclass
class SourceState:
    """What is known about one source.

    Attributes:
        url: base URL (``http://host:port``), no trailing slash.
        throughput_bps: measured rate in bytes per second: EWMA of what its piece requests
            delivered, a slow one's rate taken as is (``None``: not measured yet).
        in_flight: requests now running against it.
        consecutive_failures: transport failures since its last success.
        cooldown_until: monotonic time (seconds) before which it is not asked.
        banned_until: monotonic time until which it is banned for evidence (``inf``: for good).
        faulty_reason: the first evidence against it, or ``None``.
        bytes_received: verified piece bytes received from it.
        pieces_ok: verified pieces received from it.
        origin: an origin (reserved slots, never dropped from the pool, no probation).
        consecutive_misses: "not held" (404) answers for pieces since its last success.
        cooldowns: how many times it was cooled down (failures and misses).
        last_failure: reason of its latest failure or miss, or ``None``.
        evidence: every evidence reason recorded against it.
    """

    url: str
    origin: bool = False
    throughput_bps: float | None = None
    in_flight: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    banned_until: float = 0.0
    faulty_reason: str | None = None
    bytes_received: int = 0
    pieces_ok: int = 0
    consecutive_misses: int = 0
    cooldowns: int = 0
    last_failure: str | None = None
    evidence: list[str] = field(default_factory=list)

    @property
    def proven(self) -> bool:
        """An origin, or a source that delivered at least one verified piece."""
        return self.origin or self.pieces_ok > 0


def normalise_url(url: str) -> str:
    """``url`` without trailing slashes (the form used as a source's key)."""
    return url.rstrip("/")


def _cool_down(src: SourceState, reason: str, base_s: float, max_s: float, streak: int) -> float:
    """Keep ``src`` unasked for ``base_s · 2^(streak−1)`` seconds (at most ``max_s``); returns that delay.

    A cool-down never shortens one already running; every one is counted and its reason kept.
    """
    # the exponent is capped: 2**1024 does not fit a float, and a long streak (an upstream down for
    # hours) would raise OverflowError here; 2**62 already exceeds any cap in seconds
    delay = min(max_s, base_s * 2.0 ** min(streak - 1, 62))
    src.cooldown_until = max(src.cooldown_until, time.monotonic() + delay)
    src.cooldowns += 1
    src.last_failure = reason
    return delay


class SourcePool:
    """The sources of one fetch (or of a relay's upstream set, which can change at run time).

    Args:
        urls: base URLs of the sources (relay candidates; those also in ``origins`` are origins).
        origins: base URLs of origins: always kept, with request slots of their own.
        exploration: probability of a uniform choice instead of a throughput-weighted one.
        max_in_flight_per_source: most requests at once to one proven source.
        ban_s: how long evidence bans a source, in seconds (``None``: for the pool's lifetime).
        max_candidates: most relay candidates kept (a random subset of ``urls`` beyond that).
        untried_weight: weight of a never-measured relay, as a fraction of the best measured rate.
        rng: random generator (tests pass a seeded one).
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        origins: Iterable[str] = (),
        exploration: float = 0.1,
        max_in_flight_per_source: int = 4,
        ban_s: float | None = None,
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
        untried_weight: float = UNTRIED_WEIGHT,
        rng: random.Random | None = None,
    ) -> None:
        self.exploration = exploration
        self.untried_weight = untried_weight
        self.max_in_flight_per_source = max_in_flight_per_source
        self.ban_s = ban_s
        self.max_candidates = max_candidates
        self._rng = rng or random.Random()
        self._sources: dict[str, SourceState] = {}
        self.offered = 0
        """Relay candidates offered by the latest :meth:`set_urls` (before the subset was taken)."""
        self.set_urls(urls, origins=origins)

    def set_urls(self, urls: Iterable[str], *, origins: Iterable[str] = ()) -> None:
        """Replace the set of sources; sources kept keep their statistics, cool-downs and bans.

        Origins are all kept. Of the other URLs at most ``max_candidates`` are kept: those already
        in the pool and not banned first, the rest drawn at random (so Sybil records cannot choose
        which relays a node asks, only add lottery tickets).
        """
        origin_urls = list(dict.fromkeys(normalise_url(u) for u in origins if u))
        offered = [u for u in dict.fromkeys(normalise_url(u) for u in urls if u) if u not in origin_urls]
        self.offered = len(offered)
        now = time.monotonic()
        old = self._sources
        keep = [u for u in offered if u in old and not old[u].origin and old[u].banned_until <= now]
        rest = [u for u in offered if u not in keep]
        self._rng.shuffle(rest)
        rest.sort(key=lambda u: u in old and old[u].banned_until > now)  # banned ones only if nothing else is offered
        chosen = set((keep + rest)[: self.max_candidates])
        picked = [u for u in offered if u in chosen]
        sources: dict[str, SourceState] = {}
        for u in origin_urls:
            st = old.get(u) or SourceState(u)
            st.origin = True
            sources[u] = st
        for u in picked:
            st = old.get(u) or SourceState(u)
            st.origin = False
            sources[u] = st
        self._sources = sources

    def view(self, urls: Iterable[str]) -> SourcePool:
        """A pool over some of these sources, in the order given, sharing their state (statistics,
        cool-downs, bans, evidence): what is learnt through the view counts here too."""
        v = SourcePool((), exploration=self.exploration, max_in_flight_per_source=self.max_in_flight_per_source,
                       ban_s=self.ban_s, max_candidates=self.max_candidates, untried_weight=self.untried_weight, rng=self._rng)
        v._sources = {u: self._sources[u] for u in dict.fromkeys(normalise_url(x) for x in urls) if u in self._sources}
        return v

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

    def cooled(self) -> dict[str, str]:
        """Sources that were cooled down at least once, with the latest reason."""
        return {s.url: s.last_failure or "" for s in self._sources.values() if s.cooldowns > 0}

    def origins(self) -> list[SourceState]:
        """The origins of the pool."""
        return [s for s in self._sources.values() if s.origin]

    def capacity(self, src: SourceState) -> int:
        """Most requests at once to ``src``: one while a relay is unproven (probation)."""
        return self.max_in_flight_per_source if src.proven else 1

    def next_ready_s(self, now: float | None = None) -> float | None:
        """Seconds until the next cooling source is usable again (``None``: none is cooling)."""
        now = time.monotonic() if now is None else now
        waits = [s.cooldown_until - now for s in self._sources.values() if s.banned_until <= now and s.cooldown_until > now]
        return max(0.0, min(waits)) if waits else None

    def choose(
        self, exclude: Iterable[str] = (), *, relays: bool = True, origins: bool = True, proven_only: bool = False
    ) -> SourceState | None:
        """Pick a source for the next request, or ``None`` if none is usable and free now.

        Args:
            exclude: URLs not to pick.
            relays: whether relay candidates may be picked (the caller has a shared slot free).
            origins: whether origins may be picked.
            proven_only: pick only origins and relays that delivered a verified piece.
        """
        excluded = set(exclude)
        cands = [
            s for s in self.usable()
            if s.url not in excluded and s.in_flight < self.capacity(s) and (origins if s.origin else relays)
            and (s.proven or not proven_only)
        ]
        if not cands:
            return None
        if len(cands) == 1 or self._rng.random() < self.exploration:
            return self._rng.choice(cands)
        measured = [s.throughput_bps for s in self._sources.values() if s.throughput_bps is not None]
        best = max(measured, default=1.0)
        weights = [max(self._rate_weight(s, best), _MIN_WEIGHT_BPS) / (1 + s.in_flight) for s in cands]
        return self._rng.choices(cands, weights=weights, k=1)[0]

    def _rate_weight(self, src: SourceState, best: float) -> float:
        """A source's choice weight before load: its measured rate; unmeasured, the best measured
        (origin) or ``untried_weight`` of it (relay: weight is earned by delivering)."""
        if src.throughput_bps is not None:
            return src.throughput_bps
        return best if src.origin else best * self.untried_weight

    def best_rate_bps(self, *, origins_only: bool = False) -> float | None:
        """The highest measured rate among sources not banned (``origins_only``: among origins), bytes/s
        (``None``: none measured)."""
        now = time.monotonic()
        rates = [s.throughput_bps for s in self._sources.values()
                 if s.throughput_bps is not None and s.banned_until <= now and (s.origin or not origins_only)]
        return max(rates, default=None)

    def record_success(self, src: SourceState, nbytes: int, seconds: float) -> None:
        """A verified piece of ``nbytes`` bytes arrived from ``src`` in ``seconds``."""
        rate = nbytes / max(seconds, 1e-6)
        src.throughput_bps = rate if src.throughput_bps is None else (1 - _EWMA_ALPHA) * src.throughput_bps + _EWMA_ALPHA * rate
        src.consecutive_failures = 0
        src.consecutive_misses = 0
        src.bytes_received += nbytes
        src.pieces_ok += 1

    def record_slow(self, src: SourceState, rate_bps: float, reason: str = "slow") -> None:
        """A request to ``src`` delivered only ``rate_bps`` bytes/s, below the rate floor, and was cut
        off: its rate becomes that (its weight collapses) and it is cooled down like a failure."""
        src.throughput_bps = rate_bps if src.throughput_bps is None else min(src.throughput_bps, rate_bps)
        self.record_failure(src, reason)

    def record_failure(self, src: SourceState, reason: str) -> None:
        """A transport failure (refused, reset, timeout, 5xx, truncated): cool the source down."""
        src.consecutive_failures += 1
        delay = _cool_down(src, reason, _BASE_COOLDOWN_S, _MAX_COOLDOWN_S, src.consecutive_failures)
        logger.debug("source %s failed (%s); cooling down %.2f s", src.url, reason, delay)

    def record_missing(self, src: SourceState, reason: str = "missing") -> None:
        """``src`` answered "not held" for a piece of a step it offered: cool it down.

        Back-off doubles per consecutive miss (0.5 s … 10 s), so a source advertising a manifest
        whose pieces it cannot serve is soon asked rarely instead of once per piece, while an
        honest relay still filling that step is asked again within seconds.
        """
        src.consecutive_misses += 1
        delay = _cool_down(src, reason, _BASE_MISS_COOLDOWN_S, _MAX_MISS_COOLDOWN_S, src.consecutive_misses)
        logger.debug("source %s does not hold what it offered (%s); cooling down %.2f s", src.url, reason, delay)

    def record_evidence(self, src: SourceState, reason: str) -> None:
        """Proof that ``src`` served wrong content: ban it and remember why."""
        src.evidence.append(reason)
        if src.faulty_reason is None:
            src.faulty_reason = reason
            logger.warning("source %s is faulty: %s; not using it any more", src.url, reason)
        src.banned_until = float("inf") if self.ban_s is None else time.monotonic() + self.ban_s
