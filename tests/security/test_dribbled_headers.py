"""A Shardcast source that sends its response head one byte at a time cannot hold a request open.

The download's timeouts are socket-level (``sock_read``: silence), and the body deadlines start
once the head is complete; aiohttp re-arms ``sock_read`` on every byte, and a head may hold 128
header lines of 8 KiB. So a hostile relay (any key can publish a relay record) that answers
``HTTP/1.1 200 OK`` and then one header byte every 50 ms kept a manifest or ``/held`` request
waiting for days; :func:`node.shardcast.client.resolve_manifest` waits for every source until
one has a valid manifest, so a validator whose origin was briefly unreachable stopped judging
for good. Each request now has a whole-request deadline.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))  # the Shardcast test fixtures live there

from shardcast_fixtures import make_run

from node.shardcast.download import DownloadConfig, SourceError, get_held, get_manifest, make_session

pytestmark = pytest.mark.slow

CFG = DownloadConfig(connect_timeout_s=1.0, manifest_timeout_s=0.5, held_timeout_s=0.5, max_manifest_bytes=64 << 10)


class Dribbler:
    """Answers any request with a status line, then one header byte every 50 ms (≤ 2,000 bytes)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.requests = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests.set()
            writer.write(b"HTTP/1.1 200 OK\r\n")
            for i in range(2000):
                writer.write(b": y\r\n" if i % 40 == 39 else b"X")
                await writer.drain()
                self.bytes_sent += 1
                await asyncio.sleep(0.05)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.parametrize("what", ["manifest", "held"])
async def test_a_dribbled_response_head_ends_the_request(what: str) -> None:
    run = make_run()
    dribbler = Dribbler()
    async with dribbler as url:
        session = make_session(CFG)
        try:
            if what == "manifest":
                call = get_manifest(session, url, 3, run_id=run.run_id, authorities=run.authorities, timeout_s=CFG.manifest_timeout_s, cfg=CFG)
            else:
                call = get_held(session, url, timeout_s=CFG.held_timeout_s, cfg=CFG)
            # the bound here is only the test's own guard: the deadline in the code is a few seconds
            with pytest.raises(SourceError) as err:
                await asyncio.wait_for(call, 60)
        finally:
            await session.close()
    assert dribbler.requests.is_set() and dribbler.bytes_sent > 0, "the source was asked and was dribbling"
    assert err.value.reason == "slow" and not err.value.evidence, err.value
