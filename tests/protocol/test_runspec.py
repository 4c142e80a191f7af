import re

import pytest

from protocol.errors import RunSpecError
from protocol.identity import NodeKey
from protocol.runspec import RLSpec, RunInfo, RunSpec, ShardcastSpec, ModelSpec, dump_run_spec, load_run_spec, parse_run_spec, sign_run_spec

COORD = NodeKey.from_seed(b"c" * 32)


def spec(**kw) -> RunSpec:
    return RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=42), **kw)


def test_round_trip_and_run_id_stable():
    signed = sign_run_spec(spec(), COORD)
    text = dump_run_spec(signed)
    back = parse_run_spec(text)
    assert back.spec == signed.spec and back.run_id == signed.run_id
    # formatting does not matter, values do
    assert parse_run_spec(text.replace("temperature = 1.0", "temperature = 1")).run_id == signed.run_id


def test_every_numeric_tamper_is_refused():
    text = dump_run_spec(sign_run_spec(spec(), COORD))
    for m in re.finditer(r"(?m)^(\w+ = )(\d+)$", text):
        tampered = text[: m.start(2)] + str(int(m.group(2)) + 1) + text[m.end(2):]
        with pytest.raises(RunSpecError):
            parse_run_spec(tampered)


def test_unsigned_and_wrong_signer():
    text = dump_run_spec(sign_run_spec(spec(), COORD))
    unsigned = text[: text.index("[signature]")]
    with pytest.raises(RunSpecError, match="unsigned"):
        parse_run_spec(unsigned)
    assert parse_run_spec(unsigned, require_signature=False).spec == spec()
    with pytest.raises(RunSpecError, match="not the spec's coordinator"):
        sign_run_spec(spec(), NodeKey.generate())
    other = NodeKey.generate()
    forged = dump_run_spec(sign_run_spec(RunSpec(run=RunInfo(coordinator=other.peer_id, seed=42)), other))
    # swap in the victim's coordinator: the run ID no longer matches
    with pytest.raises(RunSpecError):
        parse_run_spec(forged.replace(other.peer_id, COORD.peer_id))


def test_schema_errors_name_the_field(tmp_path):
    text = dump_run_spec(sign_run_spec(spec(), COORD))
    with pytest.raises(RunSpecError, match="rl.async_level"):
        parse_run_spec(text.replace("async_level = 2", "async_level = -1"))
    with pytest.raises(RunSpecError, match="bogus"):
        parse_run_spec(text.replace("[rl]", "[rl]\nbogus = 1"))
    with pytest.raises(RunSpecError, match="TOML"):
        parse_run_spec("[[[")
    with pytest.raises(RunSpecError, match="cannot read"):
        load_run_spec(tmp_path / "none.toml")


def test_consistency_rules():
    with pytest.raises(ValueError, match="keep_steps"):
        spec(rl=RLSpec(async_level=4), shardcast=ShardcastSpec(keep_steps=2))


def test_keep_steps_defaults_to_the_window():
    """Unstated, a run keeps async_level + 1 steps (protocol.window.fresh_steps), signed like a stated value."""
    assert [spec(rl=RLSpec(async_level=k)).shardcast.keep_steps for k in (0, 1, 2, 5)] == [1, 2, 3, 6]
    assert spec(rl=RLSpec(async_level=1), shardcast=ShardcastSpec(piece_size_bytes=1 << 20)).shardcast.keep_steps == 2
    assert spec(rl=RLSpec(async_level=1), shardcast=ShardcastSpec(keep_steps=4)).shardcast.keep_steps == 4
    text = dump_run_spec(sign_run_spec(spec(rl=RLSpec(async_level=5)), COORD))
    assert "keep_steps = 6" in text and parse_run_spec(text).spec.shardcast.keep_steps == 6
    with pytest.raises(ValueError, match="hidden_size"):
        spec(model=ModelSpec(hidden_size=64))


def test_authorities():
    v = NodeKey.generate()
    s = RunSpec(run=RunInfo(coordinator=COORD.peer_id, validators=[v.peer_id]))
    assert s.authorities.allows("coordinator", COORD.public_key)
    assert s.authorities.allows("validator", v.public_key)
    assert not s.authorities.allows("validator", COORD.public_key)


