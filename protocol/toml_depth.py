"""A linear pre-scan of TOML text that finds where its nesting first exceeds a limit, before ``tomllib`` parses it.

``tomllib`` (CPython 3.11, the same code as ``tomli``) does work per key that grows with the key's depth:
``parse_key`` builds the key tuple by ``key += (part,)`` and ``key_value_rule`` checks every prefix of it,
so one dotted key of *n* parts costs O(n²) (``"x" + ".x" * 15_000 + " = 1"``, 30 KB, takes seconds); and
every ``key = value`` line re-walks its table header, so a 1,000-part header followed by short lines costs
O(header × lines) (≈ 12 s within 1 MiB). Bounding the depth before parsing bounds both: at depth ≤ *d* a
document of *S* bytes costs tomllib O(d · S). Pure: no I/O.

The **nesting depth** counted here is the length of the key path to a value: the key parts of the table
header in force (one more for an array of tables ``[[…]]``), plus the key parts of the key, plus one per
inline array or table the value sits in (``[a.b]`` then ``c.d = [[1]]``: the ``1`` is at depth 6). An
array of tables named again inside another's header is not counted again, so this may be below the
depth of the parsed dict by the number of such levels; it is never above it.

The scan follows ``tomllib``'s own grammar (``tomllib/_parser.py``: statements, keys, the four string
kinds, arrays with comments, inline tables) closely enough to be in step with it on every document it
accepts: dots and brackets inside strings, quoted keys and comments are not counted. Where the text
stops being valid TOML the scan stops and reports nothing, since ``tomllib`` then fails at or before
that point, having done only the work of the prefix (which was within the limit).
"""

from __future__ import annotations

import re

__all__ = ["first_nesting_over"]

_WS = re.compile(r"[ \t]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_BASIC_STR = re.compile(r'"[^"\\\n]*(?:\\[^\n][^"\\\n]*)*"')
"""A one-line basic string: an escape consumes the character after its backslash (``\\"``, ``\\\\``)."""
_LITERAL_STR = re.compile(r"'[^'\n]*'")
_ML_BASIC_STR = re.compile(r'"""[^"\\]*(?:(?:\\[\s\S]|"(?!""))[^"\\]*)*""""{0,2}')
"""A multi-line basic string: ends at the first unescaped ``\"\"\"``, plus up to two more quotes (``\"\"\"a\"\"\"\"\"``)."""
_SCALAR = re.compile(r"[0-9A-Za-z_+\-:. \t]*")
"""A number, boolean, date-time (``1979-05-27 07:32:00`` has a space) or inf/nan, with the blanks after it."""
_ARRAY_WS = re.compile(r"(?:[ \t\n]|#[^\n]*)*")
"""Blanks, newlines and comments between an array's elements."""

_KEY_INITIAL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_\"'")


class _Stop(Exception):
    """The text is not valid TOML here (tomllib fails at or before this point)."""


class _Over(Exception):
    def __init__(self, depth: int, pos: int) -> None:
        self.depth, self.pos = depth, pos


def _match(pattern: re.Pattern[str], src: str, pos: int) -> int:
    m = pattern.match(src, pos)
    if m is None:
        raise _Stop
    return m.end()


def _key(src: str, pos: int, base: int, limit: int) -> tuple[int, int]:
    """Skip a (dotted) key at ``pos`` with its trailing blanks, as ``tomllib`` ``parse_key`` reads it.

    Returns:
        (position after it, ``base`` + its number of parts); raises :class:`_Over` as soon as that
        passes ``limit`` (so a 500,000-part key costs no more than ``limit`` parts of scanning beyond it).
    """
    depth = base
    while True:
        c = src[pos : pos + 1]
        if c == '"':
            pos = _match(_BASIC_STR, src, pos)
        elif c == "'":
            pos = _match(_LITERAL_STR, src, pos)
        else:
            pos = _match(_BARE_KEY, src, pos) if c else -1
            if pos < 0:
                raise _Stop
        depth += 1
        if depth > limit:
            raise _Over(depth, pos)
        pos = _WS.match(src, pos).end()  # type: ignore[union-attr]  # matches the empty string
        if src.startswith(".", pos):
            pos = _WS.match(src, pos + 1).end()  # type: ignore[union-attr]
            continue
        return pos, depth


def _key_and_equals(src: str, pos: int, base: int, limit: int) -> tuple[int, int]:
    """Skip ``key =`` and the blanks after it (:func:`_key`); returns (position of the value, its depth)."""
    pos, depth = _key(src, pos, base, limit)
    if not src.startswith("=", pos):
        raise _Stop
    return _WS.match(src, pos + 1).end(), depth  # type: ignore[union-attr]


