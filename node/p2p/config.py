"""Configuration of a node's libp2p host and gossip (one pydantic model, defaults < TOML < CLI)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.runspec import HEARTBEAT_MIN_S


class GossipConfig(BaseModel):
    """How a node joins the run's gossip network. Every field has a default that works on one laptop."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen_host: Annotated[str, Field(max_length=64, description="interface to listen on; 0.0.0.0 or :: for all")] = "127.0.0.1"
    p2p_port: Annotated[int, Field(ge=0, le=65535, description="TCP port for libp2p; 0 picks a free one")] = 0
    bootstrap: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=64)] = Field(
        default_factory=list, description="bootstrap multiaddrs (/ip4/…/tcp/…/p2p/12D3KooW…), added to the run spec's"
    )
    announce_addrs: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] = Field(
        default_factory=list, description="multiaddrs to advertise instead of the listen addresses (NAT, containers)"
    )
    heartbeat_interval_s: Annotated[float | None, Field(ge=HEARTBEAT_MIN_S, le=3600.0,
                                                        description="seconds; None: the run spec's (its floor too)")] = None
    missed_heartbeats: Annotated[int, Field(ge=1, le=100, description="a peer silent this many intervals is dead")] = 3
    freshness_slack_s: Annotated[float, Field(ge=0.0, le=3600.0, description="seconds added to the max message age")] = 5.0
    max_future_s: Annotated[float, Field(ge=0.0, le=3600.0, description="accepted clock skew ahead of ours, seconds")] = 10.0
    publish_records: Annotated[bool, Field(description="publish signed node records (False: silent observer)")] = True
    split_records: Annotated[bool, Field(description="worker/observer records on their own topic that only infrastructure nodes read (docs/gossip.md, message budget); False: every record on one topic every node reads (the old layout, for comparison)")] = True
    presence: Annotated[bool, Field(description="workers tell only the hubs they are connected to that they are alive, over a presence stream, and hubs publish one record per interval naming their roster (docs/gossip.md); False: worker records flooded on the workers topic (the issue-18 layout, kept so the benchmarks can compare)")] = True
    fetch_rosters: Annotated[bool | None, Field(description="fetch hubs' rosters to list every live worker; None: the coordinator and silent observers do")] = None
    max_records_per_interval: Annotated[int, Field(ge=1, le=1 << 20, description="node records one peer may forward to us on the nodes topic per heartbeat interval; the rest are dropped before their signature is checked and cost the forwarder penalty points")] = 256
    hub_full_mesh: Annotated[bool, Field(description="an infrastructure node (coordinator, relay, validator) keeps every peer that grafts it in its gossipsub mesh, up to max_peers (docs/gossip.md, mesh of a star); False: gossipsub's usual bound of 12, kept only so the benchmark can compare")] = True
    target_peers: Annotated[int, Field(ge=1, le=256, description="dial peers learned from records until this many connections")] = 3
    max_peers: Annotated[int, Field(ge=1, le=4096, description="most connections (inbound + outbound) accepted")] = 64
    max_peers_per_ip: Annotated[int, Field(ge=0, le=4096, description="most connections from one remote IP address, IPv6 counted per /56 (0: no limit); addresses in ip_limit_exempt are not counted")] = 8
    ip_limit_exempt: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=64)] = Field(
        default_factory=lambda: ["127.0.0.0/8", "::1/128"], description="CIDR networks max_peers_per_ip does not apply to (loopback: this machine)"
    )
    dial_timeout_s: Annotated[float, Field(gt=0.0, le=120.0, description="seconds per dial attempt")] = 5.0
    bootstrap_backoff_s: Annotated[float, Field(gt=0.0, le=60.0, description="first retry delay after a failed bootstrap dial, seconds")] = 0.5
    bootstrap_backoff_max_s: Annotated[float, Field(gt=0.0, le=3600.0, description="longest retry delay, seconds")] = 30.0
    penalty_limit: Annotated[float, Field(gt=0.0, le=1e6, description="penalty points after which a peer is disconnected")] = 50.0
    penalty_half_life_s: Annotated[float, Field(gt=0.0, le=86400.0, description="penalty points halve every this many seconds")] = 60.0
    ban_s: Annotated[float, Field(ge=0.0, le=86400.0, description="how long a disconnected offender stays blacklisted, seconds")] = 300.0
    max_messages_per_topic_per_second: Annotated[float, Field(gt=0.0, le=1e6, description="gossipsub per-peer rate limit")] = 1000.0
    muxer: Annotated[Literal["yamux", "mplex"], Field(description="stream muxer (mplex: ~20% less CPU per message, docs/gossip.md)")] = "yamux"
    bridge: Annotated[Literal["thread", "guest"], Field(description="asyncio↔trio bridge (docs/gossip.md)")] = "thread"
    start_timeout_s: Annotated[float, Field(gt=0.0, le=600.0, description="seconds to bring the host up")] = 15.0
    stop_timeout_s: Annotated[float, Field(gt=0.0, le=60.0, description="seconds to shut the host down")] = 3.0
