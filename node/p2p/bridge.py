"""The one crossing point between the node's asyncio loop and py-libp2p's trio loop.

py-libp2p runs only on trio; the node (aiohttp, roles) runs on asyncio. A :class:`TrioBridge`
owns a trio run next to the calling asyncio loop and offers three crossings:

* asyncio → trio, await a result: :meth:`TrioBridge.run` (an ``async`` trio function, with a
  timeout in seconds that cancels the trio side too) and :meth:`TrioBridge.run_sync`.
* asyncio → trio, long-lived task: :meth:`TrioBridge.start_task` (``nursery.start`` semantics:
  returns what the task passes to ``task_status.started`` and a handle to stop it).
* trio → asyncio, fire and forget: :meth:`TrioBridge.to_asyncio` (``loop.call_soon_threadsafe``).

Two implementations share this interface (``docs/gossip.md`` has the measurements):

* :class:`ThreadBridge` (default): ``trio.run`` in a dedicated daemon thread. libp2p keeps
  serving (heartbeats, forwarding, validation) while the asyncio thread is busy or blocked.
* :class:`GuestBridge`: trio in *guest mode* on the asyncio loop's own thread
  (``trio.lowlevel.start_guest_run``); no second thread, but anything that blocks the asyncio
  thread stalls libp2p too.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import trio

from node.errors import BridgeError

logger = logging.getLogger(__name__)

T = TypeVar("T")
BridgeKind = Literal["thread", "guest"]

START_TIMEOUT_S = 10.0
"""How long :meth:`TrioBridge.start` waits for the trio loop to come up, in seconds."""
STOP_TIMEOUT_S = 3.0
"""How long :meth:`TrioBridge.stop` waits for trio tasks to finish after cancelling them, in seconds."""


@dataclass
class TrioTaskHandle:
    """A long-lived trio task started through :meth:`TrioBridge.start_task`.

    Attributes:
        value: what the task passed to ``task_status.started(...)``.
        done: resolves (on the asyncio loop) when the trio task has returned or was cancelled.
    """

    value: Any
    done: asyncio.Future[None]
    _bridge: TrioBridge = field(repr=False)
    _scope: trio.CancelScope = field(repr=False)

    async def cancel(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Cancel the trio task and wait up to ``timeout_s`` seconds for it to finish.

        Raises:
            BridgeError: the task did not finish in time.
        """
        if not self.done.done():
            self._bridge._call_trio_soon(self._scope.cancel)
        try:
            await asyncio.wait_for(asyncio.shield(self.done), timeout_s)
        except TimeoutError:
            raise BridgeError(f"trio task did not stop within {timeout_s} s") from None
        except asyncio.CancelledError:
            if not self.done.done():
                raise
        except Exception as e:  # noqa: BLE001 - the task's own failure was logged where it happened
            logger.debug("trio task ended with %r", e)


