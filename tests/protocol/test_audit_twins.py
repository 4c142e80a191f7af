"""The audit's twin test (``eprocess-v2``, protocol/audit.py): the twin counts' consistency in
``ReplayStats``, the up-share e-process's validity under the calibrated honest bound, its power against a
steerer whose diverged rollouts nearly all beat their twins, and that ``eprocess-v1`` keeps its meaning."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from protocol.audit import EVENTS, UP_EVENT, UP_FRACTIONS, AuditState, Baseline, event_counts, replay_evidence, rule_events
from protocol.messages import ReplayStats
from protocol.runspec import AUDIT_RULE_EPROCESS, AUDIT_RULE_EPROCESS_V2, AuditSpec, RunInfo, RunSpec

V2 = AUDIT_RULE_EPROCESS_V2


def twins(up: int, down: int, *, decided: int | None = None, diverged: int | None = None, tokens: int = 1000) -> ReplayStats:
    """One verdict's statistics with the given twin outcomes and no rate event beyond the diverged tokens."""
    decided = up + down if decided is None else decided
    diverged = decided if diverged is None else diverged
    return ReplayStats(tokens=tokens, differ=diverged, gap_over=[0] * 5, chunks=4, rollouts=64, diverged=diverged, decided=decided,
                       up=up, down=down)


def test_twin_counts_are_consistent_and_old_verdicts_parse_with_zeros() -> None:
    """``up + down ≤ decided ≤ diverged ≤ min(rollouts, differ)``, ``rollouts ≤ tokens``; a verdict's
    statistics signed before the counts existed parse with all of them 0 (and count nothing)."""
    ok = ReplayStats(tokens=100, differ=5, rollouts=20, diverged=4, decided=3, up=2, down=1)
    assert event_counts(ok, rule_events(V2))[UP_EVENT] == (2, 3)
    old = ReplayStats.model_validate({"tokens": 100, "differ": 5, "gap_over": [1, 0, 0, 0, 0], "chunks": 4})
    assert (old.rollouts, old.diverged, old.decided, old.up, old.down) == (0, 0, 0, 0, 0)
    assert event_counts(old, rule_events(V2))[UP_EVENT] == (0, 0)
    for bad in ({"rollouts": 20, "diverged": 4, "decided": 3, "up": 2, "down": 2},  # up + down > decided
                {"rollouts": 20, "diverged": 4, "decided": 5},  # decided > diverged
                {"rollouts": 3, "diverged": 4},  # diverged > rollouts
                {"rollouts": 20, "diverged": 6},  # diverged > differ (each diverged rollout has a differing token)
                {"rollouts": 101},  # more rollouts than tokens
                {"up": 1}):  # an up without a decided twin
        with pytest.raises(ValueError):
            ReplayStats(tokens=100, differ=5, **bad)


def test_each_up_factor_has_expectation_at_most_one_under_the_honest_bound() -> None:
    """The twin test is a test supermartingale: for a true up-share ≤ p0 every alternative's factor on one
    decisive rollout has expectation ≤ 1 (exactly 1 at p0)."""
    for p0 in (0.3, 0.6, 0.8, 0.97):
        for f in UP_FRACTIONS:
            p1 = p0 + f * (1 - p0)
            for q in (0.0, p0 / 2, p0):
                assert q * p1 / p0 + (1 - q) * (1 - p1) / (1 - p0) <= 1 + 1e-12


def _calibrated(rng: random.Random, share: float, decisive: int) -> dict[str, float]:
    """The bounds of a baseline whose honest reference work had ``decisive`` decisive twins at up-share ``share``."""
    b = Baseline(1e-6, 16)
    ups = sum(rng.random() < share for _ in range(decisive))
    b.add(0, ReplayStats(tokens=200_000, differ=3000, gap_over=[300, 200, 100, 50, 10], chunks=4000, rollouts=64_000,
                         diverged=3000, decided=decisive, up=ups, down=decisive - ups))
    return b.bounds()


def test_a_steerer_that_wins_its_twins_is_flagged_within_tens_of_decisive_rollouts() -> None:
    """The red team's rationed steerer scored 2,579 up to 1 down while its rates stayed under the bounds:
    against a null calibrated on 300 honest decisive twins at up-share 0.62 it is flagged within 100
    decisive rollouts (its rate events count nothing here); the flag names the twin event."""
    p0 = _calibrated(random.Random(1), 0.62, 300)
    assert 0.62 < p0[UP_EVENT] < 0.9
    rng = random.Random(2)
    state, decisive, flag = AuditState(rule=V2), 0, None
    while flag is None and decisive < 1000:
        up = sum(rng.random() < 2579 / 2580 for _ in range(5))
        state.observe(twins(up, 5 - up), p0)
        decisive += 5
        flag = state.flag(1e-6, p0)
    assert flag is not None and decisive <= 100, (decisive, state.log_e_value())
    assert flag.event == UP_EVENT and flag.trials == decisive and flag.p0 == p0[UP_EVENT] and "up" in flag.detail()
    # the same verdicts under eprocess-v1 flag nothing: v1 keeps its meaning, blind to the twins
    v1 = AuditState()
    for _ in range(200):
        v1.observe(twins(5, 0), p0)
    assert v1.flag(1e-6, p0) is None and not any(k.startswith(UP_EVENT) for k in v1.log_wealth) and UP_EVENT not in v1.totals


