"""A worker's standing, signed by the coordinator (GET /ingest/1/workers/{peer_id}): accepted, rejected by reason,
trained on, leaderboard place; `intellect-node status` verifies it against the spec's coordinator key."""

from __future__ import annotations

import pytest
from aiohttp import ClientSession
from test_ingest import COORD, RUN, SPEC, VALIDATOR, Coordinator, serve, submission, verdict

from node.commands.status import fetch_standing
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.ingest_api import SUBMISSIONS_ROUTE, VERDICTS_ROUTE, worker_path
from protocol.messages import WorkerStanding
from protocol.runspec import RunInfo, RunSpec, sign_run_spec

ALICE, BOB, CAROL = (NodeKey.from_seed(bytes([i]) * 32) for i in (1, 2, 3))


async def test_standing_counts_reasons_place_and_signature(tmp_path):
    coord = Coordinator(tmp_path)
    runner, port = await serve(coord)
    url = f"http://127.0.0.1:{port}"
    try:
        async with ClientSession(base_url=url) as http:
            subs = {k.peer_id: [submission(k, counter=i) for i in range(n)] for k, n in ((ALICE, 4), (BOB, 2))}
            for batch in subs.values():
                for raw in batch:
                    async with http.post(SUBMISSIONS_ROUTE, data=raw) as r:
                        assert r.status == 200, await r.text()
            a, b = subs[ALICE.peer_id], subs[BOB.peer_id]
            for raw, ok, reason in ((a[0], True, "ok"), (a[1], True, "ok"), (a[2], False, "timeout"), (b[0], True, "ok"),
                                    (b[1], False, "unknown_checkpoint")):
                async with http.post(VERDICTS_ROUTE, data=verdict(raw, ok, reason)) as r:
                    assert r.status == 200
            async with http.get(worker_path(ALICE.peer_id)) as r:
                assert r.status == 200
                env = open_envelope(await r.read(), run_id=RUN, expect=WorkerStanding, authorities=SPEC.authorities)
            s = env.body
            assert (s.worker, s.accepted, s.rejected, s.pending, s.place, s.workers) == (ALICE.peer_id, 2, 1, 1, 1, 2)
            assert s.rejected_by_reason == {"timeout": 1} and not s.banned
            async with http.get(worker_path(CAROL.peer_id)) as r:
                carol = open_envelope(await r.read(), run_id=RUN, expect=WorkerStanding, authorities=SPEC.authorities).body
            assert (carol.accepted, carol.place, carol.workers) == (0, 0, 2), "no submission: no place"
            async with http.get(worker_path("12D3KooWnot-a-peer-id")) as r:
                assert r.status == 400 and (await r.json())["error"] == "malformed"

        # the CLI's reader: verified against the coordinator key; a standing signed by another key is refused
        signed = sign_run_spec(SPEC, COORD)
        mine = await fetch_standing([url], signed, BOB.peer_id)
        assert (mine["accepted"], mine["rejected"], mine["rejected_by_reason"], mine["place"]) == (1, 1, {"unknown_checkpoint": 1}, 2)
        impostor = sign_run_spec(RunSpec(run=RunInfo(coordinator=VALIDATOR.peer_id, validators=[VALIDATOR.peer_id], seed=1)), VALIDATOR)
        with pytest.raises(OSError, match="no coordinator URL gave|not a standing"):
            await fetch_standing([url], impostor, BOB.peer_id)
    finally:
        await runner.cleanup()
        coord.close()
