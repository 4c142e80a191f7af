"""Where a devnet writes: a new folder per run by default, and a previous run's folder replaced on request.

``intellect-node devnet`` without ``--out`` makes ``devnet-out/<UTC time>`` (``-2``, ``-3``… when a
folder of that second exists) and points ``devnet-out/latest`` at it, so the main command runs again
and again in one checkout and earlier runs and the chaos examples' folders (``devnet-out/crash``…)
stay. With ``--out DIR``, ``DIR`` must be missing, empty, or a previous devnet's output: a folder
holding :data:`MARKER`, which the devnet writes first. A previous run is replaced, except for
folders inside it that are devnet outputs themselves (``devnet-out/adversary`` inside
``devnet-out`` keeps its run); anything else is refused, so no user file is ever deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

MARKER = ".intellect-devnet"
"""File at the top of every devnet output folder (JSON: run ID, seed, start time)."""
DEFAULT_ROOT = Path("devnet-out")
"""Folder of the default runs, relative to the working directory (git ignores it)."""
LATEST = "latest"
"""Symbolic link in :data:`DEFAULT_ROOT` to the newest default run."""


class OutDirError(FileExistsError):
    """``--out`` holds something that is not a devnet's output; the message says what to do."""


def is_devnet_out(path: Path) -> bool:
    """Whether ``path`` is a folder a devnet wrote (it holds :data:`MARKER`)."""
    return (Path(path) / MARKER).is_file()


def check_out(out: Path) -> None:
    """Raise :class:`OutDirError` unless ``out`` may be used: missing, empty, or a previous devnet's output."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"{out} is a file, not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not is_devnet_out(out):
        raise OutDirError(f"{out} is not empty and holds no devnet output ({MARKER} missing); choose another --out or remove it")


def claim_out(out: Path) -> list[str]:
    """Make ``out`` ready for a new run: created, or a previous run's entries removed.

    Entries that are devnet outputs themselves (nested runs) are kept.

    Returns:
        The names of the entries removed (empty for a new or empty folder).

    Raises:
        OutDirError: ``out`` holds files of something other than a devnet (see :func:`check_out`).
    """
    out = Path(out)
    check_out(out)
    removed = []
    if out.is_dir():
        for entry in sorted(out.iterdir()):
            if entry.is_dir() and not entry.is_symlink() and is_devnet_out(entry):
                continue  # another run's folder (a chaos example under devnet-out/): not ours to delete
            if entry.name == LATEST and entry.is_symlink():
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
    out.mkdir(parents=True, exist_ok=True)
    return removed


def write_marker(out: Path, info: dict[str, Any]) -> None:
    """Mark ``out`` as a devnet's output (written before anything else of the run)."""
    (Path(out) / MARKER).write_text(json.dumps(info, sort_keys=True) + "\n")


def new_default_out(root: Path = DEFAULT_ROOT, now: float | None = None) -> Path:
    """A new, empty run folder ``root/<YYYYmmdd-HHMMSS>`` (UTC), with ``root/latest`` pointing at it.

    Returns:
        The folder (created).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    for n in range(1, 1000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - a thousand runs started in one second
        raise OutDirError(f"cannot make a new run folder under {root}")
    link = root / LATEST
    tmp = root / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.name)  # relative: the folder can be moved whole
    os.replace(tmp, link)
    return path
