"""Judging a reported reward (``validator/rewards.py``): the re-run rule and its time budget, on the module's
clock seam (``validator.rewards._clock``), so no test sleeps."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import validator.rewards as vr
from protocol.rewards import RewardResult

FAIL = RewardResult(task_reward=0.0, reward=0.0, detail="test 1 failed", outcome="f" * 64)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(vr, "_clock", lambda: c.now_s)
    return c


def program(clock: Clock, durations_s: Callable[[int], float], result: RewardResult = FAIL) -> tuple[Callable[[], RewardResult], list[int]]:
    """A scorer whose n-th run takes ``durations_s(n)`` seconds of the clock and gives ``result`` every time."""
    runs: list[int] = []

    def score() -> RewardResult:
        clock.now_s += durations_s(len(runs))
        runs.append(1)
        return result

    return score, runs


@pytest.mark.parametrize("run_s, runs, reason", [
    (59.0, 2, "limit_hit"),  # old code: 3 runs, 177 s: first + the 60 s budget + one more whole run
    (7.0, 9, "limit_hit"),  # 8 re-runs (56 s) fit, a 9th would end at 63 s
    (6.0, 10, "reward"),  # 9 re-runs in 54 s: the disagreement reproduced every time, a cheat
    (0.5, 10, "reward"),
])
def test_reruns_end_within_the_budget_after_the_first_run(clock: Clock, run_s: float, runs: int, reason: str) -> None:
    """A deterministic false reward (the worker reports a pass, every run fails alike) is re-run only while the
    next run, taking as long as the longest so far, fits in the budget; cut short it is the benign ``limit_hit``,
    never the cheat ``reward`` (too little evidence: docs/validator.md "Rewards that do not reproduce")."""
    score, done = program(clock, lambda _: run_s)
    start_s = clock.now_s
    judged = vr.judge_reward(score, 1.0, 1.0, reward_tol=1e-6, budget_s=60.0)
    assert (judged.reason, judged.runs, len(done)) == (reason, runs, runs)
    assert clock.now_s - start_s <= run_s + 60.0
    if reason == "limit_hit":
        assert "would not fit" in judged.detail


def test_a_slower_later_run_counts_for_the_next_prediction(clock: Clock) -> None:
    """The prediction is the longest run so far, not the first: 1 s, then 25 s runs under 60 s stop after two re-runs."""
    score, done = program(clock, lambda n: 1.0 if n == 0 else 25.0)
    judged = vr.judge_reward(score, 1.0, 1.0, reward_tol=1e-6, budget_s=60.0)
    assert (judged.reason, len(done)) == ("limit_hit", 3)  # re-runs: 0 + 1 ≤ 60, 25 + 25 ≤ 60, 50 + 25 > 60


@pytest.mark.parametrize("durations_s", [
    [0.01, 59.9],  # a fast first run, then a slow one: started on the first's prediction
    [6.6] * 9 + [59.9],  # nine short runs fill the budget's prediction, the tenth is near the wall limit
    [1.0, 25.0, 30.0, 59.9],
    [30.0, 29.9, 59.9],
])
def test_a_rerun_slower_than_every_earlier_one_overruns_by_at_most_one_run(clock: Clock, durations_s: list[float]) -> None:
    """A run is stopped only by its sandbox (here ≤ 60 s), never by the re-run budget: a re-run slower than all
    before it ends past the budget, by at most one run, so one judgement costs at most ``budget_s`` + one
    sandbox limit (120 s in the pipeline) — the bound ``validator/pipeline.py`` adds to a submission's reward budget."""
    score, done = program(clock, lambda n: durations_s[min(n, len(durations_s) - 1)])
    start_s = clock.now_s
    vr.judge_reward(score, 1.0, 1.0, reward_tol=1e-6, budget_s=60.0)
    total_s = clock.now_s - start_s
    assert total_s <= 60.0 + max(durations_s[: len(done)]) + 1e-9, (total_s, len(done))
    assert total_s <= 120.0


def test_a_run_that_differs_is_nondeterministic_whatever_the_budget(clock: Clock) -> None:
    other = RewardResult(task_reward=0.0, reward=0.0, detail="test 2 failed", outcome="e" * 64)
    results = [FAIL, FAIL, other]

    def score() -> RewardResult:
        clock.now_s += 1.0
        return results.pop(0)

    judged = vr.judge_reward(score, 1.0, 1.0, reward_tol=1e-6, budget_s=60.0)
    assert (judged.reason, judged.runs) == ("nondeterministic", 3)