@pytest.mark.slow
def test_honest_up_shares_under_the_calibrated_bound_are_not_flagged() -> None:
    """Honest noise is not symmetric (measured 88:57, 36:26, 125:64): 40 honest workers at up-share 0.62,
    each over 3,000 decisive rollouts, tested at α = 1e-6 against the bound calibrated on 300 reference
    decisive twins: none is flagged, none comes near (E < 10³). Ville at a testable level: 300 workers whose
    up-share equals the bound, at α = 0.05, are flagged at most at α (3 σ slack)."""
    p0 = _calibrated(random.Random(3), 0.62, 300)
    rng = np.random.default_rng(5)
    worst = -math.inf
    for _ in range(40):
        state = AuditState(rule=V2)
        for up in rng.binomial(6, 0.62, size=500).tolist():
            state.observe(twins(up, 6 - up), p0)
            assert state.flag(1e-6, p0) is None
            worst = max(worst, state.log_e_value())
    assert worst < math.log(1e3), worst
    alpha, n, flagged = 0.05, 300, 0
    at = {UP_EVENT: 0.62, **{e: 1.0 for e in EVENTS}}  # only the twin test bets
    for _ in range(n):
        state = AuditState(rule=V2)
        for up in rng.binomial(4, 0.62, size=100).tolist():
            state.observe(twins(up, 4 - up), at)
            if state.flag(alpha, at) is not None:
                flagged += 1
                break
    assert flagged <= alpha * n + 3 * math.sqrt(alpha * (1 - alpha) * n)


def test_v2_evidence_recomputes_and_the_baseline_keeps_twins_for_the_whole_run() -> None:
    """``replay_evidence`` under ``eprocess-v2`` recomputes the live state and flag; the state's JSON keeps
    its rule (a state written before rules were recorded reads as v1); the baseline's rate events slide
    with the window while its twin counts pool every calibrated step."""
    b = Baseline(1e-6, window_steps=2)
    for step in range(5):
        b.add(step, twins(6, 4, diverged=12))
    assert sorted(b.by_step) == [3, 4] and b.twins == (30, 50, 50) and b.decisive() == 50
    p0 = b.bounds()
    assert 0.6 < p0[UP_EVENT] < 1.0
    rows = [(twins(5, 0), p0) for _ in range(40)]
    live, first = AuditState(rule=V2), None
    for s, bounds in rows:
        live.observe(s, bounds)
        first = first or live.flag(1e-6, bounds)
    again, flag = replay_evidence(rows, 1e-6, V2)
    assert first is not None and flag == first and again.log_wealth == live.log_wealth
    assert replay_evidence(rows, 1e-6)[1] is None  # under v1 the same verdicts are no evidence
    back = AuditState.from_json(live.to_json())
    assert back.rule == V2 and back.log_e_value() == live.log_e_value()
    legacy = live.to_json()
    del legacy["rule"]
    assert AuditState.from_json(legacy).rule == AUDIT_RULE_EPROCESS


def test_the_new_rule_and_field_leave_old_run_ids_alone() -> None:
    """``audit.min_calibration_decisive`` is hashed only off its default: a v1 spec keeps its run ID."""
    from protocol.identity import NodeKey

    coord = NodeKey.from_seed(b"c" * 32).peer_id
    v1 = RunSpec(run=RunInfo(coordinator=coord), audit=AuditSpec(rule="eprocess-v1"))
    assert b"min_calibration_decisive" not in v1.canonical_bytes() and b"twin_share" not in v1.canonical_bytes()
    v2 = RunSpec(run=RunInfo(coordinator=coord), audit=AuditSpec(rule="eprocess-v2"))
    assert v2.run_id != v1.run_id
    assert RunSpec(run=RunInfo(coordinator=coord), audit=AuditSpec(rule="eprocess-v2", min_calibration_decisive=5)).run_id != v2.run_id
    assert RunSpec(run=RunInfo(coordinator=coord), audit=AuditSpec(rule="eprocess-v2", twin_share=0.5)).run_id != v2.run_id
    with pytest.raises(ValueError):
        AuditSpec(rule="eprocess-v2", twin_share=0.0)


def test_a_steerer_balancing_its_up_share_with_sabotaged_rollouts_is_flagged_by_its_up_rate() -> None:
    """Red team a33b's balancing controller: it keeps its up-share under the calibrated bound by steering some
    rollouts to fail (downs it makes on purpose), and its token rates under theirs. Deliberate downs do not
    lower its ups per decided twin, which honest work keeps near the calibration's (35 of 559 there): the
    ``up_rate`` event flags it within a few dozen verdicts, naming that event; honest workers at the
    calibration's own up rate and share are not flagged over many verdicts."""
    from protocol.audit import UP_RATE_EVENT

    b = Baseline(1e-6, 16)
    b.add(0, ReplayStats(tokens=200_000, differ=3000, gap_over=[300, 200, 100, 50, 10], chunks=4000, rollouts=64_000, diverged=600,
                         decided=559, up=35, down=29))
    p0 = b.bounds()
    balancing = ReplayStats(tokens=1000, differ=8, gap_over=[0] * 5, chunks=32, rollouts=64, diverged=8, decided=8, up=3, down=1)
    assert balancing.up / (balancing.up + balancing.down) < p0[UP_EVENT]  # its up-share is within the honest bound
    state, flag = replay_evidence([(balancing, p0)] * 40, 1e-6, V2)
    assert flag is not None and flag.event == UP_RATE_EVENT and flag.verdicts <= 20, flag
    rng = np.random.default_rng(5)
    for _ in range(40):
        honest = AuditState(rule=V2)
        for _ in range(200):
            decided = int(rng.integers(0, 4))
            up = int(rng.binomial(decided, 35 / 559))
            down = int(rng.binomial(decided - up, 29 / 524))
            honest.observe(ReplayStats(tokens=1000, differ=8, gap_over=[1, 0, 0, 0, 0], chunks=32, rollouts=64, diverged=8,
                                       decided=decided, up=up, down=down), p0)
        assert honest.flag(1e-6, p0) is None, honest.log_e_value()
