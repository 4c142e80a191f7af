"""A hostile peer answering the node's small fetches: the dial-back client (``request_dialback``)
and ``read_body`` under an endless body, a 100 MB declared body, deeply nested JSON and garbage.

Each test starts a local aiohttp server on port 0 playing the peer and asserts the node refuses
with a clear error and reads no more than its limit (``asyncio.wait_for`` is only a safety net).
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from node.http_read import BodyTooLarge, read_body
from node.reach import request_dialback
from protocol.run_api import REACH_ANSWER_MAX_BYTES

SAFETY_S = 30.0


async def _serve(handler, method: str = "GET") -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route(method, "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _declared_then_hang(first: bytes, release: asyncio.Event):
    """A handler declaring a 100 MB body, sending ``first``, then holding the connection until ``release``:
    the reader must refuse on the declared length, not wait for the rest."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(100 << 20)})
        await resp.prepare(request)
        await resp.write(first)
        try:
            await asyncio.wait_for(release.wait(), SAFETY_S)
        except TimeoutError:
            pass
        return resp

    return handler


def _endless(sent: list[int]):
    """A handler streaming a chunked body that never ends; ``sent[0]`` counts bytes written."""
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        chunk = b"x" * 65536
        try:
            for _ in range(100_000):  # bounded: 6.5 GB, never reached
                await resp.write(chunk)
                sent[0] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return resp
    return handler


async def test_read_body_stops_an_endless_chunked_body_at_its_limit() -> None:
    sent = [0]
    runner, base = await _serve(_endless(sent))
    limit = 100_000
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{base}/x") as r:
            assert r.content_length is None
            with pytest.raises(BodyTooLarge, match="over the 100000-byte limit"):
                await asyncio.wait_for(read_body(r, limit), SAFETY_S)
            # the stream's buffer may hold a few read-ahead chunks, never the endless body
            assert r.content.total_bytes <= limit + 1 + (4 << 20)
    finally:
        await runner.cleanup()


async def test_read_body_refuses_a_100_mb_declared_length_before_reading() -> None:
    release = asyncio.Event()
    handler = _declared_then_hang(b"y" * 1024, release)

    runner, base = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{base}/x") as r:
            with pytest.raises(BodyTooLarge, match=f"{100 << 20} bytes declared"):
                await asyncio.wait_for(read_body(r, 4096), SAFETY_S)
            assert r.content.total_bytes <= 64 << 10
    finally:
        release.set()
        await runner.cleanup()


async def test_dialback_client_refuses_an_endless_answer() -> None:
    sent = [0]
    runner, base = await _serve(_endless(sent), "POST")
    try:
        with pytest.raises(OSError, match="no JSON"):
            await asyncio.wait_for(request_dialback(base, "shardcast", 4001, timeout_s=20.0), SAFETY_S)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("body", [b"\xff\xfe\x00garbage\x80", b"", b"[1,2,3]", b'"just a string"'], ids=["non-utf8", "empty", "list", "string"])
async def test_dialback_client_refuses_garbage_answers(body: bytes) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    runner, base = await _serve(handler, "POST")
    try:
        with pytest.raises(OSError, match="no JSON"):
            await asyncio.wait_for(request_dialback(base, "shardcast", 4001, timeout_s=20.0), SAFETY_S)
    finally:
        await runner.cleanup()


async def test_dialback_client_refuses_a_deeply_nested_json_answer() -> None:
    depth = (REACH_ANSWER_MAX_BYTES - 2) // 2
    body = b"[" * depth + b"]" * depth
    assert len(body) <= REACH_ANSWER_MAX_BYTES

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    runner, base = await _serve(handler, "POST")
    try:
        with pytest.raises(OSError):
            await asyncio.wait_for(request_dialback(base, "shardcast", 4001, timeout_s=20.0), SAFETY_S)
    finally:
        await runner.cleanup()


async def test_dialback_client_checks_the_seconds_field() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"reachable": True, "address": "1.2.3.4", "detail": "ok", "seconds": {"a": [[[["x" * 1000]]]]}})

    runner, base = await _serve(handler, "POST")
    try:
        try:
            answer = await asyncio.wait_for(request_dialback(base, "shardcast", 4001, timeout_s=20.0), SAFETY_S)
        except OSError:
            return
        assert answer["seconds"] is None or isinstance(answer["seconds"], (int, float))
    finally:
        await runner.cleanup()


