"""An environment's files and package versions, read from this machine (reads files; not pure).

:func:`environment_source` gathers what :func:`protocol.envs.pin.environment_hash` hashes and what
the sandbox shows the environment's code:

* **a plain file** (``my_env.py``): the file, plus the data files it names in the module-level
  string constants ``TASKS_FILE`` and ``HELDOUT_FILE`` (read by parsing the file, never by running
  it; paths relative to the file's folder, inside it). No package versions: what it imports from
  site-packages is the operator's to install alike;
* **reasoning_gym**: every file of the installed ``reasoning_gym`` package (``__pycache__`` left
  out), and the versions of ``reasoning-gym`` and of its direct requirements;
* **verifiers**: every file of the environment's module, and the versions of ``verifiers``, its
  direct requirements and the module's own distribution.

A missing adapter library is one line naming the extra to install (:func:`protocol.envs.ref.install_hint`).
It reads only the paths named above; it writes nothing and imports no environment code.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import site
from dataclasses import dataclass
from pathlib import Path

from protocol.envs.pin import EnvFile, environment_hash
from protocol.envs.ref import EnvError, EnvRef, install_hint

__all__ = ["MAX_ENV_BYTES", "MAX_ENV_FILES", "EnvSource", "environment_source", "site_dirs"]

MAX_ENV_FILES = 4096
"""Most files an environment may have (reasoning-gym 0.1.25: 386)."""
MAX_ENV_BYTES = 512 * 1024**2
"""Most bytes an environment's files may hold together (reasoning-gym 0.1.25: 23 MB)."""
MAX_BOUND_FILES = 256
"""Most files shown to the sandbox from memory (a plain file and its data, a verifiers module)."""
_DATA_NAMES = ("TASKS_FILE", "HELDOUT_FILE")


@dataclass(frozen=True)
class EnvSource:
    """An environment as found on this machine.

    Attributes:
        ref: its name, parsed.
        files: what its hash covers (paths relative to the environment's root).
        packages: distribution name → version, what its hash covers besides the files.
        hash: :func:`protocol.envs.pin.environment_hash` of the two.
        bound: the files the sandbox shows under ``/env`` (from memory, the very bytes hashed):
            a plain file and its data files, a verifiers module; none for reasoning-gym (its
            package is read from the bound site-packages).
        entry: a plain file's path inside the sandbox (``/env/<name>.py``), else ``""``.
    """

    ref: EnvRef
    files: tuple[EnvFile, ...]
    packages: dict[str, str]
    hash: str
    bound: tuple[EnvFile, ...] = ()
    entry: str = ""


def site_dirs() -> tuple[str, ...]:
    """This interpreter's site-packages folders (shown read-only inside the environment sandbox)."""
    return tuple(dict.fromkeys(os.path.realpath(d) for d in site.getsitepackages() if os.path.isdir(d)))


def _read(path: Path, what: str, limit: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > limit:
            raise EnvError(f"{what} {path} is {size} bytes, over the {limit}-byte limit")
        return path.read_bytes()
    except OSError as e:
        raise EnvError(f"cannot read {what} {path}: {e.strerror}") from None


def _tree(root: Path, prefix: str) -> list[EnvFile]:
    """Every file under ``root`` (no ``__pycache__``, no ``.pyc``), as ``prefix/relative path``, within the limits."""
    files: list[EnvFile] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            data = _read(path, "environment file", MAX_ENV_BYTES)
            total += len(data)
            files.append(EnvFile(f"{prefix}/{path.relative_to(root).as_posix()}", data))
            if len(files) > MAX_ENV_FILES or total > MAX_ENV_BYTES:
                raise EnvError(f"environment {root} has over {MAX_ENV_FILES} files or {MAX_ENV_BYTES} bytes")
    return files


def _versions(dist: str) -> dict[str, str]:
    """``dist``'s version and those of its direct requirements that apply here (no extras; ``"missing"`` when not installed)."""
    from packaging.requirements import InvalidRequirement, Requirement

    out = {dist: md.version(dist)}
    for text in md.requires(dist) or []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            out[req.name.lower()] = md.version(req.name)
        except md.PackageNotFoundError:
            out[req.name.lower()] = "missing"
    return out


def _data_names(source: bytes, path: Path) -> list[str]:
    """The string constants ``TASKS_FILE`` / ``HELDOUT_FILE`` of a plain environment file (parsed, not run)."""
    try:
        tree = ast.parse(source, filename=str(path))
    except (SyntaxError, ValueError) as e:
        raise EnvError(f"environment file {path} does not parse: {e}") from None
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target in _DATA_NAMES:
                if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                    raise EnvError(f"environment file {path}: {target} must be a plain string (the node reads it without running the file)")
                names.append(node.value.value)
    return names


def _plain_file(ref: EnvRef) -> EnvSource:
    path = Path(ref.path)
    source = _read(path, "environment file", 16 * 1024**2)
    root = path.resolve().parent
    files = [EnvFile(path.name, source)]
    for name in _data_names(source, path):
        data_path = (root / name).resolve()
        if not data_path.is_relative_to(root) or data_path == path.resolve():
            raise EnvError(f"environment file {path}: data file {name!r} must lie in its folder")
        files.append(EnvFile(data_path.relative_to(root).as_posix(), _read(data_path, "environment data file", MAX_ENV_BYTES)))
    packages: dict[str, str] = {}
    return EnvSource(ref, tuple(files), packages, environment_hash(ref.kind, files, packages), bound=tuple(files),
                     entry=f"/env/{path.name}")


def _module_dir(module: str) -> tuple[Path, bool]:
    """(the module's package folder or file, whether it is a package)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise EnvError(f"environment module {module!r} is not installed here (pip install it, e.g. the package that provides it)")
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))), True
    return Path(spec.origin), False


def _distribution_of(module: str) -> str | None:
    for dist in md.packages_distributions().get(module, []):
        return dist
    return None


def environment_source(ref: EnvRef) -> EnvSource:
    """Find ``ref``'s files and versions on this machine and hash them.

    Raises:
        EnvError: the adapter's library is not installed (one line naming the extra), the
            environment file or module is missing or unreadable, or over the limits.
    """
    if ref.kind == "file":
        return _plain_file(ref)
    module = "reasoning_gym" if ref.kind == "reasoning_gym" else "verifiers"
    if importlib.util.find_spec(module) is None:
        raise EnvError(install_hint(ref.kind))
    if ref.kind == "reasoning_gym":
        root, _ = _module_dir("reasoning_gym")
        files = _tree(root, "reasoning_gym")
        packages = _versions("reasoning-gym")
        return EnvSource(ref, tuple(files), packages, environment_hash(ref.kind, files, packages))
    where, is_package = _module_dir(ref.module)
    files = _tree(where, ref.module) if is_package else [EnvFile(where.name, _read(where, "environment module", 16 * 1024**2))]
    if len(files) > MAX_BOUND_FILES:
        raise EnvError(f"verifiers environment {ref.module!r} has {len(files)} files, over {MAX_BOUND_FILES}")
    packages = _versions("verifiers")
    dist = _distribution_of(ref.module)
    if dist is not None:
        packages[dist.lower()] = md.version(dist)
    return EnvSource(ref, tuple(files), packages, environment_hash(ref.kind, files, packages), bound=tuple(files))
