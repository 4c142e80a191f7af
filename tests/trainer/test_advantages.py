"""Per-group advantages: grouping by key, never by position; zero-advantage filtering."""

from __future__ import annotations

import numpy as np
import pytest
import trainer_toy as toy
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.advantages import compute_group_advantages, group_advantages
from trainer.batch import RolloutRecord, assemble_batch
from trainer.errors import NotEnoughRolloutsError


def _rec(task: str, seed: int, sample: int, reward: float, step: int = 0) -> RolloutRecord:
    return RolloutRecord(
        submission_id=f"s-{task}-{seed}",
        worker="w",
        policy_step=step,
        task_key=task,
        group_seed=seed,
        sample=sample,
        prompt_ids=np.array([5, 6]),
        completion_ids=np.array([7, 8, 9]),
        logprobs=np.zeros(3, np.float32),
        reward=reward,
        task_reward=reward,
    )


def test_group_advantages_formula() -> None:
    # r = [1, 0]: mean 0.5, population std 0.5 → A = ±0.5 / (0.5 + ε)
    a = group_advantages(np.array([1.0, 0.0]), eps=1e-4)
    assert a.dtype == np.float32
    np.testing.assert_allclose(a, [0.5 / 0.5001, -0.5 / 0.5001], rtol=1e-6)
    np.testing.assert_array_equal(group_advantages(np.array([0.3, 0.3, 0.3]), 1e-4), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        group_advantages(np.array([]), 1e-4)
    with pytest.raises(ValueError):
        group_advantages(np.array([1.0, float("nan")]), 1e-4)


def test_interleaved_order_p1_p2_p1_p2() -> None:
    # 2 prompts × 2 rollouts, interleaved. By position, pairs (0,1) and (2,3) would mix prompts.
    keys = [("p1", 11), ("p2", 22), ("p1", 11), ("p2", 22)]
    rewards = [1.0, 0.0, 0.0, 0.5]
    groups = compute_group_advantages(keys, rewards, eps=1e-4)
    assert [g.key for g in groups] == [("p1", 11), ("p2", 22)]
    g1, g2 = groups
    assert g1.indices == (0, 2) and g2.indices == (1, 3)
    np.testing.assert_allclose(g1.advantages, [0.5 / 0.5001, -0.5 / 0.5001], rtol=1e-6)  # rewards 1, 0
    np.testing.assert_allclose(g2.advantages, [-0.25 / 0.2501, 0.25 / 0.2501], rtol=1e-6)  # rewards 0, 0.5

    # through batch assembly: the advantage follows the record, not its position
    recs = [_rec("p1", 11, 0, 1.0), _rec("p2", 22, 0, 0.0), _rec("p1", 11, 1, 0.0), _rec("p2", 22, 1, 0.5)]
    batch = assemble_batch(recs, step=0, group_size=2, num_groups=2, adv_eps=1e-4)
    adv = {(s.record.task_key, s.record.sample): s.advantage for s in batch.sequences}
    assert adv[("p1", 0)] == pytest.approx(0.5 / 0.5001) and adv[("p1", 1)] == pytest.approx(-0.5 / 0.5001)
    assert adv[("p2", 0)] == pytest.approx(-0.25 / 0.2501) and adv[("p2", 1)] == pytest.approx(0.25 / 0.2501)


def test_same_task_different_seed_are_different_groups() -> None:
    keys = [("p1", 1), ("p1", 2), ("p1", 1), ("p1", 2)]
    groups = compute_group_advantages(keys, [1.0, 1.0, 0.0, 1.0], eps=1e-4)
    assert len(groups) == 2
    assert not groups[0].all_zero and groups[1].all_zero


def test_zero_advantage_groups_are_dropped_whole() -> None:
    recs = [
        _rec("all-one", 1, 0, 1.0),
        _rec("mixed", 2, 0, 1.0),
        _rec("all-one", 1, 1, 1.0),
        _rec("mixed", 2, 1, 0.0),
        _rec("all-zero", 3, 0, 0.0),
        _rec("all-zero", 3, 1, 0.0),
    ]
    batch = assemble_batch(recs, step=0, group_size=2, num_groups=1, adv_eps=1e-4)
    assert batch.group_keys == [("mixed", 2)]
    assert batch.zero_advantage_groups == [("all-one", 1)]  # examined before "mixed" filled the batch
    assert {s.record.task_key for s in batch.sequences} == {"mixed"}
    assert batch.reward_mean == pytest.approx(0.75)  # over examined fresh groups: 1, 1, 1, 0
    assert batch.pass_rate == pytest.approx(0.75)
    assert ("all-one", 1) in batch.consumed_groups and ("all-zero", 3) not in batch.consumed_groups
    assert batch.consumed_submission_ids == ["s-all-one-1", "s-mixed-2"]

    with pytest.raises(NotEnoughRolloutsError) as e:
        assemble_batch(recs, step=0, group_size=2, num_groups=2, adv_eps=1e-4)
    assert e.value.usable_groups == 1 and e.value.zero_advantage_groups == 2


def test_incomplete_groups_are_skipped() -> None:
    recs = [_rec("p", 1, 0, 1.0), _rec("p", 1, 1, 0.0), _rec("q", 2, 0, 1.0)]
    batch = assemble_batch(recs, step=0, group_size=2, num_groups=2, adv_eps=1e-4, allow_partial=True)
    assert batch.group_keys == [("p", 1)] and batch.incomplete_groups == [("q", 2)]


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False))
def test_advantages_do_not_depend_on_order(rnd) -> None:
    recs = toy.toy_records(seed=3, step=0)
    shuffled = list(recs)
    rnd.shuffle(shuffled)
    a = assemble_batch(recs, step=0, group_size=toy.GROUP, num_groups=4, adv_eps=1e-4)
    b = assemble_batch(shuffled, step=0, group_size=toy.GROUP, num_groups=4, adv_eps=1e-4)
    key = lambda s: (s.record.task_key, s.record.sample)
    assert {key(s): s.advantage for s in a.sequences} == {key(s): s.advantage for s in b.sequences}
