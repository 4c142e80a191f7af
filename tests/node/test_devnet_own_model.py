"""`intellect-node devnet --model DIR`: a researcher's own Hugging Face Qwen2 directory (bf16
safetensors, a 32k byte-level BPE tokenizer trained here, a ChatML chat template) trained by the
whole devnet: every verdict ok, held-out evaluation mid-run, the report naming model and task set."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
from local_model import build_local_model

from protocol.models import base_hash

pytestmark = pytest.mark.integration


def test_devnet_on_own_bf16_model_with_chat_template(tmp_path, shared):
    model = build_local_model(tmp_path / "my-qwen2", shared / "data", vocab_size=32768, dtype="bfloat16", eos_rate=0.3)
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "node", "devnet", "--model", str(model), "--steps", "2", "--workers", "1", "--relays", "1",
         "--eval-every", "1", "--eval-samples", "1", "--out", str(out), "--no-dashboard", "--timeout", "540"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    spec = tomllib.loads((out / "run.toml").read_text())
    # the spec pins the model as spec init --model-base would: its files, dtype and hidden size (TOPLOC's)
    assert spec["model"]["base"] == str(model.resolve()) and spec["model"]["base_hash"] == base_hash(model)
    assert spec["model"]["dtype"] == "bfloat16" and spec["model"]["hidden_size"] == 128
    rows = [json.loads(line) for line in (out / "coordinator" / "metrics.jsonl").read_text().splitlines()]
    run = next(row for row in rows if row.get("event") == "run")
    assert run["chat_template"] is True and run["vocab_size"] == 32768 and run["tasks"] == "embedded"
    steps = [row for row in rows if row.get("event") == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert set(steps[-1]["verdicts"]) == {"ok"}, steps[-1]["verdicts"]  # every verdict ok
    # held-out evaluation at the start, mid-run (step 1) and the end, each with its interval
    evals = [row for row in rows if row.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all(e["problems"] == run["heldout_problems"] == 100 and "heldout_ci_low" in e for e in evals)
    report = (out / "report.md").read_text()
    assert "task set: embedded (900 training problems, 100 held out" in report
    assert "bfloat16, hidden 128" in report and "vocabulary 32768, chat template yes" in report
    assert "| 1 | 0.000 |" in report or "## Held-out evaluations" in report
    assert "held-out gain: **" in report and "mismatch KL" in report
