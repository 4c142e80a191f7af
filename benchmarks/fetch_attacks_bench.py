"""Shardcast fetch under hostile relays (issue #12 item 7), side by side with the honest case.

One origin (a Shardcast server on 127.0.0.1) holds a checkpoint; ``fetch_checkpoint`` downloads it
with the origin as origin and, as relay candidates:

* ``origin``: none (the baseline);
* ``honest``: 2 honest relays (servers over a mirror of the store);
* ``tarpits``: 20 relay URLs that accept TCP and never answer;
* ``no_pieces``: 1 relay that serves the manifest and answers 404 for every piece;
* ``honest+no_pieces``: the 2 honest relays and the lying one;
* ``trickle×N`` (issue #23 item 1), N = 1, 8, 20: relays that serve the manifest, answer a piece
  request at once with the right headers, then send its true bytes one every 2 s.

Each case is fetched ``--repeat`` times (fresh output directory each time, same process, fresh
session) and the median wall time is printed with its ratio to the ``origin`` baseline; the
trickle cases also with issue #23's goal, ``2 × origin + 5 s``. All in one process on one
machine, so the numbers are for comparison, not absolute throughput.
Run: ``python benchmarks/fetch_attacks_bench.py [--size-mib 64] [--piece-mib 16] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from node.shardcast.client import fetch_checkpoint
from node.shardcast.download import DownloadConfig
from node.shardcast.publish import publish_checkpoint
from node.shardcast.server import ShardcastServer
from node.shardcast.store import ShardcastStore
from protocol.identity import NodeKey
from protocol.runspec import RunInfo, RunSpec, ShardcastSpec, sign_run_spec
from protocol.shardcast import ROUTE_PREFIX

MiB = 1 << 20


@contextlib.asynccontextmanager
async def tarpits(n: int) -> AsyncIterator[list[str]]:
    """``n`` listening sockets that accept, read, and never answer."""
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass

    servers = [await asyncio.start_server(hold, "127.0.0.1", 0) for _ in range(n)]
    try:
        yield [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    finally:
        for w in writers:
            w.transport.abort()
        for s in servers:
            s.close()


@contextlib.asynccontextmanager
async def no_pieces_relay(store: ShardcastStore, trickle_s: float | None = None) -> AsyncIterator[str]:
    """A relay serving ``store``'s manifests and 404 for every piece; with ``trickle_s``, each piece
    answered at once with its headers, then its bytes one every ``trickle_s`` seconds."""

    async def manifest(request: web.Request) -> web.Response:
        name = request.match_info["step"]
        env = store.manifest(store.latest_step() if name == "latest" else int(name))  # type: ignore[arg-type]
        if env is None:
            raise web.HTTPNotFound()
        return web.Response(body=env.raw)

    async def piece(request: web.Request) -> web.StreamResponse:
        path = store.piece_path(bytes.fromhex(request.match_info["pid"]))
        if trickle_s is None or not path.is_file():
            raise web.HTTPNotFound()
        resp = web.StreamResponse()
        resp.content_length = path.stat().st_size
        await resp.prepare(request)
        with path.open("rb") as f, contextlib.suppress(ConnectionError):
            while b := f.read(1):
                await resp.write(b)
                await asyncio.sleep(trickle_s)
        return resp

    app = web.Application()
    app.router.add_get(f"{ROUTE_PREFIX}/manifests/{{step}}", manifest)
    app.router.add_get(f"{ROUTE_PREFIX}/pieces/{{pid}}", piece)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def main(args: argparse.Namespace) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    work = Path(tempfile.mkdtemp(prefix="fetch-attacks-bench-"))
    try:
        key = NodeKey.generate()
        signed = sign_run_spec(RunSpec(run=RunInfo(name="bench", coordinator=key.peer_id),
                                       shardcast=ShardcastSpec(piece_size_bytes=args.piece_mib * MiB)), key)
        ckpt = work / "model.safetensors"
        n = args.size_mib * MiB // 4
        save_file({"w": np.random.default_rng(0).standard_normal(n, dtype=np.float32)}, str(ckpt))
        stores = []
        for name in ("origin", "mirror1", "mirror2"):
            st = ShardcastStore(work / name, run_id=signed.run_id, authorities=signed.spec.authorities, keep_steps=2, fsync=False)
            publish_checkpoint(st, [ckpt], step=1, key=key, piece_size_bytes=args.piece_mib * MiB)
            stores.append(st)
        servers = [ShardcastServer(st, host="127.0.0.1", port=0) for st in stores]
        for s in servers:
            await s.start()
        origin, honest = servers[0].url, [servers[1].url, servers[2].url]
        cfg = DownloadConfig()
        results: dict[str, float] = {}
        async with tarpits(20) as pits, no_pieces_relay(stores[0]) as liar, contextlib.AsyncExitStack() as stack:
            tricklers = [await stack.enter_async_context(no_pieces_relay(stores[0], trickle_s=2.0)) for _ in range(20)]
            cases = {
                "origin": [],
                "honest": honest,
                "tarpits": pits,
                "no_pieces": [liar],
                "honest+no_pieces": [*honest, liar],
                "trickle×1": tricklers[:1],
                "trickle×8": tricklers[:8],
                "trickle×20": tricklers,
            }
            for name, relays in cases.items():
                times = []
                for i in range(args.repeat):
                    out = work / f"out-{name}-{i}"
                    t0 = time.monotonic()
                    await fetch_checkpoint([*relays, origin], out, run_id=signed.run_id, authorities=signed.spec.authorities, step=1,
                                           config=cfg, progress=False, origins=[origin])
                    times.append(time.monotonic() - t0)
                    shutil.rmtree(out)
                results[name] = statistics.median(times)
        for s in servers:
            await s.stop()
        base = results["origin"]
        print(f"checkpoint {args.size_mib} MiB, pieces {args.piece_mib} MiB, median of {args.repeat}")
        print(f"{'case':<18} {'seconds':>8} {'× origin-only':>14} {'goal (2 × origin + 5 s)':>24}")
        for name, t in results.items():
            goal = f"{'met' if t <= 2 * base + 5 else 'MISSED'} (≤ {2 * base + 5:.2f} s)" if name.startswith("trickle") else ""
            print(f"{name:<18} {t:>8.2f} {t / base:>14.2f} {goal:>24}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--piece-mib", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    asyncio.run(main(p.parse_args()))
