"""Sybil junk against the ingest's admission and lease order (issue 23, item 4; ``trainer/ledger/leasing.py``).

Junk from many addresses and free keys used to fill the disk quota (66 addresses × 64 pending
each > 4,096 files: honest submissions got 507) and, leased addresses-oldest-first, to take the
validators' time: training stalled and an honest worker's accepted rate fell from 0.9/s to
0.03/s. Now workers with no accepted submission are on probation: together they hold at most
``probation_share`` of the disk quota, and they get one lease slot in ``PROBATION_EVERY`` while
established workers have work. A real attacker process floods from 16 or 66 loopback addresses
(each its own /24) with fresh keys; an established honest worker's next submission is stored
within 2 s, the next lease hands it out first, and ``/status`` answers within 2 s.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ingest_attack_helpers import VALIDATOR, honest_session, post, running_ingest, submission, verdict
from waiting import wait_until

from protocol import encoding
from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.messages import LeaseRequest
from trainer.ingest.limits import IngestLimits

HERE = Path(__file__).resolve().parent
SUBMISSIONS = "/ingest/1/submissions"

FLOOD = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, sys.argv[3])
    import aiohttp
    from ingest_attack_helpers import submission
    from protocol.identity import NodeKey

    url, ips = sys.argv[1], sys.argv[2].split(",")
    codes = {}

    async def flood(ip):  # a fresh key per submission, as fast as the ingest takes them
        async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(local_addr=(ip, 0))) as http:
            while True:
                async with http.post("/ingest/1/submissions", data=submission(NodeKey.generate())) as r:
                    await r.read()
                    codes[r.status] = codes.get(r.status, 0) + 1
                    if r.status != 200:
                        if sum(n for code, n in codes.items() if code != 200) == 1:
                            print("refused", r.status, flush=True)  # held to its share: the test waits for this line
                        await asyncio.sleep(0.2)

    async def main():
        tasks = [asyncio.create_task(flood(ip)) for ip in ips]
        print("ready", flush=True)  # flooding: the test waits for the junk to fill its share
        await asyncio.to_thread(sys.stdin.read)  # until the test closes stdin
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        print("codes", " ".join(f"{k}={v}" for k, v in sorted(codes.items())), flush=True)

    asyncio.run(main())
""")


@pytest.mark.slow
@pytest.mark.parametrize("addresses", [16, 66])
async def test_junk_from_many_addresses_neither_refuses_nor_delays_an_established_worker(tmp_path: Path, addresses: int) -> None:
    limits = IngestLimits(max_disk_files=64, max_pending_per_ip=8)
    ips = [f"127.{1 + i}.0.1" for i in range(addresses)]
    honest = NodeKey.generate()
    async with running_ingest(tmp_path, limits=limits) as ing:
        async with honest_session(ing.url) as http:  # the honest worker is established before the attack
            status, body = await post(http, SUBMISSIONS, first := submission(honest, counter=0))
            assert status == 200, body
            assert ing.service.apply_verdict(verdict(first, True, "ok")) is True
        proc = subprocess.Popen([sys.executable, "-c", FLOOD, ing.url, ",".join(ips), str(HERE)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=60)
            assert line.strip() == "ready", line
            share = int(limits.probation_share * limits.max_disk_files)
            await wait_until(lambda: ing.store.counts()["pending"] >= share, timeout_s=60, what="the junk filling its share")
            async with honest_session(ing.url) as http:
                async with http.get("/status") as r:
                    assert r.status == 200
                status, body = await post(http, SUBMISSIONS, submission(honest, counter=1))
                assert status == 200 and body["stored"] is True, body  # not 507: the junk holds only its share
                lease = seal(VALIDATOR, ing.ledger.run_id, LeaseRequest(limit=1, lease_s=30.0))
                async with http.post("/ingest/1/lease", data=lease) as r:
                    assert r.status == 200
                    leased = encoding.unpackb(await r.read(), 1 << 26)["submissions"]
            assert leased == [submission_bytes(ing, body["id"])]  # first in line, whatever piled up
            assert ing.store.counts()["pending"] <= share + 1  # the junk's share, plus the honest one
            # the attacker is refused once its share is full (it may not have posted past it yet under load: wait for it)
            refused = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=60)
            assert refused.startswith("refused 507") or refused.startswith("refused 429"), refused
        finally:
            proc.stdin.close()  # type: ignore[union-attr]
            out = await asyncio.wait_for(asyncio.to_thread(proc.stdout.read), timeout=60)  # type: ignore[union-attr]
            proc.wait(30)
        assert "507=" in out or "429=" in out, out  # the attacker was held to its share


