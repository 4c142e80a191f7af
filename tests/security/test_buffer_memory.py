"""A worker cannot make the coordinator hold more verified bodies in memory than its bound.

The ingest hands every stored submission's verified body to the ledger
(:meth:`trainer.ledger.ledger.SubmissionLedger.stored`), which keeps bodies for the trainer up to
``max_held_bytes`` (``trainer/ledger/bodies.py``). A hostile worker (free keys, one per submission)
sends bodies that are almost all TOPLOC proofs: up to ``⌈max_tokens / chunk⌉`` proofs of 1 KiB
per rollout, with one-token arrays. Counting only the packed arrays, each such body counted a few
hundred bytes while holding hundreds of KiB, so the bound held ~1000× its size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from ingest_attack_helpers import COORD, RUN, SPEC, attacker_session, post

from node.http_server import start_site
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import Rollout, Submission, SubmissionTask
from protocol.rollout import submission_decode_limits
from trainer.ingest.service import IngestService, error_middleware
from trainer.ledger import BanBook, BanRule, SubmissionLedger

HELD_BOUND = 1 << 20


def _proof_heavy(worker: NodeKey) -> bytes:
    """Longest arrays the run's decoder allows, every proof 1 KiB, one-token arrays (≈ 260 KiB signed)."""
    n = submission_decode_limits(SPEC).max_array_len
    rollouts = [Rollout(task=0, sample=i, seed=1, prompt_ids=b"\x01\x00\x00\x00", completion_ids=b"\x02\x00\x00\x00",
                        logprobs=b"\x00\x00\x00\x00", finish="length", task_reward=0.0, reward=0.0,
                        proofs=[bytes([i, j]) * 512 for j in range(n)]) for i in range(n)]
    body = Submission(worker=worker.peer_id, policy_step=0, counter=0,
                      tasks=[SubmissionTask(task_index=0, problem_id="p0", target_length=0)], rollouts=rollouts)
    return seal(worker, RUN, body)


def _held_data_bytes(sub: Submission) -> int:
    """Bytes of data a held body carries (its arrays and proofs; object overheads not counted)."""
    return sum(len(r.prompt_ids) + len(r.completion_ids) + len(r.logprobs) + sum(len(p) for p in r.proofs) for r in sub.rollouts)


@pytest.mark.asyncio
async def test_proof_heavy_submissions_do_not_overfill_the_held_bodies(tmp_path: Path) -> None:
    ledger = SubmissionLedger(tmp_path / "ingest", SPEC, BanBook(tmp_path / "bans.msgpack", COORD, RUN), trainer_step=lambda: 0,
                              latest_policy_step=lambda: 0, max_held_bytes=HELD_BOUND)
    service = IngestService(ledger, BanRule(ledger))
    app = web.Application(middlewares=[error_middleware])
    service.add_routes(app)
    server = await start_site(app, "127.0.0.1", 0)
    try:
        async with attacker_session(f"http://127.0.0.1:{server.port}") as http:
            sent = 0
            for i in range(12):  # 12 × ≈ 260 KiB: three times the bound
                raw = _proof_heavy(NodeKey.from_seed(bytes([i + 1]) * 32))
                status, answer = await post(http, "/ingest/1/submissions", raw)
                assert status == 200, answer
                sent += len(raw)
        assert sent > 2 * HELD_BOUND
        held = [sub for sub, _ in ledger.bodies._held.values()]
        assert held, "the ledger holds verified bodies (the ingest handed them on)"
        assert sum(_held_data_bytes(s) for s in held) <= HELD_BOUND
        assert ledger.bodies.held_bytes <= HELD_BOUND
    finally:
        await server.stop()
        service.close()
        ledger.close()
