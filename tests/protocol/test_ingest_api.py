"""protocol.ingest_api: the ingest's routes, lease answer and error codes, defined once."""

from __future__ import annotations

import pytest

from protocol import encoding
from protocol.errors import DecodeError
from protocol.ingest_api import (
    ERROR_CODES,
    LeaseAnswer,
    MAX_RETRY_AFTER_S,
    disposition,
    lease_answer_max_bytes,
    pack_lease_answer,
    retry_after_seconds,
    unpack_lease_answer,
)
from protocol.messages import Submission


@pytest.mark.parametrize(("code", "status", "outcome"), [
    ("stale_policy", 409, "final"), ("replay", 409, "final"), ("banned", 403, "final"), ("too_large", 413, "final"),
    ("malformed", 400, "final"), ("unsupported_encoding", 415, "final"), ("not_validator", 403, "final"),
    ("truncated", 400, "transient"), ("timeout", 408, "transient"),
    ("rate_limited", 429, "retry"), ("backpressure", 429, "retry"), ("busy", 429, "retry"), ("disk_full", 507, "retry"),
    ("storage_failed", 503, "retry"),
])
def test_each_code_has_one_status_and_one_meaning(code: str, status: int, outcome: str) -> None:
    assert ERROR_CODES[code] == (status, outcome)
    d = disposition(status, {"error": code, "detail": "x"}, "3")
    assert (d.outcome, d.code, d.retry_after_s) == (outcome, code, 3.0)


def test_answers_without_a_code_fall_back_on_the_status_and_unknown_ones_keep_the_data() -> None:
    assert disposition(200).outcome == "ok"
    assert (disposition(409).outcome, disposition(409).code) == ("final", "stale_policy")
    assert disposition(413, "not json").outcome == "final"
    assert disposition(408).outcome == "transient"
    assert disposition(503).outcome == "retry" and disposition(429).outcome == "retry"
    assert (disposition(404).outcome, disposition(404).code) == ("retry", "http_404")  # a wrong URL never drops work
    # a code that does not belong to the status is not believed
    assert disposition(429, {"error": "banned"}).outcome == "retry"


def test_retry_after_is_parsed_in_seconds_and_capped() -> None:
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(" 0.5 ") == 0.5
    assert retry_after_seconds("99999") == MAX_RETRY_AFTER_S
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_seconds("-1") is None and retry_after_seconds("nan") is None and retry_after_seconds(None) is None


def test_lease_answer_round_trip_and_bounds() -> None:
    blobs = [b"a" * 10, b"b" * 20]
    assert unpack_lease_answer(pack_lease_answer(blobs, 7), 2) == LeaseAnswer(blobs, 7)
    assert unpack_lease_answer(pack_lease_answer([], 0), 1) == LeaseAnswer([], 0)
    assert unpack_lease_answer(encoding.packb({"submissions": blobs}), 2) == LeaseAnswer(blobs, None)  # an ingest that does not say
    with pytest.raises(DecodeError):
        unpack_lease_answer(pack_lease_answer(blobs, 7), 1)  # more than asked for
    with pytest.raises(DecodeError):
        unpack_lease_answer(encoding.packb({"submissions": ["text"]}), 4)
    with pytest.raises(DecodeError):
        unpack_lease_answer(encoding.packb({"submissions": [], "trainer_step": "3"}), 4)
    with pytest.raises(DecodeError):
        unpack_lease_answer(encoding.packb([b"x"]), 4)
    with pytest.raises(DecodeError):
        unpack_lease_answer(b"\x00" * (lease_answer_max_bytes(1) + 1), 1)
    assert lease_answer_max_bytes(8) >= 8 * Submission.MAX_BYTES
