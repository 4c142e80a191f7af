"""The rate that addresses with no accepted submission share at the ingest (checked before a body
is read, ``trainer/ingest/service.py``) is shared fairly per address allocation, then prefix
(``protocol.ratelimit.FairShare``): one flooder cannot starve the other newcomers.

Old code: one bucket for every unproven address; a flood from one address drained it, and a new
honest worker from anywhere else was answered 429 ``rate_limited`` until the flood stopped."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from ingest_attack_helpers import post, running_ingest, submission

from protocol.identity import NodeKey
from protocol.ingest_api import SUBMISSIONS_ROUTE as SUBMISSIONS
from trainer.ingest.limits import IngestLimits


def session(url: str, ip: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=30),
                                 connector=aiohttp.TCPConnector(local_addr=(ip, 0), force_close=True))


async def test_a_flood_from_one_address_leaves_newcomers_their_share(tmp_path: Path) -> None:
    limits = IngestLimits(unproven_requests_per_s=0.05, unproven_burst=4.0)  # refills one request in 20 s: nothing refills here
    async with running_ingest(tmp_path, limits=limits) as ing:
        async with session(ing.url, "127.61.0.1") as flood:
            codes = [(await post(flood, SUBMISSIONS, submission(NodeKey.generate())))[0] for _ in range(12)]
        assert codes.count(200) == 4 and codes.count(429) == 8, codes  # alone, it had the whole burst, then nothing
        for ip in ("127.62.0.1", "127.63.0.1"):  # newcomers from other /24s: each its share at once (old code: 429)
            async with session(ing.url, ip) as new:
                status, body = await post(new, SUBMISSIONS, submission(NodeKey.generate()))
                assert status == 200 and body["stored"] is True, body
        async with session(ing.url, "127.61.0.1") as flood:
            status, body = await post(flood, SUBMISSIONS, submission(NodeKey.generate()))
            assert status == 429 and body["error"] == "rate_limited" and "127.61.0.0/24" in body["detail"], body
