"""A connection pushed out by the total connection cap while its response is being sent with
``sendfile`` ends its handler and leaves the server serving (``node/http_server.py``).

When the total cap is full, a newcomer from a lighter address takes the place of the heaviest
address's oldest connection. A hostile client can hold that oldest connection in the middle of a
``sendfile`` (it asks for a piece and does not read) and then connect from another address:
``transport.abort()`` alone left asyncio's sendfile waiting on the closed descriptor, so the
handler (and its open piece file) never ended and the next connection given that descriptor
number hung.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from http_helpers import file_app

from node.http_server import ServerLimits, start_site

BIG = 16 * 1024 * 1024


def _stalled_get(port: int, local_ip: str) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small window: the sendfile stays pending
    s.bind((local_ip, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /file HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


@pytest.mark.asyncio
async def test_an_evicted_sendfile_connection_ends_its_handler(tmp_path: Path) -> None:
    piece = tmp_path / "piece"
    piece.write_bytes(b"\1" * BIG)
    started = asyncio.Event()

    app, ended = file_app(piece, started=started)
    # write_stall_s far beyond the test: only the eviction may end the stalled sendfile
    running = await start_site(app, "127.0.0.1", limits=ServerLimits(max_connections=2, write_stall_s=3600.0))
    socks: list[socket.socket] = []
    writers: list[asyncio.StreamWriter] = []
    try:
        socks.append(_stalled_get(running.port, "127.0.0.2"))
        await asyncio.wait_for(started.wait(), 10)  # the sendfile of the oldest connection is under way
        socks.append(_stalled_get(running.port, "127.0.0.2"))  # 127.0.0.2 is the heaviest address, at the total cap
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while len(running.stalls.counted) < 2:
            assert loop.time() < end, "the second connection was never counted"
            await asyncio.sleep(0.02)
        # a newcomer from a lighter address: the oldest connection of 127.0.0.2 makes room for it
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", running.port, local_addr=("127.0.0.3", 0)), 10)
        writers.append(writer)
        writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(ended.wait(), 10)  # the evicted connection's sendfile failed and its handler ended
        writer.close()
        writers.clear()
        # more connections, all open at once, so one gets the freed descriptor number; each is answered
        for i in range(4):
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", running.port, local_addr=(f"127.0.0.{4 + i}", 0)), 10)
            writers.append(writer)
            writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
    finally:
        for w in writers:
            w.close()
        for s in socks:
            s.close()
        await running.stop()
