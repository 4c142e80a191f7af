"""The rollout buffer (the ledger's trainable view): the ingest's verified body is used as is, groups
are consumed and submissions retired exactly once and the ledger holds which (a resume forgets only
what later steps consumed), the async window is the ledger's, and an unreadable stored submission
is retired once with a reason instead of being retried."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from protocol.envelope import open_envelope, seal
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask
from protocol.rollout import pack_f32, pack_u32
from protocol.runspec import RLSpec, RunInfo, RunSpec
from trainer.buffer import RolloutBuffer
from trainer.errors import NotEnoughRolloutsError
from trainer.ledger import BanBook, State, SubmissionLedger
from trainer.ledger.bodies import body_bytes

COORD = NodeKey.from_seed(b"c" * 32)
WORKER = NodeKey.from_seed(b"w" * 32)
SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=1))
RUN = SPEC.run_id
RL = RLSpec(group_size=2, batch_groups=1, async_level=2)


def _submission(counter: int, step: int = 0, tasks: int = 2, run_id: bytes = RUN) -> bytes:
    """``tasks`` groups of 2 rollouts with rewards 0 and 1 (every group has advantages)."""
    rollouts = [Rollout(task=t, sample=k, seed=k, prompt_ids=pack_u32([5, 6, 7]), completion_ids=pack_u32([8 + k, 9]),
                        logprobs=pack_f32([-1.0, -1.0]), finish="length", task_reward=float(k), reward=float(k), proofs=[])
                for t in range(tasks) for k in range(2)]
    body = Submission(worker=WORKER.peer_id, policy_step=step, counter=counter,
                      tasks=[SubmissionTask(task_index=t, problem_id=f"p{counter}-{t}", target_length=0) for t in range(tasks)],
                      rollouts=rollouts)
    return seal(WORKER, run_id, body)


def _store_accepted(ledger: SubmissionLedger, raw: bytes, *, hold: bool = False) -> tuple[str, Submission]:
    """Store ``raw`` and accept it, as the ingest and a validator would (``hold``: the ingest keeps its verified body)."""
    env = open_envelope(raw, run_id=RUN, expect=Submission)
    sid = env.id.hex()
    assert ledger.store.add(env)
    if hold:
        ledger.stored(sid, env.body)
    assert ledger.store.record_verdict(f"v-{sid}", sid, "validator", True, "ok")
    return sid, env.body


def _consumed(ledger: SubmissionLedger, sid: str) -> tuple[State, int | None]:
    """The ledger's state of ``sid`` and the trainer step that consumed it (``None``: none)."""
    row = ledger.get(sid)
    assert row is not None
    return row.state, row.consumed_step


def _ledger(tmp_path: Path, *, max_held_bytes: int | None = None) -> SubmissionLedger:
    kw = {} if max_held_bytes is None else {"max_held_bytes": max_held_bytes}
    return SubmissionLedger(tmp_path / "ingest", SPEC, BanBook(tmp_path / "bans.msgpack", COORD, RUN), trainer_step=lambda: 0,
                            latest_policy_step=lambda: 0, **kw)


@pytest.fixture
def ledger(tmp_path: Path):
    s = _ledger(tmp_path)
    yield s
    s.close()


def test_the_ingests_verified_body_is_not_verified_again(tmp_path):
    ledger = _ledger(tmp_path)
    buffer = RolloutBuffer(ledger, RL)
    sid, _body = _store_accepted(ledger, _submission(0), hold=True)
    batch = buffer.next_batch(1)
    assert batch.consumed_submission_ids == [sid]
    assert ledger.reopened == 0
    ledger.close()
    # a ledger that never saw it (a restart) reads it back from disk and opens it there
    restarted = _ledger(tmp_path)
    fresh = RolloutBuffer(restarted, RL)
    assert fresh.next_batch(1).group_keys == batch.group_keys
    assert restarted.reopened == 1
    restarted.close()


