"""The life every role process shares: :func:`run_until_stopped` (start → run → stop, a signal
stops it), :func:`sleep_unless`, and the start-up steps of the scoring roles
(:func:`require_sandbox_for`, :func:`start_status_server`).

Every role has one layout: a package ``node/<role>/`` whose ``role.py`` wires its parts, which sit
beside it — ``node/coordinator/`` (``intellect-train``), ``node/worker/``, ``node/validator/``,
``node/relay/`` (``docs/architecture.md`` "Processes and their insides").
"""

import asyncio
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from node.status_http import StatusServer


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


async def require_sandbox_for(tasks: Sequence[Any]) -> None:
    """Refuse to start a role that will score code tasks (``prime_rl_code``) without a real sandbox.

    Args:
        tasks: the run's training tasks (:class:`protocol.tasks.Task`).

    Raises:
        protocol.rewards.base.RewardError: naming what to install (``protocol.rewards.sandbox.require_sandbox``).
    """
    if any(t.task_type == "prime_rl_code" for t in tasks):
        from protocol.rewards.sandbox import require_sandbox

        await asyncio.to_thread(require_sandbox)


async def start_status_server(status: Callable[[], dict[str, Any]], registry: "CollectorRegistry", port: int | None) -> "StatusServer | None":
    """Start a role's ``/status`` + ``/metrics`` server on 127.0.0.1:``port`` (0: any); ``None`` when ``port`` is ``None``.

    Returns:
        The started :class:`node.status_http.StatusServer`, or ``None``.

    Raises:
        OSError: the port cannot be bound.
    """
    if port is None:
        return None
    from node.status_http import StatusServer

    server = StatusServer(status, registry, port=port)
    await server.start()
    return server
