"""Per-check overhead of bounded rewards, side by side in one run.

* math: ``math_verify`` in this thread (unbounded, the old path) vs. the killable verifier
  process (:func:`protocol.rewards.verifier.verify_answer`), and the structural pre-check alone;
* code: one bubblewrap sandbox run vs. a bare ``python -c`` child (no isolation), on a trivial
  program and on a HumanEval canonical solution through ``compute_reward``.

    python benchmarks/reward_bench.py [--math-n 200] [--code-n 20]

Numbers depend on the machine's load; say what else ran next to any you quote.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.rewards import RewardLimits, SandboxLimits, compute_reward  # noqa: E402
from protocol.rewards.math import answer_precheck  # noqa: E402
from protocol.rewards.sandbox import run_python  # noqa: E402
from protocol.rewards.verifier import verify_answer  # noqa: E402
from protocol.tasks import convert  # noqa: E402

PAIRS = [("\\frac{1}{2}", "\\frac{2}{4}"), ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\pi/2)"), ("\\text{Evelyn}", "Evelyn")]


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_math(n: int) -> None:
    from math_verify import parse, verify

    def in_thread():
        for gold, ans in PAIRS:
            verify(parse(f"\\boxed{{{gold}}}", parsing_timeout=None), parse(f"\\boxed{{{ans}}}", parsing_timeout=None), timeout_seconds=None)

    def in_verifier():
        for gold, ans in PAIRS:
            assert verify_answer(gold, ans, 5.0, 1024**3)[0]

    def precheck():
        for _, ans in PAIRS:
            answer_precheck(ans, 1000)

    in_verifier()  # start the verifier processes
    in_thread()
    a = _median_ms(in_thread, n) / len(PAIRS)
    b = _median_ms(in_verifier, n) / len(PAIRS)
    c = _median_ms(precheck, n) / len(PAIRS)
    print(f"math check: in-thread {a:.3f} ms | verifier process {b:.3f} ms | ratio {b / a:.2f}x | overhead {b - a:+.3f} ms")
    print(f"math pre-check: {c * 1e3:.1f} µs per answer")


def bench_code(n: int, data_root: Path) -> None:
    limits = SandboxLimits()

    def bare():
        subprocess.run([sys.executable, "-s", "-P", "-c", "print(1)"], check=True, capture_output=True)

    def sandboxed():
        run = run_python("stdio", "print(1)", {}, limits)
        assert run.stdout.strip() == "1", run.stderr

    a = _median_ms(bare, n)
    b = _median_ms(sandboxed, n)
    print(f"code trivial: bare child {a:.1f} ms | bwrap sandbox {b:.1f} ms | ratio {b / a:.2f}x")
    he = data_root / "code" / "HumanEval.jsonl.gz"
    if he.exists():
        with gzip.open(he, "rt") as f:
            row = json.loads(f.readline())
        task = convert("humaneval", data_root)[0]
        text = f"```python\n{row['prompt'] + row['canonical_solution']}\n```"
        ms = _median_ms(lambda: compute_reward(task, text, 10, None, 0.0, RewardLimits()), n)
        print(f"code HumanEval/0 canonical through compute_reward: {ms:.1f} ms per completion")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--math-n", type=int, default=200)
    ap.add_argument("--code-n", type=int, default=20)
    ap.add_argument("--data-root", type=Path, default=Path(os.environ.get("INTELLECT_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    bench_math(args.math_n)
    bench_code(args.code_n, args.data_root)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
