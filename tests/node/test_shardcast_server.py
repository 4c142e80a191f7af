"""Shardcast HTTP server: routes, Range, and clean 4xx answers to bad requests."""

from __future__ import annotations

import asyncio
import hashlib
import json

import aiohttp
import pytest
from shardcast_fixtures import make_run, make_store, publish, serving, write_checkpoint

from protocol.shardcast import ROUTE_PREFIX, iter_pieces, open_manifest


@pytest.fixture
async def served(tmp_path):
    run = make_run()
    store = make_store(run, tmp_path / "node")
    ckpt = write_checkpoint(tmp_path / "m.safetensors", 0.5)
    env = publish(run, store, ckpt, 3)
    async with serving(store) as server, aiohttp.ClientSession(auto_decompress=False) as s:
        yield run, store, env, ckpt.read_bytes(), server, s


async def _get(s, url, **kw):
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=10), **kw) as r:
        return r.status, r.headers, await r.read()


async def test_held_and_manifests(served):
    run, store, env, _, server, s = served
    st, _, body = await _get(s, f"{server.url}{ROUTE_PREFIX}/held")
    doc = json.loads(body)
    assert st == 200 and doc["held_steps"] == [3] and doc["steps"] == [3] and doc["run_id"] == run.run_id.hex()
    for name in ("latest", "3"):
        st, h, body = await _get(s, f"{server.url}{ROUTE_PREFIX}/manifests/{name}")
        assert st == 200 and body == env.raw and h["X-Shardcast-Step"] == "3" and h["X-Shardcast-Complete"] == "1"
        assert open_manifest(body, run_id=run.run_id, authorities=run.authorities).body.step == 3
    assert (await _get(s, f"{server.url}{ROUTE_PREFIX}/manifests/4"))[0] == 404
    for bad in ("-1", "abc", "1" * 20, "1.5"):
        assert (await _get(s, f"{server.url}{ROUTE_PREFIX}/manifests/{bad}"))[0] == 400


