"""Honest flaky code against the reward rule: bans and cost, the rule of issue 23 beside the old one.

Each honest rollout is scored once by its worker (what it reports), then judged by the
validator and, where that is a cheat reason, by the coordinator's re-check; a ban needs both
(``docs/validator.md`` "Ban rule"). The new rule is :func:`validator.rewards.judge_reward`
(re-run a disagreement up to k times; only a reproducible one is ``reward``); the old rule took
one recomputation. Programs, each run for real in the bubblewrap sandbox:

* ``random-pair``: the largest of a random pair of 5 numbers (unseeded ``random``, passes ≈ 40 %);
* ``id-set``: distinct words printed in the order of a set of objects (``id()``-ordered);
* ``coin``: prints the right answer or one fixed wrong one, 50/50 (the worst shape: one failing output);
* ``cheat``: always prints a wrong answer, reported as a pass (must be banned by both rules).

    python benchmarks/flaky_rewards_bench.py [--rollouts 200] [--reruns 9]

Prints, per program: passes on the worker, verdicts of the validator, bans (new and old rule),
scorings per rollout and seconds. Numbers depend on the machine's load; quote them with it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.rewards import RewardLimits, RewardResult, compute_reward
from protocol.tasks import Task, code_task
from protocol.verdicts import is_cheat
from validator.rewards import judge_reward, mismatch_reason

LIMITS = RewardLimits()
LARGEST = code_task("largest", "Print the largest of the numbers.", {"inputs": ["3 9 4 1 7\n"], "outputs": ["9\n"]})
SORTED_WORDS = code_task("sorted-words", "Print the distinct words in alphabetical order.",
                         {"inputs": ["pear fig kiwi plum fig\n"], "outputs": ["fig kiwi pear plum\n"]})
PROGRAMS: dict[str, tuple[Task, str, bool]] = {
    "random-pair": (LARGEST, "import random\nxs = list(map(int, input().split()))\nprint(max(random.sample(xs, 2)))\n", False),
    "id-set": (SORTED_WORDS, ("class Word:\n    def __init__(self, s):\n        self.s = s\nwords = {}\nfor w in input().split():\n"
                              "    words.setdefault(w, Word(w))\nprint(' '.join(o.s for o in set(words.values())))\n"), False),
    "coin": (LARGEST, "import random\nprint(9 if random.random() < 0.5 else 7)\n", False),
    "cheat": (LARGEST, "print(min(map(int, input().split())))\n", True),
}


def fenced(code: str) -> str:
    return f"<think>\nDone.\n</think>\n```python\n{code}```\n"


class Counted:
    """A scorer that counts its scorings."""

    def __init__(self, task: Task, code: str) -> None:
        self.score = functools.partial(compute_reward, task, fenced(code), 10, None, 0.0, LIMITS)
        self.runs = 0

    def __call__(self) -> RewardResult:
        self.runs += 1
        return self.score()


def new_rule(scorer: Counted, reported: float, reruns: int) -> str:
    return judge_reward(scorer, reported, reported, reward_tol=1e-6, budget_s=LIMITS.sandbox.total_wall_time_s, reruns=reruns).reason


def old_rule(scorer: Counted, reported: float) -> str:
    r = scorer.score()
    return "ok" if r.task_reward == reported else mismatch_reason(reported, r.task_reward, r.limit_hit)


def main(args: argparse.Namespace) -> None:
    print(f"{'program':<12} {'worker passes':>13} {'validator verdicts (new rule)':<44} {'bans new':>8} {'bans old':>8} "
          f"{'checks/rollout':>14} {'s':>6}")
    for name, (task, code, cheat) in PROGRAMS.items():
        if args.only and name not in args.only:
            continue
        scorer = Counted(task, code)
        t0 = time.monotonic()
        verdicts: Counter[str] = Counter()
        bans_new = bans_old = passes = 0
        n = 1 if cheat else args.rollouts
        for _ in range(n):
            reported = 1.0 if cheat else scorer.score().task_reward
            passes += int(reported == 1.0)
            reason = new_rule(scorer, reported, args.reruns)
            verdicts[reason] += 1
            bans_new += int(is_cheat(reason) and is_cheat(new_rule(scorer, reported, args.reruns)))  # validator, then the re-check
            bans_old += int(is_cheat(old_rule(scorer, reported)) and is_cheat(old_rule(scorer, reported)))
        secs = time.monotonic() - t0
        v = ", ".join(f"{k} {c}" for k, c in sorted(verdicts.items()))
        print(f"{name:<12} {passes:>6} of {n:<4} {v:<44} {bans_new:>8} {bans_old:>8} {scorer.runs / n:>14.2f} {secs:>6.0f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=200, help="honest rollouts per flaky program")
    p.add_argument("--reruns", type=int, default=9, help="k: extra scorings before a disagreement is a cheat")
    p.add_argument("--only", nargs="*", help="programs to run (default: all)")
    main(p.parse_args())
