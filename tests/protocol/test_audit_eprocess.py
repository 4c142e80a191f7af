"""The per-worker audit's statistics (protocol/audit.py): the honest-rate bound, the test martingale's
false-alarm rate, its power against a steering worker, and the reproducibility of its evidence."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from protocol.audit import ALTERNATIVES, EVENTS, AuditState, Baseline, event_counts, rate_upper_bound, replay_evidence
from protocol.messages import ReplayStats


def stats(tokens: int, differ: int = 0, over: tuple[int, ...] = (0, 0, 0, 0, 0), chunks: int = 1) -> ReplayStats:
    return ReplayStats(tokens=tokens, differ=differ, gap_over=list(over), chunks=chunks)


def test_rate_upper_bound_is_at_least_the_observed_rate_and_covers_the_truth() -> None:
    """The Chernoff bound is ≥ the observed rate, shrinks with more trials, equals 1 − β^(1/n) with no
    event, and holds the true rate at least 1 − β of the time (here β = 0.05 over 2,000 draws)."""
    assert rate_upper_bound(0, 0, 1e-6) == 1.0
    assert rate_upper_bound(0, 1000, 1e-6) == pytest.approx(1 - 1e-6 ** (1 / 1000), rel=1e-6)
    assert rate_upper_bound(30, 1000, 1e-3) > 0.03 > rate_upper_bound(30, 100_000, 1e-3) * 0.5
    assert rate_upper_bound(50, 1000, 1e-6) < rate_upper_bound(50, 1000, 1e-9) < 1.0
    with pytest.raises(ValueError):
        rate_upper_bound(5, 4, 0.1)
    rng = random.Random(7)
    p, n = 0.01, 800
    misses = sum(rate_upper_bound(sum(rng.random() < p for _ in range(n)), n, 0.05) < p for _ in range(2000))
    assert misses <= 0.05 * 2000


def test_each_factor_has_expectation_at_most_one_under_the_honest_bound() -> None:
    """What makes the mixture a test martingale: for a true rate ≤ p0 every alternative's factor on one
    Bernoulli trial has expectation ≤ 1 (exactly 1 at p0)."""
    for p0 in (1e-4, 3e-3, 0.05, 0.3):
        for r in ALTERNATIVES:
            p1 = r * p0
            if p1 >= 1:
                continue
            for p in (0.0, p0 / 2, p0):
                e = p * (p1 / p0) + (1 - p) * (1 - p1) / (1 - p0)
                assert e <= 1 + 1e-12


def _honest_run(rng: np.random.Generator, p_true: float, p0: float, verdicts: int, tokens: int, alpha: float) -> bool:
    state = AuditState()
    bounds = {e: p0 for e in EVENTS}
    for k in rng.binomial(tokens, p_true, size=verdicts).tolist():
        state.observe(stats(tokens, k, (k, 0, 0, 0, 0)), bounds)
        if state.flag(alpha, bounds) is not None:
            return True
    return False


@pytest.mark.slow
def test_honest_workers_are_flagged_at_most_at_the_stated_rate() -> None:
    """Ville's inequality, measured: 250 honest workers whose rate equals the bound, each over 120
    verdicts of 40 tokens, tested at α = 0.05: at most α of them are ever flagged (one-sided binomial
    slack of 3 σ), though each is looked at after every verdict."""
    rng = np.random.default_rng(11)
    alpha, n = 0.05, 250
    flagged = sum(_honest_run(rng, 0.01, 0.01, 120, 40, alpha) for _ in range(n))
    assert flagged <= alpha * n + 3 * math.sqrt(alpha * (1 - alpha) * n)


def test_a_steering_worker_is_flagged_and_the_flag_names_the_event() -> None:
    """A worker whose tokens differ from the replay ten times as often as honest compute's bound, with
    gaps beyond a quarter of the bound, is flagged at α = 1e-6 within a few hundred tokens; the flag's
    figures are its own totals."""
    bounds = Baseline(1e-6, 16)
    for step in range(4):
        bounds.add(step, stats(5000, 10, (3, 0, 0, 0, 0)))
    p0 = bounds.bounds()
    assert p0["gap_over_2"] < 1e-3 < p0["differ"] < 0.01
    state, tokens = AuditState(), 0
    rng = random.Random(3)
    flag = None
    while flag is None and tokens < 100_000:
        k = sum(rng.random() < 0.05 for _ in range(40))  # a 5 % deviation rate, gaps spread up to the bound
        big = sum(rng.random() < 0.5 for _ in range(k))
        state.observe(stats(40, k, (k, k, big, big // 2, 0)), p0)
        tokens += 40
        flag = state.flag(1e-6, p0)
    assert flag is not None and tokens <= 1000
    assert flag.e_value >= 1e6 and flag.event in EVENTS and flag.count == state.totals[flag.event][0] and flag.tokens == tokens
    assert "audit e-value" in flag.detail() and len(flag.detail()) <= 200


def test_no_bet_without_a_baseline_and_evidence_is_reproducible() -> None:
    """With nothing calibrated every bound is 1 and nothing is bet (a worker is never flagged on no
    baseline); the recorded (statistics, bounds) pairs recompute the same state and the same flag."""
    empty = Baseline(1e-6, 4).bounds()
    assert set(empty.values()) == {1.0}
    state = AuditState()
    state.observe(stats(1000, 1000, (1000,) * 5), empty)
    assert state.log_e_value() == 0.0 and state.flag(1e-6, empty) is None
    bounds = {e: 1e-3 for e in EVENTS}
    rows = [(stats(50, 5, (5, 4, 3, 2, 0)), bounds) for _ in range(20)]
    live = AuditState()
    first = None
    for s, b in rows:
        live.observe(s, b)
        first = first or live.flag(1e-6, b)
    again, flag = replay_evidence(rows, 1e-6)
    assert again.log_wealth == live.log_wealth and again.totals == live.totals and flag == first and flag is not None
    assert AuditState.from_json(live.to_json()).log_wealth == live.log_wealth


def test_baseline_pools_only_the_newest_steps_and_counts_events() -> None:
    b = Baseline(1e-6, window_steps=2)
    b.add(0, stats(100, 50))
    b.add(1, stats(100, 1))
    b.add(2, stats(100, 1))
    assert sorted(b.by_step) == [1, 2] and b.pooled()["differ"] == (2, 200) and b.tokens() == 200
    assert event_counts(stats(10, 3, (3, 2))) ["gap_over_1"] == (2, 10)
    assert event_counts(stats(10, 3, (3, 2)))["gap_over_4"] == (0, 10)
    with pytest.raises(ValueError):
        ReplayStats(tokens=10, differ=3, gap_over=[2, 3])  # must be non-increasing
    with pytest.raises(ValueError):
        ReplayStats(tokens=10, differ=11)


def test_verdict_mismatch_checks_a_full_checks_counts_against_the_submission_held() -> None:
    """``verdict_mismatch``: tokens equal the held completion tokens; TOPLOC chunks between
    ``max(rollouts, ⌈T / c⌉)`` and ``⌊(T + R·(c − 1)) / c⌋``; twin rollouts equal the held rollouts under
    ``eprocess-v2``, 0 under ``eprocess-v1``; each disagreement is named."""
    from protocol.audit import HeldSubmission, verdict_mismatch

    held = HeldSubmission(rollouts=2, tokens=40)  # e.g. 33 + 7 tokens: 2 + 1 chunks of 32; 20 + 20: 1 + 1
    ok = ReplayStats(tokens=40, differ=0, chunks=2)
    assert verdict_mismatch(ok, held, rule="eprocess-v1", chunk_size=32) is None
    assert verdict_mismatch(ok.model_copy(update={"chunks": 3}), held, rule="eprocess-v1", chunk_size=32) is None
    for chunks in (1, 4):
        why = verdict_mismatch(ok.model_copy(update={"chunks": chunks}), held, rule="eprocess-v1", chunk_size=32)
        assert why is not None and why.startswith(f"chunks {chunks} outside [2, 3]")
    assert verdict_mismatch(ok.model_copy(update={"chunks": 10**6}), held, rule="eprocess-v1", chunk_size=None) is None
    assert "tokens 41 != 40" in verdict_mismatch(ok.model_copy(update={"tokens": 41}), held, rule="eprocess-v1", chunk_size=32)
    assert "rollouts 0 != 2" in verdict_mismatch(ok, held, rule="eprocess-v2", chunk_size=32)
    assert verdict_mismatch(ok.model_copy(update={"rollouts": 2}), held, rule="eprocess-v2", chunk_size=32) is None
    assert "rollouts 2 != 0" in verdict_mismatch(ok.model_copy(update={"rollouts": 2}), held, rule="eprocess-v1", chunk_size=32)
