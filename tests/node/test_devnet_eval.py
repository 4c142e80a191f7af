"""Held-out intervals (bootstrap over problems), the report's held-out and off-policy sections, and
the devnet's evaluation schedule — without running a devnet."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from node.coordinator.evaluate import EvalResult, eval_row, gain_interval, pass_rate_interval
from node.devnet.orchestrator import DevnetOptions
from node.devnet.report import heldout_summary, write_report
from node.devnet.timeline import MemorySampler


def test_pass_rate_interval_resamples_problems_not_samples():
    # 20 problems, 16 samples each: half always pass, half never. A binomial interval over 320
    # samples would be ±0.055; over problems the uncertainty is that of 20 coin flips (≈ ±0.22)
    passes = [16] * 10 + [0] * 10
    lo, hi = pass_rate_interval(passes, 16)
    assert lo < 0.5 < hi
    assert hi - lo > 0.3
    # every problem passes in half of its samples: the problems agree, so the interval is narrow
    lo2, hi2 = pass_rate_interval([8] * 20, 16)
    assert lo2 == pytest.approx(0.5) and hi2 == pytest.approx(0.5)
    assert pass_rate_interval([], 16) == (0.0, 0.0)
    assert pass_rate_interval(passes, 16) == (lo, hi)  # fixed seed: reproducible


def test_gain_interval_is_paired():
    start = [2, 4, 6, 8, 10, 12, 14, 0] * 3
    end = [s + 2 for s in start]  # every problem gains exactly 2/16
    gain, lo, hi = gain_interval(start, end, 16, 16)
    assert gain == pytest.approx(0.125) and lo == pytest.approx(0.125) and hi == pytest.approx(0.125)
    mixed = [s + (4 if i % 2 else -4) for i, s in enumerate(start)]
    mixed = [min(16, max(0, m)) for m in mixed]
    g2, lo2, hi2 = gain_interval(start, mixed, 16, 16)
    assert lo2 < g2 < hi2 and lo2 < 0 < hi2
    with pytest.raises(ValueError, match="cannot be paired"):
        gain_interval([1, 2], [1], 16, 16)


def test_eval_row_and_summary():
    a = EvalResult(pass_rate=0.25, reward_mean=0.25, samples=80, tokens=160, passes=[4, 2, 8, 0, 6], samples_per_task=16)
    b = EvalResult(pass_rate=0.6, reward_mean=0.6, samples=80, tokens=160, passes=[12, 8, 10, 6, 12], samples_per_task=16)
    rows = [eval_row(0, a), eval_row(10, b)]
    assert rows[0]["heldout_ci_low"] <= 0.25 <= rows[0]["heldout_ci_high"]
    assert rows[1]["problems"] == 5 and rows[1]["passes"] == [12, 8, 10, 6, 12]
    json.dumps(rows)
    h = heldout_summary(rows)
    assert h["start"] == 0.25 and h["end"] == 0.6 and h["gain"] == pytest.approx(0.35) and h["points"] == 2
    assert 0 < h["gain_ci"][0] <= 0.35 <= h["gain_ci"][1]
    assert heldout_summary(rows[:1])["gain"] is None


@pytest.mark.parametrize(("steps", "every", "points"), [(60, 10, 7), (40, 7, 7), (3, 1, 4), (1, 1, 2)])
def test_default_eval_interval_gives_six_points_after_start(steps, every, points):
    o = DevnetOptions(out=None, steps=steps)  # type: ignore[arg-type]
    assert o.eval_interval() == every
    # the coordinator evaluates at the start, every `every` steps, and at the end (once)
    at = {0, steps} | {s for s in range(1, steps + 1) if s % every == 0}
    assert len(at) == points and len(at) >= min(steps, 6) + 1


@pytest.mark.slow
def test_report_has_heldout_band_gain_and_off_policy(tmp_path):
    coord = tmp_path / "coordinator"
    coord.mkdir()
    rows = [{"event": "run", "tasks": "embedded", "tasks_hash": "ab" * 32, "train_problems": 80, "heldout_problems": 5,
             "model": "embedded", "dtype": "float32", "hidden_size": 128, "layers": 2, "vocab_size": 100, "parameters": 300000,
             "chat_template": False, "eval_every": 1, "eval_samples": 16}]
    rows.append(eval_row(0, EvalResult(0.25, 0.25, 80, 160, [4, 2, 8, 0, 6], 16)))
    for step in (1, 2):
        rows.append({"event": "step", "step": step, "reward_mean": 0.5, "pass_rate": 0.5, "loss": 0.01, "grad_norm": 0.2,
                     "mismatch_kl": 0.0123, "is_ratio_mean": 1.0, "is_ratio_min": 0.5, "is_ratio_max": 3.5, "clipped_frac": 0.04,
                     "staleness": {"0": 10, "1": 6}, "tokens_per_s": 100.0, "broadcast_s": 0.1, "utilization": 0.3,
                     "wait_s": 1.5, "step_time_s": 2.5, "save_s": 0.5, "state_s": 0.25, "checkpoint_bytes": 1000, "delta_bytes": 20,
                     "published_at": 100.0})
        rows.append(eval_row(step, EvalResult(0.5, 0.5, 80, 160, [12, 8, 10, 6, 4], 16)))
    (coord / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # stands in for node.devnet.orchestrator.Devnet: the attributes and the one method write_report reads
    dn = SimpleNamespace(out=tmp_path, o=DevnetOptions(out=tmp_path, steps=2), peer_ids={}, coord_url="http://127.0.0.1:1", events=[],
                         run_id="c0ffee" * 8, seed=1234, chaos_summary=lambda: None, memory=MemorySampler(), group=SimpleNamespace(procs=[]),
                         links=None, worker_outcomes=dict, adversary_summary=lambda: None)
    result = SimpleNamespace(ok=True, reason="completed", wall_s=10.0, coordinator={"verdicts_by_reason": {"ok": 3}})
    md, png = write_report(dn, result)  # type: ignore[arg-type]
    text = md.read_text()
    assert f"- run ID `{'c0ffee' * 8}`, seed **1234**" in text and "## Crash and restart" not in text
    assert "embedded (80 training problems, 5 held out" in text
    assert "300,000 parameters" in text
    assert "start 0.250 (95 % " in text and "end 0.500 (95 % " in text
    assert "held-out gain: **+0.250** (95 % " in text and "paired bootstrap over 5 held-out problems" in text
    assert "| 2 | 0.500 | 0.500 | 0.0100 | 0.200 | 0.01230 | 0.50–3.50 | 0.040 |" in text
    assert "## Held-out evaluations" in text and text.count("| 16") == 0
    timeline = text.split("## Per-step timeline", 1)[1].split("\n## ", 1)[0]
    assert "| 2 | - | - | 1.5 | 2.5 | 0.5 | 0.1 | 0.2 | 1000 | 20 | 1/50 | - |" in timeline  # no node logs: no rollouts, no holds
    assert png.stat().st_size > 10_000


def test_crash_section_points_at_the_restart_line_only_when_there_is_one():
    """A restarted worker with an empty spool logs no ``restart:`` line: the report must not send the
    reader looking for one (a 20-step run killed at step 10 had an empty spool and the report pointed at it)."""
    from node.devnet.report import crash_section

    def dn(spool: dict[str, object] | None, summary: str | None = "worker-0 killed (SIGKILL) at step 10") -> SimpleNamespace:
        return SimpleNamespace(chaos_summary=lambda: summary, node_status={"worker-0": {"spool_restart": spool}})

    assert crash_section(dn(None, summary=None)) == []
    empty = "\n".join(crash_section(dn({"found": 0, "resent": 0, "dropped_stale": 0})))
    assert "## Crash and restart" in empty and "Worker-0 killed (SIGKILL) at step 10." in empty and "restart:" not in empty
    found = "\n".join(crash_section(dn({"found": 2, "resent": 1, "dropped_stale": 1})))
    assert "the line starting `restart:`" in found
