"""The coordinator's per-worker audit in the ledger: verdicts' replay statistics are counted, a worker
whose statistics are beyond honest compute's is banned with reason ``audit`` and its untrained work
withdrawn, an honest one is not, nothing is flagged before the baseline is measured, and the state
and evidence survive a restart."""

from __future__ import annotations

import json

from protocol.audit import replay_evidence
from protocol.envelope import open_envelope, seal
from protocol.identity import NodeKey
from protocol.messages import ReplayStats, Rollout, Submission, SubmissionTask, Verdict
from protocol.runspec import AuditSpec, RunInfo, RunSpec
from protocol.verdicts import AUDIT_BAN_REASON
from trainer.ingest.service import open_ingest
from trainer.ledger import State

COORD = NodeKey.from_seed(b"c" * 32)
VALIDATOR = NodeKey.from_seed(b"v" * 32)
SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id], seed=1),
               audit=AuditSpec(rule="eprocess-v1", min_calibration_tokens=10_000))
RUN = SPEC.run_id


def submission(worker: NodeKey, counter: int, lengths: tuple[int, ...] = (200,)) -> bytes:
    """A submission of one rollout per entry of ``lengths`` (completion tokens): the verdicts below claim
    replay statistics of 200 tokens, which must be those of the submission held."""
    rollouts = [Rollout(task=0, sample=0, seed=1, prompt_ids=b"\x01\x00\x00\x00", completion_ids=b"\x02\x00\x00\x00" * n,
                        logprobs=b"\x00\x00\x00\x00" * n, finish="length", task_reward=0.0, reward=0.0, proofs=[b"\x00" * 258])
                for n in lengths]
    body = Submission(worker=worker.peer_id, policy_step=0, counter=counter, tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)],
                      rollouts=rollouts)
    return seal(worker, RUN, body)


V2_LENGTHS = (4,) * 8 + (3,) * 56
"""64 rollouts of 200 completion tokens in all, one TOPLOC chunk each (the eprocess-v2 verdicts below count 64 rollouts)."""


def verdict(sub: bytes, stats: ReplayStats, accepted: bool = True, reason: str = "ok") -> bytes:
    env = open_envelope(sub, run_id=RUN, expect=Submission)
    return seal(VALIDATOR, RUN, Verdict(submission_id=env.id, worker=env.body.worker, policy_step=0, counter=env.body.counter,
                                        accepted=accepted, reason=reason, stats=stats))


HONEST = ReplayStats(tokens=200, differ=1, gap_over=[0, 0, 0, 0, 0], chunks=7)
STEERED = ReplayStats(tokens=200, differ=40, gap_over=[40, 38, 30, 18, 0], chunks=7)


def submit_until_banned(service, worker: NodeKey, limit: int, run: bytes, make_submission, make_verdict) -> list[str]:
    """Up to ``limit`` submissions of ``worker``, each stored and given its verdict, until the ledger bans it;
    returns their IDs (hex)."""
    held = []
    for i in range(limit):
        sub = make_submission(worker, i)
        env = open_envelope(sub, run_id=run, expect=Submission)
        assert service.ledger.store.add(env)
        held.append(env.id.hex())
        service.apply_verdict(make_verdict(sub))
        if service.ledger.bans.is_banned(worker.peer_id):
            break
    return held


def open_coordinator(root):
    return open_ingest(root, SPEC, COORD, trainer_step=lambda: 0, latest_policy_step=lambda: 0)


