"""A lease answer's ``trainer_step`` is unsigned, so a validator does not trust it.

Every published step is ≤ the trainer step ``n`` (:mod:`protocol.window`), so a validator that
has a coordinator-signed announcement of step 5 knows ``n ≥ 5`` and judges the window against
that. A stale or lying ingest that answers ``trainer_step`` −2⁶¹ (or 0) would otherwise put every
fresh submission above the window's upper end, and the validator would sign ``stale_policy``
rejections of honest work; one far above it (2⁶¹) would put every fresh submission below the
window's lower end; even one just above the truth (6 when ``n`` is 5) moved the lower end.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node.validator.role import ValidatorNode, ValidatorOptions
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.ingest_api import LeaseAnswer
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


def _answering(node: ValidatorNode, trainer_step: int) -> None:
    """Make the node's ingest answer every lease with no submissions and ``trainer_step``."""

    async def lease(request: bytes, limit: int) -> LeaseAnswer:
        return LeaseAnswer([], trainer_step)

    node.ingest.lease = lease  # type: ignore[method-assign]


async def test_no_lease_answer_moves_the_window(tmp_path: Path) -> None:
    node = _validator(tmp_path)
    try:
        node.follower.note_step(5)  # a verified coordinator announcement
        for lie in (-(2**61), -1, 0, 4, 6, 7, 2**61):
            _answering(node, lie)
            assert await node._lease() == []
            assert node._trainer_step() == 5
            assert in_window(5, trainer_step=node._trainer_step(), async_level=1)
    finally:
        await node.ingest.close()
        node.judgements.close()


async def test_a_restarted_validator_judges_by_the_checkpoints_it_holds(tmp_path: Path) -> None:
    """Restarted with checkpoint 5 on its disk and no announcement heard yet (the origin poll failed):
    the verified checkpoint it loaded proves step 5 was published, so ``n ≥ 5``, whatever the answer says."""
    node = _validator(tmp_path)
    try:
        assert node.follower.latest_step == -1
        node.models._models[5] = object()  # what _prepare holds after loading the verified checkpoint of step 5
        for lie in (2**61, 7, -(2**61), 0):
            _answering(node, lie)
            await node._lease()
            assert node._trainer_step() == 5
            assert in_window(5, trainer_step=node._trainer_step(), async_level=1)
    finally:
        await node.ingest.close()
        node.judgements.close()


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
        _answering(node, 2**61)
        await node._lease()
        await asyncio.wait_for(node._judge(blob), 60)
        assert posted == [] and node.checked == 0
    finally:
        await node.follower.close()
        node.judgements.close()
