"""Reading an HTTP answer's body whole, bounded: the one way the node's small JSON/TOML/msgpack
fetches read what a peer sent.

aiohttp's ``StreamReader.read(n)`` returns *up to* ``n`` bytes — whatever has arrived — so one call
can return a body cut at a TCP segment boundary (a 3 KB run spec over a real link comes in several);
this reads until the end of the body, never more than ``limit + 1`` bytes off the stream.
"""

from __future__ import annotations

import aiohttp

__all__ = ["BodyTooLarge", "read_body"]

CHUNK_BYTES = 1 << 16
"""Bytes asked of the stream per read."""


class BodyTooLarge(ValueError):
    """The body is, or declares to be, longer than the limit."""


async def read_body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of ``resp``, at most ``limit`` bytes.

    Args:
        resp: an answer whose body has not been read.
        limit: most bytes accepted.

    Returns:
        The body.

    Raises:
        BodyTooLarge: ``Content-Length`` declares more than ``limit``, or more than ``limit`` bytes
            arrive (only ``limit + 1`` are read).
        aiohttp.ClientError, TimeoutError: the transport failed (the session's timeouts apply).
    """
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge(f"a body of {resp.content_length} bytes declared, over the {limit}-byte limit")
    buf = bytearray()
    while chunk := await resp.content.read(min(CHUNK_BYTES, limit + 1 - len(buf))):
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(f"a body over the {limit}-byte limit")
    return bytes(buf)