def calibrate(service, tokens: int) -> None:
    for step in range(tokens // 2000):
        service.ban_rule.audit.calibrate(step, ReplayStats(tokens=2000, differ=6, gap_over=[1, 0, 0, 0, 0], chunks=80))


def test_a_steering_worker_is_banned_by_the_audit_and_its_untrained_work_withdrawn(tmp_path) -> None:
    service = open_coordinator(tmp_path)
    ledger, audit = service.ledger, service.ban_rule.audit
    honest, steerer = NodeKey.generate(), NodeKey.generate()
    calibrate(service, 20_000)
    assert audit.ready()
    for counter in range(30):  # honest work: never flagged
        sub = submission(honest, counter)
        assert ledger.store.add(open_envelope(sub, run_id=RUN, expect=Submission))
        assert service.apply_verdict(verdict(sub, HONEST))
    assert not ledger.bans.is_banned(honest.peer_id)
    # the steerer's accepted work waits untrained; its next is still pending
    held = submit_until_banned(service, steerer, 30, RUN, submission, lambda sub: verdict(sub, STEERED))
    assert ledger.bans.is_banned(steerer.peer_id), audit.status()
    entry = next(e for e in ledger.bans.entries() if e.peer_id == steerer.peer_id)
    assert entry.reason == AUDIT_BAN_REASON and entry.evidence[0].by == COORD.peer_id and "e-value" in entry.evidence[0].detail
    flagged_after = len(held)
    assert flagged_after <= 5  # 40 of 200 tokens beyond a quarter of the bound: a few verdicts
    states = {ledger.get(sid).state for sid in held}
    assert states == {State.REJECTED}  # withdrawn: no step trained them
    assert "accepted" not in ledger.store.worker_stats()[steerer.peer_id]  # non-zero counts only
    # the evidence recomputes the flag
    rows = audit.evidence(steerer.peer_id)
    assert len(rows) == flagged_after and rows[-1]["verdict_id"] == entry.verdict_id.hex()
    _, flag = replay_evidence([(ReplayStats.model_validate(r["stats"]), r["bounds"]) for r in rows], SPEC.audit.false_alarm)
    assert flag is not None and flag.detail() == entry.evidence[0].detail
    status = service.status()["audit"]
    assert status["ready"] and status["workers"][steerer.peer_id]["flagged"] and not status["workers"][honest.peer_id]["flagged"]
    service.close()
    ledger.close()
    # a restarted coordinator keeps the baseline, the states and the flag
    again = open_coordinator(tmp_path)
    assert again.ban_rule.audit.ready() and again.ban_rule.audit.flagged(steerer.peer_id) is not None
    assert len(again.ban_rule.audit.evidence(honest.peer_id)) == 30
    again.close()
    again.ledger.close()


def test_verdicts_before_the_baseline_is_measured_are_kept_and_counted_once_it_is(tmp_path) -> None:
    """Below ``audit.min_calibration_tokens`` of calibration the audit flags no one and bets nothing;
    the verdicts are kept, and the worker's next verdict once the baseline is ready counts them all,
    in order, against the bounds then (the bounds come from the coordinator's reference work, not the
    worker's, so counting them late keeps the guarantee); the rule ``none`` counts nothing."""
    service = open_coordinator(tmp_path)
    calibrate(service, 4000)
    w = NodeKey.generate()
    subs = [submission(w, i) for i in range(21)]
    for sub in subs:
        assert service.ledger.store.add(open_envelope(sub, run_id=RUN, expect=Submission))
    for sub in subs[:20]:
        service.apply_verdict(verdict(sub, STEERED))
    audit = service.ban_rule.audit
    assert not service.ledger.bans.is_banned(w.peer_id) and not audit.ready() and audit.evidence(w.peer_id) == []
    calibrate(service, 20_000)
    service.apply_verdict(verdict(subs[20], STEERED))
    assert service.ledger.bans.is_banned(w.peer_id)
    rows = audit.evidence(w.peer_id)
    assert len(rows) == 21 and [r["seq"] for r in rows] == list(range(1, 22)) and len({json.dumps(r["bounds"]) for r in rows}) == 1
    _, flag = replay_evidence([(ReplayStats.model_validate(r["stats"]), r["bounds"]) for r in rows], SPEC.audit.false_alarm)
    entry = next(e for e in service.ledger.bans.entries() if e.peer_id == w.peer_id)
    assert flag is not None and flag.detail() == entry.evidence[0].detail and flag.verdicts < 21  # flagged within the kept ones
    service.close()
    service.ledger.close()
    off = open_ingest(tmp_path / "off", RunSpec(run=SPEC.run), COORD, trainer_step=lambda: 0, latest_policy_step=lambda: 0)
    assert off.ban_rule.audit.observe(w.peer_id, STEERED, "00", "00") is None and off.status()["audit"] is None
    off.close()
    off.ledger.close()


def test_a_worker_whose_work_all_came_before_the_baseline_is_judged_before_any_step_trains(tmp_path) -> None:
    """The red team's case: every verdict of a steerer arrived while the baseline was not ready (kept,
    not counted) and it sends nothing more. ``audit_catch_up`` (the coordinator calls it before every
    batch, and trains nothing before the baseline is ready) counts the kept verdicts once it is: the
    steerer is banned and its accepted work withdrawn, an honest worker's kept work stays accepted."""
    service = open_coordinator(tmp_path)
    ledger, audit = service.ledger, service.ban_rule.audit
    steerer, honest = NodeKey.generate(), NodeKey.generate()
    held: dict[str, list[str]] = {steerer.peer_id: [], honest.peer_id: []}
    for key, stats in ((steerer, STEERED), (honest, HONEST)):
        for i in range(10):
            sub = submission(key, i)
            env = open_envelope(sub, run_id=RUN, expect=Submission)
            assert ledger.store.add(env)
            held[key.peer_id].append(env.id.hex())
            service.apply_verdict(verdict(sub, stats))
    assert service.ban_rule.audit_catch_up() == 0  # not ready: nothing counted, nobody banned
    assert not ledger.bans.is_banned(steerer.peer_id) and {ledger.get(s).state for s in held[steerer.peer_id]} == {State.ACCEPTED}
    calibrate(service, 20_000)
    assert audit.ready()
    assert service.ban_rule.audit_catch_up() == 1
    assert ledger.bans.is_banned(steerer.peer_id) and not ledger.bans.is_banned(honest.peer_id)
    entry = next(e for e in ledger.bans.entries() if e.peer_id == steerer.peer_id)
    assert entry.reason == AUDIT_BAN_REASON and "e-value" in entry.evidence[0].detail
    assert {ledger.get(s).state for s in held[steerer.peer_id]} == {State.REJECTED}  # withdrawn before any step
    assert {ledger.get(s).state for s in held[honest.peer_id]} == {State.ACCEPTED}
    assert len(audit.evidence(honest.peer_id)) == 10 and audit.evidence(steerer.peer_id)
    assert service.ban_rule.audit_catch_up() == 0  # counted once
    service.close()
    ledger.close()


V2_SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id], seed=1),
                  audit=AuditSpec(rule="eprocess-v2", min_calibration_tokens=10_000))
