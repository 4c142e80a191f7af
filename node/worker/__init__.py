"""The worker (contributor) role's parts.

* ``rollouts.py`` — :func:`build_submission`: plan → generate → prove → score → sign.
* ``spool.py`` — :class:`Spool`: submissions on disk until the ingest acknowledges them.
* ``submitter.py`` — :class:`Submitter`: posts the spool with retry and backoff.
* ``role.py`` — :class:`Worker`: follows the policy and loops over submissions.
"""
