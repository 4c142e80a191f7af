"""Fresh addresses against a full per-address rate limiter (issue 23: nothing a peer sends may hurt
the node that reads it).

The ingest's per-address and per-key limits (submissions, leases and verdicts by address,
submissions by worker key, ``/status``; the run page's too) keep at most ``max_peers`` token
buckets (100,000) and forget the least recently used. The oldest was found by scanning every
bucket: once a long run's addresses, or an attacker with a few IPv6 /48s (a /64 each: 65,536 per
/48), had filled it, each request from an address not yet held cost the event loop 10–90 ms, so a
few hundred fresh addresses froze the ingest for seconds (200 new addresses: 17.7 s of
``allow`` at load 7). A real attacker here: the ingest's address limiter holds 100,000 earlier
addresses; 600 garbage verdict POSTs (refused ``malformed`` after the address check) from 600
addresses it holds, then from 600 it has never seen, 32 at a time; no request from a new address
makes the limiter visit the buckets it holds (the old scan visited all 100,000 for each one), and
``/status`` answers an honest client within 2 s meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
from ingest_attack_helpers import honest_session, running_ingest

FLOOD = 600
AT_ONCE = 32


async def garbage_verdict(port: int, ip: str) -> bytes:
    """One ``POST /ingest/1/verdicts`` of 3 junk bytes from ``ip``; the answer's status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ip, 0))
    try:
        writer.write(b"POST /ingest/1/verdicts HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
        await writer.drain()
        return (await reader.read()).split(b"\r\n", 1)[0]
    finally:
        writer.close()


async def flood(port: int, ips: list[str]) -> list[bytes]:
    """Every address of ``ips`` sends one garbage verdict, :data:`AT_ONCE` at a time; the status lines."""
    sem = asyncio.Semaphore(AT_ONCE)

    async def one(ip: str) -> bytes:
        async with sem:
            return await garbage_verdict(port, ip)

    return await asyncio.gather(*(one(ip) for ip in ips))


class CountedBuckets(OrderedDict):
    """A limiter's buckets that count every key a walk over them visits (``for``, ``min``, keys, values, items)."""

    visited = 0

    def __iter__(self) -> Iterator[str]:
        for key in super().__iter__():
            self.visited += 1
            yield key

    def keys(self):  # OrderedDict's views walk the dict without __iter__
        return list(iter(self))

    def values(self):
        return [self[k] for k in iter(self)]

    def items(self):
        return [(k, self[k]) for k in iter(self)]


@pytest.mark.slow
async def test_fresh_addresses_against_a_full_limiter_cost_what_known_ones_do(tmp_path: Path) -> None:
    known = [f"127.60.{i >> 8}.{i & 255}" for i in range(FLOOD)]
    fresh = [f"127.61.{i >> 8}.{i & 255}" for i in range(FLOOD)]
    async with running_ingest(tmp_path) as ing:
        limiter = ing.service._ip_limiter  # the state 100,000 earlier addresses leave: filled directly (seconds, not hours)
        for i in range(limiter.max_peers - FLOOD):
            limiter.allow(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
        for ip in known:
            limiter.allow(ip)
        assert len(limiter._buckets) == limiter.max_peers
        limiter._buckets = buckets = CountedBuckets(limiter._buckets)

        lines = await flood(ing.server.port, known)
        assert all(b" 400 " in ln for ln in lines), set(lines)

        async def honest_status_during_the_flood() -> None:
            async with honest_session(ing.url) as http:  # gives up after 2 s
                for _ in range(3):
                    async with http.get("/status") as r:
                        assert r.status == 200
                    await asyncio.sleep(0.2)

        honest = asyncio.create_task(honest_status_during_the_flood())
        lines = await asyncio.wait_for(flood(ing.server.port, fresh), timeout=60)
        await honest
        assert all(b" 400 " in ln for ln in lines), set(lines)
        assert len(limiter._buckets) == limiter.max_peers  # still bounded: the oldest went
        # each fresh address took the least recently used bucket's place without a walk over the held
        # ones (the old scan visited all 100,000 for each: ≥ 6 ms per fresh address, ~50 s at load 7)
        assert buckets.visited == 0, buckets.visited
