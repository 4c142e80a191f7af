"""`intellect-train` under `torchrun --nproc-per-node 2` (gloo) runs the same loop on both ranks and
publishes the weights a 1-process run publishes, on a public task set (GSM8K train) from shared/.

The test is the worker and the validator: it posts signed submissions and accepting verdicts over
HTTP, one submission per trainer step (each holds exactly the batch's groups), so both runs train
on the same batches in the same order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from local_model import build_local_model
from localnet import get_json, post
from safetensors.torch import load_file

from protocol.envelope import seal
from protocol.identity import NodeKey
from protocol.ingest_api import SUBMISSIONS_ROUTE, VERDICTS_ROUTE
from protocol.messages import Rollout, Submission, SubmissionTask, Verdict
from protocol.rollout import pack_f32, pack_u32
from protocol.runspec import (
    DataSpec,
    ModelSpec,
    NetworkSpec,
    RLSpec,
    RunInfo,
    RunSpec,
    SamplingSpec,
    dump_run_spec,
    sign_run_spec,
)

pytestmark = pytest.mark.integration

STEPS = 2
GROUP_SIZE = 4
GROUPS = 2
VOCAB = 4096


def _submission(worker: NodeKey, spec: RunSpec, counter: int) -> bytes:
    """``GROUPS`` tasks × ``GROUP_SIZE`` rollouts with a reward spread (every group has advantages)."""
    rng = np.random.default_rng(counter)
    rollouts = []
    for t in range(GROUPS):
        prompt = rng.integers(3, VOCAB, size=12).tolist()
        for k in range(GROUP_SIZE):
            completion = rng.integers(3, VOCAB, size=6 + k).tolist()
            reward = float(k % 2)
            rollouts.append(Rollout(task=t, sample=k, seed=int(rng.integers(1 << 62)), prompt_ids=pack_u32(prompt),
                                    completion_ids=pack_u32(completion), logprobs=pack_f32([-8.0] * len(completion)), finish="length",
                                    task_reward=reward, reward=reward, proofs=[]))
    tasks = [SubmissionTask(task_index=counter * GROUPS + t, problem_id=f"p{counter}-{t}", target_length=0) for t in range(GROUPS)]
    return seal(worker, spec.run_id, Submission(worker=worker.peer_id, policy_step=0, counter=counter, tasks=tasks, rollouts=rollouts))


def _run(cmd: list[str], url: str, spec: RunSpec, worker: NodeKey, validator: NodeKey, log_path: Path) -> None:
    """Start the coordinator, feed one accepted submission per trainer step, wait for it to finish."""
    from protocol.envelope import open_envelope

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + 600
            for counter in range(STEPS):
                while (get_json(f"{url}/status") or {}).get("published_step", -1) < counter:  # policy `counter` out: feed the next step
                    assert proc.poll() is None, f"the coordinator exited ({proc.returncode}): {log_path.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, f"trainer step {counter} not reached: {log_path.read_text()[-3000:]}"
                    time.sleep(0.2)
                raw = _submission(worker, spec, counter)
                status, body = post(f"{url}{SUBMISSIONS_ROUTE}", raw, timeout_s=30)
                assert status == 200, body
                sub = open_envelope(raw, run_id=spec.run_id, expect=Submission)
                verdict = seal(validator, spec.run_id, Verdict(submission_id=sub.id, worker=worker.peer_id, policy_step=0, counter=counter,
                                                               accepted=True, reason="ok"))
                status, body = post(f"{url}{VERDICTS_ROUTE}", verdict, timeout_s=30)
                assert status == 200, body
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-3000:]


@pytest.mark.timeout(900)
def test_torchrun_two_gloo_ranks_publish_what_one_process_publishes(tmp_path: Path, shared: Path, held_port) -> None:
    coord, validator, worker = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    coord.save(tmp_path / "coord.key")
    base = build_local_model(tmp_path / "my-qwen2", shared / "data", vocab_size=VOCAB, dtype="float32", seed=3)
    results = {}
    for name, prefix in (("one", [sys.executable, "-m", "node.train_cli"]),
                         ("two", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                  "-m", "node.train_cli", "--"])):
        port = held_port()  # the signed spec names the coordinator's URL
        url = f"http://127.0.0.1:{port}"
        spec = RunSpec(
            run=RunInfo(coordinator=coord.peer_id, validators=[validator.peer_id], seed=5),
            model=ModelSpec(base=str(base), dtype="float32"),
            data=DataSpec(tasks="gsm8k_train", tasks_per_submission=GROUPS),
            sampling=SamplingSpec(max_tokens=8),
            rl=RLSpec(group_size=GROUP_SIZE, batch_groups=GROUPS, learning_rate=1e-3, warmup_steps=0, async_level=2),
            network=NetworkSpec(ingest_urls=[url], origin_urls=[url]),
        )
        run = tmp_path / f"run-{name}.toml"
        run.write_text(dump_run_spec(sign_run_spec(spec, coord)))
        data_dir = tmp_path / f"coord-{name}"
        cmd = [*prefix, "--run", str(run), "--key", str(tmp_path / "coord.key"), "--data-dir", str(data_dir), "--data-root",
               str(shared / "data"), "--http-port", str(port), "--no-gossip", "--max-steps", str(STEPS), "--eval-samples", "0",
               "--probe-tasks", "0", "--batch-timeout", "300", "-v"]
        _run(cmd, url, spec, worker, validator, tmp_path / f"{name}.log")
        results[name] = data_dir
    # both ranks built a trainer in one group of two (each logs it), the single process alone
    assert (tmp_path / "two.log").read_text().count("world size 2") == 2
    assert (tmp_path / "one.log").read_text().count("world size 1") == 1
    one = load_file(str(results["one"] / "policies" / f"step-{STEPS}" / "model.safetensors"))
    two = load_file(str(results["two"] / "policies" / f"step-{STEPS}" / "model.safetensors"))
    start = load_file(str(base / "model.safetensors"))
    assert set(one) == set(two) == set(start)
    # Two Adam steps move a weight by up to ~2 × lr. gloo sums the ranks' gradients in another order,
    # and Adam's normalisation magnifies that rounding where a gradient is near zero, so the runs
    # agree to a small fraction of the update, not bit for bit; a different batch or a rank that
    # skipped a step would differ by the size of the update itself.
    update = max(float((t - start[n].to(t.dtype)).abs().max()) for n, t in one.items())
    assert update > 1e-4, "no weight moved: the steps trained on nothing"
    for name, t in one.items():
        torch.testing.assert_close(two[name], t, rtol=0, atol=0.025 * update, msg=name)
    for d in results.values():
        steps = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines() if '"event": "step"' in line]
        assert steps == list(range(1, STEPS + 1))
