"""The rollout buffer: the ingest's verified body is used as is, groups are consumed and
submissions retired exactly once, the saved position resumes, and an unreadable stored submission
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
from trainer.buffer import RolloutBuffer, _body_bytes
from trainer.errors import NotEnoughRolloutsError
from trainer.ledger import SubmissionStore

COORD = NodeKey.from_seed(b"c" * 32)
WORKER = NodeKey.from_seed(b"w" * 32)
SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=1))
RUN = SPEC.run_id
RL = RLSpec(group_size=2, batch_groups=1, async_level=2)


def _submission(counter: int, step: int = 0, tasks: int = 2) -> bytes:
    """``tasks`` groups of 2 rollouts with rewards 0 and 1 (every group has advantages)."""
    rollouts = [Rollout(task=t, sample=k, seed=k, prompt_ids=pack_u32([5, 6, 7]), completion_ids=pack_u32([8 + k, 9]),
                        logprobs=pack_f32([-1.0, -1.0]), finish="length", task_reward=float(k), reward=float(k), proofs=[])
                for t in range(tasks) for k in range(2)]
    body = Submission(worker=WORKER.peer_id, policy_step=step, counter=counter,
                      tasks=[SubmissionTask(task_index=t, problem_id=f"p{counter}-{t}", target_length=0) for t in range(tasks)],
                      rollouts=rollouts)
    return seal(WORKER, RUN, body)


def _store_accepted(store: SubmissionStore, raw: bytes) -> tuple[str, Submission]:
    env = open_envelope(raw, run_id=RUN, expect=Submission)
    sid = env.id.hex()
    assert store.add(env)
    assert store.record_verdict(f"v-{sid}", sid, "validator", True, "ok")
    return sid, env.body


def _consumed_step(store: SubmissionStore, sid: str) -> int:
    """The store's record of which trainer step retired ``sid`` (−1: none yet, −2: untrainable)."""
    with store._lock:
        return int(store._db.execute("SELECT consumed_step FROM submissions WHERE id = ?", (sid,)).fetchone()[0])


@pytest.fixture
def store(tmp_path: Path):
    s = SubmissionStore(tmp_path / "ingest", RUN)
    yield s
    s.close()


def test_the_ingests_verified_body_is_not_verified_again(store):
    buffer = RolloutBuffer(store, RUN, RL)
    sid, body = _store_accepted(store, _submission(0))
    buffer.note_stored(sid, body)
    batch = buffer.next_batch(1)
    assert batch.consumed_submission_ids == [sid]
    assert buffer.reopened == 0
    # a buffer that never saw it (a restart) reads it back from the store and opens it there
    fresh = RolloutBuffer(store, RUN, RL)
    assert fresh.next_batch(1).group_keys == batch.group_keys
    assert fresh.reopened == 1


def test_groups_are_consumed_once_and_a_submission_retires_with_its_last_group(store):
    buffer = RolloutBuffer(store, RUN, RL)
    sid, _ = _store_accepted(store, _submission(0, tasks=2))
    first = buffer.next_batch(1)
    assert buffer.consume(first) == []  # one of its two groups is left
    buffer.retire([], 1)
    second = buffer.next_batch(2)
    assert second.group_keys != first.group_keys
    assert buffer.consume(second) == [sid]
    buffer.retire([sid], 2)
    assert _consumed_step(store, sid) == 2
    with pytest.raises(NotEnoughRolloutsError):
        buffer.next_batch(2)
    assert buffer.fresh_records(2) == []


def test_saved_position_resumes_without_training_a_group_twice(store):
    buffer = RolloutBuffer(store, RUN, RL)
    sid, _ = _store_accepted(store, _submission(0, tasks=2))
    first = buffer.next_batch(1)
    buffer.consume(first)
    position = buffer.position()
    second = buffer.next_batch(2)
    buffer.retire(buffer.consume(second), 2)  # step 2 trained, but its state was never saved
    resumed = RolloutBuffer(store, RUN, RL)
    assert resumed.restore(position, 1) == 1  # the submission step 2 retired is trainable again
    again = resumed.next_batch(2)
    assert again.group_keys == second.group_keys  # not the group step 1 already trained
    assert _consumed_step(store, sid) == -1


def test_a_group_outside_the_async_window_is_not_trainable(store):
    buffer = RolloutBuffer(store, RUN, RL)
    _store_accepted(store, _submission(0, step=0))
    assert buffer.fresh_records(2)  # 2 − async level 2 = 0
    assert buffer.fresh_records(3) == []


def test_an_unreadable_stored_submission_is_retired_once_with_a_warning(store, caplog):
    buffer = RolloutBuffer(store, RUN, RL)
    sid, _ = _store_accepted(store, _submission(0))
    (store.dir / f"{sid}.sub").write_bytes(b"not an envelope")
    with caplog.at_level(logging.WARNING, logger="trainer.buffer"):
        assert buffer.fresh_records(1) == []
        assert buffer.fresh_records(1) == []
    assert [r.message for r in caplog.records if sid[:12] in r.message] and len(caplog.records) == 1
    assert _consumed_step(store, sid) == -2


def test_held_bodies_are_bounded(store):
    stored = [_store_accepted(store, _submission(counter, tasks=1)) for counter in range(4)]
    bound = 2 * _body_bytes(stored[0][1]) + 1  # room for two of the four bodies
    buffer = RolloutBuffer(store, RUN, RL, max_held_bytes=bound)
    ids = []
    for sid, body in stored:
        buffer.note_stored(sid, body)
        ids.append(sid)
    held = [i for i in ids if i in buffer._held]
    assert buffer._held_bytes <= bound and ids[-1] in held and ids[0] not in held
    assert len(buffer.fresh_records(1)) == 2 * len(ids)
    assert buffer.reopened == len(ids) - len(held)  # the dropped ones were read back from the store
