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
* **stalled writes** — a client that asks for a response and then stops reading it (its receive
  window stays shut) would hold a connection and a handler forever; once the bytes waiting to go
  to it (the transport's buffer plus the socket's unsent queue, ``TIOCOUTQ``, which also covers
  ``sendfile``) stay non-zero and unchanged for ``write_stall_s``, the connection is shut down
  and reset (a pending ``sendfile`` fails with it, so its handler ends). A
  slow reader moves them and keeps its connection;
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
        write_stall_s: a connection whose unsent response bytes stay non-zero and unchanged this
            long is aborted, seconds (checked every quarter of it).
    """

    header_timeout_s: float = 10.0
    max_connections_per_ip: int = 64
    max_connections: int = 1024
    max_line_size: int = 8190
    max_headers: int = 64
    write_stall_s: float = 60.0


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


class StallWatch:
    """Aborts connections whose unsent bytes stay non-zero and unchanged for ``stall_s``.

    Attributes:
        aborted: connections aborted for a stalled write so far.
    """

    def __init__(self, counted: dict[Any, tuple[str, asyncio.Transport]], stall_s: float) -> None:
        self.counted = counted
        self.stall_s = stall_s
        self.aborted = 0
        self._seen: dict[Any, tuple[int, float]] = {}  # handler → (unsent bytes, since when unchanged)
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
        seen: dict[Any, tuple[int, float]] = {}
        cut, self._cut = self._cut, set()
        for handler, (ip, transport) in list(self.counted.items()):
            if transport.is_closing():
                continue
            if handler in cut:  # its handler did not close it after the shutdown: close it here
                transport.abort()
                continue
            unsent = _unsent_bytes(transport)
            if unsent == 0:
                continue
            before, since = self._seen.get(handler, (-1, now))
            if unsent != before:
                since = now
            elif now - since >= self.stall_s:
                logger.debug("aborting a connection from %s: %d response bytes unread for %.0f s", ip, unsent, now - since)
                self.aborted += 1
                reset(transport)
                self._cut.add(handler)
                continue
            seen[handler] = (unsent, since)
        self._seen = seen

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.stall_s / 4)
            self.check(time.monotonic())


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
    """A started server: its runner (``await cleanup()`` to stop), bound port and stalled-write watch."""

    runner: web.AppRunner
    port: int
    stalls: StallWatch

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_site(app: web.Application, host: str, port: int = 0, *, limits: ServerLimits | None = None,
                     reuse_address: bool = True, shutdown_timeout_s: float = 1.0) -> RunningServer:
    """Start ``app`` on ``host:port`` with the protections of this module.

    Args:
        app: the application (not yet frozen); :data:`identity_only` is added first.
        host: interface; port: TCP port (0: any free one).
        limits: :class:`ServerLimits` (defaults suit every role).
        reuse_address: set ``SO_REUSEADDR`` (bind again right after a restart, as asyncio's
            ``create_server`` does by default on POSIX).
        shutdown_timeout_s: grace period for open requests on stop, seconds.

    Returns:
        The running server and its bound port.

    Raises:
        OSError: the address cannot be bound.
    """
    lim = limits or ServerLimits()
    app.middlewares.insert(0, identity_only)
    stalls = StallWatch({}, lim.write_stall_s)
    app.on_cleanup.append(stalls.stop)  # runner.cleanup() stops the watch with the server
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
    await web.SockSite(runner, sock, backlog=512).start()
    stalls.start()
    return RunningServer(runner, bound, stalls)
