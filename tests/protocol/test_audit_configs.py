"""The baseline's decode configurations (``audit.calibration_batches``, issue #33): honest replay statistics
depend on the decode batch size, so each configuration is calibrated apart and each event's bound is the
largest of theirs (``protocol/audit.py``'s :class:`~protocol.audit.Baseline`, ``docs/toploc.md`` §11.1)."""

from __future__ import annotations

import hashlib

import pytest

from protocol import encoding
from protocol.audit import EVENTS, UP_EVENT, UP_RATE_EVENT, Baseline, rate_upper_bound
from protocol.identity import NodeKey
from protocol.messages import ReplayStats
from protocol.runspec import (
    CALIBRATION_BATCHES_DEFAULT,
    RUN_ID_DOMAIN,
    AuditSpec,
    RunInfo,
    RunSpec,
    RunSpecError,
    dump_run_spec,
    parse_run_spec,
    sign_run_spec,
)

COORD = NodeKey.from_seed(b"c" * 32)


def stats(tokens: int, differ: int = 0, chunks_over: int = 0, chunks: int = 10, up: int = 0, down: int = 0) -> ReplayStats:
    d = up + down
    return ReplayStats(tokens=tokens, differ=max(differ, d), gap_over=[max(differ, d), 0, 0, 0, 0], chunks=chunks, chunks_over=chunks_over,
                       rollouts=d, diverged=d, up=up, down=down, decided=d)


def test_one_configurations_higher_rate_raises_the_bound_to_its_own() -> None:
    """A batch-1 configuration whose ``chunks_over`` rate the batch-64 one never shows sets that event's bound:
    the max over configurations, not the pooled rate (pooling would dilute batch 1's rate with batch 64's)."""
    b = Baseline(1e-6, 16, (1, 64))
    for step in range(4):
        b.add(step, stats(5000, differ=5, chunks_over=0, chunks=400), config=64)
        b.add(step, stats(5000, differ=5, chunks_over=12, chunks=400), config=1)
    bounds = b.bounds()
    alone = b.per_config[64].bounds(1e-6)
    assert bounds["chunks_over"] == rate_upper_bound(48, 1600, 1e-6) > alone["chunks_over"]
    pooled = rate_upper_bound(48, 3200, 1e-6)
    assert bounds["chunks_over"] > pooled  # pooling both would have bounded batch 1's rate too tightly
    assert bounds["differ"] == rate_upper_bound(20, 20_000, 1e-6)  # equal rates: the bound of either
    assert b.tokens_by_config() == {1: 20_000, 64: 20_000} and b.tokens() == 20_000


def test_a_configuration_without_data_keeps_every_bound_at_one() -> None:
    """Until every configuration has measured an event its bound is 1 (nothing is bet on it); :meth:`tokens` is the
    fewest any configuration holds, so the ledger's readiness waits for all of them."""
    b = Baseline(1e-6, 16, (1, 8, 64))
    b.add(0, stats(50_000, differ=10, chunks_over=1, up=3, down=3), config=64)
    b.add(0, stats(50_000, differ=10, chunks_over=1, up=3, down=3), config=8)
    assert all(v == 1.0 for v in b.bounds().values())
    assert b.tokens() == 0 and b.decisive() == 0 and b.tokens_by_config() == {1: 0, 8: 50_000, 64: 50_000}
    b.add(0, stats(50_000, differ=10, chunks_over=1, up=3, down=3), config=1)
    assert all(v < 1.0 for k, v in b.bounds().items() if k in EVENTS) and b.tokens() == 50_000
    assert b.bounds()[UP_EVENT] == rate_upper_bound(3, 6, 1e-6) and b.bounds()[UP_RATE_EVENT] == rate_upper_bound(3, 6, 1e-6)
    assert b.twins == (9, 18, 18) and sorted(b.by_step) == [0] and b.by_step[0]["differ"] == (30, 150_000)


