"""The devnet orchestrator's status polling: ``get_json`` keeps its promise of a JSON object or
``None`` whatever answers on a port (a port another process took may answer anything)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from localnet import serve_bodies

from node.devnet.orchestrator import get_json

BODIES = {"/object": b'{"step": 3}', "/list": b"[1, 2]", "/string": b'"up"', "/null": b"null", "/bad": b"{"}


@pytest.fixture
def server_url() -> Iterator[str]:
    with serve_bodies(BODIES) as url:
        yield url


def test_get_json_gives_objects_and_none_for_anything_else(server_url: str) -> None:
    assert get_json(f"{server_url}/object") == {"step": 3}
    # JSON that is no object was returned as is: the devnet kept a list as a node's status and
    # failed on its first ``.get``
    for path in ("/list", "/string", "/null", "/bad", "/missing"):
        assert get_json(f"{server_url}{path}") is None, path
