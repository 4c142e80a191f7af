"""A worker whose submission was displaced (probation's share full, a lighter address allocation or
prefix took its place: ``docs/protocol.md`` "Quotas") is told: its next 200 says how many of its
submissions are displaced now, the worker's submitter logs it and shows it in its status, and
``GET /ingest/1/submissions/{id}`` answers each one's state.

Old code: nothing told it; its client had dropped the submission on the 200."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
from ingest_attack_helpers import RUN, post, running_ingest, submission, verdict

from node.ingest_client import IngestClient
from node.worker.spool import Spool
from node.worker.submitter import Submitter
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.ingest_api import SUBMISSIONS_ROUTE as SUBMISSIONS
from protocol.ingest_api import submission_path
from trainer.ingest.limits import IngestLimits


def session(url: str, ip: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=30),
                                 connector=aiohttp.TCPConnector(local_addr=(ip, 0), force_close=True))


async def test_a_displaced_worker_is_told_on_its_next_answer_and_can_read_each_state(tmp_path: Path, caplog) -> None:
    limits = IngestLimits(max_disk_files=16, max_pending_per_ip=64)  # probation's share: 8 files
    worker = NodeKey.generate()
    async with running_ingest(tmp_path, limits=limits) as ing:
        mine: list[bytes] = []
        async with session(ing.url, "127.71.0.1") as http:
            for _ in range(2):
                status, body = await post(http, SUBMISSIONS, submission(NodeKey.generate()))
                assert status == 200
            for c in range(4):  # the worker's four are the newest of the heaviest prefix (6 of 8)
                mine.append(raw := submission(worker, counter=c))
                status, body = await post(http, SUBMISSIONS, raw)
                assert status == 200 and body["displaced"] == 0, body
        async with session(ing.url, "127.72.0.1") as http:
            for _ in range(2):
                assert (await post(http, SUBMISSIONS, submission(NodeKey.generate())))[0] == 200
        async with session(ing.url, "127.73.0.1") as http:  # a newcomer from a prefix of its own: the share is full
            status, body = await post(http, SUBMISSIONS, submission(NodeKey.generate()))
            assert status == 200, body
        victim = open_envelope(mine[-1], run_id=RUN).id.hex()
        async with session(ing.url, "127.74.0.1") as http:  # anyone may read a state by ID (as /status)
            status, body = await post_get(http, submission_path(victim))
            assert status == 200 and body == {"id": victim, "state": "displaced", "reason": "displaced"}, body
            status, body = await post_get(http, submission_path(open_envelope(mine[0], run_id=RUN).id.hex()))
            assert status == 200 and body["state"] == "pending" and body["reason"] == ""
            status, body = await post_get(http, submission_path("ab" * 32))
            assert status == 404 and body["error"] == "unknown_submission"
            status, body = await post_get(http, submission_path("XYZ"))
            assert status == 400 and body["error"] == "malformed"
        # one of its submissions is accepted: it is established and its next one is stored, and told
        assert ing.service.apply_verdict(verdict(mine[0], True, "ok"))
        spool = Spool(tmp_path / "spool")
        spool.put(10, submission(worker, counter=10))
        submitter = Submitter(spool, [ing.url])
        try:
            with caplog.at_level(logging.WARNING, logger="node.worker.submitter"):
                assert await submitter.drain(deadline_s=10) == 1
            assert submitter.displaced == 1 and submitter.acked == 1
            assert any("displaced 1 more" in r.message for r in caplog.records)
            state = await submitter.ingest.submission_state(victim)
            assert state.ok and state.json["state"] == "displaced"
            client = IngestClient([ing.url])
            unknown = await client.submission_state("cd" * 32)
            await client.close()
            assert unknown.outcome == "final" and unknown.code == "unknown_submission"
        finally:
            await submitter.close()


async def post_get(http: aiohttp.ClientSession, path: str) -> tuple[int, object]:
    async with http.get(path) as r:
        return r.status, await r.json(content_type=None)
