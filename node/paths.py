"""Default locations of a node's files."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "INTELLECT_NODE_HOME"
KEY_FILE_NAME = "node.key"


def default_data_dir() -> Path:
    """``$INTELLECT_NODE_HOME``, else ``$XDG_DATA_HOME/intellect-node``, else ``~/.local/share/intellect-node``."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "intellect-node"


def default_key_path(data_dir: Path | None = None) -> Path:
    """The node key inside ``data_dir`` (default: :func:`default_data_dir`)."""
    return (data_dir or default_data_dir()) / KEY_FILE_NAME
