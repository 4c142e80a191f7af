"""An environment's content hash (pure): what the run spec's ``env.hash`` pins.

One function, :func:`environment_hash`, over the environment's **files** (relative path and
bytes: a plain environment file and its data files, a verifiers environment module, the
reasoning-gym package) and the **versions** of the packages its code imports (the adapter's
library and that library's direct requirements). A node whose environment hashes otherwise
refuses to start (:func:`check_environment_hash`), in one line naming both hashes.

The files are given by the caller (:mod:`protocol.envs.files` reads them from disk), so code that
moves an environment between machines (a content-addressed artifact of the run) can hash the
very bytes it carries.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from protocol import encoding
from protocol.envs.ref import EnvError

__all__ = ["ENV_HASH_DOMAIN", "EnvFile", "check_environment_hash", "environment_hash"]

ENV_HASH_DOMAIN = b"intellect-node/environment/1\x00"
"""Domain-separation prefix of :func:`environment_hash`'s input."""
_PATH = re.compile(r"^(?!/)(?!.*(^|/)\.\.?(/|$))[^\x00\\]{1,512}$")


@dataclass(frozen=True)
class EnvFile:
    """One file of an environment.

    Attributes:
        path: POSIX path relative to the environment's root (``my_env.py``, ``reasoning_gym/utils.py``),
            no ``..``, no leading ``/``.
        data: its bytes.
    """

    path: str
    data: bytes


def environment_hash(kind: str, files: Iterable[EnvFile], packages: Mapping[str, str]) -> str:
    """Content hash of an environment.

    SHA-256 of :data:`ENV_HASH_DOMAIN` followed by the canonical msgpack
    (:func:`protocol.encoding.packb`) of ``{"kind": kind, "files": [[path, SHA-256 hex of
    bytes], ...] sorted by path, "packages": [[name, version], ...] sorted by name}``. File order
    on disk, timestamps and modes do not count; a changed byte or version does.

    Args:
        kind: the adapter kind (``"reasoning_gym"``, ``"verifiers"``, ``"file"``).
        files: the environment's files.
        packages: distribution name → version of what its code imports and is not in ``files``.

    Returns:
        64 lowercase hex digits.

    Raises:
        EnvError: a path that is absolute, has ``..`` or appears twice.
    """
    rows: dict[str, str] = {}
    for f in files:
        if not _PATH.match(f.path) or f.path in rows:
            raise EnvError(f"environment file path {f.path!r} is absolute, climbs out with '..', or appears twice")
        rows[f.path] = hashlib.sha256(f.data).hexdigest()
    content = {"kind": kind, "files": [[p, rows[p]] for p in sorted(rows)],
               "packages": [[str(n), str(packages[n])] for n in sorted(packages)]}
    return hashlib.sha256(ENV_HASH_DOMAIN + encoding.packb(content)).hexdigest()


def check_environment_hash(name: str, got: str, pinned: str) -> None:
    """Refuse an environment that differs from the run spec's pin: one line naming both hashes.

    Raises:
        EnvError: ``got != pinned``.
    """
    if got != pinned:
        raise EnvError(f"environment {name!r} hashes to {got} here but the run spec pins env.hash {pinned}: "
                       "install the same environment files and package versions as the coordinator")
