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
    for hint in ("no learning signal", "easier tasks", "spec init --max-tokens 32", "does not end its answers", "instruction-tuned",
                 "new run"):
        assert hint in probe.warning, hint
    assert "--length-penalty" not in probe.warning  # completions of one length: a length reward cannot tell them apart


def test_advice_never_names_what_the_run_already_uses():
    """The issue's run: gsm8k_train, a length penalty, max_tokens 1024 (the guide's), every completion at
    the cap. The advice named gsm8k_train as the easier set and said to raise --max-tokens again."""
    from node.coordinator.probe import no_signal_advice

    s = RunSpec(run=RunInfo(coordinator=NodeKey.generate().peer_id), data={"tasks": "gsm8k_train"},
                sampling=SamplingSpec(max_tokens=1024, length_penalty=0.0003, target_lengths=[512, 1024]))
    advice = no_signal_advice(s, pass_rate=0.0, capped_fraction=1.0)
    assert "'gsm8k_train')" not in advice and "max-tokens" not in advice, advice
    assert "does not end its answers" in advice and "instruction-tuned" in advice and "docs/tasks.md" in advice
    assert "spec init" in advice and "new run" in advice
    harder = no_signal_advice(s.model_copy(update={"data": s.data.model_copy(update={"tasks": "math_train"})}), 0.0, 0.5)
    assert "data.tasks = 'gsm8k_train'" in harder and "max_tokens" not in harder, harder  # an easier public set than math_train


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
    assert "easier tasks" in warning and "new run" in warning
