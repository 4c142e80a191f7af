"""The run's base model: step 0 of the policy."""

from __future__ import annotations

import hashlib
import logging
import os
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

EMBEDDED_WARM_START = WarmStartConfig(steps=600, batch_size=64, learning_rate=3e-3, seed=0)
"""Supervised steps on the training problems' answers (never the held-out ones) after which the
embedded model answers 58 % of the held-out additions right when decoding greedily and about a
quarter of its samples at the devnet's temperature: it has part of the skill, not reliably, so
GRPO groups are mixed and RL has room to raise the held-out pass rate (``docs/devnet.md``)."""
EMBEDDED_INIT_SEED = 0
"""Weight-initialisation seed of the embedded base: fixed (not the run seed), so every devnet on a
machine shares one cached warm start and seeds vary only the RL run."""
BASE_CACHE_VERSION = "2"
"""Part of the machine-wide cache key: bump when the embedded model, tokenizer or warm start changes."""


def base_cache_root() -> Path:
    """The machine-wide cache of warm-started embedded bases: ``$INTELLECT_CACHE``, else
    ``$XDG_CACHE_HOME/intellect-node``, else ``~/.cache/intellect-node``; ``bases/`` under it."""
    root = os.environ.get("INTELLECT_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "intellect-node")
    return Path(root) / "bases"


def prepare_base(spec: RunSpec, tasks: RunTasks, cache_dir: Path) -> Path:
    """Directory of the base policy (config, safetensors, tokenizer), created once and cached.

    ``model.base = "embedded"``: a tiny Qwen2 with the character tokenizer, warm-started on the
    training tasks' ground truths (:data:`EMBEDDED_WARM_START`, real task sets:
    :data:`REAL_TASKS_WARM_START`), built once per machine in :func:`base_cache_root` (keyed by
    the task hash, hidden size, warm start and :data:`BASE_CACHE_VERSION`) and copied to
    ``cache_dir``. Otherwise ``model.base`` is a local model directory.

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
    embedded = spec.data.tasks == "embedded"
    config = EMBEDDED_WARM_START if embedded else REAL_TASKS_WARM_START
    key = hashlib.sha256(f"{BASE_CACHE_VERSION}|{spec.model.hidden_size}|{EMBEDDED_INIT_SEED}|{config}|{tasks.hash}".encode()).hexdigest()[:16]
    name = f"embedded-h{spec.model.hidden_size}-{key}"
    out = Path(cache_dir) / name
    if (out / "model.safetensors").exists():
        return out
    shared = base_cache_root() / name
    if not (shared / "model.safetensors").exists():
        _warm_start_base(spec, tasks, shared, embedded, config)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shared, tmp)
    try:
        tmp.replace(out)
    except OSError:  # another process of this node made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _warm_start_base(spec: RunSpec, tasks: RunTasks, out: Path, embedded: bool, config: WarmStartConfig) -> None:
    """Build and warm-start the embedded base into ``out`` (written under a temporary name, then renamed)."""
    tok = embedded_tokenizer()
    model = build_model(embedded_config(len(tok), hidden_size=spec.model.hidden_size), seed=EMBEDDED_INIT_SEED)
    if embedded:
        examples = answer_examples(tok, [t.prompt for t in tasks.train], [t.ground_truth for t in tasks.train])
    else:
        math = [t for t in tasks.train if t.task_type == "verifiable_math"][:2000]
        prompts = [t.prompt[-REAL_TASKS_PROMPT_TAIL_CHARS:] for t in math] or ["def f():"]
        answers = [t.ground_truth for t in math] or ["```python\npass\n```"]
        examples = answer_examples(tok, prompts, answers)
    losses = warm_start(model, examples, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tok, tmp)
    try:
        tmp.replace(out)
    except OSError:  # another process finished the same base first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("embedded base model warm-started (%d steps, loss %.3f → %.3f) in %s", len(losses), losses[0], losses[-1], out)