def test_replay_tolerances_validated():
    """``toploc.replay_eps`` in (0, 0.5] and ``toploc.max_near_tie_fraction`` in [0, 1], finite; part
    of the signed content; one-line errors naming the field."""
    signed = sign_run_spec(spec(), COORD)
    text = dump_run_spec(signed)
    assert "replay_eps = 0.0001" in text and "max_near_tie_fraction = 0.1" in text
    unsigned = text[: text.index("[signature]")]
    for field, bads in (("replay_eps", ("nan", "inf", "0.0", "-1e-4", "0.6")), ("max_near_tie_fraction", ("nan", "-0.1", "1.5"))):
        for bad in bads:
            edited = re.sub(rf"(?m)^{field} = .*$", f"{field} = {bad}", unsigned)
            with pytest.raises(RunSpecError, match=rf"^run spec field toploc\.{field}: ") as e:
                parse_run_spec(edited, require_signature=False)
            assert "\n" not in str(e.value)
    other = parse_run_spec(unsigned.replace("replay_eps = 0.0001", "replay_eps = 0.05"), require_signature=False).spec
    assert other.toploc.replay_eps == 0.05 and other.run_id != signed.run_id


def test_logprob_tolerances_validated():
    """``toploc.logprob_max_abs`` / ``logprob_mean_abs``: finite, in (0, 5] nats, mean ≤ max; one-line errors naming the field."""
    from protocol.runspec import LOGPROB_TOL_LIMIT, ToplocSpec

    signed = sign_run_spec(spec(), COORD)
    text = dump_run_spec(signed)
    assert "logprob_max_abs = 0.01" in text and "logprob_mean_abs = 0.001" in text
    unsigned = text[: text.index("[signature]")]
    for field in ("logprob_max_abs", "logprob_mean_abs"):
        for bad in ("nan", "inf", "-inf", "0.0", "-0.01", str(LOGPROB_TOL_LIMIT * 2), '"abc"'):
            edited = re.sub(rf"(?m)^{field} = .*$", f"{field} = {bad}", unsigned)
            with pytest.raises(RunSpecError, match=rf"^run spec field toploc\.{field}: ") as e:
                parse_run_spec(edited, require_signature=False)
            assert "\n" not in str(e.value)
    with pytest.raises(RunSpecError, match=r"^run spec field toploc: .*logprob_mean_abs 0\.02 exceeds toploc\.logprob_max_abs 0\.01"):
        parse_run_spec(unsigned.replace("logprob_mean_abs = 0.001", "logprob_mean_abs = 0.02"), require_signature=False)
    # in range: accepted, and part of the signed content (another value is another run)
    other = parse_run_spec(unsigned.replace("logprob_max_abs = 0.01", "logprob_max_abs = 0.5"), require_signature=False).spec
    assert other.toploc.logprob_max_abs == 0.5 and other.run_id != signed.run_id
    assert ToplocSpec(logprob_max_abs=LOGPROB_TOL_LIMIT, logprob_mean_abs=LOGPROB_TOL_LIMIT).logprob_mean_abs == LOGPROB_TOL_LIMIT
    with pytest.raises(RunSpecError, match="modified after signing"):
        parse_run_spec(text.replace("logprob_mean_abs = 0.001", "logprob_mean_abs = 0.002"))


