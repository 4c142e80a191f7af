"""The devnet orchestrator's status polling: ``get_json`` keeps its promise of a JSON object or
``None`` whatever answers on a port (a port another process took may answer anything); a run
whose every worker is banned is ended, not waited out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from localnet import serve_bodies

from node.devnet.orchestrator import get_json, workers_all_banned

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


def test_a_run_whose_every_worker_is_banned_is_ended_with_the_reason() -> None:
    ids = {"coordinator": "12D3KooWcoord", "worker-0": "12D3KooWworker0", "worker-1": "12D3KooWworker1", "adversary": "12D3KooWadv"}
    ban = lambda pid, reason: {"peer_id": pid, "reason": reason, "evidence": []}
    assert workers_all_banned({}, ids) is None
    assert workers_all_banned({"banned": [ban("12D3KooWadv", "cheat reproduced")]}, ids) is None  # the adversary is meant to be
    assert workers_all_banned({"banned": [ban("12D3KooWworker0", "x"), ban("12D3KooWadv", "y")]}, ids) is None  # worker-1 still works
    why = workers_all_banned({"banned": [ban("12D3KooWworker0", "sampling: token 3 outside its interval"), ban("12D3KooWworker1", "toploc")]}, ids)
    assert why is not None and "worker-0" in why and "sampling: token 3 outside its interval" in why and "worker-1" in why
    assert workers_all_banned({"banned": "junk"}, ids) is None  # a malformed status is no reason to stop
