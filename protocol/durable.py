"""File I/O (not pure): the one atomic, durable write every node uses.

Besides it, only ``identity.NodeKey.save`` and ``models`` (a model directory, through this module)
write files in ``protocol/``, and only at paths their caller passes in. It lives here, at the bottom
of the import graph, so that ``trainer/`` (checkpoints, the ingest store) and ``node/`` (the worker's
spool, the Shardcast store, client and delta applier) share one spelling of the rule:

    write a temporary file next to the target → ``fsync`` it → ``os.replace`` onto the target →
    ``fsync`` the directory (so the rename itself survives a power cut).

A reader therefore sees either the old file or the whole new one, never a torn one, and once the call
returns the new bytes are on stable storage. The temporary name is hidden (``.<name>.tmp``) so that a
directory listing of model files or submissions never picks up a half-written one; callers that
sweep leftovers after a crash glob ``*.tmp`` (pathlib's glob matches hidden names).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir", "tmp_path_for"]


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (renames, creations) to stable storage (blocking).

    Raises:
        OSError: the directory cannot be opened or flushed.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path_for(path: Path) -> Path:
    """The hidden temporary name :func:`atomic_write` uses for ``path``: ``<dir>/.<name>.tmp``."""
    return path.with_name(f".{path.name}.tmp")


def atomic_write(
    path: Path,
    data: bytes | Callable[[Path], object],
    *,
    tmp: Path | None = None,
    durable: bool = True,
    sync_dir: bool = True,
) -> None:
    """Replace ``path`` with new contents atomically and, by default, durably (blocking).

    Args:
        path: the target file; its directory must exist.
        data: the new contents as bytes, or a function that writes the file at the path it is
            given (e.g. ``safetensors.torch.save_file``); its return value is ignored.
        tmp: the temporary file to write first (default :func:`tmp_path_for`); must be on the same
            file system as ``path``.
        durable: ``fsync`` the file before the rename. ``False`` keeps only atomicity (a store
            that batches its flushes, e.g. Shardcast's with ``fsync=False``).
        sync_dir: ``fsync`` the directory after the rename (only when ``durable``). A caller
            writing several files into one directory may pass ``False`` and call
            :func:`fsync_dir` once at the end.

    Raises:
        OSError: the write, flush or rename failed; ``path`` is unchanged (a leftover temporary
            file may remain for the caller's sweep).
    """
    path = Path(path)
    tmp = tmp_path_for(path) if tmp is None else Path(tmp)
    if callable(data):
        data(tmp)
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)
    if durable and sync_dir:
        fsync_dir(path.parent)
