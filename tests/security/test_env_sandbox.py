"""Hostile reward files against the real environment path (``open_environment`` → bubblewrap
sandbox → ``compute_reward`` → the validator's judgement): a reward function that sleeps,
allocates, forks, reads the node key or prints a gigabyte cannot harm the node or get a worker
banned. Each test has positive evidence that the attack ran (the environment answers, or a host
side effect it reaches for is absent) and checks the host directly (time, files, processes).
"""

from __future__ import annotations

import secrets
import textwrap
import time
from pathlib import Path

import pytest

from protocol.envs import EnvLimits, open_environment
from protocol.rewards import compute_reward, compute_rewards
from protocol.rewards.sandbox import sandbox_status
from protocol.verdicts import BENIGN_REASONS, is_cheat
from validator.rewards import judge_reward

pytestmark = pytest.mark.skipif(not sandbox_status()[0], reason=f"no sandbox here: {sandbox_status()[1]}")

FAST = EnvLimits(score_wall_s=3.0, cpu_time_s=2, memory_bytes=512 * 1024**2, output_bytes=256 * 1024, processes=16, pool=1)

HOSTILE = '''
import os, sys, time

def generate(seed, count):
    return [{{"id": f"t{{i}}", "prompt": f"task {{i}}", "answer": "ok"}} for i in range(count)]

def score(task, completion):
    if completion == "ok":
        return 1.0
{body}
'''


def hostile(tmp_path: Path, body: str) -> object:
    path = tmp_path / f"hostile_{secrets.token_hex(4)}.py"
    path.write_text(HOSTILE.format(body=textwrap.indent(textwrap.dedent(body), "    ")))
    return open_environment(str(path), train_size=4, heldout_size=0, limits=FAST)


def one(env: object) -> tuple[object, dict]:
    task = env.tasks.train[0]
    return task, task.environment_row[1]


def judged(task: object, completion: str, reported: float) -> str:
    """The validator's verdict reason on a worker that reported ``reported`` for ``completion``."""
    score = lambda: compute_reward(task, completion, 2, None, 0.0)
    return judge_reward(score, reported, reported, reward_tol=1e-6, budget_s=30.0, environment=True).reason


def assert_benign(reason: str) -> None:
    assert reason == "environment" and reason in BENIGN_REASONS and not is_cheat(reason)


def sandbox_pids(marker: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def test_a_sleeping_reward_is_cut_at_its_wall_limit_and_the_next_call_works(tmp_path):
    env = hostile(tmp_path, "time.sleep(3600)\nreturn 1.0")
    try:
        task, row = one(env)
        t0 = time.monotonic()
        r = compute_reward(task, "sleep", 2, None, 0.0)
        assert (r.task_reward, r.env_fault) == (0.0, "wall") and time.monotonic() - t0 < FAST.score_wall_s + 10
        assert env.score(row, "ok").value == 1.0  # the environment goes on
        assert_benign(judged(task, "sleep", 1.0))
        assert_benign(judged(task, "sleep", 0.0))  # even a worker that reported the same 0: no score to compare
    finally:
        env.close()


def test_an_allocating_reward_hits_its_memory_limit(tmp_path):
    env = hostile(tmp_path, "x = bytearray(8 * 1024**3)\nreturn 1.0")
    try:
        task, row = one(env)
        r = compute_reward(task, "allocate", 2, None, 0.0)
        assert (r.task_reward, r.env_fault) == (0.0, "memory"), r.detail
        assert env.score(row, "ok").value == 1.0
        assert_benign(judged(task, "allocate", 1.0))
    finally:
        env.close()


def test_a_forking_reward_is_bounded_and_leaves_nothing_running(tmp_path):
    marker = f"3600.{secrets.randbelow(10**8):08d}"  # an argument of sleep no other process has
    body = f'''
    import subprocess
    n = 0
    try:
        while n < 10_000:  # a fork bomb: RLIMIT_NPROC stops it
            subprocess.Popen(["/bin/sleep", "{marker}"])
            n += 1
    except OSError:
        pass
    return 0.5 if 0 < n < {FAST.processes} else 0.25
    '''
    env = hostile(tmp_path, body)
    try:
        task, row = one(env)
        r = compute_reward(task, "fork", 2, None, 0.0)
        assert (r.task_reward, r.env_fault) == (0.5, None), r.detail  # it forked, and the process limit held
        assert sandbox_pids(marker) == []  # its daemons were killed when the call ended
        assert env.score(row, "ok").value == 1.0
    finally:
        env.close()


def test_a_reward_cannot_read_the_node_key_or_any_host_file(tmp_path):
    key = tmp_path / "node.key"
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o644)  # readable by anyone on the host: only the sandbox keeps it out
    here = Path(__file__).resolve()
    body = f'''
    seen = [p for p in ({str(key)!r}, {str(here)!r}, "/etc/passwd", "/etc/hostname", "/home") if os.path.exists(p)]
    return 0.0 if seen else 0.75
    '''
    env = hostile(tmp_path, body)
    try:
        task, _ = one(env)
        assert compute_reward(task, "peek", 2, None, 0.0).task_reward == 0.75
    finally:
        env.close()
    env = hostile(tmp_path, f"return float(len(open({str(key)!r}, 'rb').read()) > 0)")
    try:
        task, _row = one(env)
        r = compute_reward(task, "read", 2, None, 0.0)
        assert (r.task_reward, r.env_fault) == (0.0, "crash") and "FileNotFoundError" in r.detail
        assert_benign(judged(task, "read", 1.0))
    finally:
        env.close()


