"""A hostile peer, round 6: the byte limits that now raise ``protocol.errors.TooLarge`` before decoding
(envelopes, gossip topics, presence frames and rosters), the twin counts of ``ReplayStats`` inside a
signed ``verdict/1``, the audit's arithmetic under extreme-but-valid counts (``protocol.audit``), the
coordinator's refusal of verdicts claiming too many decided twins, and ``validator.twins.decode_twins``'s
argument checks.

Bytes that would fail to decode are used where a test asserts the size check ran first: a decoder that
ran before the size check would raise a plain ``DecodeError`` (or ``SchemaError``), not ``TooLarge``.
"""

from __future__ import annotations

import math
import os
import time

import pytest

from protocol import encoding
from protocol.audit import EVENTS, TWINS_PER_SUBMISSION, UP_EVENT, UP_RATE_EVENT, AuditState, Baseline, rate_upper_bound
from protocol.envelope import DOMAIN, ENVELOPE_VERSION, MAX_ENVELOPE_BYTES, NONCE_BYTES, open_envelope
from protocol.errors import DecodeError, ProtocolError, SchemaError, TooLarge
from protocol.messages import ReplayStats, Verdict
from protocol.runspec import AUDIT_RULE_EPROCESS_V2
from tests.protocol.test_audit_twins import twins
from tests.security.test_hostile_peer_round5 import _Host, _nested_msgpack, _standing_run

V2 = AUDIT_RULE_EPROCESS_V2
ALL_EVENTS = (*EVENTS, UP_EVENT, UP_RATE_EVENT)


def _raw_envelope(key, run_id: bytes, type_tag: str, body: object) -> bytes:
    """A correctly signed envelope around any ``body`` map (no schema check: what a hostile signer sends)."""
    unsigned = {"v": ENVELOPE_VERSION, "type": type_tag, "run": bytes(run_id), "signer": key.public_key,
                "ts_ms": int(time.time() * 1000), "nonce": os.urandom(NONCE_BYTES), "body": body}
    sig = key.sign(DOMAIN + encoding.packb(unsigned))
    return encoding.packb({**unsigned, "sig": sig})


# --- envelopes over their byte limits ---------------------------------------------------------------

@pytest.mark.parametrize("size", [MAX_ENVELOPE_BYTES + 1, 4 * MAX_ENVELOPE_BYTES], ids=["just-over", "far-over"])
def test_open_envelope_refuses_oversized_bytes_before_decoding(size: int) -> None:
    _, signed = _standing_run()
    with pytest.raises(TooLarge, match="exceeds the limit"):
        open_envelope(b"\xc1" * size, run_id=signed.run_id)  # 0xc1 is never valid msgpack


@pytest.mark.parametrize("over", [1, 4096], ids=["just-over", "far-over"])
def test_open_envelope_refuses_a_verdict_over_its_type_limit(over: int) -> None:
    coord, signed = _standing_run()
    target = Verdict.MAX_BYTES + over
    probe = _raw_envelope(coord, signed.run_id, Verdict.TYPE, {"pad": b"x" * 1000})  # bin16: the header stays 3 bytes
    data = _raw_envelope(coord, signed.run_id, Verdict.TYPE, {"pad": b"x" * (1000 + target - len(probe))})
    assert target <= len(data) <= target + 2  # (bin32 past 64 KiB: two more header bytes)
    assert Verdict.MAX_BYTES < len(data) <= MAX_ENVELOPE_BYTES
    with pytest.raises(TooLarge, match="verdict/1 envelope"):
        open_envelope(data, run_id=signed.run_id, authorities=signed.spec.authorities, expect=Verdict)
    with pytest.raises(TooLarge):
        open_envelope(data, run_id=signed.run_id, authorities=signed.spec.authorities, max_bytes=Verdict.MAX_BYTES)


# --- gossip topics: every topic refuses oversized data as "oversized", nothing escapes ----------------

def _gate():
    from node.p2p.config import GossipConfig
    from node.p2p.topics import TopicGate
    from protocol.identity import NodeKey

    _, signed = _standing_run()
    me = NodeKey.from_seed(b"\x31" * 32)
    return TopicGate(signed.run_id, signed.spec.authorities, peer_id=me.peer_id, config=GossipConfig(), heartbeat_interval_s=5.0,
                     split_records=True)


def _topics() -> list[str]:
    from node.p2p.gossip import TOPIC_RULES
    return sorted(TOPIC_RULES)


