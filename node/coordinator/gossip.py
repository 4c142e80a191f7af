"""The coordinator on gossip: announces each published policy step, forwards the verdicts and ban
lists the ingest applied, and hands verdicts heard on gossip to the ingest.

Gossip is best effort (HTTP stays the source of truth): a failed publish is logged at DEBUG.
Publishing may be asked from any thread (the training thread announces, the ban rule's re-check
thread bans); it is scheduled on the event loop the node runs on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from node.p2p import GossipConfig, GossipNode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import Verdict
from protocol.runspec import RunSpec

logger = logging.getLogger(__name__)


class CoordinatorGossip:
    """The coordinator's gossip node and what it publishes (``await CoordinatorGossip.create(...)``).

    Args:
        node: the started gossip node; loop: the event loop it runs on.
        apply_verdict: applies a verdict heard on gossip (already verified there: signed by a
            validator of the spec), e.g. ``IngestService.apply_verdict(env, via_gossip=True)``.
    """

    def __init__(self, node: GossipNode, loop: asyncio.AbstractEventLoop, apply_verdict: Callable[[Envelope[Verdict]], object]) -> None:
        self.node = node
        self.loop = loop
        self._apply = apply_verdict
        node.on_verdict(self._on_verdict)

    @classmethod
    async def create(cls, spec: RunSpec, key: NodeKey, config: GossipConfig, *, http_url: str,
                     apply_verdict: Callable[[Envelope[Verdict]], object]) -> CoordinatorGossip:
        node = await GossipNode.create(spec, key, config, role="coordinator", http_url=http_url)
        return cls(node, asyncio.get_running_loop(), apply_verdict)

    @property
    def addrs(self) -> list[str]:
        """The gossip node's multiaddrs (``…/p2p/<peer ID>``), for bootstrapping others."""
        return list(self.node.addrs)

    async def stop(self) -> None:
        await self.node.stop()

    def announce(self, step: int, announcement: bytes) -> None:
        """Policy step ``step`` is in the origin: say so in our record and announce it (any thread)."""
        self.node.set_record(policy_step=step)
        asyncio.run_coroutine_threadsafe(self.node.publish_announcement(announcement), self.loop)

    def publish_verdict(self, raw: bytes) -> None:
        """Forward a verdict the ingest applied over HTTP (any thread)."""
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._publish("verdict", raw)))

    def publish_bans(self, raw: bytes) -> None:
        """Publish the new signed ban list (any thread)."""
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._publish("ban", raw)))

    async def _publish(self, kind: str, raw: bytes) -> None:
        try:
            if kind == "verdict":
                await self.node.publish_verdict(raw)
            else:
                await self.node.publish_ban_list(raw)
        except Exception as e:  # noqa: BLE001 - gossip is best effort: HTTP remains the source of truth
            logger.debug("gossip publish of %s failed: %s", kind, e)

    def _on_verdict(self, env: Envelope[Verdict]) -> None:
        # applied in a thread, as over HTTP: the verdict's commit waits for an fsync
        self.loop.run_in_executor(None, self._apply_quietly, env)

    def _apply_quietly(self, env: Envelope[Verdict]) -> None:
        try:
            self._apply(env)
        except ProtocolError as e:
            logger.debug("ignoring gossiped verdict: %s", e)
        except Exception:  # the ingest keeps serving; this verdict may come again over HTTP
            logger.exception("applying a gossiped verdict failed")
