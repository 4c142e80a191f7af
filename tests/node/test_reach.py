"""Reachability (node/reach.py, doctor --role relay): the coordinator dials the requester back — only its own observed
address, one port, bounded in time and bytes, rate-limited — and doctor prints the fix when a port cannot be reached."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
from aiohttp import web
from localnet import serve_app
from waiting import wait_until

from node.cli import main
from node.commands.doctor_reach import _fix, check_reachability, stand_in
from node.reach import DialBack, request_dialback
from protocol.run_api import reach_path

RUN_ID = bytes(range(32))


def coordinator_app(**limits) -> web.Application:
    app = web.Application()
    DialBack(RUN_ID, **limits).add_routes(app)
    return app


@contextlib.asynccontextmanager
async def coordinator(**limits):
    """A server with the dial-back route only; yields ``(URL, its DialBack)``."""
    app = web.Application()
    dial = DialBack(RUN_ID, **limits)
    dial.add_routes(app)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", dial  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)


async def test_dial_back_reports_what_it_found_within_its_bounds(held_port):
    async with coordinator(timeout_s=0.3, burst=100) as (url, _):
        async with stand_in("shardcast", "127.0.0.1", 0, RUN_ID) as port:
            ok = await request_dialback(url, "shardcast", port)
        assert ok["reachable"] and ok["address"] == "127.0.0.1" and "this run" in ok["detail"]
        async with stand_in("shardcast", "127.0.0.1", 0, bytes(32)) as port:
            other = await request_dialback(url, "shardcast", port)
        assert not other["reachable"] and "another run" in other["detail"]
        async with stand_in("libp2p", "127.0.0.1", 0, RUN_ID) as port:
            assert (await request_dialback(url, "libp2p", port))["reachable"]
            wrong = await request_dialback(url, "shardcast", port)  # a libp2p port is no Shardcast server
        assert not wrong["reachable"]
        closed = held_port()  # held, never listening: a connection to it is refused
        refused = await request_dialback(url, "libp2p", closed)
        assert not refused["reachable"] and "refused" in refused["detail"]

        # a tarpit (accepts, never answers) and a flood (10 MB) cost one bounded attempt each
        async def tarpit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)

        async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1024)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
            with contextlib.suppress(OSError):
                for _ in range(160):
                    writer.write(b"x" * 65536)
                    await writer.drain()
            writer.close()

        for handler, service in ((tarpit, "libp2p"), (tarpit, "shardcast"), (flood, "shardcast")):
            async with raw_server(handler) as port:
                t0 = time.monotonic()
                got = await request_dialback(url, service, port)
                assert not got["reachable"] and time.monotonic() - t0 < 2.0, (service, got)


async def test_dial_back_is_no_reflector():
    async with coordinator(burst=2, rate_per_s=0.01) as (url, _), stand_in("libp2p", "127.0.0.1", 0, RUN_ID) as port, \
            aiohttp.ClientSession() as s:
        # no way to name another host: a forwarded-for header is not believed
        async with s.post(url + reach_path("libp2p", port), headers={"X-Forwarded-For": "192.0.2.1"}) as r:
            assert (await r.json())["address"] == "127.0.0.1"
        async with s.post(url + reach_path("libp2p", port)) as r:
            assert r.status == 200
        async with s.post(url + reach_path("libp2p", port)) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1, "rate-limited per address"
    async with coordinator(burst=100) as (url, _), aiohttp.ClientSession() as s:
        for bad in ("/run/1/reach/ssh/22", "/run/1/reach/libp2p/0", "/run/1/reach/libp2p/65536", "/run/1/reach/libp2p/%EF%BC%98%EF%BC%90"):
            async with s.post(url + bad) as r:
                assert r.status == 400, bad
    async with coordinator(max_concurrent=1, timeout_s=0.5) as (url, dial):

        async def tarpit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)

        async with raw_server(tarpit) as port, aiohttp.ClientSession() as s:
            first = asyncio.ensure_future(s.post(url + reach_path("libp2p", port)))
            await wait_until(lambda: dial.running == 1, what="the first dial-back running")
            async with s.post(url + reach_path("libp2p", port)) as r:
                assert r.status == 503, "dial-backs beyond the bound are refused, not queued"
            (await first).close()


def test_doctor_relay_reachability_both_ways(tmp_path, held_port):
    """Reachable: doctor listens on the relay's ports and the coordinator reaches them. Blocked: the relay would listen on
    127.0.0.2 only, the coordinator dials the address it sees (127.0.0.1): FAIL, and the fix names the port and flag."""
    with serve_app(lambda: coordinator_app(burst=100)) as url:
        http_port, p2p_port = held_port(), held_port()
        ok = check_reachability([url], RUN_ID, host="127.0.0.1", http_port=http_port, p2p_port=p2p_port, public_url="", timeout_s=10)
        assert [c.status for c in ok] == ["PASS", "PASS"], ok
        assert f"127.0.0.1:{http_port}" in ok[0].detail and f"127.0.0.1:{p2p_port}" in ok[1].detail
        blocked = check_reachability([url], RUN_ID, host="127.0.0.2", http_port=http_port, p2p_port=p2p_port, public_url="",
                                     timeout_s=10)
        assert [c.status for c in blocked] == ["FAIL", "FAIL"], blocked
        assert f"cannot reach 127.0.0.1:{http_port}" in blocked[0].detail and "--host 0.0.0.0" in blocked[0].fix
        assert "--listen-host 0.0.0.0" in blocked[1].fix
        lazy = check_reachability([url], RUN_ID, host="127.0.0.1", http_port=0, p2p_port=0, public_url="", timeout_s=10)
        assert [c.status for c in lazy] == ["PASS", "PASS"] and "with --http-port fixed, check that one" in lazy[0].detail, lazy
        wrong = check_reachability([url], RUN_ID, host="127.0.0.1", http_port=http_port, p2p_port=p2p_port,
                                   public_url=f"http://198.51.100.7:{http_port}", timeout_s=10)
        assert wrong[0].status == "WARN" and f"--public-url http://127.0.0.1:{http_port}" in wrong[0].fix


def test_fix_names_port_address_and_flags():
    fix = _fix("shardcast", "--http-port", "0.0.0.0", 8700, "203.0.113.6", True, "")
    assert "open TCP port 8700" in fix and "forward TCP 8700 on 203.0.113.6" in fix and "--public-url http://203.0.113.6:8700" in fix
    assert "choose a fixed port with --p2p-port" in _fix("libp2p", "--p2p-port", "0.0.0.0", 40111, "203.0.113.6", False, "")


@pytest.mark.slow
def test_doctor_command_prints_the_fix(tmp_path, capsys, held_port):
    """The command end to end against a spec whose ingest URL is the dial-back server."""
    from protocol.identity import NodeKey
    from protocol.runspec import NetworkSpec, RunInfo, RunSpec, dump_run_spec, sign_run_spec

    key = NodeKey.generate()
    with serve_app(coordinator_app) as url:
        signed = sign_run_spec(RunSpec(run=RunInfo(coordinator=key.peer_id), network=NetworkSpec(ingest_urls=[url])), key)
        run = tmp_path / "run.toml"
        run.write_text(dump_run_spec(signed))
        port = held_port()
        rc = main(["doctor", "--run", str(run), "--role", "relay", "--host", "127.0.0.2", "--http-port", str(port),
                   "--gossip-wait", "0", "--timeout", "1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"FAIL  reachable: HTTP (Shardcast) port the coordinator cannot reach 127.0.0.1:{port}" in out
    assert "fix: the relay would listen on 127.0.0.2 only: pass --host 0.0.0.0" in out
