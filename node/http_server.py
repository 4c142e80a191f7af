"""One way to start every aiohttp server of a node, hardened against slow and greedy clients.

The ingest (``trainer/ingest``), the Shardcast server (origin and relays) and the status servers
all listen through :func:`start_site`. It lives in ``node/`` because ``node/`` is what opens
sockets (``DESIGN.md`` §4): the trainer-side ingest only adds routes to an application (and reads
its bodies whole, under a timeout, with ``trainer.ingest.service.read_body``), so the layering
stays one-way.

What a server started here gets (``docs/operators.md`` "HTTP limits"):

* **header timeout** — aiohttp arms its keep-alive timer when a connection opens and again after
  each response, and closes the connection if no *complete* request head arrived by then; so
  ``header_timeout_s`` is its ``keepalive_timeout`` (a slowloris connection that dribbles
  header bytes is closed after it, as is an idle keep-alive connection);
* **body timeout** — the only routes with bodies (the ingest's) read them under
  ``IngestLimits.decode_timeout_s``; bodies nobody reads are drained by aiohttp for at most its
  ``lingering_time`` (10 s);
* **per-IP and total connection caps** — connections over the cap are aborted as soon as they
  are accepted, so 300 half-open connections from one address hold at most
  ``max_connections_per_ip`` descriptors and never starve ``/status`` or other clients (64: a
  Shardcast client holds ≤ 6 connections to one server, so a devnet's ~8 nodes on 127.0.0.1 fit).
  When the total cap is full (many addresses, each under its own cap), a newcomer from an
  address holding fewer connections than the heaviest address takes the place of that
  address's oldest connection (reset, :func:`reset`), so addresses cannot together lock others out;
* **no compressed bodies** — ``auto_decompress`` is off and :data:`identity_only` answers 415 to
  any request body with a ``Content-Encoding`` other than ``identity``: nothing inflates;
* **stalled writes, judged in bytes/s** — a client that asks for a response and then stops
  reading it (its receive window stays shut) would hold a connection and a handler forever; and
  one that opens its window once a minute kept an "unchanged for 60 s" watch quiet forever
  (issue #23). Now, while bytes wait to go to a client (the transport's buffer plus the socket's
  unsent queue, ``TIOCOUTQ``, which also covers ``sendfile``), the bytes it acknowledges
  (``TCP_INFO`` ``tcpi_bytes_acked``) are counted over windows of ``write_stall_s``; a window
  in which it took less than ``write_min_bps`` on average ends the connection: shut down and
  reset (a pending ``sendfile`` fails with it, so its handler ends). A window starts again
  whenever nothing waits. Where ``TCP_INFO`` cannot be read, unsent bytes unchanged for the
  window count as a stall;
* **accept failures logged once per interval** — when descriptors run out, asyncio logs an
  ERROR per failed ``accept()`` (up to 512 per loop tick; 169,417 records in 45 s under
  ``ulimit -n 1024``); :class:`AcceptErrorLog` turns them into one WARNING per
  :data:`ACCEPT_ERROR_LOG_INTERVAL_S` with a count. The connection cap itself comes from the
  process's descriptor budget (:mod:`node.fds`), so the servers' own connections leave room for
  the node's files;
* small header limits (line and field 8 KiB, 64 headers);
* **peer noise stays out of the error log** — aiohttp logs every request it cannot parse (an
  HTTP/2 preface, a chunk size past 2^64, an over-long line) as an ERROR with a traceback, so any
  client could write ~1 KiB of log per 40-byte request and push the operator's real errors off
  the node page (:class:`PeerHttpNoiseFilter` demotes those to DEBUG; a handler's own failure
  stays an ERROR).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web, web_server
from aiohttp.http_exceptions import HttpProcessingError

from node.fds import ACCEPT_BACKLOG, CONNECTION_BUDGET
from protocol.addresses import address_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """Bounds of one HTTP server.

    Attributes:
        header_timeout_s: a connection must deliver a complete request head within this many
            seconds of opening (or of its previous response), seconds.
        max_connections_per_ip: open connections from one IPv4 address or IPv6 /64; more are aborted.
        max_connections: open connections in all; more are aborted.
        max_line_size: longest request line or header line, bytes.
        max_headers: most header fields in one request.
        write_stall_s: length of the windows over which a connection with response bytes
            waiting is judged, seconds (checked every quarter of it).
        write_min_bps: a connection that, while bytes wait for it, takes less than this many
            bytes/second over a window is aborted (bytes/s).
    """

    header_timeout_s: float = 10.0
    max_connections_per_ip: int = 64
    max_connections: int = 1024
    max_line_size: int = 8190
    max_headers: int = 64
    write_stall_s: float = 60.0
    write_min_bps: float = 4096.0


class PeerHttpNoiseFilter(logging.Filter):
    """Demotes aiohttp's records of requests it could not parse (``HttpProcessingError``: bad
    request line, header, chunk or length, line too long) to DEBUG: what a peer sends wrong is no
    error of this node, and a flood of them must not fill its log or its page's last errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.WARNING and isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger("aiohttp.server").addFilter(PeerHttpNoiseFilter())


