"""The exception family of ``node/``.

:class:`NodeError` is the root of every error ``node/`` raises on purpose. Subclasses carry the
fields a fault-tolerance point needs to act (which source, which piece). Failures caused by what
a peer sent are :class:`SourceError`; everything else is the local node's own trouble.
"""

from __future__ import annotations


class NodeError(Exception):
    """Root of the errors raised by ``node/``."""


class ShardcastError(NodeError):
    """Checkpoint distribution failed (publish, store, serve, fetch)."""


class SourceError(ShardcastError):
    """A Shardcast source (origin or relay) answered wrongly or not at all.

    Attributes:
        source: base URL of the source.
        reason: short machine-readable reason (``"http_503"``, ``"timeout"``, ``"oversized"``…).
        evidence: whether this is proof of misbehaviour (bytes that contradict a signed
            manifest) rather than a transport failure that an honest source can have too.
    """

    def __init__(self, source: str, reason: str, message: str, *, evidence: bool = False) -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
        self.reason = reason
        self.evidence = evidence


class BadPieceError(SourceError):
    """A source served bytes for a piece that do not hash to the piece's content ID (evidence).

    Attributes:
        piece_id: the 32-byte content ID that was asked for.
    """

    def __init__(self, source: str, piece_id: bytes, message: str, *, reason: str = "bad_piece") -> None:
        super().__init__(source, reason, f"piece {piece_id.hex()[:16]}…: {message}", evidence=True)
        self.piece_id = piece_id


class FetchError(ShardcastError):
    """A fetch could not complete (no source holds the step, all sources failed, deadline passed).

    Attributes:
        faulty_sources: sources found misbehaving, with the reason of the first evidence.
    """

    def __init__(self, message: str, faulty_sources: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.faulty_sources = dict(faulty_sources or {})


class StoreError(ShardcastError):
    """The local Shardcast store is unusable (wrong run, unreadable, inconsistent)."""


class GossipError(NodeError):
    """The libp2p/gossip layer failed (host start, bridge, publish)."""


class Libp2pMismatchError(GossipError):
    """The installed py-libp2p is not the one the node's overrides of it were written against
    (``node/p2p/libp2p_patches.py``): another version, or a name an override replaces is gone.

    Attributes:
        installed: the installed ``libp2p`` version (``"none"``: not installed).
        pinned: the version the overrides were written against.
        missing: dotted paths of what an override replaces or extends and the installed libp2p lacks.
    """

    def __init__(self, installed: str, pinned: str, missing: list[str]) -> None:
        self.installed = installed
        self.pinned = pinned
        self.missing = missing
        if installed != pinned:
            what = f"libp2p {installed} is installed, but the node's overrides of py-libp2p were written against {pinned}"
        else:
            what = f"libp2p {installed} lacks what the node overrides: {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}"
        super().__init__(f"{what}; install libp2p=={pinned} (pyproject.toml pins it), or re-check each entry of "
                         f"node/p2p/libp2p_patches.py against the new version before moving the pin")


class BridgeError(GossipError):
    """The asyncio↔trio bridge is not running, or did not start or stop in time."""


class PublishError(GossipError):
    """A message could not be published on gossip.

    Attributes:
        topic: the gossip topic.
        reason: short machine-readable reason (``"oversized"``, ``"wrong_type"``, ``"not_running"``…).
    """

    def __init__(self, topic: str, reason: str, message: str) -> None:
        super().__init__(f"{topic}: {message}")
        self.topic = topic
        self.reason = reason
