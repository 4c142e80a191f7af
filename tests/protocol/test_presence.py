"""Presence frames and rosters (``protocol/presence.py``): bounded before anything is built, and a
roster counts only if its bytes — whole, or a held roster with a delta applied — hash to the ID
its hub signed."""

from __future__ import annotations

import pytest

from protocol import encoding
from protocol.content import content_id
from protocol.envelope import seal
from protocol.errors import DecodeError
from protocol.identity import NodeKey
from protocol.messages import NodeRecord
from protocol.presence import (
    BEAT,
    HUB_KINDS,
    RECORD,
    VIEW,
    VIEW_MAX_BYTES,
    VIEW_MAX_ENTRIES,
    WORKER_FRAME_MAX_BYTES,
    WORKER_KINDS,
    fit_view,
    frame,
    frame_length,
    pack_envelopes,
    pack_roster,
    pack_roster_answer,
    pack_roster_delta,
    parse_roster_request,
    read_roster_answer,
    roster_request,
    split_frame,
    unpack_envelopes,
    unpack_roster,
)

RUN = b"\x07" * 32


def record(key: NodeKey, seq: int = 1) -> bytes:
    return seal(key, RUN, NodeRecord(peer_id=key.peer_id, role="worker", seq=seq, version="t"))


def test_frames_round_trip_and_are_bounded_by_direction() -> None:
    env = record(NodeKey.generate())
    data = frame(RECORD, env)
    n = frame_length(data[:4], max_bytes=WORKER_FRAME_MAX_BYTES, kinds=WORKER_KINDS)
    assert n == len(data) - 4 and split_frame(data[4:], kinds=WORKER_KINDS) == (RECORD, env)
    assert split_frame(frame(BEAT)[4:], kinds=WORKER_KINDS) == (BEAT, b"")
    with pytest.raises(DecodeError):  # a 1 MiB frame where a worker may send 8 KiB: refused from its length alone
        frame_length((1 << 20).to_bytes(4, "big"), max_bytes=WORKER_FRAME_MAX_BYTES, kinds=WORKER_KINDS)
    with pytest.raises(DecodeError):
        frame_length(b"\0\0\0\0", max_bytes=WORKER_FRAME_MAX_BYTES, kinds=WORKER_KINDS)
    with pytest.raises(DecodeError):  # a view is hub → worker only
        split_frame(frame(VIEW, b"\x90")[4:], kinds=WORKER_KINDS)
    with pytest.raises(DecodeError):  # a record is worker → hub only
        split_frame(frame(RECORD, env)[4:], kinds=HUB_KINDS)
    with pytest.raises(DecodeError):
        split_frame(bytes([BEAT]) + b"x", kinds=WORKER_KINDS)


def test_a_roster_is_its_content_id() -> None:
    envs = [record(NodeKey.generate()) for _ in range(5)]
    roster_id, data = pack_roster(envs)
    assert pack_roster(list(reversed(envs))) == (roster_id, data)  # equal sets, equal IDs
    assert sorted(unpack_roster(roster_id, data)) == sorted(envs)
    with pytest.raises(DecodeError, match="hash"):  # one byte changed: not the roster its hub signed
        unpack_roster(roster_id, data[:-1] + bytes([data[-1] ^ 1]))
    _, other = pack_roster(envs[:4])
    with pytest.raises(DecodeError, match="hash"):  # a real roster, but not the one named
        unpack_roster(roster_id, other)
    unordered = encoding.packb(sorted(envs, reverse=True))
    with pytest.raises(DecodeError, match="order"):
        unpack_roster(content_id(unordered), unordered)


def by_id(envs: list[bytes]) -> dict[bytes, bytes]:
    return {bytes(content_id(e)): e for e in envs}