@web.middleware
async def identity_only(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Answer 415 to a request whose body is compressed (any ``Content-Encoding`` but identity).

    With ``auto_decompress`` off the body would not be inflated anyway; refusing it says why.
    """
    enc = request.headers.get("Content-Encoding", "identity").strip().lower()
    if enc not in ("", "identity"):
        return web.json_response({"error": "unsupported_encoding", "detail": f"Content-Encoding {enc[:32]!r} refused: send identity bodies"},
                                 status=415)
    return await handler(request)


def _unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes written to ``transport`` that its peer has not taken yet: the transport's buffer plus
    the kernel's unsent send queue (``TIOCOUTQ``; where it cannot be read, the buffer alone)."""
    n = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            n += int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"), "little")
    return n


RESET_GRACE_S = 5.0
"""After :func:`reset`, a connection still open this many seconds later is aborted, seconds."""


def reset(transport: asyncio.Transport) -> None:
    """Reset the connection under ``transport`` so that whatever reads or writes it fails now.

    ``transport.abort()`` alone is not enough while ``loop.sendfile`` is copying to the socket
    (aiohttp's ``FileResponse``): asyncio leaves the sendfile waiting on the closed descriptor,
    so its handler (and the open file) would never end and the next connection given that
    descriptor number would hang. ``shutdown`` wakes a pending write or sendfile with ``EPIPE``
    and a pending read with EOF; the handler then fails and aiohttp closes the transport.
    ``SO_LINGER`` 0 makes that close a reset, so the kernel drops the unread bytes instead of
    keeping them. Callers abort what is still open later (:data:`RESET_GRACE_S`).
    """
    sock = transport.get_extra_info("socket")
    if sock is None:
        transport.abort()
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)


def _abort_if_open(transport: asyncio.Transport) -> None:
    if not transport.is_closing():
        transport.abort()


LISTEN_QUEUE = 4096
"""Length of the kernel's queue of connections waiting to be accepted (capped by ``somaxconn``)."""

_TCPI_BYTES_ACKED = 120
"""Offset of ``tcpi_bytes_acked`` (u64) in Linux's ``struct tcp_info`` (since Linux 4.1)."""


