"""JSON from peers, decoded only after its size and nesting depth are checked.

``json.loads`` recurses once per nesting level: 400,000 ``[`` in a row (400 KB) raise
``RecursionError`` deep inside the decoder. :func:`loads_bounded` counts the depth first, with a
scan that does not recurse, and refuses before decoding.
"""

from __future__ import annotations

import json
import re
from typing import Any

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.DOTALL)
"""A JSON string, to its closing quote or, unterminated, to the end: each match moves forward, so
removing them is linear even on hostile input."""
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def json_depth(raw: bytes, limit: int) -> int:
    """Nesting depth of the JSON text ``raw`` (brackets inside strings not counted); at most
    ``limit + 1`` is reported. Linear in ``len(raw)``, in C (regex, ``bytes.translate``, numpy)."""
    import numpy as np

    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET).translate(_STEP)
    if not brackets:
        return 0
    deepest = int(np.frombuffer(brackets, dtype=np.int8).cumsum(dtype=np.int64).max())
    return min(max(deepest, 0), limit + 1)


def loads_bounded(raw: bytes, *, max_bytes: int, max_depth: int) -> Any:
    """``json.loads(raw)`` once ``raw`` is at most ``max_bytes`` bytes and ``max_depth`` levels deep.

    Raises:
        ValueError: too large, too deep, or not JSON (the message says which).
    """
    if len(raw) > max_bytes:
        raise ValueError(f"answer of {len(raw)} bytes is larger than {max_bytes} bytes")
    if json_depth(raw, max_depth) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(raw)
    except RecursionError:  # pragma: no cover - the depth scan above refuses these first
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
