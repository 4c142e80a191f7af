"""Tests of protocol.rollout: the submission plan a validator recomputes (tasks, targets, prompts, seeds)."""

from __future__ import annotations

from collections import Counter

import pytest

from protocol import sampling
from protocol.models import embedded_tokenizer
from protocol.rollout import completion_text, pack_f32, pack_u32, plan_submission, unpack_f32, unpack_u32
from protocol.runspec import DataSpec, RLSpec, RunInfo, RunSpec, SamplingSpec
from protocol.tasks import LENGTH_CONTROL_TEMPLATE, Task, math_task

COORD = "12D3KooW" + "C" * 44
PEER_A = "12D3KooW" + "A" * 44
PEER_B = "12D3KooW" + "B" * 44
TARGETS = [64, 128, 256]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _spec(targets: list[int] | None = None, tasks_per_submission: int = 4, group_size: int = 3) -> RunSpec:
    return RunSpec(
        run=RunInfo(coordinator=COORD, seed=99),
        data=DataSpec(tasks_per_submission=tasks_per_submission),
        rl=RLSpec(group_size=group_size),
        sampling=SamplingSpec(target_lengths=TARGETS if targets is None else targets),
    )


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return [math_task(f"p{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(50)]


@pytest.fixture(scope="module")
def tok() -> object:
    return embedded_tokenizer()


def _key(plan: list) -> list[tuple]:
    return [(p.position, p.task_index, p.target_length, p.prompt_ids, p.seeds) for p in plan]


def test_plan_is_deterministic(tasks: list[Task], tok: object) -> None:
    spec = _spec()
    a = plan_submission(spec, tasks, tok, PEER_A, 3, 7)
    b = plan_submission(spec, tasks, embedded_tokenizer(), PEER_A, 3, 7)
    assert _key(a) == _key(b)
    assert [p.position for p in a] == [0, 1, 2, 3]
    assert len({p.task_index for p in a}) == 4 and all(p.task is tasks[p.task_index] for p in a)


@pytest.mark.parametrize(("peer", "step", "counter"), [(PEER_B, 3, 7), (PEER_A, 4, 7), (PEER_A, 3, 8)])
def test_plan_differs_per_peer_step_and_counter(tasks: list[Task], tok: object, peer: str, step: int, counter: int) -> None:
    spec = _spec()
    base = plan_submission(spec, tasks, tok, PEER_A, 3, 7)
    other = plan_submission(spec, tasks, tok, peer, step, counter)
    assert [p.task_index for p in other] != [p.task_index for p in base]
    assert not {s for p in other for s in p.seeds} & {s for p in base for s in p.seeds}
    # and a different run seed moves everything too
    reseeded = spec.model_copy(update={"run": spec.run.model_copy(update={"seed": 100})})
    assert [p.task_index for p in plan_submission(reseeded, tasks, tok, PEER_A, 3, 7)] != [p.task_index for p in base]


def test_seeds_are_bound_to_counter_task_and_sample_index(tasks: list[Task], tok: object) -> None:
    spec = _spec(group_size=5)
    plan = plan_submission(spec, tasks, tok, PEER_A, 2, 11)
    for p in plan:
        assert len(p.seeds) == 5
        for s, seed in enumerate(p.seeds):
            assert seed == sampling.derive_sequence_seed(99, 2, PEER_A, f"11:{p.task_index}", s)
            assert 0 <= seed < 1 << 63
    flat = [s for p in plan for s in p.seeds]
    assert len(set(flat)) == len(flat)  # no two samples share a noise stream


def test_target_lengths_come_from_the_spec(tasks: list[Task], tok: object) -> None:
    spec = _spec(tasks_per_submission=8)
    seen: Counter[int | None] = Counter()
    for counter in range(40):
        for p in plan_submission(spec, tasks, tok, PEER_A, 0, counter):
            seen[p.target_length] += 1
            suffix = LENGTH_CONTROL_TEMPLATE.format(n=p.target_length)
            assert tok.decode(list(p.prompt_ids)).endswith(suffix)  # type: ignore[attr-defined]
    assert set(seen) == set(TARGETS)
    assert min(seen.values()) > 0.2 * sum(seen.values())  # roughly uniform over the three targets
    no_targets = plan_submission(_spec(targets=[]), tasks, tok, PEER_A, 0, 0)
    for p in no_targets:
        assert p.target_length is None
        assert tok.decode(list(p.prompt_ids)) == p.task.prompt  # type: ignore[attr-defined]


def test_prompt_is_plain_text_without_a_chat_template(tasks: list[Task], tok: object) -> None:
    plan = plan_submission(_spec(), tasks, tok, PEER_A, 0, 0)
    for p in plan:
        text = f"{p.task.prompt} {LENGTH_CONTROL_TEMPLATE.format(n=p.target_length)}"
        assert list(p.prompt_ids) == tok(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]


def test_prompt_uses_the_chat_template_when_the_tokenizer_has_one(tasks: list[Task], tok: object) -> None:
    chat_tok = embedded_tokenizer()
    chat_tok.chat_template = CHAT_TEMPLATE
    plain = plan_submission(_spec(), tasks, tok, PEER_A, 0, 0)
    chat = plan_submission(_spec(), tasks, chat_tok, PEER_A, 0, 0)
    assert [p.task_index for p in chat] == [p.task_index for p in plain]  # the template changes prompts only
    assert [p.seeds for p in chat] == [p.seeds for p in plain]
    for p in chat:
        user = f"{p.task.prompt} {LENGTH_CONTROL_TEMPLATE.format(n=p.target_length)}"
        expected = f"<user>{user}\n<assistant>"
        assert chat_tok.decode(list(p.prompt_ids)) == expected
        assert list(p.prompt_ids) == chat_tok(expected, add_special_tokens=False)["input_ids"]


def test_plan_size_is_capped_by_the_dataset(tok: object) -> None:
    small = [math_task(f"q{i}", f"{i}?", str(i)) for i in range(3)]
    plan = plan_submission(_spec(tasks_per_submission=8), small, tok, PEER_A, 0, 0)
    assert sorted(p.task_index for p in plan) == [0, 1, 2]


def test_completion_text_and_packing(tok: object) -> None:
    ids = tok("x = 2", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert completion_text(tok, ids + [1], eos_id=1) == "x = 2"
    assert completion_text(tok, ids, eos_id=1) == "x = 2"
    assert unpack_u32(pack_u32([0, 7, 2**32 - 1])) == [0, 7, 2**32 - 1]
    assert unpack_f32(pack_f32([-0.5, 0.25])) == [-0.5, 0.25]
