"""A run's own environment (``protocol.envs``): naming, pinning, tasks, the three adapters in their
sandbox, and the reward path through them. The hostile reward files are in
``tests/security/test_env_sandbox.py``; a devnet on one is in ``tests/node/test_devnet_env.py``."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from protocol.envs import EnvError, EnvFile, EnvLimits, environment_hash, environment_source, open_environment, parse_env_ref
from protocol.envs.sandboxed import instance_id
from protocol.envs.tasks import env_tasks
from protocol.rewards import RewardError, compute_reward, compute_rewards
from protocol.rewards.sandbox import sandbox_status
from protocol.tasks import Task, TaskError, dataset_hash, load_tasks

REPO = Path(__file__).resolve().parents[2]
needs_sandbox = pytest.mark.skipif(not sandbox_status()[0], reason=f"no sandbox here: {sandbox_status()[1]}")
needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                              reason="reasoning-gym is not installed: pip install -e '.[test]' (or '.[reasoning-gym]')")

ADDITION = '''
import random

def generate(seed, count):
    rng = random.Random(seed)
    return [{"id": f"add-{seed}-{i}", "a": (a := rng.randint(0, 20)), "b": (b := rng.randint(0, 9)), "answer": str(a + b)}
            for i in range(count)]

def prompt(task):
    return f"{task['a']}+{task['b']}="

def score(task, completion):
    return 1.0 if completion.strip() == task["answer"] else 0.0
'''


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------- naming and pinning (pure)


def test_names_parse_and_bad_ones_are_one_line():
    ref = parse_env_ref("reasoning_gym:basic_arithmetic=2,chain_sum")
    assert (ref.kind, ref.datasets) == ("reasoning_gym", (("basic_arithmetic", 2.0), ("chain_sum", 1.0)))
    assert parse_env_ref("verifiers:vf-gsm8k").module == "vf_gsm8k"
    assert parse_env_ref("file:envs/mine.py").path == parse_env_ref("envs/mine.py").path == "envs/mine.py"
    for bad in ("", " x.py", "reasoning_gym:", "reasoning_gym:Bad", "reasoning_gym:a=0", "reasoning_gym:a,a", "verifiers:a/b", "tasks.jsonl"):
        with pytest.raises(EnvError) as e:
            parse_env_ref(bad)
        assert "\n" not in str(e.value)


def test_hash_covers_bytes_and_versions_not_order():
    files = [EnvFile("env.py", b"def score(t, c): return 1.0\n"), EnvFile("data/tasks.jsonl", b"{}\n")]
    h = environment_hash("file", files, {"numpy": "2.0"})
    assert re.fullmatch(r"[0-9a-f]{64}", h)
    assert environment_hash("file", files[::-1], {"numpy": "2.0"}) == h
    assert environment_hash("file", [files[0], EnvFile("data/tasks.jsonl", b"{} \n")], {"numpy": "2.0"}) != h
    assert environment_hash("file", files, {"numpy": "2.1"}) != h
    assert environment_hash("verifiers", files, {"numpy": "2.0"}) != h
    for bad in ("/etc/passwd", "../x", "a/../../b", ""):
        with pytest.raises(EnvError):
            environment_hash("file", [EnvFile(bad, b"")], {})
    with pytest.raises(EnvError, match="twice"):
        environment_hash("file", [files[0], files[0]], {})


def test_plain_file_source_reads_its_data_files_without_running_it(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    env = write(tmp_path / "env.py", 'TASKS_FILE = "tasks.jsonl"\nraise SystemExit("never run by the node")\ndef score(t, c):\n    return 1.0\n')
    src = environment_source(parse_env_ref(str(env)))
    assert [f.path for f in src.files] == ["env.py", "tasks.jsonl"] and src.bound == src.files and src.entry == "/env/env.py"
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1+1=", "answer": "3"}\n')
    assert environment_source(parse_env_ref(str(env))).hash != src.hash  # the data is pinned too
    write(env, 'TASKS_FILE = "../outside.jsonl"\ndef score(t, c):\n    return 1.0\n')
    with pytest.raises(EnvError, match="must lie in its folder"):
        environment_source(parse_env_ref(str(env)))
    write(env, 'TASKS_FILE = "ta" + "sks.jsonl"\n')
    with pytest.raises(EnvError, match="plain string"):
        environment_source(parse_env_ref(str(env)))


def test_missing_adapter_library_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("reasoning_gym", "verifiers") else real(name, *a))
    for name, extra in (("reasoning_gym:chain_sum", "reasoning-gym"), ("verifiers:vf_x", "verifiers")):
        with pytest.raises(EnvError) as e:
            open_environment(name)
        assert "\n" not in str(e.value) and f"pip install 'intellect-node[{extra}]'" in str(e.value)


def test_hash_mismatch_is_refused_in_one_line_naming_both(tmp_path):
    env = write(tmp_path / "add.py", ADDITION)
    got = environment_source(parse_env_ref(str(env))).hash
    with pytest.raises(EnvError) as e:
        open_environment(str(env), pinned_hash="0" * 64)  # refused before any sandbox starts
    msg = str(e.value)
    assert "\n" not in msg and got in msg and "0" * 64 in msg


def test_env_rows_become_tasks_with_heldout_rules():
    items = {"train": [{"id": f"t{i}", "prompt": f"{i}+1=", "row": {"i": i}} for i in range(20)],
             "heldout": [{"id": "h0", "prompt": "3+1=", "row": {}}, {"id": "h1", "prompt": "99+1=", "row": {}}]}
    got = env_tasks("a" * 64, items, "toy")
    assert [t.problem_id for t in got.heldout] == ["h1"] and got.dropped == 1  # "3+1=" is a training prompt
    t = got.train[0]
    assert t.task_type == "environment" and t.environment_row == ("a" * 64, {"i": 0})
    assert dataset_hash(got.train) != dataset_hash(env_tasks("b" * 64, items, "toy").train)  # the tasks name their environment
    no_split = env_tasks("a" * 64, {"train": items["train"] * 1 + [{"prompt": f"x{i}", "row": {}} for i in range(200)], "heldout": None}, "toy")
    assert no_split.heldout and len(no_split.train) + len(no_split.heldout) == 220  # 1 in 50 held out by ID
    with pytest.raises(EnvError, match="twice"):
        env_tasks("a" * 64, {"train": [items["train"][0]] * 2, "heldout": []}, "toy")
    with pytest.raises(EnvError, match="not JSON|finite"):
        env_tasks("a" * 64, {"train": [{"prompt": "p", "row": {"x": float("nan")}}], "heldout": []}, "toy")


def test_task_files_cannot_hold_environment_tasks(tmp_path):
    row = {"problem_id": "e", "task_type": "environment", "prompt": "p",
           "verification_info": json.dumps({"environment": "a" * 64, "row": {}})}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(TaskError, match="belongs to a run's environment"):
        load_tasks(tmp_path / "t.jsonl")
    assert Task.from_dict(row).environment_row == ("a" * 64, {})


def test_an_environment_task_needs_its_environment_open():
    task = env_tasks("c" * 64, {"train": [{"prompt": "p", "row": {}}], "heldout": []}, "toy").train[0]
    with pytest.raises(RewardError, match="no environment"):
        compute_reward(task, "x", 1, None, 0.0)


# ----------------------------------------------------------------------------- the adapters, in the sandbox


@needs_sandbox
def test_plain_file_generator_end_to_end_through_compute_reward(tmp_path):
    env = open_environment(str(write(tmp_path / "add.py", ADDITION)), seed=3, train_size=40, heldout_size=10)
    try:
        train = env.tasks.train
        assert len(train) == 40 and train[0].prompt.endswith("=") and train[0].problem_id == "add-3-0"
        assert all(t.prompt not in {x.prompt for x in train} for t in env.tasks.heldout)
        assert env.tasks.heldout and all(t.problem_id.startswith(f"add-{3 + 2**32}-") for t in env.tasks.heldout)  # its own seed range
        assert env.id == instance_id(env.hash, str(tmp_path / "add.py"), {})
        _, row = train[0].environment_row
        right = compute_reward(train[0], row["answer"], 2, None, 0.0)
        wrong = compute_reward(train[0], "no", 2, 8, 0.01)
        assert (right.task_reward, right.env_fault) == (1.0, None)
        assert (wrong.task_reward, wrong.reward, wrong.env_fault) == (0.0, pytest.approx(-0.06), None)  # the length penalty as ever
        again = open_environment(str(tmp_path / "add.py"), seed=3, train_size=40, heldout_size=10)
        assert again is env and dataset_hash(again.tasks.train) == dataset_hash(train)  # deterministic, opened once per process
    finally:
        env.close()


@needs_sandbox
def test_batches_score_as_one_by_one_and_blame_the_right_completion(tmp_path):
    path = write(tmp_path / "picky.py", """
        import random, time

        CALLS = []

        def generate(seed, count):
            return [{"prompt": f"p{i}", "n": i} for i in range(count)]

        def score(task, completion):
            CALLS.append(completion)  # state kept between calls would make a batch differ from one by one
            if len(CALLS) > 1:
                return 0.5
            if completion == "boom":
                raise KeyError("boom")
            if completion == "slow":
                time.sleep(60)
            return round(random.random(), 6) if completion == "rand" else float(completion == str(task["n"]))
        """)
    env = open_environment(str(path), train_size=8, heldout_size=0, limits=EnvLimits(score_wall_s=2.0, pool=1))
    try:
        rows = [t.environment_row[1] for t in env.tasks.train]
        items = [(rows[i % 8], c) for i, c in enumerate(["0", "1", "x", "rand", "boom", "5", "rand", "7"] * 3)]
        batch = env.score_many(items)
        assert batch == [env.score(r, c) for r, c in items]
        assert [s.fault for s in batch[:8]] == [None, None, None, None, "crash", None, None, None]
        tasks = [env.tasks.train[i % 8] for i in range(len(items))]
        assert compute_rewards([(t, c, 1, None) for t, (_, c) in zip(tasks, items)], 0.0) == \
            [compute_reward(t, c, 1, None, 0.0) for t, (_, c) in zip(tasks, items)]
        slow = env.score_many([(rows[0], "0"), (rows[1], "slow"), (rows[2], "2")])  # the batch runs over: scored one by one
        assert [s.fault for s in slow] == [None, "wall", None] and slow[2].value == 1.0
    finally:
        env.close()


@needs_sandbox
def test_plain_file_with_task_and_heldout_files(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"say {w}", "word": w}) + "\n" for w in ("a", "b", "c")))
    (tmp_path / "held.json").write_text(json.dumps([{"prompt": "say z", "word": "z"}]))
    path = write(tmp_path / "echo.py", '''
        TASKS_FILE = "train.jsonl"
        HELDOUT_FILE = "held.json"

        def score(task, completion):
            return 1.0 if completion.strip() == task["word"] else 0.0
        ''')
    env = open_environment(str(path), train_size=2)
    try:
        assert [t.prompt for t in env.tasks.train] == ["say a", "say b"] and [t.prompt for t in env.tasks.heldout] == ["say z"]
        _, row = env.tasks.heldout[0].environment_row
        assert env.score(row, "z").value == 1.0 and env.score(row, "y").value == 0.0
    finally:
        env.close()


@needs_sandbox
def test_a_file_that_does_not_load_is_one_line(tmp_path):
    for text, want in (("def score(t, c):\n    return 1\nimport no_such_module_here\n", "ModuleNotFoundError"),
                       ("x = 1\n", "score"), ("def score(t, c):\n    return 1\n", "generate")):
        with pytest.raises(EnvError) as e:
            open_environment(str(write(tmp_path / "broken.py", text)))
        assert want in str(e.value) and "\n" not in str(e.value)


@needs_sandbox
@needs_rg
def test_reasoning_gym_with_weights_config_template_and_both_answer_modes():
    args = {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "basic_arithmetic": {"max_terms": 2, "max_digits": 1},
            "template": "Q: {question}"}
    env = open_environment("reasoning_gym:chain_sum=3,basic_arithmetic=1", args=args, seed=5, train_size=200, heldout_size=20)
    try:
        train = env.tasks.train
        sources = [t.environment_row[1]["metadata"]["source_dataset"] for t in train]
        assert 100 < sources.count("chain_sum") < 190 and sources.count("basic_arithmetic") > 10  # 3 : 1
        assert all(t.prompt.startswith("Q: ") for t in train) and train[0].problem_id == f"{sources[0]}/train/0"
        held_seeds = {t.environment_row[1]["rg"]["seed"] for t in env.tasks.heldout}
        assert held_seeds == {5 + (1 << 32)}  # a disjoint seed range
        _, row = train[0].environment_row
        assert compute_reward(train[0], f"<answer>{row['answer']}</answer>", 5, None, 0.0).task_reward == 1.0
        assert compute_reward(train[0], row["answer"], 5, None, 0.0).task_reward == 0.0  # no tags: no answer
    finally:
        env.close()
    text = open_environment("reasoning_gym:chain_sum", args={"chain_sum": {"max_digits": 1}, "answer": "text"}, train_size=5, heldout_size=0)
    try:
        _, row = text.tasks.train[0].environment_row
        assert text.score(row, f" {row['answer']}\n").value == 1.0 and row["reference"] == row["answer"]
    finally:
        text.close()
    for bad, why in (({"chain_sum": {"seed": 1}}, "without seed or size"), ({"nope": {}}, "neither a dataset"),
                     ({"chain_sum": {"max_digits": "x"}}, "failed to load")):
        with pytest.raises(EnvError, match=why):
            open_environment("reasoning_gym:chain_sum", args=bad, train_size=2, heldout_size=0)


VF_MODULE = '''
import verifiers as vf
from datasets import Dataset

def load_environment(n: int = 12, **kw):
    rows = [{"question": f"{a}+{a % 7}=", "answer": str(a + a % 7)} for a in range(n)]
    parser = vf.Parser()

    def correct(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows[:-3]), eval_dataset=Dataset.from_list(rows[-3:]), system_prompt="Add.",
                            parser=parser, rubric=vf.Rubric(funcs=[correct], weights=[1.0], parser=parser))
'''


@needs_sandbox
def test_verifiers_single_turn_environment(tmp_path, monkeypatch):
    pytest.importorskip("verifiers", reason="verifiers is not installed: pip install -e '.[verifiers]'")
    pytest.importorskip("datasets", reason="verifiers' datasets is not installed: pip install -e '.[verifiers]'")
    pkg = tmp_path / "vf_toy_addition"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(VF_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # found here; its files are shown to the sandbox from memory
    env = open_environment("verifiers:vf_toy_addition", args={"n": 15}, train_size=50, heldout_size=10)
    try:
        assert len(env.tasks.train) == 12 and len(env.tasks.heldout) == 3  # its own eval_dataset is the held-out split
        task = env.tasks.train[3]
        assert task.prompt == "Add.\n\n3+3="
        assert compute_reward(task, "6", 1, None, 0.0).task_reward == 1.0
        assert compute_reward(task, "7", 1, None, 0.0).task_reward == 0.0
        assert "verifiers" in env.source.packages
    finally:
        env.close()
        sys.modules.pop("vf_toy_addition", None)


# ----------------------------------------------------------------------------- the guide's example file


def guide_example() -> str:
    """The one Python block of docs/tasks.md § Your own environment."""
    text = (REPO / "docs" / "tasks.md").read_text()
    section = text[text.index("## Your own environment"):]
    section = section[: section.index("\n## ", 3)] if "\n## " in section[3:] else section
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "the section has one complete example file"
    return blocks[0]


@needs_sandbox
def test_the_guides_example_file_runs(tmp_path):
    path = tmp_path / "letter_count.py"
    path.write_text(guide_example())
    env = open_environment(str(path), seed=1, train_size=300, heldout_size=50)
    try:
        assert len(env.tasks.train) == 300 and env.tasks.heldout
        for task in env.tasks.train[:20]:
            _, row = task.environment_row
            assert compute_reward(task, row["answer"], 3, None, 0.0).task_reward == 1.0
            assert compute_reward(task, row["answer"] + "0", 4, None, 0.0).task_reward < 1.0
    finally:
        env.close()
