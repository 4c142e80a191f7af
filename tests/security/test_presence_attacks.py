"""Hostile peers against presence streams (``node/p2p/presence.py``, ``docs/gossip.md``), as real
libp2p hosts on 127.0.0.1.

* A peer posing as a hub (any peer a worker is connected to that speaks the presence protocol)
  floods the worker's presence stream with views: 256 records with broken signatures each, or
  validly signed ones as fast as it can write. Before the fix the worker checked every signature
  of every view (≈ 0.7 of a core at ≈ 3,300 junk records/s from one attacker, 20 s: its
  announcements arrived 5-10× later) and never cut the peer off.
* Sybil relay records (self-signed, ≈ 5 KiB each, ≈ 210 of them) make a hub's view outgrow the
  1 MiB presence frame. Before the fix the hub's view writer raised on every attached worker's
  stream, so every worker was detached from every hub and could not re-attach (seen: attached
  1 → 0, the worker re-opening a stream every ≈ 2 s), and with more than 255 of them the
  validators, which sort after ``relay``, fell out of the view.
* Fake hubs name rosters of 4,096 worker records minted once, in advance (roster entries have no
  age limit). Before the fix the coordinator checked every new entry of every roster (4 such hubs:
  its process at 0.95 of a core); now its entry checks are budgeted over all hubs.
* One identity opens presence streams back to back; each was sent the hub's view.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))  # the p2p test factories live there
from p2p_helpers import Run, config, forge, shared_bridge, swarm
from waiting import wait_until

from node.p2p import GossipNode
from node.p2p.bridge import TrioBridge
from node.p2p.host import P2PHost, parse_peer_addr
from node.p2p.presence import OPEN_BURST, OVER_BUDGET_LIMIT, VIEW_BURST, StreamReader
from protocol.envelope import seal
from protocol.identity import NodeKey, PeerId
from protocol.messages import NodeRecord
from protocol.presence import (
    LENGTH_BYTES,
    ROSTER_REQUEST_BYTES,
    VIEW,
    VIEW_MAX_BYTES,
    frame,
    pack_envelopes,
    pack_roster,
    pack_roster_answer,
    presence_protocol,
    roster_protocol,
)

pytestmark = pytest.mark.integration

VIEWS_SENT = 64
"""Views each fake hub writes (bounded), far more than its budget."""


def relay_record(key: NodeKey, run: Run, *, big: bool = False, seq: int = 1) -> bytes:
    """A self-signed relay record; ``big``: as large as the schema allows (≈ 5.3 KiB)."""
    if not big:
        return seal(key, run.spec.run_id, NodeRecord(peer_id=key.peer_id, role="relay", seq=seq, version="t"))
    return seal(key, run.spec.run_id, NodeRecord(
        peer_id=key.peer_id, role="relay", seq=seq, version="v" * 64, http_url="http://" + "h" * 240,
        addrs=[f"/dns4/{'a' * 226}{i:02d}.example/tcp/{4000 + i}" for i in range(16)], held_steps=[2**40 - i for i in range(64)],
    ))


@contextlib.asynccontextmanager
async def fake_hub(bridge: TrioBridge, run: Run, views: list[bytes]) -> AsyncIterator[tuple[NodeKey, P2PHost]]:
    """A bare host that speaks the presence protocol: to every presence stream a worker opens to it,
    it writes ``views`` (frames) back to back. Yields its key and host."""
    key = NodeKey.generate()
    host = P2PHost(key, config())

    async def serve(stream: INetStream) -> None:
        try:
            for data in views:
                with trio.fail_after(10):
                    await stream.write(data)
            await trio.sleep(30)  # keep the stream open: the worker decides when it ends
        except Exception:  # noqa: BLE001 - the worker cut us off
            return

    host.host.set_stream_handler(TProtocol(presence_protocol(run.spec.run_id)), serve)
    handle = await bridge.start_task(host.serve, timeout_s=10)
    try:
        yield key, host
    finally:
        await handle.cancel()


def banned(node: GossipNode, key: NodeKey) -> bool:
    """Whether ``node`` blacklisted ``key``'s peer (a test's look across threads)."""
    assert node._host is not None
    return key.peer_id in node._host._banned_until


async def presence(node: GossipNode) -> dict[str, Any]:
    return dict((await node.stats()).get("presence", {}))


async def test_a_fake_hub_flooding_views_is_budgeted_and_cut_off() -> None:
    """Junk views cost the worker one failed check and the peer its connection; valid views past
    the budget are dropped unread and then cost the peer its connection too. The worker's real
    hub keeps it attached throughout."""
    run = Run()
    junk = [forge(NodeKey.generate(), run.spec.run_id, "node_record/1",
                  NodeRecord(peer_id=NodeKey.generate().peer_id, role="relay", seq=1, version="t").model_dump(), corrupt_sig=True)
            for _ in range(256)]
    junk_view = frame(VIEW, pack_envelopes(junk))
    async with shared_bridge() as bridge, swarm(run, [("relay", None), ("worker", None)], bridge=bridge) as (relay, worker):
        await wait_until(lambda: worker.peer_id in relay.peers, 20.0, "the worker attached to its hub")
        async with fake_hub(bridge, run, [junk_view] * VIEWS_SENT) as (liar_key, liar):
            await bridge.run(liar.host.connect, parse_peer_addr(worker.addrs[0]), timeout_s=10)
            await wait_until(lambda: banned(worker, liar_key), 20.0, "the worker cutting off the hub that sent junk views")
            checked = (await worker.stats())["rejected"].get("view_bad_signer", 0)
            assert checked <= 1, f"the worker checked {checked} junk records (one lie is enough)"

        minted = [relay_record(NodeKey.generate(), run) for _ in range(VIEWS_SENT)]
        flood = [frame(VIEW, pack_envelopes([m])) for m in minted]  # each view new, each record valid
        async with fake_hub(bridge, run, flood) as (flood_key, flooder):
            await bridge.run(flooder.host.connect, parse_peer_addr(worker.addrs[0]), timeout_s=10)
            await wait_until(lambda: banned(worker, flood_key), 20.0, "the worker cutting off the hub that floods views")
            stats = await presence(worker)
            assert stats["views_over_budget"] == OVER_BUDGET_LIMIT + 1
            assert stats["views"] <= VIEW_BURST + 3 + 1, stats  # the burst, what refilled meanwhile, and the honest hub's
        assert worker.peer_id in relay.peers and relay.peer_id in worker.peers, "the honest hub and worker still see each other"


async def test_sybil_hub_records_never_push_a_view_past_its_frame() -> None:
    """≈ 210 self-signed 5 KiB relay records on the nodes topic: the hub's view is cut to fit its
    frame, its worker stays attached, and the view keeps the validator (key-checked) ahead of them."""
    run = Run(heartbeat_s=10.0)  # records stay alive 30 s: long enough to deliver them all here
    n = VIEW_MAX_BYTES // len(relay_record(NodeKey.generate(), run, big=True)) + 16
    sybils = [relay_record(NodeKey.generate(), run, big=True) for _ in range(n)]
    roles = [("relay", None), ("coordinator", run.coordinator), ("validator", run.validator), ("worker", None)]
    async with shared_bridge() as bridge, swarm(run, roles, bridge=bridge) as (relay, coord, validator, worker):
        await wait_until(lambda: worker.peer_id in relay.peers and validator.peer_id in worker.peers, 30.0,
                         "the worker attached to its hub and its view listing the validator")
        accepted = (await presence(relay))["streams_accepted"]
        attacker = await GossipNode.create(run.spec, NodeKey.generate(), config(bootstrap=[relay.addrs[0]]), role="relay", bridge=bridge)
        try:
            await wait_until(lambda: relay.peers.get(attacker.peer_id) is not None, 20.0, "the attacker's own record at the hub")
            for i, data in enumerate(sybils):
                await attacker.publish("nodes", data)
                if i % 20 == 19:
                    await asyncio.sleep(0.1)  # py-libp2p drops a new stream's 101st queued message
            await wait_until(lambda: sum(p.role == "relay" for p in relay.peers.alive()) > n, 60.0, "the Sybil records alive at the hub")
            hub = relay.presence.hub  # a test's look across threads
            assert hub is not None
            await wait_until(lambda: len(hub._view) > VIEW_MAX_BYTES * 0.9, 40.0, "the hub's view filled with Sybil records")
            # its attached worker's stream has written that view (or failed to)
            await wait_until(lambda: all(a.view_version == hub._view_version for a in list(hub._attached.values())), 20.0,
                             "the view written to the worker")
            stats = await presence(relay)
            assert stats["attached"] == 1 and stats["streams_accepted"] == accepted, f"the worker was detached: {stats}"
            assert worker.peer_id in relay.peers
            assert validator.peer_id in worker.peers and coord.peer_id in worker.peers, "the view kept the key-checked hubs"
        finally:
            await attacker.stop()


async def test_fake_hubs_cannot_make_the_coordinator_check_rosters_without_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four fake hubs (self-signed relay records; their hosts serve ``roster/1``) each name a roster
    of worker records minted in advance (roster entries have no age limit), each as large as the
    fetcher's burst. Before, the coordinator checked every entry of every such roster, as fast as
    the hubs named new ones (4 hubs of 4,096 kept a coordinator process at 0.95 of a core); now its
    checks stay within ``ENTRY_CHECK_BURST + ENTRY_CHECKS_PER_S × elapsed``, the rest wait, and an
    honest relay's worker still reaches it. The budget is scaled down 8x in rate and in burst (8 checks/s,
    512 at once: at the real 1,024/s a roster that a loaded machine is slow to serve arrives after
    the burst has refilled, and nothing is deferred)."""
    import node.p2p.presence as presence_module

    rate, burst = 8.0, 512.0
    monkeypatch.setattr(presence_module, "ENTRY_CHECKS_PER_S", rate)
    monkeypatch.setattr(presence_module, "ENTRY_CHECK_BURST", burst)
    run = Run()
    hubs = [NodeKey.generate() for _ in range(4)]
    members = [NodeKey.generate() for _ in range(int(burst))]
    rosters: dict[bytes, bytes] = {}
    named: list[tuple[NodeKey, bytes]] = []
    for i, key in enumerate(hubs):
        rid, data = pack_roster([seal(m, run.spec.run_id, NodeRecord(peer_id=m.peer_id, role="worker", seq=i + 1, version="t"))
                                 for m in members])
        rosters[bytes(rid)] = data
        named.append((key, bytes(rid)))

    async def serve_roster(stream: INetStream) -> None:
        with trio.move_on_after(10):
            wanted = (await StreamReader(stream).exactly(ROSTER_REQUEST_BYTES))[:32]
            answer = pack_roster_answer(rosters[wanted]) if wanted in rosters else b""
            await stream.write(len(answer).to_bytes(LENGTH_BYTES, "big") + answer)
            await stream.close()

    roles = [("relay", None), ("coordinator", run.coordinator), ("worker", None)]
    async with shared_bridge() as bridge, swarm(run, roles, bridge=bridge) as (relay, coord, worker):
        hosts = []
        async with contextlib.AsyncExitStack() as stack:
            for key in hubs:
                host = P2PHost(key, config())
                host.host.set_stream_handler(TProtocol(roster_protocol(run.spec.run_id)), serve_roster)
                handle = await bridge.start_task(host.serve, timeout_s=10)
                stack.push_async_callback(handle.cancel)
                hosts.append(host)
            attacker = await GossipNode.create(run.spec, NodeKey.generate(), config(bootstrap=[relay.addrs[0]]), role="relay", bridge=bridge)
            stack.push_async_callback(attacker.stop)
            await wait_until(lambda: relay.peers.get(attacker.peer_id) is not None, 20.0, "the attacker's own record at the hub")
            loop = asyncio.get_running_loop()
            started = loop.time()

            async def name_hubs(seq: int) -> None:  # the attacker names its hubs (again: a fetch that failed is retried when named)
                for (key, rid), host in zip(named, hosts, strict=True):
                    addrs = [str(a) for a in host.host.get_addrs()][:4]
                    await attacker.publish("nodes", seal(key, run.spec.run_id, NodeRecord(
                        peer_id=key.peer_id, role="relay", seq=seq, version="t", addrs=addrs, workers=len(members), roster=rid)))

            async def asked() -> dict[str, Any]:
                return dict((await coord.stats()).get("rosters", {}))

            def all_asked(stats: dict[str, Any]) -> bool:  # every fake hub's roster fetched and checked, or refused
                return stats.get("entries_verified", 0) + burst * stats.get("deferred", 0) >= len(hubs) * len(members)

            stats: dict[str, Any] = {}
            for seq in range(1, 61):  # named every 2 s until each was asked (≤ 120 s): a roster fetch can fail under load,
                await name_hubs(seq)  # and one named once is then never asked again (it took the whole 120 s, 7 Dec 2026)
                for _ in range(20):
                    if all_asked(stats := await asked()):
                        break
                    await asyncio.sleep(0.1)
                if all_asked(stats):
                    break
            assert all_asked(stats), f"the coordinator did not ask every fake hub in 120 s: {stats}"
            elapsed = loop.time() - started
            stats = await asked()
            bound = burst + rate * elapsed + 64  # + the honest relay's roster
            assert stats["entries_verified"] <= bound, f"{stats['entries_verified']} roster entries checked in {elapsed:.1f} s: {stats}"
            assert stats.get("deferred", 0) >= 1, stats
            await wait_until(lambda: worker.peer_id in coord.peers, 30.0, "the honest relay's worker at the coordinator")


