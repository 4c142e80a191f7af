"""Rewards on real rows of the public sets: math-verify answers, sandboxed code tests, the length
penalty, and a sandbox that stops hostile programs."""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from protocol.errors import ProtocolError
from protocol.rewards import (
    INTELLECT2_LENGTH_PENALTY_LAMBDA,
    RewardError,
    RewardLimits,
    SandboxLimits,
    compute_reward,
    length_penalty,
)
from protocol.rewards.code import extract_code, stdout_matches
from protocol.rewards.math import extract_boxed, extract_math_answer
from protocol.tasks import Task, code_task, convert, math_task

# small limits keep the hostile-program tests quick
FAST = RewardLimits(sandbox=SandboxLimits(cpu_time_s=2, wall_time_s=3.0, total_wall_time_s=10.0))
N_SAMPLE = 20


def shared_data_dir() -> Path:
    """``$INTELLECT_SHARED/data``, default ``<repo>/../shared/data``."""
    repo = Path(__file__).resolve().parents[2]
    return Path(os.environ.get("INTELLECT_SHARED", repo.parent / "shared")) / "data"


def reward(task: Task, text: str, limits: RewardLimits = FAST) -> float:
    return compute_reward(task, text, 10, None, 0.0, limits).task_reward


def fenced(code: str) -> str:
    return f"<think>\nLet me write it.\n</think>\nHere it is:\n```python\n{code}\n```\n"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data():
    d = shared_data_dir()
    if not d.is_dir():
        pytest.skip(f"shared data not found at {d} (set INTELLECT_SHARED)")
    return d


@pytest.fixture(scope="module")
def gsm8k(data):
    raw = [json.loads(line) for line in (data / "math" / "gsm8k_test.jsonl").open()]
    return list(zip(convert("gsm8k", data), raw))


@pytest.fixture(scope="module")
def math500(data):
    raw = [json.loads(line) for line in (data / "math" / "math500_test.jsonl").open()]
    return list(zip(convert("math500", data), raw))


@pytest.fixture(scope="module")
def humaneval(data):
    with gzip.open(data / "code" / "HumanEval.jsonl.gz", "rt") as f:
        raw = [json.loads(line) for line in f]
    return list(zip(convert("humaneval", data), raw))


@pytest.fixture(scope="module")
def mbpp(data):
    raw = [json.loads(line) for line in (data / "code" / "mbpp.jsonl").open()]
    return list(zip(convert("mbpp", data), raw))


def he_solution(row: dict) -> str:
    return row["prompt"] + row["canonical_solution"]


def mbpp_solution(row: dict) -> str:
    return row["code"].replace("\r\n", "\n")


# ----------------------------------------------------------------------------- math


def test_reward_error_is_protocol_error():
    assert issubclass(RewardError, ProtocolError)


def test_extract_boxed_balanced():
    assert extract_boxed(r"a \boxed{1} b \boxed{\frac{1}{\sqrt{2}}} c") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"\boxed{\text{(C)}}.") == r"\text{(C)}"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_boxed(r"so \boxed 5.") == "5."


def test_answer_after_think():
    assert extract_math_answer(r"<think>\boxed{1}</think> so \boxed{2}", "2") == "2"
    # the box inside the reasoning does not count; a number after </think> does (integer gold)
    assert extract_math_answer(r"<think>\boxed{1}</think> it is 7", "7") == "7"
    assert extract_math_answer(r"<think>still thinking \boxed{2}", "2") is None
    assert extract_math_answer("the answer is 2", r"\frac{1}{2}") is None


def test_gsm8k_correct_and_wrong(gsm8k):
    task, raw = gsm8k[0]
    assert reward(task, raw["answer"]) == 1.0  # the worked solution, "#### 18"
    assert reward(task, "<think>9 eggs, $2 each</think> She makes \\boxed{18} dollars.") == 1.0
    assert reward(task, "<think>...</think> \\boxed{\\$18}") == 1.0
    assert reward(task, "<think>...</think> She makes 18 dollars a day.") == 1.0
    assert reward(task, "<think>...</think> \\boxed{19}") == 0.0
    assert reward(task, "#### 17") == 0.0
    assert reward(task, "<think>\\boxed{18}</think> I am not sure.") == 0.0


