"""Test helpers for Shardcast: a run with a coordinator key, checkpoints, stores, servers and a
misbehaving proxy (corrupt, oversize, truncate, throttle, forge, kill) placed in front of a source.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web
from safetensors.numpy import save_file

from node.shardcast.publish import publish_checkpoint
from node.shardcast.server import ShardcastServer
from node.shardcast.store import ShardcastStore
from protocol.identity import NodeKey
from protocol.runspec import ModelSpec, RLSpec, RunInfo, RunSpec, ShardcastSpec, SignedRunSpec, sign_run_spec

PIECE = 64 * 1024


@dataclass
class Run:
    key: NodeKey
    signed: SignedRunSpec

    @property
    def run_id(self) -> bytes:
        return self.signed.run_id

    @property
    def authorities(self):  # noqa: ANN201
        return self.signed.spec.authorities


@dataclass
class StaticSources:
    """:class:`node.policy.PolicySources` over fixed URLs (no gossip): every URL for every step."""

    urls: list[str]
    origin_urls: list[str] = field(default_factory=list)

    def __call__(self, step: int | None) -> list[str]:
        return list(self.urls)

    def origins(self) -> list[str]:
        return list(self.origin_urls)

    def relays_lagging(self, step: int) -> bool:
        return False


def make_run(*, keep_steps: int = 3, piece_size: int = PIECE, name: str = "devnet", model_dtype: str = "float32") -> Run:
    key = NodeKey.generate()
    spec = RunSpec(
        run=RunInfo(name=name, coordinator=key.peer_id),
        model=ModelSpec(dtype=model_dtype),
        rl=RLSpec(async_level=keep_steps - 1),
        shardcast=ShardcastSpec(piece_size_bytes=piece_size, keep_steps=keep_steps),
    )
    return Run(key, sign_run_spec(spec, key))


def write_checkpoint(path: Path, size_mib: float = 2.0, seed: int = 0, shared_prefix_seed: int | None = None) -> Path:
    """A safetensors file of about ``size_mib`` MiB; with ``shared_prefix_seed`` its first tensor
    is the same across seeds (so two steps share pieces)."""
    n = int(size_mib * (1 << 20) / 4 / 2)
    rng = np.random.default_rng(seed)
    first = np.random.default_rng(shared_prefix_seed).standard_normal(n, dtype=np.float32) if shared_prefix_seed is not None else rng.standard_normal(n, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"a.weight": first, "b.weight": rng.standard_normal(n, dtype=np.float32)}, str(path))
    return path


def make_store(run: Run, data_dir: Path, keep_steps: int | None = None) -> ShardcastStore:
    return ShardcastStore(
        data_dir, run_id=run.run_id, authorities=run.authorities,
        keep_steps=keep_steps or run.signed.spec.shardcast.keep_steps, fsync=False,
    )


def publish(run: Run, store: ShardcastStore, ckpt: Path, step: int):  # noqa: ANN201
    return publish_checkpoint(store, [ckpt], step=step, key=run.key, piece_size_bytes=run.signed.spec.shardcast.piece_size_bytes)


@contextlib.asynccontextmanager
async def serving(store: ShardcastStore) -> AsyncIterator[ShardcastServer]:
    server = ShardcastServer(store, host="127.0.0.1", port=0)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class EvilProxy:
    """An HTTP proxy in front of ``upstream`` that misbehaves on piece responses.

    Modes: ``ok``, ``corrupt`` (flip one byte), ``oversize`` (append bytes, honest Content-Length
    of the longer body), ``oversize_chunked`` (append bytes, no Content-Length), ``truncate``
    (declare the right length, send half, drop the connection), ``garbage_manifest`` (a manifest's or
    artifact manifest's bytes replaced),
    ``huge_manifest`` (declares 1 GiB). ``delay_s`` sleeps between 16 KiB chunks (throttle).

    Attributes:
        piece_bytes_sent: body bytes of piece responses written so far.
        pieces_completed: piece responses written completely.
    """

    def __init__(self, upstream: str, mode: str = "ok", delay_s: float = 0.0) -> None:
        self.upstream = upstream
        self.mode = mode
        self.delay_s = delay_s
        self.piece_bytes_sent = 0
        self.pieces_completed = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._transports: set[asyncio.Transport] = set()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def kill(self) -> None:
        """Drop every open connection at once and stop listening (a relay dying)."""
        for t in list(self._transports):
            t.abort()
        await self.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)  # type: ignore[arg-type]
        try:
            return await self._forward(request)
        except ConnectionResetError:  # the client went away (aiohttp's reset error subclasses it)
            return web.Response(status=499)
        finally:
            if transport is not None:
                self._transports.discard(transport)  # type: ignore[arg-type]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        is_piece = "/pieces/" in request.path
        is_manifest = "/manifests/" in request.path or "/artifacts/" in request.path
        if is_manifest and self.mode == "garbage_manifest":
            return web.Response(body=os.urandom(300))
        if is_manifest and self.mode == "huge_manifest":
            resp = web.StreamResponse(headers={"Content-Length": str(1 << 30)})
            await resp.prepare(request)
            await resp.write(b"\x00" * 65536)
            return resp
        async with self._session.get(self.upstream + request.path_qs, headers={k: v for k, v in request.headers.items() if k.lower() == "range"}) as up:
            body = await up.read()
            if not is_piece or up.status != 200:
                return web.Response(status=up.status, body=body, headers={k: v for k, v in up.headers.items() if k.lower().startswith("x-shardcast")})
        if self.mode == "corrupt":
            b = bytearray(body)
            b[len(b) // 2] ^= 0x5A
            body = bytes(b)
        elif self.mode in ("oversize", "oversize_chunked"):
            body = body + b"extra bytes beyond the piece"
        resp = web.StreamResponse()
        if self.mode != "oversize_chunked":
            resp.content_length = len(body)
        await resp.prepare(request)
        send = body[: len(body) // 2] if self.mode == "truncate" else body
        for i in range(0, len(send), 16384):
            await resp.write(send[i : i + 16384])
            self.piece_bytes_sent += len(send[i : i + 16384])
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        if self.mode == "truncate":
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write_eof()
        self.pieces_completed += 1
        return resp


@contextlib.asynccontextmanager
async def proxy(upstream: str, mode: str = "ok", delay_s: float = 0.0) -> AsyncIterator[EvilProxy]:
    p = EvilProxy(upstream, mode, delay_s)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


