"""The validator role's parts (the checks themselves are :mod:`validator`, shared with the coordinator's re-check).

* ``role.py`` — :class:`ValidatorNode`: lease → check → sign → post and gossip verdicts.
* ``resources.py`` — :class:`ResourceFailures`: a check that ran this node out of memory, disk or
  descriptors is left to a later lease once, then judged ``resources``.

Held checkpoints and loaded models are :mod:`node.policy`'s (as a worker's); retries are paced by
:mod:`node.retry` (as every node's).
"""
