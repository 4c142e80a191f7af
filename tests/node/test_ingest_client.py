"""node.ingest_client against scripted ingests on 127.0.0.1: routes from protocol.ingest_api,
answers classified once, Retry-After surfaced, lease answers bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from node.ingest_client import IngestClient, IngestUnavailable
from protocol.ingest_api import BANS_ROUTE, LEASE_ROUTE, SUBMISSIONS_ROUTE, VERDICTS_ROUTE, LeaseAnswer, pack_lease_answer


@asynccontextmanager
async def serve(routes: dict[str, Callable[[], web.Response] | bytes]) -> AsyncIterator[tuple[str, list[str]]]:
    """An ingest answering each route with fixed bytes or a fresh response; yields its URL and the paths hit."""
    hits: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        hits.append(request.path)
        answer = routes[request.path]
        return web.Response(body=answer) if isinstance(answer, bytes) else answer()

    app = web.Application()
    for path in routes:
        app.router.add_route("*", path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/", hits
    finally:
        await runner.cleanup()


def refuse(status: int, code: str, retry_after: str | None = None) -> Callable[[], web.Response]:
    headers = {"Retry-After": retry_after} if retry_after else None
    return lambda: web.json_response({"error": code, "detail": f"{code} detail"}, status=status, headers=headers)


async def test_a_final_refusal_settles_and_a_retry_answer_moves_to_the_next_ingest() -> None:
    async with serve({SUBMISSIONS_ROUTE: refuse(429, "backpressure", "2")}) as (busy, busy_hits), \
               serve({SUBMISSIONS_ROUTE: refuse(409, "stale_policy")}) as (stale, stale_hits):
        client = IngestClient([busy, stale], timeout_s=5.0)
        try:
            a = await client.post_submission(b"envelope")
            assert (a.status, a.outcome, a.code, a.url) == (409, "final", "stale_policy", stale.rstrip("/"))
            assert busy_hits == stale_hits == [SUBMISSIONS_ROUTE]
            await client.close()
            client = IngestClient([busy], timeout_s=5.0)
            b = await client.post_submission(b"envelope")
            assert (b.status, b.outcome, b.code, b.retry_after_s) == (429, "retry", "backpressure", 2.0)
        finally:
            await client.close()


async def test_nobody_listening_is_an_unreachable_answer_not_an_exception() -> None:
    async with serve({VERDICTS_ROUTE: b"{}"}) as (url, _):
        pass  # closed: nothing listens there any more
    client = IngestClient([url], timeout_s=5.0)
    try:
        a = await client.post_verdict(b"verdict")
        assert (a.status, a.outcome, a.disposition) == (0, "unreachable", None)
        assert (await IngestClient([], timeout_s=1.0).post_submission(b"x")).outcome == "unreachable"
    finally:
        await client.close()


async def test_lease_decodes_bounded_answers_and_reports_retry_after() -> None:
    async with serve({LEASE_ROUTE: pack_lease_answer([b"s1", b"s2"], 5), BANS_ROUTE: b"ban-list"}) as (url, _):
        client = IngestClient([url], timeout_s=5.0)
        try:
            assert await client.lease(b"request", 2) == LeaseAnswer([b"s1", b"s2"], 5)
            with pytest.raises(IngestUnavailable, match="bad lease answer"):
                await client.lease(b"request", 1)  # more submissions than asked for
            assert await client.get_bans() == b"ban-list"
        finally:
            await client.close()
    async with serve({LEASE_ROUTE: refuse(429, "busy", "7")}) as (url, _):
        client = IngestClient([url], timeout_s=5.0)
        try:
            with pytest.raises(IngestUnavailable) as e:
                await client.lease(b"request", 2)
            assert e.value.retry_after_s == 7.0 and e.value.answers[0].code == "busy"
        finally:
            await client.close()


async def test_a_large_lease_answer_is_decoded_as_it_arrives() -> None:
    """4 × 8 MiB leased envelopes: the client's peak memory stays near the decoded envelopes'
    (32 MiB), not the 2–3× of reading the answer whole, joining it and decoding a copy. The
    ingest is a plain socket thread (no Python buffer of its own to count)."""
    import socket
    import threading
    import tracemalloc

    envelopes = [bytes([i]) * (8 << 20) for i in range(4)]
    answer = pack_lease_answer(envelopes, 3)
    listener = socket.create_server(("127.0.0.1", 0))

    def ingest() -> None:
        conn, _ = listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: %d\r\n\r\n" % len(answer))
            conn.sendall(answer)

    server = threading.Thread(target=ingest, daemon=True)
    server.start()
    client = IngestClient([f"http://127.0.0.1:{listener.getsockname()[1]}"], timeout_s=60)
    try:
        tracemalloc.start()
        got = await client.lease(b"req", limit=4)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        await client.close()
        server.join(10)
        listener.close()
    assert got.submissions == envelopes and got.trainer_step == 3
    total = sum(len(e) for e in envelopes)
    assert peak < 1.5 * total, f"peak {peak / 2**20:.0f} MiB for {total / 2**20:.0f} MiB of envelopes"
