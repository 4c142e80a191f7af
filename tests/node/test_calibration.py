"""The coordinator's audit calibration: honest reference submissions in the run's worker dtype, checked
by the validators' pipeline, fill the baseline (a burst at the first step until the audit may flag)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.coordinator.base import EMBEDDED_BASE_DIR
from node.coordinator.calibrate import AuditCalibration, worker_engine
from node.devnet.config import EMBEDDED_RL, EMBEDDED_SAMPLING
from node.worker.rollouts import build_submission
from protocol.audit import rate_upper_bound
from protocol.dataset import resolve_tasks
from protocol.identity import NodeKey
from protocol.models import load_model, load_tokenizer
from protocol.runspec import AuditSpec, DataSpec, ModelSpec, RunInfo, RunSpec, ToplocSpec
from trainer.ledger.audit import WorkerAudit

COORD = NodeKey.from_seed(b"c" * 32)


def spec(audit: AuditSpec) -> RunSpec:
    toploc = ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=2.0, worker_dtype="bfloat16", fp32_logits=True,
                        logprob_max_abs=3.0, logprob_mean_abs=1.0, max_mant_err_mean=20.0, max_mant_err_median=16.0,
                        max_near_tie_fraction=0.2)
    return RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=2), model=ModelSpec(hidden_size=128, dtype="bfloat16"),
                   data=DataSpec(tasks_per_submission=2), sampling=EMBEDDED_SAMPLING, rl=EMBEDDED_RL, toploc=toploc, audit=audit)


@pytest.mark.slow
def test_calibration_fills_the_baseline_with_honest_bf16_reference_submissions(tmp_path: Path) -> None:
    s = spec(AuditSpec(rule="eprocess-v1", calibration_submissions=1, min_calibration_tokens=600))
    audit = WorkerAudit(s.audit, tmp_path / "audit.sqlite")
    tok = load_tokenizer(EMBEDDED_BASE_DIR)
    policy = load_model(EMBEDDED_BASE_DIR)
    cal = AuditCalibration(s, s.run_id, resolve_tasks("embedded").train, lambda: tok, lambda step: EMBEDDED_BASE_DIR,
                           lambda step: policy, audit)
    assert cal.enabled and not audit.ready()
    first = cal.calibrate(0)
    assert first > 1 and audit.ready() and audit.baseline.tokens() >= 600  # the burst: more than the step's share, until ready
    assert cal.outcomes["ok"] == sum(cal.outcomes.values())  # honest reference work passes the run's own tolerances
    second = cal.calibrate(1)
    assert second == 1 and sorted(audit.baseline.by_step) == [0, 1]
    bounds = audit.baseline.bounds()
    assert 0 < bounds["gap_over_4"] < bounds["differ"] < 1
    assert cal.status() == {"steps": 2, "submissions": first + second, "by_reason": dict(cal.outcomes), "by_batch": {"64": first + second}}
    # the reference engine computes as the spec says honest workers do: bf16 with float32 logits
    engine = worker_engine(s, EMBEDDED_BASE_DIR)
    assert str(engine.compute_dtype) == "torch.bfloat16" and engine.head_fp32 is not None
    audit.close()


@pytest.mark.slow
def test_eprocess_v2_calibration_also_counts_twins_until_it_holds_decisive_ones(tmp_path: Path) -> None:
    """Under ``eprocess-v2`` the reference submissions carry twin counts (validators' pipeline), and the first
    calibrated step keeps making them until the baseline holds ``audit.min_calibration_decisive`` decisive
    twins (the rate baseline alone would be ready sooner); later steps make their share only."""
    s = spec(AuditSpec(rule="eprocess-v2", calibration_submissions=1, min_calibration_tokens=100, min_calibration_decisive=3))
    audit = WorkerAudit(s.audit, tmp_path / "audit.sqlite")
    tok = load_tokenizer(EMBEDDED_BASE_DIR)
    policy = load_model(EMBEDDED_BASE_DIR)
    cal = AuditCalibration(s, s.run_id, resolve_tasks("embedded").train, lambda: tok, lambda step: EMBEDDED_BASE_DIR,
                           lambda step: policy, audit)
    cal.key = NodeKey.from_seed(b"r" * 32)  # the reference identity fixed: the same tasks and seeds every run
    assert audit.wants_decisive()
    first = cal.calibrate(0)
    assert first > 1 and audit.ready() and audit.baseline.decisive() >= 3 and not audit.wants_decisive(), (first, audit.baseline.twins)
    up, decisive, _ = audit.baseline.twins  # the up-share's bound is the Chernoff bound of the reference twins (1 if all were up)
    assert audit.baseline.bounds()["up"] == rate_upper_bound(up, decisive, s.audit.baseline_confidence)
    assert cal.calibrate(1) == 1
    audit.close()


@pytest.mark.slow
def test_calibration_round_robins_over_the_configured_decode_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #33: with ``audit.calibration_batches = [1, 8]`` the reference submissions alternate between an engine of
    ``max_batch`` 1 and one of 8 (sharing one load of the step's weights), each counted into its own configuration;
    the burst goes on until *every* configuration holds ``audit.min_calibration_tokens``."""
    import node.coordinator.calibrate as calibrate_mod

    used: list[int] = []
    loads: list[int] = []
    models: set[int] = set()

    def recording_build(spec, run_id, key, engine, *args, **kwargs):
        used.append(engine.max_batch)
        models.add(id(engine.model))
        return build_submission(spec, run_id, key, engine, *args, **kwargs)

    def recording_engine(*args, **kwargs):
        loads.append(1)
        return worker_engine(*args, **kwargs)

    monkeypatch.setattr(calibrate_mod, "build_submission", recording_build)
    monkeypatch.setattr(calibrate_mod, "worker_engine", recording_engine)
    s = spec(AuditSpec(rule="eprocess-v1", calibration_submissions=1, min_calibration_tokens=300, calibration_batches=[1, 8]))
    audit = WorkerAudit(s.audit, tmp_path / "audit.sqlite")
    tok = load_tokenizer(EMBEDDED_BASE_DIR)
    policy = load_model(EMBEDDED_BASE_DIR)
    cal = AuditCalibration(s, s.run_id, resolve_tasks("embedded").train, lambda: tok, lambda step: EMBEDDED_BASE_DIR,
                           lambda step: policy, audit)
    first = cal.calibrate(0)
    assert used[:4] == [1, 8, 1, 8] and len(loads) == 1 and len(models) == 1  # alternating; one load of the weights per step
    tokens = audit.baseline.tokens_by_config()
    assert audit.ready() and min(tokens.values()) >= 300 and set(tokens) == {1, 8}, tokens
    assert abs(cal.by_batch[1] - cal.by_batch[8]) <= 1 and cal.by_batch[1] + cal.by_batch[8] == first == len(used)
    assert cal.calibrate(1) == 1 and used[-1] == (1, 8)[first % 2] and len(loads) == 2  # the round-robin goes on across steps
    assert cal.status()["by_batch"] == {"1": cal.by_batch[1], "8": cal.by_batch[8]}
    audit.close()


@pytest.mark.slow
def test_the_burst_cap_is_per_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode configuration must reach ``audit.min_calibration_tokens`` on its own, so the first step's burst may make
    ``MAX_BURST_SUBMISSIONS`` per configuration (a shared cap left the devnet's three batch sizes short of ready, and no
    step trains before the baseline is ready)."""
    import node.coordinator.calibrate as calibrate_mod

    monkeypatch.setattr(calibrate_mod, "MAX_BURST_SUBMISSIONS", 2)
    s = spec(AuditSpec(rule="eprocess-v1", calibration_submissions=1, min_calibration_tokens=1 << 20, calibration_batches=[8, 64]))
    audit = WorkerAudit(s.audit, tmp_path / "audit.sqlite")
    tok = load_tokenizer(EMBEDDED_BASE_DIR)
    policy = load_model(EMBEDDED_BASE_DIR)
    cal = AuditCalibration(s, s.run_id, resolve_tasks("embedded").train, lambda: tok, lambda step: EMBEDDED_BASE_DIR,
                           lambda step: policy, audit)
    cal.calibrate(0)
    assert dict(cal.by_batch) == {8: 2, 64: 2} and not audit.ready()
    audit.close()


def test_no_calibration_without_the_audit(tmp_path: Path) -> None:
    s = spec(AuditSpec())
    audit = WorkerAudit(s.audit, tmp_path / "audit.sqlite")
    cal = AuditCalibration(s, s.run_id, [], lambda: None, lambda step: None, lambda step: None, audit)
    cal.published(0)  # nothing to do: no thread is started
    assert not cal.enabled and cal._thread is None
    cal.close()
    audit.close()
