"""A run's own environment through the real worker and validator code: the worker scores in the
environment's sandbox, the validator re-scores there, and the verdict is the one built-in rewards
get (``ok`` for honest work, ``reward`` for a lie), except where the environment's own code fails
(``environment``, benign). The policy is the shipped embedded base; the environment a plain file."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.coordinator.base import prepare_base
from node.engine.hf import TransformersEngine
from node.worker.rollouts import build_submission
from protocol.dataset import resolve_run_tasks, resolve_tasks
from protocol.envelope import open_envelope, seal
from protocol.envs import EnvError, environment_source, parse_env_ref
from protocol.identity import NodeKey
from protocol.messages import Submission
from protocol.models import load_model, load_tokenizer
from protocol.rewards.sandbox import sandbox_status
from protocol.runspec import ENV_TASKS, DataSpec, EnvSpec, RLSpec, RunInfo, RunSpec, SamplingSpec
from protocol.tasks import TaskError
from protocol.verdicts import is_cheat
from validator.pipeline import SubmissionChecker

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sandbox_status()[0], reason=f"no sandbox here: {sandbox_status()[1]}")]

COORD, VALIDATOR, WORKER = NodeKey.from_seed(b"c" * 32), NodeKey.from_seed(b"v" * 32), NodeKey.from_seed(b"w" * 32)
ENV = '''
import random

def generate(seed, count):
    rng = random.Random(seed)
    return [{"a": (a := rng.randint(0, 99)), "b": (b := rng.randint(0, 9)), "answer": str(a + b)} for _ in range(count)]

def prompt(task):
    return f"{task['a']}+{task['b']}="

def score(task, completion):
    if task["a"] == 13:
        raise RuntimeError("a bug in the environment")
    return 1.0 if completion.strip() == task["answer"] else 0.0
'''


def env_spec(path: Path, **env: object) -> RunSpec:
    pinned = environment_source(parse_env_ref(str(path))).hash
    return RunSpec(run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id], seed=3),
                   data=DataSpec(tasks=ENV_TASKS, tasks_per_submission=4), sampling=SamplingSpec(max_tokens=4, temperature=1.5),
                   rl=RLSpec(group_size=4), env=EnvSpec(name=str(path), hash=pinned, train_size=300, heldout_size=20, **env))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("env")
    path = folder / "addition.py"
    path.write_text(ENV)
    spec = env_spec(path)
    tasks = resolve_run_tasks(spec)
    base = prepare_base(RunSpec(run=RunInfo(coordinator=COORD.peer_id)), resolve_tasks("embedded"), folder / "base")  # the shipped base
    tok, model = load_tokenizer(base), load_model(base)
    try:
        yield spec, tasks, tok, model
    finally:
        tasks.environment.close()


def test_honest_environment_work_is_accepted_and_a_lie_is_a_cheat(world):
    spec, tasks, tok, model = world
    checker = SubmissionChecker(spec, tasks.train, tok, lambda s: model, trainer_step=lambda: 0, counter_seen=lambda *_: False)
    engine = TransformersEngine(model, tok)
    verdicts = []
    for counter in range(3):
        blob = build_submission(spec, spec.run_id, WORKER, engine, tok, tasks.train, 0, counter)
        env = open_envelope(blob, run_id=spec.run_id, expect=Submission)
        faulty = [p for p in env.body.tasks if p.problem_id and tasks.train[p.task_index].environment_row[1]["a"] == 13]
        result = checker.check(env)
        verdicts.append(result.reason)
        if not faulty:
            assert result.accepted, (result.reason, result.evidence)
    assert "ok" in verdicts
    # the same honest work with one reward raised: the validator's re-scoring disagrees, deterministically
    blob = build_submission(spec, spec.run_id, WORKER, engine, tok, tasks.train, 0, 10)
    body = open_envelope(blob, run_id=spec.run_id, expect=Submission).body
    j = next(i for i, ro in enumerate(body.rollouts) if ro.task_reward == 0.0
             and tasks.train[body.tasks[ro.task].task_index].environment_row[1]["a"] != 13)
    lied = body.rollouts[j].model_copy(update={"task_reward": 1.0, "reward": 1.0})
    forged = body.model_copy(update={"rollouts": [*body.rollouts[:j], lied, *body.rollouts[j + 1:]]})
    result = checker.check(open_envelope(seal(WORKER, spec.run_id, forged), run_id=spec.run_id, expect=Submission))
    assert (result.reason, is_cheat(result.reason)) == ("reward", True)


def test_a_crashing_environment_is_benign_for_the_worker(world):
    spec, tasks, tok, model = world
    checker = SubmissionChecker(spec, tasks.train, tok, lambda s: model, trainer_step=lambda: 0, counter_seen=lambda *_: False)
    engine = TransformersEngine(model, tok)
    for counter in range(200):  # the first submission that draws a task the environment crashes on
        blob = build_submission(spec, spec.run_id, WORKER, engine, tok, tasks.train, 0, counter)
        env = open_envelope(blob, run_id=spec.run_id, expect=Submission)
        if any(tasks.train[p.task_index].environment_row[1]["a"] == 13 for p in env.body.tasks):
            break
    else:
        pytest.fail("no submission drew an a=13 task")
    result = checker.check(env)
    assert (result.reason, is_cheat(result.reason)) == ("environment", False), result.evidence
    assert "a bug in the environment" in str(result.evidence.get("detail"))


def test_a_node_whose_environment_differs_refuses_to_start(world, tmp_path):
    spec, *_ = world
    changed = tmp_path / "addition.py"
    changed.write_text(ENV.replace("randint(0, 9)", "randint(0, 8)"))
    moved = spec.model_copy(update={"env": spec.env.model_copy(update={"name": str(changed)})})
    with pytest.raises(EnvError) as e:
        resolve_run_tasks(moved)
    got = environment_source(parse_env_ref(str(changed))).hash
    assert "\n" not in str(e.value) and got in str(e.value) and spec.env.hash in str(e.value)
    with pytest.raises(TaskError, match="resolve_run_tasks"):
        resolve_tasks(ENV_TASKS)