def _string(src: str, pos: int) -> int | None:
    """The end of the string that starts at ``pos``, or None where no string starts there."""
    if src.startswith('"""', pos):
        return _match(_ML_BASIC_STR, src, pos)
    if src.startswith("'''", pos):
        end = src.find("'''", pos + 3)
        if end < 0:
            raise _Stop
        end += 3
        return end + 2 if src.startswith("''", end) else end + 1 if src.startswith("'", end) else end
    if src.startswith('"', pos):
        return _match(_BASIC_STR, src, pos)
    if src.startswith("'", pos):
        return _match(_LITERAL_STR, src, pos)
    return None


def _value(src: str, pos: int, depth: int, limit: int) -> int:
    """Skip the value at ``pos`` (at ``depth``), inline arrays and tables included, without recursion.

    Returns:
        The position after it.
    """
    open_containers: list[tuple[str, int]] = []  # ("[" or "{", the container's own depth)
    while True:
        # One value at ``depth`` starts at ``pos``.
        if depth > limit:
            raise _Over(depth, pos)
        end = _string(src, pos)
        if end is not None:
            pos = end
        elif src.startswith("[", pos):
            open_containers.append(("[", depth))
            pos = _ARRAY_WS.match(src, pos + 1).end()  # type: ignore[union-attr]
            if not src.startswith("]", pos):
                depth += 1
                continue
            pos += 1
            open_containers.pop()
        elif src.startswith("{", pos):
            open_containers.append(("{", depth))
            pos = _WS.match(src, pos + 1).end()  # type: ignore[union-attr]
            if not src.startswith("}", pos):
                pos, depth = _key_and_equals(src, pos, depth, limit)
                continue
            pos += 1
            open_containers.pop()
        else:
            end = _SCALAR.match(src, pos).end()  # type: ignore[union-attr]
            if end == pos:
                raise _Stop
            pos = end
        # After a value: close what it ends, or go on to the next element or key of its container.
        while open_containers:
            kind, container_depth = open_containers[-1]
            if kind == "[":
                pos = _ARRAY_WS.match(src, pos).end()  # type: ignore[union-attr]
                if src.startswith(",", pos):
                    pos = _ARRAY_WS.match(src, pos + 1).end()  # type: ignore[union-attr]
                    if not src.startswith("]", pos):
                        depth = container_depth + 1
                        break
                if not src.startswith("]", pos):
                    raise _Stop
                pos += 1
                open_containers.pop()
            else:
                pos = _WS.match(src, pos).end()  # type: ignore[union-attr]
                if src.startswith(",", pos):
                    pos = _WS.match(src, pos + 1).end()  # type: ignore[union-attr]
                    pos, depth = _key_and_equals(src, pos, container_depth, limit)
                    break
                if not src.startswith("}", pos):
                    raise _Stop
                pos += 1
                open_containers.pop()
        else:
            return pos


def _end_of_line(src: str, pos: int) -> int:
    """Past the rest of the line: after a statement only blanks and a comment are valid TOML."""
    end = src.find("\n", pos)
    return len(src) if end < 0 else end + 1


def first_nesting_over(text: str, limit: int) -> tuple[int, int] | None:
    """Where the nesting depth of a TOML document first exceeds ``limit`` (see the module docstring).

    Linear in ``len(text)``: each character is looked at a bounded number of times, a key's parts are
    counted only up to ``limit + 1``, and inline arrays and tables are followed without recursion.

    Args:
        text: the TOML document (``\\r\\n`` line ends allowed, as ``tomllib`` allows them).
        limit: the largest nesting depth allowed (≥ 1).

    Returns:
        (depth reached, 1-based line number) at the first place deeper than ``limit``; None where the
        document never is — or stops being valid TOML first, which ``tomllib`` then reports.
    """
    src = text.replace("\r\n", "\n")
    pos, table_depth = 0, 0
    try:
        while True:
            pos = _WS.match(src, pos).end()  # type: ignore[union-attr]
            c = src[pos : pos + 1]
            if not c:
                return None
            if c == "\n":
                pos += 1
            elif c == "#":
                pos = _end_of_line(src, pos)
            elif c == "[":  # a table header; "[[" is an array of tables, one level more
                array_of_tables = src.startswith("[[", pos)
                pos = _WS.match(src, pos + 1 + array_of_tables).end()  # type: ignore[union-attr]
                pos, table_depth = _key(src, pos, int(array_of_tables), limit)
                if not src.startswith("]]" if array_of_tables else "]", pos):
                    return None
                pos = _end_of_line(src, pos)
            elif c in _KEY_INITIAL:
                pos, depth = _key_and_equals(src, pos, table_depth, limit)
                pos = _end_of_line(src, _value(src, pos, depth, limit))
            else:
                return None
    except _Stop:
        return None
    except _Over as over:
        return over.depth, src.count("\n", 0, over.pos) + 1
