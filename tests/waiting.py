"""Waiting for an event in a test, bounded in time: the one helper, in an async and a blocking form.

Tests wait for what they expect to happen (a step held, a peer seen, a process's answer), never
for a fixed time; each wait fails after ``timeout_s`` with a message naming what did not happen.
Importable from every test directory (pytest puts ``tests/``, the directory of the root
``conftest.py``, on ``sys.path``).
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
"""How long a wait lasts unless the test says, seconds (generous: the machine may be loaded)."""


async def wait_until(cond: Callable[[], T | Awaitable[T]], timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "condition", *,
                     interval_s: float = 0.05) -> T:
    """Call ``cond`` every ``interval_s`` seconds (yielding to the event loop) until it returns
    something true, and return that. ``cond`` may be a coroutine function (a status read, a call
    into the trio bridge): its result is awaited.

    Raises:
        AssertionError: ``timeout_s`` seconds passed; the message names ``what``.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got  # type: ignore[return-value]
        if loop.time() > end:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


def wait_for(cond: Callable[[], T], timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "condition",
             proc: subprocess.Popen[Any] | None = None, *, interval_s: float = 0.05) -> T:
    """The blocking form of :func:`wait_until` (tests without an event loop, child processes).

    Args:
        cond: called until it returns something true.
        timeout_s: how long to wait, seconds.
        what: what is waited for (named in the failure).
        proc: the process the test waits on: fail at once when it exits first.
        interval_s: pause between calls, seconds.

    Raises:
        AssertionError: ``proc`` exited first, or ``timeout_s`` seconds passed.
    """
    end = time.monotonic() + timeout_s
    while not (got := cond()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
    return got
