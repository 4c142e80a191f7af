"""The environment's command line as an operator uses it: ``spec init --env`` pins it, a worker
and a validator whose environment differs refuse to start in one line naming both hashes, and the
devnet's ``--env`` flags are checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from protocol.rewards.sandbox import sandbox_status

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sandbox_status()[0], reason=f"no sandbox here: {sandbox_status()[1]}")]

ENV = '''
def generate(seed, count):
    return [{"id": f"t-{seed}-{i}", "n": i % 10, "answer": str(2 * (i % 10))} for i in range(count)]

def prompt(task):
    return f"2*{task['n']}="

def score(task, completion):
    return 1.0 if completion.strip() == task["answer"] else 0.0
'''


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=180, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)


def test_spec_init_pins_the_environment_and_a_changed_one_is_refused(tmp_path):
    (tmp_path / "double.py").write_text(ENV)
    assert cli("keygen", "--key", "coord.key", cwd=tmp_path).returncode == 0
    assert cli("keygen", "--key", "val.key", cwd=tmp_path).returncode == 0
    val_id = cli("id", "--key", "val.key", cwd=tmp_path).stdout.strip().split()[-1]
    r = cli("spec", "init", "--coordinator-key", "coord.key", "--out", "run.toml", "--validator", val_id, "--env", "double.py",
            "--ingest-url", "http://127.0.0.1:9", "--origin-url", "http://127.0.0.1:9",
            "--env-train-size", "50", "--env-heldout-size", "10", "--env-seed", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"environment double\.py: 1 files, .*env\.hash [0-9a-f]{64}; 50 training tasks", r.stdout), r.stdout
    spec = tomllib.loads((tmp_path / "run.toml").read_text())
    env = spec["env"]
    assert (spec["data"]["tasks"], env["name"], env["seed"], env["train_size"], env["heldout_size"]) == ("environment", "double.py", 4, 50, 10)
    assert re.fullmatch(r"[0-9a-f]{64}", env["hash"]) and re.fullmatch(r"[0-9a-f]{64}", spec["data"]["tasks_hash"])
    assert cli("spec", "show", "run.toml", cwd=tmp_path).returncode == 0
    # the operator changes the file after signing: every scoring role refuses, naming both hashes
    (tmp_path / "double.py").write_text(ENV.replace("2 * (i % 10)", "2 * (i % 10) + 0"))
    for role in (["join", "--role", "worker", "--data-dir", "w"], ["validate", "--key", "val.key", "--data-dir", "v"]):
        r = cli(*role, "--run", "run.toml", "--no-gossip", cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
        assert re.fullmatch(rf"error: environment 'double\.py' hashes to [0-9a-f]{{64}} here but the run spec pins env\.hash {env['hash']}: .*",
                            lines[0]), lines[0]


def test_env_flags_are_checked(tmp_path):
    assert cli("keygen", "--key", "coord.key", cwd=tmp_path).returncode == 0
    for args, want in ((["--env", "x.py", "--tasks", "gsm8k"], "leave out --tasks"), (["--env-arg", "a=1"], "need --env"),
                       (["--env", "reasoning_gym:Bad"], "not a reasoning-gym dataset name")):
        r = cli("spec", "init", "--coordinator-key", "coord.key", "--out", "run.toml", *args, cwd=tmp_path)
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for args, want in ((["--env-arg", "a=1"], "--env-arg needs --env"), (["--env", "missing.py"], "no such file"),
                       (["--env", "x.py", "--tasks", "gsm8k"], "leave out --tasks")):
        r = cli("devnet", "--out", "dn", *args, cwd=tmp_path)
        assert r.returncode == 2 and want in r.stderr, r.stderr


def test_the_devnets_reasoning_gym_preset_is_the_embedded_tasks_shape():
    # `devnet --env reasoning_gym:basic_arithmetic` with no --env-arg: the tiny model solves none at the default difficulty
    from node.devnet.config import EMBEDDED_ENV_PRESETS, devnet_env, embedded_env_args

    args = embedded_env_args("reasoning_gym:basic_arithmetic")
    assert args == EMBEDDED_ENV_PRESETS["reasoning_gym:basic_arithmetic"] and args is not EMBEDDED_ENV_PRESETS["reasoning_gym:basic_arithmetic"]
    assert embedded_env_args("reasoning_gym:chain_sum") is None
    section, _, tokens = devnet_env("reasoning_gym:basic_arithmetic", args)
    assert section.args == args and tokens <= 4  # answers of at most three digits, plus EOS
    from protocol.envs import open_environment

    env = open_environment(section.name, args=section.args, seed=section.seed, train_size=section.train_size, heldout_size=section.heldout_size)
    try:
        assert all(re.fullmatch(r"\d{1,3} \+ \d{1,3}=", t.prompt) for t in env.tasks.train + env.tasks.heldout)
        assert env.tasks.heldout  # reasoning-gym's own held-out seed range, minus prompts a training task has
    finally:
        env.close()