REFERENCE_V2 = ReplayStats(tokens=2000, differ=40, gap_over=[4, 2, 1, 0, 0], chunks=80, rollouts=640, diverged=32, decided=8, up=5, down=3)
"""Honest reference work as the red team measured it: ≈ 2 % of tokens differ, 5 % of rollouts diverge, up-share ≈ 0.6."""
RATIONED = ReplayStats(tokens=200, differ=3, gap_over=[0, 0, 0, 0, 0], chunks=64, rollouts=64, diverged=3, decided=3, up=3, down=0)
"""The rationed steerer: its rates under the honest bounds, but every decided twin loses to its completion."""


def test_eprocess_v2_bans_the_rationed_steerer_that_v1_cannot_see(tmp_path) -> None:
    """Issue 33's red-team hole, at the ledger: a steerer whose token rates stay under the honest bounds
    but whose diverged rollouts all beat their float32 twins is banned with reason ``audit`` under
    ``eprocess-v2`` (its untrained work withdrawn, the flag naming the twin event and recomputable from
    the verdicts), while ``eprocess-v1`` on the same verdicts never flags it; an honest worker with the
    calibration's own up-share is not flagged; the twin baseline survives a restart."""
    run = V2_SPEC.run_id
    service = open_ingest(tmp_path, V2_SPEC, COORD, trainer_step=lambda: 0, latest_policy_step=lambda: 0)
    ledger, audit = service.ledger, service.ban_rule.audit
    for step in range(40):  # 80,000 reference tokens, 320 decisive twins at up-share 5/8
        audit.calibrate(step, REFERENCE_V2)
    assert audit.ready() and not audit.wants_decisive() and audit.baseline.decisive() == 320

    def v2_submission(worker: NodeKey, counter: int) -> bytes:
        env = open_envelope(submission(worker, counter, V2_LENGTHS), run_id=RUN, expect=Submission)
        return seal(worker, run, env.body)

    def v2_verdict(sub: bytes, stats: ReplayStats) -> bytes:
        env = open_envelope(sub, run_id=run, expect=Submission)
        return seal(VALIDATOR, run, Verdict(submission_id=env.id, worker=env.body.worker, policy_step=0, counter=env.body.counter,
                                            accepted=True, reason="ok", stats=stats))

    honest, steerer = NodeKey.generate(), NodeKey.generate()
    honest_stats = [ReplayStats(tokens=200, differ=3, gap_over=[0] * 5, chunks=64, rollouts=64, diverged=3, decided=2, up=u, down=2 - u)
                    for u in (1, 2, 1, 1, 0, 2, 1, 2) * 10]  # up-share 0.625 over 160 decisive twins
    for counter, stats in enumerate(honest_stats):
        sub = v2_submission(honest, counter)
        assert ledger.store.add(open_envelope(sub, run_id=run, expect=Submission))
        service.apply_verdict(v2_verdict(sub, stats))
    assert not ledger.bans.is_banned(honest.peer_id), audit.status()
    held = submit_until_banned(service, steerer, 200, run, v2_submission, lambda sub: v2_verdict(sub, RATIONED))
    assert ledger.bans.is_banned(steerer.peer_id), audit.status()
    assert len(held) * RATIONED.decided <= 100  # within tens of decisive rollouts
    entry = next(e for e in ledger.bans.entries() if e.peer_id == steerer.peer_id)
    assert entry.reason == AUDIT_BAN_REASON and "e-value" in entry.evidence[0].detail and " up " in entry.evidence[0].detail
    assert {ledger.get(sid).state for sid in held} == {State.REJECTED}  # withdrawn: no step trained them
    rows = audit.evidence(steerer.peer_id)
    verdicts = [(ReplayStats.model_validate(r["stats"]), r["bounds"]) for r in rows]
    _, flag = replay_evidence(verdicts, V2_SPEC.audit.false_alarm, "eprocess-v2")
    assert flag is not None and flag.detail() == entry.evidence[0].detail
    assert replay_evidence(verdicts, V2_SPEC.audit.false_alarm)[1] is None  # eprocess-v1: the same verdicts flag nothing
    status = service.status()["audit"]
    assert status["rule"] == "eprocess-v2" and status["baseline_decisive"] == 320 and "up" in status["workers"][honest.peer_id]["rates"]
    service.close()
    ledger.close()
    again = open_ingest(tmp_path, V2_SPEC, COORD, trainer_step=lambda: 0, latest_policy_step=lambda: 0)
    assert again.ban_rule.audit.baseline.twins[:2] == (200, 320) and again.ban_rule.audit.flagged(steerer.peer_id) is not None
    again.close()
    again.ledger.close()


