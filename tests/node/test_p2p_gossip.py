"""Gossip topic rules: what the libp2p topic validator accepts, rejects, and how it scores."""

from __future__ import annotations

import time

import pytest
from p2p_helpers import Run, forge

from node.p2p.gossip import (
    GOSSIP_MAX_BYTES,
    TOPIC_RULES,
    DuplicateEnvelope,
    EnvelopeValidator,
    PeerScores,
    penalty_for,
    record_kind,
    subscribed_kinds,
    topic_name,
    topic_names,
)
from protocol.envelope import seal
from protocol.errors import DecodeError, ProtocolError, SchemaError, SignatureError, TooLarge, WrongRunError
from protocol.identity import NodeKey
from protocol.messages import CheckpointAnnouncement, NodeRecord, Verdict


def record(key: NodeKey, role: str = "worker") -> NodeRecord:
    return NodeRecord(peer_id=key.peer_id, role=role, seq=1, version="t")  # type: ignore[arg-type]


def verdict(worker: NodeKey) -> Verdict:
    return Verdict(submission_id=b"\0" * 32, worker=worker.peer_id, policy_step=1, counter=0, accepted=True, reason="ok")


@pytest.fixture
def run() -> Run:
    return Run()


@pytest.fixture
def validator(run: Run) -> EnvelopeValidator:
    return EnvelopeValidator(run.spec.run_id, run.spec.authorities, max_age_s=6.0, max_future_s=10.0)


def test_topic_names_are_per_run_and_versioned(run: Run) -> None:
    names = topic_names(run.spec.run_id)
    assert names["nodes"] == f"/intellect/{run.spec.run_id.hex()[:16]}/nodes/1"
    assert set(names) == {"nodes", "workers", "checkpoints", "verdicts", "bans"}
    assert topic_name(Run().spec.run_id, "nodes") != names["nodes"]
    assert all(rule.max_bytes <= GOSSIP_MAX_BYTES < 1 << 20 for rule in TOPIC_RULES.values())


def test_accepts_valid_messages_once(run: Run, validator: EnvelopeValidator) -> None:
    key = NodeKey.generate()
    data = seal(key, run.spec.run_id, record(key))
    env = validator.check("workers", data)
    assert env.body.peer_id == key.peer_id
    with pytest.raises(DuplicateEnvelope):
        validator.check("workers", data)
    relay = NodeKey.generate()
    assert validator.check("nodes", seal(relay, run.spec.run_id, record(relay, "relay"))).body.role == "relay"
    assert penalty_for(DuplicateEnvelope("x")) == ("duplicate", 0.0)
    ann = CheckpointAnnouncement(step=3, manifest_id=b"\1" * 32, checkpoint_hash=b"\2" * 32)
    assert validator.check("checkpoints", seal(run.coordinator, run.spec.run_id, ann)).body.step == 3
    assert validator.check("verdicts", seal(run.validator, run.spec.run_id, verdict(key))).body.accepted
    # remember=False (the publisher's pre-check) leaves the envelope acceptable afterwards
    fresh = seal(key, run.spec.run_id, record(key))
    validator.check("workers", fresh, remember=False)
    validator.check("workers", fresh)


def forgeries(run: Run) -> dict[str, tuple[str, bytes, type[ProtocolError], str]]:
    """name → (topic kind, payload, expected error, penalty reason)."""
    mallory = NodeKey.generate()
    rid = run.spec.run_id
    rec = record(mallory).model_dump()
    ann = CheckpointAnnouncement(step=9, manifest_id=b"\1" * 32, checkpoint_hash=b"\2" * 32)
    return {
        "bad signature": ("nodes", forge(mallory, rid, "node_record/1", rec, corrupt_sig=True), SignatureError, "bad_signer"),
        "other run": ("nodes", seal(mallory, Run().spec.run_id, record(mallory)), WrongRunError, "wrong_run"),
        "verdict by non-validator": ("verdicts", seal(mallory, rid, verdict(mallory)), SignatureError, "bad_signer"),
        "announcement by non-coordinator": ("checkpoints", seal(mallory, rid, ann), SignatureError, "bad_signer"),
        "fake coordinator record": ("nodes", seal(mallory, rid, record(mallory, "coordinator")), SignatureError, "bad_signer"),
        "fake validator record": ("nodes", seal(mallory, rid, record(mallory, "validator")), SignatureError, "bad_signer"),
        "record of someone else": ("nodes", forge(mallory, rid, "node_record/1", record(NodeKey.generate()).model_dump()), SignatureError, "bad_signer"),
        "wrong type for topic": ("nodes", seal(run.validator, rid, verdict(mallory)), SchemaError, "bad_schema"),
        "replayed old timestamp": ("nodes", seal(mallory, rid, record(mallory), ts_ms=int(time.time() * 1000) - 3_600_000), SchemaError, "stale"),
        "from the future": ("nodes", seal(mallory, rid, record(mallory), ts_ms=int(time.time() * 1000) + 3_600_000), SchemaError, "stale"),
        "oversized": ("nodes", forge(mallory, rid, "node_record/1", {**rec, "version": "x" * 9000}), TooLarge, "oversized"),
        "worker record on the nodes topic": ("nodes", seal(mallory, rid, record(mallory)), SchemaError, "bad_schema"),
        "relay record on the workers topic": ("workers", seal(mallory, rid, record(mallory, "relay")), SchemaError, "bad_schema"),
        "garbage": ("verdicts", b"\x93\x01\x02" + b"\0" * 64, DecodeError, "malformed"),
    }


