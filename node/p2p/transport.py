"""What a libp2p connection of a node may speak: noise only, and a yamux that enforces its windows.

py-libp2p 0.8's ``new_host`` offers four security protocols by default: noise, TLS, secio and
``/plaintext/2.0.0``. Plaintext proves nothing: a peer sends any public key it likes and is
taken to *be* that peer ID (measured: a relay accepted a plaintext connection claiming an honest
worker's ID next to the worker's own noise connection). Whatever the node then does to that ID
(penalties, bans, "is the coordinator connected") it does to the impersonated peer. A node
offers noise alone (:func:`secure_transports`), which proves possession of the ed25519 key
(libp2p noise spec, "Handshake payload"), and only the muxer it is configured for
(:func:`muxer_options`; py-libp2p offered mplex as a fallback to yamux).

py-libp2p's yamux does not enforce its receive window: DATA past a stream's window is logged and
buffered anyway. A stream nobody reads (the gossipsub stream a node opens to a peer is only ever
written) then grows without bound: 64 MiB sent in 0.7 s sat in a relay's memory. go-yamux closes
the session on that (``ErrRecvWindowExceeded``); :class:`BoundedYamux` does the same. See
``docs/gossip.md``, "Transport rules". py-libp2p builds every yamux connection as
``muxer_multistream.Yamux(...)`` whatever class the muxer options name, and looks up a few other
names of its yamux module at each use: ``node/p2p/libp2p_patches.py`` points them at what is here
(once per process, for the pinned py-libp2p only) and lists every such override with its reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Iterable
from typing import Any, cast

import trio
from libp2p.abc import INetwork
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TMuxerOptions, TProtocol, TSecurityOptions
from libp2p.network.swarm import Swarm
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.mplex.mplex import MPLEX_PROTOCOL_ID, Mplex
from libp2p.stream_muxer.yamux import yamux as py_yamux
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, HEADER_SIZE, Yamux, YamuxStream
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID

from node.p2p.libp2p_patches import adopt
from protocol.addresses import address_key

logger = logging.getLogger(__name__)

__all__ = ["MAX_INBOUND_STREAMS", "BoundedYamux", "InboundSwarm", "PerAddressCap", "muxer_options", "secure_transports"]

MAX_INBOUND_STREAMS = 64
"""Streams a peer may hold open on one connection (a node's peers need about four: gossipsub,
identify, ping); the rest are reset."""

MAX_FRAMES_PER_S = 1_000
FRAME_BURST = 20_000
"""Yamux frames one connection may send us: :data:`MAX_FRAMES_PER_S` on average, bursts of
:data:`FRAME_BURST` (a token bucket); past it the connection is closed. py-libp2p spends ~20 µs of
the event loop on each frame however empty, and a peer packs ~5,400 12-byte frames (empty DATA,
WINDOW_UPDATE of 0) into one 64 KiB noise message, one cipher call for it: 108,320 such frames kept
a relay's loop busy for ~2 s (attacker A4, 4 Dec; HTTP/2's "empty frames flood"). An honest peer's
frames are its messages and window updates: a few hundred a second on a hub's busiest link."""

STREAM_WINDOW_BYTES = DEFAULT_WINDOW_SIZE
"""A yamux stream's receive window, bytes (256 KiB, the yamux spec's initial window), also its
largest: py-libp2p's auto-tuning would grow a read stream's window to 16 MiB."""

MAX_BUFFERED_BYTES = 8 * STREAM_WINDOW_BYTES
"""Unread bytes all streams of one connection may hold together (2 MiB): past it the connection
is closed. Each stream's window bounds it alone, but a peer may open :data:`MAX_INBOUND_STREAMS`
streams and fill each while it sits in protocol negotiation, where nothing reads it for up to
30 s: 16 MiB per connection (measured), ``max_peers`` × 16 MiB per hub. An honest peer's ~4
streams hold at most four windows even when this node stops reading them."""


def secure_transports(key_pair: KeyPair) -> TSecurityOptions:
    """Noise XX with the node's ed25519 key and a fresh x25519 static key; nothing else.

    Args:
        key_pair: the node's libp2p key pair (its peer ID), see ``node.p2p.host.libp2p_key_pair``.
    """
    noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    return {TProtocol(NOISE_PROTOCOL_ID): noise}


