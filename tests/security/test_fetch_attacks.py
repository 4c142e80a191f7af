"""Issue #12 item 7 and the relay-manifest part of item 4: hostile Shardcast sources against a real
origin, relays and fetch on 127.0.0.1.

Attackers: self-signed relay records pointing at tarpits (accept TCP, never answer), a relay that
serves the manifest but none of its pieces, a relay serving an 8 MiB "manifest", an upstream whose
unsigned ``/held`` advertises steps near 2^40, and Sybil relays filling a relay's upstream slots.
Every test waits for events (a fetch returning, a step held), never for time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))  # the Shardcast test fixtures live there

from shardcast_fixtures import make_run, make_store, publish, serving, write_checkpoint  # noqa: E402
from waiting import wait_until

from node.errors import SourceError  # noqa: E402
from node.p2p.peers import PeerTable  # noqa: E402
from node.policy import GossipSources, PolicyFollower  # noqa: E402
from node.shardcast.client import fetch_checkpoint  # noqa: E402
from node.shardcast.download import DownloadConfig, ManifestCache, get_manifest  # noqa: E402
from node.shardcast.relay import Relay, RelayConfig  # noqa: E402
from node.shardcast.server import ShardcastServer  # noqa: E402
from protocol.envelope import open_envelope, seal  # noqa: E402
from protocol.identity import NodeKey  # noqa: E402
from protocol.messages import NodeRecord  # noqa: E402
from protocol.shardcast import ROUTE_PREFIX  # noqa: E402

# Short socket timeouts keep the tests quick; they bound how long a tarpit holds a request.
CFG = DownloadConfig(max_concurrency=6, connect_timeout_s=2.0, read_timeout_s=2.0, manifest_timeout_s=2.0, held_timeout_s=1.0,
                     hedge_after_s=0.3, stall_timeout_s=60.0, deadline_s=120.0)


class Tarpit:
    """``n`` listening sockets that accept TCP, read what arrives, and never answer.

    Attributes:
        requests: request lines seen per port (``GET /shardcast/1/pieces/…``).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.servers: list[asyncio.Server] = []
        self.urls: list[str] = []
        self.requests: dict[str, list[str]] = {}
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        for _ in range(self.n):
            url_box: list[str] = []

            async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, box: list[str] = url_box) -> None:
                self._writers.append(writer)
                with contextlib.suppress(Exception):
                    while line := await reader.readline():
                        if line.startswith(b"GET "):
                            self.requests.setdefault(box[0], []).append(line.decode(errors="replace").split()[1])

            srv = await asyncio.start_server(hold, "127.0.0.1", 0)
            url_box.append(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
            self.servers.append(srv)
            self.urls.append(url_box[0])

    async def stop(self) -> None:
        for w in self._writers:
            w.transport.abort()
        for srv in self.servers:
            srv.close()
            await srv.wait_closed()

    def asked_for_pieces(self) -> set[str]:
        return {u for u, reqs in self.requests.items() if any("/pieces/" in r for r in reqs)}


@contextlib.asynccontextmanager
async def tarpits(n: int) -> AsyncIterator[Tarpit]:
    t = Tarpit(n)
    await t.start()
    try:
        yield t
    finally:
        await t.stop()


class LyingRelay:
    """A relay with its own routes: ``/held`` and manifests from ``store`` (or made up), pieces per ``mode``.

    Modes: ``no_pieces`` (manifest served, every piece 404), ``huge_manifest`` (an endless chunked
    "manifest" of zero bytes, ``manifest_bytes`` long), ``huge_steps`` (``/held`` offers
    ``fake_steps``; their manifests 404; the store's real steps are offered and served too),
    ``trickle`` (manifests served; a piece answered at once with the right headers, then its
    true bytes one every ``trickle_s`` seconds).

    Attributes:
        hits: requests per kind (``held``, ``manifest``, ``piece``).
        manifest_bytes_sent: body bytes of manifest responses the server managed to write.
        trickled_bytes: piece bytes written in ``trickle`` mode.
    """

    def __init__(self, store, mode: str, *, manifest_bytes: int = 8 << 20, fake_steps: list[int] | None = None,  # noqa: ANN001
                 trickle_s: float = 2.0) -> None:
        self.store = store
        self.mode = mode
        self.manifest_bytes = manifest_bytes
        self.fake_steps = fake_steps or []
        self.trickle_s = trickle_s
        self.hits: Counter[str] = Counter()
        self.manifest_bytes_sent = 0
        self.trickled_bytes = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(f"{ROUTE_PREFIX}/held", self._held)
        app.router.add_get(f"{ROUTE_PREFIX}/manifests/{{step}}", self._manifest)
        app.router.add_get(f"{ROUTE_PREFIX}/pieces/{{pid}}", self._piece)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # bound what the kernel buffers ahead of the client
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _held(self, request: web.Request) -> web.Response:
        self.hits["held"] += 1
        steps = sorted(set(self.store.steps()) | set(self.fake_steps))
        doc = {"run_id": "", "peer_id": "", "held_steps": steps, "steps": steps, "latest": steps[-1] if steps else None}
        return web.Response(text=json.dumps(doc), content_type="application/json")

    async def _manifest(self, request: web.Request) -> web.StreamResponse:
        self.hits["manifest"] += 1
        name = request.match_info["step"]
        if self.mode == "huge_manifest":
            resp = web.StreamResponse()  # chunked: no Content-Length to refuse it by
            await resp.prepare(request)
            chunk = b"\x00" * (64 << 10)
            with contextlib.suppress(ConnectionError):
                while self.manifest_bytes_sent < self.manifest_bytes:
                    await resp.write(chunk)
                    self.manifest_bytes_sent += len(chunk)
                await resp.write_eof()
            return resp
        step = self.store.latest_step() if name == "latest" else int(name)
        env = self.store.manifest(step) if step is not None else None
        if env is None:
            raise web.HTTPNotFound()
        return web.Response(body=env.raw, headers={"ETag": f'"{env.id.hex()}"'})

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        self.hits["piece"] += 1
        if self.mode == "no_pieces":
            raise web.HTTPNotFound()
        path = self.store.piece_path(bytes.fromhex(request.match_info["pid"]))
        if not path.is_file():
            raise web.HTTPNotFound()
        if self.mode == "trickle":
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = path.stat().st_size
            await resp.prepare(request)  # headers at once
            with path.open("rb") as f, contextlib.suppress(ConnectionError):
                while b := f.read(1):  # then the true bytes, one every trickle_s
                    await resp.write(b)
                    self.trickled_bytes += 1
                    await asyncio.sleep(self.trickle_s)
            return resp
        return web.FileResponse(path)


@contextlib.asynccontextmanager
async def lying_relay(store, mode: str, **kw) -> AsyncIterator[LyingRelay]:  # noqa: ANN001, ANN003
    r = LyingRelay(store, mode, **kw)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


@pytest.fixture
def origin(tmp_path):
    run = make_run()
    store = make_store(run, tmp_path / "origin")
    ckpt = write_checkpoint(tmp_path / "model.safetensors", 2.0)
    publish(run, store, ckpt, 1)
    return run, store, ckpt


def fake_relay_records(run, urls: list[str], step: int) -> list[NodeRecord]:  # noqa: ANN001
    """Self-signed relay records (fresh keys, as a Sybil makes them), verified the way gossip does."""
    out = []
    for url in urls:
        key = NodeKey.generate()
        raw = seal(key, run.run_id, NodeRecord(peer_id=key.peer_id, role="relay", seq=1, version="x", http_url=url, held_steps=[step]))
        out.append(open_envelope(raw, run_id=run.run_id, authorities=run.authorities, expect=NodeRecord).body)
    return out


def gossip_view(run, origin_url: str, relay_urls: list[str], step: int) -> PeerTable:  # noqa: ANN001
    """A peer table as gossip fills it: the coordinator's record (the origin) and the relay records."""
    table = PeerTable(60.0, coordinator=run.key.peer_id)
    table.update(NodeRecord(peer_id=run.key.peer_id, role="coordinator", seq=1, version="x", http_url=origin_url, policy_step=step), 1)
    for r in fake_relay_records(run, relay_urls, step):
        table.update(r, 1)
    return table


async def test_twenty_tarpit_relay_records_cannot_break_a_fetch(origin, tmp_path):
    """Item 7: 20 self-signed relay records pointing at tarpits; the fetch succeeds from the origin."""
    run, store, ckpt = origin
    async with serving(store) as o, tarpits(20) as pit:
        table = gossip_view(run, o.url, pit.urls, 1)
        chooser = GossipSources(lambda: SimpleNamespace(peers=table), run.signed.spec)
        sources = chooser(1)
        assert len(sources) == 21 and chooser.origins() == [o.url]
        res = await fetch_checkpoint(sources, tmp_path / "out", run_id=run.run_id, authorities=run.authorities, step=1,
                                     config=CFG, progress=False, origins=chooser.origins())
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
    assert res.candidates_offered == 20
    used = set(res.source_bytes) - {o.url}
    assert 0 < len(used) <= CFG.max_candidates, "a bounded random subset of the relay records is used"
    assert res.source_bytes[o.url] == res.bytes_downloaded and all(res.source_bytes[u] == 0 for u in used)
    asked = pit.asked_for_pieces()
    assert asked, "the tarpits were given pieces (and so had the chance to hold them)"
    assert asked <= used and asked <= set(res.cooled_sources), "every tarpit that held a piece request was cooled down"
    assert not res.faulty_sources, "silence is not evidence"


async def test_tarpit_upstreams_cannot_stop_a_relay_that_keeps_its_origin(origin, tmp_path):
    """Sybil relays (tarpits) offered as upstreams: the origin stays in the set and the step is filled."""
    run, store, ckpt = origin
    async with serving(store) as o, tarpits(20) as pit:
        r = Relay(make_store(run, tmp_path / "relay"), RelayConfig(origins=(o.url,), poll_interval_s=0.05, download=CFG))
        await r.start()
        try:
            r.set_upstreams([*pit.urls, o.url])
            assert o.url in r.pool.urls and len(r.pool.urls) == CFG.max_candidates + 1
            await wait_until(lambda: r.held_steps() == [1], timeout_s=60)
        finally:
            await r.stop()


async def test_relay_with_manifest_but_no_pieces_is_cooled_down(origin, tmp_path):
    """Item 7: a relay holding the manifest but none of its pieces, with the origin and alone with it."""
    run, store, ckpt = origin
    n_pieces = sum(len(f.pieces) for f in store.manifest(1).body.files)
    async with serving(store) as o, lying_relay(store, "no_pieces") as liar:
        res = await fetch_checkpoint([liar.url], tmp_path / "out", run_id=run.run_id, authorities=run.authorities, step=1,
                                     config=CFG, progress=False, origins=[o.url])
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
        assert liar.url in res.cooled_sources and res.source_bytes[liar.url] == 0
        assert liar.hits["piece"] < n_pieces, "not asked once per piece: cooled down with back-off after its 404s"
        # alone with a relay that only ever answers 404 for pieces and another that does too, the origin still serves
        async with lying_relay(store, "no_pieces") as liar2:
            res2 = await fetch_checkpoint([liar.url, liar2.url, o.url], tmp_path / "out2", run_id=run.run_id, authorities=run.authorities,
                                          step=1, config=CFG, progress=False, origins=[o.url])
        assert res2.source_bytes[o.url] == res2.bytes_downloaded
        assert {liar.url, liar2.url} <= set(res2.cooled_sources)


async def test_eight_mib_manifest_is_refused_with_a_bounded_read_and_not_polled_again(origin, tmp_path):
    """Item 4 (relay part): an 8 MiB "manifest" is cut off at the cap, the relay is faulty, not asked again."""
    run, store, ckpt = origin
    cap = 1 << 20
    cfg = dataclasses.replace(CFG, max_manifest_bytes=cap)
    cache = ManifestCache()

    def small_rcvbuf(addr_info):  # noqa: ANN001, ANN202 - so that what the server sent ≈ what the client read
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family, type_, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        return sock

    async with serving(store) as o, lying_relay(store, "huge_manifest", manifest_bytes=8 << 20) as evil, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=6, socket_factory=small_rcvbuf), auto_decompress=False, read_bufsize=1 << 20
    ) as s:
        with pytest.raises(SourceError, match="exceeds the") as e:
            await get_manifest(s, evil.url, 1, run_id=run.run_id, authorities=run.authorities, timeout_s=2.0, cfg=cfg, cache=cache)
        assert e.value.evidence and e.value.reason == "oversized"
        # bounded read: the server could write at most the cap plus the client's 2 MiB stream buffer
        # and small socket buffers before the client hung up; never the whole 8 MiB
        await wait_until(lambda: evil.manifest_bytes_sent > 0)
        assert cap < evil.manifest_bytes_sent <= cap + (3 << 20)
        assert cache.faulty_reason(evil.url, 1) == "oversized"
        # polled again: not asked at all (for this step) ...
        with pytest.raises(SourceError, match="not asked again"):
            await get_manifest(s, evil.url, 1, run_id=run.run_id, authorities=run.authorities, timeout_s=2.0, cfg=cfg, cache=cache)
        assert evil.hits["manifest"] == 1
        # ... and a fetch that includes it never contacts it for the manifest, names it faulty and succeeds
        res = await fetch_checkpoint([evil.url], tmp_path / "out", run_id=run.run_id, authorities=run.authorities, step=1,
                                     config=cfg, progress=False, origins=[o.url], cache=cache)
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == ckpt.read_bytes()
        assert evil.hits["manifest"] == 1 and evil.url in res.faulty_sources and res.source_bytes[evil.url] == 0
        # a verified manifest is cached: polling the origin again does not decode it again
        decoded = cache.decoded
        for _ in range(3):
            env = await get_manifest(s, o.url, None, run_id=run.run_id, authorities=run.authorities, timeout_s=2.0, cfg=cfg, cache=cache)
            assert env is not None and env.body.step == 1
        assert cache.decoded == decoded, "the step-1 manifest was verified during the fetch; polls reuse it"


