"""A piece-serving app for the HTTP servers' attack tests: ``GET /file`` answers a file with
``sendfile`` (as Shardcast serves pieces) and ``GET /small`` a short body."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web


def file_app(piece: Path, *, started: asyncio.Event | None = None) -> tuple[web.Application, asyncio.Event]:
    """The app, and an event set once a ``/file`` handler ended (its sendfile finished or failed);
    ``started`` is set when one begins sending."""
    ended = asyncio.Event()

    class _Tracked(web.FileResponse):
        async def prepare(self, request: web.BaseRequest):  # type: ignore[override]
            if started is not None:
                started.set()
            try:
                return await super().prepare(request)
            finally:
                ended.set()

    async def file(_request: web.Request) -> web.StreamResponse:
        return _Tracked(piece)

    async def small(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/file", file)
    app.router.add_get("/small", small)
    return app, ended
