"""Handing freed heap memory back to the kernel after a model is dropped.

glibc's ``malloc`` serves an allocation above its mmap threshold with its own ``mmap`` (given back
on ``free``), and below it from a heap arena (kept for reuse). The threshold is dynamic: freeing an
mmapped block raises it to that block's size, up to 32 MiB on 64-bit. So after the first model a
process frees, the next model's tensors under 32 MiB (at the 0.5B profile every decoder weight:
17 MiB for an MLP matrix in float32) come from the arena of the thread that loads it, and freeing
that model leaves them there. Loads run in ``asyncio.to_thread``'s pool, a different thread and
arena each time, so the next load does not reuse them: measured at the 0.5B profile (float32,
1.84 GiB), the third load in a new thread held 3.50 GiB resident instead of 2.20 GiB, and a
validator's resident set rose by 0.86 GiB at its second model swap (issue #25's profile devnet).
:func:`release_free_memory` after dropping a model gives those pages back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)


@functools.cache
def _libc() -> Any | None:
    """glibc, when the process runs on it (``None`` elsewhere: musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_free_memory() -> bool:
    """Give free heap memory of every arena back to the kernel (glibc ``malloc_trim(0)``).

    Blocking, ≈ milliseconds per GiB of free heap. Call after dropping the last reference to a
    large object (a model), not in a hot loop.

    Returns:
        Whether memory was given back (``False`` also where the C library has no ``malloc_trim``).
    """
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))
