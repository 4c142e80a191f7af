"""The per-worker audit: a sequential test of a worker's replay statistics against honest rates.

One submission cannot tell a worker that steers its tokens inside the replay's window (it reads
the seeded uniforms and emits, where the rule admits it, the token it prefers) from a worker whose
bf16 arithmetic moved a CDF edge; many submissions can. Each deciding verdict carries
:class:`~protocol.messages.ReplayStats`: counts of *events* (a token that differs from the
validator's replay, one whose gap exceeds a fixed fraction of the tolerance, a log-prob or TOPLOC
chunk beyond its bound) out of their *trials* (tokens, chunks). For an honest worker each event
has some small rate ``p_e``; the coordinator measures an upper bound ``p0_e`` of it on honest
reference submissions of its own (calibration, :class:`Baseline`). A steering worker raises some
rate above it.

**The test** (``audit.rule = "eprocess-v1"``, ``docs/toploc.md`` §11): for every event ``e`` and
alternative ``p1 = r · p0_e``, ``r ∈`` :data:`ALTERNATIVES`, the likelihood ratio of the worker's
counts, ``Π (p1 / p0)^k ((1 − p1) / (1 − p0))^(n − k)`` over its verdicts, is a test martingale
(its expectation is ≤ 1 at every verdict) whenever the worker's true rate is ≤ ``p0_e``; so is
the average ``E`` of all of them (a mixture). Ville's inequality: an honest worker's ``E`` ever
reaches ``1 / α`` with probability ≤ ``α`` (``audit.false_alarm``), over the whole run, however
long, however often it is looked at. A worker whose ``E`` reaches it is flagged. ``p0_e`` may
change between verdicts (a new calibration); each factor uses the bound current when its verdict
is counted, which keeps the product a supermartingale.

What the guarantee rests on, stated: honest workers' event rates, given what came before, are
at most the calibrated bounds. The calibration runs the honest worker's code in the run's
worker dtype on the current policy (``node/coordinator/calibrate.py``) and bounds each rate by
a one-sided Chernoff bound at level ``audit.baseline_confidence`` (:func:`rate_upper_bound`,
pooled over the newest ``audit.calibration_window_steps`` policy steps), per decode configuration
(``audit.calibration_batches``: honest statistics depend on the decode batch size), each event's
bound the largest over the configurations (:class:`Baseline`); workers whose hardware computes
differently from the calibration (another GPU kernel) must be covered by it, which is what
``spec init --measure-precision`` on the workers' kind of machine checks (``docs/operators.md``).

**The twin test** (``audit.rule = "eprocess-v2"``, ``docs/toploc.md`` §11.2). A rate test cannot see
*which* tokens differ, so a steerer that rations its deviations below the bounds (≈ 1.44 ``p0``: the
drift of every component is negative there) is never flagged. Under ``eprocess-v2`` validators decode,
for up to :data:`TWINS_PER_SUBMISSION` diverged rollouts of each full check, the float32 *twin* (the
replay's choice at the first differing token, then its own seeded decode) and count whether the
claimed completion's task reward beats the twin's (``up``) or the reverse (``down``). Among decisive
rollouts an honest worker's up-share is some ``q`` (bf16 noise is not symmetric: measured 0.58–0.66),
bounded above by the calibration like the rates (pooled over the whole run, :class:`Baseline`); a
steerer's is ≈ 1. The mixture over :data:`UP_FRACTIONS` of Bernoulli likelihood ratios with
``p1 = p0 + f · (1 − p0)`` is a test supermartingale whenever the worker's up-share is ≤ ``p0``; the
rule's ``E`` is the average of ``eprocess-v1``'s mixture and this one (half the weight each), so Ville
still bounds an honest worker's chance of ever being flagged by ``α``. The twin half also tests ups per
*decided* twin as a rate (:data:`UP_RATE_EVENT`): deliberate downs lower the up-share, not that rate. With
the eleven calibrated bounds, ``≤ α + 11β``.

Pure arithmetic on counts (no I/O): the coordinator's ledger keeps the state
(``trainer/ledger/audit.py``); anyone holding the signed verdicts and the calibration counts can
recompute every step (:func:`replay_evidence`).

Source: test martingales and mixtures of likelihood ratios — Ville (1939); Ramdas, Grünwald,
Vovk & Shafer, "Game-theoretic statistics and safe anytime-valid inference" (Statist. Sci.
2023), §3–§4. The Chernoff bound: Hoeffding (1963), Thm. 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from protocol.messages import ReplayStats
from protocol.runspec import AUDIT_RULE_EPROCESS, AUDIT_RULE_EPROCESS_V2, CALIBRATION_BATCHES_DEFAULT

__all__ = [
    "ALTERNATIVES",
    "TWINS_PER_SUBMISSION",
    "UP_FRACTIONS",
    "AuditState",
    "Baseline",
    "ConfigCounts",
    "Flag",
    "HeldSubmission",
    "event_counts",
    "rate_upper_bound",
    "verdict_mismatch",
]

ALTERNATIVES = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
"""Ratios ``r`` of the alternative rates ``p1 = r · p0`` the mixture bets on: a worker whose event
rate is ``r`` times the honest bound grows its factor fastest near that ``r``, and averaging over
ten of them costs ``ln 10`` ≈ 2.3 nats of evidence against knowing ``r``."""

TOKEN_EVENTS = ("differ", "gap_over_0", "gap_over_1", "gap_over_2", "gap_over_3", "gap_over_4", "impossible", "logprob_over")
"""Events per replayed token (``gap_over_i``: the gap beyond ``GAP_EDGE_FRACTIONS[i]`` of the tolerance)."""
CHUNK_EVENTS = ("chunks_over",)
"""Events per TOPLOC chunk."""
EVENTS = TOKEN_EVENTS + CHUNK_EVENTS
"""The rate events (``eprocess-v1``)."""
UP_EVENT = "up"
"""The twin event (``eprocess-v2``): a decisive rollout (``up`` or ``down``) that is ``up``."""
UP_RATE_EVENT = "up_rate"
"""The second twin event (``eprocess-v2``): a decided twin (a twin whose reward was had) that is ``up``.
Deliberate downs lower the up-share but not this rate: a steerer that balances its ups with sabotaged
rollouts, or farms downs in rejected work, is seen by it (red team a33b, 7 Dec 2026)."""
TWIN_EVENTS = (UP_EVENT, UP_RATE_EVENT)
EVENTS_V2 = EVENTS + TWIN_EVENTS

UP_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875, 0.984375, 0.9921875, 0.99609375)
"""The twin test's alternatives: up-shares ``p1 = p0 + f · (1 − p0)``; a steerer at up-share ≈ 1 grows the
largest fastest, one just above ``p0`` the smallest (the smallest ``f`` sets how far above ``p0`` a steerer
that balances its ups with deliberate downs may stay unflagged: drift ≤ 0 below ``q*`` ≈ ``p0 + f/2 · (1 − p0)``)."""

TWINS_PER_SUBMISSION = 8
"""Most diverged rollouts of one full check whose twin a validator decodes under ``eprocess-v2`` (drawn at
random among the diverged ones, so a worker cannot choose which are decided; the rest count as diverged,
not decided). Bounds the extra work: at most this many decodes of ≤ ``sampling.max_tokens`` tokens and
their rewards per submission (``docs/validator.md``)."""


def rule_events(rule: str) -> tuple[str, ...]:
    """The events an audit rule tests (:data:`EVENTS`, and :data:`UP_EVENT` under ``eprocess-v2``)."""
    return EVENTS_V2 if rule == AUDIT_RULE_EPROCESS_V2 else EVENTS


def event_counts(stats: ReplayStats, events: Sequence[str] = EVENTS) -> dict[str, tuple[int, int]]:
    """Each event's ``(count, trials)`` in one verdict's statistics (default: the rate events :data:`EVENTS`;
    ``up`` is ``(up, up + down)``: the decisive rollouts are its trials).

    A ``gap_over`` list shorter than the edges counts 0 for the missing edges (a validator of
    another rule version binned fewer; it then says nothing about them).
    """
    over = list(stats.gap_over) + [0] * (5 - len(stats.gap_over))
    out = {"differ": (stats.differ, stats.tokens), "impossible": (stats.impossible, stats.tokens),
           "logprob_over": (stats.logprob_over, stats.tokens), "chunks_over": (stats.chunks_over, stats.chunks),
           UP_EVENT: (stats.up, stats.up + stats.down), UP_RATE_EVENT: (stats.up, stats.decided)}
    for i in range(5):
        out[f"gap_over_{i}"] = (over[i], stats.tokens)
    return {e: out[e] for e in events}


@dataclass(frozen=True)
class HeldSubmission:
    """What the coordinator holds of a judged submission, against which a verdict's counts are checked.

    Attributes:
        rollouts: the submission's rollouts.
        tokens: their completion tokens (the sum of the completions' lengths, tokens).
    """

    rollouts: int
    tokens: int


def verdict_mismatch(stats: ReplayStats, held: HeldSubmission, *, rule: str, chunk_size: int | None) -> str | None:
    """Why a full check's statistics cannot be those of the submission the coordinator holds, or ``None``.

    A full check replays every completion token of every rollout and verifies every TOPLOC chunk
    (``validator.pipeline``), so its counts are fixed by the submission: ``tokens`` equals the held
    completion tokens; ``chunks`` lies between ``max(rollouts, ⌈tokens / chunk_size⌉)`` and
    ``⌊(tokens + rollouts · (chunk_size − 1)) / chunk_size⌋`` (each rollout of ``n ≥ 1`` tokens has
    ``⌈n / chunk_size⌉`` chunks); under ``eprocess-v2`` ``rollouts`` equals the held rollouts (0 under
    other rules). A verdict whose counts differ was forged or broken: counted, its inflated trials
    would dilute the worker's test (a huge ``tokens`` with no events drives every component's
    likelihood ratio towards 0, and the evidence a steerer builds later must first climb back).

    Args:
        stats: the verdict's replay statistics.
        held: the submission as the coordinator stored it.
        rule: the run's ``audit.rule``.
        chunk_size: the run's ``toploc.chunk_size`` (tokens); ``None``: chunks are not checked.

    Returns:
        A one-line reason naming the count that disagrees, or ``None`` when all agree.
    """
    if stats.tokens != held.tokens:
        return f"tokens {stats.tokens} != {held.tokens} completion tokens held"
    want_rollouts = held.rollouts if rule == AUDIT_RULE_EPROCESS_V2 else 0
    if stats.rollouts != want_rollouts:
        return f"rollouts {stats.rollouts} != {want_rollouts} ({rule})"
    if chunk_size is not None and held.rollouts > 0:
        lo = max(held.rollouts, -(-held.tokens // chunk_size))
        hi = (held.tokens + held.rollouts * (chunk_size - 1)) // chunk_size
        if not lo <= stats.chunks <= hi:
            return f"chunks {stats.chunks} outside [{lo}, {hi}] for {held.rollouts} rollouts of {held.tokens} tokens"
    return None


def _alternatives(event: str, p0: float) -> list[tuple[str, float]]:
    """``(component key, p1)`` of every alternative of ``event`` at honest bound ``p0`` (``p1 < 1`` only)."""
    if event == UP_EVENT:
        return [(f"{event}@{f:g}", p1) for f in UP_FRACTIONS if (p1 := p0 + f * (1.0 - p0)) < 1.0]  # p0 within 1e-16 of 1 rounds p1 to 1
    return [(f"{event}@{r:g}", r * p0) for r in ALTERNATIVES if r * p0 < 1.0]


def _kl(q: float, p: float) -> float:
    """Bernoulli KL divergence ``KL(q ‖ p)``, nats."""
    a = q * math.log(q / p) if q > 0 else 0.0
    b = (1 - q) * math.log((1 - q) / (1 - p)) if q < 1 else 0.0
    return a + b


def rate_upper_bound(count: int, trials: int, confidence: float) -> float:
    """An upper bound on a Bernoulli rate from ``count`` events in ``trials``, wrong with probability ≤ ``confidence``.

    The largest ``p ≥ count / trials`` with ``trials · KL(count / trials ‖ p) ≤ ln(1 / confidence)``
    (Chernoff–Hoeffding: ``P(Binom(n, p) ≤ k) ≤ exp(−n KL(k/n ‖ p))`` for ``k/n ≤ p``), a little
    more conservative than the Clopper–Pearson bound; found by bisection to 1e-12.

    Args:
        count: events seen (0 … ``trials``).
        trials: trials (0: the bound is 1, nothing is known).
        confidence: in (0, 1).

    Returns:
        The bound, in ``(0, 1]``.

    Raises:
        ValueError: counts out of range or ``confidence`` outside (0, 1).
    """
    if not (0 <= count <= trials) or not 0.0 < confidence < 1.0:
        raise ValueError(f"need 0 ≤ count ≤ trials and confidence in (0, 1), got {count}, {trials}, {confidence}")
    if trials == 0:
        return 1.0
    q = count / trials
    budget = math.log(1.0 / confidence) / trials
    lo, hi = q, 1.0
    if _kl(q, 1.0 - 1e-15) <= budget:
        return 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid >= 1.0:  # q within an ulp of 1 (≈ 10^16 trials): nothing left to bisect
            break
        if _kl(q, mid) <= budget:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return hi


@dataclass
class ConfigCounts:
    """One decode configuration's calibration counts (:class:`Baseline` keeps one per configuration).

    Attributes:
        by_step: policy step → event → ``(count, trials)`` of that step's reference submissions made
            in this configuration (the newest ``window_steps`` steps that had any).
        twins: ``(up, decisive, decided)`` of every reference submission of this configuration counted in the run.
    """

    by_step: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    twins: tuple[int, int, int] = (0, 0, 0)

    def add(self, step: int, stats: ReplayStats, window_steps: int, *, twins: bool = True) -> None:
        """Count one reference submission at policy ``step``, keeping the newest ``window_steps`` steps."""
        acc = self.by_step.setdefault(step, {})
        for name, (k, n) in event_counts(stats).items():
            k0, n0 = acc.get(name, (0, 0))
            acc[name] = (k0 + k, n0 + n)
        if twins:
            self.twins = (self.twins[0] + stats.up, self.twins[1] + stats.up + stats.down, self.twins[2] + stats.decided)
        for old in sorted(self.by_step)[:-window_steps]:
            del self.by_step[old]

    def pooled(self) -> dict[str, tuple[int, int]]:
        """Each event's ``(count, trials)`` over the window."""
        out: dict[str, tuple[int, int]] = {}
        for acc in self.by_step.values():
            for name, (k, n) in acc.items():
                k0, n0 = out.get(name, (0, 0))
                out[name] = (k0 + k, n0 + n)
        return out

    def tokens(self) -> int:
        """Replayed tokens in the window."""
        return self.pooled().get("differ", (0, 0))[1]

    def bounds(self, confidence: float) -> dict[str, float]:
        """This configuration's upper bound of every event's honest rate (1 where nothing was measured)."""
        pooled = self.pooled()
        out = {name: rate_upper_bound(*pooled.get(name, (0, 0)), confidence) for name in EVENTS}
        out[UP_EVENT] = rate_upper_bound(self.twins[0], self.twins[1], confidence)
        out[UP_RATE_EVENT] = rate_upper_bound(self.twins[0], self.twins[2], confidence)
        return out


