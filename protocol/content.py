"""Content IDs: SHA-256 of bytes, streamed for large inputs.

SHA-256 rather than BLAKE3 because it needs no extra dependency, runs at ≈1.5–2 GB/s per core
with the SHA-NI instructions OpenSSL uses on current x86 and ARM CPUs (faster than a loopback
HTTP transfer, so it is never the bottleneck), and is what libp2p multihashes and most tooling
understand (``sha256sum`` verifies a piece by hand). See ``docs/protocol.md`` §4.
"""

from __future__ import annotations

import hashlib
from typing import NewType

ContentId = NewType("ContentId", bytes)

CONTENT_ID_BYTES = 32


def content_id(data: bytes | bytearray | memoryview) -> ContentId:
    """The 32-byte content ID (SHA-256) of ``data``."""
    return ContentId(hashlib.sha256(data).digest())


def hex_id(cid: bytes) -> str:
    """Lower-case hex spelling of a content ID, as used in URLs and file names."""
    return cid.hex()
