"""Shardcast relay: follow, verify, cut-through, announce only complete steps, retention, upstream changes."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
from shardcast_fixtures import make_run, make_store, proxy, publish, serving, write_checkpoint
from waiting import wait_until

from node.shardcast.client import fetch_checkpoint
from node.shardcast.download import DownloadConfig
from node.shardcast.relay import Relay, RelayConfig
from protocol.shardcast import ROUTE_PREFIX, iter_pieces

DL = DownloadConfig(max_concurrency=4, stall_timeout_s=20.0, deadline_s=60.0, connect_timeout_s=2.0, read_timeout_s=5.0)


@contextlib.asynccontextmanager
async def relay(store, upstreams=(), poll_s=0.1):
    r = Relay(store, RelayConfig(upstreams=tuple(upstreams), poll_interval_s=poll_s, download=DL))
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


async def test_origin_relay_chain_and_cut_through(tmp_path):
    run = make_run()
    origin_store = make_store(run, tmp_path / "origin")
    ckpt = write_checkpoint(tmp_path / "m.safetensors", 2.0)
    seen_partial_serving = False
    async with relay(origin_store) as origin, proxy(origin.url, delay_s=0.004) as slow_link:
        async with relay(make_store(run, tmp_path / "r1"), [slow_link.url]) as r1, relay(make_store(run, tmp_path / "r2"), [r1.url]) as r2:
            assert r1.held_steps() == [] and r2.held_steps() == []
            env = await asyncio.to_thread(publish, run, origin_store, ckpt, 1)  # origin picks it up from disk
            first = list(iter_pieces(env.body))[0]
            async with aiohttp.ClientSession() as s:

                def partial_and_serving() -> bool:
                    return r1.store.steps() == [1] and r1.held_steps() == [] and r1.store.has_piece(first.piece_id)

                await wait_until(partial_and_serving, timeout_s=20, interval_s=0.01)
                async with s.get(f"{r1.url}{ROUTE_PREFIX}/pieces/{first.piece_id.hex()}") as resp:
                    seen_partial_serving = resp.status == 200 and len(await resp.read()) == first.size_bytes
                async with s.get(f"{r1.url}{ROUTE_PREFIX}/held") as resp:
                    doc = json.loads(await resp.read())
                assert doc["steps"] == [1] and 1 not in doc["held_steps"], "announces only complete steps"
            # a client on the second hop starts before r1 finished: pieces flow through the chain
            await wait_until(lambda: r2.store.steps() == [1], timeout_s=20, interval_s=0.01)
            assert r1.held_steps() == [], "the chain is still filling"
            res = await fetch_checkpoint([r2.url], tmp_path / "out", run_id=run.run_id, authorities=run.authorities, step=1, config=DL, progress=False)
            await wait_until(lambda: r1.held_steps() == [1] and r2.held_steps() == [1], timeout_s=20)
    assert seen_partial_serving
    assert (tmp_path / "out" / "m.safetensors").read_bytes() == ckpt.read_bytes()
    assert res.faulty_sources == {}


async def test_relay_rejects_forged_upstream_and_uses_honest_one(tmp_path):
    run = make_run()
    other = make_run()
    ckpt = write_checkpoint(tmp_path / "m.safetensors", 1.0)
    honest = make_store(run, tmp_path / "honest")
    publish(run, honest, ckpt, 1)
    forged = make_store(other, tmp_path / "forged")
    publish(other, forged, write_checkpoint(tmp_path / "x.safetensors", 0.5, seed=3), 7)
    async with serving(forged) as fs:
        # the forger serves another run's manifest at every step the relay asks for
        async with relay(make_store(run, tmp_path / "r"), [fs.url]) as r:
            # the event: the relay fetched the forger's manifest and judged it (evidence bans the
            # source, so nothing more is asked of it); only then is "nothing stored" meaningful
            await wait_until(lambda: fs.url in r.pool.faulty(), timeout_s=20)
            assert r.pool.faulty()[fs.url] == "bad_manifest"
            assert r.store.steps() == [], "nothing stored from a forger"
    async with serving(honest) as hs, proxy(hs.url, "corrupt") as evil, relay(make_store(run, tmp_path / "r2"), [evil.url, hs.url]) as r2:
        await wait_until(lambda: r2.held_steps() == [1], timeout_s=20)
        assert evil.url in r2.pool.faulty()
    store = r2.store
    data = ckpt.read_bytes()
    for ref in iter_pieces(store.manifest(1).body):
        assert store.piece_path(ref.piece_id).read_bytes() == data[ref.offset_bytes : ref.offset_bytes + ref.size_bytes]


async def test_relay_keeps_last_k_and_follows_new_upstreams(tmp_path):
    run = make_run(keep_steps=2)
    origin_store = make_store(run, tmp_path / "origin", keep_steps=8)
    async with relay(origin_store) as origin, relay(make_store(run, tmp_path / "r")) as r:
        assert r.pool.urls == []
        for step in (1, 2, 3):
            await asyncio.to_thread(publish, run, origin_store, write_checkpoint(tmp_path / f"s{step}.safetensors", 0.5, seed=step), step)
        r.set_upstreams([origin.url])  # e.g. learned from gossip
        await wait_until(lambda: r.held_steps() == [2, 3], timeout_s=20)
        await asyncio.to_thread(publish, run, origin_store, write_checkpoint(tmp_path / "s4.safetensors", 0.5, seed=4), 4)
        await wait_until(lambda: r.held_steps() == [3, 4], timeout_s=20)
        assert r.store.steps() == [3, 4]
        kept = {p.piece_id for s in (3, 4) for p in iter_pieces(r.store.manifest(s).body)}
        on_disk = {bytes.fromhex(p.name) for p in (r.store.root / "pieces").rglob("*") if p.is_file()}
        assert on_disk == kept, "pieces of pruned steps are gone, kept ones all there"
