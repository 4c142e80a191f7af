"""Naming an environment (pure): the run spec's ``env.name`` parsed into an :class:`EnvRef`.

Three kinds, one grammar each:

* ``reasoning_gym:NAME[=WEIGHT][,NAME[=WEIGHT]...]`` — reasoning-gym procedural datasets by name
  (``basic_arithmetic``, ``chain_sum``, …), several at once with relative weights (default 1),
  as reasoning-gym's own composite dataset mixes them;
* ``verifiers:MODULE`` — a prime ``verifiers`` single-turn environment, the installed module
  whose ``load_environment(**args)`` returns it (``vf-gsm8k`` names the module ``vf_gsm8k``);
* ``PATH.py`` (or ``file:PATH.py``) — a plain Python file with ``score(task, completion)``
  (``docs/tasks.md`` § Your own environment).

The adapters' third-party code never runs in the node: :mod:`protocol.envs.sandboxed` runs it
in the bubblewrap sandbox.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from protocol.tasks.schema import TaskError

__all__ = ["ENV_EXTRAS", "ENV_KINDS", "EnvError", "EnvKind", "EnvRef", "install_hint", "parse_env_ref"]

EnvKind = Literal["reasoning_gym", "verifiers", "file"]
ENV_KINDS: tuple[str, ...] = ("reasoning_gym", "verifiers", "file")
ENV_EXTRAS: dict[str, tuple[str, str]] = {"reasoning_gym": ("reasoning_gym", "reasoning-gym"), "verifiers": ("verifiers", "verifiers")}
"""Per adapter kind: the module it imports and the optional extra of ``intellect-node`` that installs it."""

MAX_DATASETS = 64
_DATASET = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,127}$")


class EnvError(TaskError):
    """An environment that cannot be named, found, pinned, loaded or run (one line: what and the fix)."""


@dataclass(frozen=True)
class EnvRef:
    """A parsed ``env.name``.

    Attributes:
        kind: ``"reasoning_gym"``, ``"verifiers"`` or ``"file"``.
        text: the name as written in the run spec.
        datasets: reasoning_gym only: ``(dataset name, weight > 0)`` in the order given.
        module: verifiers only: the module ``load_environment`` lives in.
        path: file only: the path of the Python file, as written (relative to the node's working folder).
    """

    kind: EnvKind
    text: str
    datasets: tuple[tuple[str, float], ...] = ()
    module: str = ""
    path: str = ""

    @property
    def label(self) -> str:
        """Short name for problem IDs and the run page: the first dataset, the module, or the file's stem."""
        if self.kind == "reasoning_gym":
            return "+".join(name for name, _ in self.datasets)
        if self.kind == "verifiers":
            return self.module
        return self.path.rsplit("/", 1)[-1].removesuffix(".py")


def install_hint(kind: str) -> str:
    """The one line that says which extra an adapter needs (``pip install 'intellect-node[reasoning-gym]'``)."""
    module, extra = ENV_EXTRAS[kind]
    return f"environment kind {kind} needs the Python package {module!r}: pip install 'intellect-node[{extra}]' (or pip install -e '.[{extra}]')"


def _weight(text: str, where: str) -> float:
    try:
        w = float(text)
    except ValueError:
        raise EnvError(f"env.name {where!r}: weight {text!r} is not a number") from None
    if not (math.isfinite(w) and w > 0):
        raise EnvError(f"env.name {where!r}: weight must be a positive number, got {text!r}")
    return w


def parse_env_ref(text: str) -> EnvRef:
    """Parse ``env.name`` (the grammar of the module docstring).

    Raises:
        EnvError: naming what is wrong and the accepted forms.
    """
    forms = "use reasoning_gym:NAME[=WEIGHT][,NAME...], verifiers:MODULE or a path to a .py file"
    if not isinstance(text, str) or not text.strip() or text != text.strip():
        raise EnvError(f"env.name {text!r} is empty or has surrounding spaces; {forms}")
    if text.startswith("reasoning_gym:"):
        body = text.removeprefix("reasoning_gym:")
        datasets: list[tuple[str, float]] = []
        for part in body.split(","):
            name, sep, w = part.partition("=")
            if not _DATASET.match(name):
                raise EnvError(f"env.name {text!r}: {name!r} is not a reasoning-gym dataset name (lowercase letters, digits, _)")
            datasets.append((name, _weight(w, text) if sep else 1.0))
        names = [n for n, _ in datasets]
        if len(set(names)) != len(names) or len(names) > MAX_DATASETS:
            raise EnvError(f"env.name {text!r}: each dataset once, at most {MAX_DATASETS}")
        return EnvRef("reasoning_gym", text, datasets=tuple(datasets))
    if text.startswith("verifiers:"):
        module = text.removeprefix("verifiers:")
        if not _MODULE.match(module):
            raise EnvError(f"env.name {text!r}: {module!r} is not an environment module name")
        return EnvRef("verifiers", text, module=module.replace("-", "_"))
    path = text.removeprefix("file:")
    if path.endswith(".py") and "\x00" not in path and len(path) <= 512:
        return EnvRef("file", text, path=path)
    raise EnvError(f"env.name {text!r} is not an environment; {forms}")