@pytest.mark.parametrize("kind", _topics())
@pytest.mark.parametrize("extra", [1, 1 << 20], ids=["just-over", "far-over"])
def test_topic_gate_counts_oversized_data_on_every_topic_without_raising(kind: str, extra: int) -> None:
    import trio
    from libp2p.peer.id import ID
    from libp2p.pubsub.pb import rpc_pb2

    from node.p2p.gossip import TOPIC_RULES
    from protocol.identity import NodeKey

    data = b"\xc1" * (TOPIC_RULES[kind].max_bytes + extra)
    gate, host = _gate(), _Host()
    forwarder = ID.from_base58(NodeKey.from_seed(b"\x32" * 32).peer_id)
    msg = rpc_pb2.Message(from_id=forwarder.to_bytes(), data=data, seqno=b"\x00" * 8, topicIDs=[kind])
    validate = gate.validator(kind, host)  # type: ignore[arg-type]

    async def run() -> bool:  # the "nodes" topic reads trio's clock for its rate budget
        return validate(forwarder, msg)

    assert trio.run(run) is False
    assert gate.rejected == {"oversized": 1}, gate.rejected
    assert gate.take(host.message_id(msg)) is None


@pytest.mark.parametrize("kind", _topics())
def test_check_outgoing_names_an_oversized_envelope_oversized(kind: str) -> None:
    from node.errors import PublishError
    from node.p2p.gossip import TOPIC_RULES

    gate = _gate()
    with pytest.raises(PublishError) as e:
        gate.check_outgoing(kind, f"/t/{kind}", b"\xc1" * (TOPIC_RULES[kind].max_bytes + 1))  # type: ignore[arg-type]
    assert e.value.reason == "oversized"


def test_check_outgoing_does_not_call_undecodable_bytes_oversized() -> None:
    from node.errors import PublishError

    with pytest.raises(PublishError) as e:
        _gate().check_outgoing("verdicts", "/t/verdicts", _nested_msgpack(100))
    assert e.value.reason != "oversized"


# --- presence frames and rosters -------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 1 << 10, 2**32 - 1], ids=["just-over", "far-over", "u32-max"])
def test_presence_frame_length_over_the_limit_is_too_large(n: int) -> None:
    from protocol.presence import FRAME_MAX_BYTES, WORKER_FRAME_MAX_BYTES, frame_length

    for limit in (FRAME_MAX_BYTES, WORKER_FRAME_MAX_BYTES):
        length = min(limit + n, 2**32 - 1)
        with pytest.raises(TooLarge):
            frame_length(length.to_bytes(4, "big"), max_bytes=limit, kinds=frozenset({1}))
        assert frame_length(limit.to_bytes(4, "big"), max_bytes=limit, kinds=frozenset({1})) == limit


def test_presence_frame_of_zero_length_is_malformed_not_too_large() -> None:
    from protocol.presence import FRAME_MAX_BYTES, frame_length

    with pytest.raises(DecodeError) as e:
        frame_length(b"\x00\x00\x00\x00", max_bytes=FRAME_MAX_BYTES, kinds=frozenset({1}))
    assert not isinstance(e.value, TooLarge)


@pytest.mark.parametrize("extra", [1, 1 << 20], ids=["just-over", "far-over"])
def test_roster_over_its_limit_is_too_large_before_hashing(extra: int) -> None:
    from protocol.presence import FULL, ROSTER_MAX_BYTES, read_roster_answer, unpack_roster

    data = b"\xc1" * (ROSTER_MAX_BYTES + extra)
    with pytest.raises(TooLarge):
        unpack_roster(b"\x00" * 32, data)  # a hash check first would say "do not hash", not TooLarge
    with pytest.raises(TooLarge):
        read_roster_answer(b"\x00" * 32, bytes([FULL]) + data)


# --- ReplayStats inside a signed verdict: hostile values refused by the schema ------------------------

_BASE_STATS = {"tokens": 100, "differ": 5, "gap_over": [1, 0, 0, 0, 0], "chunks": 4, "rollouts": 20, "diverged": 4, "decided": 3,
               "up": 2, "down": 1}
