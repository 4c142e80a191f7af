"""Shardcast HTTP server: serves a :class:`ShardcastStore` under ``/shardcast/1``.

Routes (``docs/shardcast.md``)::

    GET       /shardcast/1/held               JSON: run_id, peer_id, held_steps, steps, latest
    GET       /shardcast/1/manifests/latest   the newest stored manifest (raw envelope bytes)
    GET       /shardcast/1/manifests/{step}   the manifest of one step
    GET|HEAD  /shardcast/1/pieces/{id}        one piece (64 hex digits); HTTP Range supported
    GET       /shardcast/1/artifacts/{id}     the bytes of an artifact manifest (ID: 64 hex digits)
    GET       /run/1/spec                     the signed run spec (TOML), when :attr:`ShardcastServer.run_spec` is set

Pieces are served with ``sendfile`` from their files as soon as they are stored (cut-through:
a relay serves a verified piece of a step it is still filling). A request for a piece that a
stored manifest of a step still being filled lists, but that has not arrived yet, is held (up
to ``piece_wait_s``, 5 s) and answered the moment the piece is stored, instead of a 404 that
the client would retry later. The server accepts no request
bodies, and every malformed path, step or range is a 4xx answer, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from node.shardcast.store import ShardcastStore
from protocol.content import hex_id
from protocol.identity import PeerId
from protocol.shardcast import ROUTE_PREFIX

logger = logging.getLogger(__name__)

MSGPACK_TYPE = "application/x-msgpack"
_HEX_ID = re.compile(r"^[0-9a-f]{64}$")
_MAX_STEP = 2**40
_ZERO_SUFFIX = re.compile(r"^\s*bytes\s*=\s*-\s*0+\s*$", re.IGNORECASE)
"""A ``Range`` of one suffix range of length 0 (``bytes=-0``)."""
IMMUTABLE = "public, max-age=31536000, immutable"
PIECE_WAIT_S = 5.0
"""How long a request for a piece of a step being filled is held until the piece is stored."""


def _is_step(name: str) -> bool:
    """Whether a path segment names a step: 1–13 ASCII digits, at most ``_MAX_STEP`` (``str.isdigit``
    alone also takes "１" or "١", which ``int`` reads as 1)."""
    return name.isascii() and name.isdigit() and len(name) <= 13 and int(name) <= _MAX_STEP


class ShardcastServer:
    """An aiohttp server for one store.

    Args:
        store: what to serve.
        host: interface to bind (``127.0.0.1`` by default; ``0.0.0.0`` to serve others).
        port: TCP port; 0 picks a free one (read :attr:`port` after :meth:`start`).
        peer_id: the serving node's peer ID, reported in ``/held`` (informational; ``None``: reported as ``""``).

    Attributes:
        pieces_served: piece responses with status 200 or 206 started so far.
        status: if set before :meth:`start`, ``GET /status`` answers its JSON (a relay's status).
        run_spec: if set before :meth:`start`, ``GET /run/1/spec`` answers these bytes (the signed
            spec's TOML, ``protocol.run_api.SPEC_ROUTE``): a newcomer can fetch it from this node.
    """

    def __init__(
        self, store: ShardcastStore, *, host: str = "127.0.0.1", port: int = 0, peer_id: PeerId | None = None, piece_wait_s: float = PIECE_WAIT_S
    ) -> None:
        self.store = store
        self.host = host
        self.port = port
        self.peer_id = peer_id
        self.piece_wait_s = piece_wait_s
        self.pieces_served = 0
        self.status: Callable[[], dict[str, Any]] | None = None
        self.run_spec: bytes | None = None
        self._runner: web.AppRunner | None = None
        self._waiters: dict[bytes, list[asyncio.Future[None]]] = {}

    def piece_stored(self, piece_id: bytes) -> None:
        """Wake requests waiting for ``piece_id`` (call on the server's event loop once it is stored)."""
        for fut in self._waiters.pop(piece_id, []):
            if not fut.done():
                fut.set_result(None)

    async def _wait_for_piece(self, piece_id: bytes, path: Path) -> bool:
        """Hold a request for a piece of a step being filled until it is stored (≤ ``piece_wait_s``)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.piece_wait_s
        while self.store.is_awaited(piece_id):
            left = end - loop.time()
            if left <= 0:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(piece_id, []).append(fut)
            try:  # woken by piece_stored(); re-check the disk now and then (another process may store it)
                await asyncio.wait_for(fut, timeout=min(left, 0.25))
            except TimeoutError:
                waiting = self._waiters.get(piece_id)
                if waiting is not None and fut in waiting:
                    waiting.remove(fut)
                    if not waiting:
                        del self._waiters[piece_id]
            if path.is_file():
                return True
        return path.is_file()

    def make_app(self) -> web.Application:
        """The aiohttp application with the Shardcast routes (no request bodies accepted)."""
        app = web.Application(client_max_size=1024)
        app.router.add_get(f"{ROUTE_PREFIX}/held", self._held)
        app.router.add_get(f"{ROUTE_PREFIX}/manifests/{{step}}", self._manifest)
        app.router.add_get(f"{ROUTE_PREFIX}/deltas/{{step}}", self._delta)
        app.router.add_get(f"{ROUTE_PREFIX}/pieces/{{piece_id}}", self._piece)  # GET also answers HEAD
        app.router.add_get(f"{ROUTE_PREFIX}/artifacts/{{artifact_id}}", self._artifact)
        if self.run_spec is not None:
            from protocol.run_api import SPEC_CONTENT_TYPE, SPEC_ROUTE

            spec = self.run_spec

            async def serve_spec(request: web.Request) -> web.Response:
                return web.Response(body=spec, content_type=SPEC_CONTENT_TYPE, charset="utf-8", headers={"Cache-Control": "no-cache"})

            app.router.add_get(SPEC_ROUTE, serve_spec)
        if self.status is not None:
            from node.web.assets import RecentErrors, add_status_routes

            self.errors = RecentErrors()
            add_status_routes(app, lambda: self.status() if self.status is not None else {}, self.errors)  # the relay's page at /
        return app

    async def start(self) -> None:
        """Bind and start serving."""
        from node.http_server import start_site  # header timeout, per-IP connection cap, no compressed bodies

        running = await start_site(self.make_app(), self.host, self.port)
        self._runner, self.port = running.runner, running.port
        logger.info("Shardcast server on %s", self.url)

    async def stop(self) -> None:
        """Stop serving and close connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        """Base URL of this server (what clients pass as a source)."""
        from node.http_server import http_url

        return http_url(self.host, self.port)

    async def _artifact(self, request: web.Request) -> web.Response:
        name = request.match_info["artifact_id"]
        if not _HEX_ID.match(name):
            raise web.HTTPBadRequest(text="artifact ID must be 64 lower-case hex digits")
        held = self.store.artifact(bytes.fromhex(name))
        if held is None:
            raise web.HTTPNotFound(text="artifact not held")
        return web.Response(body=held[1], content_type=MSGPACK_TYPE, headers={"Cache-Control": IMMUTABLE, "ETag": f'"{name}"'})

    async def _held(self, request: web.Request) -> web.Response:
        steps = self.store.steps()
        doc = {
            "run_id": self.store.run_id.hex(),
            "peer_id": self.peer_id or "",
            "held_steps": self.store.held_steps()[-512:],
            "steps": steps[-512:],
            "latest": steps[-1] if steps else None,
            "deltas": self.store.delta_steps()[-512:],
            "artifacts": [a.hex() for a in self.store.artifact_ids()[:16] if self.store.artifact_complete(a)],
        }
        return web.Response(text=json.dumps(doc), content_type="application/json", headers={"Cache-Control": "no-cache"})

    async def _manifest(self, request: web.Request) -> web.Response:
        name = request.match_info["step"]
        if name == "latest":
            step = self.store.latest_step()
            if step is None:
                raise web.HTTPNotFound(text="no manifest yet\n")
        else:
            if not _is_step(name):
                raise web.HTTPBadRequest(text="step must be a non-negative integer or 'latest'\n")
            step = int(name)
        env = self.store.manifest(step)
        if env is None:
            raise web.HTTPNotFound(text=f"no manifest for step {step}\n")
        headers = {
            "X-Shardcast-Step": str(step),
            "X-Shardcast-Complete": "1" if self.store.is_complete(step) else "0",
            "ETag": f'"{hex_id(env.id)}"',
            "Cache-Control": "no-cache" if name == "latest" else IMMUTABLE,
        }
        return web.Response(body=env.raw, content_type=MSGPACK_TYPE, headers=headers)

    async def _delta(self, request: web.Request) -> web.Response:
        name = request.match_info["step"]
        if not _is_step(name):
            raise web.HTTPBadRequest(text="step must be a non-negative integer\n")
        env = self.store.delta(int(name))
        if env is None:
            raise web.HTTPNotFound(text=f"no delta into step {name}\n")
        headers = {"X-Shardcast-Step": name, "X-Shardcast-Base-Step": str(env.body.base_step), "ETag": f'"{hex_id(env.id)}"',
                   "Cache-Control": IMMUTABLE}
        return web.Response(body=env.raw, content_type=MSGPACK_TYPE, headers=headers)

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        pid = request.match_info["piece_id"]
        if not _HEX_ID.match(pid):
            raise web.HTTPBadRequest(text="piece ID must be 64 lower-case hex digits\n")
        piece_id = bytes.fromhex(pid)
        path = self.store.piece_path(piece_id)
        if not path.is_file() and not (self.piece_wait_s > 0 and await self._wait_for_piece(piece_id, path)):
            raise web.HTTPNotFound(text="piece not held\n")
        if _ZERO_SUFFIX.match(request.headers.get("Range", "")):
            # RFC 9110 §14.1.1: a suffix range of length 0 selects no byte, so it is unsatisfiable (416);
            # aiohttp reads "-0" as "from byte 0" and answered 206 with the whole piece
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{path.stat().st_size}"})
        self.pieces_served += 1
        return web.FileResponse(path, headers={"Cache-Control": IMMUTABLE, "Content-Type": "application/octet-stream"})
