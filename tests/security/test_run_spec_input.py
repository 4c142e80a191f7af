"""What a node reads from a run spec it was handed (``protocol/runspec.py``): the decoder bounds its
work and names the field, and hostile values of the TOPLOC replay fields are refused.

A run spec arrives from whoever runs the run (or a file anyone can pass): its TOML is bounded in
size, nesting and digits before it is built, and every number the checks depend on is finite and
in range, under the rule it belongs to.
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from protocol import runspec
from protocol.errors import RunSpecError
from protocol.identity import NodeKey
from protocol.runspec import ToplocSpec, parse_run_spec

LB = "logit-bound-v1"


@pytest.mark.parametrize("text, why", [
    ("x = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("x = " + "{a=" * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ("[run]\nseed = " + "9" * 5000, "4300 digits"),
    ("#" * (2 << 20), "over the 1048576-byte limit"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_mant_err_mean = inf\n", "toploc.max_mant_err_mean"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_mant_err_median = nan\n", "toploc.max_mant_err_median"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = nan\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = -1e-4\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = inf\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_near_tie_fraction = 1.5\n", "toploc.max_near_tie_fraction"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_near_tie_fraction = nan\n", "toploc.max_near_tie_fraction"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_cap = inf\n", "rl.is_cap"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_cap = 1.0\n", "rl.is_cap"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = 'clip'\n", "rl.is_correction"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = 'mask'\nold_logprobs = 'behavior'\n", "needs old_logprobs"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = ['mask']\n", "rl.is_correction"),
    # env.args is free-form JSON: what has no canonical form named the field only as "run spec: ..." before
    ("[run]\ncoordinator = '{c}'\n[env]\nargs = {a = " + "[" * 20 + "1" + "]" * 20 + "}\n", "env.args.*nested deeper than 16"),
    ("[run]\ncoordinator = '{c}'\n[env]\nargs = {a = nan}\n", "env.args.*NaN"),
    ("[run]\ncoordinator = '{c}'\n[env]\nargs = {a = 99999999999999999999}\n", "env.args.*out of range"),
])
def test_run_spec_decoder_bounds_its_work_and_names_the_field(text: str, why: str) -> None:
    text = text.replace("{c}", NodeKey.from_seed(b"c" * 32).peer_id)
    with pytest.raises(RunSpecError, match=why):
        parse_run_spec(text, require_signature=False)


@pytest.mark.parametrize("kw", [
    {"replay_rule": "x"},
    {"replay_rule": "EPS-V1"},
    {"replay_rule": ["eps-v1"]},
    {"replay_rule": LB, "replay_logit_bound": math.nan},
    {"replay_rule": LB, "replay_logit_bound": math.inf},
    {"replay_rule": LB, "replay_logit_bound": 1e308},
    {"replay_rule": LB, "replay_logit_bound": -1.0},
    {"replay_rule": LB, "replay_logit_bound": {"a": 1}},
    {"replay_rule": LB},  # logit-bound-v1 without a bound
    {"replay_logit_bound": 1.0},  # a bound without its rule
    {"replay_rule": LB, "replay_logit_bound": 1.0, "eos_prob_slack": 0.2},  # eps-v1's field under the other rule
    {"eos_prob_slack": math.nan},
    {"eos_prob_slack": 10**400},
    {"eos_prob_slack": True},
])
def test_hostile_replay_fields_refused(kw: dict) -> None:
    # attacker A5's probes of the replay rule's fields (unknown rule, NaN/inf/huge/negative/nested/bool, fields under the wrong rule)
    with pytest.raises(ValidationError):
        ToplocSpec(**kw)


C = NodeKey.from_seed(b"c" * 32).peer_id


@pytest.mark.parametrize("table, line", [
    ("rl", 'group_size = "8"'),
    ("rl", "group_size = 8.0"),
    ("rl", "async_level = true"),
    ("sampling", "max_tokens = true"),
    ("sampling", "temperature = true"),
    ("sampling", 'temperature = "1.5"'),
    ("toploc", 'fp32_logits = "true"'),
    ("toploc", "fp32_logits = 1"),
    ("audit", 'calibration_batches = ["64"]'),
    ("audit", "calibration_batches = [true]"),
])
def test_a_spec_field_takes_its_own_type_not_a_coerced_one(table: str, line: str) -> None:
    # pydantic's lax mode read "8", 8.0 and true as the integer 8, 8 and 1 (and true as the float 1.0): the run ID hashed the
    # coerced value, so such a file verified against the signature of the plain one, and `async_level = true` meant 1
    field = line.split(" = ")[0]
    with pytest.raises(RunSpecError, match=rf"{table}\.{field}"):
        parse_run_spec(f"[run]\ncoordinator = '{C}'\n[{table}]\n{line}\n", require_signature=False)


def test_an_integer_float_is_the_same_float_and_arrays_stay_arrays() -> None:
    # what strictness keeps: `1` vs `1.0` is one value (docs/protocol.md §7), and a TOML array fills a tuple field
    one = parse_run_spec(f"[run]\ncoordinator = '{C}'\n[sampling]\ntemperature = 1\n", require_signature=False).spec
    same = parse_run_spec(f"[run]\ncoordinator = '{C}'\n[sampling]\ntemperature = 1.0\n", require_signature=False).spec
    assert one.run_id == same.run_id and one.sampling.temperature == 1.0
    audit = parse_run_spec(f"[run]\ncoordinator = '{C}'\n[audit]\ncalibration_batches = [1, 8]\n", require_signature=False).spec.audit
    assert audit.calibration_batches == (1, 8)


@pytest.mark.parametrize("tables, why", [
    ("[data]\ntasks_per_submission = 1024\n[rl]\ngroup_size = 1024\n", "1048576 rollouts, over the 16384"),
    ("[data]\ntasks_per_submission = 17\n[rl]\ngroup_size = 1024\n", "17408 rollouts, over the 16384"),
    ("[sampling]\nmax_tokens = 131072\n[toploc]\nchunk_size = 1\n", "131072 proofs per rollout, over the 65536"),
    ("[model]\nhidden_size = 1024\n[toploc]\ntopk = 512\n", "proofs of 1026 bytes, over the 1024"),
    ("[sampling]\nmax_tokens = 131072\n[rl]\ngroup_size = 64\n", "over the 33554432 of a submission/1"),
])
def test_a_spec_whose_submissions_could_never_be_sent_is_refused(tables: str, why: str) -> None:
    # each passed every bound of its own field: workers would decode a whole submission and then fail to seal it
    # (submission/1 carries ≤ 16,384 rollouts of ≤ 65,536 proofs of ≤ 1,024 bytes, in ≤ 32 MiB)
    with pytest.raises(RunSpecError, match=why):
        parse_run_spec(f"[run]\ncoordinator = '{C}'\n{tables}", require_signature=False)


def test_the_largest_spec_bounds_that_fit_still_load_and_match_the_proof_format() -> None:
    from protocol.messages import PROOF_MAX_BYTES
    from protocol.toploc import proof_size_bytes

    assert proof_size_bytes(511) <= PROOF_MAX_BYTES < proof_size_bytes(512)  # runspec's torch-free copy of the proof size
    for tables in ("[data]\ntasks_per_submission = 16\n[rl]\ngroup_size = 1024\n", "[model]\nhidden_size = 1024\n[toploc]\ntopk = 511\n",
                   "[sampling]\nmax_tokens = 32768\n[rl]\ngroup_size = 16\n"):
        parse_run_spec(f"[run]\ncoordinator = '{C}'\n{tables}", require_signature=False)


def test_a_spec_cannot_make_a_node_read_a_file_it_does_not_pin(tmp_path) -> None:
    # data.tasks may name a path, and a worker without the tasks artifact read whatever file it named (a spec written by
    # hand, no tasks_hash): a task-shaped file of the operator's (another run's private set) went out as the prompts of
    # every submission. Now a named file is read only under data.tasks_hash; names of public sets and "embedded" stay free.
    from protocol.dataset import resolve_run_tasks, resolve_tasks
    from protocol.runspec import DataSpec, RunInfo, RunSpec
    from protocol.tasks import TaskError, canonical_task_line, math_task

    private = tmp_path / "private.jsonl"
    private.write_bytes(b"".join(canonical_task_line(math_task(f"secret-{i}", f"the operator's prompt {i}", str(i))) for i in range(20)))
    unpinned = RunSpec(run=RunInfo(coordinator=C), data=DataSpec(tasks=str(private)))
    with pytest.raises(TaskError, match="does not pin it"):
        resolve_run_tasks(unpinned)
    pinned = unpinned.model_copy(update={"data": DataSpec(tasks=str(private), tasks_hash=resolve_tasks(str(private)).hash)})
    assert len(resolve_run_tasks(pinned).train) + len(resolve_run_tasks(pinned).heldout) == 20
    assert resolve_run_tasks(RunSpec(run=RunInfo(coordinator=C))).train  # "embedded" needs no pin


@pytest.mark.parametrize("seconds", ["1e-9", "0.0", "0.05"])
def test_a_heartbeat_interval_that_would_void_the_gossip_budgets_is_refused(seconds: str) -> None:
    # a node's budget of node records a forwarder may make it check is max_records_per_interval / heartbeat_interval_s a
    # second (node.p2p.topics.TopicGate): at 1e-9 s (the old bound was only > 0) it was 2.56e11, no budget at all
    with pytest.raises(RunSpecError, match="network.heartbeat_interval_s"):
        parse_run_spec(f"[run]\ncoordinator = '{C}'\n[network]\nheartbeat_interval_s = {seconds}\n", require_signature=False)
    assert parse_run_spec(f"[run]\ncoordinator = '{C}'\n[network]\nheartbeat_interval_s = 0.1\n", require_signature=False)


def _deep(parts: int) -> str:
    return "x" + ".x" * (parts - 1)


@pytest.mark.parametrize("text, line", [
    (_deep(15_000) + " = 1\n", 1),  # one dotted key: tomllib's work is quadratic in its parts (seconds at 30 KB)
    (f"[{_deep(1_000)}]\n" + "k = 1\n" * 1000, 1),  # every line under a deep header re-walks it
    (f"[[{_deep(40)}]]\n", 1),
    ("[run]\nname = 'a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v.w.x.y.z.a.b.c.d.e.f.g.h'\n" + _deep(33) + " = 1\n", 3),
    ("[env]\nargs = { " + _deep(40) + " = 1 }\n", 2),  # a dotted key inside an inline table
    ("[env.args]\n" + '"q.u.o.t.e.d" = """\n' + _deep(40) + ' = 1\n"""\n' + _deep(40) + " = 2\n", 5),  # after a multi-line string
    ("x = " + "[" * 100_000 + "]" * 100_000, 1),
])
def test_deep_nesting_is_refused_before_tomllib_reads_it(text: str, line: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parse(_text: str) -> None:
        raise AssertionError("tomllib.loads ran on text the nesting scan should have refused")

    monkeypatch.setattr(runspec.tomllib, "loads", no_parse)
    with pytest.raises(RunSpecError, match=rf"nested too deeply: \d+ levels at line {line} .*at most {runspec.MAX_SPEC_DEPTH}\)"):
        parse_run_spec(text, require_signature=True)


def test_dots_in_strings_quoted_keys_and_comments_are_not_nesting() -> None:
    """A spec whose values and quoted keys hold many dots (URLs, multiaddrs, a 40-part quoted key) and whose
    comments hold dotted keys parses and verifies, in any of TOML's string forms: the scan counts key parts."""
    coord, val = NodeKey.from_seed(b"c" * 32), NodeKey.from_seed(b"v" * 32)
    quoted = ".".join("k" * 40)
    args = {"servers": ["https://a.b.example.org/v1.2/x.y", f"/ip4/10.0.0.1/tcp/4001/p2p/{val.peer_id}"],
            quoted: {"x.y.z": "1.2.3.4", "q'uote\"d.[k]": "#not.a.comment = [1.2]"}, "deep": {"a": {"b": [[{"c": "d.e"}]]}}}
    signed = runspec.sign_run_spec(runspec.RunSpec(
        run=runspec.RunInfo(coordinator=coord.peer_id, validators=[val.peer_id]), data=runspec.DataSpec(tasks="environment"),
        env=runspec.EnvSpec(name="my_env.py", hash="ab" * 32, args=args)), coord)
    text = runspec.dump_run_spec(signed)
    assert f'"{quoted}"' in text
    # the same values in other TOML forms: literal strings, a multi-line string, a literal key, comments
    restyled = (text.replace('"https://a.b.example.org/v1.2/x.y"', "'https://a.b.example.org/v1.2/x.y'")
                .replace('"x.y.z" = "1.2.3.4"', "'x.y.z' = '''1.2.3.4'''  # " + _deep(40) + " = [[[")
                .replace('c = "d.e"', 'c = """d.e"""')
                .replace("[audit]", f"# {_deep(50)} = 1\n[audit]"))
    assert restyled != text
    for t in (text, restyled):
        assert parse_run_spec(t).run_id == signed.run_id