async def test_dialback_client_clips_a_hostile_refusal_detail() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"detail": "z" * 3000}, status=403)

    runner, base = await _serve(handler, "POST")
    try:
        with pytest.raises(OSError, match="refused the dial-back") as e:
            await asyncio.wait_for(request_dialback(base, "shardcast", 4001, timeout_s=20.0), SAFETY_S)
        assert len(str(e.value)) < 400 and "\n" not in str(e.value)
    finally:
        await runner.cleanup()


# --- the run spec fetched from an address (node/bootstrap.py) -------------------------------------

def _address(base: str):
    from protocol.address import RunAddress
    from protocol.identity import NodeKey

    return RunAddress(coordinator=NodeKey.from_seed(b"\x07" * 32).peer_id, run_id_prefix="", http_urls=(base,), bootstrap=())


async def test_fetch_spec_refuses_an_endless_spec() -> None:
    from node.bootstrap import JoinError, fetch_spec

    sent = [0]
    runner, base = await _serve(_endless(sent))
    try:
        with pytest.raises(JoinError, match="too large"):
            await asyncio.wait_for(fetch_spec(_address(base), timeout_s=20.0), SAFETY_S)
    finally:
        await runner.cleanup()


async def test_fetch_spec_refuses_a_100_mb_declared_spec_without_reading_it() -> None:
    from node.bootstrap import JoinError, fetch_spec

    release = asyncio.Event()
    handler = _declared_then_hang(b"[run]\n", release)

    runner, base = await _serve(handler)
    try:
        with pytest.raises(JoinError, match="declared"):
            await asyncio.wait_for(fetch_spec(_address(base), timeout_s=20.0), SAFETY_S)
    finally:
        release.set()
        await runner.cleanup()


async def test_fetch_spec_gives_up_on_a_dribbled_spec() -> None:
    from node.bootstrap import LocationsUnavailable, fetch_spec

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            for _ in range(200):  # one byte every 50 ms, bounded at 10 s
                await resp.write(b"#")
                await asyncio.sleep(0.05)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    runner, base = await _serve(handler)
    try:
        with pytest.raises(LocationsUnavailable, match="unreachable"):
            await asyncio.wait_for(fetch_spec(_address(base), timeout_s=1.0), SAFETY_S)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("body", [b"\xff\xfe[run]\n\x80\x81", b"a = " + b"[" * 5000 + b"]" * 5000, b"\x00" * 4096],
                         ids=["non-utf8", "nested-toml", "nul-bytes"])
async def test_fetch_spec_refuses_garbage_in_one_line(body: bytes) -> None:
    from node.bootstrap import JoinError, fetch_spec

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body)

    runner, base = await _serve(handler)
    try:
        with pytest.raises(JoinError) as e:
            await asyncio.wait_for(fetch_spec(_address(base), timeout_s=20.0), SAFETY_S)
        assert "\n" not in str(e.value) and len(str(e.value)) < 600
    finally:
        await runner.cleanup()


# --- the worker standing `status` fetches (node/commands/status.py) ---------------------------------

def _standing_run():
    from protocol.identity import NodeKey
    from protocol.runspec import RunInfo, RunSpec, sign_run_spec

    coord = NodeKey.from_seed(b"\x11" * 32)
    return coord, sign_run_spec(RunSpec(run=RunInfo(coordinator=coord.peer_id, validators=[coord.peer_id], seed=1)), coord)


def _standing(coord, run_id: bytes, worker: str) -> bytes:
    from protocol.envelope import seal
    from protocol.messages import WorkerStanding

    body = WorkerStanding(worker=worker, trainer_step=1, pending=0, accepted=5, rejected=0, stale=0, trained=5, rollouts_trained=5,
                          displaced=0, place=1, workers=1)
    return seal(coord, run_id, body)


