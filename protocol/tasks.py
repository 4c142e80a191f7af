"""Tasks in the INTELLECT-2 schema: loading, converting public sets, hashing, derivation, prompts.

A :class:`Task` is one row of INTELLECT-2's RL dataset (PrimeIntellect/INTELLECT-2-RL-Dataset):
``problem_id``, ``task_type`` (``verifiable_math`` or ``prime_rl_code``), ``prompt`` and
``verification_info``, a JSON *string* whose content depends on the type:

* math: ``{"ground_truth": "70"}`` (LaTeX or a plain number, unboxed);
* code: ``{"test_cases": "<JSON string>"}`` where the inner JSON string is one of

  - stdin/stdout (INTELLECT-2, no ``fn_name``): ``{"inputs": [str, ...], "outputs": [str, ...]}``,
    the program reads ``inputs[i]`` on stdin and must print ``outputs[i]``;
  - call-based (INTELLECT-2, with ``fn_name``): ``{"inputs": [[arg, ...], ...], "outputs":
    [value, ...], "fn_name": "f"}``, ``f(*inputs[i])`` (or ``Solution().f`` when the program
    defines ``class Solution``) must return ``outputs[i]``;
  - assert-based (an intellect-node extension for HumanEval and MBPP, which ship assertions, not
    input/output pairs): ``{"assert_tests": [str, ...], "setup_code"?: str, "prelude"?: str}``.
    ``prelude`` runs before the solution (the imports a HumanEval prompt gives the model),
    ``setup_code`` after it (MBPP's ``test_setup_code``, which may use the solution's classes),
    then every snippet of ``assert_tests`` in the same namespace; a snippet passes when it runs
    without raising. HumanEval is one snippet, its ``check`` function followed by
    ``check(<entry_point>)``, exactly as the human-eval harness runs it; MBPP is one snippet per
    assertion of ``test_list`` (``challenge_test_list`` is left out, as in MBPP's own evaluation).

The tasks a worker solves are not its choice: :func:`derive_task_indices` maps (run seed, peer
ID, policy step, submission counter) to dataset indices, and a validator recomputes it.
:func:`dataset_hash` pins the dataset's content in the run spec.

This module is pure: it reads only the files a caller names and holds no paths of its own.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

__all__ = [
    "CONVERTER_NAMES",
    "LENGTH_CONTROL_TEMPLATE",
    "CodeTests",
    "Task",
    "TaskError",
    "TaskType",
    "build_messages",
    "build_prompt_text",
    "convert",
    "dataset_hash",
    "derive_task_indices",
    "load_tasks",
]

TaskType = Literal["verifiable_math", "prime_rl_code"]
TASK_TYPES: tuple[str, ...] = ("verifiable_math", "prime_rl_code")

LENGTH_CONTROL_TEMPLATE = "Think for {n} tokens before giving a response."
"""INTELLECT-2's length-control instruction (paper §3.3; prime-rl ``length_prompt_location``)."""

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to converted math problems (DeepSeek-R1's recommended math instruction)."""

CODE_INSTRUCTION = "Write your solution as a single Python program in a ```python code block."
"""Appended to converted code problems; the code reward reads the last fenced block."""

TASK_DERIVATION_DOMAIN = b"intellect-node/task-derivation/v1\x00"
"""Domain-separation prefix of :func:`derive_task_indices`'s hash input."""

MAX_PEER_ID_BYTES = 255
MAX_U64 = 2**64 - 1

_REQUIRED_KEYS = ("problem_id", "task_type", "prompt", "verification_info")
_SOLVE_RATE_KEYS = ("solve_rate", "solve_rate_qwen_r1_distill_7b")
_ALLOWED_KEYS = frozenset(_REQUIRED_KEYS + _SOLVE_RATE_KEYS)


class TaskError(ProtocolError):
    """A task file or row that is missing, malformed or inconsistent with the schema.

    Attributes:
        source: the file (and line or row) the bad task came from, or ``""``.
    """

    def __init__(self, message: str, source: str = "") -> None:
        super().__init__(f"{source}: {message}" if source else message)
        self.source = source


@dataclass(frozen=True, slots=True)
class CodeTests:
    """The parsed ``test_cases`` of a code task (see the module docstring for the encodings).

    Attributes:
        kind: ``"stdio"``, ``"call"`` or ``"assert"``.
        inputs: stdio: one stdin text per case; call: one argument list per case; assert: empty.
        outputs: stdio: expected stdout per case; call: expected return value per case.
        fn_name: call-based only: the function (or ``Solution`` method) to call.
        assert_tests: assert-based only: Python snippets that must run without raising.
        setup_code: assert-based only: runs after the solution, before the snippets.
        prelude: assert-based only: runs before the solution (imports the prompt provided).
    """

    kind: Literal["stdio", "call", "assert"]
    inputs: tuple[Any, ...] = ()
    outputs: tuple[Any, ...] = ()
    fn_name: str | None = None
    assert_tests: tuple[str, ...] = ()
    setup_code: str = ""
    prelude: str = ""

    @property
    def n_cases(self) -> int:
        """Number of test cases (assert snippets for the assert-based kind)."""
        return len(self.assert_tests) if self.kind == "assert" else len(self.inputs)


def _parse_test_cases(raw: Any, source: str) -> CodeTests:
    """Validate the inner ``test_cases`` value (a JSON string) and parse it.

    Raises:
        TaskError: if it is not a JSON object string in one of the three encodings.
    """
    if not isinstance(raw, str):
        raise TaskError("verification_info.test_cases must be a JSON string", source)
    try:
        tc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TaskError(f"verification_info.test_cases is not valid JSON: {e}", source) from e
    if not isinstance(tc, dict):
        raise TaskError("verification_info.test_cases must encode a JSON object", source)
    if "assert_tests" in tc:
        extra = set(tc) - {"assert_tests", "setup_code", "prelude"}
        if extra:
            raise TaskError(f"assert-based test_cases has unknown keys {sorted(extra)}", source)
        tests = tc["assert_tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise TaskError("test_cases.assert_tests must be a non-empty list of strings", source)
        setup, prelude = tc.get("setup_code", ""), tc.get("prelude", "")
        if not isinstance(setup, str) or not isinstance(prelude, str):
            raise TaskError("test_cases.setup_code and .prelude must be strings", source)
        return CodeTests(kind="assert", assert_tests=tuple(tests), setup_code=setup, prelude=prelude)
    extra = set(tc) - {"inputs", "outputs", "fn_name"}
    if extra:
        raise TaskError(f"test_cases has unknown keys {sorted(extra)}", source)
    inputs, outputs, fn_name = tc.get("inputs"), tc.get("outputs"), tc.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise TaskError("test_cases needs lists 'inputs' and 'outputs'", source)
    if len(inputs) != len(outputs) or not inputs:
        raise TaskError(
            f"test_cases needs as many outputs as inputs, at least one (got {len(inputs)} inputs, {len(outputs)} outputs)",
            source,
        )
    if fn_name is None:
        if not all(isinstance(x, str) for x in inputs + outputs):
            raise TaskError("stdin/stdout test_cases need string inputs and outputs", source)
        return CodeTests(kind="stdio", inputs=tuple(inputs), outputs=tuple(outputs))
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise TaskError(f"test_cases.fn_name must be a Python identifier, got {fn_name!r}", source)
    if not all(isinstance(x, list) for x in inputs):
        raise TaskError("call-based test_cases need one argument list per input", source)
    return CodeTests(kind="call", inputs=tuple(inputs), outputs=tuple(outputs), fn_name=fn_name)


@dataclass(frozen=True, slots=True)
class Task:
    """One task in the INTELLECT-2 schema.

    Construct through :meth:`from_dict` (validates everything) or directly and call
    :meth:`validate`. ``verification_info`` stays the exact JSON string of the dataset so that
    :func:`dataset_hash` is over the bytes the dataset holds.

    Attributes:
        problem_id: unique ID within the dataset.
        task_type: ``"verifiable_math"`` or ``"prime_rl_code"``.
        prompt: the problem text, without the length-control suffix (added at run time).
        verification_info: JSON string, ``{"ground_truth": ...}`` or ``{"test_cases": ...}``.
        solve_rate: optional pass rate of a reference model in [0, 1] (INTELLECT-2:
            ``solve_rate_qwen_r1_distill_7b``; it kept tasks with 0.1 ≤ rate ≤ 0.8).
    """

    problem_id: str
    task_type: TaskType
    prompt: str
    verification_info: str
    solve_rate: float | None = None

    @classmethod
    def from_dict(cls, row: Any, source: str = "") -> Task:
        """Build and validate a task from one dataset row.

        Accepts ``solve_rate`` or INTELLECT-2's column name ``solve_rate_qwen_r1_distill_7b``.

        Args:
            row: a mapping with the schema's keys; unknown keys are rejected.
            source: where the row came from (``"tasks.jsonl:12"``), used in error messages.

        Returns:
            The validated task.

        Raises:
            TaskError: on a missing, extra or mistyped field or bad ``verification_info``.
        """
        if not isinstance(row, dict):
            raise TaskError(f"a task must be a JSON object, got {type(row).__name__}", source)
        missing = [k for k in _REQUIRED_KEYS if k not in row]
        if missing:
            raise TaskError(f"missing field(s) {missing}", source)
        extra = set(row) - _ALLOWED_KEYS
        if extra:
            raise TaskError(f"unknown field(s) {sorted(extra)}; allowed: {sorted(_ALLOWED_KEYS)}", source)
        rates = [row[k] for k in _SOLVE_RATE_KEYS if row.get(k) is not None]
        if len(rates) > 1:
            raise TaskError(f"give only one of {list(_SOLVE_RATE_KEYS)}", source)
        task = cls(
            problem_id=row["problem_id"],
            task_type=row["task_type"],
            prompt=row["prompt"],
            verification_info=row["verification_info"],
            solve_rate=rates[0] if rates else None,
        )
        task.validate(source)
        return task

    def validate(self, source: str = "") -> None:
        """Check every field and parse ``verification_info`` once.

        Args:
            source: where the task came from, used in error messages.

        Raises:
            TaskError: on any violation of the schema.
        """
        if not isinstance(self.problem_id, str) or not self.problem_id:
            raise TaskError("problem_id must be a non-empty string", source)
        if self.task_type not in TASK_TYPES:
            raise TaskError(f"task_type must be one of {list(TASK_TYPES)}, got {self.task_type!r}", source)
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise TaskError("prompt must be a non-empty string", source)
        if self.solve_rate is not None:
            rate = self.solve_rate
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
                raise TaskError(f"solve_rate must be a number in [0, 1], got {rate!r}", source)
        self._parsed(source)

    def _parsed(self, source: str = "") -> str | CodeTests:
        if not isinstance(self.verification_info, str):
            raise TaskError("verification_info must be a JSON string", source)
        try:
            info = json.loads(self.verification_info)
        except json.JSONDecodeError as e:
            raise TaskError(f"verification_info is not valid JSON: {e}", source) from e
        if not isinstance(info, dict):
            raise TaskError("verification_info must encode a JSON object", source)
        if self.task_type == "verifiable_math":
            gt = info.get("ground_truth")
            if set(info) != {"ground_truth"} or not isinstance(gt, str) or not gt.strip():
                raise TaskError(
                    'a verifiable_math task needs verification_info {"ground_truth": <non-empty string>}',
                    source,
                )
            return gt
        if set(info) != {"test_cases"}:
            raise TaskError('a prime_rl_code task needs verification_info {"test_cases": ...}', source)
        return _parse_test_cases(info["test_cases"], source)

    @property
    def ground_truth(self) -> str:
        """The math answer (LaTeX or a number, unboxed).

        Raises:
            TaskError: if this is not a math task or ``verification_info`` is malformed.
        """
        if self.task_type != "verifiable_math":
            raise TaskError(f"task {self.problem_id} is {self.task_type}, it has no ground_truth")
        return cast(str, self._parsed(self.problem_id))

    @property
    def test_cases(self) -> CodeTests:
        """The parsed code tests.

        Raises:
            TaskError: if this is not a code task or ``verification_info`` is malformed.
        """
        if self.task_type != "prime_rl_code":
            raise TaskError(f"task {self.problem_id} is {self.task_type}, it has no test_cases")
        return cast(CodeTests, self._parsed(self.problem_id))

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-ready dict (``solve_rate`` is ``None`` when absent)."""
        return {
            "problem_id": self.problem_id,
            "task_type": self.task_type,
            "prompt": self.prompt,
            "verification_info": self.verification_info,
            "solve_rate": self.solve_rate,
        }


def math_task(problem_id: str, prompt: str, ground_truth: str) -> Task:
    """Build a validated ``verifiable_math`` task.

    Raises:
        TaskError: if a field is invalid.
    """
    return Task.from_dict(
        {
            "problem_id": problem_id,
            "task_type": "verifiable_math",
            "prompt": prompt,
            "verification_info": json.dumps({"ground_truth": ground_truth}, ensure_ascii=False),
        },
        problem_id,
    )


def code_task(problem_id: str, prompt: str, test_cases: dict[str, Any]) -> Task:
    """Build a validated ``prime_rl_code`` task from a test-cases object (encoded twice, as in
    INTELLECT-2: ``test_cases`` is itself a JSON string).

    Raises:
        TaskError: if a field is invalid.
    """
    inner = json.dumps(test_cases, ensure_ascii=False)
    return Task.from_dict(
        {
            "problem_id": problem_id,
            "task_type": "prime_rl_code",
            "prompt": prompt,
            "verification_info": json.dumps({"test_cases": inner}, ensure_ascii=False),
        },
        problem_id,
    )


# ---------------------------------------------------------------------------------------------
# Loading


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
        if task.problem_id in seen:
            raise TaskError(f"duplicate problem_id {task.problem_id!r} (first at {seen[task.problem_id]})", where)
        seen[task.problem_id] = where
        tasks.append(task)
    if not tasks:
        raise TaskError("no tasks in file", str(path))
    logger.info("loaded %d tasks from %s", len(tasks), path)
    return tasks


# ---------------------------------------------------------------------------------------------
# Converters from the public sets


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


# ---------------------------------------------------------------------------------------------
# Hashing and derivation


def canonical_task_line(task: Task) -> bytes:
    """One task as a canonical JSON line: sorted keys, no spaces, UTF-8, ``\\n``-terminated,
    ``solve_rate`` as a JSON number or ``null``."""
    return (json.dumps(task.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode(
        "utf-8"
    )


def dataset_hash(tasks: Iterable[Task]) -> str:
    """Content hash of a task list, for the run spec to pin.

    SHA-256 over the concatenation of :func:`canonical_task_line` of every task in order (order
    matters: derived indices point into it).

    Args:
        tasks: the dataset, in the order the run uses.

    Returns:
        64 lowercase hex digits.
    """
    h = hashlib.sha256()
    for task in tasks:
        h.update(canonical_task_line(task))
    return h.hexdigest()


def _u64(value: int, name: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_U64:
        raise TaskError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return value.to_bytes(8, "big")


def derive_task_indices(
    run_seed: int,
    peer_id: str,
    policy_step: int,
    counter: int,
    n_tasks_in_dataset: int,
    tasks_per_submission: int,
) -> list[int]:
    """The dataset indices a worker must solve for one submission; validators recompute them.

    Hash input ("seed bytes"), all integers unsigned big-endian::

        b"intellect-node/task-derivation/v1\\x00"
        || run_seed (8 bytes) || len(peer_id UTF-8) (1 byte) || peer_id UTF-8
        || policy_step (8 bytes) || counter (8 bytes)
        || n_tasks_in_dataset (8 bytes) || tasks_per_submission (8 bytes)

    Block ``j`` (j = 0, 1, ...) is ``SHA-256(seed bytes || j as 4 bytes)``; each block yields four
    64-bit big-endian words. A word ``w`` is rejected when ``w >= 2**64 - 2**64 % n`` (no modulo
    bias), otherwise ``w % n`` is the next candidate; candidates already drawn are skipped. The
    first ``tasks_per_submission`` distinct candidates, in draw order, are the result.

    Args:
        run_seed: the run spec's seed, in [0, 2**64).
        peer_id: the worker's peer ID string (``12D3KooW…``), at most 255 UTF-8 bytes.
        policy_step: the policy step the submission is generated with, in [0, 2**64).
        counter: the worker's submission counter for that step, in [0, 2**64).
        n_tasks_in_dataset: dataset size, ≥ 1.
        tasks_per_submission: how many distinct tasks, 1 ≤ it ≤ n_tasks_in_dataset.

    Returns:
        ``tasks_per_submission`` distinct indices in [0, n_tasks_in_dataset).

    Raises:
        TaskError: on an argument out of range.
    """
    if not isinstance(peer_id, str) or not peer_id:
        raise TaskError("peer_id must be a non-empty string")
    pid = peer_id.encode("utf-8")
    if len(pid) > MAX_PEER_ID_BYTES:
        raise TaskError(f"peer_id is {len(pid)} bytes, at most {MAX_PEER_ID_BYTES} allowed")
    n, k = n_tasks_in_dataset, tasks_per_submission
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TaskError(f"n_tasks_in_dataset must be a positive integer, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise TaskError(f"tasks_per_submission must be in [1, {n}], got {k!r}")
    seed = b"".join(
        (
            TASK_DERIVATION_DOMAIN,
            _u64(run_seed, "run_seed"),
            len(pid).to_bytes(1, "big"),
            pid,
            _u64(policy_step, "policy_step"),
            _u64(counter, "counter"),
            _u64(n, "n_tasks_in_dataset"),
            _u64(k, "tasks_per_submission"),
        )
    )
    limit = 2**64 - (2**64 % n)
    chosen: list[int] = []
    seen: set[int] = set()
    block = 0
    while len(chosen) < k:
        digest = hashlib.sha256(seed + block.to_bytes(4, "big")).digest()
        block += 1
        for off in range(0, 32, 8):
            word = int.from_bytes(digest[off : off + 8], "big")
            if word >= limit:
                continue
            idx = word % n
            if idx not in seen:
                seen.add(idx)
                chosen.append(idx)
                if len(chosen) == k:
                    break
    return chosen


# ---------------------------------------------------------------------------------------------
# Prompts


def _length_instruction(target_length: int | None) -> str | None:
    if target_length is None:
        return None
    if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length < 1:
        raise TaskError(f"target_length must be a positive number of tokens, got {target_length!r}")
    return LENGTH_CONTROL_TEMPLATE.format(n=target_length)


def build_prompt_text(task: Task, target_length: int | None) -> str:
    """The user prompt with INTELLECT-2's length-control suffix.

    ``task.prompt + " " + "Think for N tokens before giving a response."`` (prime-rl's
    ``length_prompt_location = "instruction"``); the task's prompt unchanged when
    ``target_length`` is ``None``.

    Args:
        task: the task.
        target_length: N, in tokens (drawn from the run spec's target lengths), or ``None``.

    Returns:
        The prompt text.

    Raises:
        TaskError: if ``target_length`` is not a positive integer.
    """
    suffix = _length_instruction(target_length)
    return task.prompt if suffix is None else f"{task.prompt} {suffix}"


def build_messages(
    task: Task,
    target_length: int | None,
    system_prompt: str | None = None,
    length_prompt_location: Literal["instruction", "system_prompt"] = "instruction",
) -> list[dict[str, str]]:
    """Chat messages for the engine, which applies the tokenizer's chat template.

    Args:
        task: the task.
        target_length: tokens for the length-control instruction, or ``None`` for none.
        system_prompt: an optional system message.
        length_prompt_location: ``"instruction"`` appends the instruction to the user message
            (:func:`build_prompt_text`); ``"system_prompt"`` puts it in the system message (after
            ``system_prompt`` if given), as prime-rl's option of the same name.

    Returns:
        ``[{"role": "system", ...}?, {"role": "user", "content": ...}]``.

    Raises:
        TaskError: on a bad ``target_length`` or ``length_prompt_location``.
    """
    if length_prompt_location not in ("instruction", "system_prompt"):
        raise TaskError(f"unknown length_prompt_location {length_prompt_location!r}")
    messages: list[dict[str, str]] = []
    if length_prompt_location == "instruction":
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": build_prompt_text(task, target_length)})
        return messages
    suffix = _length_instruction(target_length)
    system = "\n\n".join(s for s in (system_prompt, suffix) if s)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": task.prompt})
    return messages