def test_gsm8k_thousands_commas(gsm8k):
    task, raw = next((t, r) for t, r in gsm8k if "," in r["answer"].rsplit("####", 1)[1])
    with_commas = raw["answer"].rsplit("####", 1)[1].strip()
    assert "," not in task.ground_truth
    assert reward(task, raw["answer"]) == 1.0
    assert reward(task, f"\\boxed{{{with_commas}}}") == 1.0
    assert reward(task, f"The answer is {with_commas}.") == 1.0
    assert reward(task, f"\\boxed{{{int(task.ground_truth) + 1000:,}}}") == 0.0


def _pick(math500, pred):
    return next((t, r) for t, r in math500 if pred(r["answer"]))


def test_math500_solutions_score_one(math500):
    sample = random.Random(0).sample(math500, 30)
    for task, raw in sample:
        assert reward(task, "<think>hmm</think>" + raw["solution"]) == 1.0, task.problem_id


def test_math500_fraction(math500):
    task, raw = _pick(math500, lambda a: a.startswith("\\frac") and a.count("{") == 2)
    num, den = raw["answer"][len("\\frac{") : -1].split("}{")
    assert reward(task, f"\\boxed{{{raw['answer']}}}") == 1.0
    assert reward(task, f"\\boxed{{{num}/{den}}}") == 1.0
    assert reward(task, f"\\boxed{{\\dfrac{{{num}}}{{{den}}}}}") == 1.0
    assert reward(task, f"\\boxed{{\\frac{{{den}}}{{{num}7}}}}") == 0.0


def test_math500_tuple(math500):
    task, _ = _pick(math500, lambda a: a == "\\left( 3, \\frac{\\pi}{2} \\right)")
    assert reward(task, "<think>r=3</think>\\boxed{(3, \\frac{\\pi}{2})}") == 1.0
    assert reward(task, "\\boxed{(3,\\pi/2)}") == 1.0
    assert reward(task, "\\boxed{(\\frac{\\pi}{2}, 3)}") == 0.0
    assert reward(task, "\\boxed{(3, \\pi)}") == 0.0


def test_math500_text(math500):
    task, _ = _pick(math500, lambda a: a == "\\text{Evelyn}")
    assert reward(task, "\\boxed{\\text{Evelyn}}") == 1.0
    assert reward(task, "\\boxed{Evelyn}") == 1.0
    assert reward(task, "\\boxed{\\text{Bob}}") == 0.0
    task, _ = _pick(math500, lambda a: a == "\\text{(C)}")
    assert reward(task, "\\boxed{\\text{(C)}}") == 1.0
    assert reward(task, "\\boxed{(C)}") == 1.0
    assert reward(task, "\\boxed{\\text{(D)}}") == 0.0


def test_math_off_main_thread(math500):
    task, _ = _pick(math500, lambda a: a == "\\left( 3, \\frac{\\pi}{2} \\right)")
    out = []
    th = threading.Thread(target=lambda: out.append(reward(task, "\\boxed{(3,\\pi/2)}")))
    th.start()
    th.join(60)
    assert out == [1.0]


def test_overlong_answer_scores_zero():
    task = math_task("t", "x?", "\\frac{1}{2}")
    assert reward(task, "\\boxed{" + "1+" * 800 + "1}") == 0.0


# ----------------------------------------------------------------------------- length penalty


def test_length_penalty():
    lam = INTELLECT2_LENGTH_PENALTY_LAMBDA
    assert lam == 0.0003
    assert length_penalty(1.0, 1000, None, lam) == 1.0
    assert length_penalty(1.0, 1000, 1000, lam) == 1.0
    assert length_penalty(1.0, 1500, 1000, lam) == pytest.approx(1.0 - 0.15)
    assert length_penalty(0.0, 500, 1000, lam) == pytest.approx(-0.15)
    for bad in [(1.0, -1, 10, lam), (1.0, 1, -10, lam), (1.0, 1, 10, -1.0), (1.0, 1, 10, float("nan"))]:
        with pytest.raises(RewardError):
            length_penalty(*bad)