def test_twin_bounds_are_the_largest_over_configurations_and_config_is_checked() -> None:
    b = Baseline(1e-6, 16, (8, 64))
    for _ in range(10):
        b.add(0, stats(1000, up=6, down=4), config=8)
        b.add(0, stats(1000, up=4, down=6), config=64)
    assert b.bounds()[UP_EVENT] == rate_upper_bound(60, 100, 1e-6) and b.decisive_by_config() == {8: 100, 64: 100}
    with pytest.raises(ValueError, match="needs the submission's config"):
        b.add(0, stats(10))
    with pytest.raises(ValueError, match="decode configuration 1 is not calibrated"):
        b.add(0, stats(10), config=1)
    one = Baseline(1e-6, 16)  # the default: the one batch-64 configuration, config optional
    one.add(0, stats(10))
    assert one.configs == CALIBRATION_BATCHES_DEFAULT == (64,) and one.tokens_by_config() == {64: 10}


def test_each_configuration_keeps_its_own_newest_steps() -> None:
    """The window is per configuration: a configuration calibrated at older steps (round-robin with few
    submissions per step) keeps its own newest ``window_steps`` steps."""
    b = Baseline(1e-6, 2, (1, 64))
    for step in range(6):
        b.add(step, stats(100, differ=1), config=64 if step % 3 else 1)
    assert sorted(b.per_config[1].by_step) == [0, 3] and sorted(b.per_config[64].by_step) == [4, 5]


def test_calibration_batches_default_keeps_old_run_ids_and_new_values_are_another_run() -> None:
    """``audit.calibration_batches`` is hashed only off its default ``[64]``: a spec signed before the field keeps its
    run ID (its content hashed without the field); a spec naming ``[1, 8, 64]`` is another run and round-trips."""
    audit = AuditSpec(rule="eprocess-v2")
    signed = sign_run_spec(RunSpec(run=RunInfo(coordinator=COORD.peer_id), audit=audit), COORD)
    assert b"calibration_batches" not in signed.spec.canonical_bytes()
    content = signed.spec.model_dump(mode="python")
    del content["audit"]["calibration_batches"], content["artifacts"], content["env"]
    for name in ("min_calibration_decisive", "twin_share"):
        del content["audit"][name]
    for name in ("replay_rule", "replay_logit_bound", "eos_prob_slack", "worker_dtype", "fp32_logits", "hard_factor"):
        del content["toploc"][name]
    assert hashlib.sha256(RUN_ID_DOMAIN + encoding.packb(content)).digest() == signed.run_id
    text = dump_run_spec(signed)
    before = text.replace("calibration_batches = [\n    64,\n]\n", "").replace("calibration_batches = [64]\n", "")
    assert "calibration_batches" not in before
    old = parse_run_spec(before[: before.index("[signature]")], require_signature=False).spec
    assert old.run_id == signed.run_id and old.audit.calibration_batches == (64,)
    multi = sign_run_spec(RunSpec(run=RunInfo(coordinator=COORD.peer_id), audit=AuditSpec(rule="eprocess-v2", calibration_batches=[1, 8, 64])),
                          COORD)
    assert multi.run_id != signed.run_id and parse_run_spec(dump_run_spec(multi)).spec.audit.calibration_batches == (1, 8, 64)


@pytest.mark.parametrize("value", ["[8, 1]", "[1, 1]", "[0]", "[2048]", "[]", "[1, 2, 3, 4, 5, 6, 7, 8, 9]", '"64"'])
def test_bad_calibration_batches_are_refused_naming_the_field(value: str) -> None:
    signed = sign_run_spec(RunSpec(run=RunInfo(coordinator=COORD.peer_id), audit=AuditSpec(rule="eprocess-v2", calibration_batches=[1, 8, 64])),
                           COORD)
    text = dump_run_spec(signed)
    unsigned = text[: text.index("[signature]")]
    import re

    bad = re.sub(r"calibration_batches = \[[^\]]*\]", f"calibration_batches = {value}", unsigned)
    assert bad != unsigned
    with pytest.raises(RunSpecError, match=r"^run spec field audit\.calibration_batches"):
        parse_run_spec(bad, require_signature=False)
