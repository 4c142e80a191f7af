"""A gossip node's counters as Prometheus metrics (``intellect_gossip_*``).

What the node drops, refuses and holds is otherwise only in :meth:`GossipNode.stats
<node.p2p.service.GossipNode.stats>`: send-queue and delivery drops (``docs/gossip.md``, send
queues), rejected messages by reason, bans, connections, live peers and, on a hub, the workers
attached over presence streams. :class:`GossipCollector` exports the node's latest snapshot of them;
the node refreshes it every heartbeat interval once a collector is registered
(:meth:`GossipNode.register_metrics <node.p2p.service.GossipNode.register_metrics>`), because a
Prometheus scrape runs synchronously and the counters live on the trio thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


def gossip_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The counters of a ``GossipNode.stats()`` dict a status page shows: connections, live peers,
    peers banned now, workers attached (a hub), send-queue and delivery drops, rejected messages by reason."""
    out = {
        "connected": stats.get("connected", 0),
        "peers_alive": stats.get("peers_alive", 0),
        "banned": len(stats.get("banned", ())),
        "send_drops": dict(stats.get("send_drops", {})),
        "delivery_drops": stats.get("delivery_drops", 0),
        "rejected": dict(stats.get("rejected", {})),
    }
    presence = stats.get("presence") or {}
    if "attached" in presence:
        out["attached"] = presence["attached"]
    return out


class GossipCollector(Collector):
    """Yields ``intellect_gossip_*`` metrics from ``snapshot()`` (a ``GossipNode.stats()`` dict,
    empty before the first refresh: then nothing is yielded).

    Metrics: ``connected`` and ``peers_alive`` (gauges), ``banned`` (peers blacklisted now),
    ``send_drops_total{reason}`` (RPCs dropped from a peer's send queue: ``queue_full``,
    ``oversized``; ``messages`` counts the publishes inside them; ``publish_waits_expired``: own
    publishes that waited their 2 s for room), ``delivery_drops_total`` (verified messages dropped
    from a full delivery channel), ``rejected_total{reason}`` (messages refused by the topic
    validator or a budget), and on a hub ``presence_attached`` (workers attached) and
    ``presence_refused_total{reason}`` (presence streams and frames refused: offences, a full hub,
    frames past a stream's budget, streams opened past a peer's budget, stale or replayed records,
    workers detached for silence).
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Any]:
        return []  # metric names depend on the snapshot; describing none keeps registration lazy

    def collect(self) -> Iterator[Any]:
        s = self._snapshot()
        if not s:
            return
        yield GaugeMetricFamily("intellect_gossip_connected", "libp2p connections open", value=s.get("connected", 0))
        yield GaugeMetricFamily("intellect_gossip_peers_alive", "Peers alive in the peer table", value=s.get("peers_alive", 0))
        yield GaugeMetricFamily("intellect_gossip_banned", "Peers blacklisted now", value=len(s.get("banned", ())))
        yield _by_reason("intellect_gossip_send_drops", "RPCs dropped from peers' send queues, by reason", s.get("send_drops", {}))
        drops = CounterMetricFamily("intellect_gossip_delivery_drops", "Verified messages dropped from a full delivery channel")
        drops.add_metric([], s.get("delivery_drops", 0))
        yield drops
        yield _by_reason("intellect_gossip_rejected", "Messages refused by the topic validator or a budget, by reason", s.get("rejected", {}))
        presence = s.get("presence") or {}
        if "attached" in presence:  # a hub
            yield GaugeMetricFamily("intellect_gossip_presence_attached", "Workers attached over presence streams",
                                    value=presence["attached"])
            refused = {k.removeprefix("refused_"): v for k, v in presence.items() if k.startswith("refused_")}
            refused.update({reason: presence.get(key, 0) for reason, key in _PRESENCE_IGNORED.items()})
            yield _by_reason("intellect_gossip_presence_refused", "Presence frames or streams refused, by reason", refused)


_PRESENCE_IGNORED = {"over_budget": "over_budget", "opens_over_budget": "opens_over_budget", "stale": "records_stale", "replayed": "records_replayed", "beat_timeout": "beat_timeouts"}
"""Presence counters (``PresenceHub.counters``) exported as refusals without an offence: frames past
a stream's budget, streams opened past a peer's budget, stale or replayed records, workers detached
for silence."""


def _by_reason(name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["reason"])
    for reason, n in sorted(counts.items()):
        family.add_metric([reason], n)
    return family