def test_compute_reward_applies_penalty():
    task = math_task("t", "1+1?", "2")
    r = compute_reward(task, "\\boxed{2}", 700, 1000, 0.0003)
    assert (r.task_reward, r.reward) == (1.0, pytest.approx(1.0 - 0.09))
    r = compute_reward(task, "\\boxed{3}", 1000, 1000, 0.0003)
    assert (r.task_reward, r.reward) == (0.0, 0.0)
    assert r.detail


# ----------------------------------------------------------------------------- code: datasets


def test_extract_code():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("<think>```python\nx=1\n```") is None
    assert extract_code("<think>```python\nx=1\n```</think>no code") is None
    assert extract_code("```python\nunterminated") is None


@pytest.mark.slow
@pytest.mark.usefixtures("code_sandbox")
def test_humaneval_canonical_sample_passes(humaneval):
    for task, raw in random.Random(1).sample(humaneval, N_SAMPLE):
        r = compute_reward(task, fenced(he_solution(raw)), 10, None, 0.0)
        assert r.task_reward == 1.0, (task.problem_id, r.detail)


@pytest.mark.slow
@pytest.mark.usefixtures("code_sandbox")
def test_mbpp_canonical_sample_passes(mbpp):
    for task, raw in random.Random(2).sample(mbpp, N_SAMPLE):
        r = compute_reward(task, fenced(mbpp_solution(raw)), 10, None, 0.0)
        assert r.task_reward == 1.0, (task.problem_id, r.detail)


@pytest.mark.usefixtures("code_sandbox")
def test_broken_solutions_fail(humaneval, mbpp):
    task, raw = humaneval[0]
    broken = he_solution(raw).replace("distance < threshold", "distance > threshold")
    assert reward(task, fenced(broken)) == 0.0
    assert reward(task, fenced("def has_close_elements(numbers, threshold):\n    return True")) == 0.0
    assert reward(task, fenced("syntax error (")) == 0.0
    assert reward(task, "no code at all") == 0.0
    task, raw = mbpp[0]
    assert reward(task, fenced(mbpp_solution(raw).replace("return tc[m][n]", "return tc[m][n] + 1"))) == 0.0
    # exiting early is not passing
    assert reward(task, fenced("import sys\nsys.exit(0)")) == 0.0
    assert reward(task, fenced("import os\nos._exit(0)")) == 0.0


CANONICAL_STRIDE = int(os.environ.get("INTELLECT_CANONICAL_STRIDE", "3"))
"""Every third task's canonical solution (both task sets, every encoding they use) in the suite, to
keep its time down; ``INTELLECT_CANONICAL_STRIDE=1`` checks all 1,137."""


@pytest.mark.usefixtures("code_sandbox")
@pytest.mark.slow
def test_canonical_solutions_pass(humaneval, mbpp):
    # every sandbox run is its own processes: two at a time use both cores
    jobs = [(task, he_solution(raw)) for task, raw in humaneval] + [(task, mbpp_solution(raw)) for task, raw in mbpp]
    jobs = jobs[::CANONICAL_STRIDE]

    def score(job):
        task, code = job
        return task.problem_id, compute_reward(task, fenced(code), 10, None, 0.0, RewardLimits())

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(score, jobs))
    # a limit hit (wall time on a loaded machine) says nothing about the solution: scored again alone
    retry = {pid for pid, r in results if r.task_reward != 1.0 and r.limit_hit is not None}
    again = dict(score(job) for job in jobs if job[0].problem_id in retry)
    failures = [(pid, again.get(pid, r).detail) for pid, r in results if again.get(pid, r).task_reward != 1.0]
    assert len(jobs) > 300 and failures == []


# ----------------------------------------------------------------------------- code: INTELLECT-2 encodings