class TrioBridge(abc.ABC):
    """Runs a trio loop alongside the current asyncio loop (see the module docstring).

    Lifecycle: ``await start()`` → any number of crossings → ``await stop()``. Not reusable.
    """

    kind: BridgeKind

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop_event: trio.Event | None = None
        self._started: asyncio.Future[None] | None = None
        self._finished: asyncio.Future[None] | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        """Whether the trio loop is up and accepts calls."""
        return self._token is not None and not self._stopping and self._finished is not None and not self._finished.done()

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the trio loop and wait until it accepts calls.

        Raises:
            BridgeError: already started, or trio did not come up within ``timeout_s`` seconds.
        """
        if self._loop is not None:
            raise BridgeError("a bridge can be started only once")
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._finished = self._loop.create_future()
        self._launch()
        try:
            await asyncio.wait_for(asyncio.shield(self._started), timeout_s)
        except TimeoutError:
            raise BridgeError(f"trio loop did not start within {timeout_s} s") from None
        logger.debug("trio bridge (%s) started", self.kind)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Cancel every trio task, wait for the trio loop to end and release its thread.

        Idempotent. Never raises on a slow stop: a trio loop still running after ``timeout_s``
        seconds is logged and abandoned (the thread is a daemon, so it cannot block exit).
        """
        if self._finished is None or self._stopping:
            if self._finished is not None:
                await asyncio.wait([self._finished], timeout=timeout_s)
            return
        self._stopping = True
        if self._stop_event is not None and not self._finished.done():
            self._call_trio_soon(self._stop_event.set)
        done, _ = await asyncio.wait([self._finished], timeout=timeout_s)
        if not done:
            logger.warning("trio loop did not stop within %.1f s; abandoning it", timeout_s)
            return
        if not self._finished.cancelled() and self._finished.exception() is not None:
            logger.warning("trio loop ended with an error: %r", self._finished.exception())
        await self._joined(timeout_s)
        logger.debug("trio bridge (%s) stopped", self.kind)

    # --- crossings ---------------------------------------------------------------------------

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout_s: float) -> T:
        """Run ``await fn(*args)`` on the trio loop and return its result on asyncio.

        Args:
            fn: an ``async`` function written for trio.
            *args: its positional arguments.
            timeout_s: seconds to wait; on timeout (or if the awaiting asyncio task is
                cancelled) the trio call is cancelled too.

        Raises:
            TimeoutError: ``fn`` did not finish within ``timeout_s`` seconds.
            BridgeError: the bridge is not running.
            Exception: whatever ``fn`` raised.
        """
        loop, nursery = self._require()
        fut: asyncio.Future[T] = loop.create_future()
        scope = trio.CancelScope()

        async def runner() -> None:
            posted = False
            try:
                with scope:
                    try:
                        result = await fn(*args)
                    except Exception as e:  # noqa: BLE001 - carried over to the asyncio caller
                        self.to_asyncio(_settle, fut, None, e)
                    else:
                        self.to_asyncio(_settle, fut, result, None)
                    posted = True
            finally:
                if not posted:
                    self.to_asyncio(_settle, fut, None, asyncio.CancelledError())

        self._call_trio_soon(nursery.start_soon, runner)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            fut.cancel()  # the late trio result is dropped, not left unretrieved
            self._call_trio_soon(scope.cancel)
            raise

    async def run_sync(self, fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
        """Run the plain function ``fn(*args)`` on the trio thread (to touch trio-owned state).

        Raises:
            TimeoutError: not run within ``timeout_s`` seconds.
            BridgeError: the bridge is not running.
            Exception: whatever ``fn`` raised.
        """

        async def wrapper() -> T:
            return fn(*args)

        return await self.run(wrapper, timeout_s=timeout_s)

    async def start_task(self, fn: Callable[..., Awaitable[Any]], *args: Any, timeout_s: float) -> TrioTaskHandle:
        """Start a long-lived trio task with ``nursery.start`` semantics.

        ``fn`` must accept a ``task_status`` keyword and call ``task_status.started(value)``
        once it is ready; this returns as soon as it does. The task then runs until it returns,
        until :meth:`TrioTaskHandle.cancel`, or until the bridge stops.

        Raises:
            TimeoutError: ``fn`` did not report ready within ``timeout_s`` seconds.
            BridgeError: the bridge is not running.
            Exception: whatever ``fn`` raised before it reported ready.
        """
        loop, nursery = self._require()
        done: asyncio.Future[None] = loop.create_future()
        scope = trio.CancelScope()

        done.add_done_callback(_consume)

        async def task(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
            status = _ReadyStatus(task_status)
            error: BaseException | None = None
            try:
                with scope:
                    await fn(*args, task_status=status)
            except Exception as e:
                if not status.ready:
                    raise  # nursery.start re-raises it to the caller of start_task
                error = e  # a failure after start must not take the whole trio loop down
                logger.warning("trio task %s failed: %r", getattr(fn, "__qualname__", fn), e)
            finally:
                self.to_asyncio(_settle, done, None, error)

        async def starter() -> Any:
            return await nursery.start(task)

        try:
            value = await self.run(starter, timeout_s=timeout_s)
        except BaseException:
            self._call_trio_soon(scope.cancel)
            raise
        return TrioTaskHandle(value=value, done=done, _bridge=self, _scope=scope)

    def to_asyncio(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the asyncio loop (callable from the trio side; never blocks).

        Dropped silently once the asyncio loop is closed (shutdown).
        """
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    # --- internals ---------------------------------------------------------------------------

    def _require(self) -> tuple[asyncio.AbstractEventLoop, trio.Nursery]:
        if not self.running or self._loop is None or self._nursery is None:
            raise BridgeError("the trio bridge is not running")
        return self._loop, self._nursery

    def _call_trio_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    async def _trio_main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop_event = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            assert self._started is not None
            self.to_asyncio(_settle, self._started, None, None)
            await self._stop_event.wait()
            nursery.cancel_scope.cancel()
        self._nursery = None

    def _on_trio_done(self, error: BaseException | None) -> None:
        """Called on the asyncio loop when the trio run has ended."""
        assert self._finished is not None and self._started is not None
        if error is not None and self._stopping is False:
            logger.error("trio loop ended unexpectedly: %r", error)
        if not self._started.done():
            self._started.set_exception(BridgeError(f"trio loop failed to start: {error!r}"))
        _settle(self._finished, None, error)

    @abc.abstractmethod
    def _launch(self) -> None:
        """Begin the trio run (on a thread or as a guest); must end with :meth:`_on_trio_done`."""

    async def _joined(self, timeout_s: float) -> None:
        """Release whatever :meth:`_launch` acquired after the trio run ended."""


class ThreadBridge(TrioBridge):
    """Trio in a dedicated daemon thread (``trio.run``); the default. See the module docstring."""

    kind: BridgeKind = "thread"

    def __init__(self, name: str = "trio-libp2p") -> None:
        super().__init__()
        self._name = name
        self._thread: threading.Thread | None = None

    def _launch(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name=self._name, daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        error: BaseException | None = None
        try:
            trio.run(self._trio_main)
        except BaseException as e:  # noqa: BLE001 - reported to the asyncio side
            error = e
        self.to_asyncio(self._on_trio_done, error)

    async def _joined(self, timeout_s: float) -> None:
        if self._thread is not None:
            # the trio run is over, so the thread is on its way out: poll rather than park an
            # executor thread in join()
            deadline = asyncio.get_running_loop().time() + timeout_s
            while self._thread.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.005)
            if self._thread.is_alive():
                logger.warning("trio thread %s still alive after %.1f s", self._name, timeout_s)


class GuestBridge(TrioBridge):
    """Trio in guest mode on the asyncio loop's thread. See the module docstring."""

    kind: BridgeKind = "guest"

    def _launch(self) -> None:
        assert self._loop is not None
        trio.lowlevel.start_guest_run(
            self._trio_main,
            run_sync_soon_threadsafe=self._loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=self._loop.call_soon,
            done_callback=self._guest_done,
            host_uses_signal_set_wakeup_fd=True,
        )

    def _guest_done(self, outcome: Any) -> None:
        error = getattr(outcome, "error", None)
        self._on_trio_done(error)


def make_bridge(kind: BridgeKind = "thread") -> TrioBridge:
    """A new, unstarted bridge of the given kind (``"thread"`` or ``"guest"``)."""
    if kind == "thread":
        return ThreadBridge()
    if kind == "guest":
        return GuestBridge()
    raise ValueError(f"unknown bridge kind {kind!r}; use 'thread' or 'guest'")


class _ReadyStatus:
    """Wraps a trio ``task_status`` to remember whether the task reported ready."""

    def __init__(self, inner: trio.TaskStatus[Any]) -> None:
        self._inner = inner
        self.ready = False

    def started(self, value: Any = None) -> None:
        self.ready = True
        self._inner.started(value)


def _consume(fut: asyncio.Future[Any]) -> None:
    """Mark a background future's exception as retrieved (it was logged where it happened)."""
    if not fut.cancelled():
        fut.exception()


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Resolve ``fut`` on its loop unless its awaiter already gave up on it."""
    if fut.done():
        return
    if isinstance(error, asyncio.CancelledError):
        fut.cancel()
    elif error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