@pytest.mark.parametrize("signed_by", ["origin", "gossip", "nothing"])
async def test_upstream_advertising_step_2_pow_40_cannot_stop_a_relay(origin, tmp_path, signed_by):
    """Item 7: an upstream's unsigned /held offers steps near 2^40; the relay still syncs the real latest step.

    ``origin``: the relay knows which upstream is the origin; ``gossip``: a coordinator-signed
    announcement names the latest step; ``nothing``: neither (the per-upstream failure budget holds).
    """
    run, store, ckpt = origin
    fake = [2**40 - i for i in range(1000 if signed_by == "nothing" else 3)]
    empty = make_store(run, tmp_path / "empty")
    async with serving(store) as o, lying_relay(empty, "huge_steps", fake_steps=fake) as liar:
        cfg = RelayConfig(origins=(o.url,) if signed_by == "origin" else (), poll_interval_s=0.05, download=CFG)
        r = Relay(make_store(run, tmp_path / "relay"), cfg)
        await r.start()
        try:
            r.set_upstreams([liar.url, o.url])
            if signed_by == "gossip":
                r.note_latest_step(1)
            await wait_until(lambda: r.held_steps() == [1], timeout_s=60)
            publish(run, store, write_checkpoint(tmp_path / "s2.safetensors", 0.5, seed=2), 2)
            if signed_by == "gossip":
                r.note_latest_step(2)
            await wait_until(lambda: 2 in r.held_steps(), timeout_s=60)
        finally:
            await r.stop()
    if signed_by != "nothing":
        assert liar.hits["manifest"] == 0, "steps above the signed latest are never even asked for"
    else:
        assert liar.hits["manifest"] <= len(fake), "each fake offer is asked at most once"


