"""node/http_read.py: a body that arrives in pieces is read whole; one over the limit is refused
after at most limit + 1 bytes, declared or not."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from node.http_read import BodyTooLarge, read_body

PIECES = [b"a" * 3000, b"b" * 3000, b"c" * 3000]


async def _serve(handler):
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # bound at 0: read back
    return runner, f"http://127.0.0.1:{port}/"


async def _pieces(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()  # chunked: no Content-Length
    await resp.prepare(request)
    for piece in PIECES:
        await resp.write(piece)
        await asyncio.sleep(0.05)  # paced, so the pieces usually arrive apart (one read of the stream returns only what arrived)
    await resp.write_eof()
    return resp


async def _declared(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * 20_000)


async def test_a_body_in_pieces_is_read_whole_and_an_oversized_one_refused() -> None:
    runner, url = await _serve(_pieces)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:
                assert await read_body(r, 9000) == b"".join(PIECES)
            async with s.get(url) as r:
                with pytest.raises(BodyTooLarge, match="over the 8999-byte limit"):
                    await read_body(r, 8999)
    finally:
        await runner.cleanup()
    runner, url = await _serve(_declared)
    try:
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            with pytest.raises(BodyTooLarge, match="20000 bytes declared"):
                await read_body(r, 10_000)
    finally:
        await runner.cleanup()
