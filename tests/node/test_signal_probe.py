"""The coordinator's start-up probe: a run whose groups can never differ in reward is named at once,
with what to change."""

from __future__ import annotations

import pytest
import torch

from node.coordinator.probe import probe_learning_signal
from node.engine.base import Generation
from protocol.embedded import embedded_tasks
from protocol.identity import NodeKey
from protocol.models import embedded_tokenizer
from protocol.runspec import RLSpec, RunInfo, RunSpec, SamplingSpec


class FixedLengthEngine:
    """Completions of ``lengths[i % len(lengths)]`` non-EOS tokens (never the right answer)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def generate(self, prompts, seeds, params):  # noqa: ANN001
        out = []
        for i, _ in enumerate(prompts):
            n = min(self.lengths[i % len(self.lengths)], params.max_tokens)
            ids = torch.full((n,), 10, dtype=torch.int64)
            out.append(Generation(ids, torch.zeros(n), torch.zeros(n, 128, dtype=torch.bfloat16), "length"))
        return out


def spec(**sampling) -> RunSpec:
    return RunSpec(run=RunInfo(coordinator=NodeKey.generate().peer_id), rl=RLSpec(group_size=4), sampling=SamplingSpec(**sampling))


def test_no_spread_without_length_penalty_warns_with_the_fix():
    s = spec(max_tokens=8)
    probe = probe_learning_signal(s, FixedLengthEngine([8]), embedded_tokenizer(), embedded_tasks()[:40], n_tasks=3)
    assert (probe.groups, probe.groups_with_spread, probe.pass_rate, probe.capped_fraction) == (3, 0, 0.0, 1.0)
    assert probe.warning is not None and "\n" not in probe.warning
    for hint in ("no learning signal", "--length-penalty", "easier tasks", "raise --max-tokens"):
        assert hint in probe.warning, hint


def test_length_penalty_with_varied_lengths_gives_signal():
    s = spec(max_tokens=16, length_penalty=0.01, target_lengths=[4])
    probe = probe_learning_signal(s, FixedLengthEngine([2, 5, 9, 16]), embedded_tokenizer(), embedded_tasks()[:40], n_tasks=2)
    assert probe.groups_with_spread == 2 and probe.warning is None
    assert probe.mean_tokens == (2 + 5 + 9 + 16) / 4


@pytest.mark.integration
def test_coordinator_warns_at_start_when_the_run_cannot_learn(tmp_path, shared):
    """The issue's run: an own model that never solves gsm8k, no length penalty. The coordinator
    says so in one log line at start, with what to change, not only after its batch timeout."""
    import subprocess
    import sys

    from local_model import build_local_model

    model = build_local_model(tmp_path / "my-qwen2", shared / "data")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)

    assert cli("keygen", "--key", "coord.key").returncode == 0
    r = cli("spec", "init", "--coordinator-key", "coord.key", "--out", "run.toml", "--model-base", str(model), "--tasks", "gsm8k_train",
            "--data-root", str(shared / "data"), "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "node.train_cli", "--run", "run.toml", "--key", "coord.key", "--data-dir", "coord",
                        "--data-root", str(shared / "data"), "--no-gossip", "--eval-samples", "0", "--probe-tasks", "2", "--batch-timeout", "1"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]  # gave up waiting for a batch, as asked
    warning = next(line for line in r.stdout.splitlines() + r.stderr.splitlines() if "no learning signal" in line)
    assert "--length-penalty" in warning and "easier tasks" in warning
