"""The run page's bounds without a browser: propagation rows from records, the snapshot API's caps
and rate limit, a node's page and its last errors. The run page and node pages in a real browser,
and ``doctor``, against a live devnet: ``test_devnet.py``."""

from __future__ import annotations

import json

import pytest

from protocol.messages import NodeRecord


def test_propagation_rows_from_records():
    from node.web.runpage import Propagation

    now = [100.0]
    prop = Propagation(clock=lambda: now[0])
    relay, worker = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44
    prop.note_published(0, 0.5)
    now[0] = 100.4
    prop.note_record(NodeRecord(peer_id=relay, role="relay", seq=1, version="t", held_steps=[0, 1]))  # step 1 before its announcement
    now[0] = 101.0
    prop.note_record(NodeRecord(peer_id=worker, role="worker", seq=1, version="t", policy_step=0))
    prop.note_published(1, 0.2)
    rows = {r["step"]: r for r in prop.rows()}
    assert rows[0]["publish_s"] == 0.5 and rows[0]["relays_first_s"] == pytest.approx(0.4) and rows[0]["workers_all_s"] == pytest.approx(1.0)
    assert rows[1]["relays_holding"] == 1 and rows[1]["relays_first_s"] == 0.0  # held before the announcement: 0 s
    for step in range(2, 200):
        prop.note_published(step, 0.1)
    assert len(prop.rows()) == prop.max_steps  # bounded


async def test_api_is_bounded_and_rate_limited(tmp_path):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from node.devnet.config import devnet_spec
    from node.web.runpage import CAPS, RunPage
    from protocol.identity import NodeKey
    from protocol.runspec import sign_run_spec
    from trainer.ledger import BanBook, SubmissionLedger

    key = NodeKey.generate()
    signed = sign_run_spec(devnet_spec(key, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="", seed=3), key)
    ledger = SubmissionLedger(tmp_path / "ingest", signed.spec, BanBook(tmp_path / "bans.msgpack", key, signed.run_id),
                              trainer_step=lambda: 2000, latest_policy_step=lambda: 2000)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"event": "step", "step": i, "reward_mean": 0.5, "pass_rate": 0.25,
                                           "verdicts": {"ok": i}}) + "\n" for i in range(1, 2000))
                       # an unchecked submission's huge reward made the last mean overflow (json writes Infinity)
                       + json.dumps({"event": "step", "step": 2000, "reward_mean": float("inf"), "pass_rate": float("nan")}) + "\n"
                       + '{"event": "st')
    page = RunPage(signed, ledger, status=lambda: {"trainer_step": 2000, "published_step": 2000, "state": "training"},
                   metrics_path=metrics, peer_id=key.peer_id)
    app = web.Application()
    page.add_routes(app)
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/api/run")
        assert r.status == 200
        def strict(c: str) -> None:
            raise AssertionError(f"{c} in the snapshot: browsers cannot parse it")

        doc = json.loads(await r.text(), parse_constant=strict)
        assert doc["curves"]["steps"][-1]["reward_mean"] is None and doc["curves"]["steps"][-1]["pass_rate"] is None
        assert len(doc["curves"]["steps"]) <= CAPS["curve_points"] + 1 and doc["curves"]["steps"][-1]["step"] == 2000
        assert doc["nodes"][0]["role"] == "coordinator" and doc["trainer"]["published_step"] == 2000
        assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
        html = await client.get("/")
        assert html.status == 200 and "/web/run.js" in await html.text()
        assert (await client.get("/web/..%2fassets.py")).status == 404
        codes = [(await client.get("/api/run")).status for _ in range(150)]
        assert 429 in codes  # one address cannot poll faster than the limit
    ledger.close()


async def test_node_page_and_last_errors(tmp_path):
    import logging

    from aiohttp import ClientSession
    from prometheus_client import CollectorRegistry

    from node.status_http import StatusServer

    server = StatusServer(lambda: {"role": "worker", "state": "waiting for the first policy announcement"}, CollectorRegistry())
    await server.start()
    try:
        logging.getLogger("node.test").warning("cannot fetch step %d", 7)
        async with ClientSession() as s:
            async with s.get(f"{server.url}/") as r:
                assert r.status == 200 and "/web/node.js" in await r.text()
            async with s.get(f"{server.url}/web/node.js") as r:
                assert r.status == 200 and r.content_type == "text/javascript"
            async with s.get(f"{server.url}/status") as r:
                doc = await r.json()
        assert doc["state"].startswith("waiting") and doc["last_errors"][-1]["message"] == "cannot fetch step 7"
    finally:
        await server.stop()
    assert server.errors not in logging.getLogger().handlers  # detached on stop
