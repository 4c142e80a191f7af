"""The one client of the coordinator's ingest (``docs/protocol.md`` §8), used by the worker's
submitter, the validator role and the tests.

Routes, the lease answer's format and what each answer means come from
:mod:`protocol.ingest_api`, the same module the server registers its routes from; this module only
moves bytes: it tries each ingest URL in turn, reads every answer within a bound, and reports the
answer with its :class:`~protocol.ingest_api.Disposition` (ok / final / retry / transient, the
error code, ``Retry-After``). Pacing the retries is the caller's (with :class:`node.retry.Backoff`,
never sooner than the answer's ``Retry-After``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from node.timeouts import INGEST_REQUEST_TIMEOUT_S
from protocol.errors import DecodeError
from protocol.ingest_api import (
    BANS_ROUTE,
    LEASE_ROUTE,
    SUBMISSIONS_ROUTE,
    VERDICTS_ROUTE,
    Disposition,
    LeaseAnswer,
    LeaseAnswerReader,
    disposition,
    lease_answer_max_bytes,
    submission_path,
)
from protocol.messages import BanList

JSON_ANSWER_MAX_BYTES = 64 << 10
"""Largest JSON answer (or error) read from an ingest, bytes."""


@dataclass(frozen=True)
class IngestAnswer:
    """One ingest's answer to one request, or why there was none.

    Attributes:
        url: the ingest base URL that answered (or failed).
        status: the HTTP status; 0 when no answer came (connection error, timeout, oversized answer).
        disposition: what to do with it (:func:`protocol.ingest_api.disposition`); ``None`` when ``status`` is 0.
        detail: the answer's text (≤ 300 characters) or the connection error.
        body: the answer's bytes (for a 200), else ``b""``.
        json: the decoded JSON answer, or ``None``.
    """

    url: str
    status: int
    disposition: Disposition | None
    detail: str
    body: bytes = b""
    json: Any = None

    @property
    def ok(self) -> bool:
        return self.disposition is not None and self.disposition.outcome == "ok"

    @property
    def outcome(self) -> str:
        """``"ok"``, ``"final"``, ``"retry"``, ``"transient"``, or ``"unreachable"`` (no answer)."""
        return "unreachable" if self.disposition is None else self.disposition.outcome

    @property
    def code(self) -> str:
        return "" if self.disposition is None else self.disposition.code

    @property
    def retry_after_s(self) -> float | None:
        return None if self.disposition is None else self.disposition.retry_after_s


class IngestUnavailable(Exception):
    """No ingest URL gave a usable answer; ``answers`` holds each URL's (``[]``: no URL configured)."""

    def __init__(self, answers: list[IngestAnswer]) -> None:
        self.answers = answers
        parts = [f"{a.url} unreachable: {a.detail[:200]}" if a.status == 0 else f"{a.url} refused: {a.status} {a.detail[:200]}"
                 for a in answers]
        super().__init__("; ".join(parts) or "no ingest URL")

    @property
    def retry_after_s(self) -> float | None:
        """The longest ``Retry-After`` any ingest asked for, seconds, or ``None``."""
        return max((a.retry_after_s for a in self.answers if a.retry_after_s is not None), default=None)


async def _read_bounded(r: aiohttp.ClientResponse, limit: int, sink: Callable[[bytes], None] | None = None) -> bytes:
    """The whole answer body, refusing more than ``limit`` bytes (``ValueError``); with ``sink``,
    each chunk is handed to it as it arrives instead (and ``b""`` returned), so a large answer is
    never held whole next to what is decoded from it."""
    if r.content_length is not None and r.content_length > limit:
        raise ValueError(f"answer of {r.content_length} bytes exceeds {limit}")
    chunks: list[bytes] = []
    got = 0
    while True:
        data = await r.content.read(min(1 << 20, limit + 1 - got))
        if not data:
            return b"".join(chunks)
        got += len(data)
        if got > limit:
            raise ValueError(f"answer exceeds {limit} bytes")
        if sink is not None:
            sink(data)
        else:
            chunks.append(data)