async def test_presence_streams_opened_back_to_back_are_refused_before_a_view_is_sent() -> None:
    """One identity opens 60 presence streams back to back. Before, each replaced the last and was
    sent the hub's view (up to 1 MiB each; 220 streams a second took 0.7 of a hub's core); now
    past :data:`OPEN_BURST` they are closed before anything is sent, and the honest worker stays."""
    run = Run()
    async with shared_bridge() as bridge, swarm(run, [("relay", None), ("worker", None)], bridge=bridge) as (relay, worker):
        await wait_until(lambda: worker.peer_id in relay.peers, 20.0, "the worker attached to its hub")
        before = await presence(relay)
        key = NodeKey.generate()
        host = P2PHost(key, config())
        handle = await bridge.start_task(host.serve, timeout_s=10)
        try:
            await bridge.run(host.host.connect, parse_peer_addr(relay.addrs[0]), timeout_s=10)
            protocols = [TProtocol(presence_protocol(run.spec.run_id))]
            for _ in range(60):
                with contextlib.suppress(Exception):  # a refused stream may be reset while it is negotiated
                    await bridge.run(host.host.new_stream, ID.from_base58(relay.peer_id), protocols, timeout_s=10)
            stats: dict[str, Any] = {}
            for _ in range(100):  # the hub has handled all 60 (≤ 10 s)
                stats = await presence(relay)
                if stats["streams_accepted"] + stats.get("opens_over_budget", 0) - before["streams_accepted"] >= 60:
                    break
                await asyncio.sleep(0.1)
            handled = stats["streams_accepted"] + stats.get("opens_over_budget", 0) - before["streams_accepted"]
            assert handled > 2 * OPEN_BURST, f"the hub handled {handled} of the 60 streams: the refusal was not exercised: {stats}"
            sent = stats["views_sent"] - before["views_sent"]
            assert sent <= OPEN_BURST + 2, f"the hub sent {sent} views to 60 streams of one peer: {stats}"
            assert stats["attached"] == 1 and worker.peer_id in relay.peers
        finally:
            await handle.cancel()