def test_only_accepted_verdicts_are_counted_and_an_impossible_twin_count_is_refused(tmp_path) -> None:
    """Rejected work is never trained, so its statistics are not evidence either way: a worker whose verdicts
    are ``precision`` rejections with a steerer's rates is not counted (red team a33b farmed twin downs and
    clean tokens in submissions it had rejected on purpose). A verdict claiming more decided twins than a
    validator decodes per submission is not counted."""
    from protocol.audit import TWINS_PER_SUBMISSION

    service = open_coordinator(tmp_path)
    ledger, audit = service.ledger, service.ban_rule.audit
    calibrate(service, 20_000)
    rejected, forged = NodeKey.generate(), NodeKey.generate()
    for counter in range(30):
        sub = submission(rejected, counter)
        assert ledger.store.add(open_envelope(sub, run_id=RUN, expect=Submission))
        service.apply_verdict(verdict(sub, STEERED, accepted=False, reason="precision"))
    assert not ledger.bans.is_banned(rejected.peer_id) and audit.evidence(rejected.peer_id) == []
    n = TWINS_PER_SUBMISSION + 1
    too_many = ReplayStats(tokens=200, differ=n, gap_over=[0] * 5, chunks=7, rollouts=64, diverged=n, decided=n, down=n)
    sub = submission(forged, 0)
    assert ledger.store.add(open_envelope(sub, run_id=RUN, expect=Submission))
    service.apply_verdict(verdict(sub, too_many))
    assert audit.evidence(forged.peer_id) == []
    service.close()
    ledger.close()


def test_a_verdict_whose_counts_are_not_the_submission_held_is_not_counted(tmp_path) -> None:
    """A full check replays every token and chunk of the submission, so its counts are fixed by what the
    coordinator holds. One forged verdict (a compromised validator key) claiming 10⁹ clean tokens would
    drive every likelihood ratio of the worker's test towards 0, and a steerer's later evidence would
    first have to climb back: such a verdict is not counted (logged; ``mismatched_verdicts`` in
    ``/status``). Nor is one with another chunk count, or twin rollouts under ``eprocess-v1``; a verdict
    whose counts match is counted, and the steerer is still flagged as fast as without the forgery."""
    service = open_coordinator(tmp_path)
    ledger, audit = service.ledger, service.ban_rule.audit
    calibrate(service, 20_000)
    steerer = NodeKey.generate()
    forged = [ReplayStats(tokens=10**9, differ=0, gap_over=[0] * 5, chunks=7),  # inflated tokens
              ReplayStats(tokens=200, differ=0, gap_over=[0] * 5, chunks=10**9),  # inflated chunks
              ReplayStats(tokens=200, differ=0, gap_over=[0] * 5, chunks=6),  # too few chunks for 200 tokens
              ReplayStats(tokens=200, differ=0, gap_over=[0] * 5, chunks=7, rollouts=1)]  # twins under eprocess-v1
    for counter, stats in enumerate(forged):
        sub = submission(steerer, counter)
        assert ledger.store.add(open_envelope(sub, run_id=RUN, expect=Submission))
        service.apply_verdict(verdict(sub, stats))
    assert audit.evidence(steerer.peer_id) == [] and service.status()["audit"]["mismatched_verdicts"] == len(forged)
    held = submit_until_banned(service, steerer, 30, RUN, lambda w, i: submission(w, 100 + i), lambda sub: verdict(sub, STEERED))
    assert ledger.bans.is_banned(steerer.peer_id) and len(held) <= 5
    assert len(audit.evidence(steerer.peer_id)) == len(held)  # the matching verdicts, all counted
    service.close()
    ledger.close()
