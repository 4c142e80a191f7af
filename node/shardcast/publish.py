"""Publish a checkpoint: cut it into pieces, store them, sign the manifest (origin side).

The trainer calls :func:`publish_checkpoint` with the store its origin server serves; the
``intellect-node publish`` command calls it with a store on ``--data-dir``. Pieces are written
first and the manifest last, so a server that picks the manifest up (``store.refresh()``) finds
the step complete.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

from node.errors import ShardcastError
from node.shardcast.store import ShardcastStore
from protocol.artifacts import ARTIFACT_PIECE_SIZE_BYTES, ArtifactManifest, build_artifact
from protocol.content import ContentId
from protocol.envelope import Envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.messages import Manifest
from protocol.shardcast import DEFAULT_PIECE_SIZE_BYTES, MANIFEST_FETCH_LIMIT_BYTES, build_manifest

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Weight formats that unpickle on load; never published (weights travel as safetensors)."""


def checkpoint_files(path: Path) -> list[Path]:
    """The files of a checkpoint at ``path``: the file itself, or a directory's regular,
    non-hidden top-level files in name order (weights ``*.safetensors`` plus config files).

    Raises:
        ShardcastError: missing path, a single file that is not safetensors, a directory without
            safetensors weights, or a pickle-based weight file.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".safetensors" and path.suffix.lower() not in PICKLE_SUFFIXES:
            raise ShardcastError(f"{path} is not a .safetensors file; publish a safetensors file or a checkpoint directory")
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ShardcastError(f"{path} holds no files to publish")
    else:
        raise ShardcastError(f"no checkpoint at {path}")
    for f in files:
        if f.suffix.lower() in PICKLE_SUFFIXES:
            raise ShardcastError(f"{f} is a pickle-based weight file; save weights as safetensors")
    if not any(p.suffix.lower() == ".safetensors" for p in files):
        raise ShardcastError(f"{path} holds no .safetensors weights")
    return files


def publish_checkpoint(
    store: ShardcastStore,
    files: Sequence[Path],
    *,
    step: int,
    key: NodeKey,
    piece_size_bytes: int = DEFAULT_PIECE_SIZE_BYTES,
    meta: Mapping[str, str] | None = None,
    prune: bool = True,
    delta_from: int | None = None,
) -> Envelope[Manifest]:
    """Cut ``files`` into pieces in ``store`` and store the manifest signed by ``key``.

    Blocking (reads every byte once, hashing and writing as it goes; memory stays flat); from
    asyncio call it through ``asyncio.to_thread``.

    Args:
        store: the origin's store (its run ID and coordinator key decide what is valid).
        files: checkpoint files in manifest order; each is published under its base name.
        step: the policy step.
        key: the coordinator key of the run.
        piece_size_bytes: piece size (the run spec's ``shardcast.piece_size_bytes``).
        meta: small string annotations put in the manifest.
        prune: apply the store's retention afterwards.
        delta_from: also publish the delta from this complete, earlier step (``docs/shardcast.md``
            §9), before the manifest is stored; a delta that cannot be made is logged and skipped
            (the full checkpoint is always published).

    Returns:
        The signed manifest as stored.

    Raises:
        ShardcastError: unreadable files, duplicate names, a step already published with other
            content, a key that is not the run's coordinator, or a manifest over the fetch limit
            (``protocol.shardcast.MANIFEST_FETCH_LIMIT_BYTES``: choose a larger piece size).
    """
    if key.public_key != store.authorities.coordinator:
        raise ShardcastError(f"key {key.peer_id} is not the coordinator of this run; only it can publish")
    existing = store.manifest(step)
    names = [Path(f).name for f in files]
    if len(set(names)) != len(names):
        raise ShardcastError(f"checkpoint file names must be unique: {names}")
    sink = store.sink()
    try:
        with ExitStack() as stack:
            streams = [(Path(f).name, stack.enter_context(open(f, "rb"))) for f in files]
            manifest = build_manifest(step, streams, piece_size_bytes=piece_size_bytes, meta=meta, sink=sink)
    except OSError as e:
        raise ShardcastError(f"cannot read checkpoint file: {e}") from e
    except (ValueError, ProtocolError) as e:
        raise ShardcastError(f"cannot publish: {e}") from e
    finally:
        sink.close()
    if existing is not None:
        if existing.body.checkpoint_hash != manifest.checkpoint_hash:
            raise ShardcastError(f"step {step} is already published with different content")
        return existing
    raw = seal(key, store.run_id, manifest)
    if len(raw) > MANIFEST_FETCH_LIMIT_BYTES:  # fetchers would refuse it as oversized
        raise ShardcastError(
            f"the manifest of step {step} is {len(raw)} bytes, over the {MANIFEST_FETCH_LIMIT_BYTES} bytes fetchers read; "
            f"use a larger shardcast.piece_size_bytes (now {piece_size_bytes})"
        )
    if delta_from is not None and delta_from < step and existing is None:
        from node.shardcast.delta import publish_delta  # numpy/zstandard only when deltas are used

        try:
            publish_delta(store, raw, base_step=delta_from, key=key)
        except ShardcastError as e:
            logger.warning("no delta for step %d: %s", step, e, extra={"step": step})
    env = store.add_manifest(raw)
    if not store.check_complete(step):
        raise ShardcastError(f"step {step} is incomplete after publishing (pieces were removed meanwhile)")
    logger.info(
        "published step %d: %d files, %d bytes", step, len(files), sum(f.size_bytes for f in manifest.files), extra={"step": step}
    )
    if prune:
        store.prune()
    return env


def publish_artifact(store: ShardcastStore, name: str, files: Sequence[tuple[str, BinaryIO]], *, expected_id: bytes | None = None,
                     piece_size_bytes: int = ARTIFACT_PIECE_SIZE_BYTES,
                     meta: Mapping[str, str] | None = None) -> tuple[ArtifactManifest, ContentId]:
    """Cut an artifact's files into pieces in ``store`` and store its manifest (``docs/shardcast.md`` §10).

    Blocking; the same streaming pass as a checkpoint's (memory stays flat). An artifact needs no
    signature: the run spec pins its ID (``[artifacts]``), so serving it is publishing it.

    Args:
        store: the origin's store.
        name: the artifact's name (``tasks``, ``environment``).
        files: ``(file name, stream)`` in order.
        expected_id: the ID the run spec pins; when these files make another artifact its manifest
            is not stored (the pieces already cut stay in the store, listed by nothing).
        piece_size_bytes: the piece size (default :data:`protocol.artifacts.ARTIFACT_PIECE_SIZE_BYTES`).
        meta: small string annotations.

    Returns:
        ``(manifest, artifact ID)``.

    Raises:
        ShardcastError: unreadable files, a schema error, or files that are not the pinned artifact
            (one line naming both IDs).
    """
    sink = store.sink()
    try:
        manifest, raw, aid = build_artifact(name, files, piece_size_bytes=piece_size_bytes, meta=meta, sink=sink)
    except OSError as e:
        raise ShardcastError(f"cannot read artifact file: {e}") from e
    except (ValueError, ProtocolError) as e:
        raise ShardcastError(f"cannot publish artifact {name!r}: {e}") from e
    finally:
        sink.close()
    if expected_id is not None and aid != expected_id:
        raise ShardcastError(f"artifact {name!r} built here is {aid.hex()[:16]}…, the run spec pins {bytes(expected_id).hex()[:16]}…: "
                             "different files")
    store.add_artifact(raw, aid)
    logger.info("published artifact %s %s… (%d bytes)", name, aid.hex()[:16], sum(f.size_bytes for f in manifest.files))
    return manifest, aid
