"""Shardcast step deltas: the byte format, its encoder and a streaming applier (pure).

Between consecutive RL policy steps almost no published bf16 weight changes bits (at RL learning
rates the fp32 master moves far less than one bf16 ulp; PULSE, arXiv 2602.03839 §3 measured
> 99 % of bf16 weights unchanged). A **delta** lists, per tensor, the 16-bit words that changed
and by how much, compressed with zstandard; ``docs/shardcast.md`` §9 gives the layout byte for
byte. The delta is cut into content-addressed pieces by the ordinary piece rule and described by
a coordinator-signed :class:`protocol.messages.DeltaManifest` naming the base and target *full*
manifests. The applier checks every reconstructed piece against the target full manifest as it
writes, so a delta can change how many bytes a node moves, never what it accepts.

Pure like :mod:`protocol.shardcast`: callers pass streams (``BinaryIO``) and openers in; nothing
here opens a path. Memory is flat in checkpoint size: files are processed in windows of
:data:`WINDOW_WORDS` words and changes in blocks of :data:`BLOCK_CHANGES`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import zstandard

from protocol.envelope import Authorities, Envelope, open_envelope
from protocol.errors import ProtocolError, SchemaError
from protocol.messages import DeltaManifest, Manifest, ManifestFile
from protocol.shardcast import PieceId, PieceRef, piece_count, piece_spans

MAGIC = b"ISD1"
"""First 4 bytes of a decompressed delta body (format version 1)."""

KIND_SAME = 0
"""File identical to the base file of the same name: no payload."""
KIND_LITERAL = 1
"""File sent whole: ``size_bytes`` raw bytes follow."""
KIND_WORDS = 2
"""File of the same size as the base file of the same name, patched as 16-bit little-endian words."""

BLOCK_CHANGES = 1 << 16
"""Most changes in one block of a section (bounds the decoder's memory: 6 bytes each)."""
WINDOW_WORDS = 1 << 20
"""Words read, patched and written at once (2 MiB)."""
MAX_SECTION_WORDS = (1 << 32) - 1
"""Largest section, in words (gaps are uint32)."""
MAX_SECTIONS = 1 << 20
"""Most sections in one file."""
ZSTD_WINDOW_LOG = 23
"""zstd window of the encoder (8 MiB); the decoder refuses frames that need more."""
DELTA_FILE_NAME = "delta"
"""Name used for the delta's single virtual file in :class:`PieceRef` values."""
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_FILE_HEAD = struct.Struct("<BQ")  # kind, size_bytes (after the name)


class DeltaFormatError(ProtocolError):
    """The delta bytes do not follow the format (``reason`` says where)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed delta: {reason}")
        self.reason = reason


class DeltaMismatchError(ProtocolError):
    """The reconstructed bytes do not hash to the target full manifest's piece (or the base is unusable).

    Attributes:
        file_name: the file of the target checkpoint.
        piece_index: index of the piece within that file (``-1``: not about one piece).
    """

    def __init__(self, file_name: str, piece_index: int, message: str) -> None:
        super().__init__(f"delta result refused: {file_name} piece {piece_index}: {message}")
        self.file_name = file_name
        self.piece_index = piece_index


@dataclass
class DeltaStats:
    """What one delta holds.

    Attributes:
        raw_size_bytes: length of the decompressed body, bytes.
        changed_elements: 16-bit words whose bits changed (``KIND_WORDS`` files).
        total_elements: 16-bit words of the files sent as ``KIND_SAME`` or ``KIND_WORDS``.
        files_same, files_words, files_literal: files per kind.
        literal_bytes: bytes of the files sent whole.
    """

    raw_size_bytes: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    files_same: int = 0
    files_words: int = 0
    files_literal: int = 0
    literal_bytes: int = 0


# --- delta manifest ----------------------------------------------------------------------------


def check_delta_manifest(dm: DeltaManifest) -> None:
    """Rules a schema-valid delta manifest must also follow.

    Raises:
        SchemaError: the piece count does not follow the piece rule, or ``base_step ≥ step``.
    """
    if dm.base_step >= dm.step:
        raise SchemaError(f"delta base step {dm.base_step} is not before its step {dm.step}", "body.base_step")
    want = piece_count(dm.size_bytes, dm.piece_size_bytes)
    if len(dm.pieces) != want:
        raise SchemaError(f"delta of {dm.size_bytes} bytes needs {want} pieces, lists {len(dm.pieces)}", "body.pieces")


def open_delta_manifest(data: bytes, *, run_id: bytes, authorities: Authorities) -> Envelope[DeltaManifest]:
    """Decode and verify delta manifest bytes received from anyone.

    Raises:
        DecodeError, SchemaError: malformed bytes, wrong type, or a broken piece rule.
        WrongRunError: another run's delta.
        SignatureError: not signed by the run's coordinator.
    """
    env: Envelope[DeltaManifest] = open_envelope(data, run_id=run_id, authorities=authorities, expect=DeltaManifest)
    check_delta_manifest(env.body)
    return env


def check_delta_links(dm: DeltaManifest, base: Envelope[Manifest], target: Envelope[Manifest]) -> None:
    """Check that ``dm`` leads from exactly ``base`` to exactly ``target`` (by manifest ID and step).

    Raises:
        SchemaError: naming the link that does not hold.
    """
    if dm.base_step != base.body.step or dm.base_manifest_id != hashlib.sha256(base.raw).digest():
        raise SchemaError(f"delta to step {dm.step} is not based on the held manifest of step {base.body.step}", "body.base_manifest_id")
    if dm.step != target.body.step or dm.target_manifest_id != hashlib.sha256(target.raw).digest():
        raise SchemaError(f"delta to step {dm.step} does not lead to the signed manifest of step {target.body.step}", "body.target_manifest_id")


def iter_delta_pieces(dm: DeltaManifest) -> Iterator[PieceRef]:
    """The pieces of the delta bytes in order (one virtual file named :data:`DELTA_FILE_NAME`)."""
    for i, ((offset, length), pid) in enumerate(zip(piece_spans(dm.size_bytes, dm.piece_size_bytes), dm.pieces, strict=True)):
        yield PieceRef(0, DELTA_FILE_NAME, i, offset, length, PieceId(pid))


# --- encoder -----------------------------------------------------------------------------------


def _safetensors_bounds(stream: BinaryIO, size: int) -> list[int]:
    """Byte offsets where the header and each tensor's data start/end (empty if not safetensors)."""
    head = stream.read(8)
    if len(head) < 8:
        return []
    n = _U64.unpack(head)[0]
    if n > MAX_SAFETENSORS_HEADER_BYTES or 8 + n > size:
        return []
    try:
        header = json.loads(stream.read(n))
        bounds = [0, 8 + n]
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            b, e = entry["data_offsets"]
            bounds += [8 + n + int(b), 8 + n + int(e)]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    return bounds


def _sections(bounds: list[int], size: int) -> list[int]:
    """Section lengths in words tiling a file of ``size`` bytes (``size`` even), cut at even bounds."""
    cuts = sorted({b // 2 for b in bounds if b % 2 == 0 and 0 < b < size} | {0, size // 2})
    out: list[int] = []
    for a, b in itertools.pairwise(cuts):
        while b - a > MAX_SECTION_WORDS:
            out.append(MAX_SECTION_WORDS)
            a += MAX_SECTION_WORDS
        if b > a:
            out.append(b - a)
    return out


def zigzag16(diff: np.ndarray) -> np.ndarray:
    """16-bit word differences (``[n] uint16``, mod 2^16) as zigzag codes: the difference read as a
    signed int16 *s* becomes ``2s`` (s ≥ 0) or ``−2s − 1`` (s < 0), so ±1 ulp is 2 or 1 and the
    high byte plane is all zeros. Returns ``[n] <u2``; 0 ↔ 0."""
    s = diff.astype("<u2").view(np.int16).astype(np.int32)
    return ((s << 1) ^ (s >> 31)).astype("<u2")


def unzigzag16(code: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag16`: ``[n] <u2`` codes → ``[n] uint16`` differences (mod 2^16)."""
    z = code.astype(np.int32)
    return ((z >> 1) ^ -(z & 1)).astype(np.int16).view(np.uint16)


def _planes(values: np.ndarray, width: int) -> bytes:
    """Little-endian values as ``width`` byte planes (all low bytes first): zstd packs them well."""
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, width).T).tobytes()


def _unplanes(raw: bytes, count: int, dtype: str) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    return np.frombuffer(raw, np.uint8).reshape(width, count).T.copy().view(dtype).reshape(count)


class _Counting:
    """Writes to a zstd stream writer, counting raw bytes."""

    def __init__(self, w: BinaryIO) -> None:
        self.w = w
        self.n = 0

    def write(self, b: bytes) -> None:
        self.w.write(b)
        self.n += len(b)


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = stream.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _encode_words(base: BinaryIO, target: BinaryIO, sections: list[int], out: _Counting, stats: DeltaStats) -> None:
    out.write(_U32.pack(len(sections)))
    for n_words in sections:
        out.write(_U64.pack(n_words))
        pos: list[np.ndarray] = []
        diff: list[np.ndarray] = []
        pending = 0
        prev = -1

        def flush(limit: int) -> None:
            nonlocal pos, diff, pending, prev
            while pending >= limit and pending > 0:
                p_all, d_all = np.concatenate(pos), np.concatenate(diff)
                m = min(BLOCK_CHANGES, pending)
                p, d = p_all[:m], d_all[:m]
                gaps = np.diff(p, prepend=prev).astype("<u4")  # ≥ 1: positions strictly increase
                out.write(_U32.pack(m) + _planes(gaps, 4) + _planes(zigzag16(d), 2))
                prev = int(p[-1])
                pos, diff, pending = [p_all[m:]], [d_all[m:]], pending - m

        done = 0
        while done < n_words:
            w = min(WINDOW_WORDS, n_words - done)
            a = np.frombuffer(_read_exact(base, 2 * w), "<u2")
            b = np.frombuffer(_read_exact(target, 2 * w), "<u2")
            if len(a) != w or len(b) != w:
                raise ValueError("a base or target file is shorter than its manifest says")
            idx = np.flatnonzero(a != b)
            if len(idx):
                pos.append(idx.astype(np.int64) + done)
                diff.append((b[idx] - a[idx]).astype("<u2"))  # wraps mod 2^16
                pending += len(idx)
                stats.changed_elements += len(idx)
                flush(BLOCK_CHANGES)
            done += w
        flush(1)
        out.write(_U32.pack(0))
        stats.total_elements += n_words


def encode_delta(
    base: Manifest,
    target: Manifest,
    open_base: Callable[[str], BinaryIO],
    open_target: Callable[[str], BinaryIO],
    out: BinaryIO,
    *,
    level: int = 3,
) -> DeltaStats:
    """Write the compressed delta from checkpoint ``base`` to ``target`` into ``out`` (streaming).

    Per target file: ``KIND_SAME`` if the base has a file of the same name with the same pieces;
    ``KIND_WORDS`` if it has one of the same, even size (sections cut at the safetensors header and
    tensor boundaries, so changes are indexed per tensor); ``KIND_LITERAL`` otherwise.

    Args:
        base, target: the full manifests (the files' names, sizes and piece IDs).
        open_base, open_target: open a file of that checkpoint by name for sequential reading;
            the caller's bytes must be the manifests' (the result is checked on apply anyway).
        out: receives the zstd frame (the bytes that are cut into delta pieces).
        level: zstd compression level (window fixed at 2^:data:`ZSTD_WINDOW_LOG` bytes).

    Returns:
        :class:`DeltaStats` (``raw_size_bytes`` goes into the delta manifest).

    Raises:
        OSError: from the streams. ValueError: a file shorter than its manifest says.
    """
    stats = DeltaStats()
    base_files = {f.name: f for f in base.files}
    params = zstandard.ZstdCompressionParameters.from_level(level, window_log=ZSTD_WINDOW_LOG)
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(out, closefd=False) as zw:
        w = _Counting(zw)
        w.write(MAGIC + _U32.pack(len(target.files)))
        for tf in target.files:
            bf = base_files.get(tf.name)
            name = tf.name.encode()
            if bf is not None and bf.size_bytes == tf.size_bytes and bf.pieces == tf.pieces and base.piece_size_bytes == target.piece_size_bytes:
                w.write(bytes([len(name)]) + name + _FILE_HEAD.pack(KIND_SAME, tf.size_bytes))
                stats.files_same += 1
                stats.total_elements += tf.size_bytes // 2
            elif bf is not None and bf.size_bytes == tf.size_bytes and tf.size_bytes % 2 == 0:
                with open_target(tf.name) as s:
                    bounds = _safetensors_bounds(s, tf.size_bytes) if tf.name.endswith(".safetensors") else []
                w.write(bytes([len(name)]) + name + _FILE_HEAD.pack(KIND_WORDS, tf.size_bytes))
                with open_base(tf.name) as bs, open_target(tf.name) as ts:
                    _encode_words(bs, ts, _sections(bounds, tf.size_bytes), w, stats)
                stats.files_words += 1
            else:
                w.write(bytes([len(name)]) + name + _FILE_HEAD.pack(KIND_LITERAL, tf.size_bytes))
                with open_target(tf.name) as ts:
                    left = tf.size_bytes
                    while left:
                        chunk = ts.read(min(1 << 20, left))
                        if not chunk:
                            raise ValueError(f"{tf.name} is shorter than its manifest says")
                        w.write(chunk)
                        left -= len(chunk)
                stats.files_literal += 1
                stats.literal_bytes += tf.size_bytes
        stats.raw_size_bytes = w.n
    return stats


# --- applier -----------------------------------------------------------------------------------


class _Body:
    """The decompressed delta body, read with a hard bound on its total length."""

    def __init__(self, compressed: BinaryIO, raw_size_bytes: int) -> None:
        dctx = zstandard.ZstdDecompressor(max_window_size=1 << ZSTD_WINDOW_LOG)
        self._r = dctx.stream_reader(compressed, read_size=1 << 20, read_across_frames=False)
        self.limit = raw_size_bytes
        self.consumed = 0

    def read(self, n: int, what: str) -> bytes:
        if self.consumed + n > self.limit:
            raise DeltaFormatError(f"{what} runs past the declared {self.limit}-byte body")
        try:
            data = _read_exact(self._r, n)
        except zstandard.ZstdError as e:
            raise DeltaFormatError(f"zstd: {e}") from None
        if len(data) != n:
            raise DeltaFormatError(f"body ends inside {what}")
        self.consumed += n
        return data

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self.read(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack(self.read(8, what))[0])

    def finish(self) -> None:
        if self.consumed != self.limit:
            raise DeltaFormatError(f"body is {self.consumed} bytes, the manifest says {self.limit}")
        try:
            extra = self._r.read(1)
        except zstandard.ZstdError as e:
            raise DeltaFormatError(f"zstd: {e}") from None
        if extra:
            raise DeltaFormatError("bytes after the declared body")


class _PieceCheck:
    """Writes one target file, checking each piece against the full manifest as it completes."""

    def __init__(self, out: BinaryIO, f: ManifestFile, piece_size_bytes: int) -> None:
        self._out = out
        self._f = f
        self._p = piece_size_bytes
        self._h = hashlib.sha256()
        self._in_piece = 0
        self._index = 0
        self.written = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if self.written + len(view) > self._f.size_bytes:
            raise DeltaMismatchError(self._f.name, self._index, "more bytes than the file has")
        self._out.write(view)
        while view:
            take = min(len(view), self._p - self._in_piece, self._f.size_bytes - self.written)
            self._h.update(view[:take])
            view = view[take:]
            self._in_piece += take
            self.written += take
            if self._in_piece == self._p or self.written == self._f.size_bytes:
                self._end_piece()

    def _end_piece(self) -> None:
        if self._h.digest() != self._f.pieces[self._index]:
            raise DeltaMismatchError(self._f.name, self._index, "does not hash to the full manifest's piece")
        self._index += 1
        self._h = hashlib.sha256()
        self._in_piece = 0

    def finish(self) -> None:
        if self.written != self._f.size_bytes or self._index != len(self._f.pieces):
            raise DeltaMismatchError(self._f.name, self._index, f"{self.written} of {self._f.size_bytes} bytes reconstructed")


def _copy_base(base: BinaryIO, n: int, sink: _PieceCheck, name: str) -> None:
    while n:
        chunk = base.read(min(2 * WINDOW_WORDS, n))
        if not chunk:
            raise DeltaMismatchError(name, -1, "the held base file is shorter than its manifest says")
        sink.write(chunk)
        n -= len(chunk)


def _apply_words(body: _Body, base: BinaryIO, sink: _PieceCheck, size_bytes: int, name: str) -> int:
    n_sections = body.u32("section count")
    if n_sections > MAX_SECTIONS:
        raise DeltaFormatError(f"{name}: {n_sections} sections (at most {MAX_SECTIONS})")
    total_words = size_bytes // 2
    start = 0
    changed = 0
    for _ in range(n_sections):
        n_words = body.u64("section length")
        if n_words == 0 or n_words > MAX_SECTION_WORDS or start + n_words > total_words:
            raise DeltaFormatError(f"{name}: section of {n_words} words at word {start} does not fit {total_words} words")
        cursor, prev = 0, -1
        while True:
            m = body.u32("block size")
            if m == 0:
                break
            if m > BLOCK_CHANGES:
                raise DeltaFormatError(f"{name}: block of {m} changes (at most {BLOCK_CHANGES})")
            gaps = _unplanes(body.read(4 * m, "gaps"), m, "<u4")
            diffs = unzigzag16(_unplanes(body.read(2 * m, "values"), m, "<u2"))
            if not gaps.all() or not diffs.all():
                raise DeltaFormatError(f"{name}: zero gap or zero change in a block")
            pos = prev + np.cumsum(gaps, dtype=np.int64)
            if pos[-1] >= n_words:
                raise DeltaFormatError(f"{name}: change at word {int(pos[-1])} beyond its {n_words}-word section")
            cursor = _patch_copy(base, sink, cursor, int(pos[-1]) + 1, pos, diffs, name)
            prev = int(pos[-1])
            changed += m
        _patch_copy(base, sink, cursor, n_words, None, None, name)
        start += n_words
    if start != total_words:
        raise DeltaFormatError(f"{name}: sections cover {start} of {total_words} words")
    return changed


def _patch_copy(
    base: BinaryIO, sink: _PieceCheck, cursor: int, upto: int, pos: np.ndarray | None, diffs: np.ndarray | None, name: str
) -> int:
    """Copy base words ``[cursor, upto)`` of a section to ``sink``, adding ``diffs`` at ``pos``."""
    while cursor < upto:
        w = min(WINDOW_WORDS, upto - cursor)
        raw = _read_exact(base, 2 * w)
        if len(raw) != 2 * w:
            raise DeltaMismatchError(name, -1, "the held base file is shorter than its manifest says")
        lo, hi = (0, 0) if pos is None else np.searchsorted(pos, [cursor, cursor + w])
        if hi == lo or diffs is None:
            sink.write(raw)  # no change in this window
        else:
            assert pos is not None  # lo < hi needs positions
            buf = np.frombuffer(raw, "<u2").copy()
            buf[pos[lo:hi] - cursor] += diffs[lo:hi]  # uint16 arithmetic wraps mod 2^16, as encoded
            sink.write(buf.data.cast("B"))
        cursor += w
    return cursor


def apply_delta(
    compressed: BinaryIO,
    *,
    delta: DeltaManifest,
    base: Manifest,
    target: Manifest,
    open_base: Callable[[str], BinaryIO],
    open_out: Callable[[ManifestFile], BinaryIO],
) -> DeltaStats:
    """Rebuild the ``target`` checkpoint from the held ``base`` and a delta, streaming.

    Every piece written is hashed and compared with the target *full* manifest the moment it is
    complete; the first mismatch stops the apply. The caller writes into temporary files and
    renames them into place only after this returns (``node.shardcast.delta``).

    Args:
        compressed: the delta bytes (verified pieces, in order), read sequentially.
        delta: its verified manifest (``raw_size_bytes`` bounds the decompressed body).
        base, target: the full manifests of the held and the wanted step.
        open_base: opens a held base file by name for sequential reading.
        open_out: opens (creates) the output stream for a target file; the caller closes it.

    Returns:
        :class:`DeltaStats` of the applied delta.

    Raises:
        DeltaFormatError: the delta does not follow the format or its bounds.
        DeltaMismatchError: a reconstructed piece does not hash to the target manifest's piece,
            or a held base file is missing or short.
    """
    stats = DeltaStats(raw_size_bytes=delta.raw_size_bytes)
    body = _Body(compressed, delta.raw_size_bytes)
    if body.read(4, "magic") != MAGIC:
        raise DeltaFormatError("bad magic (not a version-1 delta body)")
    n_files = body.u32("file count")
    if n_files != len(target.files):
        raise DeltaFormatError(f"{n_files} files, the target manifest has {len(target.files)}")
    base_files = {f.name: f for f in base.files}
    for tf in target.files:
        name_len = body.read(1, "name length")[0]
        name = body.read(name_len, "file name").decode("utf-8", errors="replace")
        kind, size = _FILE_HEAD.unpack(body.read(_FILE_HEAD.size, "file header"))
        if name != tf.name or size != tf.size_bytes:
            raise DeltaFormatError(f"file {name!r} of {size} bytes where the target manifest has {tf.name!r} of {tf.size_bytes}")
        bf = base_files.get(tf.name)
        if kind == KIND_SAME and (bf is None or bf.size_bytes != size):
            raise DeltaFormatError(f"{name}: kind {kind} needs a base file of the same size")
        if kind == KIND_WORDS and (bf is None or bf.size_bytes != size or size % 2):
            raise DeltaFormatError(f"{name}: kind {kind} needs a base file of the same, even size")
        sink = _PieceCheck(open_out(tf), tf, target.piece_size_bytes)
        if kind == KIND_SAME:
            with open_base(tf.name) as bs:
                _copy_base(bs, size, sink, name)
            stats.files_same += 1
            stats.total_elements += size // 2
        elif kind == KIND_WORDS:
            with open_base(tf.name) as bs:
                stats.changed_elements += _apply_words(body, bs, sink, size, name)
            stats.files_words += 1
            stats.total_elements += size // 2
        elif kind == KIND_LITERAL:
            left = size
            while left:
                n = min(2 * WINDOW_WORDS, left)
                sink.write(body.read(n, "literal file"))
                left -= n
            stats.files_literal += 1
            stats.literal_bytes += size
        else:
            raise DeltaFormatError(f"{name}: unknown kind {kind}")
        sink.finish()
    body.finish()
    return stats

