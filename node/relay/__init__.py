"""The relay role (its mechanism, following upstreams and serving pieces, is :mod:`node.shardcast.relay`).

* ``role.py`` — :func:`run_relay`: a Shardcast relay (or the origin when it has no upstream), on gossip.
"""