@dataclass
class Baseline:
    """The honest event rates' upper bounds, from calibration counts pooled over recent policy steps, per
    decode configuration.

    Honest replay statistics depend on how the worker decoded: a batch-1 worker's bf16 kernels round
    differently from a batch-64 worker's, and its TOPLOC ``chunks_over`` and large-gap rates are ones a
    batch-64 calibration does not contain (measured, ``docs/toploc.md`` §11.1). So the counts are kept per
    *configuration* (the decode batch size of ``audit.calibration_batches``: the coordinator's reference
    submissions round-robin over them) and each event's bound ``p0`` is the **largest** of the
    configurations' bounds: every honest configuration's rate is then below it (each configuration's
    bound holds with probability ≥ ``1 − confidence``). A configuration with no data yet bounds every
    event by 1, so nothing is flagged on an event until every configuration has measured it; the audit
    flags no one before every configuration holds ``audit.min_calibration_tokens`` (:meth:`tokens` is the
    fewest of them).

    The rate events pool each configuration's newest ``window_steps`` steps (rates move with the policy);
    the twin events pool every calibrated step of the run (:attr:`ConfigCounts.twins`): decisive rollouts
    are rare (≈ 0.4 per 64-rollout reference submission on the devnet's base), and the up-share is a property
    of the worker's arithmetic against the validator's (measured 0.58–0.66 across decode batch sizes and
    heads), not of one step's rates.

    Attributes:
        confidence: the one-sided level of :func:`rate_upper_bound` (``audit.baseline_confidence``).
        window_steps: how many of a configuration's newest policy steps are pooled (``audit.calibration_window_steps``).
        configs: the decode batch sizes calibrated (``audit.calibration_batches``; sorted, unique).
        per_config: decode batch size → its :class:`ConfigCounts`.
    """

    confidence: float
    window_steps: int
    configs: tuple[int, ...] = CALIBRATION_BATCHES_DEFAULT
    per_config: dict[int, ConfigCounts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError("a baseline needs at least one decode configuration")
        for c in self.configs:
            self.per_config.setdefault(c, ConfigCounts())

    def add(self, step: int, stats: ReplayStats, *, config: int | None = None, twins: bool = True) -> None:
        """Count one honest reference submission's statistics at policy ``step``, decoded with batch size
        ``config`` (``None``: the only configuration); ``twins=False``: its rate events only, for a reload
        whose twin totals are kept apart.

        Raises:
            ValueError: ``config`` is not one of :attr:`configs` (or ``None`` with several).
        """
        if config is None:
            if len(self.configs) != 1:
                raise ValueError(f"a baseline of decode configurations {list(self.configs)} needs the submission's config")
            config = self.configs[0]
        if config not in self.per_config:
            raise ValueError(f"decode configuration {config} is not calibrated here ({list(self.configs)})")
        self.per_config[config].add(step, stats, self.window_steps, twins=twins)

    @property
    def by_step(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Policy step → event → ``(count, trials)`` summed over the configurations (read-only view)."""
        out: dict[int, dict[str, tuple[int, int]]] = {}
        for counts in self.per_config.values():
            for step, acc in counts.by_step.items():
                dst = out.setdefault(step, {})
                for name, (k, n) in acc.items():
                    k0, n0 = dst.get(name, (0, 0))
                    dst[name] = (k0 + k, n0 + n)
        return out

    @property
    def twins(self) -> tuple[int, int, int]:
        """``(up, decisive, decided)`` summed over the configurations."""
        t = [c.twins for c in self.per_config.values()]
        return (sum(x[0] for x in t), sum(x[1] for x in t), sum(x[2] for x in t))

    def pooled(self) -> dict[str, tuple[int, int]]:
        """Each event's ``(count, trials)`` over the window, summed over the configurations (for display; the
        bounds never pool configurations)."""
        out: dict[str, tuple[int, int]] = {}
        for counts in self.per_config.values():
            for name, (k, n) in counts.pooled().items():
                k0, n0 = out.get(name, (0, 0))
                out[name] = (k0 + k, n0 + n)
        return out

    def tokens_by_config(self) -> dict[int, int]:
        """Decode batch size → replayed tokens in its window."""
        return {c: self.per_config[c].tokens() for c in self.configs}

    def tokens(self) -> int:
        """Replayed tokens in the window of the configuration with the fewest (what readiness needs)."""
        return min(self.tokens_by_config().values())

    def decisive_by_config(self) -> dict[int, int]:
        """Decode batch size → decisive reference rollouts (up or down) counted in the run."""
        return {c: self.per_config[c].twins[1] for c in self.configs}

    def decisive(self) -> int:
        """Decisive reference rollouts counted in the run by the configuration with the fewest."""
        return min(self.decisive_by_config().values())

    def bounds(self) -> dict[str, float]:
        """Each event's honest-rate upper bound ``p0``, ``up`` included (the honest up-share's bound among
        decisive rollouts): the largest over the configurations of that configuration's
        :func:`rate_upper_bound` (1 where any configuration measured nothing)."""
        per = [self.per_config[c].bounds(self.confidence) for c in self.configs]
        return {name: max(b[name] for b in per) for name in per[0]}

@dataclass(frozen=True)
class Flag:
    """Why a worker was flagged: the evidence a ban cites.

    Attributes:
        e_value: the mixture's value when it reached the threshold.
        threshold: ``1 / audit.false_alarm``.
        event: the event whose components carry most of it.
        count, trials: the worker's totals of that event.
        p0: the honest bound of that event at the flagging verdict.
        verdicts: verdicts counted.
        tokens: tokens counted.
    """

    e_value: float
    threshold: float
    event: str
    count: int
    trials: int
    p0: float
    verdicts: int
    tokens: int

    def detail(self) -> str:
        """One line for a ban entry (≤ 200 characters)."""
        return (f"audit e-value {self.e_value:.3g} ≥ {self.threshold:.3g} after {self.verdicts} verdicts / {self.tokens} tokens: "
                f"{self.event} {self.count}/{self.trials} vs honest ≤ {self.p0:.3g}")[:200]


@dataclass
class AuditState:
    """One worker's test: the log-value of every mixture component and the worker's event totals.

    Attributes:
        log_wealth: ``(event, r)`` → log of that likelihood-ratio martingale (0 at start); the twin
            event's keys are ``up@f`` (:data:`UP_FRACTIONS`).
        totals: event → the worker's ``(count, trials)`` counted so far.
        verdicts: verdicts counted.
        rule: ``eprocess-v1`` (the rate events) or ``eprocess-v2`` (and the twin event).
    """

    log_wealth: dict[str, float] = field(default_factory=dict)
    totals: dict[str, tuple[int, int]] = field(default_factory=dict)
    verdicts: int = 0
    rule: str = AUDIT_RULE_EPROCESS

    def observe(self, stats: ReplayStats, p0: Mapping[str, float]) -> None:
        """Count one verdict's statistics against the honest bounds ``p0`` current now."""
        self.verdicts += 1
        for name, (k, n) in event_counts(stats, rule_events(self.rule)).items():
            k0, n0 = self.totals.get(name, (0, 0))
            self.totals[name] = (k0 + k, n0 + n)
            p = p0.get(name, 1.0)
            if n == 0 or not 0.0 < p < 1.0:
                continue
            for key, p1 in _alternatives(name, p):  # an alternative with p1 ≥ 1 bets nothing (a factor of 1)
                step = k * math.log(p1 / p) + (n - k) * math.log1p(-p1) - (n - k) * math.log1p(-p)
                self.log_wealth[key] = self.log_wealth.get(key, 0.0) + step

    def log_e_value(self) -> float:
        """Log of the mixture ``E``: under ``eprocess-v1`` the average over all :data:`EVENTS` ×
        :data:`ALTERNATIVES` components; under ``eprocess-v2`` the average of that and of the twin
        event's :data:`UP_FRACTIONS` components (half the weight each)."""
        rate = _log_mean([self.log_wealth.get(f"{e}@{r:g}", 0.0) for e in EVENTS for r in ALTERNATIVES])
        if self.rule != AUDIT_RULE_EPROCESS_V2:
            return rate
        twin = [self.log_wealth.get(f"{UP_EVENT}@{f:g}", 0.0) for f in UP_FRACTIONS]
        twin += [self.log_wealth.get(f"{UP_RATE_EVENT}@{r:g}", 0.0) for r in ALTERNATIVES]
        return _log_mean([rate, _log_mean(twin)])

    def flag(self, false_alarm: float, p0: Mapping[str, float]) -> Flag | None:
        """A :class:`Flag` when ``E ≥ 1 / false_alarm``, else ``None``."""
        log_e = self.log_e_value()
        if log_e < math.log(1.0 / false_alarm):
            return None
        best = max(self.log_wealth, key=lambda key: self.log_wealth[key])
        event = best.split("@", 1)[0]
        k, n = self.totals.get(event, (0, 0))  # for up: ups among decisive rollouts
        tokens = self.totals.get("differ", (0, 0))[1]
        return Flag(math.exp(min(log_e, 700.0)), 1.0 / false_alarm, event, k, n, p0.get(event, 1.0), self.verdicts, tokens)

    def to_json(self) -> dict[str, object]:
        """A JSON-safe copy (persistence)."""
        return {"log_wealth": dict(self.log_wealth), "totals": {k: list(v) for k, v in self.totals.items()}, "verdicts": self.verdicts,
                "rule": self.rule}

    @classmethod
    def from_json(cls, doc: Mapping[str, object]) -> AuditState:
        """The inverse of :meth:`to_json` (the coordinator's own file; raises ``KeyError``/``TypeError`` on a damaged one;
        a state written before rules were recorded is ``eprocess-v1``'s)."""
        lw = doc["log_wealth"]
        totals = doc["totals"]
        assert isinstance(lw, dict) and isinstance(totals, dict)
        return cls({str(k): float(v) for k, v in lw.items()}, {str(k): (int(v[0]), int(v[1])) for k, v in totals.items()},
                   int(doc["verdicts"]), str(doc.get("rule", AUDIT_RULE_EPROCESS)))  # type: ignore[call-overload]


def _log_mean(logs: Sequence[float]) -> float:
    """``log(mean(exp(logs)))``, without overflow."""
    top = max(logs)
    return top + math.log(sum(math.exp(x - top) for x in logs) / len(logs))


def replay_evidence(verdicts: Iterable[tuple[ReplayStats, Mapping[str, float]]], false_alarm: float,
                    rule: str = AUDIT_RULE_EPROCESS) -> tuple[AuditState, Flag | None]:
    """Recompute a worker's test under audit ``rule`` from its verdicts' statistics, each with the bounds
    that applied when it was counted: the audit's evidence is reproducible from signed verdicts and
    calibration counts alone. Returns the final state and the first flag (``None`` if never flagged)."""
    state = AuditState(rule=rule)
    first: Flag | None = None
    for stats, p0 in verdicts:
        state.observe(stats, p0)
        if first is None:
            first = state.flag(false_alarm, p0)
    return state, first


def rates(totals: Mapping[str, tuple[int, int]], events: Sequence[str] = EVENTS) -> dict[str, float]:
    """Observed rates ``count / trials`` per event (0 where nothing was counted)."""
    return {e: (totals[e][0] / totals[e][1] if e in totals and totals[e][1] else 0.0) for e in events}
