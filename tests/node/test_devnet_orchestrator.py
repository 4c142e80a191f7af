"""The devnet orchestrator's status polling: ``get_json`` keeps its promise of a JSON object or
``None`` whatever answers on a port (a port another process took may answer anything)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from node.devnet.orchestrator import get_json

BODIES = {"/object": b'{"step": 3}', "/list": b"[1, 2]", "/string": b'"up"', "/null": b"null", "/bad": b"{"}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = BODIES.get(self.path, b"")
        self.send_response(200 if self.path in BODIES else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server_url() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


def test_get_json_gives_objects_and_none_for_anything_else(server_url: str) -> None:
    assert get_json(f"{server_url}/object") == {"step": 3}
    # JSON that is no object was returned as is: the devnet kept a list as a node's status and
    # failed on its first ``.get``
    for path in ("/list", "/string", "/null", "/bad", "/missing"):
        assert get_json(f"{server_url}{path}") is None, path
