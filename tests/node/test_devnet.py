"""The main job, shortened: every role as a process, discovery, publishing through relays,
validation, training, an adversary banned, a worker killed and restarted, and nothing left running
afterwards. Two devnets (the expensive part) serve the module's three tests."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


def _nobody_listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


@dataclass
class MainRun:
    """One run of the main command: its summary line's run ID and seed, its folder and its output."""

    run_id: str
    seed: str
    out: Path
    stdout: str


BASE = [sys.executable, "-m", "node", "devnet", "--workers", "1", "--validators", "1", "--eval-samples", "2", "--no-dashboard"]
ADVERSARY_RUN = ["--steps", "3", "--relays", "2", "--adversary", "inflated-reward", "--timeout", "240", "--seed", "7"]
"""Run 1: an inflated-reward adversary beside an honest worker, two relays, the default held-out interval."""
KILL_RUN = ["--steps", "4", "--relays", "1", "--kill-worker-at", "2", "--eval-every", "2", "--timeout", "400"]
"""Run 2 (random seed): worker 0 SIGKILLed at step 2 and restarted on its data directory."""


@pytest.fixture(scope="module")
def main_runs(tmp_path_factory) -> tuple[Path, MainRun, MainRun]:
    """The README's main command (no --out) twice in one folder, shortened by flags (``ADVERSARY_RUN``,
    then ``KILL_RUN``), beside a chaos example's folder made first; returns that folder and both runs."""
    from node.devnet.outdir import write_marker

    cwd = tmp_path_factory.mktemp("main")
    crash = cwd / "devnet-out" / "crash"
    crash.mkdir(parents=True)
    write_marker(crash, {"seed": 1})
    (crash / "report.md").write_text("an earlier --kill-worker-at run")
    runs = []
    for flags in (ADVERSARY_RUN, KILL_RUN):
        r = subprocess.run(BASE + flags, cwd=cwd, capture_output=True, text=True, timeout=460, check=False)
        # the time budget is the devnet's own --timeout: past it the devnet fails (non-zero exit)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        m = re.search(r"^devnet completed (\d+) of \1 steps in \d+ s \(run ([0-9a-f]{16}), seed (\d+)\)$", r.stdout, re.MULTILINE)
        assert m, r.stdout[-2000:]
        report = re.search(r"^report: (\S+/report\.md) and", r.stdout, re.MULTILINE).group(1)
        runs.append(MainRun(m.group(2), m.group(3), Path(report).parent, r.stdout))
    return cwd, runs[0], runs[1]


@pytest.mark.timeout(900)
def test_short_devnet_with_adversary(main_runs):
    _, run, _ = main_runs
    out = run.out
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


@pytest.mark.timeout(900)
def test_short_devnet_survives_a_killed_worker(main_runs):
    """--kill-worker-at with the default task set: worker 0 is SIGKILLed at step 2 and restarted on
    its data directory; the run completes its steps and keeps evaluating held-out."""
    _, _, run = main_runs
    out = run.out
    report = (out / "report.md").read_text()
    assert "killed worker-0 at step" in report and "restarted worker-0" in report
    # the summary names the kill and the restart, and what the restarted worker did with its spool,
    # as its one "restart:" log line says (or that the spool was empty)
    chaos = next(line for line in run.stdout.splitlines() if line.startswith("chaos: "))
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
def test_main_command_runs_twice_in_one_folder(main_runs):
    """The README's main command (no --out) twice in one folder: each run gets its own folder under
    devnet-out/ (latest points at the newest), a chaos example's folder there is kept, and the
    summary line names the run ID and the seed (also in report.md)."""
    cwd, run1, run2 = main_runs
    assert run1.seed == "7" and run1.run_id != run2.run_id and run1.out != run2.out
    for run in (run1, run2):
        assert run.out.parent == (cwd / "devnet-out").resolve()
        text = (run.out / "report.md").read_text()
        assert f"run ID `{run.run_id}" in text and f"seed **{run.seed}**" in text
        assert re.search(rf"^seed = {run.seed}$", (run.out / "run.toml").read_text(), re.MULTILINE)
    latest = cwd / "devnet-out" / "latest"
    assert (latest / "report.md").resolve() == (run2.out / "report.md").resolve()
    crash = cwd / "devnet-out" / "crash"
    assert (crash / "report.md").read_text() == "an earlier --kill-worker-at run"
