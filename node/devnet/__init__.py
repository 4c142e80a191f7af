"""``intellect-node devnet``: a whole decentralized run on one machine (``docs/devnet.md``).

* ``config.py`` — :func:`devnet_spec`: the run spec of a devnet (embedded or real tasks).
* ``procs.py`` — :class:`ProcessGroup`: child processes with logs, clean stop, no leftovers.
* ``orchestrator.py`` — :class:`Devnet`: keys, spec, processes, chaos, the run itself.
* ``dashboard.py`` — the live terminal view (rich).
* ``report.py`` — ``report.md`` and ``report.png`` from the coordinator's metrics.
"""
