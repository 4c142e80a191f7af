"""Decoders that cannot amplify (issue 12, item 4) and key files (item 10).

Signed bodies (what the ingest and the validators open): a forged envelope's body is never decoded,
signed ones only under their schema's limits, and a tree of empty arrays within those limits is
refused before it is built (tracemalloc peak) while an honest submission's containers always fit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from alloc_helpers import PEAK_LIMIT, peak
from ingest_attack_helpers import RUN, SPEC, VALIDATOR, forge, submission

from node.p2p.gossip import BAN_GOSSIP_MAX_BYTES, TOPIC_RULES
from protocol import encoding
from protocol.envelope import DOMAIN, open_envelope
from protocol.errors import DecodeError, KeyFileError, SchemaError, SignatureError
from protocol.identity import NodeKey
from protocol.messages import BODY_LIMITS, MESSAGE_TYPES, Submission, decode_limits
from protocol.rollout import submission_decode_limits


def _resign_without(data: bytes) -> bytes:
    """``data`` with its signature bits flipped (a forgery)."""
    import msgpack

    obj = msgpack.unpackb(data, raw=False)
    obj["sig"] = bytes(b ^ 0xFF for b in obj["sig"])
    return encoding.packb(obj)


@pytest.mark.slow
def test_body_of_a_forged_envelope_is_never_decoded() -> None:
    # 380 KiB of empty maps inside an envelope whose signature is wrong: refused at the signature,
    # after one C pass that skips the body (its 380k maps are never built)
    w = NodeKey.generate()
    bomb = forge(w, "submission/1", {"rollouts": [{}] * 380_000})
    bad = _resign_without(bomb)
    with pytest.raises(SignatureError):
        open_envelope(bad, run_id=RUN, expect=Submission)


def test_signed_bodies_are_decoded_under_their_schema_limits() -> None:
    w = NodeKey.generate()
    over_array = forge(w, "submission/1", {"rollouts": [{}] * 70_000, "worker": w.peer_id})
    with pytest.raises(DecodeError, match="max_array_len"):
        open_envelope(over_array, run_id=RUN, expect=Submission)
    # a lease request body has no containers at all; a verdict's only array is its replay statistics' gap counts (≤ 8)
    for tag, body in (("lease_request/1", {"limit": [1, 2]}), ("verdict/1", {"evidence": {"x": [1] * 9}})):
        with pytest.raises(DecodeError, match="max_array_len"):
            open_envelope(forge(VALIDATOR, tag, body), run_id=RUN, authorities=SPEC.authorities)
    # nesting deeper than the schema's
    deep: object = {}
    for _ in range(8):
        deep = {"a": deep}
    with pytest.raises(SchemaError, match="body.tasks"):  # the schema stops it before any walk of it
        open_envelope(forge(w, "submission/1", {"counter": 0, "policy_step": 0, "rollouts": [], "tasks": deep, "worker": w.peer_id}), run_id=RUN)
    with pytest.raises(DecodeError, match="nested deeper than 4"):  # and the decoder's own depth bound
        encoding.unpackb(encoding.packb({"tasks": deep}), 1 << 20, BODY_LIMITS["submission/1"])
    # 16,000 empty maps where rollouts belong: one error, not one per missing field of each
    with pytest.raises(SchemaError, match="body.rollouts.0"):
        open_envelope(forge(w, "submission/1", {"counter": 0, "policy_step": 0, "rollouts": [{}] * 16_000, "tasks": [{"problem_id": "p", "target_length": 0, "task_index": 0}],
                                                 "worker": w.peer_id}), run_id=RUN)
    # a huge str where the schema allows 256 characters
    with pytest.raises(DecodeError, match="max_str_len"):
        open_envelope(forge(w, "submission/1", {"worker": "x" * 100_000}), run_id=RUN)


def test_limits_come_from_the_schema_not_the_size() -> None:
    sub = BODY_LIMITS["submission/1"]
    assert sub.max_array_len == 1 << 16 and sub.max_bin_len == 4 << 20 and sub.max_depth == 4
    assert BODY_LIMITS["lease_request/1"].max_array_len == 0 and BODY_LIMITS["lease_request/1"].max_bin_len == 0
    for tag, cls in MESSAGE_TYPES.items():
        lim = decode_limits(cls)
        assert lim.max_array_len < cls.MAX_BYTES and lim.max_map_len <= 128, tag


def test_outer_fields_must_be_canonical_and_tight() -> None:
    good = submission(NodeKey.generate())
    open_envelope(good, run_id=RUN)
    # the same map with the "v" key as str8 instead of fixstr: not canonical
    i = good.index(b"\xa1v")
    with pytest.raises(DecodeError, match="canonical"):
        open_envelope(good[:i] + b"\xd9\x01v" + good[i + 2:], run_id=RUN)
    with pytest.raises(DecodeError, match="trailing"):
        open_envelope(good + b"\x00", run_id=RUN)
    with pytest.raises(DecodeError):
        open_envelope(good[:-1], run_id=RUN)
    # an over-long outer field (a 1 MiB "type") fails in the decoder's 64-byte limit
    obj = encoding.unpackb(good, 1 << 26)
    obj["type"] = "x" * (1 << 20)
    with pytest.raises(DecodeError, match="max_str_len"):
        open_envelope(encoding.packb(obj), run_id=RUN)


def test_signature_covers_exactly_the_canonical_unsigned_map() -> None:
    good = submission(NodeKey.generate())
    obj = encoding.unpackb(good, 1 << 26)
    unsigned = {k: v for k, v in obj.items() if k != "sig"}
    env = open_envelope(good, run_id=RUN)
    # the signed bytes the decoder cut out of the raw bytes are the canonical unsigned map
    from protocol.identity import verify_signature

    verify_signature(env.signer, obj["sig"], DOMAIN + encoding.packb(unsigned))
    with pytest.raises(SchemaError, match="unknown field"):
        open_envelope(encoding.packb({**obj, "zz": 1}), run_id=RUN)


def test_gossip_topics_have_per_type_caps() -> None:
    assert TOPIC_RULES["bans"].max_bytes == BAN_GOSSIP_MAX_BYTES == 128 << 10
    assert TOPIC_RULES["verdicts"].max_bytes == MESSAGE_TYPES["verdict/1"].MAX_BYTES
    assert TOPIC_RULES["nodes"].max_bytes == 8 << 10


def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    key = NodeKey.generate()
    path = tmp_path / "node.key"
    key.save(path)
    assert NodeKey.load(path).peer_id == key.peer_id
    for mode in (0o644, 0o640, 0o604, 0o700):
        os.chmod(path, mode)
        with pytest.raises(KeyFileError, match=rf"mode {mode:04o}, must be 0600.*chmod 600 {path}") as e:
            NodeKey.load(path)
        assert "\n" not in str(e.value)
    os.chmod(path, 0o600)
    assert NodeKey.load(path).peer_id == key.peer_id


def _forge_raw(key: NodeKey, type_tag: str, body: bytes) -> bytes:
    """A signed envelope around canonical body bytes ``body`` (as ``forge``, without building the body in Python)."""
    import msgpack

    mark = b"\xab" * 16
    sealed = forge(key, type_tag, mark)
    outer = msgpack.unpackb(sealed)
    unsigned = {k: v for k, v in outer.items() if k != "sig"}
    splice = encoding.packb(mark)
    signed_bytes = encoding.packb(unsigned).replace(splice, body)
    return encoding.packb({**unsigned, "sig": key.sign(DOMAIN + signed_bytes)}).replace(splice, body)


def test_signed_bodies_of_empty_arrays_are_refused_before_they_are_built() -> None:
    # any free key signs a submission; arrays nested under the run's array bound (16 here) still
    # made 1 list per byte: 32 MiB → ≈ 2.4 GB in the ingest (its bounds) or a validator (the schema's)
    tree = b"\x90"
    for _ in range(5):  # 16⁵ = 1 M empty lists in 1.2 MB
        tree = b"\xdc\x00\x10" + tree * 16
    blob = _forge_raw(NodeKey.generate(), "submission/1", b"\x81\xa6worker" + tree)
    # under the run's bounds (the ingest, a validator): an honest submission's 189 containers; under
    # the schema's alone, 173,067 (≈ 11 MB, vs. 70 MB for the 1 M lists these bytes describe)
    for limits, peak_limit in ((submission_decode_limits(SPEC), PEAK_LIMIT), (None, 16 << 20)):
        error, top = peak(lambda limits=limits: open_envelope(blob, run_id=RUN, expect=Submission, body_limits=limits))
        assert isinstance(error, DecodeError) and "arrays and maps" in str(error), error
        assert top < peak_limit, top


def test_decoder_container_budget_never_refuses_what_the_limits_allow() -> None:
    # an honest submission's largest container count still decodes, and generic values too
    limits = submission_decode_limits(SPEC)
    assert limits.max_containers >= 1 + 1 + SPEC.data.tasks_per_submission * SPEC.rl.group_size * 2
    assert encoding.unpackb(encoding.packb([[1], [2], {"a": []}]), 1 << 10) == [[1], [2], {"a": []}]
    tight = encoding.DecodeLimits(16, 16, 16, 16, 4, max_containers=3)
    assert encoding.unpackb(encoding.packb([[], []]), 1 << 10, tight) == [[], []]
    with pytest.raises(DecodeError, match="more than 3 arrays and maps"):
        encoding.unpackb(encoding.packb([[], [], []]), 1 << 10, tight)