_HOSTILE = [
    ("tokens", 2**63), ("tokens", 2**64 - 1), ("decided", 2**63), ("up", -1), ("down", -(2**63)), ("rollouts", 2**41),
    ("decided", 1.5), ("up", 1.0), ("up", "1"), ("diverged", {"a": 1}), ("decided", [1]), ("decided", None), ("up", b"\x01"),
    ("gap_over", [0] * 9), ("gap_over", [2**63] * 5), ("gap_over", [-1]), ("gap_over", {"0": 1}), ("gap_over", "abc"),
    ("up", 3), ("decided", 5), ("diverged", 6), ("rollouts", 101), ("extra_field", 1),
]


def _verdict_body(stats: object) -> dict[str, object]:
    from protocol.identity import NodeKey

    return {"submission_id": b"\x00" * 32, "worker": NodeKey.from_seed(b"\x33" * 32).peer_id, "policy_step": 0, "counter": 0,
            "accepted": True, "reason": "ok", "evidence": {}, "stats": stats}


def test_a_consistent_raw_verdict_opens() -> None:
    """The harness below signs raw maps correctly: the same map with consistent stats is accepted."""
    coord, signed = _standing_run()
    data = _raw_envelope(coord, signed.run_id, Verdict.TYPE, _verdict_body(_BASE_STATS))
    env = open_envelope(data, run_id=signed.run_id, authorities=signed.spec.authorities, expect=Verdict)
    assert env.body.stats is not None and env.body.stats.up == 2


