"""Measuring what a decoder allocates before it refuses hostile bytes, and the bytes that make it.

Shared by the decoding attacks on presence answers, signed bodies and lease answers: each builds
its attack in a few hundred KiB and asserts the decoder refuses it before it has built what the
bytes describe (a ``tracemalloc`` peak under :data:`PEAK_LIMIT`) and with an error naming what was wrong.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

PEAK_LIMIT = 4 << 20
"""Most bytes an attack may make the decoder allocate (each describes ≥ 16 MiB of Python objects)."""


def peak(fn: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """What ``fn`` raised (``None`` when it returned) and the peak bytes it allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        error: BaseException | None = None
    except Exception as e:  # noqa: BLE001 - returned to the test
        error = e
    finally:
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return error, top


def empty_arrays(n_bytes: int, fanout: int = 4096) -> bytes:
    """A msgpack tree of arrays of at most ``fanout`` elements with empty arrays for leaves, about
    ``n_bytes`` long: one Python list per byte."""
    level = b"\x90"
    while True:
        n = min(fanout, max(1, n_bytes // len(level)))
        level = b"\xdc" + struct.pack(">H", n) + level * n
        if n < fanout or len(level) >= n_bytes:
            return level
