"""A small aiohttp server for a role's ``/status`` (JSON) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from node.http_server import http_url, start_site
from node.web.assets import RecentErrors, add_status_routes


class StatusServer:
    """Serves ``GET /status`` from ``status()`` and ``GET /metrics`` from ``registry`` on 127.0.0.1 by default,
    and the node's page at ``GET /`` (``node/web/static/node.html``: it polls ``/status``).

    ``/status`` also carries ``last_errors``: this process's last WARNING-or-worse log records
    (:class:`~node.web.RecentErrors`), unless ``status()`` sets that key itself.

    Args:
        status: returns the JSON-ready status dict.
        registry: the role's Prometheus registry.
        host: interface, port: TCP port (0: any).
    """

    def __init__(self, status: Callable[[], dict[str, Any]], registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.status = status
        self.registry = registry
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self.errors = RecentErrors()

    async def start(self) -> None:
        app = web.Application()
        add_status_routes(app, self.status, self.errors)
        app.router.add_get("/metrics", self._metrics)
        running = await start_site(app, self.host, self.port)  # header timeout, per-IP cap, no compressed bodies
        self._runner, self.port = running.runner, running.port

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # also detaches self.errors
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
