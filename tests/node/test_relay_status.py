"""Every role has ``/status``: the relay answers on its Shardcast port; ``status`` learns the latest
step from a relay's held steps."""

from __future__ import annotations

import logging
import time

import aiohttp
import pytest
from shardcast_fixtures import make_run, make_store, publish, write_checkpoint
from waiting import wait_until

from node.commands.status import latest_step
from node.relay.role import relay_status
from node.shardcast.relay import Relay, RelayConfig


async def test_relay_status_reports_held_steps(tmp_path):
    run = make_run()
    origin = make_store(run, tmp_path / "origin")
    publish(run, origin, write_checkpoint(tmp_path / "ckpt0", size_mib=0.2), step=0)
    from node.shardcast.server import ShardcastServer

    up = ShardcastServer(origin)
    await up.start()
    relay = Relay(make_store(run, tmp_path / "relay"), RelayConfig(upstreams=(up.url,), peer_id="relay-peer"))
    relay.server.status = lambda: relay_status(relay, "relay-peer", "http://relay.example:8700", time.monotonic())
    await relay.start()
    try:
        await wait_until(lambda: relay.held_steps() == [0])
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{relay.url}/status") as r:
                assert r.status == 200
                doc = await r.json()
            async with s.get(f"{up.url}/status") as r:
                assert r.status == 404  # a plain Shardcast server (the coordinator adds its own /status)
        assert doc["role"] == "relay" and doc["held_steps"] == [0] and doc["latest_step"] == 0
        assert doc["url"] == "http://relay.example:8700" and doc["upstreams"] == [up.url]
        assert isinstance(doc["last_errors"], list)
        assert relay.server.errors in logging.getLogger().handlers
        assert "gossip" not in doc  # off gossip: no counters
        stats = {"connected": 3, "peers_alive": 5, "banned": ["p"], "send_drops": {"queue_full": 2}, "delivery_drops": 1,
                 "rejected": {"stale": 4}, "presence": {"attached": 2, "records": 9}}
        on_gossip = relay_status(relay, "relay-peer", "http://relay.example:8700", time.monotonic(), gossip=stats)["gossip"]
        assert on_gossip == {"connected": 3, "peers_alive": 5, "banned": 1, "send_drops": {"queue_full": 2}, "delivery_drops": 1,
                             "rejected": {"stale": 4}, "attached": 2}
    finally:
        await relay.stop()
        await up.stop()
    assert relay.server.errors not in logging.getLogger().handlers  # detached on stop


async def test_a_status_server_that_cannot_bind_leaves_no_log_handler():
    """The status routes keep this process's last errors only while their server runs (node.web.add_status_routes)."""
    from prometheus_client import CollectorRegistry

    from node.status_http import StatusServer

    first = StatusServer(lambda: {"role": "worker"}, CollectorRegistry())
    await first.start()
    try:
        second = StatusServer(lambda: {"role": "worker"}, CollectorRegistry(), port=first.port)
        with pytest.raises(OSError):
            await second.start()
        assert second.errors not in logging.getLogger().handlers
    finally:
        await first.stop()


def test_urls_bracket_ipv6_hosts():
    from node.http_server import http_url

    assert http_url("127.0.0.1", 8700) == "http://127.0.0.1:8700"
    assert http_url("::1", 8700) == "http://[::1]:8700"


def test_status_latest_step_from_any_peer():
    relay = {"policy_step": -1, "held_steps": [0, 1]}
    worker = {"policy_step": 3, "held_steps": []}
    assert latest_step(None, [relay]) == 1  # bootstrapped from a relay: its newest held step
    assert latest_step(None, [relay, worker]) == 3
    assert latest_step(5, [relay, worker]) == 5
    assert latest_step(None, [{"policy_step": -1, "held_steps": []}]) is None
