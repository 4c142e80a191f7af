"""Canonical msgpack: the one byte encoding of everything that is hashed or signed.

Rules (normative, see ``docs/protocol.md`` §2):

* maps have ``str`` keys only and are written in ascending order of the keys' UTF-8 bytes;
* ``bytes`` are msgpack *bin*, ``str`` are msgpack *str* (UTF-8);
* integers use the shortest msgpack form; floats are always float64 and never NaN or ±inf;
* no extension types, no ``None`` keys, nesting at most :data:`MAX_DEPTH` levels.

Decoding re-encodes the result and requires the identical bytes, so each value has exactly one
accepted encoding and a content ID or signature over it cannot be malleated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import DecodeError

MAX_DEPTH = 16


def _normalise(obj: Any, depth: int, max_depth: int = MAX_DEPTH) -> Any:
    if depth > max_depth:
        raise DecodeError(f"value nested deeper than {max_depth} levels")
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise DecodeError("NaN and infinite floats are not allowed in canonical msgpack")
        return obj
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, (list, tuple)):
        return [_normalise(x, depth + 1, max_depth) for x in obj]
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, str):
                raise DecodeError(f"map key {k!r} is not a string")
            items.append((k.encode("utf-8"), k, _normalise(v, depth + 1, max_depth)))
        items.sort(key=lambda kv: kv[0])
        return {k: v for _, k, v in items}
    raise DecodeError(f"type {type(obj).__name__} has no canonical msgpack encoding")


def packb(obj: Any) -> bytes:
    """Encode ``obj`` canonically.

    Args:
        obj: ``None``, bool, int (−2⁶³ … 2⁶⁴−1), finite float, str, bytes, list/tuple, or dict with
            str keys, nested at most :data:`MAX_DEPTH` deep.

    Returns:
        The canonical msgpack bytes.

    Raises:
        DecodeError: a value that has no canonical encoding (NaN, non-str key, unknown type).
    """
    return _pack(obj, MAX_DEPTH)


def _pack(obj: Any, max_depth: int) -> bytes:
    try:
        out: bytes = msgpack.packb(_normalise(obj, 0, max_depth), use_bin_type=True, use_single_float=False)
        return out
    except (OverflowError, ValueError) as e:  # ints out of msgpack's range
        raise DecodeError(f"cannot encode: {e}") from e


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds the msgpack decoder enforces *while* decoding (before any Python object walk).

    Derived per message type from its schema (:func:`protocol.messages.decode_limits`), so a
    peer cannot make the decoder allocate containers the schema would reject anyway.

    Attributes:
        max_bin_len: longest accepted bin, bytes.
        max_str_len: longest accepted str, UTF-8 bytes.
        max_array_len: most elements in one array.
        max_map_len: most entries in one map.
        max_depth: deepest container nesting (a scalar at top level is depth 0).
        max_containers: most arrays and maps in the whole value, counted as the decoder builds
            them. The C decoder checks nesting only against its own stack (1,024 levels) and the
            depth limit is checked after the value is built, so without this bound a body within
            every other limit could be nothing but empty arrays: one Python list (≈ 64 bytes) per
            input byte, 1.2 GB for an 8 MiB roster answer.
    """

    max_bin_len: int
    max_str_len: int
    max_array_len: int
    max_map_len: int
    max_depth: int = MAX_DEPTH
    max_containers: int = 1 << 62

    @classmethod
    def generic(cls, max_size: int) -> DecodeLimits:
        """Limits for a value without a schema: bins/strs up to ``max_size``, ≤ 65,536 array
        elements, ≤ 1,024 map entries and ≤ 65,536 containers in all."""
        return cls(max_size, max_size, min(max_size, 1 << 16), min(max_size, 1 << 10), MAX_DEPTH, min(max_size, 1 << 16))


class _TooManyContainers(Exception):
    """Raised inside the decoder's hooks to stop it at the container budget."""


def unpackb(data: bytes, max_size: int, limits: DecodeLimits | None = None, *, canonical: bool = True) -> Any:
    """Decode canonical msgpack with hard limits.

    Args:
        data: the encoded bytes.
        max_size: largest accepted input, in bytes.
        limits: container/bin/str/depth bounds checked by the C decoder; default
            :meth:`DecodeLimits.generic` of ``max_size``.
        canonical: check the canonical form here; ``False`` leaves it to the caller, who must
            call :func:`require_canonical` (e.g. after a cheap schema check that fails fast on
            junk, so junk never gets the Python walk the canonical check needs).

    Returns:
        The decoded value (dicts, lists, str, bytes, int, float, bool, None).

    Raises:
        DecodeError: oversized, truncated, trailing bytes, invalid UTF-8, extension types,
            a container/bin/str over ``limits``, more containers than ``limits.max_containers``
            (stopped when the next one is built), too deep, or not in canonical form.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_size:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {max_size} bytes")
    if not data:
        raise DecodeError("empty message")
    lim = limits or DecodeLimits.generic(max_size)
    hooks: dict[str, Any] = {}
    if lim.max_containers < len(data):  # each container takes at least one byte: a larger budget never binds
        left = lim.max_containers

        def count(container: Any) -> Any:
            nonlocal left
            left -= 1
            if left < 0:
                raise _TooManyContainers
            return container

        hooks = {"list_hook": count, "object_hook": count}
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=min(lim.max_bin_len, max_size),
            max_str_len=min(lim.max_str_len, max_size),
            max_array_len=min(lim.max_array_len, max_size),
            max_map_len=min(lim.max_map_len, max_size),
            max_ext_len=0,
            **hooks,
        )
    except _TooManyContainers:
        raise DecodeError(f"more than {lim.max_containers} arrays and maps in one message") from None
    except msgpack.ExtraData as e:
        raise DecodeError("trailing bytes after the message") from e
    except RecursionError as e:
        raise DecodeError("message nested too deeply") from e
    except (ValueError, TypeError, OverflowError) as e:  # msgpack's FormatError/StackError/UnicodeDecodeError are ValueErrors
        raise DecodeError(f"malformed msgpack: {type(e).__name__}: {e}") from e
    if canonical:
        require_canonical(obj, data, lim.max_depth)
    return obj


def require_canonical(obj: Any, data: bytes, max_depth: int = MAX_DEPTH) -> None:
    """Check that ``data`` is the canonical encoding of ``obj`` (what :func:`unpackb` decoded from it).

    Raises:
        DecodeError: not canonical, or nested deeper than ``max_depth``.
    """
    try:
        again = _pack(obj, max_depth)
    except RecursionError as e:
        raise DecodeError("message nested too deeply") from e
    if again != data:
        raise DecodeError("message is not in canonical msgpack form")
