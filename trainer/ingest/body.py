"""Request bodies: read whole under a deadline and a rate floor, and counted in memory as they arrive.

A body costs the coordinator what it has *received*, not what its ``Content-Length`` declares:
reserving the declared length up front let 18 connections from 6 addresses, each declaring
32 MiB and sending nothing, hold the whole in-flight budget for 30 s, and every honest submission
got 429 meanwhile. Here (``docs/protocol.md`` "Ingest budgets"):

* :class:`BodyBudget` counts each body's bytes as they arrive, per address and in all. An address
  may hold at most its share; when the total is full, a body from an address holding less than
  the heaviest address *evicts* that address's largest unfinished body (which is answered 429
  ``busy``): an address can only be pushed out by one holding more than it, so many addresses
  together cannot lock out one that holds little.
* :func:`read_body` enforces a rate floor: after a grace period, a body that has arrived slower
  than ``min_rate_bytes_per_s`` on average is cut off (408), so a slow sender holds what it sent
  for seconds, not for the whole body deadline; a sender of nothing is dropped after the grace.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from trainer.errors import Refused


class BodyBudget:
    """Body bytes held in memory: at most ``per_address`` for one address and ``total`` in all.

    Event-loop only (no lock). Eviction cancels the evicted body's handler task, which
    :meth:`Ticket.evicted` lets it recognise and answer 429 (``trainer/ingest/service.py``).

    Args:
        per_address: bytes one address may hold.
        total: bytes all addresses may hold together.
    """

    def __init__(self, per_address: int, total: int) -> None:
        self.per_address = per_address
        self.total = total
        self.held = 0
        self.by_address: dict[str, int] = {}
        self._tickets: dict[str, set[Ticket]] = {}
        self.evictions = 0

    def ticket(self, address: str) -> Ticket:
        """A ticket for one body from ``address``, owned by the running task (the one an eviction cancels)."""
        t = Ticket(self, address, asyncio.current_task())
        self._tickets.setdefault(address, set()).add(t)
        return t

    def _take(self, t: Ticket, n: int) -> None:
        if t.evicted:
            raise Refused("busy", "this body was evicted; retry later", retry_after_s=1.0)
        mine = self.by_address.get(t.address, 0)
        if mine + n > self.per_address:
            raise Refused("busy", f"address {t.address} has {mine} request bytes in flight, its share; retry later", retry_after_s=1.0)
        while self.held + n > self.total:
            victim = self._heaviest_other(t.address)
            if victim is None or self.by_address.get(victim, 0) <= mine + n:
                raise Refused("busy", f"{self.held} request bytes in flight, the ingest's limit; retry later", retry_after_s=1.0)
            self._evict(max((x for x in self._tickets[victim] if x.evictable), key=lambda x: x.held))
        self.by_address[t.address] = mine + n
        self.held += n
        t.held += n

    def _heaviest_other(self, address: str) -> str | None:
        """The address other than ``address`` that holds the most bytes in evictable bodies."""
        best, most = None, 0
        for a, tickets in self._tickets.items():
            if a != address and any(x.evictable and x.held for x in tickets) and self.by_address.get(a, 0) > most:
                best, most = a, self.by_address[a]
        return best

    def _evict(self, t: Ticket) -> None:
        t.evicted = True
        self.evictions += 1
        self._release(t)
        if t.task is not None and not t.task.done():
            t.task.cancel()

    def _release(self, t: Ticket) -> None:
        if t.held:
            left = self.by_address[t.address] - t.held
            if left:
                self.by_address[t.address] = left
            else:
                del self.by_address[t.address]
            self.held -= t.held
            t.held = 0

    def _close(self, t: Ticket) -> None:
        self._release(t)
        tickets = self._tickets.get(t.address)
        if tickets is not None:
            tickets.discard(t)
            if not tickets:
                del self._tickets[t.address]


@dataclass(eq=False)
class Ticket:
    """One body's share of a :class:`BodyBudget`.

    Attributes:
        address: the sender's address key; task: the handler task an eviction cancels.
        held: bytes counted for this body. evictable: while it is read or waits to be decoded.
        evicted: it was pushed out (its bytes are no longer counted; its task was cancelled).
    """

    budget: BodyBudget
    address: str
    task: asyncio.Task[object] | None
    held: int = 0
    evictable: bool = True
    evicted: bool = field(default=False)

    def take(self, n: int) -> None:
        """Count ``n`` more received bytes.

        Raises:
            Refused: ``busy`` — the address holds its share, or the total is full and no address
                holds more than this one's would.
        """
        self.budget._take(self, n)

    def settle(self) -> None:
        """The body is complete and being decoded: no longer evictable."""
        self.evictable = False

    def close(self) -> None:
        """The request is done: its bytes are no longer held."""
        self.budget._close(self)


class BodyError(Exception):
    """A request body refused while reading it: ``code`` ``timeout`` (408), ``too_large`` (413) or ``truncated`` (400)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


async def read_body(request: web.Request, limit: int, timeout_s: float, *, ticket: Ticket | None = None,
                    min_rate_bytes_per_s: float = 0.0, grace_s: float = 0.0) -> bytes:
    """Read the whole request body, at most ``limit`` bytes, within ``timeout_s`` seconds.

    Unlike ``request.content.read(n)``, which returns only what is already buffered (so bodies
    over ≈ 384 KiB came back cut and were refused as malformed), this waits for every byte the
    client declared or, for a chunked body, for its end. Each chunk is counted in ``ticket`` as
    it arrives; with ``min_rate_bytes_per_s``, a body whose bytes so far arrived slower than that
    (after ``grace_s`` seconds) is cut off.

    Raises:
        BodyError: 413 over ``limit`` (declared or sent), 408 not received in time or too slowly,
            400 cut short.
        Refused: ``busy`` from the ticket (its address's share or the total is full).
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError("too_large", f"body of {declared} bytes exceeds {limit} bytes")
    want = declared if declared is not None else limit + 1
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + timeout_s
    chunks: list[bytes] = []
    got = 0
    try:
        async with asyncio.timeout_at(end) as deadline:
            while got < want:
                if min_rate_bytes_per_s > 0:
                    deadline.reschedule(min(end, start + grace_s + got / min_rate_bytes_per_s))
                data = await request.content.read(min(1 << 20, want - got))
                if not data:
                    break
                if ticket is not None:
                    ticket.take(len(data))
                chunks.append(data)
                got += len(data)
                if declared is None and got > limit:
                    raise BodyError("too_large", f"body exceeds {limit} bytes")
    except TimeoutError:
        if loop.time() >= end:
            raise BodyError("timeout", f"body not received within {timeout_s} s") from None
        raise BodyError("timeout", f"body arrived slower than {min_rate_bytes_per_s:.0f} bytes/s ({got} bytes in "
                                   f"{loop.time() - start:.1f} s)") from None
    except (HttpProcessingError, ConnectionError) as e:
        raise BodyError("truncated", f"body ended after {got} of {declared} bytes ({type(e).__name__})") from None
    if declared is not None and got < declared:
        raise BodyError("truncated", f"body ended after {got} of {declared} bytes")
    return b"".join(chunks)