async def test_fetch_standing_refuses_an_endless_standing() -> None:
    from node.commands.status import fetch_standing
    from protocol.identity import NodeKey

    _, signed = _standing_run()
    sent = [0]
    runner, base = await _serve(_endless(sent))
    try:
        with pytest.raises(OSError, match="byte limit"):
            await asyncio.wait_for(fetch_standing([base], signed, NodeKey.from_seed(b"\x12" * 32).peer_id), SAFETY_S)
    finally:
        await runner.cleanup()


def _nested_msgpack(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # fixarray of one, nested ``depth`` times, around nil


@pytest.mark.parametrize("body", [_nested_msgpack(15_000), b"\xff\xfe garbage \x80", b"\xdf\xff\xff\xff\xff"],
                         ids=["nested-msgpack", "garbage", "huge-map-header"])
async def test_fetch_standing_refuses_hostile_msgpack_in_one_line(body: bytes) -> None:
    from node.commands.status import fetch_standing
    from protocol.identity import NodeKey
    from protocol.messages import WorkerStanding

    assert len(body) <= WorkerStanding.MAX_BYTES
    _, signed = _standing_run()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/msgpack")

    runner, base = await _serve(handler)
    try:
        with pytest.raises(OSError, match="not a standing signed") as e:
            await asyncio.wait_for(fetch_standing([base], signed, NodeKey.from_seed(b"\x12" * 32).peer_id), SAFETY_S)
        assert "\n" not in str(e.value)
    finally:
        await runner.cleanup()


async def test_fetch_standing_refuses_another_workers_genuine_standing() -> None:
    from node.commands.status import fetch_standing
    from protocol.identity import NodeKey

    coord, signed = _standing_run()
    me, other = NodeKey.from_seed(b"\x12" * 32).peer_id, NodeKey.from_seed(b"\x13" * 32).peer_id
    raw = _standing(coord, signed.run_id, other)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=raw, content_type="application/msgpack")

    runner, base = await _serve(handler)
    try:
        with pytest.raises(OSError, match="another worker"):
            await asyncio.wait_for(fetch_standing([base], signed, me), SAFETY_S)
    finally:
        await runner.cleanup()


# --- gossip envelopes through the TopicGate (node/p2p/topics.py) ------------------------------------

class _Host:
    """The part of P2PHost the gate's validator calls."""

    def __init__(self) -> None:
        self.banned: list[str] = []

    def message_id(self, msg) -> bytes:
        return msg.from_id + msg.seqno

    def ban(self, peer_id) -> None:
        self.banned.append(str(peer_id))


@pytest.mark.parametrize("data", [
    _nested_msgpack(100_000),
    b"\x91" * 200 + b"\xc0",
    b"\xdf\xff\xff\xff\xff" + b"\x00" * 16,
    b"\xdd\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff" + b"x" * 64,
    b"\x85" + b"\xa1a\x91" * 5000,
    b"\xff" * (4 << 20),
], ids=["nested-100k", "nested-200", "huge-map-header", "huge-array-header", "huge-bin-header", "nested-map", "oversized-4mb"])
def test_topic_gate_rejects_hostile_envelopes_without_raising(data: bytes) -> None:
    from libp2p.peer.id import ID
    from libp2p.pubsub.pb import rpc_pb2

    from node.p2p.config import GossipConfig
    from node.p2p.topics import TopicGate
    from protocol.identity import NodeKey

    coord, signed = _standing_run()
    me, hostile = NodeKey.from_seed(b"\x21" * 32), NodeKey.from_seed(b"\x22" * 32)
    gate = TopicGate(signed.run_id, signed.spec.authorities, peer_id=me.peer_id, config=GossipConfig(), heartbeat_interval_s=5.0,
                     split_records=True)
    host = _Host()
    forwarder = ID.from_base58(hostile.peer_id)
    validate = gate.validator("verdicts", host)  # type: ignore[arg-type]
    msg = rpc_pb2.Message(from_id=forwarder.to_bytes(), data=data, seqno=b"\x00" * 8, topicIDs=["verdicts"])
    assert validate(forwarder, msg) is False
    assert sum(gate.rejected.values()) == 1, gate.rejected
    if len(data) > 1 << 20:  # refused for its size before a byte is decoded, and counted so
        assert gate.rejected == {"oversized": 1}, gate.rejected
    assert gate.take(host.message_id(msg)) is None
