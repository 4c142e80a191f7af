"""Task files (file I/O, not pure): reading task files (:func:`load_tasks`: JSONL, gzip, JSON,
Parquet) and converting the public sets under a data root (:func:`convert`: GSM8K, MATH-500,
DeepScaleR MATH, HumanEval, MBPP) into :class:`~protocol.tasks.schema.Task` lists.

It reads only the paths its caller names (a file, or ``data_root`` joined with
:data:`CONVERTER_FILES`); it writes nothing.
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from protocol.tasks.schema import _SOLVE_RATE_KEYS, ENV_TASK_TYPE, Task, TaskError, code_task, math_task

logger = logging.getLogger(__name__)


MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to converted math problems (DeepSeek-R1's recommended math instruction)."""

CODE_INSTRUCTION = "Write your solution as a single Python program in a ```python code block."
"""Appended to converted code problems; the code reward reads the last fenced block."""


def _iter_json_lines(path: Path, opener: Any) -> Iterator[tuple[str, Any]]:
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise TaskError(f"invalid JSON: {e}", where) from e
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read: {e}", str(path)) from e


def _iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    name = path.name.lower()
    if name.endswith(".jsonl.gz"):
        yield from _iter_json_lines(path, gzip.open)
    elif name.endswith(".jsonl"):
        yield from _iter_json_lines(path, open)
    elif name.endswith(".json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise TaskError(f"cannot read: {e}", str(path)) from e
        except json.JSONDecodeError as e:
            raise TaskError(f"invalid JSON at line {e.lineno}: {e.msg}", str(path)) from e
        if not isinstance(data, list):
            raise TaskError("a .json task file must hold a list of task objects", str(path))
        for i, row in enumerate(data):
            yield f"{path}[{i}]", row
    elif name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise TaskError("reading .parquet needs pyarrow: pip install pyarrow", str(path)) from e
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:
            raise TaskError(f"cannot read parquet: {e}", str(path)) from e
        for i, row in enumerate(table.to_pylist()):
            yield f"{path} row {i}", row
    else:
        raise TaskError("unknown task file type; use .jsonl, .jsonl.gz, .json or .parquet", str(path))


def load_tasks(path: str | Path) -> list[Task]:
    """Load and strictly validate a task file in the INTELLECT-2 schema.

    Formats, by file name: ``.jsonl`` / ``.jsonl.gz`` (one object per line; blank lines skipped),
    ``.json`` (a list of objects), ``.parquet`` (needs ``pyarrow``; columns are the schema's
    keys). A ``solve_rate`` that is null in a parquet column counts as absent.

    Args:
        path: the file to read.

    Returns:
        The tasks in file order (that order is what :func:`derive_task_indices` indexes).

    Raises:
        TaskError: naming the file and line (or row) of the first invalid task, a duplicate
            ``problem_id``, an unreadable file or an empty one.
    """
    path = Path(path)
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for where, row in _iter_rows(path):
        if isinstance(row, dict):
            row = {k: v for k, v in row.items() if not (k in _SOLVE_RATE_KEYS and v is None)}
        task = Task.from_dict(row, where)
        if task.task_type == ENV_TASK_TYPE:
            raise TaskError("task_type 'environment' belongs to a run's environment ([env] in the run spec), not to a task file", where)
        if task.problem_id in seen:
            raise TaskError(f"duplicate problem_id {task.problem_id!r} (first at {seen[task.problem_id]})", where)
        seen[task.problem_id] = where
        tasks.append(task)
    if not tasks:
        raise TaskError("no tasks in file", str(path))
    logger.info("loaded %d tasks from %s", len(tasks), path)
    return tasks


CONVERTER_FILES: dict[str, str] = {
    "gsm8k": "math/gsm8k_test.jsonl",
    "gsm8k_train": "math/gsm8k_train.jsonl",
    "math500": "math/math500_test.jsonl",
    "math_train": "math/deepscaler_train_math.json",
    "humaneval": "code/HumanEval.jsonl.gz",
    "mbpp": "code/mbpp.jsonl",
}
CONVERTER_NAMES: tuple[str, ...] = tuple(CONVERTER_FILES)
CONVERTER_SPLITS: dict[str, str] = {
    "gsm8k": "GSM8K test split, 1319 problems",
    "gsm8k_train": "GSM8K train split, 7473 problems",
    "math500": "MATH-500 test subset, 500 problems",
    "math_train": "DeepScaleR MATH train split, 7472 problems",
    "humaneval": "HumanEval, 164 problems (test only)",
    "mbpp": "MBPP, all 974 problems",
}
"""What each public set name means: which split, how many problems."""
EVALUATION_ONLY: dict[str, str] = {
    "gsm8k": "gsm8k_train",
    "math500": "math_train",
    "humaneval": "mbpp",
}
"""Public sets published as test or evaluation splits, each with the training set to use instead.
A run may train on them (the devnet does, to run every stage on real tasks), but its held-out
scores then measure nothing a benchmark reports: :func:`training_split_warning` says so."""


def training_split_warning(tasks: str) -> str | None:
    """One line when ``tasks`` (a run spec's ``data.tasks``) is a test/evaluation split; ``None`` otherwise."""
    instead = EVALUATION_ONLY.get(tasks)
    if instead is None:
        return None
    return (f"data.tasks {tasks!r} is the {CONVERTER_SPLITS[tasks]}, published for evaluation, not training: a run that trains on it "
            f"learns the test answers, and its scores on that benchmark mean nothing. Train on {instead!r} "
            f"({CONVERTER_SPLITS[instead]}) unless this is a smoke test")


def task_set_help() -> str:
    """One line naming every public task set with its split (for ``--help`` and errors)."""
    return "; ".join(f"{name} ({CONVERTER_SPLITS[name]})" for name in CONVERTER_NAMES)


def _raw_rows(path: Path) -> list[tuple[str, Any]]:
    return list(_iter_rows(path))


def _require(row: Any, keys: Sequence[str], where: str) -> dict[str, Any]:
    if not isinstance(row, dict) or any(k not in row for k in keys):
        raise TaskError(f"expected an object with keys {list(keys)}", where)
    return row


def _math_prompt(problem: str) -> str:
    return f"{problem.strip()}\n\n{MATH_INSTRUCTION}"


def _convert_gsm8k(rows: list[tuple[str, Any]], split: str) -> list[Task]:
    tasks = []
    for i, (where, row) in enumerate(rows):
        row = _require(row, ("question", "answer"), where)
        if "####" not in row["answer"]:
            raise TaskError("GSM8K answer has no '#### <number>' line", where)
        gt = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        tasks.append(math_task(f"gsm8k/{split}/{i}", _math_prompt(row["question"]), gt))
    return tasks


def _convert_math500(rows: list[tuple[str, Any]]) -> list[Task]:
    tasks = []
    for where, row in rows:
        row = _require(row, ("problem", "answer", "unique_id"), where)
        uid = row["unique_id"].removesuffix(".json")
        tasks.append(math_task(f"math500/{uid}", _math_prompt(row["problem"]), row["answer"]))
    return tasks


def _convert_math_train(rows: list[tuple[str, Any]]) -> list[Task]:
    tasks = []
    for i, (where, row) in enumerate(rows):
        row = _require(row, ("problem", "answer"), where)
        if row["answer"] is None or not str(row["answer"]).strip():
            logger.debug("skipping %s: no answer", where)
            continue
        tasks.append(math_task(f"math_train/{i}", _math_prompt(row["problem"]), str(row["answer"])))
    return tasks


def _top_level_imports(source: str) -> str:
    """The top-level import statements of a HumanEval prompt, one per line."""
    tree = ast.parse(source)
    return "\n".join(
        ast.get_source_segment(source, node) or "" for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
    )


def _convert_humaneval(rows: list[tuple[str, Any]]) -> list[Task]:
    tasks = []
    for where, row in rows:
        row = _require(row, ("task_id", "prompt", "entry_point", "test"), where)
        prompt = (
            "Complete the following Python function. Return the complete function, including its "
            f"signature and any imports it needs.\n\n```python\n{row['prompt'].rstrip()}\n```\n\n"
            f"{CODE_INSTRUCTION}"
        )
        test = f"{row['test'].rstrip()}\n\ncheck({row['entry_point']})\n"
        tests = {"assert_tests": [test], "prelude": _top_level_imports(row["prompt"])}
        tasks.append(code_task(row["task_id"], prompt, tests))
    return tasks


def _convert_mbpp(rows: list[tuple[str, Any]]) -> list[Task]:
    tasks = []
    for where, row in rows:
        row = _require(row, ("text", "task_id", "test_list", "test_setup_code"), where)
        asserts = [t.replace("\r\n", "\n").strip() for t in row["test_list"]]
        prompt = (
            f"You are an expert Python programmer, and here is your task: {row['text'].strip()} "
            "Your code should pass these tests:\n\n" + "\n".join(asserts) + f"\n\n{CODE_INSTRUCTION}"
        )
        tests = {"assert_tests": asserts, "setup_code": row["test_setup_code"].replace("\r\n", "\n")}
        tasks.append(code_task(f"mbpp/{row['task_id']}", prompt, tests))
    return tasks


def _sniff(rows: list[tuple[str, Any]], path: Path) -> str:
    """Recognise a raw public set by its first row's keys."""
    if not rows or not isinstance(rows[0][1], dict):
        raise TaskError("empty file or not a list of objects", str(path))
    keys = set(rows[0][1])
    if {"task_id", "prompt", "entry_point", "test"} <= keys:
        return "humaneval"
    if {"text", "code", "test_list"} <= keys:
        return "mbpp"
    if {"question", "answer"} <= keys:
        return "gsm8k_train" if "train" in path.name else "gsm8k"
    if {"problem", "answer", "unique_id"} <= keys:
        return "math500"
    if {"problem", "answer"} <= keys:
        return "math_train"
    raise TaskError(f"cannot tell which public set has keys {sorted(keys)}", str(path))


def convert(name_or_path: str | Path, data_root: str | Path | None = None) -> list[Task]:
    """Convert a raw public task set into INTELLECT-2-schema tasks.

    Names and files (relative to ``data_root``, the shared ``data/`` folder): ``gsm8k``
    (``math/gsm8k_test.jsonl``, 1319), ``gsm8k_train`` (7473), ``math500`` (500), ``math_train``
    (``math/deepscaler_train_math.json``: 7474 rows, the 2 with a null answer skipped → 7472),
    ``humaneval`` (``code/HumanEval.jsonl.gz``, 164), ``mbpp`` (974). Anything else is taken as a
    path to one of those raw files and recognised by its columns.

    Problem IDs: ``gsm8k/<split>/<line index>``, ``math500/<unique_id without .json>``,
    ``math_train/<index in the raw file>``, HumanEval's ``task_id``, ``mbpp/<task_id>``.
    GSM8K ground truths lose their thousands commas (``"2,125"`` → ``"2125"``). Math prompts end
    with :data:`MATH_INSTRUCTION`, code prompts with :data:`CODE_INSTRUCTION`. Code tests use
    the assert-based encoding described in the module docstring.

    Args:
        name_or_path: a set name from :data:`CONVERTER_NAMES` or a path to a raw file.
        data_root: the folder holding ``math/`` and ``code/``; required with a set name.

    Returns:
        The converted tasks, in the raw file's order.

    Raises:
        TaskError: for an unknown name, a missing ``data_root``, or an unreadable or
            unrecognised file.
    """
    if str(name_or_path) in CONVERTER_FILES:
        name = str(name_or_path)
        if data_root is None:
            raise TaskError(f"task set {name!r} needs the public task files: pass --data-root DIR (the folder with math/ and code/) "
                            "to this node (data_root is unset)")
        path = Path(data_root) / CONVERTER_FILES[name]
        if not path.is_file():
            raise TaskError(f"no such file for set {name!r}", str(path))
        rows = _raw_rows(path)
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise TaskError(f"neither a set name ({', '.join(CONVERTER_NAMES)}) nor an existing file", str(path))
        rows = _raw_rows(path)
        name = _sniff(rows, path)
    if name in ("gsm8k", "gsm8k_train"):
        tasks = _convert_gsm8k(rows, "test" if name == "gsm8k" else "train")
    elif name == "math500":
        tasks = _convert_math500(rows)
    elif name == "math_train":
        tasks = _convert_math_train(rows)
    elif name == "humaneval":
        tasks = _convert_humaneval(rows)
    else:
        tasks = _convert_mbpp(rows)
    logger.info("converted %d %s tasks from %s", len(tasks), name, path)
    return tasks
