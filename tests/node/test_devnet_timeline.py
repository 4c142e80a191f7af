"""The devnet report's timeline, propagation and memory tables from metrics rows, node logs and /proc."""

from __future__ import annotations

import os

from node.devnet.timeline import MemorySampler, read_node_log, rss_budget_bytes, step_timeline, trainer_state_bytes

WORKER_LOG = """\
10:00:01 INFO    node.worker.role: submission 0 at step 0: 128 tokens in 4.00 s, mean task reward 0.00
10:00:05 INFO    node.worker.role: submission 1 at step 0: 64 tokens in 6.00 s, mean task reward 0.00
10:00:09 INFO    node.policy: holds policy step 1 via delta: 2000 bytes in 1.500 s (apply 0.700 s) at 1000.500
10:00:09 INFO    node.policy: holds policy step 1 via full: 9000 bytes in 9.000 s (apply 0.000 s) at 1009.000
"""
VALIDATOR_LOG = """\
10:00:03 INFO    node.validator.role: verdict accept on 0123456789ab from 12D3KooWx (step 0, checked in 2.50 s): ok {}
10:00:07 WARNING node.validator.role: verdict reject on ba9876543210 from 12D3KooWy (step 0, checked in 1.50 s): tampered {}
10:00:10 INFO    node.policy: holds policy step 1 via delta: 2000 bytes in 2.000 s (apply 1.000 s) at 1002.250
"""


def test_step_timeline_joins_coordinator_rows_and_node_logs(tmp_path):
    (tmp_path / "w.log").write_text(WORKER_LOG)
    (tmp_path / "v.log").write_text(VALIDATOR_LOG)
    logs = {"worker-0": read_node_log(tmp_path / "w.log"), "validator-0": read_node_log(tmp_path / "v.log"),
            "relay-0": read_node_log(tmp_path / "missing.log")}
    assert logs["worker-0"].held[1].via == "delta"  # a step held twice (a restart) keeps the first
    steps = [{"step": 1, "wait_s": 3.0, "step_time_s": 20.0, "save_s": 2.0, "broadcast_s": 4.0, "state_s": 8.0,
              "checkpoint_bytes": 100_000, "delta_bytes": 2000, "published_at": 999.0},
             {"step": 2, "step_time_s": 21.0}]
    first, second = step_timeline(steps, logs)
    assert (first["rollout_s"], first["validation_s"]) == (5.0, 2.0)
    assert (first["batch_wait_s"], first["train_s"], first["save_s"], first["publish_s"], first["state_s"]) == (3.0, 20.0, 2.0, 4.0, 8.0)
    assert (first["checkpoint_bytes"], first["delta_bytes"]) == (100_000, 2000)
    assert first["held"]["worker-0"] == {"after_s": 1.5, "via": "delta", "bytes": 2000, "fetch_s": 1.5, "apply_s": 0.7}
    assert first["held"]["validator-0"]["after_s"] == 3.25 and "relay-0" not in first["held"]
    assert (first["last_node"], first["last_hold_s"]) == ("validator-0", 3.25)
    assert second["held"] == {} and second["last_hold_s"] is None and second["rollout_s"] is None


def test_memory_sampler_reads_proc_and_reports_growth_between_steps():
    sampler = MemorySampler()
    for step in (0, 1, 2, 3):
        sampler.sample([("me", "worker", os.getpid())], step)
    sampler.sample([("gone", "relay", 2**22 + 12345)], 1)  # no such process: nothing recorded
    (row,) = sampler.rows(steps=3)
    assert row["name"] == "me" and row["peak_bytes"] >= max(row["by_step"].values()) > 0
    assert sorted(row["by_step"]) == [0, 1, 2, 3] and row["growth_bytes"] == row["by_step"][2] - row["by_step"][1]
    assert sampler.rows(steps=2)[0]["growth_bytes"] is None  # one step between load and wind-down: no growth to measure


def test_memory_goal_and_trainer_state():
    assert rss_budget_bytes(988_000_000) == 3 * 988_000_000 + (1 << 30)
    assert trainer_state_bytes(494_032_768) == 16 * 494_032_768  # fp32 masters, grads, two AdamW moments