def _bytes_acked(transport: asyncio.Transport) -> int | None:
    """Bytes the peer has acknowledged on this TCP connection, or ``None`` where it cannot be read."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES_ACKED + 8)
    except (OSError, ValueError, AttributeError):
        return None
    if len(info) < _TCPI_BYTES_ACKED + 8:
        return None
    return int(struct.unpack_from("<Q", info, _TCPI_BYTES_ACKED)[0])


class StallWatch:
    """Aborts connections that, while response bytes wait for them, take less than ``min_bps``
    over a window of ``stall_s`` seconds.

    Attributes:
        aborted: connections aborted for a stalled write so far.
    """

    def __init__(self, counted: dict[Any, tuple[str, asyncio.Transport]], stall_s: float, min_bps: float = 0.0) -> None:
        self.counted = counted
        self.stall_s = stall_s
        self.min_bps = min_bps
        self.aborted = 0
        self._seen: dict[Any, tuple[float, int | None, int]] = {}  # handler → (window start, bytes acked then, unsent then)
        self._cut: set[Any] = set()  # handlers shut down at the previous pass, aborted at this one if still open
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def check(self, now: float) -> None:
        """One pass over the open connections."""
        seen: dict[Any, tuple[float, int | None, int]] = {}
        cut, self._cut = self._cut, set()
        for handler, (ip, transport) in list(self.counted.items()):
            if transport.is_closing():
                continue
            if handler in cut:  # its handler did not close it after the shutdown: close it here
                transport.abort()
                continue
            unsent = _unsent_bytes(transport)
            if unsent == 0:
                continue  # nothing waits for it: no window runs
            acked = _bytes_acked(transport)
            window = self._seen.get(handler)
            if window is None:
                seen[handler] = (now, acked, unsent)
                continue
            since, acked0, unsent0 = window
            if now - since < self.stall_s:
                seen[handler] = window
                continue
            if acked is not None and acked0 is not None:
                rate = (acked - acked0) / (now - since)
                stalled = rate < self.min_bps
            else:  # no TCP_INFO: the old rule, unsent bytes unchanged for the window
                rate, stalled = 0.0, unsent == unsent0
            if stalled:
                logger.debug("aborting a connection from %s: took %.0f bytes/s over %.0f s with %d bytes waiting", ip, rate, now - since, unsent)
                self.aborted += 1
                reset(transport)
                self._cut.add(handler)
                continue
            seen[handler] = (now, acked, unsent)  # next window
        self._seen = seen

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.stall_s / 4)
            self.check(time.monotonic())


ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
"""At most one log record about failing ``accept()`` calls per this many seconds."""

_ACCEPT_ERROR = "socket.accept() out of system resource"


def _is_accept_retry(context: dict[str, Any]) -> bool:
    """A failure of asyncio's retry of a failed ``accept()`` (it schedules one retry per failed
    try; those left when the server closes fail on its closed socket)."""
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    return getattr(callback, "__name__", "") == "_start_serving" and isinstance(context.get("exception"), (OSError, ValueError))


class AcceptErrorLog:
    """An event-loop exception handler that reports asyncio's ``accept()`` failures (EMFILE,
    ENFILE, ENOBUFS, ENOMEM) as one WARNING per ``interval_s`` with their count, and passes every
    other context to the handler it replaced (or the loop's default).

    Attributes:
        failures: accept failures seen so far.
        logged: WARNING records written about them.
    """

    def __init__(self, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None,
                 interval_s: float = ACCEPT_ERROR_LOG_INTERVAL_S) -> None:
        self.previous = previous
        self.interval_s = interval_s
        self.failures = 0
        self.logged = 0
        self._unlogged = 0
        self._last_log = -float("inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_ERROR and not _is_accept_retry(context):
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.failures += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            exc = context.get("exception")
            logger.warning("accept() failed %d times since the last report (%s): connections are refused until descriptors free up; "
                           "raise the open files limit (ulimit -n) or lower the connection cap", self._unlogged, exc)
            self.logged += 1
            self._unlogged = 0
            self._last_log = now

    @classmethod
    def install(cls, loop: asyncio.AbstractEventLoop) -> AcceptErrorLog:
        """Install on ``loop`` once (a second call returns the installed one)."""
        current = loop.get_exception_handler()
        if isinstance(current, cls):
            return current
        handler = cls(current)
        loop.set_exception_handler(handler)
        return handler


def _cap_connections(server: web_server.Server, limits: ServerLimits) -> dict[Any, tuple[str, asyncio.Transport]]:
    """Abort connections over the per-IP or total cap right after they are accepted.

    aiohttp has no connection cap of its own; its ``Server`` is told of every connection (made
    and lost) by the protocol, which is where the count is kept.
    """
    made, lost = server.connection_made, server.connection_lost
    per_ip: dict[str, int] = {}
    counted: dict[Any, tuple[str, asyncio.Transport]] = {}  # oldest first

    def refuse(transport: asyncio.Transport) -> None:
        # after the handler's start task has begun (aborting now would run connection_lost first)
        asyncio.get_running_loop().call_soon(transport.abort)

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        made(handler, transport)
        peer = transport.get_extra_info("peername")
        ip = address_key(str(peer[0])) if peer else "?"
        if per_ip.get(ip, 0) >= limits.max_connections_per_ip:
            logger.debug("refusing a connection from %s: over the per-address connection cap", ip)
            refuse(transport)
            return
        if len(counted) >= limits.max_connections:
            # Full: many addresses (a loopback range, a botnet) each under their own cap. Make
            # room by dropping the oldest connection of the address holding the most, if that is
            # more than this address holds; otherwise refuse the newcomer.
            heaviest = max(per_ip, key=per_ip.__getitem__)
            if per_ip[heaviest] <= per_ip.get(ip, 0):
                logger.debug("refusing a connection from %s: over the connection cap", ip)
                refuse(transport)
                return
            victim = next(h for h, (vip, _) in counted.items() if vip == heaviest)
            logger.debug("dropping a connection from %s to make room for %s: over the connection cap", heaviest, ip)
            victim_transport = counted[victim][1]
            reset(victim_transport)  # it may be mid-response (sendfile): see reset()
            asyncio.get_running_loop().call_later(RESET_GRACE_S, _abort_if_open, victim_transport)
            forget(victim)
        per_ip[ip] = per_ip.get(ip, 0) + 1
        counted[handler] = (ip, transport)

    def forget(handler: Any) -> None:
        entry = counted.pop(handler, None)
        if entry is not None:
            ip = entry[0]
            per_ip[ip] -= 1
            if not per_ip[ip]:
                del per_ip[ip]

    def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
        forget(handler)
        lost(handler, exc)

    server.connection_made = connection_made  # type: ignore[method-assign]
    server.connection_lost = connection_lost  # type: ignore[method-assign]
    return counted


def http_url(host: str, port: int) -> str:
    """``http://host:port``, with an IPv6 literal in brackets (``http://[::1]:8700``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class RunningServer:
    """A started server: its runner (``await cleanup()`` to stop), bound port, stalled-write
    watch, the connection cap it got from the process's descriptor budget, and its loop's
    accept-failure log."""

    runner: web.AppRunner
    port: int
    stalls: StallWatch
    max_connections: int = 0
    accept_errors: AcceptErrorLog | None = None

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_site(app: web.Application, host: str, port: int = 0, *, limits: ServerLimits | None = None,
                     reuse_address: bool = True, shutdown_timeout_s: float = 1.0) -> RunningServer:
    """Start ``app`` on ``host:port`` with the protections of this module.

    Args:
        app: the application (not yet frozen); :data:`identity_only` is added first.
        host: interface; port: TCP port (0: any free one).
        limits: :class:`ServerLimits` (defaults suit every role); ``max_connections`` is
            lowered to what the process's descriptor budget allows (:mod:`node.fds`).
        reuse_address: set ``SO_REUSEADDR`` (bind again right after a restart, as asyncio's
            ``create_server`` does by default on POSIX).
        shutdown_timeout_s: grace period for open requests on stop, seconds.

    Returns:
        The running server and its bound port.

    Raises:
        OSError: the address cannot be bound.
    """
    lim = limits or ServerLimits()
    cap = CONNECTION_BUDGET.grant(lim.max_connections)  # room left for the node's own files (node/fds.py)
    lim = dataclasses.replace(lim, max_connections=cap, max_connections_per_ip=min(lim.max_connections_per_ip, cap))
    accept_errors = AcceptErrorLog.install(asyncio.get_running_loop())
    app.middlewares.insert(0, identity_only)
    stalls = StallWatch({}, lim.write_stall_s, lim.write_min_bps)

    async def give_back(_app: web.Application) -> None:
        CONNECTION_BUDGET.release(cap)

    app.on_cleanup.append(stalls.stop)  # runner.cleanup() stops the watch with the server
    app.on_cleanup.append(give_back)
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout_s,
        keepalive_timeout=lim.header_timeout_s, auto_decompress=False,
        max_line_size=lim.max_line_size, max_field_size=lim.max_line_size, max_headers=lim.max_headers,
    )
    await runner.setup()
    assert runner.server is not None
    stalls.counted = _cap_connections(runner.server, lim)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        await runner.cleanup()
        raise
    bound = int(sock.getsockname()[1])
    await web.SockSite(runner, sock, backlog=ACCEPT_BACKLOG).start()
    # asyncio accepts at most ACCEPT_BACKLOG connections per loop pass (the descriptor budget
    # counts on it); the kernel's queue may be longer, so a flood of connects does not drop an
    # honest client's SYN (a 1 s retransmit) while the loop works through the queue
    sock.listen(LISTEN_QUEUE)
    stalls.start()
    return RunningServer(runner, bound, stalls, cap, accept_errors)
