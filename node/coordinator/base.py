"""The run's base model: step 0 of the policy."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from protocol.dataset import RunTasks
from protocol.models import build_model, check_base_hash, embedded_config, embedded_tokenizer, save_model
from protocol.runspec import RunSpec
from trainer.warmstart import WarmStartConfig, answer_examples, warm_start

logger = logging.getLogger(__name__)

REAL_TASKS_WARM_START = WarmStartConfig(steps=40, batch_size=16, learning_rate=3e-3, seed=0)
"""For public task sets the tiny embedded model cannot learn to solve them; a short warm start on
each task's final answer (prompt tail only, to stay cheap) teaches it to answer briefly and stop,
so completion lengths — and with the length penalty, rewards — vary within groups."""
REAL_TASKS_PROMPT_TAIL_CHARS = 96

EMBEDDED_WARM_START = WarmStartConfig(steps=150, batch_size=64, learning_rate=3e-3, seed=0)
"""Supervised steps on the training tasks' answers that make the embedded model solve about a
third of its held-out problems at the devnet's sampling temperature, so GRPO has signal."""


def prepare_base(spec: RunSpec, tasks: RunTasks, cache_dir: Path) -> Path:
    """Directory of the base policy (config, safetensors, tokenizer), created once and cached.

    ``model.base = "embedded"``: a tiny Qwen2 with the character tokenizer, warm-started on the
    training tasks' ground truths (:data:`EMBEDDED_WARM_START`), cached under ``cache_dir``
    keyed by the task hash and hidden size. Otherwise ``model.base`` is a local model directory.

    Raises:
        FileNotFoundError: a non-embedded base directory that does not exist.
        protocol.models.ModelLoadError: its files do not match the spec's ``model.base_hash``.
    """
    if spec.model.base != "embedded":
        path = Path(spec.model.base)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.base {path} has no config.json (a local Qwen2 directory is required; no hub access)")
        check_base_hash(path, spec.model.base_hash)
        return path
    out = Path(cache_dir) / f"embedded-h{spec.model.hidden_size}-s{spec.run.seed % (2**31)}-{tasks.hash[:12]}"
    if (out / "model.safetensors").exists():
        return out
    tok = embedded_tokenizer()
    model = build_model(embedded_config(len(tok), hidden_size=spec.model.hidden_size), seed=spec.run.seed % (2**31))
    if spec.data.tasks == "embedded":
        examples = answer_examples(tok, [t.prompt for t in tasks.train], [t.ground_truth for t in tasks.train])
        config = EMBEDDED_WARM_START
    else:
        math = [t for t in tasks.train if t.task_type == "verifiable_math"][:2000]
        prompts = [t.prompt[-REAL_TASKS_PROMPT_TAIL_CHARS:] for t in math] or ["def f():"]
        answers = [t.ground_truth for t in math] or ["```python\npass\n```"]
        examples = answer_examples(tok, prompts, answers)
        config = REAL_TASKS_WARM_START
    losses = warm_start(model, examples, config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tok, tmp)
    tmp.replace(out)
    logger.info("embedded base model warm-started (%d steps, loss %.3f → %.3f) in %s", len(losses), losses[0], losses[-1], out)
    return out
