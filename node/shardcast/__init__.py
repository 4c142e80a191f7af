"""Shardcast: content-addressed, coordinator-signed checkpoint distribution over HTTP.

What lives where (format rules are pure, in :mod:`protocol.shardcast`):

* :mod:`.store`    — :class:`ShardcastStore`, the on-disk content-addressed store with retention.
* :mod:`.publish`  — :func:`publish_checkpoint`, cut + sign a checkpoint into a store (origin, trainer).
* :mod:`.server`   — :class:`ShardcastServer`, the aiohttp routes under ``/shardcast/1``.
* :mod:`.relay`    — :class:`Relay`, follow upstreams, verify, serve cut-through, keep the last K steps.
* :mod:`.client`   — :func:`fetch_checkpoint`, multi-source verified download with resume.
* :mod:`.download`, :mod:`.sources` — the HTTP fetch engine and source choice both use.
* :mod:`.delta`    — step deltas: :func:`~.delta.publish_delta` (origin), :func:`~.delta.fetch_step`
  (apply a delta chain, else fetch in full), relay mirroring and rebuilding from deltas.

Fetched weights are read by :func:`protocol.models.iter_weights` (safetensors only); a worker's or
validator's held steps are owned by :class:`node.policy.PolicyFollower`.
"""

from node.shardcast.client import FetchResult, fetch_checkpoint
from node.shardcast.download import DownloadConfig
from node.shardcast.publish import publish_checkpoint
from node.shardcast.relay import Relay, RelayConfig
from node.shardcast.server import ShardcastServer
from node.shardcast.store import ShardcastStore

__all__ = [
    "DownloadConfig",
    "FetchResult",
    "Relay",
    "RelayConfig",
    "ShardcastServer",
    "ShardcastStore",
    "fetch_checkpoint",
    "publish_checkpoint",
]
