"""node.policy: the owner of a node's held checkpoints (retention, fetch locks, the delta-or-full choice)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from shardcast_fixtures import Run, StaticSources, make_run, make_store, serving, write_checkpoint

from node.coordinator.publish import RECHECK_GRACE_STEPS, PolicyPublisher
from node.errors import FetchError
from node.policy import PolicyFollower
from node.shardcast.delta import full_fetch_reason
from node.shardcast.publish import publish_checkpoint
from node.shardcast.store import ShardcastStore


def _publish(run: Run, store: ShardcastStore, tmp_path: Path, step: int) -> None:
    d = tmp_path / f"ckpt-{step}"
    ckpt = write_checkpoint(d / "model.safetensors", 0.1, seed=step)
    (d / "config.json").write_text("{}")
    publish_checkpoint(store, [ckpt, d / "config.json"], step=step, key=run.key, piece_size_bytes=run.signed.spec.shardcast.piece_size_bytes)


async def test_retention_keeps_the_newest_keep_steps_and_the_step_just_fetched(tmp_path: Path) -> None:
    """keep_steps 2: fetching 1, 2, 3 leaves 2 and 3; a validator then fetching the older step 0
    (to judge a late submission) gets a directory that is still there, and the next fetch drops it."""
    run = make_run(keep_steps=2)
    origin = make_store(run, tmp_path / "origin", keep_steps=8)
    for step in range(5):
        _publish(run, origin, tmp_path, step)
    async with serving(origin) as srv:
        follower = PolicyFollower(run.signed.spec, tmp_path / "held", StaticSources([srv.url]))
        try:
            for step in (1, 2, 3):
                await follower.fetch(step)
            assert follower.held_steps() == [2, 3]
            old = await follower.fetch(0)
            assert (old / "model.safetensors").is_file() and follower.have(0), "the step in use is not pruned under its user"
            assert follower.held_steps() == [0, 2, 3]
            await follower.fetch(4)
            assert follower.held_steps() == [3, 4]
        finally:
            await follower.close()


async def test_fetch_locks_do_not_grow_with_steps_nobody_has(tmp_path: Path) -> None:
    """A lying ingest naming ever new policy steps leaves no lock behind per step (issue #23 item 8)."""
    run = make_run()
    origin = make_store(run, tmp_path / "origin")
    _publish(run, origin, tmp_path, 0)
    async with serving(origin) as srv:
        follower = PolicyFollower(run.signed.spec, tmp_path / "held", StaticSources([srv.url]))
        try:
            for step in range(1000, 1040):
                with pytest.raises(FetchError):
                    await follower.fetch(step)
            await follower.fetch(0)
            assert follower._locks == {}
        finally:
            await follower.close()


def test_the_coordinator_keeps_its_written_policies_by_the_same_rule(tmp_path: Path) -> None:
    """The coordinator's written policies follow protocol.window.retained_steps with keep_steps + the
    re-check's grace: with rl.publish_every 2 (steps 0, 2, 4, ...) it keeps the newest three
    published, as a node counts held steps (pruning by step distance kept two)."""
    run = make_run(keep_steps=2)
    origin = make_store(run, tmp_path / "origin", keep_steps=8)
    pub = PolicyPublisher(origin, run.key, run.signed, tmp_path / "policies", "http://127.0.0.1:1", lambda *_: None)
    for step in range(0, 10, 2):
        d = tmp_path / "policies" / f"step-{step}"
        ckpt = write_checkpoint(d / "model.safetensors", 0.1, seed=step)
        (d / "config.json").write_text("{}")
        pub.publish(step, [ckpt, d / "config.json"])
    assert RECHECK_GRACE_STEPS == 1
    assert sorted(int(p.name[5:]) for p in (tmp_path / "policies").glob("step-*")) == [4, 6, 8]
    assert pub.policy_dir(4) is not None and pub.policy_dir(2) is None


def test_the_delta_or_full_choice(tmp_path: Path) -> None:
    """One function chooses; a float32 run (no deltas published) always fetches in full."""
    held = SimpleNamespace(body=SimpleNamespace(step=3))
    out = tmp_path / "step-5"
    assert full_fetch_reason(held, 5, out, max_chain=4) == ""
    assert full_fetch_reason(held, None, out, max_chain=4) == ""  # the newest step: decided again once its manifest is known
    assert "no deltas" in full_fetch_reason(held, 5, out, max_chain=0)
    assert "no held" in full_fetch_reason(None, 5, out, max_chain=4)
    assert "not before" in full_fetch_reason(held, 3, out, max_chain=4)
    out.mkdir()
    (out / "x").write_text("x")
    assert "not empty" in full_fetch_reason(held, 5, out, max_chain=4)
    run = make_run()
    assert not run.signed.spec.publishes_deltas and run.signed.spec.delta_chain_limit == 0
    assert make_run(model_dtype="bfloat16").signed.spec.delta_chain_limit == run.signed.spec.shardcast.max_delta_chain