async def test_policy_follower_polls_and_fetches_past_tarpit_relays(origin, tmp_path):
    """The worker's and validator's path (PolicyFollower over gossip sources), with 20 tarpit relay records."""
    run, store, ckpt = origin

    async with serving(store) as o, tarpits(20) as pit:
        table = gossip_view(run, o.url, pit.urls, 1)
        follower = PolicyFollower(run.signed.spec, tmp_path / "ckpts", GossipSources(lambda: SimpleNamespace(peers=table), run.signed.spec))
        follower._cfg = dataclasses.replace(CFG, stall_timeout_s=30.0)
        try:
            assert await follower.poll_latest() == 1, "the origin's answer is taken without waiting for the tarpits"
            decoded = follower._manifests.decoded
            assert await follower.poll_latest() == 1 and follower._manifests.decoded == decoded, "not decoded again"
            out = await follower.fetch(1)
        finally:
            await follower.close()
    assert (out / "model.safetensors").read_bytes() == ckpt.read_bytes()


async def test_next_step_without_a_delta_is_fetched_in_full_without_asking_tarpits(tmp_path):
    """The follower holds step 1; step 2 has no delta at the origin: relays (tarpits) are not asked for one."""
    from node.shardcast.publish import publish_checkpoint

    run = make_run()
    store = make_store(run, tmp_path / "origin")

    def publish_step(step: int) -> Path:
        d = tmp_path / f"s{step}"
        ckpt = write_checkpoint(d / "model.safetensors", 1.0, seed=step)
        (d / "config.json").write_text("{}")
        publish_checkpoint(store, [ckpt, d / "config.json"], step=step, key=run.key, piece_size_bytes=run.signed.spec.shardcast.piece_size_bytes)
        return ckpt

    publish_step(1)
    async with serving(store) as o, tarpits(20) as pit:
        table = gossip_view(run, o.url, pit.urls, 1)
        follower = PolicyFollower(run.signed.spec, tmp_path / "ckpts", GossipSources(lambda: SimpleNamespace(peers=table), run.signed.spec))
        follower._cfg = dataclasses.replace(CFG, stall_timeout_s=30.0)
        try:
            await follower.fetch(1)
            assert follower.have(1)
            ckpt2 = publish_step(2)  # no delta_from: the origin has no delta into step 2
            for r in fake_relay_records(run, pit.urls, 2):
                table.update(r, 2)
            out = await follower.fetch(2)
        finally:
            await follower.close()
    assert (out / "model.safetensors").read_bytes() == ckpt2.read_bytes()
    assert not [r for reqs in pit.requests.values() for r in reqs if "/deltas/" in r], "no tarpit was asked for a delta"


