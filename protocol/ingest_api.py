"""The ingest's HTTP API, defined once: routes, the lease answer's format, error codes and what a
client does with each answer (``docs/protocol.md`` §8).

Pure (no sockets): the coordinator's server (``trainer/ingest/service.py``) registers these routes
and raises these codes; the one client (``node/ingest_client.py``), used by the worker's submitter,
the validator role and the tests, builds its URLs from them and decides with :func:`disposition`
whether to drop, retry later or give up.

Every error answer is JSON ``{"error": code, "detail": text}``. A code is one of three kinds:

* **final** — the same bytes will be refused again (malformed, banned, stale, replayed, too large,
  a compressed body, a key that is no validator): a client never retries it.
* **retry** — flow control (rate limit, backpressure, quotas, a full disk): retry the same bytes
  after the answer's ``Retry-After`` seconds (or the client's own back-off without one).
* **transient** — the transfer, not the bytes, failed (the body arrived too slowly or cut short):
  retry at most :data:`TRANSIENT_RETRIES` times, then give up.

An answer without a JSON code (another server in front, an old ingest) falls back on its HTTP
status: 400/403/409/413/415 final, 408 transient, 429/503/507 and other 5xx retry. Any other
status (404 from a wrong URL, …) is treated as *retry*: a misconfigured address must never make a
worker drop the submissions in its spool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgpack

from protocol import encoding
from protocol.errors import DecodeError
from protocol.messages import Submission

PREFIX: Final = "/ingest/1"
"""Versioned prefix of every ingest route."""
SUBMISSIONS_ROUTE: Final = f"{PREFIX}/submissions"
"""``POST`` a ``submission/1`` envelope; 200 JSON ``{"id", "stored", "displaced"}`` (``"duplicate", "state"`` when
already stored). ``displaced`` is how many of the signing worker's submissions are *displaced* now:
stored, then their place in the share of workers with no accepted submission went to a lighter
address allocation or prefix, so they get no verdict and are never trained on (no penalty either;
the same bytes posted again are stored again). A client that sees it rise has been displaced, and
may ask :data:`SUBMISSION_ROUTE` which ones."""
SUBMISSION_ROUTE: Final = f"{PREFIX}/submissions/{{id}}"
"""``GET`` one submission's state by its ID (64 lower-case hex digits): 200 JSON ``{"id", "state",
"reason"}`` with ``state`` one of :data:`SUBMISSION_STATES` and ``reason`` the deciding verdict's
reason (``"stale_policy"``, ``"banned"``, ``"displaced"``; ``""`` while pending); 404
``unknown_submission``. Public like ``/status`` and rate-limited as it is (IDs are unguessable)."""
SUBMISSION_STATES: Final = ("pending", "accepted", "rejected", "displaced")
"""What the ingest calls a submission's state (``trainer.ledger.states.public_state``)."""


def submission_path(submission_id: str) -> str:
    """The path of :data:`SUBMISSION_ROUTE` for a submission ID (hex)."""
    return SUBMISSION_ROUTE.replace("{id}", submission_id)

LEASE_ROUTE: Final = f"{PREFIX}/lease"
"""``POST`` a validator's ``lease_request/1``; 200 msgpack ``{"submissions": [bin…], "trainer_step": int}``
(:func:`pack_lease_answer`): at most the request's ``limit`` pending submissions, each leased for its
``lease_s``, and the coordinator's trainer step (``protocol.window``)."""
VERDICTS_ROUTE: Final = f"{PREFIX}/verdicts"
"""``POST`` a ``verdict/1`` envelope of a run validator; 200 JSON ``{"applied": bool}``."""
BANS_ROUTE: Final = f"{PREFIX}/bans"
"""``GET`` the coordinator-signed ``ban_list/1`` envelope."""
WORKER_ROUTE: Final = f"{PREFIX}/workers/{{peer_id}}"
"""``GET`` the coordinator-signed ``worker_standing/1`` envelope of one worker (``protocol.messages.WorkerStanding``):
its submissions accepted, rejected by reason, trained on, and its leaderboard place. 400 for a
malformed peer ID; rate-limited like ``/status`` (429 ``rate_limited``)."""


def worker_path(peer_id: str) -> str:
    """The path of one worker's standing (:data:`WORKER_ROUTE`)."""
    return WORKER_ROUTE.format(peer_id=peer_id)

LEASE_CONTENT_TYPE: Final = "application/msgpack"


def lease_answer_max_bytes(limit: int) -> int:
    """Largest lease answer to a request for ``limit`` submissions: ``limit`` envelopes of at most
    ``Submission.MAX_BYTES`` each, with msgpack framing, bytes."""
    return limit * (Submission.MAX_BYTES + 8) + 32


