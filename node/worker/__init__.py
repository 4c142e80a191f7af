"""The worker (contributor) role's parts.

* ``rollouts.py`` — :func:`build_submission`: plan → generate → prove → score → sign.
* ``spool.py`` — :class:`Spool`: submissions on disk until the ingest acknowledges them.
* ``submitter.py`` — :class:`Submitter`: posts the spool with retry and backoff.
* ``adversary.py`` / ``steering.py`` — the dishonest variants of chaos mode (:data:`ADVERSARIES`).
* ``node/worker/role.py`` — :class:`Worker`: follows the policy and loops over submissions.
"""

ADVERSARIES = ("other-model", "tampered-token", "inflated-reward", "cherry-pick", "replay", "fake-eos", "steer")
"""The cheats of :mod:`node.worker.adversary` (devnet chaos mode, validator tests)."""
