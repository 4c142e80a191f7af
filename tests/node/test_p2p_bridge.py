"""The asyncio↔trio bridge: results, errors, timeouts that cancel the trio side, clean stop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from node.errors import BridgeError
from node.p2p.bridge import make_bridge

KINDS = ["thread", "guest"]


@pytest.mark.parametrize("kind", KINDS)
async def test_run_returns_results_and_errors(kind: str) -> None:
    bridge = make_bridge(kind)  # type: ignore[arg-type]
    await bridge.start()
    try:
        async def add(a: int, b: int) -> int:
            await trio.lowlevel.checkpoint()
            return a + b

        async def boom() -> None:
            raise ValueError("from trio")

        assert await bridge.run(add, 2, 3, timeout_s=5) == 5
        assert await bridge.run_sync(lambda: trio.lowlevel.current_trio_token() is not None, timeout_s=5)
        with pytest.raises(ValueError, match="from trio"):
            await bridge.run(boom, timeout_s=5)
    finally:
        await bridge.stop()
    assert not bridge.running


@pytest.mark.parametrize("kind", KINDS)
async def test_timeout_cancels_the_trio_call(kind: str) -> None:
    bridge = make_bridge(kind)  # type: ignore[arg-type]
    await bridge.start()
    cancelled = threading.Event()
    try:
        async def slow() -> None:
            try:
                await trio.sleep(30)
            except trio.Cancelled:
                cancelled.set()
                raise

        with pytest.raises(TimeoutError):
            await bridge.run(slow, timeout_s=0.2)
        # the event: trio delivered the cancellation (bounded generously: a loaded machine is slow, not wrong)
        assert await asyncio.to_thread(cancelled.wait, 10.0), "the trio call was not cancelled"
    finally:
        await bridge.stop()


@pytest.mark.parametrize("kind", KINDS)
async def test_start_task_and_trio_to_asyncio(kind: str) -> None:
    bridge = make_bridge(kind)  # type: ignore[arg-type]
    await bridge.start()
    got: list[int] = []
    try:
        async def ticker(*, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started("ready")
            for i in range(1000):
                bridge.to_asyncio(got.append, i)
                await trio.sleep(0.01)

        handle = await bridge.start_task(ticker, timeout_s=5)
        assert handle.value == "ready"
        end = asyncio.get_running_loop().time() + 10.0
        while len(got) < 5:
            assert asyncio.get_running_loop().time() < end, f"only {len(got)} ticks reached asyncio"
            await asyncio.sleep(0.01)
        await handle.cancel(timeout_s=3)
        assert handle.done.done()
        assert got[:5] == [0, 1, 2, 3, 4]
    finally:
        await bridge.stop()


async def test_thread_bridge_leaves_no_thread_and_refuses_calls_after_stop() -> None:
    before = {t.ident for t in threading.enumerate()}
    bridge = make_bridge("thread")
    await bridge.start()
    assert len({t.ident for t in threading.enumerate()} - before) == 1
    await bridge.stop()
    await bridge.stop()  # idempotent
    assert {t.ident for t in threading.enumerate() if t.is_alive()} - before == set()

    async def noop() -> None:
        return None

    with pytest.raises(BridgeError):
        await bridge.run(noop, timeout_s=1)
    with pytest.raises(BridgeError):
        await bridge.start()