@pytest.mark.parametrize(("field", "value"), _HOSTILE, ids=[f"{f}={str(v)[:12]}" for f, v in _HOSTILE])
def test_hostile_replay_stats_in_a_signed_verdict_are_refused(field: str, value: object) -> None:
    coord, signed = _standing_run()
    data = _raw_envelope(coord, signed.run_id, Verdict.TYPE, _verdict_body({**_BASE_STATS, field: value}))
    with pytest.raises((SchemaError, DecodeError)) as e:  # the body's decode limits or its schema
        open_envelope(data, run_id=signed.run_id, authorities=signed.spec.authorities, expect=Verdict)
    assert not isinstance(e.value, TooLarge)
    if isinstance(e.value, SchemaError):
        assert str(e.value).startswith("body.stats"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_million_entry_gap_over_is_refused_by_size_on_the_wire_and_fast_by_the_schema() -> None:
    coord, signed = _standing_run()
    with pytest.raises(TooLarge):
        open_envelope(_raw_envelope(coord, signed.run_id, Verdict.TYPE, _verdict_body({**_BASE_STATS, "gap_over": [0] * 10**6})),
                      run_id=signed.run_id, authorities=signed.spec.authorities, expect=Verdict)
    # the schema alone (a verdict read from disk, say) stops at max_length, not after a walk of 10^6 items
    for junk in ([0] * 10**6, ["x"] * 10**6, [[0]] * 10**6):
        with pytest.raises(ValueError):
            ReplayStats.model_validate({**_BASE_STATS, "gap_over": junk})


# --- the audit under extreme-but-valid counts --------------------------------------------------------

_BIG = 2**40  # Count's upper bound


def _extreme_stats() -> list[ReplayStats]:
    return [
        ReplayStats(tokens=_BIG, differ=_BIG, gap_over=[_BIG] * 5, impossible=_BIG, logprob_over=_BIG, chunks=_BIG, chunks_over=_BIG,
                    rollouts=_BIG, diverged=_BIG, decided=_BIG, up=_BIG, down=0),
        ReplayStats(tokens=_BIG, differ=_BIG, rollouts=_BIG, diverged=_BIG, decided=_BIG, up=0, down=_BIG),
        ReplayStats(tokens=_BIG, differ=0, chunks=_BIG),
        ReplayStats(tokens=_BIG, differ=1, rollouts=1, diverged=1, decided=1, up=1),
        ReplayStats(tokens=0, differ=0),
    ]


@pytest.mark.parametrize("p", [1e-12, 1e-6, 0.5, 0.99, 1 - 1e-9, 1.0, 0.0])
def test_audit_state_observe_extreme_counts_keeps_log_e_finite(p: float) -> None:
    for rule in ("eprocess-v1", V2):
        st = AuditState(rule=rule)
        for _ in range(100):
            for s in _extreme_stats():
                st.observe(s, {e: p for e in ALL_EVENTS})
        assert math.isfinite(st.log_e_value()), (rule, p, st.log_wealth)
        st.flag(1e-6, {e: p for e in ALL_EVENTS})  # never raises (exp is clipped)


def test_baseline_bounds_from_extreme_counts_are_probabilities_and_usable() -> None:
    b = Baseline(1e-6, 4)
    for step in range(10_000):
        for s in _extreme_stats():
            b.add(step, s)
    bounds = b.bounds()
    assert all(0.0 < v <= 1.0 for v in bounds.values()), bounds
    st = AuditState(rule=V2)
    for s in _extreme_stats():
        st.observe(s, bounds)
    assert math.isfinite(st.log_e_value())


def test_rate_upper_bound_near_one_does_not_divide_by_zero() -> None:
    n = 10**16  # (n - 1) / n is 1 - 2**-53 in float
    assert 0.0 < rate_upper_bound(n - 1, n, 0.5) <= 1.0


def test_baseline_bounds_with_nearly_all_up_twins_does_not_raise() -> None:
    b = Baseline(0.5, 4)
    b.per_config[64].twins = (10**16 - 1, 10**16, 10**16)
    assert 0.0 < b.bounds()[UP_EVENT] <= 1.0


@pytest.mark.parametrize("p", [1 - 2**-53, 1 - 1e-15], ids=["1-2^-53", "1-1e-15"])
def test_observe_with_an_up_bound_just_below_one_does_not_raise(p: float) -> None:
    st = AuditState(rule=V2)
    st.observe(twins(0, 8), {UP_EVENT: p, UP_RATE_EVENT: 0.5})
    assert math.isfinite(st.log_e_value())


# --- the coordinator ignores verdicts claiming more decided twins than a validator decodes -------------

def test_worker_audit_ignores_verdicts_with_too_many_decided_twins(tmp_path) -> None:
    from protocol.runspec import AuditSpec
    from trainer.ledger.audit import WorkerAudit

    audit = WorkerAudit(AuditSpec(rule=V2, min_calibration_tokens=1), tmp_path / "audit.sqlite")
    for decided in (TWINS_PER_SUBMISSION + 1, 64, 2**40):
        stats = ReplayStats(tokens=2**40, differ=2**40, rollouts=2**40, diverged=2**40, decided=decided, up=decided)
        assert audit.observe("w", stats, "s" * 64, "v" * 64) is None
    assert "w" not in audit._states  # nothing counted, nothing kept


# --- decode_twins refuses bad arguments with ValueError before touching the model --------------------

class _NoModel:
    def parameters(self):  # a model that is touched fails the test loudly
        raise AssertionError("the model was used before the arguments were checked")


def _params():
    from protocol.sampling import ReplayParams
    return ReplayParams.from_spec(_standing_run()[1].spec, [7])


@pytest.mark.parametrize(("prompts", "prefixes", "seeds", "max_tokens"), [
    ([[1]], [[2]], [], 4),  # fewer seeds
    ([[1], [1]], [[2]], [1, 2], 4),  # fewer prefixes
    ([[1]], [[2], [3]], [1], 4),  # more prefixes
    ([[]], [[2]], [1], 4),  # empty prompt
    ([[1]], [[]], [1], 4),  # empty prefix
    ([[1]], [[2] * 5], [1], 4),  # prefix over max_tokens
    ([[1]], [[2]], [1], 0),  # no room at all
    ([[1]], [[2]], [1], -(2**63)),  # negative max_tokens
    ([[1]], [["x"]], [1], 4),  # a token that is not an integer
], ids=["few-seeds", "few-prefixes", "many-prefixes", "empty-prompt", "empty-prefix", "long-prefix", "zero-max", "negative-max",
        "str-token"])
def test_decode_twins_refuses_bad_arguments_with_value_error(prompts, prefixes, seeds, max_tokens) -> None:
    from validator.twins import decode_twins

    with pytest.raises(ValueError):
        decode_twins(_NoModel(), prompts, prefixes, seeds, _params(), max_tokens, 0)


def test_decode_twins_with_nothing_to_decode_never_touches_the_model() -> None:
    from validator.twins import decode_twins

    params = _params()
    eos = list(params.eos_ids)[:1]
    prefixes = [[5] * 4] + ([[5] + eos] if eos else [])
    out = decode_twins(_NoModel(), [[1]] * len(prefixes), prefixes, [1] * len(prefixes), params, 4, 0)
    assert out == prefixes
    assert decode_twins(_NoModel(), [], [], [], params, 4, 0) == []


def test_protocol_errors_stay_one_family() -> None:
    assert issubclass(TooLarge, DecodeError) and issubclass(DecodeError, ProtocolError)
