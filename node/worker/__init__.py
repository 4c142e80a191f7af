"""The worker (contributor) role's parts.

* ``rollouts.py`` — :func:`build_submission`: plan → generate → prove → score → sign.
* ``spool.py`` — :class:`Spool`: submissions on disk until the ingest acknowledges them.
* ``submitter.py`` — :class:`Submitter`: posts the spool with retry and backoff.
* ``role.py`` — :class:`Worker`: follows the policy and loops over submissions.
"""

ADVERSARIES = ("other-model", "tampered-token", "inflated-reward", "cherry-pick", "replay", "fake-eos")
"""The cheats of :mod:`node.worker.adversary` (devnet chaos mode, validator tests)."""
