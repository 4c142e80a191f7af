"""I/O and roles of intellect-node: the CLI, libp2p host and gossip, Shardcast HTTP server and
client, inference engines, the worker, relay and validator processes, status and metrics.

Kept import-light: heavy modules (torch, libp2p, aiohttp) are imported by the commands that use them.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
