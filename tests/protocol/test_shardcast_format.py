"""Shardcast format: the piece rule, manifest building, piece and manifest verification."""

from __future__ import annotations

import hashlib
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.envelope import seal
from protocol.errors import ProtocolError, SchemaError, SignatureError, WrongRunError
from protocol.identity import NodeKey
from protocol.messages import Manifest, ManifestFile
from protocol.runspec import RunInfo, RunSpec
from protocol.shardcast import (
    MIN_PIECE_SIZE_BYTES,
    build_manifest,
    check_manifest,
    checkpoint_hash,
    iter_pieces,
    open_manifest,
    piece_count,
    piece_spans,
    total_size_bytes,
)

P = MIN_PIECE_SIZE_BYTES


class RecordingSink:
    def __init__(self) -> None:
        self.pieces: list[tuple[bytes, bytes]] = []
        self._buf = bytearray()

    def write(self, chunk: bytes) -> None:
        self._buf += chunk

    def end_piece(self, piece_id: bytes, size_bytes: int) -> None:
        assert len(self._buf) == size_bytes
        self.pieces.append((piece_id, bytes(self._buf)))
        self._buf.clear()


@pytest.fixture(scope="module")
def run():
    key = NodeKey.generate()
    spec = RunSpec(run=RunInfo(coordinator=key.peer_id))
    return key, spec


def test_piece_rule_edges():
    assert piece_count(0, P) == 0
    assert piece_count(1, P) == 1
    assert piece_count(P, P) == 1
    assert piece_count(P + 1, P) == 2
    assert list(piece_spans(2 * P + 5, P)) == [(0, P), (P, P), (2 * P, 5)]
    assert list(piece_spans(0, P)) == []


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 10**9), piece=st.integers(1, 10**7))
def test_piece_spans_tile_the_file(size, piece):
    spans = list(piece_spans(size, piece)) if size // piece < 2000 else []
    if spans:
        assert spans[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
        assert spans[-1][0] + spans[-1][1] == size
        assert all(0 < n <= piece for _, n in spans)
        assert len(spans) == piece_count(size, piece)


def test_build_manifest_streams_pieces_and_hashes():
    a = bytes(range(256)) * (P * 2 // 256) + b"tail"  # 2 full pieces + 4 bytes
    b = b""  # empty file: no pieces
    c = b"x" * P  # exactly one piece
    sink = RecordingSink()
    m = build_manifest(7, [("a.safetensors", io.BytesIO(a)), ("b.json", io.BytesIO(b)), ("c.bin2", io.BytesIO(c))], piece_size_bytes=P, meta={"format": "safetensors"}, sink=sink)
    assert m.step == 7 and m.piece_size_bytes == P
    assert [(f.name, f.size_bytes, len(f.pieces)) for f in m.files] == [("a.safetensors", len(a), 3), ("b.json", 0, 0), ("c.bin2", P, 1)]
    assert m.checkpoint_hash == hashlib.sha256(a + b + c).digest()
    assert checkpoint_hash([io.BytesIO(a), io.BytesIO(b), io.BytesIO(c)]) == m.checkpoint_hash
    refs = list(iter_pieces(m))
    assert [r.size_bytes for r in refs] == [P, P, 4, P]
    assert [(pid, data) for pid, data in sink.pieces] == [(r.piece_id, (a + c)[i * P : i * P + r.size_bytes] if i < 3 else c) for i, r in enumerate(refs)]
    assert total_size_bytes(m) == len(a) + len(c)
    for r, (_, data) in zip(refs, sink.pieces):
        assert len(data) == r.size_bytes and hashlib.sha256(data).digest() == r.piece_id


def test_build_manifest_bounds():
    with pytest.raises(ValueError):
        build_manifest(0, [("f", io.BytesIO(b"x"))], piece_size_bytes=1024)
    with pytest.raises(SchemaError):
        build_manifest(0, [("bad/name", io.BytesIO(b"x"))], piece_size_bytes=P)
    with pytest.raises(SchemaError):
        build_manifest(0, [("f", io.BytesIO(b"x")), ("f", io.BytesIO(b"y"))], piece_size_bytes=P)


@pytest.mark.parametrize("name", [".", "..", ".hidden"])
def test_dot_names_rejected(name):
    m = Manifest(step=0, piece_size_bytes=P, files=[ManifestFile(name=name, size_bytes=0, pieces=[])], checkpoint_hash=b"\0" * 32)
    with pytest.raises(SchemaError):
        check_manifest(m)


def test_piece_count_must_follow_rule(run):
    key, spec = run
    m = Manifest(step=1, piece_size_bytes=P, files=[ManifestFile(name="f", size_bytes=P + 1, pieces=[b"\1" * 32])], checkpoint_hash=b"\0" * 32)
    raw = seal(key, spec.run_id, m)
    with pytest.raises(SchemaError, match="needs 2 pieces"):
        open_manifest(raw, run_id=spec.run_id, authorities=spec.authorities)


def test_open_manifest_requires_coordinator_and_run(run):
    key, spec = run
    m = build_manifest(3, [("f", io.BytesIO(b"z" * 1000))], piece_size_bytes=P)
    env = open_manifest(seal(key, spec.run_id, m), run_id=spec.run_id, authorities=spec.authorities)
    assert env.body == m
    with pytest.raises(SignatureError, match="coordinator"):
        open_manifest(seal(NodeKey.generate(), spec.run_id, m), run_id=spec.run_id, authorities=spec.authorities)
    with pytest.raises(WrongRunError):
        open_manifest(seal(key, b"\7" * 32, m), run_id=spec.run_id, authorities=spec.authorities)
    raw = bytearray(seal(key, spec.run_id, m))
    raw[-70] ^= 1  # inside the signed content or the signature
    with pytest.raises(ProtocolError):
        open_manifest(bytes(raw), run_id=spec.run_id, authorities=spec.authorities)
