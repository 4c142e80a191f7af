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
  argument list and prints its result; here, after a JSON round trip (tuples become lists), it
  must equal the expected value, or its single element when the expected value is a
  one-element list (APPS). Expected outputs never enter the sandbox.
* assert-based tests (HumanEval, MBPP): one child; prelude, program, setup code, then every
  snippet, each ``assert`` rewritten so that the child prints its operands and this process
  compares them (:mod:`protocol.rewards.asserts`); every assert must be reached and hold.

A run stopped by a resource limit before any test failed scores 0 with ``limit_hit`` set, so
that callers can tell "the program failed" from "this machine's limit was hit".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from typing import Any

from protocol.rewards.asserts import judge_assert_records, judge_call_records, plan_asserts
from protocol.rewards.base import SandboxLimits
from protocol.rewards.math import answer_region
from protocol.rewards.sandbox import RECORDS_MAX_BYTES, require_sandbox, run_python
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


def _digest(h: hashlib._Hash, exit_code: int | None, data: bytes) -> None:
    """Add one run's exit status and output to an outcome hash (length-prefixed: unambiguous)."""
    h.update(f"{exit_code}:{len(data)}:".encode())
    h.update(data)


def _records_bytes(records: list[dict[str, Any]]) -> bytes:
    return json.dumps(records, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8", "surrogatepass")


def code_reward(completion: str, tests: CodeTests, limits: SandboxLimits) -> tuple[float, str, str | None, str | None]:
    """Score a code completion by running its program against all tests.

    The sandbox only runs the program and reports raw outputs; expected outputs stay here and
    are compared here (see :mod:`protocol.rewards.asserts`).

    Args:
        completion: the generated text.
        tests: the task's parsed tests.
        limits: sandbox limits (per process and in total, in seconds and bytes).

    Returns:
        ``(1.0 or 0.0, detail, limit_hit, outcome)``: ``limit_hit`` names the resource limit
        (``"wall"``, ``"cpu"``, ``"memory"``, ``"output"``) that stopped the run before any test
        failed, else ``None``; ``outcome`` is the SHA-256 (hex) of every run's exit status and
        stdout (stdin/stdout tests, up to the first failing case) or test records (call and
        assert tests), ``None`` when no program ran (see :attr:`RewardResult.outcome`).

    Raises:
        RewardError: if the sandbox is unavailable (the message says what to install) or the
            task's tests do not parse.
    """
    code = extract_code(completion)
    if code is None:
        return 0.0, "no complete ```python code block", None, None
    require_sandbox()
    if tests.kind == "stdio":
        return _run_stdio(code, tests, limits)
    if tests.kind == "call":
        run = run_python("call", code, {"inputs": list(tests.inputs), "fn_name": tests.fn_name}, limits)
        verdict, detail = judge_call_records(list(tests.outputs), run.records)
    else:
        plan = plan_asserts(tests.assert_tests, tests.setup_code, tests.prelude)
        payload = {"prelude": plan.prelude, "setup_code": plan.setup_code, "snippets": list(plan.snippets)}
        run = run_python("assert", code, payload, limits)
        verdict, detail = judge_assert_records(plan, run.records)
    h = hashlib.sha256()
    _digest(h, run.exit_code, _records_bytes(run.records))
    outcome = h.hexdigest()
    if verdict == "fail":  # a check failed before any limit: the program's own failure
        return 0.0, detail, None, outcome
    if run.records_truncated:
        return 0.0, f"more than {RECORDS_MAX_BYTES} bytes of test records", "output", outcome
    if run.limit_hit == "wall":
        return 0.0, f"wall limit of {limits.wall_time_s} s reached ({detail})", "wall", outcome
    if run.limit_hit is not None:
        return 0.0, f"{run.limit_hit} limit reached ({detail})", run.limit_hit, outcome
    if verdict == "pass" and run.exit_code == 0:
        return 1.0, detail, None, outcome
    return 0.0, f"{detail}; exit status {run.exit_code}: {run.stderr[-200:]}", None, outcome


def _run_stdio(code: str, tests: CodeTests, limits: SandboxLimits) -> tuple[float, str, str | None, str | None]:
    deadline = time.monotonic() + limits.total_wall_time_s
    h = hashlib.sha256()
    for i, (stdin_text, expected) in enumerate(zip(tests.inputs, tests.outputs)):
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0, f"total wall limit of {limits.total_wall_time_s} s reached at case {i}", "wall", h.hexdigest()
        run = run_python("stdio", code, {}, limits, stdin_text=stdin_text, wall_time_s=left)
        _digest(h, run.exit_code, run.stdout.encode("utf-8", "surrogatepass"))
        if run.limit_hit is not None:
            return 0.0, f"case {i}: {run.limit_hit} limit reached", run.limit_hit, h.hexdigest()
        if run.exit_code != 0:
            return 0.0, f"case {i}: exit status {run.exit_code}: {run.stderr[-300:]}", None, h.hexdigest()
        if not stdout_matches(run.stdout, expected):
            return 0.0, f"case {i}: wrong output", None, h.hexdigest()
    return 1.0, f"all {tests.n_cases} tests passed", None, h.hexdigest()
