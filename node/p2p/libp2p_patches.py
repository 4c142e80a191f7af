"""Every change this node makes to py-libp2p's own code, in one list, for the one version it was
written against (``libp2p`` 0.8.1, pinned in ``pyproject.toml``).

py-libp2p 0.8.1's defaults let a peer hurt a node (unbounded buffers, queues and answers) or cost
a hub CPU per peer for nothing, and some of its objects offer no option to change that. What the
node changes is listed in :data:`OVERRIDES`: what is replaced or extended, how, by what, and why
(the measurements are in ``docs/gossip.md`` and ``benchmarks/gossip_results.md``). The
replacements themselves live with their concern (``node/p2p/transport.py``: what a connection may
speak; ``node/p2p/router.py``: gossipsub); this module applies them.

* :func:`apply` makes the process-wide changes (module names py-libp2p looks up when it builds a
  connection or a queue, its log records) once per process. The first :class:`~node.p2p.host.P2PHost`
  calls it before it builds anything; importing a module of ``node.p2p`` changes nothing in
  py-libp2p.
* :func:`adopt` makes the per-object ones: it turns one py-libp2p object into our subclass of its
  class (py-libp2p builds swarms and yamux streams itself, with no factory to override), after
  checking the object is exactly the class the subclass was written for.
* The rest are our subclasses overriding methods (some private) of py-libp2p classes, chosen
  through py-libp2p's public options (``muxer_opt``, the router and pubsub given to the host).

Both refuse to run (:class:`~node.errors.Libp2pMismatchError`) when the installed libp2p is not
:data:`PINNED_LIBP2P_VERSION`, or when any name an override replaces or extends is missing from it:
a renamed private method would otherwise leave a rule silently unapplied (a yamux that buffers
without bound, a queue of 32 that drops without a word). A new py-libp2p needs each entry below
re-checked against its code, then the pin and :data:`PINNED_LIBP2P_VERSION` moved together.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal, TypeVar

from node.errors import Libp2pMismatchError

logger = logging.getLogger(__name__)

__all__ = ["OVERRIDES", "PINNED_LIBP2P_VERSION", "Override", "adopt", "apply", "check"]

PINNED_LIBP2P_VERSION = "0.8.1"
"""The py-libp2p release every override below was written and tested against."""

OverrideKind = Literal["module name", "method", "instance attribute", "instance class", "log filter"]


@dataclass(frozen=True)
class Override:
    """One change to py-libp2p.

    Attributes:
        target: dotted path of what is replaced or extended in py-libp2p (a module-level name, a
            class's method, an attribute its ``__init__`` sets, a class whose instances are
            adopted, or a logger's name).
        kind: ``module name`` (set by :func:`apply`), ``method`` (overridden by our subclass),
            ``instance attribute`` (set on each instance we build), ``instance class`` (instances
            turned into our subclass by :func:`adopt`), ``log filter`` (added by :func:`apply`).
        ours: dotted path of what replaces it (for an attribute, the value's source).
        why: what py-libp2p does and why the node cannot keep it.
    """

    target: str
    kind: OverrideKind
    ours: str
    why: str


OVERRIDES: tuple[Override, ...] = (
    # --- yamux: node/p2p/transport.py --------------------------------------------------------------
    Override(
        "libp2p.stream_muxer.muxer_multistream.Yamux", "module name", "node.p2p.transport.BoundedYamux",
        "py-libp2p builds every yamux connection as muxer_multistream.Yamux(...), whatever class the muxer "
        "options name, so the bounded yamux below is only used if this name points at it.",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.MAX_WINDOW_SIZE", "module name", "node.p2p.transport.STREAM_WINDOW_BYTES",
        "auto-tuning grows a read stream's receive window to 16 MiB; pinned at the 256 KiB initial window "
        "so a connection's unread bytes stay bounded (MAX_BUFFERED_BYTES).",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.read_exactly", "module name", "node.p2p.transport._read_exactly_counted",
        "the frame loop reads each 12-byte header through this name; ours charges it to the connection's "
        "frame budget (1,000/s, burst 20,000): ~20 us of the loop per frame however empty, and a peer packs "
        "~5,400 empty frames into one noise message (attacker A4, 4 Dec).",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.Yamux.accept_stream", "method", "node.p2p.transport.BoundedYamux.accept_stream",
        "every inbound stream went into a protocol negotiation of up to 30 s: one peer held ~8,000 streams "
        "and ~90 MB; past MAX_INBOUND_STREAMS open at once new ones are reset (go-yamux maxIncomingStreams).",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.Yamux._read_data_body", "method", "node.p2p.transport.BoundedYamux._read_data_body",
        "DATA past a stream's window was logged and buffered anyway (64 MiB sat in a relay); the connection "
        "is closed at the next DATA frame after a violation, or when its streams would hold over 2 MiB unread.",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.Yamux.__init__.streams", "instance attribute", "node.p2p.transport._StreamTable",
        "Yamux.streams becomes a table that adopts each stream py-libp2p registers (it builds them inside its "
        "frame loop, with no factory to override).",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.Yamux.__init__.secured_conn", "instance attribute", "node.p2p.transport._FrameBudget",
        "the connection the frame loop passes to read_exactly: the frame budget rides on it.",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.YamuxStream", "instance class", "node.p2p.transport._WindowedStream",
        "each yamux stream notices its peer sending past the receive window (the excess dropped at once).",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.YamuxStream.__init__.recv_window", "instance attribute",
        "node.p2p.transport._WindowedStream.recv_window",
        "a property over py-libp2p's counter of credit the peer holds: negative means it sent past the window.",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.YamuxStream._auto_tune_and_send_window_update", "method",
        "node.p2p.transport._WindowedStream._auto_tune_and_send_window_update",
        "a WINDOW_UPDATE went out after nearly every read however small (a second noise frame and syscalls per "
        "message on both sides: half of a relay's frames in an announcement step); credit now goes back once half "
        "the window is consumed, as go-yamux does (before: PY_YAMUX_RELEASE_ON_READ=0 halved them).",
    ),
    Override(
        "libp2p.stream_muxer.yamux.yamux.Yamux._measure_rtt_loop", "method", "node.p2p.transport.BoundedYamux._measure_rtt_loop",
        "a ping each way every 30 s on every connection, only to size the window auto-tuning the pinned window "
        "turns off (67 frames/s at a hub with 500 workers); peers' pings are still answered.",
    ),
    # --- swarm: node/p2p/transport.py ----------------------------------------------------------------
    Override(
        "libp2p.network.swarm.Swarm", "instance class", "node.p2p.transport.InboundSwarm",
        "the host's swarm is adopted before it runs (install_inbound_rules) for the three methods below.",
    ),
    Override(
        "libp2p.network.swarm.Swarm._do_handle_inbound_connection", "method", "node.p2p.transport.InboundSwarm._do_handle_inbound_connection",
        "inbound connections are counted per address (max_peers_per_ip) from accept, before any handshake, and "
        "get TCP keepalive: 4 silent sockets from one address took every inbound slot of a max_peers 4 relay.",
    ),
    Override(
        "libp2p.network.swarm.Swarm.upgrade_inbound_raw_conn", "method", "node.p2p.transport.InboundSwarm.upgrade_inbound_raw_conn",
        "py-libp2p's handler of an inbound connection waited for the swarm to stop, so a closed connection kept "
        "its inbound slot for the node's lifetime (64 connections in total and a relay refused every new one).",
    ),
    Override(
        "libp2p.network.swarm.Swarm.upgrade_outbound_raw_conn", "method", "node.p2p.transport.InboundSwarm.upgrade_outbound_raw_conn",
        "TCP keepalive at the heartbeat interval on dialed connections too (a vanished peer dropped within ~4 T).",
    ),
    # --- pubsub and gossipsub: node/p2p/router.py ----------------------------------------------------
    Override(
        "libp2p.pubsub.pubsub.RpcQueue", "module name", "node.p2p.router._BoundedRpcQueue",
        "each peer's outbound queue held 32 RPCs and dropped past it silently (a burst of 300 verdicts: 260 "
        "arrived); ours holds SEND_QUEUE_RPCS (512) and the router counts drops.",
    ),
    Override(
        "libp2p.pubsub.pubsub.SUBSCRIPTION_CHANNEL_SIZE", "module name", "node.p2p.router.DELIVERY_QUEUE_MESSAGES",
        "each subscription's delivery channel held 32 messages and dropped past it silently; 1,024.",
    ),
    Override(
        "libp2p.pubsub.pubsub.env_to_send_in_RPC", "module name", "node.p2p.router.sender_record",
        "the host's signed peer record, attached to what pubsub sends, was rebuilt (addresses, serialization) for "
        "every message, ~0.2-0.3 ms each; reused for a second.",
    ),
    Override(
        "libp2p.pubsub.gossipsub.env_to_send_in_RPC", "module name", "node.p2p.router.sender_record",
        "the same for every message gossipsub publishes or forwards, whether or not it has anyone to send it to.",
    ),
    Override(
        "libp2p.pubsub.pubsub.Pubsub.notify_subscriptions", "method", "node.p2p.router.CountingPubsub.notify_subscriptions",
        "counts the messages a full delivery channel drops (stats()['delivery_drops']).",
    ),
    Override(
        "libp2p.pubsub.gossipsub.GossipSub._handle_dropped_rpc", "method", "node.p2p.router.BoundedGossipSub._handle_dropped_rpc",
        "counts the RPCs a full send queue drops (stats()['send_drops']).",
    ),
    Override(
        "libp2p.pubsub.gossipsub.GossipSub.handle_iwant", "method", "node.p2p.router.BoundedGossipSub.handle_iwant",
        "an IWANT was answered once per listed ID, duplicates included, as often as asked: one 240 KB IWANT took "
        "a relay from 101 to 555 MB; each ID once per IWANT, each message 3 times per peer (go-libp2p-pubsub).",
    ),
    Override(
        "libp2p.pubsub.gossipsub.GossipSub.remove_peer", "method", "node.p2p.router.BoundedGossipSub.remove_peer",
        "forgets a departed peer's IWANT answer counts.",
    ),
    Override(
        "libp2p.pubsub.gossipsub.GossipSub._perform_opportunistic_grafting", "method",
        "node.p2p.router.BoundedGossipSub._perform_opportunistic_grafting",
        "scored every mesh peer of every topic every second looking for a subscriber outside the mesh; a hub's "
        "full mesh has none (about a third of a 500-worker relay's idle CPU): skipped when there is none.",
    ),
    Override(
        "libp2p.pubsub.gossipsub.GossipSub._consider_peer_replacement", "method",
        "node.p2p.router.BoundedGossipSub._consider_peer_replacement",
        "the same scoring for 'peer replacement' (not in the gossipsub spec): skipped when no subscriber is outside the mesh.",
    ),
    Override(
        "libp2p.pubsub.score.PeerScorer", "instance class", "node.p2p.router._DefaultScorer",
        "the router's scorer is adopted so that, with py-libp2p's inert default parameters (ours: weights 0, "
        "decays 1, thresholds -inf), it no longer rewrites ~6 values per peer and topic every second nor scores "
        "every peer a message is sent to (1.5 ms per announcement at a hub with 500 workers).",
    ),
    Override(
        "libp2p.pubsub.score.PeerScorer.on_heartbeat", "method", "node.p2p.router._DefaultScorer.on_heartbeat",
        "returns at once when every decay factor is 1; otherwise decays as before.",
    ),
    Override(
        "libp2p.pubsub.score.PeerScorer.allow_publish", "method", "node.p2p.router._DefaultScorer.allow_publish",
        "True at once when the publish threshold is -inf (any finite score passes it); otherwise scores as before.",
    ),
    Override(
        "libp2p.pubsub.score.PeerScorer.allow_gossip", "method", "node.p2p.router._DefaultScorer.allow_gossip",
        "True at once when the gossip threshold is -inf; otherwise scores as before.",
    ),
    Override(
        "libp2p.pubsub.score.PeerScorer.is_graylisted", "method", "node.p2p.router._DefaultScorer.is_graylisted",
        "False at once when the graylist threshold is -inf; otherwise scores as before.",
    ),
    Override(
        "libp2p.pubsub.gossipsub.GossipSub.__init__.scorer", "instance attribute", "node.p2p.router._DefaultScorer",
        "the router's scorer, adopted in BoundedGossipSub.__init__.",
    ),
    Override(
        "libp2p.pubsub.gossipsub.GossipSub.__init__.graft_flood_threshold", "instance attribute", "node.p2p.router.BoundedGossipSub",
        "set to 0 (off): py-libp2p's 'GRAFT flood' check (not in gossipsub v1.1) refused and penalized the GRAFT "
        "of a peer that had pruned us within 10 s, so meshes around a busy hub churned; the spec's 60 s prune "
        "backoff still applies.",
    ),
    # --- logging: node/p2p/libp2p_patches.py ---------------------------------------------------------
    Override(
        "libp2p.transport.tcp.tcp", "log filter", "node.p2p.libp2p_patches.PeerNoiseFilter",
        "every failed dial is logged at WARNING/ERROR; an unreachable peer is peer noise: DEBUG.",
    ),
    Override(
        "libp2p.network.swarm", "log filter", "node.p2p.libp2p_patches.PeerNoiseFilter",
        "every torn-down connection is logged at WARNING/ERROR; a departing peer is peer noise: DEBUG.",
    ),
)
"""Every override of py-libp2p 0.8.1 the node makes (see the module docstring)."""


class PeerNoiseFilter(logging.Filter):
    """Demotes WARNING and above to DEBUG (a py-libp2p logger that reports peers' failures as ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_lock = threading.Lock()
_applied = False


def _resolve(path: str) -> tuple[Any, str]:
    """``(owner, name)`` of a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:-1]:
            obj = getattr(obj, attr)
        return obj, parts[-1]
    raise ImportError(path)


def _present(o: Override) -> bool:
    """Whether py-libp2p still has what ``o`` replaces or extends."""
    try:
        if o.kind == "log filter":
            importlib.import_module(o.target)
            return True
        owner, name = _resolve(o.target)
        if o.kind == "instance attribute":  # ``Class.__init__.attr``: an attribute that ``__init__`` assigns
            return name in owner.__code__.co_names
        return hasattr(owner, name)
    except (ImportError, AttributeError):
        return False


def check() -> None:
    """Refuse a py-libp2p the overrides were not written against.

    Raises:
        Libp2pMismatchError: the installed ``libp2p`` is not :data:`PINNED_LIBP2P_VERSION`, or a name
            an override replaces or extends is missing from it.
    """
    try:
        installed = metadata.version("libp2p")
    except metadata.PackageNotFoundError:
        installed = "none"
    if installed != PINNED_LIBP2P_VERSION:
        raise Libp2pMismatchError(installed, PINNED_LIBP2P_VERSION, [])
    missing = [o.target for o in OVERRIDES if not _present(o)]
    if missing:
        raise Libp2pMismatchError(installed, PINNED_LIBP2P_VERSION, missing)


def apply() -> None:
    """Check py-libp2p (:func:`check`) and make the process-wide overrides, once per process
    (thread-safe; later calls return at once).

    Raises:
        Libp2pMismatchError: see :func:`check`; nothing is changed then.
    """
    global _applied
    with _lock:
        if _applied:
            return
        check()
        for o in OVERRIDES:
            if o.kind == "module name":
                owner, name = _resolve(o.target)
                replacement_owner, replacement_name = _resolve(o.ours)
                setattr(owner, name, getattr(replacement_owner, replacement_name))
            elif o.kind == "log filter":
                logging.getLogger(o.target).addFilter(PeerNoiseFilter())
        _applied = True
        logger.debug("py-libp2p %s: %d overrides in force", PINNED_LIBP2P_VERSION, len(OVERRIDES))


T = TypeVar("T")


def adopt(obj: Any, base: type, subclass: type[T]) -> T:
    """Turn ``obj``, built by py-libp2p as exactly ``base``, into an instance of ``subclass`` (one of
    the ``instance class`` overrides; ``subclass`` adds methods and properties, no state of its own
    that ``__init__`` would set).

    Raises:
        TypeError: ``obj`` is not exactly ``base`` (already adopted, or py-libp2p built another class).
    """
    if type(obj) is not base:
        raise TypeError(f"expected py-libp2p's {base.__name__}, got {type(obj).__name__}")
    obj.__class__ = subclass
    return obj  # type: ignore[no-any-return]
