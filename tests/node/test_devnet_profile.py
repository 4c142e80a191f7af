"""``devnet --profile qwen2.5-0.5b`` at reduced depth: the real vocabulary (151,936 ids, byte-level
BPE trained on the task text), width (896), heads (14 / 2) and tied embeddings, one decoder
layer, through every role as its own process — generated, proven, validated, trained (fp32
masters), published in bf16 with a step delta, and that delta applied by every node — with the
report's timeline, propagation and memory tables. With root the nodes also sit behind capped
links (``--links``). The full 24 layers are ``benchmarks/profile_devnet.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tomllib

import psutil
import pytest

from node.devnet.links import PREFIX, namespaces, unavailable
from node.devnet.profile import PROFILES
from node.devnet.timeline import read_node_log

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1500)
def test_profile_at_one_layer_runs_every_role_and_reports_its_timeline(tmp_path, shared):
    out = tmp_path / "out"
    links = unavailable() is None
    p = subprocess.Popen(
        [sys.executable, "-m", "node", "devnet", "--profile", "qwen2.5-0.5b", "--profile-layers", "1", "--steps", "1",
         "--data-root", str(shared / "data"), "--out", str(out), "--no-dashboard", "--timeout", "1200",
         # capped links, the worker's at 1 Gb/s: at the default 100 Mb/s its 309 MB base alone takes ≈ 25 s of the suite
         *(["--links", "--link-mbit", "worker=1000"] if links else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = p.communicate(timeout=1500)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, output[-3000:]
    profile = PROFILES["qwen2.5-0.5b"]
    spec = tomllib.loads((out / "run.toml").read_text())
    assert spec["model"]["dtype"] == "bfloat16" and spec["model"]["hidden_size"] == profile.hidden_size
    assert spec["toploc"]["max_near_tie_fraction"] == 1.0  # random weights: near ties are honest noise (node/devnet/config.py)
    assert spec["data"]["tasks"] == "gsm8k" and spec["data"]["tasks_per_submission"] == 1 and spec["rl"]["group_size"] == 4
    rows = [json.loads(line) for line in (out / "coordinator" / "metrics.jsonl").read_text().splitlines()]
    run = next(r for r in rows if r.get("event") == "run")
    assert (run["vocab_size"], run["hidden_size"], run["layers"]) == (profile.vocab_size, profile.hidden_size, 1)
    assert run["parameters"] == profile.parameters(1)
    config = json.loads((out / "coordinator" / "policies" / "step-1" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    (step,) = [r for r in rows if r.get("event") == "step"]
    assert set(step["verdicts"]) == {"ok"}, step["verdicts"]
    # published in bf16 (2 bytes per parameter; the checkpoint also holds the ≈ 7 MB tokenizer and the config) with a
    # delta from step 0, and every node applied that delta
    assert profile.bf16_bytes(1) < step["checkpoint_bytes"] < profile.bf16_bytes(1) + (16 << 20)
    assert 0 < step["delta_bytes"] < step["checkpoint_bytes"]
    for name in ("relay-0", "validator-0", "worker-0"):
        held = read_node_log(out / "logs" / f"{name}.log").held
        assert held[1].via == "delta" and held[1].bytes == step["delta_bytes"], (name, held)
    assert all(isinstance(step.get(k), (int, float)) for k in ("wait_s", "save_s", "state_s", "published_at", "broadcast_s"))
    report = (out / "report.md").read_text()
    timeline = report.split("## Per-step timeline", 1)[1].split("\n## ", 1)[0]
    assert "| step | rollout | validation | batch wait | train | save | publish | state | full bytes | delta bytes | delta / full |" in timeline
    line = next(x for x in timeline.splitlines() if x.startswith("| 1 |"))
    assert f"| {step['checkpoint_bytes']} | {step['delta_bytes']} |" in line
    assert any(f"({name})" in line for name in ("relay-0", "validator-0", "worker-0")), line  # the last node to hold step 1
    propagation = report.split("## Policy propagation", 1)[1].split("\n## ", 1)[0]
    assert {x.split("|")[2].strip() for x in propagation.splitlines() if x.startswith("| 1 |")} == {"relay-0", "validator-0", "worker-0"}
    memory = report.split("## Memory", 1)[1].split("\n## ", 1)[0]
    assert "Goal per node: ≤ 3 × the bf16 checkpoint" in memory and "stated apart" in memory
    processes = {x.split("|")[1].strip() for x in memory.splitlines() if x.startswith("| ") and not x.startswith("| process")}
    assert processes == {"coordinator", "relay-0", "validator-0", "worker-0"}
    # nothing left: no process of the run, no namespace
    end = time.monotonic() + 10.0
    while (left := [q for q in psutil.process_iter(["cmdline"]) if str(out) in " ".join(q.info["cmdline"] or [])]) and time.monotonic() < end:
        time.sleep(0.1)
    assert left == []
    if links:
        assert re.search(r"links: coordinator [\d.]+ 1000 Mb/s, validator-0 [\d.]+ 500 Mb/s, worker-0 [\d.]+ 1000 Mb/s", report), report
        assert "links removed" in report and [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{p.pid}-")] == []
