"""The main job, shortened: every role as a process, discovery, publishing through relays,
validation, training, an adversary banned, a worker killed and restarted, the run page and node
pages in a browser and ``doctor`` against the live run, and nothing left running afterwards.

One devnet (the expensive part) serves every test that only watches a run: the README's main
command (no ``--out``) with two honest workers, a reward-inflating adversary, two relays and a
validator, worker 0 SIGKILLed at step 2 and restarted (``MAIN_RUN``). While it runs, the first test
looks at it from outside; the others read what it left. A second, minimal run of the main command in
the same folder (``SECOND_RUN``, started once the first has its folder, beside it) gives the folder
its second run.
The tests run in file order, on one pytest-xdist worker (``--dist loadscope``: a module is the unit).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from browser_checks import LiveDevnet, check_doctor, check_node_pages, check_run_page, start_browser
from localnet import SHARED_PROCESSES, get_json
from waiting import wait_for

pytestmark = pytest.mark.integration

BASE = [sys.executable, "-m", "node", "devnet", "--validators", "1", "--eval-samples", "1", "--no-dashboard"]
STEPS = 60
"""Steps of the main run: enough that it usually still trains while the first test looks at it (doctor,
then the browser: ≈ 42 s on the idle 2-core machine, where 30 steps took ≈ 43 s after step 1). The
look does not depend on it: doctor and the page's advancing policy step need the run alive and say
so if it ended first; the leaderboard and console checks accept a run that ended under them (CI,
7 Dec 2026: the run page check took 61 s and the run ended under it). Held-out evaluations at the
default interval, ceil(60 / 6) = 10."""
EVAL_EVERY = -(-STEPS // 6)
KILL_AT = 2
MAIN_RUN = ["--steps", str(STEPS), "--workers", "2", "--relays", "2", "--adversary", "inflated-reward", "--kill-worker-at", str(KILL_AT),
            "--seed", "7", "--timeout", "600"]
"""The watched run: two honest workers, an inflated-reward adversary, two relays; worker 0 SIGKILLed at step 2 and restarted on its data directory."""
SECOND_RUN = ["--steps", "1", "--workers", "1", "--relays", "0", "--timeout", "400"]
"""The main command again in the same folder (random seed): its own folder, ``latest`` pointing at it."""
LIVE_TIMEOUT_S = 300.0


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


class Runs:
    """The module's two runs of the main command in one folder ``cwd``: started, watched, finished."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, flags: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        console = self.cwd.parent / f"console-{len(self.procs)}.txt"
        with console.open("wb") as sink:
            proc = subprocess.Popen(BASE + flags, cwd=self.cwd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
        SHARED_PROCESSES.add(proc.pid)  # it outlives the test that started it (the reaper spares it)
        self.procs.append((proc, console))
        return proc, console

    def finish(self, i: int, timeout_s: float) -> MainRun:
        """Wait for run ``i`` to exit (its own ``--timeout`` bounds it) and read its summary line."""
        proc, console = self.procs[i]
        proc.wait(timeout=timeout_s)
        stdout = console.read_text(errors="replace")
        # the time budget is the devnet's own --timeout: past it the devnet fails (non-zero exit)
        assert proc.returncode == 0, stdout[-4000:]
        m = re.search(r"^devnet completed (\d+) of \1 steps in \d+ s \(run ([0-9a-f]{16}), seed (\d+)\)$", stdout, re.MULTILINE)
        assert m, stdout[-2000:]
        report = re.search(r"^report: (\S+/report\.md) and", stdout, re.MULTILINE).group(1)
        return MainRun(m.group(2), m.group(3), Path(report).parent, stdout)

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            SHARED_PROCESSES.discard(proc.pid)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the devnet stops every child it started
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[Runs]:
    """A chaos example's folder made first in ``devnet-out/``, then the main run started there."""
    from node.devnet.outdir import write_marker

    cwd = tmp_path_factory.mktemp("main") / "cwd"
    crash = cwd / "devnet-out" / "crash"
    crash.mkdir(parents=True)
    write_marker(crash, {"seed": 1})
    (crash / "report.md").write_text("an earlier --kill-worker-at run")
    r = Runs(cwd)
    try:
        r.start(MAIN_RUN)
        yield r
    finally:
        r.stop_all()


@pytest.fixture(scope="module")
def live(runs: Runs) -> LiveDevnet:
    """The main run once it has its folder and spec (then the second run starts: its folder is the
    newest), every role on gossip and the first step trained."""
    proc, console = runs.procs[0]
    latest = runs.cwd / "devnet-out" / "latest"
    spec = wait_for(lambda: (latest / "run.toml").is_file() and re.search(r"http://127\.0\.0\.1:\d+", (latest / "run.toml").read_text()),
                    120, "the main run's spec", proc)
    out, url = latest.resolve(), spec.group(0)
    runs.start(SECOND_RUN)

    def ready() -> bool:
        doc = get_json(f"{url}/api/run") or {}
        return doc.get("trainer", {}).get("step", 0) >= 1 and len(doc.get("nodes", [])) >= 7

    wait_for(ready, LIVE_TIMEOUT_S, f"step 1 and all nodes (console: {console})", proc)
    return LiveDevnet(out, url, proc)


@pytest.fixture(scope="module")
def main_runs(runs: Runs, live: LiveDevnet) -> tuple[Path, MainRun, MainRun]:
    """Both runs finished: the folder and each run's summary."""
    main = runs.finish(0, 900)
    assert main.out == live.out
    return runs.cwd, main, runs.finish(1, 600)


@pytest.mark.timeout(900)
def test_live_devnet_doctor_node_pages_and_run_page(live: LiveDevnet, tmp_path: Path) -> None:
    """While the run trains: doctor all PASS, then (worker 0 back from its kill) the node pages and the
    run page in headless Chromium (skipped with the reason when no browser is installed)."""
    t0 = time.monotonic()

    def step() -> int:
        return (get_json(f"{live.url}/status") or {}).get("trainer_step", -1)

    def restarted() -> bool:
        return (live.out / "logs" / "worker-0.log").read_text(errors="replace").count("started; status") >= 2

    print(f"live checks start at step {step()}")
    check_doctor(live, tmp_path)
    print(f"{time.monotonic() - t0:.0f}s doctor done at step {step()}")
    wait_for(restarted, LIVE_TIMEOUT_S, "worker-0 restarted after its kill", live.proc)
    browser = start_browser()
    try:
        check_node_pages(live, browser)
        print(f"{time.monotonic() - t0:.0f}s node pages done at step {step()}")
        check_run_page(live, browser)
        print(f"{time.monotonic() - t0:.0f}s run page done at step {step()}")
    finally:
        browser.quit()


@pytest.mark.timeout(900)
def test_short_devnet_with_adversary(main_runs):
    _, run, _ = main_runs
    out = run.out
    report = (out / "report.md").read_text()
    assert (out / "report.png").stat().st_size > 10_000
    # the policy steps published and fetched through the relays
    rows = [json.loads(line) for line in (out / "coordinator" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("event") == "step"]
    assert len(steps) == STEPS
    spec = (out / "run.toml").read_text()
    coord_url = re.search(r"ingest_urls = \[\s*\"(http://127.0.0.1:\d+)\"", spec).group(1)
    relay_urls = {u for name in ("relay-0", "relay-1") for u in re.findall(r"serving (http://127\.0\.0\.1:\d+)", (out / "logs" / f"{name}.log").read_text())}
    fetches = re.findall(r"fetched policy step (\d+) in [\d.]+ s from \[(.*?)\]", (out / "logs" / "worker-0.log").read_text())
    assert any(int(step) >= 1 for step, _ in fetches), fetches
    # workers prefer relays that hold the step over the origin: later steps came through relays
    assert any(url in srcs for _, srcs in fetches for url in relay_urls), (fetches, relay_urls, coord_url)
    # held-out evaluation at the start, at the default interval ceil(60 / 6) = 10 and at the end, not twice there
    evals = [row for row in rows if row.get("event") == "eval"]
    assert [e["step"] for e in evals] == [*range(0, STEPS, EVAL_EVERY), STEPS]
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
    for name in ("worker-0", "worker-1"):
        worker_line = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        assert int(worker_line.split("|")[6]) > 0  # the honest workers' rollouts were trained on
    # nothing left: no process mentions the out dir, the coordinator's port is free again
    def left() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]

    wait_for(lambda: not left(), 10.0, f"the run's processes to be reaped: {left()}")  # exiting children may take a moment
    assert _nobody_listens(int(coord_url.rsplit(":", 1)[1]))


@pytest.mark.timeout(900)
def test_short_devnet_survives_a_killed_worker(main_runs):
    """--kill-worker-at with the default task set: worker 0 is SIGKILLed at step 2 and restarted on
    its data directory; the run completes its steps and keeps evaluating held-out."""
    _, run, _ = main_runs
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
    assert [row["step"] for row in rows if row.get("event") == "step"] == list(range(1, STEPS + 1))
    assert [row["step"] for row in rows if row.get("event") == "eval"] == [*range(0, STEPS, EVAL_EVERY), STEPS]
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
