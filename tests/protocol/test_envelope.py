import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import encoding
from protocol.envelope import DOMAIN, Authorities, open_envelope, seal
from protocol.errors import DecodeError, ProtocolError, SchemaError, SignatureError, WrongRunError
from protocol.identity import NodeKey
from protocol.messages import CheckpointAnnouncement, Manifest, ManifestFile, NodeRecord, Rollout, Submission, SubmissionTask, Verdict

RUN = bytes(range(32))
OTHER_RUN = bytes(32)
COORD = NodeKey.from_seed(b"c" * 32)
VALID = NodeKey.from_seed(b"v" * 32)
WORKER = NodeKey.from_seed(b"w" * 32)
AUTH = Authorities(coordinator=COORD.public_key, validators=frozenset({VALID.public_key}))


def record(key=WORKER, **kw):
    base = dict(peer_id=key.peer_id, role="worker", seq=1, version="0.1.0", addrs=["/ip4/127.0.0.1/tcp/1"])
    base.update(kw)
    return NodeRecord(**base)


def verdict(**kw):
    base = dict(submission_id=b"\x01" * 32, worker=WORKER.peer_id, policy_step=3, counter=1, accepted=True, reason="ok", evidence={"mismatches": 2})
    base.update(kw)
    return Verdict(**base)


def submission():
    r = Rollout(task=0, sample=0, seed=7, prompt_ids=b"\x01\x00\x00\x00", completion_ids=b"\x02\x00\x00\x00", logprobs=b"\x00\x00\x80\xbf",
                finish="eos", task_reward=1.0, reward=0.99, proofs=[b"\x00" * 258])
    return Submission(worker=WORKER.peer_id, policy_step=1, counter=0, tasks=[SubmissionTask(task_index=5, problem_id="p5", target_length=0)], rollouts=[r])


def _big_submission():
    sub = submission()
    r = sub.rollouts[0]
    many = [r.model_copy(update={"sample": i, "completion_ids": b"\x00" * (4 << 20)}) for i in range(9)]
    return sub.model_copy(update={"rollouts": many})


def test_round_trips_for_each_type():
    for key, body in [
        (WORKER, record()),
        (VALID, verdict()),
        (WORKER, submission()),
        (COORD, CheckpointAnnouncement(step=2, manifest_id=b"\x02" * 32, checkpoint_hash=b"\x03" * 32)),
        (COORD, Manifest(step=2, piece_size_bytes=1 << 20, files=[ManifestFile(name="model.safetensors", size_bytes=10, pieces=[b"\x04" * 32])], checkpoint_hash=b"\x05" * 32)),
    ]:
        data = seal(key, RUN, body)
        env = open_envelope(data, run_id=RUN, authorities=AUTH)
        assert env.body == body
        assert env.peer_id == key.peer_id
        assert env.raw == data and len(env.id) == 32


def _mutate(data: bytes, **changes) -> bytes:
    obj = encoding.unpackb(data, 1 << 26)
    obj.update(changes)
    return encoding.packb(obj)


def _resign(data: bytes, key: NodeKey, **changes) -> bytes:
    obj = encoding.unpackb(data, 1 << 26)
    obj.update(changes)
    obj["signer"] = key.public_key
    unsigned = {k: v for k, v in obj.items() if k != "sig"}
    obj["sig"] = key.sign(DOMAIN + encoding.packb(unsigned))
    return encoding.packb(obj)


def test_tampered_signature_and_body():
    data = seal(WORKER, RUN, record())
    obj = encoding.unpackb(data, 1 << 20)
    with pytest.raises(SignatureError):
        open_envelope(_mutate(data, sig=bytes(64)), run_id=RUN)
    body = dict(obj["body"], seq=2)
    with pytest.raises(SignatureError):
        open_envelope(_mutate(data, body=body), run_id=RUN)


def test_wrong_run_rejected_even_with_valid_signature():
    data = seal(WORKER, OTHER_RUN, record())
    with pytest.raises(WrongRunError):
        open_envelope(data, run_id=RUN)


def test_type_is_signed_and_must_be_expected():
    data = seal(WORKER, RUN, record())
    with pytest.raises(SchemaError, match="not acceptable"):
        open_envelope(data, run_id=RUN, expect=Verdict)
    with pytest.raises(SchemaError, match="unknown message type"):
        open_envelope(_mutate(data, type="evil/1"), run_id=RUN)
    # changing the type tag breaks the signature (domain separation)
    with pytest.raises((SignatureError, SchemaError)):
        open_envelope(_mutate(data, type="verdict/1"), run_id=RUN, authorities=AUTH)


