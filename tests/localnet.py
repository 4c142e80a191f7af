"""Loopback helpers shared by tests that start servers and processes on 127.0.0.1.

Importable from every test directory (pytest puts ``tests/``, the directory of the root
``conftest.py``, on ``sys.path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

T = TypeVar("T")

SHARED_PROCESSES: set[int] = set()
"""PIDs of child processes a module- or session-scoped fixture keeps running across its tests (a
shared devnet): the conftest's reaper, which kills every other child after each test, spares them
and their children. The fixture stops them itself."""


@contextlib.contextmanager
def reserve_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port held for the ``with`` block, for a server whose port must be known before it starts
    (a signed run spec names it, or a command line): the server binds it too, nobody else can.

    Bind at port 0 and read the port back wherever the server can say what it bound (its object, its
    "serving"/"started" line); this is for the other cases. The port stays bound here with
    ``SO_REUSEADDR`` and never listens, so: a server that binds it with ``SO_REUSEADDR`` and listens
    gets it (``node/http_server.py``, aiohttp, py-libp2p's TCP transport and the doctor's port check all
    set it); a plain ``bind`` elsewhere fails, and the kernel hands it out neither for another
    ``bind(0)`` nor as an outgoing connection's local port; until a server listens, a connection
    to it is refused (a dead address for tests that need one). ``free_port()`` (bind, read, close,
    hope) let another process take the port in between.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        yield int(s.getsockname()[1])


def get_json(url: str, timeout_s: float = 2.0) -> Any | None:
    """``GET url`` parsed as JSON; ``None`` when nobody answers, the answer is an HTTP error or not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # loopback only
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def post(url: str, data: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """``POST data`` to ``url``: ``(status, body)``, also for HTTP errors; ``(0, b"")`` when nobody answers."""
    req = urllib.request.Request(url, data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # loopback only
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:  # the server finished and closed its port
        return 0, b""


@contextlib.contextmanager
def serve_bodies(bodies: dict[str, bytes]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 (any port) answering ``GET path`` with ``bodies[path]`` as JSON
    (404 and an empty body for other paths); yields its base URL, stops on exit."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's method name
            body = bodies.get(self.path, b"")
            self.send_response(200 if self.path in bodies else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def serve_app(app_factory: Callable[[], Any], host: str = "127.0.0.1") -> Iterator[str]:
    """An aiohttp application (``app_factory()``, built on the server's own event loop) served in a
    thread on ``host`` (any port); yields its base URL, stops on exit. For tests that are not
    themselves async (a blocking command under test runs its own event loop)."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(app_factory(), shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        box["runner"], box["port"] = runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the test server did not start within 10 s")
    try:
        yield f"http://{host}:{box['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