class IngestClient:
    """Talks to the coordinator's ingest at one or more base URLs (``http://host:port``).

    Args:
        urls: ingest base URLs, tried in order; trailing slashes ignored.
        timeout_s: per-request timeout (connect, send and read), seconds.
    """

    def __init__(self, urls: list[str], *, timeout_s: float = INGEST_REQUEST_TIMEOUT_S) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def request(self, url: str, method: str, route: str, data: bytes | None = None, *,
                      max_answer_bytes: int = JSON_ANSWER_MAX_BYTES, sink: Callable[[bytes], None] | None = None) -> IngestAnswer:
        """One request to one ingest; never raises for a network failure (``status`` 0 instead).

        ``sink`` takes a 200 answer's bytes as they arrive (its ``body`` is then ``b""``); it may
        raise ``DecodeError`` to abandon the answer (the error is raised from here).
        """
        headers = {"Content-Type": "application/octet-stream"} if data is not None else None
        try:
            async with self._http().request(method, f"{url}{route}", data=data, headers=headers) as r:
                status = r.status
                retry_after = r.headers.get("Retry-After")
                limit = max_answer_bytes if status == 200 else JSON_ANSWER_MAX_BYTES
                body = await _read_bounded(r, limit, sink if status == 200 else None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            return IngestAnswer(url, 0, None, f"{type(e).__name__}: {e}")
        parsed: Any = None
        if body[:1] in (b"{", b"["):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        detail = body[:300].decode("utf-8", "replace")
        return IngestAnswer(url, status, disposition(status, parsed, retry_after), detail, body if status == 200 else b"", parsed)

    async def _first(self, method: str, route: str, data: bytes | None, *, settle_on_final: bool,
                     max_answer_bytes: int = JSON_ANSWER_MAX_BYTES) -> tuple[IngestAnswer | None, list[IngestAnswer]]:
        """Try each URL until one answers ok (or, with ``settle_on_final``, refuses for good)."""
        answers: list[IngestAnswer] = []
        for url in self.urls:
            a = await self.request(url, method, route, data, max_answer_bytes=max_answer_bytes)
            answers.append(a)
            if a.ok or (settle_on_final and a.outcome == "final"):
                return a, answers
        return None, answers

    async def post_submission(self, envelope: bytes) -> IngestAnswer:
        """``POST`` a ``submission/1`` envelope to the first ingest that accepts or refuses it for good.

        Returns:
            That answer; else the last URL's answer (retry, transient or unreachable), or an
            unreachable answer with URL ``""`` when no URL is configured.
        """
        settled, answers = await self._first("POST", SUBMISSIONS_ROUTE, envelope, settle_on_final=True)
        return settled or (answers[-1] if answers else IngestAnswer("", 0, None, "no ingest URL"))

    async def submission_state(self, submission_id: str) -> IngestAnswer:
        """``GET`` a submission's state (``protocol.ingest_api.SUBMISSION_ROUTE``) from the first ingest
        that knows it (its ``json``: ``{"id", "state", "reason"}``) or says it does not (404
        ``unknown_submission``, final); else the last URL's answer."""
        settled, answers = await self._first("GET", submission_path(submission_id), None, settle_on_final=True)
        return settled or (answers[-1] if answers else IngestAnswer("", 0, None, "no ingest URL"))

    async def post_verdict(self, envelope: bytes) -> IngestAnswer:
        """``POST`` a ``verdict/1`` envelope; same answer rule as :meth:`post_submission`."""
        settled, answers = await self._first("POST", VERDICTS_ROUTE, envelope, settle_on_final=True)
        return settled or (answers[-1] if answers else IngestAnswer("", 0, None, "no ingest URL"))

    async def lease(self, request: bytes, limit: int) -> LeaseAnswer:
        """Lease pending submissions with a signed ``lease_request/1`` for ``limit`` of them.

        Returns:
            The leased envelopes (unverified: open each with ``open_envelope``) and the
            coordinator's trainer step.

        Raises:
            IngestUnavailable: no ingest leased (each one's answer attached, with ``Retry-After``).
        """
        answers: list[IngestAnswer] = []
        for url in self.urls:
            reader = LeaseAnswerReader(limit)  # decoded as it arrives: never held twice
            try:
                a = await self.request(url, "POST", LEASE_ROUTE, request, max_answer_bytes=lease_answer_max_bytes(limit), sink=reader.feed)
                if a.ok:
                    return reader.result()
            except DecodeError as e:
                a = IngestAnswer(url, 0, None, f"bad lease answer: {e}")
            answers.append(a)
        raise IngestUnavailable(answers)

    async def get_bans(self) -> bytes:
        """The coordinator-signed ``ban_list/1`` envelope from the first ingest that serves it (unverified).

        Raises:
            IngestUnavailable: no ingest served it.
        """
        settled, answers = await self._first("GET", BANS_ROUTE, None, settle_on_final=False, max_answer_bytes=BanList.MAX_BYTES)
        if settled is None:
            raise IngestUnavailable(answers)
        return settled.body
