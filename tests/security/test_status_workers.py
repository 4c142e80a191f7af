"""``/status`` lists a bounded number of workers (``trainer/ingest/status.py`` ``STATUS_WORKERS_MAX``).

Every key with one admitted submission keeps a row in the ledger's per-worker read model for the
whole run, and keys are free: ``/status`` listed every worker of the run, 7.3 MB of JSON at 10^5
junk keys (≈ 1.4 hours of the shared rate of unproven addresses), for a request of ~150 bytes at 5
requests/s per address. Now it lists the first ``STATUS_WORKERS_MAX`` by most accepted, then fewest
rejected (junk, rejected, sorts last) and counts them all in ``workers_total``. Scaled here: a
limit of 3, one honest worker with accepted work and 6 junk keys with a rejection each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ingest_attack_helpers import honest_session, post, running_ingest, submission, verdict

import trainer.ingest.status as status_mod
from protocol.identity import NodeKey


async def test_status_lists_a_bounded_number_of_workers_honest_ones_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_mod, "STATUS_WORKERS_MAX", 3, raising=False)
    honest = NodeKey.generate()
    junk = [NodeKey.generate() for _ in range(6)]
    async with running_ingest(tmp_path) as ing, honest_session(ing.url) as http:
        for key in [honest, *junk]:
            status, body = await post(http, "/ingest/1/submissions", sub := submission(key))
            assert status == 200, body
            assert ing.service.apply_verdict(verdict(sub, key is honest, "ok" if key is honest else "wrong_length"))
        async with http.get("/status") as r:
            assert r.status == 200
            doc = await r.json()
    assert len(doc["workers"]) == 3, doc["workers"]
    assert doc["workers_total"] == 7
    assert next(iter(doc["workers"])) == honest.peer_id and doc["workers"][honest.peer_id] == {"accepted": 1}
