"""Node roles: each wires components (Shardcast, gossip, inference…) into one process.

* :mod:`.relay` — :func:`run_relay`, a Shardcast relay (or the origin when it has no upstream).
* :mod:`.worker` — :class:`Worker`; :mod:`.validator` — :class:`ValidatorNode`.
* :func:`run_until_stopped` — the common start/run/stop life of a role process.
"""

import asyncio
import signal
from typing import Any, Protocol


class RoleProcess(Protocol):
    """What :func:`run_until_stopped` drives: ``start`` → ``run`` → ``stop``, ``request_stop`` on a signal."""

    status_server: Any

    async def start(self) -> None: ...
    async def run(self) -> None: ...
    async def stop(self) -> None: ...
    def request_stop(self) -> None: ...


async def run_until_stopped(node: RoleProcess, label: str) -> None:
    """Start ``node``, print where its status is served, run it until done or SIGINT/SIGTERM, always stop it."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.request_stop)
    try:
        await node.start()
        where = node.status_server.url if node.status_server else "no status server"
        print(f"{label} started; status {where}", flush=True)
        await node.run()
    finally:
        await node.stop()


async def sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds`` or until ``stop`` is set, whichever comes first."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
