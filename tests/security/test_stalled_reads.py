"""A client that requests a response and never reads it loses its connection once the unsent bytes
stop moving; a slow client that keeps reading keeps its connection (``node/http_server.py``)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from aiohttp import web
from http_helpers import file_app
from waiting import wait_until

from node.http_server import ServerLimits, start_site

pytestmark = pytest.mark.slow

BIG = 16 * 1024 * 1024  # far more than the socket buffers on both sides hold


def _app(piece: Path) -> web.Application:
    app = web.Application()

    async def body(_request: web.Request) -> web.StreamResponse:  # written in chunks (drain-bound)
        resp = web.StreamResponse()
        resp.content_length = BIG
        await resp.prepare(_request)
        chunk = b"\0" * (1 << 20)
        for _ in range(BIG // len(chunk)):
            await resp.write(chunk)
        return resp

    async def file(_request: web.Request) -> web.StreamResponse:  # sendfile, as Shardcast pieces are served
        return web.FileResponse(piece)

    app.router.add_get("/body", body)
    app.router.add_get("/file", file)
    return app


def _connect(port: int, path: str, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # before connecting, so the advertised window is small from the start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/body", "/file"])
async def test_a_client_that_stops_reading_is_cut_off_and_a_slow_reader_is_not(tmp_path: Path, path: str) -> None:
    piece = tmp_path / "piece"
    piece.write_bytes(b"\1" * BIG)
    running = await start_site(_app(piece), "127.0.0.1", limits=ServerLimits(write_stall_s=1.0))
    stalled = _connect(running.port, path, rcvbuf=4096)
    slow = _connect(running.port, path)
    slow.setblocking(False)
    got = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    try:
        def slow_read() -> None:
            nonlocal got
            try:
                got += len(slow.recv(65536))
            except BlockingIOError:
                pass

        # the slow reader keeps taking a little at a time until the stalled one has been cut off
        while running.stalls.aborted == 0:
            slow_read()
            assert loop.time() < deadline, "the stalled client was never cut off"
            assert got < BIG, "the slow reader finished before the stall was detected"
            await asyncio.sleep(0.1)
        assert running.stalls.aborted == 1
        await wait_until(lambda: len(running.stalls.counted) == 1)  # its slot is free again (only the slow reader holds one)
        # the stalled socket sees the abort (after the bytes already in its buffer)
        stalled.settimeout(10)
        with pytest.raises((ConnectionResetError, AssertionError)):
            while True:
                data = stalled.recv(1 << 16)
                assert data, "closed"
        # the slow reader's connection is still served
        before = got
        await wait_until(lambda: (slow_read(), got > before + 65536)[1])
        assert running.stalls.aborted == 1
    finally:
        stalled.close()
        slow.close()
        await running.stop()


@pytest.mark.asyncio
async def test_a_sendfile_cut_off_ends_its_handler_and_leaves_the_loop_serving(tmp_path: Path) -> None:
    """A stalled ``sendfile`` that is cut off must not strand its handler (and open file) on the closed
    descriptor, nor break the next connection that gets that descriptor number (``transport.abort()``
    alone did both: asyncio's sendfile kept its writer registered on the dead descriptor)."""
    piece = tmp_path / "piece"
    piece.write_bytes(b"\1" * BIG)

    app, ended = file_app(piece)
    running = await start_site(app, "127.0.0.1", limits=ServerLimits(write_stall_s=1.0))
    stalled = _connect(running.port, "/file", rcvbuf=4096)
    writers: list[asyncio.StreamWriter] = []
    try:
        await wait_until(lambda: running.stalls.aborted == 1)
        await asyncio.wait_for(ended.wait(), 30)  # the sendfile failed and the handler ended
        await wait_until(lambda: len(running.stalls.counted) == 0)
        # several new connections, all open at once, so one of them (client or server side) gets the
        # freed descriptor number; every one is answered
        for _ in range(4):
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", running.port), 10)
            writers.append(writer)
            writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
    finally:
        for w in writers:
            w.close()
        stalled.close()
        await running.stop()


@pytest.mark.asyncio
async def test_a_client_that_opens_its_window_once_per_watch_period_is_cut_off(tmp_path: Path) -> None:
    """Issue 23: the watch fired only when the unsent bytes stayed unchanged for a whole
    ``write_stall_s``, so a client reading 16 KiB just before each period ended held its
    connection (and handler) forever at ~20 KiB/s. Now a period in which it takes
    less than ``write_min_bps`` ends it; a reader above the floor keeps its connection."""
    piece = tmp_path / "piece"
    piece.write_bytes(b"\1" * BIG)
    running = await start_site(_app(piece), "127.0.0.1", limits=ServerLimits(write_stall_s=1.0, write_min_bps=64 * 1024))
    opener = _connect(running.port, "/body", rcvbuf=4096)
    opener.setblocking(False)
    reader = _connect(running.port, "/file")
    reader.setblocking(False)
    got = {opener: 0, reader: 0}
    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    next_open = loop.time()

    def take(s: socket.socket, n: int) -> None:
        try:
            while n > 0 and (chunk := s.recv(min(n, 1 << 16))):
                got[s] += len(chunk)
                n -= len(chunk)
        except (BlockingIOError, ConnectionResetError):
            pass

    try:
        while running.stalls.aborted == 0:
            assert loop.time() < end, f"the window opener was never cut off (it took {got[opener]} bytes)"
            if loop.time() >= next_open:  # 16 KiB (≈ 20 KiB/s), just often enough that the unsent bytes never sit unchanged for a period
                take(opener, 16 << 10)
                next_open = loop.time() + 0.8
            take(reader, 1 << 16)  # ≈ 640 KiB/s: far above the floor
            await asyncio.sleep(0.1)
        before = got[reader]
        await wait_until(lambda: (take(reader, 1 << 16), got[reader] > before + (1 << 18))[1])
        assert running.stalls.aborted == 1, "only the window opener was cut off"
        assert got[reader] < BIG
    finally:
        opener.close()
        reader.close()
        await running.stop()