@pytest.mark.parametrize("name", list(forgeries(Run())))
def test_rejects_forgeries(name: str, run: Run, validator: EnvelopeValidator) -> None:
    kind, data, error, reason = forgeries(run)[name]
    with pytest.raises(error) as info:
        validator.check(kind, data)  # type: ignore[arg-type]
    assert penalty_for(info.value)[0] == reason
    assert penalty_for(info.value)[1] > 0


def test_records_go_where_they_are_needed() -> None:
    """Workers' heartbeats reach infrastructure nodes only; the single-topic layout stays available."""
    assert record_kind("worker") == "workers" and record_kind("observer") == "workers"
    assert {record_kind(r) for r in ("coordinator", "relay", "validator")} == {"nodes"}
    assert record_kind("worker", split=False) == "nodes"
    assert "workers" not in subscribed_kinds("worker")
    assert all("workers" in subscribed_kinds(r) for r in ("coordinator", "relay", "validator"))
    assert "workers" in subscribed_kinds("observer", publishes_records=False)  # node status: the whole table
    assert set(subscribed_kinds("worker", split=False)) == set(TOPIC_RULES)
    # the node's layout: no worker record on gossip at all; workers read no records either
    assert subscribed_kinds("worker", presence=True) == ("checkpoints", "verdicts", "bans")
    assert all(subscribed_kinds(r, presence=True) == ("nodes", "checkpoints", "verdicts", "bans") for r in ("coordinator", "relay", "validator"))
    assert "nodes" in subscribed_kinds("observer", publishes_records=False, presence=True)


def test_single_topic_layout_accepts_worker_records_on_nodes(run: Run) -> None:
    flat = EnvelopeValidator(run.spec.run_id, run.spec.authorities, max_age_s=6.0, max_future_s=10.0, split_records=False)
    key = NodeKey.generate()
    assert flat.check("nodes", seal(key, run.spec.run_id, record(key))).body.role == "worker"


def test_scores_decay_and_hit_the_limit() -> None:
    now = [0.0]
    scores = PeerScores(limit=50.0, half_life_s=10.0, clock=lambda: now[0])
    for _ in range(4):
        assert not scores.penalize("p", 10.0)
    now[0] = 10.0  # 40 points halve to 20
    assert scores.points("p") == pytest.approx(20.0)
    assert not scores.penalize("p", 10.0)
    assert scores.penalize("p", 25.0)
    scores.forget("p")
    assert scores.points("p") == 0.0
    scores.penalize("q", 1.0)
    now[0] = 1000.0
    scores.prune()
    assert scores.points("q") == 0.0


@pytest.mark.parametrize(("case", "reason"), [("oversized", "oversized"), ("stale", "stale")])
def test_an_own_message_receivers_would_refuse_is_not_published_and_says_why(run: Run, case: str, reason: str) -> None:
    """The publish-side check names the receivers' reason: an oversized envelope ``oversized`` (a
    :class:`TooLarge`), an old one ``stale`` — not ``oversized`` because its error text says "limit"."""
    from node.errors import PublishError
    from node.p2p.config import GossipConfig
    from node.p2p.topics import TopicGate
    from protocol.runspec import sign_run_spec

    signed = sign_run_spec(run.spec, run.coordinator)
    me = NodeKey.generate()
    gate = TopicGate(signed.run_id, signed.spec.authorities, peer_id=me.peer_id, config=GossipConfig(), heartbeat_interval_s=5.0,
                     split_records=True)
    rec = record(me).model_dump()
    data = (forge(me, signed.run_id, "node_record/1", {**rec, "version": "x" * 9000}) if case == "oversized"
            else seal(me, signed.run_id, record(me, "relay"), ts_ms=int(time.time() * 1000) - 3_600_000))
    with pytest.raises(PublishError) as info:
        gate.check_outgoing("nodes", "t", data)
    assert info.value.reason == reason, info.value
