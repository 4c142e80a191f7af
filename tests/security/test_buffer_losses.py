"""An accepted submission is not lost to a passing failure of the coordinator's own resources.

The rollout buffer retires (never trains) a stored submission it cannot read back or decode. A
hostile peer can exhaust the coordinator's file descriptors for a while (connections up to the
HTTP servers' caps); reading a submission then fails with ``EMFILE``, which is no property of the
submission. Such a failure must leave it trainable once descriptors are free again.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from protocol.envelope import open_envelope, seal
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask
from protocol.rollout import pack_f32, pack_u32
from protocol.runspec import RLSpec, RunInfo, RunSpec
from trainer.buffer import RolloutBuffer
from trainer.ledger import BanBook, State, SubmissionLedger

COORD = NodeKey.from_seed(b"c" * 32)
WORKER = NodeKey.from_seed(b"w" * 32)
SPEC = RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=1))
RUN = SPEC.run_id
RL = RLSpec(group_size=2, batch_groups=1, async_level=2)


def _store_accepted(ledger: SubmissionLedger) -> str:
    """One accepted submission of one group (rewards 0 and 1); returns its ID."""
    rollouts = [Rollout(task=0, sample=k, seed=k, prompt_ids=pack_u32([5, 6, 7]), completion_ids=pack_u32([8 + k, 9]),
                        logprobs=pack_f32([-1.0, -1.0]), finish="length", task_reward=float(k), reward=float(k), proofs=[])
                for k in range(2)]
    body = Submission(worker=WORKER.peer_id, policy_step=0, counter=0,
                      tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)], rollouts=rollouts)
    env = open_envelope(seal(WORKER, RUN, body), run_id=RUN, expect=Submission)
    sid = env.id.hex()
    assert ledger.store.add(env)
    assert ledger.store.record_verdict(f"v-{sid}", sid, "validator", True, "ok")
    return sid


def _lowest_free_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_NOFILE"), reason="needs RLIMIT_NOFILE")
def test_running_out_of_descriptors_does_not_retire_an_accepted_submission(tmp_path: Path) -> None:
    ledger = SubmissionLedger(tmp_path / "ingest", SPEC, BanBook(tmp_path / "bans.msgpack", COORD, RUN), trainer_step=lambda: 0,
                              latest_policy_step=lambda: 0)
    try:
        buffer = RolloutBuffer(ledger, RL)  # nothing held: the body is read back from disk (as after a restart)
        sid = _store_accepted(ledger)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), hard))  # every new descriptor now fails: EMFILE
        try:
            with pytest.raises(OSError):
                os.open(os.devnull, os.O_RDONLY)
            starved = buffer.fresh_records(1)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert starved == []
        assert ledger.get(sid).state == State.ACCEPTED  # not retired
        assert {r.submission_id for r in buffer.fresh_records(1)} == {sid}  # trainable once descriptors are free
    finally:
        ledger.close()