async def test_steps_in_paths_are_ascii_digits_only(origin):
    """Path traversal and look-alike steps: only ASCII digits name a step (``str.isdigit`` also
    takes "１" and "١", which ``int`` reads as 1, and the delta route echoed the raw name in a header)."""
    import aiohttp

    _, store, _ = origin
    async with serving(store) as server, aiohttp.ClientSession() as http:
        for route in ("manifests", "deltas"):
            for name in ("１", "١", "1\u0301", "..%2F..%2Fkeys", "1e3"):
                async with http.get(f"{server.url}/shardcast/1/{route}/{name}") as r:
                    assert r.status == 400, (route, name, r.status)
            async with http.get(f"{server.url}/shardcast/1/{route}/%2e%2e") as r:  # the client resolves it to /shardcast/1/
                assert r.status == 404
        async with http.get(f"{server.url}/shardcast/1/manifests/1") as r:
            assert r.status == 200


@contextlib.asynccontextmanager
async def lying_relays(store, mode: str, n: int) -> AsyncIterator[list[LyingRelay]]:  # noqa: ANN001
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(lying_relay(store, mode)) for _ in range(n)]


@pytest.fixture(scope="module")
def big_origin(tmp_path_factory):
    """64 MiB in 16 MiB pieces (issue 23's shape: the run spec's default piece size)."""
    tmp = tmp_path_factory.mktemp("big")
    run = make_run(piece_size=16 << 20)
    store = make_store(run, tmp / "origin")
    ckpt = write_checkpoint(tmp / "model.safetensors", 64.0)
    publish(run, store, ckpt, 1)
    return run, store, ckpt


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 8, 20])
async def test_trickling_relays_cannot_stall_a_policy_fetch(big_origin, tmp_path, n):
    """Issue 23 item 1: relay records pointing at relays that answer at once and then send one
    byte every 2 s. The worker's and validator's fetch (PolicyFollower, its own limits: 30 s stall
    timeout) completes from the origin, cutting each trickler off within a rate window and cooling
    it down; the origin's /status answers within 2 s meanwhile. Before: ``no source delivered a
    piece for 30 s`` (a 16 MiB piece's body deadline was 69 s)."""
    run, store, ckpt = big_origin
    o = ShardcastServer(store, host="127.0.0.1", port=0)
    o.status = lambda: {"role": "origin"}
    await o.start()
    async with contextlib.AsyncExitStack() as stack, lying_relays(store, "trickle", n) as tricklers:
        stack.push_async_callback(o.stop)
        table = gossip_view(run, o.url, [t.url for t in tricklers], 1)
        follower = PolicyFollower(run.signed.spec, tmp_path / "ckpts", GossipSources(lambda: SimpleNamespace(peers=table), run.signed.spec))
        try:
            fetch = asyncio.ensure_future(follower.fetch(1))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
                while not fetch.done():  # the origin keeps answering while it serves past the tricklers
                    async with http.get(f"{o.url}/status") as r:
                        assert r.status == 200
                    await asyncio.wait({fetch}, timeout=0.5)
            async with asyncio.timeout(CFG.stall_timeout_s):
                out = await fetch
        finally:
            await follower.close()
    assert (out / "model.safetensors").read_bytes() == ckpt.read_bytes()
    given = [t for t in tricklers if t.hits["piece"]]
    assert all(t.trickled_bytes < 64 for t in given), "each trickler was cut off after a few bytes"
    assert sum(t.trickled_bytes for t in tricklers) < 64 * n