def muxer_options(muxer: str) -> TMuxerOptions:
    """The one stream muxer a node speaks: ``"yamux"`` (:class:`BoundedYamux`) or ``"mplex"``
    (py-libp2p's, whose per-stream buffer is one message and resets a stream nobody reads)."""
    if muxer == "mplex":
        return {TProtocol(MPLEX_PROTOCOL_ID): Mplex}
    return {TProtocol(YAMUX_PROTOCOL_ID): BoundedYamux}


class _WindowedStream(YamuxStream):
    """A py-libp2p yamux stream that notices its peer sending past the receive window, and returns
    credit to the peer the way go-yamux does.

    py-libp2p appends a DATA frame's bytes to the stream's buffer, then lowers ``recv_window`` (the
    credit the peer still holds, bytes) by their length; a negative result means the peer sent
    more than it was granted. The excess is dropped from the buffer at once (so unread bytes never
    exceed granted credit) and the connection is marked for closing.
    """

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        """After a read: send a WINDOW_UPDATE once the credit consumed reaches half the window
        (go-yamux ``sendWindowUpdate``; yamux spec, "Flow Control"), never growing the window.

        py-libp2p 0.8 sent one after nearly every read however small ("partial slack" below half
        the window; ``PY_YAMUX_RELEASE_ON_READ=0`` only stopped the reads in between): a second
        frame, with its noise encryption and syscalls on both sides, for each gossip message, view,
        record or beat. At a relay with 24 workers, one announcement step cost 3.8 window updates
        per worker of 7.4 frames in all (``benchmarks/gossip_results.md``, issue 36). Credit is
        what the peer may still send, so batching it changes no byte delivered: the peer holds at
        least half a window (128 KiB) of credit at every moment, and our messages are smaller.
        """
        _ = bytes_read  # the consumed credit is what the window and buffer say, not this read alone
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            delta = STREAM_WINDOW_BYTES - (self.recv_window + buffered)
            if delta < STREAM_WINDOW_BYTES // 2:
                return
            self.recv_window += delta
        await self.send_window_update(delta, skip_lock=True)

    @property
    def recv_window(self) -> int:
        return int(self.__dict__["recv_window"])

    @recv_window.setter
    def recv_window(self, value: int) -> None:
        if value < 0:
            buf = self.conn.stream_buffers.get(self.stream_id)
            if buf is not None:
                del buf[max(0, len(buf) + value) :]
            conn = self.conn
            if isinstance(conn, BoundedYamux) and conn.window_exceeded is None:
                conn.window_exceeded = (self.stream_id, -value)
            value = 0
        self.__dict__["recv_window"] = value


class _StreamTable(dict[int, YamuxStream]):
    """``Yamux.streams``: every stream py-libp2p registers becomes a :class:`_WindowedStream`
    (py-libp2p builds its streams inside its frame loop, with no factory to override)."""

    def __setitem__(self, stream_id: int, stream: YamuxStream) -> None:
        if type(stream) is YamuxStream:
            adopt(stream, YamuxStream, _WindowedStream)
        super().__setitem__(stream_id, stream)


class _FrameBudget:
    """Token bucket of yamux frames read on one connection (:data:`MAX_FRAMES_PER_S`, :data:`FRAME_BURST`)."""

    def __init__(self, peer_id: Any) -> None:
        self.peer_id = peer_id
        self.tokens = float(FRAME_BURST)
        self.at = trio.current_time()

    def take(self) -> bool:
        now = trio.current_time()
        self.tokens = min(float(FRAME_BURST), self.tokens + (now - self.at) * MAX_FRAMES_PER_S)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


_read_exactly = py_yamux.read_exactly
"""py-libp2p's own ``read_exactly`` (``node/p2p/libp2p_patches.py`` points the module's name at
:func:`_read_exactly_counted`, which calls this one)."""