TRANSIENT_RETRIES: Final = 3
"""How often a client re-sends after a *transient* answer (408, a cut-short body) before giving up."""
MAX_RETRY_AFTER_S: Final = 300.0
"""A ``Retry-After`` above this many seconds is capped (a hostile or broken server cannot park a client)."""

Kind = Literal["final", "retry", "transient"]

ERROR_CODES: Final[dict[str, tuple[int, Kind]]] = {
    "malformed": (400, "final"),  # any ProtocolError of the envelope, naming the field
    "truncated": (400, "transient"),  # body shorter than its Content-Length
    "banned": (403, "final"),
    "not_validator": (403, "final"),  # the lease request is not signed by a validator of the spec, or too old
    "timeout": (408, "transient"),  # body not received whole in time
    "stale_policy": (409, "final"),  # policy step outside [trainer_step − async_level, published step]
    "replay": (409, "final"),  # counter already used by this worker, or a lease request already served
    "too_large": (413, "final"),
    "unsupported_encoding": (415, "final"),  # a Content-Encoding other than identity
    "rate_limited": (429, "retry"),
    "backpressure": (429, "retry"),  # the worker has its quota of unjudged submissions
    "busy": (429, "retry"),  # too many body bytes in flight, or too many lease requests
    "quota": (507, "retry"),
    "ip_quota": (507, "retry"),
    "probation_quota": (507, "retry"),  # workers with no accepted submission yet hold their share of the disk quota
    "disk_quota": (507, "retry"),
    "disk_full": (507, "retry"),
    "storage_failed": (503, "retry"),  # the ingest could not write or commit it (disk error): nothing stored
    "unknown_submission": (404, "final"),  # GET of a submission's state: no such submission
}
"""Every error code the ingest answers with: its HTTP status and what a client does with it."""

_STATUS_FALLBACK: Final[dict[int, tuple[str, Kind]]] = {
    400: ("malformed", "final"),
    403: ("banned", "final"),
    408: ("timeout", "transient"),
    409: ("stale_policy", "final"),
    413: ("too_large", "final"),
    415: ("unsupported_encoding", "final"),
}


@dataclass(frozen=True)
class Disposition:
    """What a client does with one answer of the ingest.

    Attributes:
        outcome: ``"ok"`` (2xx), or the error's kind: ``"final"``, ``"retry"``, ``"transient"``.
        code: the error code (the JSON ``error`` field, else one derived from the status), ``""`` on success.
        retry_after_s: the answer's ``Retry-After`` in seconds (capped at :data:`MAX_RETRY_AFTER_S`), or ``None``.
    """

    outcome: Literal["ok", "final", "retry", "transient"]
    code: str
    retry_after_s: float | None


def retry_after_seconds(header: str | None) -> float | None:
    """Parse a ``Retry-After`` header given in seconds (RFC 9110 §10.2.3); an HTTP date or junk gives ``None``.

    Returns:
        Seconds in ``[0, MAX_RETRY_AFTER_S]``, or ``None``.
    """
    if header is None:
        return None
    try:
        s = float(header.strip()[:16])
    except ValueError:
        return None
    if math.isnan(s) or s < 0:
        return None
    return min(s, MAX_RETRY_AFTER_S)


def disposition(status: int, body: Any = None, retry_after: str | None = None) -> Disposition:
    """Classify one ingest answer (see the module docstring).

    Args:
        status: the HTTP status.
        body: the decoded JSON body, if it was JSON (its ``error`` field names the code).
        retry_after: the ``Retry-After`` header, if any.

    Returns:
        The :class:`Disposition`.
    """
    after = retry_after_seconds(retry_after)
    if 200 <= status < 300:
        return Disposition("ok", "", after)
    code = body.get("error") if isinstance(body, dict) else None
    if isinstance(code, str) and code in ERROR_CODES and ERROR_CODES[code][0] == status:
        return Disposition(ERROR_CODES[code][1], code, after)
    if status in _STATUS_FALLBACK:
        name, kind = _STATUS_FALLBACK[status]
        return Disposition(kind, name, after)
    return Disposition("retry", f"http_{status}", after)


@dataclass(frozen=True)
class LeaseAnswer:
    """A decoded lease answer.

    Attributes:
        submissions: the leased ``submission/1`` envelopes, still unverified (open each with ``open_envelope``).
        trainer_step: the coordinator's trainer step when it answered (:mod:`protocol.window`'s ``n``:
            what a validator judges freshness against), or ``None`` from an ingest that does not say.
    """

    submissions: list[bytes]
    trainer_step: int | None


def pack_lease_answer(submissions: list[bytes], trainer_step: int) -> bytes:
    """The body of a 200 lease answer: canonical msgpack ``{"submissions": [bin…], "trainer_step": int}``."""
    return encoding.packb({"submissions": list(submissions), "trainer_step": int(trainer_step)})