@pytest.mark.slow
async def test_trickling_upstreams_cannot_hold_a_relay_back(big_origin, tmp_path):
    """Issue 23 item 1, relay side: 20 trickling upstreams beside the origin (the relay's own limits:
    120 s stall timeout). The relay fills the step within 30 s (before: a trickler held a 16 MiB
    piece for its 69 s body deadline, then the next one did), its pieces verified into its store
    through writers a cut-off request never touches again; its /status answers within 2 s meanwhile."""
    run, store, ckpt = big_origin
    async with serving(store) as o, lying_relays(store, "trickle", 20) as tricklers:
        r = Relay(make_store(run, tmp_path / "relay"), RelayConfig(origins=(o.url,), poll_interval_s=0.05))
        r.server.status = lambda: {"held": r.held_steps()}
        await r.start()
        try:
            r.set_upstreams([*(t.url for t in tricklers), o.url])
            loop = asyncio.get_running_loop()
            end = loop.time() + 30.0
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
                while r.held_steps() != [1]:
                    assert loop.time() < end, "the relay did not fill the step within 30 s"
                    async with http.get(f"{r.url}/status") as resp:
                        assert resp.status == 200
                    await asyncio.sleep(0.2)
            assert await asyncio.to_thread(r.store.check_complete, 1)
            cooled = r.pool.cooled()
        finally:
            await r.stop()
    given = {t.url for t in tricklers if t.hits["piece"]}
    assert given and all(cooled.get(u) == "slow" for u in given), "every trickler given a piece was cut off as slow and cooled down"
    assert all(t.trickled_bytes < 64 for t in tricklers)


