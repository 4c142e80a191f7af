"""How a precision measurement becomes a run spec's tolerances (``node.precision.PrecisionMeasurement.toploc``):
δ is three times the worst honest gap, but never below the bf16 floor for bf16 workers, whose honest tail a
measurement of a few dozen submissions sees only by chance (red team h41b: δ drew 0.47–4.0 in ten
measurements, and an honest 1.7-nat error beyond 2δ is a ``sampling`` rejection, a cheat reason)."""

from __future__ import annotations

import pytest

from node.precision import BF16_DELTA_FLOOR, FLOORS, PrecisionMeasurement
from protocol.runspec import LOGIT_BOUND_LIMIT, ToplocSpec


def measured(dtype: str, gap: float) -> PrecisionMeasurement:
    m = PrecisionMeasurement(dtype, fp32_logits=dtype == "bfloat16", submissions=24, rollouts=1536, tokens=6000)
    m.extremes["gap"] = gap
    return m


@pytest.mark.parametrize(("dtype", "gap", "delta"), [
    ("bfloat16", 0.156, BF16_DELTA_FLOOR),  # the lowest draw: 3 × 0.156 = 0.47 would put the honest 1.7-nat context beyond 2δ
    ("bfloat16", 0.5, 1.5),  # above the floor: three times the worst gap
    ("bfloat16", 1.661, LOGIT_BOUND_LIMIT),  # the highest draw: capped
    ("float32", 0.01, FLOORS["gap"]),  # float32 workers keep their own floor
    ("float32", 0.05, 0.15),
])
def test_delta_is_three_times_the_worst_gap_within_the_dtypes_floor_and_the_cap(dtype: str, gap: float, delta: float) -> None:
    m = measured(dtype, gap)
    spec = m.toploc(ToplocSpec(), temperature=1.0)
    assert spec.replay_logit_bound == pytest.approx(delta, abs=1e-4)
    assert spec.replay_rule == "logit-bound-v3" and spec.worker_dtype == dtype
    floor_line = [line for line in m.lines(spec) if "the bf16 floor" in line]
    assert bool(floor_line) == (delta == BF16_DELTA_FLOOR and dtype == "bfloat16")


def test_at_the_bf16_floor_an_honest_error_of_the_measured_tail_is_never_beyond_the_hard_factor() -> None:
    """The honest bf16 errors measured (1.72 nats on the embedded base, up to 1.99 in issue #33) stay within
    ``hard_factor`` × δ, where beyond δ they are benign ``precision`` findings, not cheats."""
    spec = measured("bfloat16", 0.156).toploc(ToplocSpec(), temperature=1.0)
    assert spec.hard_factor * spec.replay_logit_bound > 1.99