def test_groups_are_consumed_once_and_a_submission_retires_with_its_last_group(ledger):
    buffer = RolloutBuffer(ledger, RL)
    sid, _ = _store_accepted(ledger, _submission(0, tasks=2))
    first = buffer.next_batch(1)
    assert buffer.consume(first, 1) == []  # one of its two groups is left
    assert ledger.consumed_groups() == set(first.group_keys)  # the ledger, not the buffer, holds it
    buffer.retire(1)
    second = buffer.next_batch(2)
    assert second.group_keys != first.group_keys
    assert buffer.consume(second, 2) == [sid]
    assert _consumed(ledger, sid) == (State.CONSUMED, 2)
    buffer.retire(2)
    assert _consumed(ledger, sid) == (State.CONSUMED, 2)  # kept while the state of step 2 is the one a resume loads
    with pytest.raises(NotEnoughRolloutsError):
        buffer.next_batch(2)
    assert buffer.fresh_records(2) == []
    buffer.retire(3)  # step 3's state is saved: step 2's work is never needed again
    assert _consumed(ledger, sid) == (State.RETIRED, 2) and not (ledger.store.dir / f"{sid}.sub").exists()
    assert ledger.consumed_groups() == set()


def test_a_resume_forgets_what_later_steps_consumed_and_keeps_the_rest(ledger):
    """The loop's order: the ledger records a step's groups before its state is saved. A resume from
    step 1's state gives back what step 2 consumed (its state was never saved), not what step 1 did."""
    buffer = RolloutBuffer(ledger, RL)
    sid, _ = _store_accepted(ledger, _submission(0, tasks=2))
    first = buffer.next_batch(1)
    buffer.consume(first, 1)  # step 1's state saved after this
    second = buffer.next_batch(2)
    assert buffer.consume(second, 2) == [sid]  # step 2 trained, but its state was never saved
    resumed = RolloutBuffer(ledger, RL)
    assert resumed.resume(1) == 1  # the submission step 2 consumed is trainable again
    again = resumed.next_batch(2)
    assert again.group_keys == second.group_keys  # not the group step 1 already trained
    assert _consumed(ledger, sid) == (State.ACCEPTED, None)


def test_what_a_step_consumed_survives_a_restart_resumed_at_that_step(tmp_path):
    """Old code saved the buffer's consumed groups in the trainer state, taken before the step's own
    groups were added: a resume from step 1's state trained step 1's group again."""
    ledger = _ledger(tmp_path)
    buffer = RolloutBuffer(ledger, RL)
    _store_accepted(ledger, _submission(0, tasks=2))
    first = buffer.next_batch(1)
    buffer.consume(first, 1)
    ledger.close()
    restarted = _ledger(tmp_path)
    try:
        resumed = RolloutBuffer(restarted, RL)
        assert resumed.resume(1) == 0
        assert resumed.next_batch(2).group_keys != first.group_keys
    finally:
        restarted.close()


def test_consumed_groups_a_state_of_an_older_version_saved_are_recorded_in_the_ledger(ledger):
    buffer = RolloutBuffer(ledger, RL)
    sid, _ = _store_accepted(ledger, _submission(0, tasks=2))
    first = buffer.next_batch(1)
    resumed = RolloutBuffer(ledger, RL)
    assert resumed.resume(1, {"consumed_groups": [list(k) for k in first.group_keys]}) == 0
    assert ledger.consumed_groups() == set(first.group_keys)
    assert resumed.next_batch(2).group_keys != first.group_keys
    assert _consumed(ledger, sid) == (State.ACCEPTED, None)


def test_a_group_outside_the_async_window_is_not_trainable(ledger):
    buffer = RolloutBuffer(ledger, RL)
    _store_accepted(ledger, _submission(0, step=0))
    assert buffer.fresh_records(2)  # 2 − async level 2 = 0
    assert buffer.fresh_records(3) == []


