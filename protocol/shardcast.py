"""Shardcast format: how a checkpoint is cut into pieces and described by a signed manifest.

Pure rules shared by the publisher, relays and clients (``docs/shardcast.md``); no sockets and
no file paths: callers pass byte streams in and receive manifests, piece descriptions and
verdicts out.

* **Piece rule.** Each file of a checkpoint is cut independently into pieces of exactly
  ``piece_size_bytes`` bytes, the last piece of a file holding the remainder (an empty file has
  no pieces). Piece *i* of a file covers bytes ``[i·P, min((i+1)·P, size))``. A piece's ID is
  the SHA-256 of its bytes (:mod:`protocol.content`), so anyone can verify a piece alone.
* **Checkpoint hash.** SHA-256 of all files' bytes concatenated in manifest order: a final
  end-to-end check after assembly.
* **Manifest.** :class:`protocol.messages.Manifest` in a ``manifest/1`` envelope signed by the
  run's coordinator key; :func:`open_manifest` is the only way bytes off the network become a
  manifest, and it also enforces the piece rule (counts per file) and safe file names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, NewType, Protocol

from pydantic import ValidationError

from protocol.content import ContentId
from protocol.envelope import Authorities, Envelope, open_envelope
from protocol.errors import SchemaError
from protocol.messages import DEFAULT_PIECE_SIZE_BYTES, MAX_PIECE_SIZE_BYTES, MIN_PIECE_SIZE_BYTES, Manifest, ManifestFile

PieceId = NewType("PieceId", bytes)
"""32-byte SHA-256 content ID of one piece."""

ROUTE_PREFIX = "/shardcast/1"
"""Versioned prefix of every Shardcast HTTP route (``docs/shardcast.md``)."""

READ_CHUNK_BYTES = 1 << 20
"""Streams are read in chunks of at most this many bytes, so memory stays flat."""
MANIFEST_FETCH_LIMIT_BYTES = 4 << 20
"""Largest manifest envelope a fetcher reads by default, bytes (≈ 120 000 pieces: 1.9 TB at
16 MiB pieces); a publisher refuses to sign a larger one (use larger pieces). Tighter than
``Manifest.MAX_BYTES`` because fetchers read manifests from anyone (issue #12)."""


class PieceListing(Protocol):
    """What the piece rule reads of a manifest: a checkpoint's :class:`~protocol.messages.Manifest`
    or an artifact's :class:`~protocol.artifacts.ArtifactManifest`."""

    @property
    def piece_size_bytes(self) -> int: ...

    @property
    def files(self) -> Sequence[ManifestFile]: ...


@dataclass(frozen=True)
class PieceRef:
    """Where one piece of a manifest lives.

    Attributes:
        file_index: index of the file in ``manifest.files``.
        file_name: that file's name.
        index: index of the piece within its file.
        offset_bytes: first byte of the piece within its file.
        size_bytes: length of the piece in bytes (``piece_size_bytes`` except for a file's last piece).
        piece_id: the piece's content ID.
    """

    file_index: int
    file_name: str
    index: int
    offset_bytes: int
    size_bytes: int
    piece_id: PieceId


def piece_count(size_bytes: int, piece_size_bytes: int) -> int:
    """Number of pieces of a file of ``size_bytes`` bytes (0 for an empty file)."""
    if size_bytes < 0 or piece_size_bytes <= 0:
        raise ValueError("sizes must be non-negative and the piece size positive")
    return -(-size_bytes // piece_size_bytes)


def piece_spans(size_bytes: int, piece_size_bytes: int) -> Iterator[tuple[int, int]]:
    """``(offset_bytes, length_bytes)`` of each piece of a file, in order (the piece rule)."""
    for i in range(piece_count(size_bytes, piece_size_bytes)):
        start = i * piece_size_bytes
        yield start, min(piece_size_bytes, size_bytes - start)


def iter_pieces(manifest: PieceListing) -> Iterator[PieceRef]:
    """Every piece of ``manifest`` in file order, with its position and length.

    Raises:
        SchemaError: a file's piece list does not follow the piece rule (see :func:`check_manifest`).
    """
    for fi, f in enumerate(manifest.files):
        spans = list(piece_spans(f.size_bytes, manifest.piece_size_bytes))
        if len(spans) != len(f.pieces):
            raise SchemaError(f"file {f.name!r} of {f.size_bytes} bytes needs {len(spans)} pieces, lists {len(f.pieces)}", "body.files")
        for i, ((offset, length), pid) in enumerate(zip(spans, f.pieces, strict=True)):
            yield PieceRef(fi, f.name, i, offset, length, PieceId(pid))


def total_size_bytes(manifest: PieceListing) -> int:
    """Sum of the file sizes of ``manifest``, in bytes."""
    return sum(f.size_bytes for f in manifest.files)


def check_manifest(manifest: PieceListing) -> None:
    """Rules a schema-valid manifest must also follow before anyone acts on it.

    Every file's piece count follows the piece rule, and no file name starts with ``.`` (which
    excludes ``.`` and ``..`` and leaves the ``.``-names of a checkpoint directory to the node).

    Raises:
        SchemaError: naming the offending file.
    """
    for f in manifest.files:
        if f.name.startswith("."):
            raise SchemaError(f"file name {f.name!r} must not start with '.'", "body.files")
        want = piece_count(f.size_bytes, manifest.piece_size_bytes)
        if len(f.pieces) != want:
            raise SchemaError(f"file {f.name!r} of {f.size_bytes} bytes needs {want} pieces, lists {len(f.pieces)}", "body.files")


def open_manifest(data: bytes, *, run_id: bytes, authorities: Authorities, max_bytes: int | None = None) -> Envelope[Manifest]:
    """Decode and verify manifest bytes received from anyone.

    Args:
        data: the envelope bytes.
        run_id: this node's 32-byte run ID.
        authorities: the run spec's keys; only the coordinator may sign a manifest.
        max_bytes: a tighter size limit than ``Manifest.MAX_BYTES`` (a fetcher's cap), bytes.

    Returns:
        The verified envelope (``.body`` is the :class:`Manifest`, ``.raw`` the exact bytes).

    Raises:
        DecodeError, SchemaError: malformed bytes, wrong type or a manifest breaking the piece rule.
        WrongRunError: a manifest of another run.
        SignatureError: not signed by the run's coordinator.
    """
    env: Envelope[Manifest] = open_envelope(data, run_id=run_id, authorities=authorities, expect=Manifest, max_bytes=max_bytes)
    check_manifest(env.body)
    return env


class PieceSink(Protocol):
    """Receives a checkpoint's bytes piece by piece while :func:`build_manifest` cuts it."""

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` (at most :data:`READ_CHUNK_BYTES` bytes) to the current piece."""

    def end_piece(self, piece_id: PieceId, size_bytes: int) -> None:
        """The current piece is complete; its content ID is ``piece_id``."""


def build_manifest(
    step: int,
    files: Sequence[tuple[str, BinaryIO]],
    *,
    piece_size_bytes: int = DEFAULT_PIECE_SIZE_BYTES,
    meta: Mapping[str, str] | None = None,
    sink: PieceSink | None = None,
) -> Manifest:
    """Cut files into pieces and describe them, in one streaming pass (memory stays flat).

    Args:
        step: the policy step the checkpoint holds.
        files: ``(name, stream)`` per file, in manifest order; each stream is read to its end.
        piece_size_bytes: the piece size (64 KiB … 1 GiB).
        meta: small string annotations carried in the manifest (e.g. ``{"format": "safetensors"}``).
        sink: optional receiver of every piece's bytes (the publisher stores pieces with it).

    Returns:
        The manifest (unsigned; seal it with :func:`protocol.envelope.seal`).

    Raises:
        SchemaError: a name or size the manifest schema rejects.
        ValueError: ``piece_size_bytes`` out of range.
    """
    if not MIN_PIECE_SIZE_BYTES <= piece_size_bytes <= MAX_PIECE_SIZE_BYTES:
        raise ValueError(f"piece size must be {MIN_PIECE_SIZE_BYTES}…{MAX_PIECE_SIZE_BYTES} bytes, got {piece_size_bytes}")
    whole = hashlib.sha256()
    out: list[ManifestFile] = []
    # The whole-checkpoint hash runs in a second thread (hashlib releases the GIL), overlapping
    # the piece hash and the sink's writes; chunks reach it in order, one at a time.
    ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardcast-hash")
    prev: Future[None] | None = None
    try:
        prev = _cut_files(files, piece_size_bytes, sink, whole, ex, out)
    finally:
        if prev is not None:
            prev.result()
        ex.shutdown(wait=True)
    try:
        manifest = Manifest(
            step=step, piece_size_bytes=piece_size_bytes, files=out, checkpoint_hash=whole.digest(), meta=dict(meta or {})
        )
    except ValidationError as e:
        raise SchemaError(_first_error(e), "body") from None
    check_manifest(manifest)
    return manifest


def _cut_files(
    files: Sequence[tuple[str, BinaryIO]],
    piece_size_bytes: int,
    sink: PieceSink | None,
    whole: hashlib._Hash,
    ex: ThreadPoolExecutor,
    out: list[ManifestFile],
) -> Future[None] | None:
    prev: Future[None] | None = None
    for name, stream in files:
        pieces: list[bytes] = []
        size = 0
        while True:
            h = hashlib.sha256()
            got = 0
            while got < piece_size_bytes:
                chunk = stream.read(min(READ_CHUNK_BYTES, piece_size_bytes - got))
                if not chunk:
                    break
                if prev is not None:
                    prev.result()
                prev = ex.submit(whole.update, chunk)
                h.update(chunk)
                if sink is not None:
                    sink.write(chunk)
                got += len(chunk)
            if got == 0:
                break
            pid = PieceId(h.digest())
            if sink is not None:
                sink.end_piece(pid, got)
            pieces.append(pid)
            size += got
            if got < piece_size_bytes:
                break
        try:
            out.append(ManifestFile(name=name, size_bytes=size, pieces=pieces))
        except ValidationError as e:
            raise SchemaError(f"file {name!r}: {_first_error(e)}", "body.files") from None
    return prev


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else str(err["msg"])


def checkpoint_hash(streams: Sequence[BinaryIO]) -> ContentId:
    """SHA-256 of the concatenated contents of ``streams`` (in manifest order), read in chunks."""
    h = hashlib.sha256()
    for s in streams:
        while chunk := s.read(READ_CHUNK_BYTES):
            h.update(chunk)
    return ContentId(h.digest())