def test_a_gigabyte_of_output_is_cut_at_its_output_limit(tmp_path):
    env = hostile(tmp_path, "chunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\nreturn 1.0")
    try:
        task, row = one(env)
        t0 = time.monotonic()
        r = compute_reward(task, "print", 2, None, 0.0)
        assert (r.task_reward, r.env_fault) == (0.0, "output") and time.monotonic() - t0 < 30
        assert env.score(row, "ok").value == 1.0  # a fresh sandbox took its place
        assert_benign(judged(task, "print", 1.0))
    finally:
        env.close()


def test_crashes_bad_values_and_nondeterminism_are_the_environments_fault(tmp_path):
    env = hostile(tmp_path, '''
    if completion == "crash":
        raise ValueError("boom")
    if completion == "nan":
        return float("nan")
    if completion == "exit":
        os._exit(3)
    return int.from_bytes(os.urandom(1), "big") / 255  # not a function of its input
    ''')
    try:
        task, _ = one(env)
        assert compute_reward(task, "crash", 2, None, 0.0).env_fault == "crash"
        assert compute_reward(task, "nan", 2, None, 0.0).env_fault == "value"
        assert compute_reward(task, "exit", 2, None, 0.0).env_fault == "crash"
        for completion in ("crash", "nan", "exit", "random"):
            assert_benign(judged(task, completion, 1.0))
    finally:
        env.close()


def test_a_worker_that_lies_about_a_deterministic_environment_is_still_caught(tmp_path):
    env = hostile(tmp_path, "return 0.0")
    try:
        task, _ = one(env)
        reason = judged(task, "wrong", 1.0)
        assert reason == "reward" and is_cheat(reason)  # verified like the built-in rewards
        assert judged(task, "ok", 1.0) == "ok"
    finally:
        env.close()


def test_random_is_seeded_per_call_so_scores_agree_everywhere(tmp_path):
    env = hostile(tmp_path, "import random\nreturn random.random()")
    try:
        task, row = one(env)
        first = env.score(row, "same")
        assert first.fault is None and env.score(row, "same").value == first.value
        assert judged(task, "same", first.value) == "ok"
    finally:
        env.close()


def test_closing_an_environment_leaves_no_sandbox_behind(tmp_path):
    env = hostile(tmp_path, "return 0.0")
    try:
        _, row = one(env)
        assert env.score(row, "ok").value == 1.0
        assert sandbox_pids(env.source.entry)  # its harness runs (bwrap's command line names the file)
    finally:
        env.close()
    assert sandbox_pids(env.source.entry) == []


@pytest.mark.slow
def test_hostile_items_in_a_workers_batch_land_on_their_own_completions(tmp_path):
    # a worker scores its completions in batches (compute_rewards): the same faults, on the same items, as one by one
    marker = f"3600.{secrets.randbelow(10**8):08d}"
    env = hostile(tmp_path, f'''
    if completion == "sleep":
        time.sleep(3600)
    if completion == "allocate":
        x = bytearray(8 * 1024**3)
    if completion == "fork":
        import subprocess
        subprocess.Popen(["/bin/sleep", "{marker}"])
        return 0.5
    if completion == "print":
        for _ in range(1024):
            sys.stdout.write("x" * (1 << 20))
    return 0.0
    ''')
    try:
        task, _ = one(env)
        completions = ["ok", "sleep", "ok", "allocate", "fork", "ok", "print", "ok", "wrong"]
        t0 = time.monotonic()
        batch = compute_rewards([(task, c, 2, None) for c in completions], 0.0)
        assert time.monotonic() - t0 < 120
        faults = [(r.task_reward, r.env_fault) for r in batch]
        assert faults == [(1.0, None), (0.0, "wall"), (1.0, None), (0.0, "memory"), (0.5, None), (1.0, None), (0.0, "output"), (1.0, None),
                          (0.0, None)], [r.detail for r in batch]
        assert sandbox_pids(marker) == []
        assert [judged(task, c, 1.0) for c in ("sleep", "allocate", "print")] == ["environment"] * 3  # never the worker's fault
    finally:
        env.close()


def test_a_process_left_holding_the_answer_pipe_does_not_stall_the_call(tmp_path):
    env = hostile(tmp_path, '''
    if os.fork() == 0:  # a child that keeps every descriptor, the answer pipe too (exec would close it: O_CLOEXEC)
        time.sleep(3600)
        os._exit(0)
    return 0.5
    ''')
    try:
        task, row = one(env)
        first = env.score(row, "daemon")  # answered when it answered, not as "wall" at its wall limit
        assert (first.value, first.fault) == (0.5, None)
        assert [(r.task_reward, r.env_fault) for r in compute_rewards([(task, "daemon", 2, None)] * 2, 0.0)] == [(0.5, None)] * 2
    finally:
        env.close()