@pytest.mark.usefixtures("code_sandbox")
def test_stdio_tests():
    task = code_task("s", "sum", {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]})
    assert reward(task, fenced("a, b = map(int, input().split())\nprint(a + b)")) == 1.0
    assert reward(task, fenced("import sys\na, b = map(int, open(0).read().split())\nprint(a + b)")) == 1.0
    assert reward(task, fenced("a, b = map(int, input().split())\nprint(a - b)")) == 0.0
    assert reward(task, fenced("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)")) == 0.0
    assert stdout_matches("0.3333333\n", "0.33333333")
    assert not stdout_matches("1 2", "1 3")


@pytest.mark.usefixtures("code_sandbox")
def test_stdio_set_printing_is_deterministic():
    # PYTHONHASHSEED is pinned in the child, so set order is the same everywhere
    code = "print(list({'apple', 'pear', 'fig', 'kiwi', 'plum'}))"
    from protocol.rewards.sandbox import run_python

    outs = {run_python("stdio", code, {}, FAST.sandbox).stdout for _ in range(3)}
    assert len(outs) == 1


@pytest.mark.usefixtures("code_sandbox")
def test_call_based_tests():
    tc = {"inputs": [[[1, 2, 3]], [[5]]], "outputs": [[3, 2, 1], [5]], "fn_name": "rev"}
    task = code_task("c", "reverse", tc)
    assert reward(task, fenced("def rev(xs):\n    return xs[::-1]")) == 1.0
    assert reward(task, fenced("def rev(xs):\n    return tuple(reversed(xs))")) == 1.0
    assert reward(task, fenced("class Solution:\n    def rev(self, xs):\n        return xs[::-1]")) == 1.0
    assert reward(task, fenced("def rev(xs):\n    return xs")) == 0.0
    cheat = "class Eq(list):\n    def __eq__(self, o):\n        return True\ndef rev(xs):\n    return Eq([0])"
    assert reward(task, fenced(cheat)) == 0.0
    assert reward(task, fenced("def other(xs):\n    return xs")) == 0.0


@pytest.mark.usefixtures("code_sandbox")
def test_rewards_are_deterministic(humaneval):
    task, raw = humaneval[3]
    text = fenced(he_solution(raw))
    results = {compute_reward(task, text, 123, 100, 0.0003).reward for _ in range(3)}
    assert results == {1.0 - 0.0003 * 23}


# ----------------------------------------------------------------------------- sandbox


def limited(task: Task, text: str, limits: RewardLimits = FAST) -> tuple[float, str | None]:
    """The task reward and the resource limit that stopped scoring (``None``: the completion's own result)."""
    r = compute_reward(task, text, 10, None, 0.0, limits)
    return r.task_reward, r.limit_hit


@pytest.mark.slow
@pytest.mark.usefixtures("code_sandbox")
def test_infinite_loop_is_stopped(humaneval):
    # stopped by its limits (the kill is the evidence; no wall-clock assert)
    task, _ = humaneval[0]
    score, limit = limited(task, fenced("def has_close_elements(n, t):\n    while True:\n        pass\nhas_close_elements(1, 2)"))
    assert score == 0.0 and limit in ("cpu", "wall")
    sleepy = RewardLimits(sandbox=SandboxLimits(cpu_time_s=30, wall_time_s=1.5))
    assert limited(task, fenced("import time\ntime.sleep(60)"), sleepy) == (0.0, "wall")


@pytest.mark.usefixtures("code_sandbox")
def test_huge_allocation_is_stopped(humaneval):
    task, raw = humaneval[0]
    # time limits far beyond what either needs, so that memory is the only limit they can meet (under
    # suite load FAST's 3 s wall limit sometimes came first)
    roomy = RewardLimits(sandbox=SandboxLimits(cpu_time_s=60, wall_time_s=60.0, total_wall_time_s=120.0))
    code = "_hog = bytearray(10 * 1024**3)\n" + he_solution(raw)
    assert limited(task, fenced(code), roomy) == (0.0, "memory")
    code = "_hog = []\nwhile True:\n    _hog.append(bytearray(100 * 1024**2))\n"
    assert limited(task, fenced(code), roomy) == (0.0, "memory")


