"""The coordinator process: ingest → validator verdicts → GRPO steps → published policies,
killed with SIGKILL mid-run and resumed without losing an acknowledged rollout."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from localnet import get_json, post
from waiting import wait_for

from node.coordinator.base import prepare_base
from node.engine.hf import TransformersEngine
from node.errors import FetchError
from node.shardcast import fetch_checkpoint
from node.shardcast.download import DownloadConfig
from node.worker.rollouts import build_submission
from protocol import encoding
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope, seal
from protocol.identity import NodeKey
from protocol.ingest_api import LEASE_ROUTE, SUBMISSIONS_ROUTE, VERDICTS_ROUTE
from protocol.messages import LeaseRequest, Submission, Verdict
from protocol.models import load_tokenizer
from protocol.runspec import DataSpec, ModelSpec, NetworkSpec, RLSpec, RunInfo, RunSpec, SamplingSpec, dump_run_spec, sign_run_spec

pytestmark = pytest.mark.integration


FETCH = DownloadConfig(stall_timeout_s=5.0)
"""The test's worker fetches from one local coordinator that exits once it published its last step: a
fetch begun as it exits has its manifest but no pieces, and gives up after 5 s without a piece instead
of the default 60 s (the likely cause of one pass in which this test took 74 s instead of 16 s)."""


def test_train_kill_resume(tmp_path, held_port):
    coord, val, worker = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    coord.save(tmp_path / "coord.key")
    port = held_port()  # the signed spec names the coordinator's URL
    url = f"http://127.0.0.1:{port}"
    tasks = resolve_tasks("embedded")
    probe = RunSpec(run=RunInfo(coordinator=coord.peer_id))
    base = prepare_base(probe, tasks, tmp_path / "base-cache")
    spec = RunSpec(
        run=RunInfo(coordinator=coord.peer_id, validators=[val.peer_id], seed=3),
        model=ModelSpec(base=str(base)),
        data=DataSpec(tasks_per_submission=2),
        sampling=SamplingSpec(max_tokens=4, temperature=2.0),
        rl=RLSpec(group_size=8, batch_groups=2, learning_rate=1e-3, warmup_steps=0, async_level=1),
        network=NetworkSpec(ingest_urls=[url], origin_urls=[url]),
    )
    run = tmp_path / "run.toml"
    run.write_text(dump_run_spec(sign_run_spec(spec, coord)))
    data_dir = tmp_path / "coordinator"
    cmd = [sys.executable, "-m", "node.train_cli", "--run", str(run), "--key", str(tmp_path / "coord.key"), "--data-dir", str(data_dir),
           "--http-port", str(port), "--no-gossip", "--max-steps", "3", "--eval-samples", "0", "--batch-timeout", "120"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "coord.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tok = load_tokenizer(base)
    counter = [0]
    acked: list[str] = []

    def feed_one_step() -> None:
        """Act as worker (generate with the published policy) and validator (accept what is pending)."""
        st = get_json(f"{url}/status")
        if st is None:
            return
        step = st["published_step"]
        out = tmp_path / "w" / f"step-{step}"
        if not out.exists():
            try:
                asyncio.run(fetch_checkpoint([url], out, run_id=spec.run_id, authorities=spec.authorities, step=step, progress=False,
                                             config=FETCH))
            except FetchError:  # the coordinator finished meanwhile (the next call fetches again if it did not)
                shutil.rmtree(out, ignore_errors=True)
                return
        engine = TransformersEngine.from_dir(out)
        data = build_submission(spec, spec.run_id, worker, engine, tok, tasks.train, step, counter[0])
        counter[0] += 1
        status, body = post(f"{url}{SUBMISSIONS_ROUTE}", data)
        if status == 200:
            acked.append(json.loads(body)["id"])
        lease = seal(val, spec.run_id, LeaseRequest(limit=16, lease_s=30.0))
        status, body = post(f"{url}{LEASE_ROUTE}", lease)
        if status != 200:
            return
        for blob in encoding.unpackb(body, 1 << 28)["submissions"]:
            env_ = open_envelope(blob, run_id=spec.run_id, expect=Submission)
            v = seal(val, spec.run_id, Verdict(submission_id=env_.id, worker=env_.body.worker, policy_step=env_.body.policy_step,
                                                counter=env_.body.counter, accepted=True, reason="ok"))
            assert post(f"{url}{VERDICTS_ROUTE}", v)[0] in (0, 200)

    try:
        wait_for(lambda: get_json(f"{url}/status"), 120, "the coordinator's status", proc)
        wait_for(lambda: (feed_one_step(), (get_json(f"{url}/status") or {}).get("trainer_step", 0) >= 1)[1], 120, "trainer step 1", proc)
        # /status counts step 1 once it is trained; its state is written after its policy is published
        wait_for(lambda: (data_dir / "state" / "latest").exists(), 120, "trainer step 1's saved state", proc)
        # one more acknowledged submission that the killed process never trains on
        feed_one_step()
        stored_before = get_json(f"{url}/status")["submissions"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert (data_dir / "state" / "latest").exists()
        proc = subprocess.Popen([*cmd, "--resume"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # the resumed process may finish at once on the acknowledged rollouts it already holds
        wait_for(lambda: proc.poll() is not None or (feed_one_step(), False)[1], 180, "the resumed run to finish", None)
        assert proc.returncode == 0, (tmp_path / "coord.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    rows = [json.loads(line) for line in (data_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r.get("event") == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 3  # resumed from the saved step: no step trained twice
    from trainer.ledger import SubmissionStore

    store = SubmissionStore(data_dir / "ingest", spec.run_id)
    counts = store.counts()
    store.close()
    assert sum(counts[k] for k in ("pending", "accepted", "rejected")) >= sum(stored_before[k] for k in ("pending", "accepted", "rejected"))
    assert (Path(data_dir) / "policies" / "step-3" / "model.safetensors").exists()


@pytest.mark.timeout(600)
def test_waiting_is_logged_at_the_default_level_and_sigterm_stops_without_a_final_evaluation(tmp_path, held_port):
    """docs/operators.md §2 and §6: a wait for a batch longer than its logging interval (30 s by default;
    1 s here, ``--wait-log-every``) is logged with its reason at the default level; SIGTERM stops the
    coordinator at once (no final held-out evaluation, which on a CPU can take long), exit 0, the run
    page's final state written to the data directory."""
    from node.coordinator.role import WAIT_LOG_INTERVAL_S, CoordinatorOptions
    from node.train_cli import build_parser

    assert CoordinatorOptions(data_dir=tmp_path).wait_log_interval_s == WAIT_LOG_INTERVAL_S == 30.0  # the default: 30 s
    assert build_parser().parse_args(["--run", "r", "--key", "k"]).wait_log_every is None  # the CLI keeps it
    coord, val = NodeKey.generate(), NodeKey.generate()
    coord.save(tmp_path / "coord.key")
    port = held_port()  # the signed spec names the coordinator's URL
    url = f"http://127.0.0.1:{port}"
    base = prepare_base(RunSpec(run=RunInfo(coordinator=coord.peer_id)), resolve_tasks("embedded"), tmp_path / "base-cache")
    spec = RunSpec(run=RunInfo(coordinator=coord.peer_id, validators=[val.peer_id], seed=3), model=ModelSpec(base=str(base)),
                   sampling=SamplingSpec(max_tokens=4), network=NetworkSpec(ingest_urls=[url], origin_urls=[url]))
    run = tmp_path / "run.toml"
    run.write_text(dump_run_spec(sign_run_spec(spec, coord)))
    data_dir = tmp_path / "coordinator"
    log_path = tmp_path / "coord.log"
    with open(log_path, "ab") as log:  # no -v: the default log level
        proc = subprocess.Popen([sys.executable, "-m", "node.train_cli", "--run", str(run), "--key", str(tmp_path / "coord.key"),
                                 "--data-dir", str(data_dir), "--http-port", str(port), "--no-gossip", "--eval-samples", "1",
                                 "--probe-tasks", "0", "--wait-log-every", "1"], stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                start_new_session=True)
    try:
        wait_for(lambda: "for a batch for step 1" in log_path.read_text(errors="replace"), 300, "the batch-wait line", proc)
        line = next(x for x in log_path.read_text(errors="replace").splitlines() if "for a batch for step 1" in x)
        assert "WARNING" in line and "usable groups" in line, line
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "stop requested: no final held-out evaluation" in log_path.read_text(errors="replace")
    rows = [json.loads(x) for x in (data_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("event") == "eval"] == [0]  # the start evaluation only
    assert (data_dir / "run-page" / "index.html").is_file() and (data_dir / "run-page" / "snapshot.js").stat().st_size > 100
