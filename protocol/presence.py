"""Presence and roster byte formats: how a worker tells its hubs it is alive, and how anyone reads a
hub's list of attached workers (``docs/protocol.md`` §9.1, ``docs/gossip.md``). Pure: no sockets.

Two libp2p stream protocols, per run:

* ``/intellect/<run16>/presence/1`` — opened by a worker to each hub (coordinator, relay,
  validator) it is connected to, and kept open. Both directions carry *frames*::

      length  u32 big-endian, 1 … FRAME_MAX_BYTES (the bytes that follow)
      kind    u8
      payload length − 1 bytes

  worker → hub: ``RECORD`` (payload: the worker's ``node_record/1`` envelope, sent when the
  stream opens and whenever the record changes) and ``BEAT`` (empty payload, every
  ``PRESENCE_BEAT_INTERVALS`` heartbeat intervals). hub → worker: ``VIEW`` (payload: a
  :func:`pack_envelopes` list of the ``node_record/1`` envelopes of the live hubs, the sender
  first; sent when the stream opens and whenever what it lists changes).
* ``/intellect/<run16>/roster/1`` — request: the 32-byte roster ID named in a hub's record;
  answer: a u32 big-endian length, then that many bytes: the roster (:func:`pack_envelopes` of
  the attached workers' ``node_record/1`` envelopes, ordered by their bytes), whose SHA-256 is
  the roster ID; length 0 when the hub no longer has it.

Nothing here is trusted by being well formed: every envelope inside is verified by the reader
(``protocol.envelope.open_envelope``), and a roster only counts if it hashes to the ID its hub signed.
"""

from __future__ import annotations

import struct
from typing import Final

from protocol import encoding
from protocol.content import CONTENT_ID_BYTES, ContentId, content_id
from protocol.errors import DecodeError
from protocol.messages import MiB, NodeRecord

PRESENCE_VERSION: Final = 1
ROSTER_VERSION: Final = 1

RECORD: Final = 0x01
"""worker → hub: the worker's ``node_record/1`` envelope."""
BEAT: Final = 0x02
"""worker → hub: still here (empty payload)."""
VIEW: Final = 0x11
"""hub → worker: the live hubs' ``node_record/1`` envelopes."""
WORKER_KINDS: Final = frozenset({RECORD, BEAT})
HUB_KINDS: Final = frozenset({VIEW})

LENGTH_BYTES: Final = 4
ENVELOPE_MAX_BYTES: Final = NodeRecord.MAX_BYTES
"""Largest envelope inside a frame, a view or a roster (a ``node_record/1``), bytes."""
VIEW_MAX_ENTRIES: Final = 256
"""Most hub records in one view."""
VIEW_MAX_BYTES: Final = 1 * MiB
"""Largest view payload, bytes (256 records of ≈ 0.5–1.5 KiB, with room)."""
FRAME_MAX_BYTES: Final = 1 + VIEW_MAX_BYTES
"""Largest frame (kind byte + payload), bytes. A worker → hub frame is at most 1 + 8 KiB."""
WORKER_FRAME_MAX_BYTES: Final = 1 + ENVELOPE_MAX_BYTES
ROSTER_MAX_ENTRIES: Final = 4096
"""Most workers in one roster (a hub's ``max_peers`` is at most 4,096)."""
ROSTER_MAX_BYTES: Final = 8 * MiB
"""Largest roster, bytes (4,096 records of ≤ 2 KiB each; records are capped at 8 KiB alone)."""
ROSTER_REQUEST_BYTES: Final = CONTENT_ID_BYTES

PRESENCE_BEAT_INTERVALS: Final = 5
"""A worker sends a ``BEAT`` every this many heartbeat intervals (10 s at the default 2 s): a hub
already sees a worker that exits or crashes at once (its connection closes), and TCP keepalive at
the heartbeat interval finds a vanished machine; the beat catches a process that hangs with its
connection up. Each frame costs a py-libp2p hub ≈ 0.35 ms of CPU (``docs/gossip.md``, results),
so one per interval per worker would not stay flat."""
MISSED_BEATS: Final = 3
"""A hub drops a worker silent for this many beat periods (3 × 5 × 2 s = 30 s by default)."""

def presence_protocol(run_id: bytes) -> str:
    """The presence stream protocol ID of run ``run_id`` (32 bytes)."""
    return f"/intellect/{run_id.hex()[:16]}/presence/{PRESENCE_VERSION}"


