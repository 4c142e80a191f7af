"""A lease answer's ``trainer_step`` is unsigned: it is held between coordinator-signed bounds.

Every published step is ≤ the trainer step ``n`` (:mod:`protocol.window`), so a validator that
has a coordinator-signed announcement of step 5 knows ``n ≥ 5``. A stale or lying ingest that
answers ``trainer_step`` −2⁶¹ (or 0) would otherwise put every fresh submission above the
window's upper end, and the validator would sign ``stale_policy`` rejections of honest work; one
far above it (2⁶¹) would put every fresh submission below the window's lower end.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node.roles.validator import ValidatorNode, ValidatorOptions
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask
from protocol.rollout import pack_f32, pack_u32
from protocol.runspec import NetworkSpec, RLSpec, RunInfo, RunSpec, sign_run_spec
from protocol.window import in_window

COORD = NodeKey.from_seed(b"C" * 32)
VALIDATOR = NodeKey.from_seed(b"V" * 32)


def _validator(tmp_path: Path) -> ValidatorNode:
    spec = RunSpec(run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id], seed=3), rl=RLSpec(async_level=1),
                   network=NetworkSpec(ingest_urls=["http://127.0.0.1:9"]))
    return ValidatorNode(sign_run_spec(spec, COORD), VALIDATOR, ValidatorOptions(data_dir=tmp_path, gossip=None, http_port=None))


def test_a_lease_answer_below_the_signed_latest_step_does_not_move_the_window(tmp_path: Path) -> None:
    node = _validator(tmp_path)
    try:
        node.follower.note_step(5)  # a verified coordinator announcement
        for lie in (-(2**61), -1, 0, 4):
            node.coordinator_step = lie  # what _lease keeps from the answer
            assert node._trainer_step() == 5
            assert in_window(5, trainer_step=node._trainer_step(), async_level=1)
        node.coordinator_step = 6  # an answer inside the signed bounds is taken as it is
        assert node._trainer_step() == 6
        for lie in (7, 2**61):  # above the newest signed step + publish_every (1): lowered to it
            node.coordinator_step = lie
            assert node._trainer_step() == 6
            assert in_window(5, trainer_step=node._trainer_step(), async_level=1)
    finally:
        node.ledger.close()


def test_a_restarted_validator_bounds_the_answer_by_the_checkpoints_it_holds(tmp_path: Path) -> None:
    """Restarted with checkpoint 5 on its disk and no announcement heard yet (the origin poll failed):
    the verified checkpoint it loaded proves step 5 was published, so ``n ≥ 5`` bounds the answer
    as an announcement would (the bound was skipped while no announcement had been heard)."""
    node = _validator(tmp_path)
    try:
        assert node.follower.latest_step == -1
        node._models[5] = object()  # what _prepare keeps after loading the verified checkpoint of step 5
        for lie in (2**61, 7, -(2**61), 0):
            node.coordinator_step = lie
            assert node._trainer_step() in (5, 6)
            assert in_window(5, trainer_step=node._trainer_step(), async_level=1)
    finally:
        node.ledger.close()


@pytest.mark.asyncio
async def test_no_verdict_on_a_submission_whose_checkpoint_this_validator_cannot_get(tmp_path: Path) -> None:
    """With no checkpoint and no announcement (nothing signed bounds the answer), a lying answer
    (2⁶¹) must not turn into a signed ``stale_policy`` rejection of honest work: the submission
    gets no verdict, as one whose checkpoint is missing always did (its lease expires)."""
    node = _validator(tmp_path)
    posted: list[bytes] = []

    async def post_verdict(verdict: bytes) -> None:
        posted.append(verdict)

    node._post_verdict = post_verdict  # type: ignore[method-assign]
    try:
        worker = NodeKey.from_seed(b"W" * 32)
        rollout = Rollout(task=0, sample=0, seed=1, prompt_ids=pack_u32([1]), completion_ids=pack_u32([2]), logprobs=pack_f32([-1.0]),
                          finish="length", task_reward=0.0, reward=0.0, proofs=[b"\0" * 258])
        blob = seal(worker, node.signed.run_id, Submission(worker=worker.peer_id, policy_step=0, counter=0,
                                                           tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)],
                                                           rollouts=[rollout]))
        node.coordinator_step = 2**61
        await asyncio.wait_for(node._judge(blob), 60)
        assert posted == [] and node.checked == 0
    finally:
        await node.follower.close()
        node.ledger.close()