async def _read_exactly_counted(conn: Any, n: int, *args: Any, **kwargs: Any) -> bytes:
    """py-libp2p's yamux ``read_exactly``, charging each frame header read on a :class:`BoundedYamux`
    connection to its :class:`_FrameBudget` (over it: ``trio.TooSlowError``, which py-libp2p's frame
    loop answers by closing the connection). Installed by ``node/p2p/libp2p_patches.py``."""
    budget = getattr(conn, "_frame_budget", None) if n == HEADER_SIZE else None
    if budget is not None and not budget.take():
        logger.warning(
            "peer %s sent more than %d yamux frames at %d/s; closing the connection",
            budget.peer_id, FRAME_BURST, MAX_FRAMES_PER_S, extra={"peer_id": str(budget.peer_id)},
        )
        raise trio.TooSlowError
    return cast(bytes, await _read_exactly(conn, n, *args, **kwargs))


class BoundedYamux(Yamux):
    """py-libp2p's :class:`Yamux` that closes a connection whose peer exceeds a stream's receive
    window (go-yamux ``ErrRecvWindowExceeded``; yamux spec, "Flow Control").

    The offending frame's excess is dropped when it arrives; the connection is closed when the
    next DATA frame header is read (py-libp2p's teardown path for a DATA frame it cannot take,
    which logs its own "timed out reading DATA frame body" line after ours).

    It also resets inbound streams past :data:`MAX_INBOUND_STREAMS` open at once: py-libp2p took
    every one into a protocol negotiation of up to 30 s (measured: one peer held ~8,000 open streams
    and ~90 MB on a relay, and py-libp2p's process-wide limit of 10,000 inbound streams, shared with
    honest peers, is then two such peers away), and closes a connection whose streams would hold
    more than :data:`MAX_BUFFERED_BYTES` unread together (windows stay at
    :data:`STREAM_WINDOW_BYTES`, so an honest peer's few streams stay well under it) or sending
    frames faster than :data:`MAX_FRAMES_PER_S` past a burst of :data:`FRAME_BURST`.

    Attributes:
        window_exceeded: ``(stream ID, bytes past the window)`` of the first violation, else None.
        streams_refused: inbound streams reset for going over :data:`MAX_INBOUND_STREAMS`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streams = _StreamTable()
        self.window_exceeded: tuple[int, int] | None = None
        self.streams_refused = 0
        self.secured_conn._frame_budget = _FrameBudget(self.peer_id)  # type: ignore[attr-defined] # read by _read_exactly_counted

    async def _measure_rtt_loop(self) -> None:
        """No RTT pings. py-libp2p 0.8 pings every connection every 30 s from each side (a ping
        and a pong each way: 4 noise frames per connection per 30 s, 67 a second at a hub with 500
        workers) only to size its receive-window auto-tuning, which the pinned window turns off
        (:data:`STREAM_WINDOW_BYTES`); a vanished peer is found by TCP keepalive
        (:func:`set_keepalive`). Pings a peer sends are still answered (py-libp2p's frame loop)."""
        return

    async def accept_stream(self) -> YamuxStream:
        """The next stream the peer opened, resetting any that would hold more than
        :data:`MAX_INBOUND_STREAMS` open at once (go-yamux: ``maxIncomingStreams``, RST)."""
        while True:
            stream = cast(YamuxStream, await super().accept_stream())
            open_inbound = sum(1 for s in self.streams.values() if not s.is_initiator and not s.closed)
            if open_inbound <= MAX_INBOUND_STREAMS:
                return stream
            if not self.streams_refused:
                logger.warning(
                    "peer %s holds more than %d open streams; resetting the new ones",
                    self.peer_id, MAX_INBOUND_STREAMS, extra={"peer_id": str(self.peer_id)},
                )
            self.streams_refused += 1
            await stream.reset()

    async def _read_data_body(self, length: int) -> bytes:
        if self.window_exceeded is not None:
            stream_id, excess = self.window_exceeded
            logger.warning(
                "peer %s sent %d bytes past the yamux receive window of stream %d; closing the connection",
                self.peer_id, excess, stream_id, extra={"peer_id": str(self.peer_id)},
            )
            raise trio.TooSlowError
        held = sum(len(b) for b in self.stream_buffers.values())
        if held + length > MAX_BUFFERED_BYTES:
            logger.warning(
                "peer %s would hold %d unread bytes on one connection (limit %d); closing the connection",
                self.peer_id, held + length, MAX_BUFFERED_BYTES, extra={"peer_id": str(self.peer_id)},
            )
            raise trio.TooSlowError
        return await super()._read_data_body(length)


def _stream_ip(stream: Any) -> str | None:
    """The remote host of a raw inbound stream as the transport gives it, or None."""
    try:
        addr = stream.get_remote_address()
    except Exception:  # noqa: BLE001 - a transport without addresses
        return None
    return str(addr[0]) if addr else None


IPV6_PREFIX = 56
"""IPv6 addresses are counted per network of this prefix length (go-libp2p ``defaultIP6Limits``)."""


class PerAddressCap:
    """Inbound connections per remote IP (IPv6: per /56), at most ``limit`` of them at once.

    The node's ``max_peers`` (64) is one pool for everyone: measured, 64 noise connections from one
    address (one machine, any number of made-up peer IDs) left no slot for a single honest worker
    on a relay. With this cap one address holds at most ``limit``; filling a hub now takes
    ``max_peers / limit`` addresses. Networks in ``exempt`` (loopback by default: the operator's
    own machine, and every test and devnet) are not counted. :class:`InboundSwarm` counts a
    connection from its accept to its close and closes one over the limit before any handshake
    (logged at DEBUG). Connections this node dials are not counted: the attack is inbound.

    Args:
        limit: connections per remote IP; 0 turns the cap off.
        exempt: CIDR networks (``"127.0.0.0/8"``) whose addresses are never capped.

    Raises:
        ValueError: an entry of ``exempt`` is not a CIDR network.
    """

    def __init__(self, limit: int, exempt: Iterable[str]) -> None:
        self.limit = limit
        self.exempt = [ipaddress.ip_network(n, strict=False) for n in exempt]
        self.refused = 0
        """Inbound connections refused by the cap (for status and tests)."""
        self.inbound: Counter[str] = Counter()
        """Inbound connections per :meth:`key`, from accept to close, handshake or not (:class:`InboundSwarm`)."""

    def admit_inbound(self, ip: str | None) -> bool:
        """Count an accepted inbound TCP connection, before any handshake; False (not counted)
        when its address (IPv6: its /56) already holds ``limit`` inbound connections. Each True
        needs one :meth:`release_inbound` with the same ``ip``."""
        key = self.key(ip)
        if key is None:
            return True
        if self.inbound[key] >= self.limit:
            self.refused += 1
            logger.debug("refusing a connection from %s before its handshake: %d inbound from %s (limit %d)", ip, self.inbound[key], key, self.limit)
            return False
        self.inbound[key] += 1
        return True

    def release_inbound(self, ip: str | None) -> None:
        """The inbound connection :meth:`admit_inbound` counted has ended."""
        key = self.key(ip)
        if key is not None:
            self.inbound[key] -= 1
            if self.inbound[key] <= 0:
                del self.inbound[key]

    def key(self, ip: str | None) -> str | None:
        """What the cap counts ``ip`` under: the IPv4 address itself, an IPv6 address's /56
        network (one host or site is given at least a /64, often a /56: go-libp2p's resource
        manager counts IPv6 per /56 too), or None: not counted (no address, an exempt network,
        or the cap off)."""
        if ip is None or self.limit <= 0:
            return None
        # the HTTP servers' rule (IPv4-mapped as IPv4, zone IDs dropped): the address alone for the
        # exemption, its /56 for the count
        try:
            single = ipaddress.ip_network(address_key(ip, v6_prefix=128))
        except ValueError:
            return None
        if any(single.subnet_of(n) for n in self.exempt if n.version == single.version):  # type: ignore[arg-type]
            return None
        return address_key(ip, v6_prefix=IPV6_PREFIX)


_FROM_LISTENER: contextvars.ContextVar[bool] = contextvars.ContextVar("_FROM_LISTENER", default=False)
"""Set in the task py-libp2p's TCP listener runs for one inbound connection, and cleared once read:
only that path's upgrade waits for the connection's end (relay and hole-punching callers do not)."""


KEEPALIVE_PROBES = 3
"""Unanswered TCP keepalive probes after which the kernel drops a connection."""


def set_keepalive(conn: Any, interval_s: float) -> bool:
    """Turn on TCP keepalive on the socket under a py-libp2p raw connection (walking ``.stream``):
    idle and probe interval ``interval_s`` (≥ 1 s), :data:`KEEPALIVE_PROBES` probes. A peer whose
    machine or network vanished while the connection was idle is then dropped by the kernel within
    about ``(1 + KEEPALIVE_PROBES) × interval_s``, at no cost to this process (``docs/gossip.md``,
    liveness). No ``TCP_USER_TIMEOUT``: it also cuts a live peer that is only slow to read (a zero
    window for that long), which a loaded hub's workers are.

    Returns:
        Whether a socket was found and set (False for a transport without one).
    """
    obj = conn
    for _ in range(6):
        sock = getattr(obj, "socket", None)
        if sock is not None and hasattr(sock, "setsockopt"):
            break
        obj = getattr(obj, "stream", None)
        if obj is None:
            return False
    else:
        return False
    seconds = max(1, round(interval_s))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds), ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as e:
        logger.debug("TCP keepalive not set: %r", e)
        return False
    return True


