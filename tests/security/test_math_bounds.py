"""Pathological math answers (issue #12 item 3): refused before parsing or cut off in a killable
verifier process, while an asyncio loop in this process keeps answering."""

from __future__ import annotations

import asyncio
import threading

import pytest

from protocol.rewards import RewardLimits, compute_reward
from protocol.rewards.math import answer_precheck
from protocol.rewards.verifier import verify_answer
from protocol.tasks import math_task

PATHOLOGICAL = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{9^{9^9}}",
    r"\boxed{9^9^9}",
    r"\boxed{2^{10000000}}",
    r"\boxed{99999999!}",
    r"\boxed{" + "{" * 40 + "1" + "}" * 40 + "}",
    r"\boxed{" + "9" * 5000 + "}",
    r"\boxed{" + "1+" * 2000 + "1}",
    "\\boxed{" * 3000,  # unclosed boxes: extraction stays linear
]


async def _loop_answers_while(work) -> tuple[object, int]:
    """Run ``work`` in a thread; while it runs, ping the loop from another thread and count the
    pings it answered before ``work`` finished."""
    loop = asyncio.get_running_loop()
    done = threading.Event()
    answered_during = 0

    def run():
        try:
            return work()
        finally:
            done.set()

    fut = loop.run_in_executor(None, run)
    for _ in range(10_000):  # bounded; ends when the work does
        if done.is_set():
            break
        ping = loop.create_future()
        threading.Thread(target=loop.call_soon_threadsafe, args=(ping.set_result, True)).start()
        await asyncio.wait_for(ping, 30)
        if not done.is_set():
            answered_during += 1
        await asyncio.sleep(0.01)
    return await fut, answered_during


def test_pathological_answers_score_zero_without_parsing():
    task = math_task("t", "x?", "7")
    other = math_task("t2", "x?", "\\frac{1}{2}")
    for answer in PATHOLOGICAL:
        for t in (task, other):
            r = compute_reward(t, answer, 10, None, 0.0)
            assert (r.task_reward, r.limit_hit) == (0.0, None), (answer[:40], r.detail)
    assert answer_precheck(r"9^{9^{9^{9}}}", 1000) is not None
    for fine in (r"e^{x^2}", r"2^{100}", r"x^2+y^2", r"\frac{1}{2}", r"(3, \frac{\pi}{2})", r"10^{100}"):
        assert answer_precheck(fine, 1000) is None, fine


def test_loop_keeps_answering_while_rewards_run():
    task = math_task("t", "x?", "\\frac{1}{2}")

    def score_all():
        return [compute_reward(task, a, 10, None, 0.0).task_reward for a in [*PATHOLOGICAL, r"\boxed{0.5}"]]

    rewards, _ = asyncio.run(_loop_answers_while(score_all))
    assert rewards == [0.0] * len(PATHOLOGICAL) + [1.0]


@pytest.mark.slow
def test_runaway_check_is_killed_and_the_loop_stays_live():
    # past the pre-checks (called directly): the verifier process is killed at the wall limit
    def runaway():
        return verify_answer("1", r"9^{9^{9^{9}}}", timeout_s=3.0, memory_bytes=1024**3)

    (ok, limit, detail), answered = asyncio.run(_loop_answers_while(runaway))
    assert (ok, limit) == (False, "wall"), detail
    assert answered >= 1  # the loop answered a ping while the check was running
    # a fresh verifier replaces the killed one
    r = compute_reward(math_task("t", "x?", "\\frac{1}{2}"), r"\boxed{\frac{2}{4}}", 10, None, 0.0)
    assert (r.task_reward, r.limit_hit) == (1.0, None)


@pytest.mark.slow
def test_wall_limit_is_reported_to_callers():
    limits = RewardLimits(math_timeout_s=1)
    ok, limit, _ = verify_answer("1", r"9^{9^{9^{9}}}", timeout_s=float(limits.math_timeout_s), memory_bytes=limits.math_memory_bytes)
    assert (ok, limit) == (False, "wall")



@pytest.mark.slow
def test_verifier_killed_between_checks_is_replaced(monkeypatch):
    """A verifier killed while idle (an operator, the OOM killer, a test reaper) that still looks
    alive when the next check starts: the request hits a closed pipe, the verifier is replaced
    and the check answered; the caller sees no exception (CI once saw BrokenPipeError here)."""
    import os
    import signal

    from protocol.rewards import verifier as v

    assert verify_answer("1", "1", timeout_s=30.0, memory_bytes=1024**3)[0]
    pool = v._get_pool()
    with pool.lock:
        dead = list(pool.all)
    assert dead
    for slot in dead:
        os.killpg(slot.proc.pid, signal.SIGKILL)
        slot.proc.wait()  # gone, its end of the request pipe closed
    real_alive = v._Verifier.alive
    fooled: list[v._Verifier] = []

    def alive_once(self):  # the window between poll() and the write, made certain
        if self in dead and self not in fooled:
            fooled.append(self)
            return True
        return real_alive(self)

    monkeypatch.setattr(v._Verifier, "alive", alive_once)
    ok, limit, detail = verify_answer("\\frac{14}{3}", "\\frac{14}{3}", timeout_s=30.0, memory_bytes=1024**3)
    assert fooled  # the dead verifier was handed the request
    assert (ok, limit) == (True, None), detail
