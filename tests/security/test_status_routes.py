"""Attack review of the shared node ``/status`` route and page (``node.web.assets.add_status_routes``).

A hostile client on 127.0.0.1 sends traversal and encoded asset paths, an oversized header line and
many headers; peer-controlled strings (a record's version, http_url, addresses, an error message
with markup) reach ``/status``. The server must answer each with a clear 4xx, read no file a
request names, keep serving, and send ``/status`` as strict JSON (a browser's ``JSON.parse`` has
no ``NaN`` / ``Infinity``: one such value would blank the whole node page).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from node.status_http import StatusServer

MARKUP = '<script>alert(1)</script><img src=x onerror=alert(2)>"\'&'


async def raw_get(port: int, target: str, extra: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 GET with the request line sent byte for byte (no client-side path normalising)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode() + extra + b"\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(1 << 20), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.fixture
async def server():
    doc = {"role": "relay", "version": MARKUP, "url": "javascript:alert(1)", "addrs": [MARKUP] * 3,
           "nested": {"a": [[[[1]]]]}, "rate_per_s": float("nan"), "inf": float("inf"), "big": -float("inf")}
    s = StatusServer(lambda: dict(doc), CollectorRegistry(), port=0)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def test_asset_route_reads_no_named_path(server):
    for target in ("/web/..%2f..%2fstatus_http.py", "/web/%2e%2e%2fassets.py", "/web/..%5cassets.py", "/web/../assets.py",
                   "/web/style.css%00.py", "/web/%252e%252e%252fassets.py", "/web/" + "a" * 4000, "/web/run.html",
                   "//web/../../etc/passwd", "/web/style.css/..%2f..%2fassets.py"):
        status, body = await raw_get(server.port, target)
        assert status in (400, 404), (target, status)
        assert b"import" not in body and b"root:" not in body, target
        assert len(body) < 400, target  # the 404 echoes at most 64 characters of the name
    status, body = await raw_get(server.port, "/web/style.css")
    assert status == 200 and body


async def test_oversized_and_many_headers_refused_then_serves(server):
    status, _ = await raw_get(server.port, "/status", b"X-Big: " + b"a" * 100_000 + b"\r\n")
    assert status in (400, 431)
    status, _ = await raw_get(server.port, "/status", b"".join(b"X-%d: 1\r\n" % i for i in range(1000)))
    assert status in (400, 431)
    status, body = await raw_get(server.port, "/status")
    assert status == 200 and json.loads(body)["role"] == "relay"


async def test_status_is_strict_json_with_peer_strings_as_data(server):
    logging.getLogger("node.p2p.test").warning("bad record from %s: %s", MARKUP, "x" * 1000)
    status, body = await raw_get(server.port, "/status")
    assert status == 200

    def no_constants(name: str) -> None:
        raise ValueError(f"non-JSON constant {name} in /status")

    doc = json.loads(body, parse_constant=no_constants)  # what a browser's JSON.parse accepts
    assert doc["version"] == MARKUP and doc["addrs"] == [MARKUP] * 3  # data, put in the page as text (node.js)
    assert doc["rate_per_s"] is None and doc["inf"] is None and doc["big"] is None
    msgs = [e["message"] for e in doc["last_errors"]]
    assert any(MARKUP in m for m in msgs) and all(len(m) <= 300 for m in msgs)


async def test_status_flood_from_one_ip_is_limited(server):
    """A client looping on ``/status`` (each ~7.6 KB with 20 kept errors) gets 429s past the page's
    burst, with ``Retry-After``, like ``/`` and ``/web/*``: it cannot pull megabytes a second off a
    relay's public port."""
    import aiohttp

    from node.web.assets import PAGE_BURST, PAGE_REQUESTS_PER_S

    codes: dict[int, int] = {}
    retry_after = None
    started = time.monotonic()
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            async with s.get(f"{server.url}/status") as r:
                await r.read()
                codes[r.status] = codes.get(r.status, 0) + 1
                retry_after = r.headers.get("Retry-After") if r.status == 429 else retry_after
    refilled = PAGE_REQUESTS_PER_S * (time.monotonic() - started)  # the budget refills while the loop runs (slowly on a loaded box)
    assert set(codes) == {200, 429} and codes[200] <= PAGE_BURST + refilled + 1, (codes, refilled)
    assert retry_after is not None and int(retry_after) >= 1


@pytest.mark.parametrize("addr", ["garbage", "\x00", "/ip4/1.2.3.4/tcp/99999/p2p/12D3KooWAbc", "/ip4/1.2.3.4/tcp/1",
                                  "/ip6/::1/tcp/1/p2p/" + "1" * 200, "/dns4/" + "a" * 240 + "/tcp/1"])
def test_hostile_bootstrap_flag_is_a_one_line_error(addr):
    """A ``--bootstrap`` that is no ``…/p2p/<peer ID>`` multiaddr stops the command at once, naming
    the flag (once running it was only a warning, and the node ran without its bootstrap peer)."""
    import argparse

    from node.cli import CliError, add_gossip_arguments, gossip_config

    p = argparse.ArgumentParser()
    add_gossip_arguments(p, off_help="off")
    with pytest.raises(CliError, match=r"^invalid --bootstrap: ") as e:
        gossip_config(p.parse_args(["--bootstrap", addr]))
    assert "\n" not in str(e.value) and len(str(e.value)) <= 450
    ok = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    assert gossip_config(p.parse_args(["--bootstrap", ok])).bootstrap == [ok]


def test_max_peers_per_ip_flag():
    """``--max-peers-per-ip`` reaches the gossip settings (default 8; 0 turns the cap off) and a
    negative value is a one-line error naming the flag."""
    import argparse

    from node.cli import CliError, add_gossip_arguments, gossip_config

    p = argparse.ArgumentParser()
    add_gossip_arguments(p, off_help="off")
    assert gossip_config(p.parse_args([])).max_peers_per_ip == 8
    assert gossip_config(p.parse_args(["--max-peers-per-ip", "32"])).max_peers_per_ip == 32
    with pytest.raises(CliError, match=r"^invalid --max-peers-per-ip: "):
        gossip_config(p.parse_args(["--max-peers-per-ip", "-1"]))


def test_max_peers_flag():
    """``--max-peers`` reaches the gossip settings (default 64; a hub holds one connection per
    attached worker, docs/capacity.md) and 0 is a one-line error naming the flag."""
    import argparse

    from node.cli import CliError, add_gossip_arguments, gossip_config

    p = argparse.ArgumentParser()
    add_gossip_arguments(p, off_help="off")
    assert gossip_config(p.parse_args([])).max_peers == 64
    assert gossip_config(p.parse_args(["--max-peers", "600"])).max_peers == 600
    with pytest.raises(CliError, match=r"^invalid --max-peers: "):
        gossip_config(p.parse_args(["--max-peers", "0"]))