def test_a_roster_delta_carries_only_what_changed_and_counts_only_if_the_result_hashes_to_the_id() -> None:
    keys = [NodeKey.generate() for _ in range(40)]
    old_envs = [record(k) for k in keys]
    new_envs = [record(keys[0], seq=2), *old_envs[1:39], record(NodeKey.generate())]  # one changed, one left, one joined
    old_id, old_data = pack_roster(old_envs)
    new_id, new_data = pack_roster(new_envs)
    delta = pack_roster_delta(old_envs, new_envs)
    assert len(delta) < len(new_data) // 10  # two records and two IDs, not forty records
    assert read_roster_answer(new_id, delta, by_id(old_envs)) == by_id(new_envs)
    assert read_roster_answer(new_id, pack_roster_answer(new_data)) == by_id(new_envs)  # the whole roster needs nothing held
    with pytest.raises(DecodeError, match="hash"):  # applied to a roster other than the one it was made from
        read_roster_answer(new_id, delta, by_id([*old_envs, record(NodeKey.generate())]))
    with pytest.raises(DecodeError, match="no roster was held"):
        read_roster_answer(new_id, delta)
    wrong = pack_roster_delta(old_envs, [*new_envs[:-1], record(NodeKey.generate())])  # a real delta to another roster
    with pytest.raises(DecodeError, match="hash"):
        read_roster_answer(new_id, wrong, by_id(old_envs))
    not_held = bytes([0x01]) + encoding.packb([[b"\1" * 32], []])
    with pytest.raises(DecodeError, match="not held"):
        read_roster_answer(old_id, not_held, by_id(old_envs))
    twice = bytes([0x01]) + encoding.packb([[], [old_envs[0]]])
    with pytest.raises(DecodeError, match="already held"):
        read_roster_answer(old_id, twice, by_id(old_envs))
    with pytest.raises(DecodeError):  # gone IDs are 32 bytes
        read_roster_answer(old_id, bytes([0x01]) + encoding.packb([[b"x"], []]), by_id(old_envs))
    with pytest.raises(DecodeError, match="form"):
        read_roster_answer(old_id, bytes([0x07]) + old_data)
    assert old_id == content_id(old_data)


def test_a_roster_request_names_the_roster_wanted_and_the_one_held() -> None:
    wanted, held = b"\1" * 32, b"\2" * 32
    assert parse_roster_request(roster_request(wanted, held)) == (wanted, held)
    assert parse_roster_request(roster_request(wanted)) == (wanted, b"")
    with pytest.raises(DecodeError):
        parse_roster_request(wanted)  # the 32-byte request of before: refused, not misread
    with pytest.raises(ValueError):
        roster_request(b"short")


def test_envelope_lists_are_bounded_before_they_are_built() -> None:
    env = record(NodeKey.generate())
    with pytest.raises(DecodeError):
        unpack_envelopes(encoding.packb([env] * 3), max_entries=2, max_bytes=1 << 20)
    with pytest.raises(DecodeError):  # the same envelope twice
        unpack_envelopes(encoding.packb([env, env]), max_entries=8, max_bytes=1 << 20)
    with pytest.raises(DecodeError):  # not bins
        unpack_envelopes(encoding.packb(["x"]), max_entries=8, max_bytes=1 << 20)
    with pytest.raises(DecodeError):  # a bin over a record's limit
        unpack_envelopes(encoding.packb([b"\0" * 9000]), max_entries=8, max_bytes=1 << 20)


def test_only_a_hub_record_carries_a_roster() -> None:
    key = NodeKey.generate()
    NodeRecord(peer_id=key.peer_id, role="relay", seq=1, version="t", workers=3, roster=b"\1" * 32)
    with pytest.raises(ValueError, match="no roster"):
        NodeRecord(peer_id=key.peer_id, role="worker", seq=1, version="t", workers=3, roster=b"\1" * 32)
    with pytest.raises(ValueError):
        NodeRecord(peer_id=key.peer_id, role="relay", seq=1, version="t", workers=3, roster=b"")
    with pytest.raises(ValueError):
        NodeRecord(peer_id=key.peer_id, role="relay", seq=1, version="t", workers=0, roster=b"\1" * 16)


def test_fit_view_cuts_where_the_frame_ends() -> None:
    """Self-signed hub records can outgrow one frame; the view keeps the first ones that fit."""
    big = [bytes([i % 256]) * 5000 + i.to_bytes(2, "big") for i in range(300)]
    kept = fit_view(big)
    assert kept == big[: len(kept)] and 0 < len(kept) < len(big)
    assert len(pack_envelopes(kept)) <= VIEW_MAX_BYTES < len(pack_envelopes(big[: len(kept) + 1]))
    small = [i.to_bytes(4, "big") for i in range(VIEW_MAX_ENTRIES + 10)]
    assert fit_view(small) == small[:VIEW_MAX_ENTRIES]
