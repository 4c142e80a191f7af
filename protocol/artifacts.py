"""Artifacts: a named set of files pinned by one content hash in the run spec (pure; ``docs/shardcast.md`` §10).

A run ships what every node needs besides the policy — the training task list today; a
researcher's environment (code and data) next — as an **artifact**: its files cut into pieces by
the Shardcast piece rule (:mod:`protocol.shardcast`) and listed by an :class:`ArtifactManifest`.
The artifact's ID is the SHA-256 of a domain tag and the manifest's canonical msgpack bytes, and
the run spec pins it under the artifact's name (``[artifacts]``, ``protocol.runspec``). So the
coordinator's signature over the spec covers every byte: a node checks the manifest bytes against
the pinned ID *before* decoding them (:func:`open_artifact`), and then each piece against its ID in
the manifest as it arrives, exactly as it checks a checkpoint against its signed manifest. No
signature of its own is needed, and anyone (the origin, any relay) can serve it.

Pure: callers pass byte streams in and get manifests, bytes and IDs out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Annotated, BinaryIO, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator

from protocol import encoding
from protocol.content import ContentId
from protocol.errors import ArtifactError, SchemaError
from protocol.messages import KiB, ManifestFile, Message, Name, ShortStr, Signer, decode_limits, unique_file_names
from protocol.shardcast import MANIFEST_FETCH_LIMIT_BYTES, PieceSink, build_manifest, check_manifest

ARTIFACT_DOMAIN = b"intellect-node/artifact/1\x00"
"""Domain tag hashed before the manifest bytes (an artifact ID is never some other content's hash)."""
ARTIFACT_PIECE_SIZE_BYTES = 1 << 20
"""Piece size of the artifacts a coordinator builds (1 MiB: a task list of a few MB is a few pieces;
fixed here, not taken from the spec, so ``spec init`` and the coordinator cut the same pieces)."""
MAX_ARTIFACT_MANIFEST_BYTES = MANIFEST_FETCH_LIMIT_BYTES
"""Largest artifact manifest anyone reads or builds, bytes (≈ 120,000 pieces: 120 GB at 1 MiB pieces)."""
TASKS_ARTIFACT = "tasks"
"""The name under which the run spec pins the training task list (``protocol.dataset``)."""
ARTIFACT_NAME_PATTERN = r"^[a-z][a-z0-9_\-]{0,31}$"
"""What an artifact name in the run spec looks like (``tasks``, ``environment``)."""


class ArtifactManifest(Message):
    """The list of an artifact's files and pieces; its bytes hash to the ID the run spec pins.

    Piece *i* of a file covers bytes ``[i·piece_size_bytes, min((i+1)·piece_size_bytes, size))``,
    each piece's ID the SHA-256 of its bytes (the Shardcast piece rule). Not an envelope: it is
    not signed, it is pinned (module docstring).
    """

    TYPE: ClassVar[str] = "artifact/1"
    MAX_BYTES: ClassVar[int] = MAX_ARTIFACT_MANIFEST_BYTES
    SIGNER: ClassVar[Signer] = "coordinator"  # through the spec that pins it

    type: Literal["artifact/1"] = "artifact/1"
    name: Annotated[str, Field(max_length=32, pattern=ARTIFACT_NAME_PATTERN)]
    piece_size_bytes: Annotated[int, Field(ge=64 * KiB, le=1 << 30)]
    files: Annotated[list[ManifestFile], Field(min_length=1, max_length=1024, fail_fast=True)]
    meta: Annotated[dict[Name, ShortStr], Field(max_length=32)] = {}  # noqa: RUF012 - pydantic copies defaults

    @field_validator("files")
    @classmethod
    def _unique_names(cls, files: list[ManifestFile]) -> list[ManifestFile]:
        return unique_file_names(files)


_LIMITS = decode_limits(ArtifactManifest)


def artifact_id(raw: bytes) -> ContentId:
    """The artifact ID of manifest bytes: SHA-256 of :data:`ARTIFACT_DOMAIN` and ``raw`` (32 bytes)."""
    return ContentId(hashlib.sha256(ARTIFACT_DOMAIN + raw).digest())


def build_artifact(name: str, files: Sequence[tuple[str, BinaryIO]], *, piece_size_bytes: int = ARTIFACT_PIECE_SIZE_BYTES,
                   meta: Mapping[str, str] | None = None, sink: PieceSink | None = None) -> tuple[ArtifactManifest, bytes, ContentId]:
    """Cut files into pieces and describe them, in one streaming pass (memory stays flat).

    Args:
        name: the artifact's name (:data:`ARTIFACT_NAME_PATTERN`), e.g. :data:`TASKS_ARTIFACT`.
        files: ``(file name, stream)`` in order; each stream is read to its end.
        piece_size_bytes: the piece size (64 KiB … 1 GiB).
        meta: small string annotations (≤ 32).
        sink: receives every piece's bytes (a store keeps them to serve).

    Returns:
        ``(manifest, its canonical bytes, artifact ID)``: the ID is what the run spec pins.

    Raises:
        SchemaError: a name or size the schema refuses, or a manifest over :data:`MAX_ARTIFACT_MANIFEST_BYTES`.
    """
    cut = build_manifest(0, files, piece_size_bytes=piece_size_bytes, sink=sink)  # the one piece rule
    try:
        manifest = ArtifactManifest(name=name, piece_size_bytes=piece_size_bytes, files=list(cut.files), meta=dict(meta or {}))
    except ValidationError as e:
        err = e.errors()[0]
        raise SchemaError(str(err["msg"]), ".".join(map(str, err["loc"]))) from None
    raw = encoding.packb(manifest.model_dump(mode="python"))
    if len(raw) > MAX_ARTIFACT_MANIFEST_BYTES:
        raise SchemaError(f"artifact manifest of {len(raw)} bytes is over {MAX_ARTIFACT_MANIFEST_BYTES}: use a larger piece size")
    return manifest, raw, artifact_id(raw)


def open_artifact(raw: bytes, expected_id: bytes) -> ArtifactManifest:
    """Check manifest bytes received from anyone against the pinned ID, then decode them.

    The hash is checked first, over the raw bytes: bytes the run spec does not pin are never
    decoded. Then the decoder runs under the bounds of the schema, and the piece rule and safe
    file names are checked (:func:`protocol.shardcast.check_manifest`).

    Args:
        raw: the manifest bytes as received.
        expected_id: the 32-byte artifact ID from the run spec's ``[artifacts]``.

    Returns:
        The manifest.

    Raises:
        ArtifactError: over :data:`MAX_ARTIFACT_MANIFEST_BYTES`, or bytes that do not hash to ``expected_id``.
        DecodeError, SchemaError: pinned bytes that are still no valid manifest (a coordinator's bug).
    """
    if len(raw) > MAX_ARTIFACT_MANIFEST_BYTES:
        raise ArtifactError(f"artifact manifest of {len(raw)} bytes is over the {MAX_ARTIFACT_MANIFEST_BYTES}-byte limit")
    got = artifact_id(raw)
    if got != expected_id:
        raise ArtifactError(f"artifact manifest hashes to {got.hex()[:16]}…, the run spec pins {bytes(expected_id).hex()[:16]}…")
    doc = encoding.unpackb(raw, MAX_ARTIFACT_MANIFEST_BYTES, _LIMITS)
    try:
        manifest = ArtifactManifest.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise SchemaError(str(err["msg"]), ".".join(map(str, err["loc"]))) from None
    check_manifest(manifest)
    return manifest


def total_bytes(manifest: ArtifactManifest) -> int:
    """Sum of the artifact's file sizes, bytes."""
    return sum(f.size_bytes for f in manifest.files)