def test_the_ledger_offers_only_work_inside_the_async_window(tmp_path):
    """The window ``n − k ≤ policy_step ≤ n`` is applied by the ledger's trainable view alone (batch
    assembly trusts it): at n = 5, k = 2 accepted work of steps 3 and 5 trains, of step 2 never (even
    accepted), of step 6 only once the trainer reaches it (after a resume from an earlier step)."""
    ledger = _ledger(tmp_path)
    try:
        buffer = RolloutBuffer(ledger, RL)
        n, k = 5, RL.async_level
        assert ledger.async_level == k
        ids = {p: _store_accepted(ledger, _submission(p, step=p, tasks=1))[0] for p in (n - k - 1, n - k, n, n + 1)}
        assert {r.policy_step for r in buffer.fresh_records(n)} == {n - k, n}
        assert [s.id for s in ledger.trainable(n)] == [ids[n - k], ids[n]]  # oldest first
        batch = buffer.next_batch(n)
        assert batch.staleness_histogram() == {0: 2}  # the freshest policy first
        assert {r.policy_step for r in buffer.fresh_records(n + 1)} == {n, n + 1}  # n − k fell out, n + 1 came in
        for later in (n, n + 1):
            assert ids[n - k - 1] not in {s.id for s in ledger.trainable(later)}
    finally:
        ledger.close()


def test_async_level_zero_trains_on_policy_only(tmp_path):
    spec = RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=1), rl=RLSpec(group_size=2, batch_groups=1, async_level=0))
    ledger = SubmissionLedger(tmp_path / "ingest", spec, BanBook(tmp_path / "bans.msgpack", COORD, spec.run_id), trainer_step=lambda: 0,
                              latest_policy_step=lambda: 0)
    try:
        buffer = RolloutBuffer(ledger, spec.rl)
        for p in (3, 4):
            env = open_envelope(_submission(p, step=p, tasks=1, run_id=spec.run_id), run_id=spec.run_id, expect=Submission)
            assert ledger.store.add(env) and ledger.store.record_verdict(f"v{p}", env.id.hex(), "validator", True, "ok")
        assert {r.policy_step for r in buffer.fresh_records(4)} == {4}
        assert buffer.fresh_records(5) == []
        with pytest.raises(NotEnoughRolloutsError):
            buffer.next_batch(5)
    finally:
        ledger.close()


def test_an_unreadable_stored_submission_is_retired_once_with_a_warning(ledger, caplog):
    buffer = RolloutBuffer(ledger, RL)
    sid, _ = _store_accepted(ledger, _submission(0))
    (ledger.store.dir / f"{sid}.sub").write_bytes(b"not an envelope")
    with caplog.at_level(logging.WARNING, logger="trainer.buffer"):
        assert buffer.fresh_records(1) == []
        assert buffer.fresh_records(1) == []
    assert [r.message for r in caplog.records if sid[:12] in r.message] and len(caplog.records) == 1
    assert _consumed(ledger, sid) == (State.RETIRED, None)  # retired untrained
    assert not (ledger.store.dir / f"{sid}.sub").exists()


def test_held_bodies_are_bounded(tmp_path):
    bound = 2 * body_bytes(open_envelope(_submission(0, tasks=1), run_id=RUN, expect=Submission).body) + 1  # room for two of four
    ledger = _ledger(tmp_path, max_held_bytes=bound)
    try:
        ids = [_store_accepted(ledger, _submission(counter, tasks=1), hold=True)[0] for counter in range(4)]
        held = [i for i in ids if i in ledger.bodies]
        assert ledger.bodies.held_bytes <= bound and ids[-1] in held and ids[0] not in held
        buffer = RolloutBuffer(ledger, RL)
        assert len(buffer.fresh_records(1)) == 2 * len(ids)
        assert ledger.reopened == len(ids) - len(held)  # the dropped ones were read back from disk
    finally:
        ledger.close()