class PacedRelay(LyingRelay):
    """A relay serving the store's true bytes at ``rate_bps`` per request (an honest relay on a
    modest link), or, ``fast_once``, one piece at once from memory and then 503 to every piece."""

    def __init__(self, store, *, rate_bps: float = 0.0, fast_once: bool = False) -> None:  # noqa: ANN001
        super().__init__(store, "paced")
        self.rate_bps = rate_bps
        self.fast_once = fast_once

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        self.hits["piece"] += 1
        path = self.store.piece_path(bytes.fromhex(request.match_info["pid"]))
        if self.fast_once:
            if self.hits["piece"] > 1:
                raise web.HTTPServiceUnavailable()
            return web.Response(body=path.read_bytes(), content_type="application/octet-stream")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = path.stat().st_size
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), 0
        with path.open("rb") as f, contextlib.suppress(ConnectionError):
            while b := f.read(64 << 10):
                await resp.write(b)
                sent += len(b)
                await asyncio.sleep(max(0.0, started + sent / self.rate_bps - loop.time()))
        return resp


async def test_a_relay_fast_once_then_refusing_does_not_raise_the_rate_floor(tmp_path):
    """A Sybil relay serves its first piece from memory at once (gigabytes a second on a short path),
    then answers 503. Its measured rate stayed the download's best, so the relative rate floor
    (best / 8) cut every honest relay (0.5 MiB/s here) off in its first 2 s window and the origin
    served the rest (32 MiB at 1 MiB/s, 3 honest relays: the origin sent 28 MiB instead of 16). The
    floor now follows the origins' rates only: the honest relays deliver their pieces."""
    run = make_run(piece_size=2 << 20)
    store = make_store(run, tmp_path / "origin")
    ckpt = write_checkpoint(tmp_path / "model.safetensors", 16.0)
    publish(run, store, ckpt, 1)
    async with contextlib.AsyncExitStack() as stack:
        servers = [PacedRelay(store, rate_bps=0.5 * (1 << 20)) for _ in range(4)] + [PacedRelay(store, fast_once=True)]
        for s in servers:
            await s.start()
            stack.push_async_callback(s.stop)
        origin, honest, sybil = servers[0], servers[1:4], servers[4]
        res = await fetch_checkpoint([s.url for s in servers], tmp_path / "out", run_id=run.run_id, authorities=run.authorities, step=1,
                                     origins=[origin.url], progress=False)
    assert (res.out_dir / "model.safetensors").read_bytes() == ckpt.read_bytes()
    assert sybil.hits["piece"] >= 1
    slow = {u: why for u, why in res.cooled_sources.items() if why == "slow"}
    assert not slow, f"honest relays cut off as slow: {slow} ({res.source_bytes})"
    assert all(res.source_bytes.get(r.url, 0) >= 2 << 20 for r in honest), res.source_bytes
