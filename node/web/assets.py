"""Static page files and the aiohttp routes that serve them.

The files live in ``node/web/static`` (package data). Only the names listed in :data:`ASSETS`
are served, from memory; nothing is read from a path a request names.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
from collections.abc import Callable
from importlib import resources
from typing import Any

from aiohttp import web

from protocol.ratelimit import RateLimiter

ASSETS = {"style.css": "text/css", "common.js": "text/javascript", "run.js": "text/javascript", "node.js": "text/javascript",
          "icon.svg": "image/svg+xml"}
"""Files under ``/web/<name>`` and their content types."""
PAGES = ("run.html", "node.html")
PAGE_REQUESTS_PER_S = 5.0
"""Sustained page and API requests per second per client IP (a page polls once a second)."""
PAGE_BURST = 30.0
"""Requests a client IP may make at once (a page load fetches four files)."""
SECURITY_HEADERS = {
    # scripts and styles only from this origin: nothing peer-controlled can run as script
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def asset_bytes(name: str) -> bytes:
    """The bytes of a shipped static file (``name`` from :data:`ASSETS` or :data:`PAGES`).

    Raises:
        KeyError: a name that is not shipped.
    """
    if name not in ASSETS and name not in PAGES:
        raise KeyError(name)
    return resources.files("node.web").joinpath("static", name).read_bytes()


class PageLimiter:
    """A per-IP token bucket for the page routes; answers 429 with ``Retry-After`` when empty."""

    def __init__(self, rate_per_s: float = PAGE_REQUESTS_PER_S, burst: float = PAGE_BURST) -> None:
        self.limiter = RateLimiter(rate_per_s, burst, max_peers=10_000)

    def check(self, request: web.Request) -> None:
        """Raise ``HTTPTooManyRequests`` when ``request``'s IP is over its rate."""
        ip = request.remote or "?"
        if not self.limiter.allow(ip):
            retry = max(1, int(self.limiter.retry_after_s(ip) + 0.999))
            raise web.HTTPTooManyRequests(text="too many requests from this address", headers={"Retry-After": str(retry)})


def add_page_routes(app: web.Application, page: str, limiter: PageLimiter | None = None) -> PageLimiter:
    """Serve ``page`` (``run.html`` or ``node.html``) at ``GET /`` and the shared assets at ``GET /web/<name>``.

    Args:
        app: the server's application (before it starts).
        page: which page ``/`` shows.
        limiter: the per-IP limit to share with other page routes (a new one if ``None``).

    Returns:
        The limiter, to use on the page's data routes too.
    """
    limiter = limiter or PageLimiter()
    files = {name: asset_bytes(name) for name in (*ASSETS, page)}  # read once: no file I/O per request

    async def index(request: web.Request) -> web.Response:
        limiter.check(request)
        return web.Response(body=files[page], content_type="text/html", charset="utf-8", headers=SECURITY_HEADERS)

    async def asset(request: web.Request) -> web.Response:
        limiter.check(request)
        name = request.match_info["name"]
        if name not in ASSETS:
            raise web.HTTPNotFound(text=f"no asset {name[:64]!r}")
        return web.Response(body=files[name], content_type=ASSETS[name], charset="utf-8", headers=SECURITY_HEADERS)

    async def no_favicon(request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("/web/icon.svg")

    app.router.add_get("/", index)
    app.router.add_get("/web/{name}", asset)
    app.router.add_get("/favicon.ico", no_favicon)
    return limiter


class RecentErrors(logging.Handler):
    """The process's last WARNING-or-worse log records, for node pages (bounded, thread-safe).

    Args:
        capacity: records kept (oldest dropped first).
        max_chars: each message cut to this many characters.
    """

    def __init__(self, capacity: int = 20, max_chars: int = 300) -> None:
        super().__init__(level=logging.WARNING)
        self.max_chars = max_chars
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._lock_ = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string (any error) must not break logging
            msg = str(record.msg)
        with self._lock_:
            self._records.append({"ts_ms": int(record.created * 1000), "level": record.levelname, "logger": record.name,
                                  "message": msg[: self.max_chars]})

    def snapshot(self) -> list[dict[str, Any]]:
        """The kept records, oldest first (JSON-ready)."""
        with self._lock_:
            return list(self._records)

    def install(self) -> Callable[[], None]:
        """Attach to the root logger; returns the function that detaches it again."""
        root = logging.getLogger()
        root.addHandler(self)
        return lambda: root.removeHandler(self)


def _finite(value: Any, depth: int = 0) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by ``None``, down to 32 levels.

    JSON has no NaN or Infinity: one such value (Python's ``json`` writes ``NaN``) makes the
    browser's parse of the whole ``/status`` document fail, and the node page goes blank.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= 32:
        return value
    if isinstance(value, dict):
        return {k: _finite(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, depth + 1) for v in value]
    return value


def add_status_routes(app: web.Application, status: Callable[[], dict[str, Any]], errors: RecentErrors, page: str = "node.html") -> None:
    """Serve a node's ``GET /status`` (JSON) and its page at ``GET /`` (which polls ``/status``).

    ``/status`` carries ``last_errors``, the records ``errors`` keeps, unless ``status()`` sets that
    key itself. ``/status`` shares the page's per-client-IP limit (:class:`PageLimiter`: 429 with
    ``Retry-After`` when over it). ``errors`` is attached to the root logger while ``app`` runs: from its start-up to
    its clean-up (``AppRunner.setup`` / ``AppRunner.cleanup``), so a server that stops, or fails to
    bind, leaves no handler behind.

    Args:
        app: the server's application (before it starts).
        status: returns the JSON-ready status dict (values JSON cannot hold are sent as ``str``;
            non-finite floats as ``null``).
        errors: where this process's last warnings and errors are kept.
        page: which page ``/`` shows.
    """
    root = logging.getLogger()

    async def status_route(request: web.Request) -> web.Response:
        limiter.check(request)  # ~7.6 KB a response: unlimited, one client pulled ~50 MB/s off a relay
        doc = status()
        doc.setdefault("last_errors", errors.snapshot())
        return web.json_response(_finite(doc), dumps=lambda o: json.dumps(o, default=str, allow_nan=False))

    async def attach(_app: web.Application) -> None:
        root.addHandler(errors)

    async def detach(_app: web.Application) -> None:
        root.removeHandler(errors)

    limiter = add_page_routes(app, page)
    app.router.add_get("/status", status_route)
    app.on_startup.append(attach)
    app.on_cleanup.append(detach)
