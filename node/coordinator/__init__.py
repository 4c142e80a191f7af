"""The coordinator process (``intellect-train``): wires ``trainer/`` to Shardcast, gossip and HTTP.

* ``base.py`` — the run's base model (embedded + warm start, cached; or a local directory).
* ``evaluate.py`` — held-out pass rate with the run's sampling rule.
* ``role.py`` — :class:`Coordinator`: ingest + origin server, the training loop, publishing, resume.
"""
