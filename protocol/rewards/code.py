"""Code reward: the last fenced Python block, run against every test in the sandbox.

Rule (INTELLECT-2 / prime-rl ``prime_rl_code``): the program is the content of the last
complete ```` ``` ```` block (language tag ``python``/``py``/``python3`` or none) after the last
``</think>`` (none if ``<think>`` is never closed). The reward is 1.0 when every test passes,
else 0.0; the first failing test stops the run.

* stdin/stdout tests: one child process per case; the case passes when the program exits with
  status 0 and its stdout equals the expected output after stripping each line and trailing
  blank lines, or, failing that, when the whitespace-separated tokens are equal or all numeric
  and within rel 1e-5 / abs 1e-8 (the APPS checker's tolerance).
* call-based tests: one child; ``fn_name`` (or ``Solution().fn_name``) is called with each
  argument list; its result, after a JSON round trip (tuples become lists), must equal the
  expected value, or its single element when the expected value is a one-element list (APPS).
* assert-based tests (HumanEval, MBPP): one child; prelude, program, setup code, then every
  snippet; each must run without raising.
"""

from __future__ import annotations

import logging
import math
import re
import time

from protocol.rewards.base import SandboxLimits
from protocol.rewards.math import answer_region
from protocol.rewards.sandbox import run_python
from protocol.tasks import CodeTests

logger = logging.getLogger(__name__)

__all__ = ["code_reward", "extract_code", "stdout_matches"]

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str | None:
    """The program in a completion: its last complete fenced code block.

    Returns:
        The code, or ``None`` when there is no complete block or reasoning never ended.
    """
    region = answer_region(completion)
    if region is None:
        return None
    blocks = _FENCE_RE.findall(region)
    return blocks[-1] if blocks and blocks[-1].strip() else None


def _lines(text: str) -> list[str]:
    lines = [line.strip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def stdout_matches(actual: str, expected: str) -> bool:
    """Whether a program's stdout matches the expected output (see the module docstring)."""
    if _lines(actual) == _lines(expected):
        return True
    a, e = actual.split(), expected.split()
    if a == e:
        return True
    if len(a) != len(e):
        return False
    try:
        pairs = [(float(x), float(y)) for x, y in zip(a, e)]
    except ValueError:
        return False
    return all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-8) for x, y in pairs)


def code_reward(completion: str, tests: CodeTests, limits: SandboxLimits) -> tuple[float, str]:
    """Score a code completion by running its program against all tests.

    Args:
        completion: the generated text.
        tests: the task's parsed tests.
        limits: sandbox limits (per process and in total, in seconds and bytes).

    Returns:
        ``(1.0 or 0.0, detail)``.

    Raises:
        RewardError: if the sandbox cannot start.
    """
    code = extract_code(completion)
    if code is None:
        return 0.0, "no complete ```python code block"
    if tests.kind == "stdio":
        return _run_stdio(code, tests, limits)
    if tests.kind == "call":
        payload = {"inputs": list(tests.inputs), "outputs": list(tests.outputs), "fn_name": tests.fn_name}
    else:
        payload = {
            "assert_tests": list(tests.assert_tests),
            "setup_code": tests.setup_code,
            "prelude": tests.prelude,
        }
    run = run_python(tests.kind, code, payload, limits)
    if run.timed_out:
        return 0.0, f"wall limit of {limits.wall_time_s} s reached"
    if run.result is None:
        return 0.0, f"no result (exit status {run.exit_code}): {run.stderr[-300:]}"
    passed, total = run.result.get("passed"), run.result.get("total")
    if passed == total == tests.n_cases and not run.result.get("error"):
        return 1.0, f"all {total} tests passed"
    return 0.0, f"{passed}/{tests.n_cases} tests passed; {run.result.get('error', '')}"


def _run_stdio(code: str, tests: CodeTests, limits: SandboxLimits) -> tuple[float, str]:
    deadline = time.monotonic() + limits.total_wall_time_s
    for i, (stdin_text, expected) in enumerate(zip(tests.inputs, tests.outputs)):
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0, f"total wall limit of {limits.total_wall_time_s} s reached at case {i}"
        run = run_python("stdio", code, {}, limits, stdin_text=stdin_text, wall_time_s=left)
        if run.timed_out:
            return 0.0, f"case {i}: wall limit reached"
        if run.exit_code != 0:
            return 0.0, f"case {i}: exit status {run.exit_code}: {run.stderr[-300:]}"
        if not stdout_matches(run.stdout, expected):
            return 0.0, f"case {i}: wrong output"
    return 1.0, f"all {tests.n_cases} tests passed"
