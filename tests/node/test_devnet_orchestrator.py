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


def test_worker_outcomes_and_the_adversary_sentence(tmp_path) -> None:
    """Per worker the ledger's counts from /status, the rollouts trained from the run page's final
    snapshot, and the trainer step at which the devnet first saw a ban; the adversary's sentence says
    what was accepted and trained on, whether and when it was banned, and how it steered."""
    import json

    from node.devnet.orchestrator import Devnet, DevnetOptions

    dn = Devnet(DevnetOptions(out=tmp_path, adversary="steer", steer_rate=0.5, worker_dtype="bfloat16"))
    dn.peer_ids = {"coordinator": "12D3KooWcoord", "worker-0": "12D3KooWw0", "adversary": "12D3KooWadv"}
    assert dn.adversary_summary() is not None and "never banned" in str(dn.adversary_summary())  # before any status: zeros
    dn.status = {"trainer_step": 7, "workers": {"12D3KooWw0": {"accepted": 9, "trained": 4, "rejected": 1},
                                                "12D3KooWadv": {"accepted": 5, "trained": 2, "pending": 1}},
                 "banned": [{"peer_id": "12D3KooWw0", "reason": "sampling", "evidence": []}]}
    dn.banned_seen = {"12D3KooWw0": (6, 40.0)}
    dn.node_status = {"adversary": {"steering": {"rollouts": 320, "tokens": 900, "chances": 120, "taken": 61}}}
    page = tmp_path / "coordinator" / "run-page"
    page.mkdir(parents=True)
    # the final snapshot is newer than the last /status: its counts win (the adversary trained once more)
    board = [{"peer_id": "12D3KooWadv", "accepted": 5, "rejected": 0, "pending": 0, "submissions_trained": 3, "rollouts_trained": 192},
             {"peer_id": "12D3KooWw0", "rollouts_trained": 256}]
    bans = [{"peer_id": "12D3KooWw0", "reason": "sampling", "evidence": {"rollout": 3, "near_ties": 3, "detail": "3 near-tie mismatches > 2 allowed"}}]
    (page / "snapshot.js").write_text("window.RUN_SNAPSHOT = " + json.dumps({"leaderboard": board, "bans": bans}) + ";\n")
    rows = dn.worker_outcomes()
    assert set(rows) == {"worker-0", "adversary"}
    assert rows["worker-0"] | {"peer_id": "-"} == {"peer_id": "-", "accepted": 9, "rejected": 1, "stale": 0, "pending": 0, "trained": 4,
                                                  "rollouts_trained": 256, "banned": "sampling", "banned_at_step": 6, "banned_after_s": 40.0,
                                                  "ban_evidence": bans[0]["evidence"]}
    from node.devnet.report import workers_section

    text = "\n".join(workers_section(dn))
    assert "| worker-0 | `12D3KooWw0` | 9 | 1 (0) | 0 | 4 | sampling | 6 | 256 | bfloat16 |" in text
    assert "- worker-0: `sampling` at trainer step 6 (3 near-tie mismatches > 2 allowed): near_ties 3, rollout 3" in text
    said = dn.adversary_summary()
    assert said == ("adversary steer: 5 submissions accepted, 0 rejected, 0 pending, 3 trained on (192 rollouts); never banned; "
                    "steered 61 of 120 chances over 320 rollouts (900 tokens, rate 0.5)")
    (page / "snapshot.js").write_text("garbage")  # no readable snapshot: the rollouts are unknown, not 0
    assert dn.worker_outcomes()["adversary"]["rollouts_trained"] is None