def _no_container(_: object) -> object:
    """Decoder hook of :class:`LeaseAnswerReader`: its arrays and maps are read as headers, so one
    built by ``unpack()`` stands where a submission (bin) or the trainer step (int) belongs. Refused
    as soon as the first is complete: a 32 MiB tree of empty arrays there took ≈ 2 GB to build."""
    raise DecodeError("lease answer holds an array or map where a submission or the trainer step belongs")


class LeaseAnswerReader:
    """Decodes the answer to a lease request for ``limit`` submissions as its bytes arrive.

    A lease answer may be ``limit`` × 32 MiB. Reading it whole and then decoding held it two to
    three times over (the received chunks, their join, the decoded envelopes); fed chunk by chunk
    here, each envelope is taken out of the stream as soon as it is complete, so the peak is the
    decoded envelopes plus one envelope's bytes. Bounded before decoding: at most
    :func:`lease_answer_max_bytes` in all, ``limit`` envelopes of at most ``Submission.MAX_BYTES``.
    The answer is not signed, so its canonical form is not checked (only its shape).

    Usage: :meth:`feed` every chunk, then :meth:`result`.

    Raises (from :meth:`feed` or :meth:`result`):
        DecodeError: oversized, cut short, trailing bytes, or not ``{"submissions": [bin…], "trainer_step": int}``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bound = lease_answer_max_bytes(limit)
        self.received = 0
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=Submission.MAX_BYTES + (2 << 20),
                                          max_bin_len=Submission.MAX_BYTES, max_str_len=16, max_array_len=limit, max_map_len=2,
                                          max_ext_len=0, list_hook=_no_container, object_hook=_no_container)
        self._stage = "map"
        self._n_keys = 0
        self._keys: list[str] = []
        self._left = 0  # envelopes still to come in the array being read
        self.submissions: list[bytes] = []
        self.trainer_step: int | None = None

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the answer and decode what they complete."""
        self.received += len(chunk)
        if self.received > self.bound:
            raise DecodeError(f"lease answer exceeds {self.bound} bytes")
        try:
            self._unpacker.feed(chunk)
            while self._step():
                pass
        except msgpack.OutOfData:
            return
        except (ValueError, TypeError, msgpack.UnpackException) as e:  # over a bound, bad type, invalid data
            raise DecodeError(f"bad lease answer: {type(e).__name__}: {e}") from None

    def _step(self) -> bool:
        """Decode one more item; ``False`` once the answer is complete."""
        u = self._unpacker
        if self._stage == "map":
            self._n_keys = u.read_map_header()  # 1: an ingest that does not send its trainer step
            if self._n_keys not in (1, 2):
                raise DecodeError("lease answer is not {'submissions': [bin…], 'trainer_step': int}")
            self._stage = "key"
        elif self._stage == "key":
            if len(self._keys) == self._n_keys:
                self._stage = "done"
                return True
            key = u.unpack()
            expected = ("submissions", "trainer_step")[len(self._keys)]
            if key != expected:
                raise DecodeError(f"lease answer has key {str(key)[:16]!r} where {expected!r} belongs")
            self._keys.append(key)
            self._stage = key
        elif self._stage == "submissions":
            self._left = u.read_array_header()
            if self._left > self.limit:
                raise DecodeError(f"lease answer holds {self._left} submissions, more than the {self.limit} asked for")
            self._stage = "envelopes"
        elif self._stage == "envelopes":
            if self._left == 0:
                self._stage = "key"
                return True
            env = u.unpack()
            if not isinstance(env, bytes):
                raise DecodeError("a leased submission is not bin")
            self.submissions.append(env)
            self._left -= 1
        elif self._stage == "trainer_step":
            step = u.unpack()
            if not isinstance(step, int) or isinstance(step, bool) or not -(2**62) < step < 2**62:
                raise DecodeError("lease answer's trainer_step is not an int")
            self.trainer_step = step
            self._stage = "key"
        else:
            return False
        return True

    def result(self) -> LeaseAnswer:
        """The decoded answer (call after the last :meth:`feed`)."""
        if self._stage != "done":
            raise DecodeError("lease answer cut short")
        try:
            self._unpacker.skip()
        except msgpack.OutOfData:
            return LeaseAnswer(self.submissions, self.trainer_step)
        raise DecodeError("trailing bytes after the lease answer")


def unpack_lease_answer(data: bytes, limit: int) -> LeaseAnswer:
    """Decode a whole answer to a lease request for ``limit`` submissions (:class:`LeaseAnswerReader`).

    Raises:
        DecodeError: oversized, not msgpack, or not ``{"submissions": [bin…], "trainer_step": int}``.
    """
    reader = LeaseAnswerReader(limit)
    reader.feed(data)
    return reader.result()