async def test_pieces_with_range(served):
    _, _, env, data, server, s = served
    ref = list(iter_pieces(env.body))[1]
    want = data[ref.offset_bytes : ref.offset_bytes + ref.size_bytes]
    url = f"{server.url}{ROUTE_PREFIX}/pieces/{ref.piece_id.hex()}"
    st, h, body = await _get(s, url)
    assert st == 200 and body == want and int(h["Content-Length"]) == ref.size_bytes and "immutable" in h["Cache-Control"]
    assert h["Accept-Ranges"] == "bytes"
    st, h, body = await _get(s, url, headers={"Range": "bytes=100-199"})
    assert st == 206 and body == want[100:200] and h["Content-Range"] == f"bytes 100-199/{ref.size_bytes}"
    st, _, body = await _get(s, url, headers={"Range": "bytes=-10"})
    assert st == 206 and body == want[-10:]
    for zero in ("bytes=-0", "bytes=-000"):  # a suffix of no bytes selects nothing: 416 (RFC 9110 §14.1.1), not the whole piece
        st, h, body = await _get(s, url, headers={"Range": zero})
        assert st == 416 and h["Content-Range"] == f"bytes */{ref.size_bytes}" and len(body) < 100
    async with s.head(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        assert r.status == 200 and int(r.headers["Content-Length"]) == ref.size_bytes
    assert server.pieces_served >= 3


@pytest.mark.parametrize(
    ("path", "headers", "statuses"),
    [
        ("pieces/{pid}", {"Range": "bytes=99999999-"}, {416}),
        ("pieces/{pid}", {"Range": "bytes=500-100"}, {416}),
        ("pieces/{pid}", {"Range": "bytes=abc"}, {416}),
        ("pieces/{pid}", {"Range": "lines=1-2"}, {416}),
        ("pieces/{pid}", {"Range": "bytes=-0"}, {416}),
        ("pieces/" + "0" * 64, {}, {404}),
        ("pieces/xyz", {}, {400}),
        ("pieces/" + "A" * 64, {}, {400}),
        ("pieces/../../etc/passwd", {}, {400, 404}),
        ("nope", {}, {404}),
    ],
)
async def test_bad_requests_are_clean_4xx(served, path, headers, statuses):
    _, _, env, data, server, s = served
    pid = env.body.files[0].pieces[0].hex()
    st, _, _ = await _get(s, f"{server.url}{ROUTE_PREFIX}/{path.format(pid=pid)}", headers=headers)
    assert st in statuses
    st, _, body = await _get(s, f"{server.url}{ROUTE_PREFIX}/pieces/{pid}")
    assert st == 200 and body == data[: len(body)], "server keeps serving"


async def test_bodies_and_garbage_do_not_break_the_server(served):
    _, _, env, data, server, s = served
    async with s.post(f"{server.url}{ROUTE_PREFIX}/held", data=b"x" * (1 << 20), timeout=aiohttp.ClientTimeout(total=10)) as r:
        assert r.status in (405, 413)
    for junk in (b"GARBAGE\r\n\r\n", b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\n\r\n", b"\x00\xff" * 100, b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"):
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.port), 5)
        writer.write(junk)
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(200), 5)
        assert reply == b"" or reply[:12] in (b"HTTP/1.1 400", b"HTTP/1.0 400", b"HTTP/1.1 414", b"HTTP/1.0 414", b"HTTP/1.1 431", b"HTTP/1.0 431")
        writer.close()
    # a client that disconnects mid-piece
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.port), 5)
    writer.write(f"GET {ROUTE_PREFIX}/pieces/{env.body.files[0].pieces[0].hex()} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    await asyncio.wait_for(reader.read(1000), 5)
    writer.transport.abort()
    st, _, body = await _get(s, f"{server.url}{ROUTE_PREFIX}/manifests/latest")
    assert st == 200 and body == env.raw


async def test_piece_deleted_while_listed_is_404(served):
    _, store, env, _, server, s = served
    pid = env.body.files[0].pieces[0]
    store.piece_path(pid).unlink()
    assert (await _get(s, f"{server.url}{ROUTE_PREFIX}/pieces/{pid.hex()}"))[0] == 404


async def test_request_for_a_piece_being_filled_waits_for_it(tmp_path):
    run = make_run()
    origin = make_store(run, tmp_path / "origin")
    env = publish(run, origin, write_checkpoint(tmp_path / "m.safetensors", 0.5), 1)
    mirror = make_store(run, tmp_path / "mirror")
    mirror.add_manifest(env.raw)  # step 1 being filled: no pieces yet
    ref = next(iter_pieces(env.body))
    data = origin.piece_path(ref.piece_id).read_bytes()
    other = hashlib.sha256(b"not listed").hexdigest()
    async with serving(mirror) as server, aiohttp.ClientSession(auto_decompress=False) as s:
        assert (await _get(s, f"{server.url}{ROUTE_PREFIX}/pieces/{other}"))[0] == 404, "unknown pieces are not waited for"
        req = asyncio.create_task(_get(s, f"{server.url}{ROUTE_PREFIX}/pieces/{ref.piece_id.hex()}"))
        end = asyncio.get_running_loop().time() + 5.0
        while ref.piece_id not in server._waiters:  # the event: the request is parked on the piece
            assert not req.done(), "held until the piece arrives, not answered 404"
            assert asyncio.get_running_loop().time() < end, "the request never waited for the piece"
            await asyncio.sleep(0.01)
        assert not req.done()
        w = mirror.piece_writer(ref.piece_id, ref.size_bytes)
        w.write(data)
        w.commit()
        server.piece_stored(ref.piece_id)
        status, _, body = await asyncio.wait_for(req, 5)
        assert status == 200 and body == data
        server.piece_wait_s = 0.2
        missing = list(iter_pieces(env.body))[1]
        assert (await _get(s, f"{server.url}{ROUTE_PREFIX}/pieces/{missing.piece_id.hex()}"))[0] == 404, "404 after the wait"