@pytest.mark.usefixtures("code_sandbox")
def test_socket_is_refused(humaneval):
    task, raw = humaneval[0]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        for opener in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))",
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
        ):
            assert reward(task, fenced(opener + "\n" + he_solution(raw))) == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@pytest.mark.usefixtures("code_sandbox")
def test_writes_stay_inside_the_sandbox(humaneval, tmp_path):
    # the sandbox's own tmpfs folder is writable (and private); the host is not touched
    task, raw = humaneval[0]
    target = tmp_path / "pwned.txt"
    ok = "import tempfile\nopen('scratch.txt', 'w').write('ok')\n"
    ok += "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('ok')\n"
    ok += f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
    assert reward(task, fenced(ok + he_solution(raw))) == 1.0
    assert not target.exists()


@pytest.mark.usefixtures("code_sandbox")
def test_output_flood_is_bounded(humaneval):
    task, _ = humaneval[0]
    limits = RewardLimits(sandbox=SandboxLimits(cpu_time_s=5, wall_time_s=5.0, output_bytes=1024 * 1024))
    assert limited(task, fenced("while True:\n    print('x' * 100000)"), limits) == (0.0, "output")


@pytest.mark.slow
@pytest.mark.usefixtures("code_sandbox")
def test_assert_forms_are_judged_in_the_parent():
    # each (program, asserts, expected reward): the sandbox prints operands, this process compares
    cases = [
        ("def f(x):\n    return x * 2", ["assert f(2) == 4", "assert f(2) != 5", "assert 3 < f(2) <= 4"], 1.0),
        ("def f(x):\n    return (x, x)", ["assert f(1) == (1, 1)"], 1.0),
        ("def f(x):\n    return [x, x]", ["assert f(1) == (1, 1)"], 0.0),  # a list is not a tuple, as in Python
        ("def f(x):\n    return None", ["assert f(1) is None", "assert not f(1)"], 1.0),
        ("def f(x):\n    return 0", ["assert f(1) is False"], 0.0),
        ("def f(x):\n    return {'a': 1} if x else {}", ["assert f(1) == {'a': 1} and not f(0)", "assert f(0) == {} or f(0) is None"], 1.0),
        ("def f(x):\n    return 3.14159", ["import math\nassert math.isclose(f(1), 3.1416, rel_tol=1e-4)", "assert abs(f(1) - 3.14159) < 1e-9"], 1.0),
        ("import collections\ndef f(s):\n    return collections.Counter(s)", ["assert f('aab') == {'a': 2, 'b': 1}"], 1.0),
        ("import collections\ndef f(x):\n    return collections.deque([x])", ["import collections\nassert f(1) == collections.deque([1])"], 1.0),
        ("def f(x):\n    return {(1, 2): {3}, 'k': frozenset({b'x'})}", ["assert f(0) == {(1, 2): {3}, 'k': frozenset({b'x'})}"], 1.0),
        ("def f(x):\n    return float('nan')", ["assert f(0) == float('nan')"], 0.0),
        ("def f(x):\n    return 'b'", ["assert f(0) in 'abc'", "assert f(0) not in ['a']"], 1.0),
        ("def f(x):\n    if x < 0:\n        raise ValueError\n    return x", ["try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass"], 1.0),
        ("def f(x):\n    return x", ["try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass"], 0.0),
        ("def f(x):\n    return x", ["for i in range(50):\n    assert f(i) == i"], 1.0),
        ("def f(x):\n    return x if x != 37 else 0", ["for i in range(50):\n    assert f(i) == i"], 0.0),
        ("def f(x):\n    return f", ["assert f(0) == 1"], 0.0),  # a function is not a value
    ]
    for code, asserts, want in cases:
        task = code_task("t", "t", {"assert_tests": asserts})
        r = compute_reward(task, fenced(code), 10, None, 0.0, FAST)
        assert r.task_reward == want, (code, asserts, r.detail)
        assert r.limit_hit is None