class _InboundEnded(Exception):
    """An inbound connection closed; ends py-libp2p's handler for it (logged at DEBUG there)."""


class InboundSwarm(Swarm):
    """py-libp2p's :class:`Swarm` whose handler of an inbound connection ends when the connection does.

    py-libp2p runs each inbound TCP connection in a handler task that holds one of the swarm's
    ``max_connections - min_connections`` inbound slots (``_inbound_limiter``) and, once the
    connection is upgraded, waits for the *swarm* to stop: a closed connection kept its task, its
    objects and its slot for the node's lifetime. Measured: after ``max_peers`` inbound connections
    in total (one peer connecting and leaving 64 times) a relay refused every inbound connection,
    with none open. Here the handler waits for the connection's muxer to shut down instead.

    Before any handshake it also applies :class:`PerAddressCap` to inbound connections: one
    address holds at most ``limit`` of them, accepted but not yet upgraded included (py-libp2p
    lets an upgrade take 10 s; TCP connections that never speak otherwise took every inbound slot).

    Installed on a host's swarm by :func:`install_inbound_rules`.

    Attributes:
        address_cap: the per-address cap counted before the handshake, or None (no cap).
    """

    address_cap: PerAddressCap | None = None
    keepalive_s: float | None = None
    """TCP keepalive interval of every connection, seconds (None: the OS default, off)."""

    async def _do_handle_inbound_connection(self, read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
        ip = _stream_ip(read_write_closer)
        cap = self.address_cap
        if cap is not None and not cap.admit_inbound(ip):
            with contextlib.suppress(Exception):  # already gone
                await read_write_closer.close()
            return
        if self.keepalive_s is not None:
            set_keepalive(read_write_closer, self.keepalive_s)
        _FROM_LISTENER.set(True)  # this task is this connection's handler alone
        try:
            await super()._do_handle_inbound_connection(read_write_closer, maddr, failure_event)
        finally:
            if cap is not None:
                cap.release_inbound(ip)

    async def upgrade_outbound_raw_conn(self, raw_conn: Any, peer_id: Any, pre_scope: Any = None) -> Any:
        if self.keepalive_s is not None:
            set_keepalive(raw_conn, self.keepalive_s)
        return await super().upgrade_outbound_raw_conn(raw_conn, peer_id, pre_scope)

    async def upgrade_inbound_raw_conn(self, raw_conn: Any, maddr: Any) -> Any:
        from_listener = _FROM_LISTENER.get()
        _FROM_LISTENER.set(False)  # tasks started during the upgrade do not inherit it
        muxed = await super().upgrade_inbound_raw_conn(raw_conn, maddr)
        if not from_listener:
            return muxed
        await muxed.event_shutting_down.wait()  # type: ignore[attr-defined] # yamux and mplex both set it on every way down
        raise _InboundEnded("inbound connection closed")


def install_inbound_rules(network: INetwork, cap: PerAddressCap, *, keepalive_s: float | None = None) -> None:
    """Make ``network`` (a py-libp2p :class:`Swarm`, before it runs) an :class:`InboundSwarm`
    counting inbound connections against ``cap``, with TCP keepalive every ``keepalive_s`` seconds
    on its connections (:func:`set_keepalive`; None: off).

    Raises:
        TypeError: ``network`` is not exactly py-libp2p's :class:`Swarm`.
    """
    swarm = adopt(network, Swarm, InboundSwarm)
    swarm.address_cap = cap
    swarm.keepalive_s = keepalive_s
