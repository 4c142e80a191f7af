"""Task schema (pure): one row of INTELLECT-2's RL dataset as a :class:`Task`, its code tests
(:class:`CodeTests`) and the errors of a bad row. See :mod:`protocol.tasks` for the encodings.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

from protocol.errors import ProtocolError

TaskType = Literal["verifiable_math", "prime_rl_code", "environment"]
TASK_TYPES: tuple[str, ...] = ("verifiable_math", "prime_rl_code", "environment")
ENV_TASK_TYPE: Literal["environment"] = "environment"
"""A task of a run's own environment (``protocol.envs``): scored by the environment's code in the
sandbox, never read from a task file."""
_ENV_HASH = re.compile(r"^[0-9a-f]{64}$")


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

    def _parsed(self, source: str = "") -> str | CodeTests | tuple[str, dict[str, Any]]:
        if not isinstance(self.verification_info, str):
            raise TaskError("verification_info must be a JSON string", source)
        try:
            info = json.loads(self.verification_info)
        except json.JSONDecodeError as e:
            raise TaskError(f"verification_info is not valid JSON: {e}", source) from e
        if not isinstance(info, dict):
            raise TaskError("verification_info must encode a JSON object", source)
        if self.task_type == ENV_TASK_TYPE:
            env, row = info.get("environment"), info.get("row")
            if set(info) != {"environment", "row"} or not isinstance(env, str) or not _ENV_HASH.match(env) or not isinstance(row, dict):
                raise TaskError('an environment task needs verification_info {"environment": <64 hex digits>, "row": {...}}', source)
            return env, row
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

    @property
    def environment_row(self) -> tuple[str, dict[str, Any]]:
        """An environment task's ``(environment hash, row)``: the hash names the environment that
        scores it (``protocol.envs``), the row is what its ``score(task, completion)`` receives.

        Raises:
            TaskError: if this is not an environment task or ``verification_info`` is malformed.
        """
        if self.task_type != ENV_TASK_TYPE:
            raise TaskError(f"task {self.problem_id} is {self.task_type}, not an environment task")
        return cast(tuple[str, dict[str, Any]], self._parsed(self.problem_id))

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