def submission_bytes(ing, sid: str) -> bytes:  # type: ignore[no-untyped-def]
    return ing.store.read(sid)



async def test_new_addresses_share_one_submission_rate_and_a_proven_address_keeps_its_own(tmp_path: Path) -> None:
    """Addresses none of whose submissions was ever accepted share one bucket (refused before their
    bodies are read): three of them posting 90 submissions at once get most refused with 429, while
    an address with an accepted submission posts on within its own rate."""
    import aiohttp

    limits = IngestLimits(unproven_requests_per_s=5.0, unproven_burst=10.0)
    honest = NodeKey.generate()
    async with running_ingest(tmp_path, limits=limits) as ing:
        async with honest_session(ing.url) as http:
            status, body = await post(http, SUBMISSIONS, first := submission(honest, counter=0))
            assert status == 200, body
            assert ing.service.apply_verdict(verdict(first, True, "ok")) is True  # 127.0.0.1 is proven now
        codes: list[int] = []
        for ip in ("127.9.0.1", "127.9.1.1", "127.9.2.1"):
            async with aiohttp.ClientSession(base_url=ing.url, connector=aiohttp.TCPConnector(local_addr=(ip, 0))) as evil:
                answers = await asyncio.gather(*(post(evil, SUBMISSIONS, submission(NodeKey.generate())) for _ in range(30)))
                codes += [status for status, _ in answers]
                assert all(b["error"] == "rate_limited" for status, b in answers if status == 429)
        assert codes.count(200) <= 10 + 5 * 10 and codes.count(429) >= 30, codes  # the bucket, and what refilled meanwhile (≤ 10 s)
        async with honest_session(ing.url) as http:
            for c in range(1, 4):
                status, body = await post(http, SUBMISSIONS, submission(honest, counter=c))
                assert status == 200, body


async def test_a_new_worker_from_its_own_prefix_gets_in_while_fresh_keys_hold_probations_share(tmp_path: Path) -> None:
    """Fresh keys from three /24s fill probation's share (8); a new worker from a fourth /24 is stored
    (it displaces the heaviest prefix's newest unleased submission: ``docs/protocol.md`` "Quotas"),
    while one more from the heaviest prefix is refused before its body is read. Old code: 507
    ``probation_quota`` for the new worker until the junk was judged."""
    import aiohttp

    limits = IngestLimits(max_disk_files=16, max_pending_per_ip=64)
    async with running_ingest(tmp_path, limits=limits) as ing:
        stored: dict[str, list[str]] = {}
        for ip, n in (("127.31.0.1", 4), ("127.32.0.1", 2), ("127.33.0.1", 2)):
            async with aiohttp.ClientSession(base_url=ing.url, connector=aiohttp.TCPConnector(local_addr=(ip, 0))) as evil:
                for _ in range(n):
                    status, body = await post(evil, SUBMISSIONS, submission(NodeKey.generate()))
                    assert status == 200, body
                    stored.setdefault(ip, []).append(body["id"])
        async with aiohttp.ClientSession(base_url=ing.url, connector=aiohttp.TCPConnector(local_addr=("127.31.0.1", 0))) as evil:
            status, body = await post(evil, SUBMISSIONS, submission(NodeKey.generate()))
            assert status == 507 and body["error"] == "probation_quota", body
        async with aiohttp.ClientSession(base_url=ing.url, connector=aiohttp.TCPConnector(local_addr=("127.34.0.1", 0))) as new:
            status, body = await post(new, SUBMISSIONS, submission(NodeKey.generate()))
            assert status == 200 and body["stored"] is True, body
            async with new.get("/status") as r:
                assert (await r.json())["submissions"]["displaced"] == 1
        assert ing.ledger.get(stored["127.31.0.1"][-1]).state.value == "displaced"
        assert ing.store.counts()["pending"] == 8