def roster_protocol(run_id: bytes) -> str:
    """The roster fetch protocol ID of run ``run_id`` (32 bytes)."""
    return f"/intellect/{run_id.hex()[:16]}/roster/{ROSTER_VERSION}"


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One frame: u32 big-endian length of (kind + payload), kind byte, payload.

    Raises:
        ValueError: unknown kind, or the frame would exceed :data:`FRAME_MAX_BYTES`.
    """
    if kind not in WORKER_KINDS | HUB_KINDS:
        raise ValueError(f"unknown presence frame kind {kind:#x}")
    if 1 + len(payload) > FRAME_MAX_BYTES:
        raise ValueError(f"presence frame of {1 + len(payload)} bytes exceeds {FRAME_MAX_BYTES}")
    return struct.pack(">IB", 1 + len(payload), kind) + payload


def frame_length(header: bytes, *, max_bytes: int, kinds: frozenset[int]) -> int:
    """Check a frame's 4-byte length prefix before reading the frame.

    Args:
        header: the 4 length bytes.
        max_bytes: the largest frame this direction allows (kind byte included).
        kinds: frame kinds this direction allows (only used for the error text here).

    Returns:
        The frame's length (kind byte + payload), 1 … ``max_bytes``.

    Raises:
        DecodeError: a zero length or one over ``max_bytes``.
    """
    if len(header) != LENGTH_BYTES:
        raise DecodeError(f"a frame length is {LENGTH_BYTES} bytes, got {len(header)}")
    n = int.from_bytes(header, "big")
    if not 1 <= n <= max_bytes:
        raise DecodeError(f"presence frame of {n} bytes (limit {max_bytes}, kinds {sorted(kinds)})")
    return n


def split_frame(data: bytes, *, kinds: frozenset[int]) -> tuple[int, bytes]:
    """``(kind, payload)`` of a frame body (what follows the length prefix).

    Raises:
        DecodeError: empty, a kind not allowed in this direction, or a ``BEAT`` with a payload.
    """
    if not data:
        raise DecodeError("empty presence frame")
    kind = data[0]
    if kind not in kinds:
        raise DecodeError(f"presence frame kind {kind:#x} not allowed here")
    if kind == BEAT and len(data) != 1:
        raise DecodeError("a BEAT frame has no payload")
    return kind, bytes(data[1:])


def pack_envelopes(envelopes: list[bytes]) -> bytes:
    """Canonical msgpack array of envelope bytes (a view or a roster).

    Raises:
        ValueError: too many entries, or one over :data:`ENVELOPE_MAX_BYTES`.
    """
    if len(envelopes) > ROSTER_MAX_ENTRIES:
        raise ValueError(f"{len(envelopes)} envelopes, over {ROSTER_MAX_ENTRIES}")
    if any(len(e) > ENVELOPE_MAX_BYTES for e in envelopes):
        raise ValueError(f"an envelope over {ENVELOPE_MAX_BYTES} bytes")
    return encoding.packb([bytes(e) for e in envelopes])


def unpack_envelopes(data: bytes, *, max_entries: int, max_bytes: int) -> list[bytes]:
    """The envelope byte strings of a view or roster, bounded before anything is built.

    Args:
        data: the packed list.
        max_entries: most entries accepted (:data:`VIEW_MAX_ENTRIES`, :data:`ROSTER_MAX_ENTRIES`).
        max_bytes: largest ``data`` accepted.

    Raises:
        DecodeError: over a bound, not canonical msgpack, not an array of bins, or duplicates.
    """
    limits = encoding.DecodeLimits(max_bin_len=ENVELOPE_MAX_BYTES, max_str_len=0, max_array_len=max_entries, max_map_len=0, max_depth=1)
    obj = encoding.unpackb(data, max_bytes, limits)
    if not isinstance(obj, list) or not all(isinstance(e, bytes) for e in obj):
        raise DecodeError("expected an array of envelope bins")
    if len(set(obj)) != len(obj):
        raise DecodeError("the same envelope twice")
    return obj


def pack_roster(envelopes: list[bytes]) -> tuple[ContentId, bytes]:
    """A hub's roster: its attached workers' record envelopes ordered by their bytes, and its ID
    (SHA-256 of the packed bytes). Equal sets give equal IDs.

    Raises:
        ValueError: as :func:`pack_envelopes`.
    """
    data = pack_envelopes(sorted(envelopes))
    return content_id(data), data


def unpack_roster(roster_id: bytes, data: bytes) -> list[bytes]:
    """The envelopes of a fetched roster, after checking it is the one its hub signed.

    Args:
        roster_id: the ``roster`` field of the hub's verified record.
        data: the bytes fetched.

    Raises:
        DecodeError: the bytes do not hash to ``roster_id`` (a wrong or stale answer), exceed a
            bound, or are not a roster (entries out of order, duplicates).
    """
    if len(data) > ROSTER_MAX_BYTES:
        raise DecodeError(f"roster of {len(data)} bytes exceeds {ROSTER_MAX_BYTES}")
    if content_id(data) != roster_id:
        raise DecodeError("roster bytes do not hash to the roster ID the hub signed")
    envelopes = unpack_envelopes(data, max_entries=ROSTER_MAX_ENTRIES, max_bytes=ROSTER_MAX_BYTES)
    if envelopes != sorted(envelopes):
        raise DecodeError("roster entries are not in order")
    return envelopes
