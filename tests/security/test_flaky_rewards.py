"""Honest code whose result is not a function of its input is not cheating (issue 23, item 5).

Two honest programs that pass only sometimes, run for real in the bubblewrap sandbox: one draws
with unseeded ``random`` (the largest of a random pair, ≈ 40 % of runs pass), one prints a set of
objects, whose order follows their ``id()`` (≈ 25–45 % here). 80 honest rollouts, each from
its own worker key (``benchmarks/flaky_rewards_bench.py`` runs 200 of each and counts): the worker scores once and reports what it got (as an honest worker does);
the validator judges by the pipeline's rule (:func:`validator.rewards.judge_reward`, which
``SubmissionChecker`` calls) and posts its verdict to a real ingest, whose coordinator re-check
applies the same rule (the re-check runs ``SubmissionChecker`` too). Deterministic cheats (a
program that always prints a wrong answer, reported as a pass) go through the same path.

The test can fail: the same rollouts judged by the old rule (one disagreement is ``reward``,
also in the re-check) go to a second ingest, which must ban honest workers for the test to
prove anything.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ingest_attack_helpers import COORD, RUN, VALIDATOR, honest_session, post, running_ingest, submission, verdict
from waiting import wait_until

from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission
from protocol.rewards import RewardLimits, compute_reward
from protocol.rewards.sandbox import sandbox_status
from protocol.tasks import Task, code_task
from trainer.ledger import RecheckResult
from validator.rewards import REWARD_RERUNS, judge_reward, mismatch_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sandbox_status()[0], reason=f"no code sandbox here: {sandbox_status()[1]}"),
]

LIMITS = RewardLimits()
RANDOM_PAIR = "import random\nxs = list(map(int, input().split()))\nprint(max(random.sample(xs, 2)))\n"
ID_ORDERED_SET = (
    "class Word:\n    def __init__(self, s):\n        self.s = s\n"
    "words = {}\nfor w in input().split():\n    words.setdefault(w, Word(w))\n"
    "print(' '.join(o.s for o in set(words.values())))\n"
)
LARGEST = code_task("largest", "Print the largest of the numbers.", {"inputs": ["3 9 4 1 7\n"], "outputs": ["9\n"]})
SORTED_WORDS = code_task("sorted-words", "Print the distinct words in alphabetical order.",
                         {"inputs": ["pear fig kiwi plum fig\n"], "outputs": ["fig kiwi pear plum\n"]})
HONEST = [(LARGEST, RANDOM_PAIR)] * 40 + [(SORTED_WORDS, ID_ORDERED_SET)] * 40
CHEATS = [(LARGEST, "xs = list(map(int, input().split()))\nprint(min(xs))\n"),
          (SORTED_WORDS, "print(' '.join(dict.fromkeys(input().split())))\n"),
          (LARGEST, "raise SystemExit(3)\n")]


def fenced(code: str) -> str:
    return f"<think>\nDone.\n</think>\n```python\n{code}```\n"


def score(task: Task, code: str) -> float:
    return compute_reward(task, fenced(code), 10, None, 0.0, LIMITS).task_reward


def rule(task: Task, code: str, reported: float) -> str:
    """The pipeline's reward stage for one rollout (``SubmissionChecker`` → ``judge_reward``)."""
    scorer = functools.partial(compute_reward, task, fenced(code), 10, None, 0.0, LIMITS)
    return judge_reward(scorer, reported, reported, reward_tol=1e-6, budget_s=LIMITS.sandbox.total_wall_time_s).reason


def old_rule(task: Task, code: str, reported: float) -> str:
    """Issue 23's rule before the fix: one recomputation, a disagreement without a limit is ``reward``."""
    r = compute_reward(task, fenced(code), 10, None, 0.0, LIMITS)
    return "ok" if r.task_reward == reported else mismatch_reason(reported, r.task_reward, r.limit_hit)


class Recheck:
    """The coordinator's re-check for these submissions: ``judge`` on the worker's program again."""

    def __init__(self, judge, rollouts: dict[str, tuple[Task, str, float]]) -> None:
        self.judge = judge
        self.rollouts = rollouts

    def __call__(self, raw: bytes) -> RecheckResult:
        worker = open_envelope(raw, run_id=RUN, expect=Submission).body.worker
        reason = self.judge(*self.rollouts[worker])
        return RecheckResult(reason == "ok", reason, "", COORD.peer_id)


async def test_flaky_honest_code_is_never_banned_and_cheats_still_are(tmp_path: Path) -> None:
    keys = [NodeKey.generate() for _ in range(len(HONEST) + len(CHEATS))]
    with ThreadPoolExecutor(2) as pool:  # each honest worker scores once and reports what it got
        reported = list(pool.map(lambda tc: score(*tc), HONEST))
    passes = sum(reported)
    assert 0 < passes < len(HONEST), "the programs must be flaky for the test to mean anything"
    rollouts = {k.peer_id: (t, c, r) for k, (t, c), r in zip(keys, HONEST + CHEATS, reported + [1.0] * len(CHEATS))}
    cheaters = {k.peer_id for k in keys[len(HONEST):]}
    verdicts: dict[str, int] = {}
    async with running_ingest(tmp_path / "rule", recheck=Recheck(rule, rollouts)) as ing, \
            running_ingest(tmp_path / "old", recheck=Recheck(old_rule, rollouts)) as old:
        for key in keys:
            sub = submission(key)
            for target in (ing, old):
                async with honest_session(target.url) as http:
                    status, _ = await post(http, "/ingest/1/submissions", sub)
                assert status == 200
            task, code, rep = rollouts[key.peer_id]
            for target, judge in ((ing, rule), (old, old_rule)):
                reason = judge(task, code, rep)
                if target is ing:
                    verdicts[reason] = verdicts.get(reason, 0) + 1
                target.service.apply_verdict(verdict(sub, reason == "ok", reason, key=VALIDATOR))

        def rechecks_done(i) -> bool:
            r = i.service.ban_rule.rechecks
            return r["reproduced"] + r["not_reproduced"] + r["dropped"] == r["queued"]

        await wait_until(lambda: rechecks_done(ing) and rechecks_done(old), timeout_s=600, what="re-checks")
        banned = {k.peer_id for k in keys if ing.bans.is_banned(k.peer_id)}
        old_banned = {k.peer_id for k in keys if old.bans.is_banned(k.peer_id)}
    summary = f"{passes} of {len(HONEST)} honest runs passed on the worker; verdicts {verdicts}; k = {REWARD_RERUNS}"
    assert old_banned - cheaters, f"the old rule banned no honest worker ({summary}): the test proves nothing"
    assert banned == cheaters, f"honest banned: {len(banned - cheaters)}, cheaters not banned: {len(cheaters - banned)} ({summary})"
    assert verdicts.get("nondeterministic", 0) > 0, summary
