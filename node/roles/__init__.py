"""Node roles: each wires components (Shardcast, gossip, inference…) into one process.

* :mod:`.relay` — :func:`run_relay`, a Shardcast relay (or the origin when it has no upstream).
"""
