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
* ``/intellect/<run16>/roster/1`` — request (:func:`roster_request`): the 32-byte roster ID
  named in a hub's record, then the 32-byte ID of a roster of that hub the reader already holds
  (32 zero bytes: none); answer: a u32 big-endian length, then that many bytes
  (:func:`read_roster_answer`): ``FULL`` and the roster (:func:`pack_envelopes` of the attached
  workers' ``node_record/1`` envelopes, ordered by their bytes), whose SHA-256 is the roster ID;
  or ``DELTA`` and what changed since the held roster (:func:`pack_roster_delta`: the content IDs
  of the entries gone, the entries new), which the reader applies to its copy and must then hash
  to the roster ID; length 0 when the hub no longer has it. A worker whose record changes costs a
  reader of its hub's roster that record, not the whole roster again.

Nothing here is trusted by being well formed: every envelope inside is verified by the reader
(``protocol.envelope.open_envelope``), and a roster only counts if it hashes to the ID its hub signed.
"""

from __future__ import annotations

import struct
from typing import Final

from protocol import encoding
from protocol.content import CONTENT_ID_BYTES, ContentId, content_id
from protocol.errors import DecodeError, TooLarge
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
ROSTER_REQUEST_BYTES: Final = 2 * CONTENT_ID_BYTES
"""A roster request: the roster ID wanted, then the ID of the roster held (zeros: none)."""
FULL: Final = 0x00
"""Roster answer form: the whole roster follows."""
DELTA: Final = 0x01
"""Roster answer form: the changes since the roster the reader holds follow."""
NO_ROSTER: Final = bytes(CONTENT_ID_BYTES)

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
    if n == 0:
        raise DecodeError("an empty presence frame")
    if n > max_bytes:
        raise TooLarge(f"presence frame of {n} bytes (limit {max_bytes}, kinds {sorted(kinds)})")
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


def fit_view(envelopes: list[bytes]) -> list[bytes]:
    """The longest prefix of ``envelopes`` (in the caller's priority order) that packs within
    :data:`VIEW_MAX_ENTRIES` and :data:`VIEW_MAX_BYTES`, so a view always fits one frame.

    Hub records are self-signed and up to :data:`ENVELOPE_MAX_BYTES` each, so anyone can make the
    live hubs' records outgrow a frame (≈ 200 records of ≈ 5 KiB); the caller orders them so that
    the ones workers need most come first.
    """
    out: list[bytes] = []
    size = _MSGPACK_HEADER_MAX  # array header
    for e in envelopes:
        if len(out) == VIEW_MAX_ENTRIES:
            break
        size += _MSGPACK_HEADER_MAX + len(e)  # bin header + bytes
        if size > VIEW_MAX_BYTES:
            break
        out.append(e)
    return out


_MSGPACK_HEADER_MAX = 5
"""Most bytes a msgpack array or bin header takes (type byte + u32 length)."""


def unpack_envelopes(data: bytes, *, max_entries: int, max_bytes: int) -> list[bytes]:
    """The envelope byte strings of a view or roster, bounded before anything is built.

    Args:
        data: the packed list.
        max_entries: most entries accepted (:data:`VIEW_MAX_ENTRIES`, :data:`ROSTER_MAX_ENTRIES`).
        max_bytes: largest ``data`` accepted.

    Raises:
        DecodeError: over a bound, not canonical msgpack, not an array of bins, or duplicates.
    """
    limits = encoding.DecodeLimits(max_bin_len=ENVELOPE_MAX_BYTES, max_str_len=0, max_array_len=max_entries, max_map_len=0, max_depth=1,
                                   max_containers=1)
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
        raise TooLarge(f"roster of {len(data)} bytes exceeds {ROSTER_MAX_BYTES}")
    if content_id(data) != roster_id:
        raise DecodeError("roster bytes do not hash to the roster ID the hub signed")
    envelopes = unpack_envelopes(data, max_entries=ROSTER_MAX_ENTRIES, max_bytes=ROSTER_MAX_BYTES)
    if envelopes != sorted(envelopes):
        raise DecodeError("roster entries are not in order")
    return envelopes


def roster_request(wanted: bytes, held: bytes = b"") -> bytes:
    """A ``roster/1`` request: the roster ID wanted and the ID of the roster of the same hub held
    (``b""``: none; the answer is then the whole roster).

    Raises:
        ValueError: an ID that is not 32 bytes.
    """
    held = held or NO_ROSTER
    if len(wanted) != CONTENT_ID_BYTES or len(held) != CONTENT_ID_BYTES:
        raise ValueError("roster IDs are 32 bytes")
    return bytes(wanted) + bytes(held)


def parse_roster_request(data: bytes) -> tuple[bytes, bytes]:
    """``(wanted, held)`` of a request (``held`` is ``b""`` for none).

    Raises:
        DecodeError: not :data:`ROSTER_REQUEST_BYTES` long.
    """
    if len(data) != ROSTER_REQUEST_BYTES:
        raise DecodeError(f"a roster request is {ROSTER_REQUEST_BYTES} bytes, got {len(data)}")
    held = bytes(data[CONTENT_ID_BYTES:])
    return bytes(data[:CONTENT_ID_BYTES]), b"" if held == NO_ROSTER else held


def pack_roster_delta(held: list[bytes], wanted: list[bytes]) -> bytes:
    """The ``DELTA`` answer turning roster ``held`` into roster ``wanted`` (both lists of envelopes):
    ``DELTA`` byte, then the canonical msgpack array ``[gone, new]``: the content IDs of the
    entries of ``held`` not in ``wanted`` (ascending), and the entries of ``wanted`` not in ``held``
    (ascending).

    Raises:
        ValueError: as :func:`pack_envelopes` for the new entries.
    """
    before, after = set(held), set(wanted)
    gone = sorted(bytes(content_id(e)) for e in before - after)
    new = sorted(after - before)
    pack_envelopes(new)  # its bounds
    return bytes([DELTA]) + encoding.packb([gone, [bytes(e) for e in new]])


def pack_roster_answer(data: bytes) -> bytes:
    """The ``FULL`` answer carrying roster bytes ``data`` (as :func:`pack_roster` made them)."""
    return bytes([FULL]) + data


def read_roster_answer(roster_id: bytes, answer: bytes, held: dict[bytes, bytes] | None = None) -> dict[bytes, bytes]:
    """The entries of roster ``roster_id`` from a ``roster/1`` answer, after checking it is the
    roster its hub signed.

    Args:
        roster_id: the ``roster`` field of the hub's verified record.
        answer: the answer's bytes (after the length prefix, non-empty).
        held: the entries of the roster the request named as held, by content ID (required for a
            ``DELTA`` answer; never modified).

    Returns:
        The roster's entries (envelopes) by content ID.

    Raises:
        DecodeError: over a bound; an unknown form; a ``DELTA`` without a held roster, naming an
            entry gone that was not held or a new one already held; or the result does not hash
            to ``roster_id`` (a wrong or stale answer), is out of order or holds duplicates.
    """
    if not answer:
        raise DecodeError("empty roster answer")
    form, body = answer[0], answer[1:]
    if form == FULL:
        return {bytes(content_id(e)): e for e in unpack_roster(roster_id, body)}
    if form != DELTA:
        raise DecodeError(f"unknown roster answer form {form:#x}")
    if held is None:
        raise DecodeError("a roster delta, but no roster was held")
    limits = encoding.DecodeLimits(max_bin_len=ENVELOPE_MAX_BYTES, max_str_len=0, max_array_len=ROSTER_MAX_ENTRIES,
                                   max_map_len=0, max_depth=2, max_containers=3)
    obj = encoding.unpackb(body, ROSTER_MAX_BYTES, limits)
    if not (isinstance(obj, list) and len(obj) == 2 and all(isinstance(part, list) for part in obj)):
        raise DecodeError("a roster delta is [gone, new]")
    gone, new = obj
    if not all(isinstance(g, bytes) and len(g) == CONTENT_ID_BYTES for g in gone) or not all(isinstance(e, bytes) for e in new):
        raise DecodeError("a roster delta's gone are 32-byte IDs, its new are envelopes")
    entries = dict(held)
    for g in gone:
        if entries.pop(g, None) is None:
            raise DecodeError("a roster delta removes an entry that was not held")
    for e in new:
        eid = bytes(content_id(e))
        if eid in entries:
            raise DecodeError("a roster delta adds an entry already held")
        entries[eid] = e
    if len(entries) > ROSTER_MAX_ENTRIES:
        raise DecodeError(f"a roster of {len(entries)} entries, over {ROSTER_MAX_ENTRIES}")
    data = pack_envelopes(sorted(entries.values()))
    if len(data) > ROSTER_MAX_BYTES:
        raise TooLarge(f"a roster of {len(data)} bytes, over {ROSTER_MAX_BYTES}")
    if content_id(data) != roster_id:
        raise DecodeError("the roster after the delta does not hash to the roster ID the hub signed")
    return entries
