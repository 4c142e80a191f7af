"""A worker banned while one of its submissions is being stored (the ingest's group commit window).

A real ingest server on 127.0.0.1; the submission is held in its group commit by making the
commit's directory ``fsync`` wait until the ban has happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ingest_attack_helpers import RUN, VALIDATOR2, honest_session, post, running_ingest, submission, verdict
from test_ingest_group_commit import FsyncFault
from waiting import wait_until

from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission

SUBMISSIONS = "/ingest/1/submissions"
VERDICTS = "/ingest/1/verdicts"


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FsyncFault]]:
    made: list[FsyncFault] = []

    def make(**kw: bool) -> FsyncFault:
        made.append(FsyncFault(monkeypatch, **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for f in made:
        f.release.set()  # never leave the commit thread waiting


async def test_a_worker_banned_while_its_submission_is_being_stored_gets_no_pending_submission(
        tmp_path: Path, fault: Callable[..., FsyncFault]) -> None:
    """Was: the ban rejected the worker's pending submissions in the index, but one still being
    written (admitted before the ban, committed after it) landed as pending, was leased to
    validators and could be trained on."""
    async with running_ingest(tmp_path) as ing:
        cheat = NodeKey.generate()
        judged = submission(cheat, counter=0)
        async with honest_session(ing.url) as http:
            assert (await post(http, SUBMISSIONS, judged))[0] == 200
            # the next one waits in the commit (its directory fsync) while the ban happens
            f = fault(dirs=True, block=True)
            late = submission(cheat, counter=1)
            late_id = open_envelope(late, run_id=RUN, expect=Submission).id.hex()
            answer = asyncio.ensure_future(post(http, SUBMISSIONS, late))
            await wait_until(f.hit.is_set, what="the late submission's commit")
            assert ing.store.storing(late_id)
            assert (await post(http, VERDICTS, verdict(judged, False, "toploc")))[1] == {"applied": True}
            await post(http, VERDICTS, verdict(judged, False, "toploc", key=VALIDATOR2))
            assert ing.bans.is_banned(cheat.peer_id)
            f.release.set()
            status, body = await asyncio.wait_for(answer, 20.0)
        assert (status, body["error"]) == (403, "banned"), body
        stored = ing.store.get(late_id)
        assert stored is not None and (stored.state, stored.reason) == ("rejected", "banned")
        assert ing.store.counts()["pending"] == 0
        assert not (ing.store.dir / f"{late_id}.sub").exists()
