"""The main job, shortened: every role as a process, discovery, publishing through relays,
validation, training, an adversary banned, and nothing left running afterwards."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


def _nobody_listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_short_devnet_with_adversary(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "node", "devnet", "--steps", "3", "--workers", "1", "--relays", "2", "--validators", "1",
         "--adversary", "inflated-reward", "--out", str(out), "--no-dashboard", "--timeout", "240"],
        capture_output=True, text=True, timeout=300,
    )
    # the time budget is the devnet's own --timeout: past it the devnet fails (non-zero exit)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = (out / "report.md").read_text()
    assert (out / "report.png").stat().st_size > 10_000
    # at least two policy steps published and fetched through the relays
    rows = [json.loads(line) for line in (out / "coordinator" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("event") == "step"]
    assert len(steps) == 3
    spec = (out / "run.toml").read_text()
    coord_url = re.search(r"ingest_urls = \[\s*\"(http://127.0.0.1:\d+)\"", spec).group(1)
    relay_urls = {u for name in ("relay-0", "relay-1") for u in re.findall(r"serving (http://127\.0\.0\.1:\d+)", (out / "logs" / f"{name}.log").read_text())}
    fetches = re.findall(r"fetched policy step (\d+) in [\d.]+ s from \[(.*?)\]", (out / "logs" / "worker-0.log").read_text())
    assert any(int(step) >= 1 for step, _ in fetches), fetches
    # workers prefer relays that hold the step over the origin: later steps came through relays
    assert any(url in srcs for _, srcs in fetches for url in relay_urls), (fetches, relay_urls, coord_url)
    # held-out evaluation at the start, after every step (default interval ceil(3 / 6) = 1) and not twice at the end
    evals = [row for row in rows if row.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 1, 2, 3]
    assert all(e["heldout_ci_low"] <= e["heldout_pass_rate"] <= e["heldout_ci_high"] and len(e["passes"]) == e["problems"] for e in evals)
    assert "held-out gain: **" in report and "## Held-out evaluations" in report
    # off-policy statistics per step; the first step trains on fresh rollouts of the same weights
    assert all({"mismatch_kl", "is_ratio_min", "is_ratio_max", "clipped_frac", "staleness"} <= set(s) for s in steps)
    assert steps[0]["staleness"] == {"0": steps[0]["num_rollouts"]} and steps[0]["mismatch_kl"] < 1e-4
    # submissions were validated and trained on; the adversary was banned and never trained on
    assert "| ok |" in report
    adv_line = next(line for line in report.splitlines() if line.startswith("| adversary |"))
    cells = [c.strip() for c in adv_line.split("|")]
    assert cells[6] == "0", adv_line  # trained on
    assert cells[7] == "reward", adv_line  # banned for the inflated reward
    worker_line = next(line for line in report.splitlines() if line.startswith("| worker-0 |"))
    assert int(worker_line.split("|")[6]) > 0  # the honest worker's rollouts were trained on
    # nothing left: no process mentions the out dir, the coordinator's port is free again
    end = time.monotonic() + 10.0
    while (left := [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]) and time.monotonic() < end:
        time.sleep(0.1)  # exiting children may take a moment to be reaped
    assert left == []
    assert _nobody_listens(int(coord_url.rsplit(":", 1)[1]))


@pytest.mark.timeout(600)
def test_short_devnet_survives_a_killed_worker(tmp_path):
    """--kill-worker-at with the default task set: worker 0 is SIGKILLed at step 2 and restarted on
    its data directory; the run completes its steps and keeps evaluating held-out."""
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "node", "devnet", "--steps", "4", "--workers", "1", "--relays", "1", "--validators", "1",
         "--kill-worker-at", "2", "--eval-every", "2", "--eval-samples", "4", "--out", str(out), "--no-dashboard", "--timeout", "400"],
        capture_output=True, text=True, timeout=460,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = (out / "report.md").read_text()
    assert "killed worker-0 at step" in report and "restarted worker-0" in report
    # the summary names the kill and the restart, and what the restarted worker did with its spool,
    # as its one "restart:" log line says (or that the spool was empty)
    chaos = next(line for line in r.stdout.splitlines() if line.startswith("chaos: "))
    assert re.search(r"worker-0 killed \(SIGKILL\) at step \d+ and restarted at step \d+; ", chaos), chaos
    log = (out / "logs" / "worker-0.log").read_text(errors="replace")
    restart = re.findall(r"restart: found (\d+) spooled submissions; re-sending (\d+) .*dropping (\d+) already stale", log)
    if restart:
        found, resent, dropped = restart[-1]
        assert f"of {found} spooled submissions it re-sent {resent} and dropped {dropped}" in chaos, (chaos, restart)
    else:
        assert "its spool was empty" in chaos, chaos
    assert "## Crash and restart" in report
    rows = [json.loads(line) for line in (out / "coordinator" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row.get("event") == "step"] == [1, 2, 3, 4]
    assert [row["step"] for row in rows if row.get("event") == "eval"] == [0, 2, 4]
    worker_line = next(line for line in report.splitlines() if line.startswith("| worker-0 |"))
    assert int(worker_line.split("|")[6]) > 0


@pytest.mark.timeout(900)
def test_main_command_runs_twice_in_one_folder(tmp_path):
    """The README's main command (no --out) twice in one folder, shortened by flags: each run gets its
    own folder under devnet-out/ (latest points at the newest), a chaos example's folder there is
    kept, and the summary line names the run ID and the seed (also in report.md)."""
    from node.devnet.outdir import write_marker

    crash = tmp_path / "devnet-out" / "crash"
    crash.mkdir(parents=True)
    write_marker(crash, {"seed": 1})
    (crash / "report.md").write_text("an earlier --kill-worker-at run")
    cmd = [sys.executable, "-m", "node", "devnet", "--steps", "1", "--workers", "1", "--relays", "0", "--eval-samples", "1",
           "--no-dashboard", "--timeout", "300"]
    seen = []
    for extra in (["--seed", "7"], []):
        r = subprocess.run(cmd + extra, cwd=tmp_path, capture_output=True, text=True, timeout=360, check=False)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        m = re.search(r"^devnet completed 1 of 1 steps in \d+ s \(run ([0-9a-f]{16}), seed (\d+)\)$", r.stdout, re.MULTILINE)
        assert m, r.stdout[-2000:]
        report = re.search(r"^report: (\S+/report\.md) and", r.stdout, re.MULTILINE).group(1)
        seen.append((m.group(1), m.group(2), report))
    (run1, seed1, report1), (run2, _, report2) = seen
    assert seed1 == "7" and run1 != run2 and report1 != report2
    for run_id, seed, report in seen:
        text = Path(report).read_text()
        assert f"run ID `{run_id}" in text and f"seed **{seed}**" in text
        assert re.search(rf"^seed = {seed}$", (Path(report).parent / "run.toml").read_text(), re.MULTILINE)
    latest = tmp_path / "devnet-out" / "latest"
    assert (latest / "report.md").resolve() == Path(report2).resolve()
    assert (crash / "report.md").read_text() == "an earlier --kill-worker-at run"
