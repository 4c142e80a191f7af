"""Malformed HTTP from a peer is peer noise, not an error of the node (``node/http_server.py``).

aiohttp logs every request it cannot parse (a chunk size past 2^64, Content-Length with
Transfer-Encoding, an over-long line, an HTTP/2 preface, a bad method after a first good request)
with ``logger.exception``: an ERROR record with a full traceback. Any client could write ~1 KiB
of traceback into a node's log for each ~40-byte junk request, as fast as it can connect, and
push the operator's real errors out of the node page's last-errors list
(:class:`node.web.assets.RecentErrors`, 20 records). Every server started by
:func:`node.http_server.start_site` (ingest, Shardcast, status) must answer such requests with a
4xx and log them at DEBUG only; a failure of the node's own handler stays an ERROR.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from node.http_server import start_site
from node.web.assets import RecentErrors

JUNK = [
    b"GET /ok HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n",
    b"GET /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n",
    b"GET /ok HTTP/1.1\r\nHost: x\r\nX: " + b"b" * 20_000 + b"\r\n\r\n",
    b"GET /ok HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n\x00\xff GARBAGE\r\n\r\n",  # a bad method after a good request
]


class Records(logging.Handler):
    """Every record that reaches the root logger's handlers."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` and read until the server closes (bounded)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.transport.abort()


@pytest.fixture
def captured() -> tuple[Records, RecentErrors]:
    root = logging.getLogger()
    records, page = Records(), RecentErrors()
    root.addHandler(records)
    detach = page.install()
    yield records, page
    detach()
    root.removeHandler(records)


async def test_malformed_requests_are_not_logged_as_errors_and_handler_bugs_are(captured) -> None:
    records, page = captured

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def bug(_request: web.Request) -> web.Response:
        raise RuntimeError("a bug in the node's own handler")

    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/bug", bug)
    server = await start_site(app, "127.0.0.1", 0)
    try:
        for junk in JUNK * 3:
            reply = await _exchange(server.port, junk)
            assert reply.split(b" ", 2)[1:2] in ([b"400"], [b"414"], [b"431"]) or b" 400 " in reply, reply[:200]
        noisy = [r for r in records.records if r.levelno >= logging.WARNING]
        assert noisy == [], [f"{r.name}: {r.getMessage()} ({r.exc_info[0].__name__ if r.exc_info else ''})" for r in noisy]
        assert page.snapshot() == [], "peer junk fills the node page's last errors"
        # the control: a failure of our own handler is still an ERROR with its traceback
        assert b" 500 " in await _exchange(server.port, b"GET /bug HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        errors = [r for r in records.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None and errors[0].exc_info[0] is RuntimeError
        assert [e["level"] for e in page.snapshot()] == ["ERROR"]
        assert b" 200 " in await _exchange(server.port, b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), "still serving"
    finally:
        await server.stop()
