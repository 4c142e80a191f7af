"""protocol.window: the one async-window rule."""

from __future__ import annotations

from protocol.window import fresh_steps, in_window, oldest_fresh_step, retained_steps


def test_the_window_is_n_minus_k_to_n() -> None:
    assert oldest_fresh_step(10, 2) == 8
    assert [p for p in range(5, 13) if in_window(p, trainer_step=10, async_level=2)] == [8, 9, 10]
    assert oldest_fresh_step(0, 2) == -2 and in_window(0, trainer_step=0, async_level=2)


def test_the_ingest_bounds_the_top_by_the_newest_published_step() -> None:
    # trainer at 10, newest published policy 9 (publish_every > 1): step 10 does not exist yet for workers
    assert [p for p in range(6, 12) if in_window(p, trainer_step=10, async_level=2, newest_step=9)] == [8, 9]


def test_retention_keeps_the_newest_steps_and_the_one_in_use() -> None:
    assert fresh_steps(2) == 3 and fresh_steps(0) == 1
    assert retained_steps([5, 1, 3, 4, 2], 3) == {3, 4, 5}
    assert retained_steps([5, 1, 3, 4, 2], 3, in_use=1) == {1, 3, 4, 5}
    assert retained_steps([2, 3], 3, in_use=7) == {2, 3}  # not held: nothing to keep
    assert retained_steps([], 3) == set()