def test_signer_authority():
    with pytest.raises(SignatureError, match="validator"):
        open_envelope(seal(WORKER, RUN, verdict()), run_id=RUN, authorities=AUTH)
    with pytest.raises(SignatureError, match="coordinator"):
        open_envelope(seal(VALID, RUN, CheckpointAnnouncement(step=1, manifest_id=b"\x00" * 32, checkpoint_hash=b"\x00" * 32)), run_id=RUN, authorities=AUTH)
    with pytest.raises(SignatureError):  # no authorities known: never accept privileged types
        open_envelope(seal(VALID, RUN, verdict()), run_id=RUN)
    # a record about another peer, signed by someone else
    with pytest.raises(SignatureError, match="not the signer"):
        open_envelope(seal(VALID, RUN, record(key=WORKER)), run_id=RUN)
    with pytest.raises(SignatureError, match="not the signer"):
        open_envelope(seal(VALID, RUN, submission()), run_id=RUN)


def test_freshness():
    now = int(time.time() * 1000)
    old = seal(WORKER, RUN, record(), ts_ms=now - 60_000)
    open_envelope(old, run_id=RUN)
    with pytest.raises(SchemaError, match="stale"):
        open_envelope(old, run_id=RUN, max_age_s=10, now_ms=now)
    with pytest.raises(SchemaError, match="future"):
        open_envelope(seal(WORKER, RUN, record(), ts_ms=now + 120_000), run_id=RUN, now_ms=now)


def test_truncated_oversized_and_shape_errors():
    data = seal(WORKER, RUN, record())
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(DecodeError):
            open_envelope(data[:cut], run_id=RUN)
    with pytest.raises(DecodeError, match="exceeds"):
        open_envelope(data, run_id=RUN, max_bytes=len(data) - 1)
    # a node record bigger than its type's 8 KiB limit, validly signed: refused before schema checks
    obj = encoding.unpackb(data, 1 << 20)
    huge = _resign(data, WORKER, body={**obj["body"], "version": "x" * 9000})
    with pytest.raises(DecodeError, match="limit of 8192"):
        open_envelope(huge, run_id=RUN)
    with pytest.raises(SchemaError, match="over its limit"):
        seal(WORKER, RUN, _big_submission())
    with pytest.raises(DecodeError, match="map"):
        open_envelope(encoding.packb([1, 2]), run_id=RUN)


def test_extra_missing_and_wrong_typed_fields():
    data = seal(WORKER, RUN, record())
    obj = encoding.unpackb(data, 1 << 20)
    with pytest.raises(SchemaError, match="unknown field"):
        open_envelope(encoding.packb({**obj, "x": 1}), run_id=RUN)
    with pytest.raises(SchemaError, match="nonce"):
        open_envelope(encoding.packb({k: v for k, v in obj.items() if k != "nonce"}), run_id=RUN)
    with pytest.raises(SchemaError, match="ts_ms"):
        open_envelope(_mutate(data, ts_ms="now"), run_id=RUN)
    with pytest.raises(SchemaError, match="signer"):
        open_envelope(_mutate(data, signer=b"\x00" * 31), run_id=RUN)
    # a correctly signed body with an extra, a missing and a mistyped field
    body = obj["body"]
    for bad_body, field in [({**body, "evil": 1}, "body.evil"), ({k: v for k, v in body.items() if k != "role"}, "body.role"),
                            ({**body, "seq": "1"}, "body.seq"), ({**body, "seq": True}, "body.seq"), ({**body, "seq": -1}, "body.seq"),
                            ({**body, "role": "king"}, "body.role")]:
        with pytest.raises(SchemaError) as e:
            open_envelope(_resign(data, WORKER, body=bad_body), run_id=RUN)
        assert e.value.field == field


def test_seal_refuses_invalid_body():
    with pytest.raises(Exception):
        record(seq=-5)
    with pytest.raises(SchemaError, match="32 bytes"):
        seal(WORKER, b"short", record())


@pytest.mark.slow
@given(st.binary(max_size=600))
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_bytes_only_raise_protocol_errors(data):
    with pytest.raises(ProtocolError):
        open_envelope(data, run_id=RUN, authorities=AUTH)


_valid = seal(WORKER, RUN, record())


@pytest.mark.slow
@given(st.lists(st.tuples(st.integers(0, len(_valid) - 1), st.integers(0, 255)), min_size=1, max_size=6), st.integers(0, len(_valid)))
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
def test_mutated_envelopes_only_raise_protocol_errors(edits, cut):
    b = bytearray(_valid)
    for i, v in edits:
        b[i] = v
    data = bytes(b[:cut]) if cut < len(b) else bytes(b)
    try:
        env = open_envelope(data, run_id=RUN, authorities=AUTH)
    except ProtocolError:
        return
    assert env.raw == _valid  # only a no-op edit may pass