async def test_minted_hub_records_neither_queue_roster_fetches_nor_stay_remembered() -> None:
    """A relay's peer mints hub records within its record budget: half name no roster, half a roster
    at an address that accepts TCP and never answers (each fetch holds a slot for the dial timeout).
    Before, each record with a roster queued a fetch for good behind 4 slots (512 in 15 s kept an
    honest relay's new worker from the coordinator for over 2 minutes) and each identity stayed in
    the fetcher; now fetches of hubs the coordinator knows go first and the rest are bounded, and a
    hub is remembered only once its roster was fetched."""
    run = Run()
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(256)  # connections complete in the kernel and are never read: every dial waits its timeout
    port = hole.getsockname()[1]
    try:
        async with shared_bridge() as bridge, swarm(run, [("relay", None), ("coordinator", run.coordinator)], bridge=bridge,
                                                    target_peers=1) as (relay, coord):
            await wait_until(lambda: relay.peer_id in coord.peers, 20.0, "the relay at the coordinator")
            attacker = await GossipNode.create(run.spec, NodeKey.generate(), config(bootstrap=[relay.addrs[0]], target_peers=1),
                                               role="relay", bridge=bridge)
            try:
                await wait_until(lambda: relay.peers.get(attacker.peer_id) is not None, 20.0, "the attacker at the relay")
                for i in range(120):
                    k = NodeKey.generate()
                    extra: dict[str, Any] = {} if i % 2 else {"addrs": [f"/ip4/127.0.0.1/tcp/{port}"], "workers": 1, "roster": os.urandom(32)}
                    await attacker.publish("nodes", seal(k, run.spec.run_id, NodeRecord(peer_id=k.peer_id, role="relay", seq=1, version="m", **extra)))
                await wait_until(lambda: coord.peers.get(k.peer_id) is not None, 20.0, "the minted records at the coordinator")
                async with swarm(run, [("worker", None)], bridge=bridge, bootstrap=[relay.addrs[0]], target_peers=1) as (worker,):
                    # 60 unreachable fetches ahead of it took 4 slots x 3 s each per 4: 45 s before the fix
                    await wait_until(lambda: worker.peer_id in coord.peers, 20.0, "the honest relay's new worker at the coordinator")
                rosters = dict((await coord.stats())["rosters"])
                assert rosters["hubs"] <= 2, f"minted identities remembered by the roster fetcher: {rosters}"
            finally:
                await attacker.stop()
    finally:
        hole.close()


def test_fresh_identities_do_not_refill_a_peers_spent_open_budget() -> None:
    """A peer that spent its presence-stream opens stays refused while thousands of other identities
    open streams: the hub forgets only its least recently used budgets (the budgets used to be
    cleared whole past 4 × the hub's workers, so minting 9 identities gave a flooder a fresh burst)."""
    from node.p2p.presence import PresenceHub

    hub = PresenceHub(b"r" * 32, peer_id=PeerId("hub"), heartbeat_interval_s=2.0, check_record=lambda raw: None,  # type: ignore[arg-type, return-value]
                      on_attach=lambda env: None, on_detach=lambda p: None, ban=lambda p: None, max_attached=2, clock=lambda: 0.0)
    flooder = PeerId("flooder")
    assert all(hub._may_open(flooder, 0.0) for _ in range(int(OPEN_BURST)))
    for i in range(1000):
        assert hub._may_open(PeerId(f"sybil-{i}"), 0.0)
        assert not hub._may_open(flooder, 0.0), f"the flooder's budget came back after {i + 1} new identities"
