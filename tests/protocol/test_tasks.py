"""Tasks: schema validation, loading, converters on the real public sets, hashing, derivation,
prompts."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.tasks import (
    CONVERTER_NAMES,
    Task,
    TaskError,
    build_messages,
    build_prompt_text,
    convert,
    dataset_hash,
    derive_task_indices,
    load_tasks,
)


@pytest.fixture(scope="module")
def data() -> Path:
    """``$INTELLECT_SHARED/data``, default ``<repo>/../shared/data``; skips when absent."""
    repo = Path(__file__).resolve().parents[2]
    d = Path(os.environ.get("INTELLECT_SHARED", repo.parent / "shared")) / "data"
    if not d.is_dir():
        pytest.skip(f"shared data not found at {d} (set INTELLECT_SHARED)")
    return d


SUFFIX = "Think for 1000 tokens before giving a response."


def _row(**over):
    row = {
        "problem_id": "p1",
        "task_type": "verifiable_math",
        "prompt": "What is 2+2?",
        "verification_info": json.dumps({"ground_truth": "4"}),
    }
    row.update(over)
    return row


def _code_row(test_cases: dict, **over):
    return _row(
        task_type="prime_rl_code",
        verification_info=json.dumps({"test_cases": json.dumps(test_cases)}),
        **over,
    )


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- schema


def test_task_error_is_protocol_error():
    assert issubclass(TaskError, ProtocolError)


def test_math_task_accessors():
    task = Task.from_dict(_row(solve_rate_qwen_r1_distill_7b=0.5))
    assert task.ground_truth == "4"
    assert task.solve_rate == 0.5
    with pytest.raises(TaskError, match="no test_cases"):
        _ = task.test_cases


def test_intellect2_stdio_and_call_test_cases():
    stdio = Task.from_dict(_code_row({"inputs": ["1 2\n"], "outputs": ["3\n"]}))
    assert stdio.test_cases.kind == "stdio" and stdio.test_cases.n_cases == 1
    call = Task.from_dict(_code_row({"inputs": [[1, 2], [3, 4]], "outputs": [3, 7], "fn_name": "add"}))
    tc = call.test_cases
    assert (tc.kind, tc.fn_name, tc.inputs, tc.outputs) == ("call", "add", ([1, 2], [3, 4]), (3, 7))
    with pytest.raises(TaskError, match="no ground_truth"):
        _ = call.ground_truth


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"problem_id": "x"}, "missing field"),
        (_row(extra=1), "unknown field"),
        (_row(task_type="chess"), "task_type"),
        (_row(problem_id=""), "problem_id"),
        (_row(prompt="  "), "prompt"),
        (_row(verification_info="{not json"), "not valid JSON"),
        (_row(verification_info=json.dumps({"ground_truth": ""})), "ground_truth"),
        (_row(verification_info={"ground_truth": "4"}), "JSON string"),
        (_row(solve_rate=1.5), "solve_rate"),
        (_row(solve_rate=0.2, solve_rate_qwen_r1_distill_7b=0.3), "only one"),
        (_row(task_type="prime_rl_code"), "test_cases"),
        (_code_row({"inputs": ["1"], "outputs": []}), "as many outputs"),
        (_code_row({"inputs": [1], "outputs": [1]}), "string inputs"),
        (_code_row({"inputs": [[1]], "outputs": [1], "fn_name": "not an id"}), "identifier"),
        (_code_row({"assert_tests": []}), "non-empty list"),
        (_code_row({"assert_tests": ["assert 1"], "bogus": 1}), "unknown keys"),
        (_row(task_type="prime_rl_code", verification_info=json.dumps({"test_cases": {"inputs": []}})), "JSON string"),
    ],
)
def test_invalid_rows_rejected(row, message):
    with pytest.raises(TaskError, match=message):
        Task.from_dict(row)


# ----------------------------------------------------------------------------- loading


def test_load_formats_round_trip(tmp_path):
    rows = [_row(problem_id=f"p{i}", solve_rate=i / 10) for i in range(5)]
    rows.append(_code_row({"assert_tests": ["assert f() == 1"]}, problem_id="c"))
    expected = [Task.from_dict(r) for r in rows]
    jsonl = _write_jsonl(tmp_path / "t.jsonl", rows)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    js = tmp_path / "t.json"
    js.write_text(json.dumps(rows))
    for path in (jsonl, gz, js):
        assert load_tasks(path) == expected
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist([t.to_dict() for t in expected]), tmp_path / "t.parquet")
    loaded = load_tasks(tmp_path / "t.parquet")
    assert loaded == expected
    assert dataset_hash(loaded) == dataset_hash(expected)


def test_load_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row()) + "\n\n" + "{oops\n")
    with pytest.raises(TaskError, match=r"bad\.jsonl:3: invalid JSON"):
        load_tasks(path)
    _write_jsonl(path, [_row(), _row(task_type="nope")])
    with pytest.raises(TaskError, match=r"bad\.jsonl:2: task_type"):
        load_tasks(path)
    _write_jsonl(path, [_row(), _row()])
    with pytest.raises(TaskError, match=r"bad\.jsonl:2: duplicate problem_id 'p1'"):
        load_tasks(path)
    path.write_text("")
    with pytest.raises(TaskError, match="no tasks"):
        load_tasks(path)
    with pytest.raises(TaskError, match="unknown task file type"):
        load_tasks(tmp_path / "tasks.csv")
    with pytest.raises(TaskError, match="cannot read"):
        load_tasks(tmp_path / "missing.jsonl")
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(TaskError, match="list of task objects"):
        load_tasks(tmp_path / "obj.json")


# ----------------------------------------------------------------------------- converters

EXPECTED_COUNTS = {
    "gsm8k": 1319,
    "gsm8k_train": 7473,
    "math500": 500,
    # 7474 rows; 2 have a null answer and 2 (indices 5328, 5330) an empty one: all 4 skipped
    "math_train": 7470,
    "humaneval": 164,
    "mbpp": 974,
}


@pytest.mark.parametrize("name", CONVERTER_NAMES)
def test_converter_counts_and_schema(data, name):
    tasks = convert(name, data)
    assert len(tasks) == EXPECTED_COUNTS[name]
    assert len({t.problem_id for t in tasks}) == len(tasks)
    for t in tasks:
        t.validate()
    kind = "prime_rl_code" if name in ("humaneval", "mbpp") else "verifiable_math"
    assert {t.task_type for t in tasks} == {kind}


def test_converter_details(data):
    gsm = convert("gsm8k", data)
    assert gsm[0].problem_id == "gsm8k/test/0" and gsm[0].ground_truth == "18"
    assert all("," not in t.ground_truth for t in gsm)
    assert "\\boxed{}" in gsm[0].prompt
    m500 = {t.problem_id: t for t in convert("math500", data)}
    assert m500["math500/test/precalculus/807"].ground_truth == "\\left( 3, \\frac{\\pi}{2} \\right)"
    he = convert("humaneval", data)
    assert he[0].problem_id == "HumanEval/0"
    tc = he[0].test_cases
    assert tc.kind == "assert" and tc.assert_tests[0].rstrip().endswith("check(has_close_elements)")
    assert tc.prelude == "from typing import List"
    mbpp = convert("mbpp", data)
    assert mbpp[0].problem_id == "mbpp/1"
    assert mbpp[0].test_cases.n_cases == 3
    assert all("\r" not in t.prompt and "\r" not in t.verification_info for t in mbpp)


def test_convert_by_path_sniffs_the_set(data):
    assert convert(data / "code" / "mbpp.jsonl") == convert("mbpp", data)
    assert convert(data / "math" / "math500_test.jsonl") == convert("math500", data)
    with pytest.raises(TaskError, match="data_root"):
        convert("gsm8k")
    with pytest.raises(TaskError, match="neither a set name"):
        convert("no-such-set", data)


# ----------------------------------------------------------------------------- hashing


def test_dataset_hash_pins_content_and_order():
    tasks = [Task.from_dict(_row(problem_id=f"p{i}")) for i in range(3)]
    h = dataset_hash(tasks)
    assert len(h) == 64 and h == dataset_hash(list(tasks))
    assert dataset_hash(tasks[::-1]) != h
    changed = [*tasks[:2], Task.from_dict(_row(problem_id="p2", prompt="What is 2+3?"))]
    assert dataset_hash(changed) != h
    assert dataset_hash([*tasks[:2], Task.from_dict(_row(problem_id="p2", solve_rate=0.5))]) != h


def test_dataset_hash_of_real_set_is_stable(data):
    a = convert("gsm8k", data)
    b = convert("gsm8k", data)
    assert dataset_hash(a) == dataset_hash(b)


# ----------------------------------------------------------------------------- derivation

PEER = "12D3KooWExamplePeer"


def test_derivation_golden_vector():
    # pinned: a change here changes which tasks every validator expects
    assert derive_task_indices(42, PEER, 7, 3, 1000, 4) == [494, 204, 170, 281]
    assert derive_task_indices(0, "p", 0, 0, 1, 1) == [0]


def test_derivation_deterministic_and_varies():
    base = derive_task_indices(1, PEER, 5, 0, 10_000, 8)
    assert base == derive_task_indices(1, PEER, 5, 0, 10_000, 8)
    assert len(set(base)) == 8 and all(0 <= i < 10_000 for i in base)
    variants = [
        derive_task_indices(1, PEER + "x", 5, 0, 10_000, 8),
        derive_task_indices(1, PEER, 5, 1, 10_000, 8),
        derive_task_indices(1, PEER, 6, 0, 10_000, 8),
        derive_task_indices(2, PEER, 5, 0, 10_000, 8),
    ]
    for v in variants:
        assert v != base


def test_derivation_full_permutation():
    assert sorted(derive_task_indices(3, PEER, 0, 0, 17, 17)) == list(range(17))


@pytest.mark.parametrize(
    "args",
    [
        (-1, PEER, 0, 0, 10, 1),
        (2**64, PEER, 0, 0, 10, 1),
        (0, "", 0, 0, 10, 1),
        (0, "x" * 256, 0, 0, 10, 1),
        (0, PEER, -1, 0, 10, 1),
        (0, PEER, 0, 0, 0, 1),
        (0, PEER, 0, 0, 10, 11),
        (0, PEER, 0, 0, 10, 0),
    ],
)
def test_derivation_rejects_bad_arguments(args):
    with pytest.raises(TaskError):
        derive_task_indices(*args)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**20),
    counter=st.integers(0, 2**20),
    n=st.integers(1, 5000),
    data=st.data(),
)
def test_derivation_properties(seed, step, counter, n, data):
    k = data.draw(st.integers(1, min(n, 16)))
    idx = derive_task_indices(seed, PEER, step, counter, n, k)
    assert len(idx) == k == len(set(idx)) and all(0 <= i < n for i in idx)
    assert idx == derive_task_indices(seed, PEER, step, counter, n, k)


# ----------------------------------------------------------------------------- prompts


def test_prompt_suffix_exact():
    task = Task.from_dict(_row())
    assert build_prompt_text(task, None) == task.prompt
    assert build_prompt_text(task, 1000) == f"{task.prompt} {SUFFIX}"
    with pytest.raises(TaskError):
        build_prompt_text(task, 0)


def test_build_messages():
    task = Task.from_dict(_row())
    assert build_messages(task, 1000) == [{"role": "user", "content": f"{task.prompt} {SUFFIX}"}]
    assert build_messages(task, 1000, system_prompt="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"{task.prompt} {SUFFIX}"},
    ]
    assert build_messages(task, 1000, length_prompt_location="system_prompt") == [
        {"role": "system", "content": SUFFIX},
        {"role": "user", "content": task.prompt},
    ]
    assert build_messages(task, None, length_prompt_location="system_prompt") == [{"role": "user", "content": task.prompt}]
    with pytest.raises(TaskError):
        build_messages(task, 10, length_prompt_location="elsewhere")  # type: ignore[arg-type]


def test_task_set_names_list_their_split():
    from protocol.dataset import resolve_tasks
    from protocol.tasks import CONVERTER_NAMES, CONVERTER_SPLITS, task_set_help

    assert set(CONVERTER_SPLITS) == set(CONVERTER_NAMES)
    assert "gsm8k (GSM8K test split" in task_set_help() and "gsm8k_train (GSM8K train split" in task_set_help()
    with pytest.raises(TaskError, match="gsm8k_train") as e:
        resolve_tasks("gsm9k")
    assert "\n" not in str(e.value)