def test_replay_rule_is_versioned_in_the_spec():
    """``toploc.replay_rule`` names the replay rule: an unknown one is refused naming the field; a
    spec signed before the rule existed (no replay_rule, replay_logit_bound, eos_prob_slack lines)
    keeps its run ID and means eps-v1 with EOS slack 0.01; logit-bound-v1 needs its bound and
    refuses eps-v1's fields; every non-default value is another run."""
    import hashlib

    from protocol import encoding
    from protocol.runspec import RUN_ID_DOMAIN, ToplocSpec

    signed = sign_run_spec(spec(), COORD)
    unsigned = dump_run_spec(signed)[: dump_run_spec(signed).index("[signature]")]
    assert 'replay_rule = "eps-v1"' in unsigned and "eos_prob_slack = 0.01" in unsigned
    with pytest.raises(RunSpecError, match=r"^run spec field toploc\.replay_rule: Input should be 'eps-v1', 'logit-bound-v1', 'logit-bound-v2' or 'logit-bound-v3'$"):
        parse_run_spec(unsigned.replace('replay_rule = "eps-v1"', 'replay_rule = "logit-bound-v9"'), require_signature=False)
    # the content as a spec before the rule was written hashes to the same run ID
    old = signed.spec.model_dump(mode="python")
    del old["artifacts"]  # added later still: hashed only when it pins something (test_artifacts_table_keeps_old_run_ids)
    for name in ("replay_rule", "replay_logit_bound", "eos_prob_slack", "worker_dtype", "fp32_logits", "hard_factor"):
        del old["toploc"][name]
    del old["audit"], old["env"]  # sections added later still, hashed only off their default
    assert hashlib.sha256(RUN_ID_DOMAIN + encoding.packb(old)).digest() == signed.run_id
    before = re.sub(r'(?m)^(replay_rule|replay_logit_bound|eos_prob_slack|worker_dtype|fp32_logits|hard_factor) = .*\n', "", unsigned)
    before = before[: before.index("[audit]")]
    back = parse_run_spec(before, require_signature=False).spec
    assert back.run_id == signed.run_id and (back.toploc.replay_rule, back.toploc.eos_prob_slack) == ("eps-v1", 0.01)
    bound = unsigned.replace('replay_rule = "eps-v1"', 'replay_rule = "logit-bound-v1"')
    with pytest.raises(RunSpecError, match=r"^run spec field toploc: .*needs toploc\.replay_logit_bound > 0"):
        parse_run_spec(bound, require_signature=False)
    bf16 = parse_run_spec(bound.replace("replay_logit_bound = 0.0", "replay_logit_bound = 0.75"), require_signature=False).spec
    assert bf16.toploc.replay_logit_bound == 0.75 and bf16.run_id != signed.run_id
    with pytest.raises(RunSpecError, match=r"^run spec field toploc: .*belong to replay rule eps-v1"):
        parse_run_spec(bound.replace("replay_logit_bound = 0.0", "replay_logit_bound = 0.75").replace("replay_eps = 0.0001", "replay_eps = 0.05"),
                       require_signature=False)
    with pytest.raises(RunSpecError, match=r"^run spec field toploc: .*belongs to the logit-bound replay rules"):
        parse_run_spec(unsigned.replace("replay_logit_bound = 0.0", "replay_logit_bound = 0.75"), require_signature=False)
    for bad in ("nan", "inf", "-0.5", "4.5"):
        with pytest.raises(RunSpecError, match=r"^run spec field toploc\.replay_logit_bound: "):
            parse_run_spec(bound.replace("replay_logit_bound = 0.0", f"replay_logit_bound = {bad}"), require_signature=False)
    slack = parse_run_spec(unsigned.replace("eos_prob_slack = 0.01", "eos_prob_slack = 0.02"), require_signature=False).spec
    assert slack.toploc.eos_prob_slack == 0.02 and slack.run_id != signed.run_id
    assert ToplocSpec().replay_rule == "eps-v1"


def test_artifacts_table_keeps_old_run_ids_and_pins_content():
    """``[artifacts]`` is absent from the hashed content while empty (a spec signed before it keeps its
    run ID and its text has no such table); a pinned artifact is part of the signed content."""
    import hashlib

    from protocol import encoding
    from protocol.runspec import RUN_ID_DOMAIN

    signed = sign_run_spec(spec(), COORD)
    text = dump_run_spec(signed)
    assert "[artifacts]" not in text
    content = signed.spec.model_dump(mode="python")
    del content["artifacts"], content["audit"], content["env"]  # all added after specs were signed: hashed only off their defaults
    for name in ("replay_rule", "replay_logit_bound", "eos_prob_slack", "worker_dtype", "fp32_logits", "hard_factor"):
        del content["toploc"][name]
    assert hashlib.sha256(RUN_ID_DOMAIN + encoding.packb(content)).digest() == signed.run_id
    pinned = sign_run_spec(spec().model_copy(update={"artifacts": {"tasks": "ab" * 32}}), COORD)
    assert pinned.run_id != signed.run_id and pinned.spec.artifact_id("tasks") == bytes.fromhex("ab" * 32)
    ptext = dump_run_spec(pinned)
    assert parse_run_spec(ptext).spec.artifacts == {"tasks": "ab" * 32}
    with pytest.raises(RunSpecError, match="modified after signing"):
        parse_run_spec(ptext.replace("ab" * 32, "ac" + "ab" * 31))
    with pytest.raises(RunSpecError, match=r"artifacts"):
        parse_run_spec(ptext.replace("[artifacts]\ntasks = ", "[artifacts]\nTasks = "), require_signature=False)
