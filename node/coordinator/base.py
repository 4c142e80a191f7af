"""The run's base model: step 0 of the policy.

Three kinds of base, by the run spec's ``model.base`` and ``data.tasks``:

* **the shipped embedded base** (``model.base = "embedded"`` on the embedded addition tasks at
  hidden size 128, the devnet's default): a complete model directory inside this package
  (:data:`EMBEDDED_BASE_DIR`), the output of ``scripts/build_embedded_base.py``, the same bytes on
  every machine and checked against :data:`EMBEDDED_BASE_HASH` before use. No warm start runs.
* **a warm-started embedded model** (any other task set or hidden size, or a run's own
  environment: on its reference completions, :data:`ENV_WARM_START`): built and warm-started
  here once per machine and cached (:func:`base_cache_root`). The warm start runs on one CPU
  thread so its arithmetic does not depend on the machine's core count.
* **a local model directory** (anything else), pinned by ``model.base_hash``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from protocol.dataset import RunTasks
from protocol.envs.tasks import row_answer
from protocol.models import (
    ModelLoadError,
    base_hash,
    build_model,
    check_base_hash,
    copy_model,
    embedded_config,
    embedded_tokenizer,
    save_model,
)
from protocol.runspec import RunSpec
from protocol.tasks import ENV_TASK_TYPE
from trainer.warmstart import WarmStartConfig, answer_examples, warm_start

logger = logging.getLogger(__name__)

REAL_TASKS_WARM_START = WarmStartConfig(steps=40, batch_size=16, learning_rate=3e-3, seed=0)
"""For public task sets the tiny embedded model cannot learn to solve them; a short warm start on
each task's final answer (prompt tail only, to stay cheap) teaches it to answer briefly and stop,
so completion lengths — and with the length penalty, rewards — vary within groups."""
REAL_TASKS_PROMPT_TAIL_CHARS = 96

EMBEDDED_WARM_START = WarmStartConfig(steps=600, batch_size=64, learning_rate=3e-3, seed=0)
"""Supervised steps on the training problems' answers (never the held-out ones) that made the
shipped embedded base (``scripts/build_embedded_base.py``): it has part of the addition skill, not
reliably, so GRPO groups are mixed and RL has room to raise the held-out pass rate (``docs/devnet.md``)."""
ENV_WARM_START = WarmStartConfig(steps=600, batch_size=64, learning_rate=3e-3, seed=0)
"""A run's own environment on the embedded model: the shipped base's warm start, on the training
tasks' reference completions (``protocol.envs.row_answer``: reasoning-gym's answer in the
environment's answer format), so the tiny model starts with part of the skill and GRPO groups are
mixed; with fewer steps where examples are longer (:data:`ENV_WARM_START_TOKENS`). An environment
whose rows carry no reference gets no warm start."""
ENV_WARM_START_TOKENS = 600 * 64 * 16
"""Tokens an environment's warm start trains on at most (the shipped base's: 600 steps of 64
additions of ≈ 8 tokens, twice over): steps = this / (64 × mean example length), 40 to 600. At
load 10 on 2 cores, 600 steps of 120-token examples did not finish in the devnet's 300 s start."""
EMBEDDED_INIT_SEED = 0
"""Weight-initialisation seed of every embedded base: fixed (not the run seed), so every devnet
starts from the same base and seeds vary only the RL run."""
EMBEDDED_HIDDEN_SIZE = 128
"""Hidden size of the shipped embedded base (TOPLOC's top-k)."""
EMBEDDED_BASE_DIR = Path(__file__).with_name("embedded_base")
"""The shipped embedded base: ``config.json``, ``model.safetensors`` (float32) and tokenizer files."""
EMBEDDED_BASE_HASH = "05100028dcd53dfad566f6190bf2082798a3101ed7e2f22c6ac9370703cf2733"
""":func:`protocol.models.base_hash` of :data:`EMBEDDED_BASE_DIR`, printed by ``scripts/build_embedded_base.py``."""
WARM_START_THREADS = 1
"""CPU threads of a warm start: a fixed count so the reduction order, and so the base, does not
depend on how many cores the machine has."""
BASE_CACHE_VERSION = "3"
"""Part of the machine-wide cache key: bump when the embedded model, tokenizer or warm start changes."""


def base_cache_root() -> Path:
    """The machine-wide cache of warm-started embedded bases: ``$INTELLECT_CACHE``, else
    ``$XDG_CACHE_HOME/intellect-node``, else ``~/.cache/intellect-node``; ``bases/`` under it."""
    root = os.environ.get("INTELLECT_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "intellect-node")
    return Path(root) / "bases"


def uses_shipped_base(spec: RunSpec) -> bool:
    """Whether the run's base is the shipped embedded base (embedded model and tasks, hidden 128)."""
    return spec.model.base == "embedded" and spec.data.tasks == "embedded" and spec.model.hidden_size == EMBEDDED_HIDDEN_SIZE


def prepare_base(spec: RunSpec, tasks: RunTasks, cache_dir: Path) -> Path:
    """Directory of the base policy (config, safetensors, tokenizer).

    ``model.base = "embedded"``: the shipped base (:func:`uses_shipped_base`, checked against
    :data:`EMBEDDED_BASE_HASH` and copied to ``cache_dir``), or else a tiny Qwen2 with the character
    tokenizer warm-started on the training tasks' ground truths (:data:`REAL_TASKS_WARM_START`, or
    :data:`EMBEDDED_WARM_START` at another hidden size), built once per machine in
    :func:`base_cache_root` (keyed by the task hash, hidden size, warm start and
    :data:`BASE_CACHE_VERSION`) and copied to ``cache_dir``. Otherwise ``model.base`` is a local
    model directory.

    Raises:
        FileNotFoundError: a non-embedded base directory that does not exist, or has no config.json.
        protocol.models.ModelLoadError: its files do not match the spec's ``model.base_hash``, or
            the shipped base's files do not match :data:`EMBEDDED_BASE_HASH`.
    """
    if spec.model.base != "embedded":
        path = Path(spec.model.base)
        if not path.is_dir():
            raise FileNotFoundError(f"model.base {path} does not exist (a local Qwen2 directory is required; no hub access)")
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.base {path} has no config.json (a local Qwen2 directory is required; no hub access)")
        check_base_hash(path, spec.model.base_hash)
        return path
    if uses_shipped_base(spec):
        return _cached_copy(Path(cache_dir) / f"embedded-h{EMBEDDED_HIDDEN_SIZE}-{EMBEDDED_BASE_HASH[:16]}", check_shipped_base)
    embedded = spec.data.tasks == "embedded"
    config = EMBEDDED_WARM_START if embedded else ENV_WARM_START if spec.env.name else REAL_TASKS_WARM_START
    key = hashlib.sha256(f"{BASE_CACHE_VERSION}|{spec.model.hidden_size}|{EMBEDDED_INIT_SEED}|{config}|{tasks.hash}".encode()).hexdigest()[:16]
    name = f"embedded-h{spec.model.hidden_size}-{key}"
    shared = base_cache_root() / name

    def machine_base() -> Path:
        if not (shared / "model.safetensors").exists():
            _publish_dir(shared, lambda tmp: warm_start_base(tasks, tmp, spec.model.hidden_size, embedded, config))
        return shared

    return _cached_copy(Path(cache_dir) / name, machine_base)


def check_shipped_base() -> Path:
    """:data:`EMBEDDED_BASE_DIR` after its hash check (the coordinator before use; ``doctor --role coordinator``).

    Raises:
        protocol.models.ModelLoadError: its files do not hash to :data:`EMBEDDED_BASE_HASH` (the message names the fix).
    """
    got = base_hash(EMBEDDED_BASE_DIR)
    if got != EMBEDDED_BASE_HASH:
        raise ModelLoadError(
            f"the shipped embedded base {EMBEDDED_BASE_DIR} hashes to {got[:16]}…, expected {EMBEDDED_BASE_HASH[:16]}…: "
            "its files were changed; reinstall the package or rebuild it with scripts/build_embedded_base.py"
        )
    return EMBEDDED_BASE_DIR


def _cached_copy(out: Path, source: Callable[[], Path]) -> Path:
    """``out``, made once as a byte-identical copy of the directory ``source()`` returns."""
    if (out / "model.safetensors").exists():
        return out
    src = source()
    _publish_dir(out, lambda tmp: copy_model(src, tmp))
    return out


def _publish_dir(out: Path, fill: Callable[[Path], object]) -> None:
    """Fill a temporary sibling of ``out`` with ``fill`` and rename it to ``out``; when another
    process of this machine made ``out`` first, keep theirs."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    fill(tmp)
    try:
        tmp.replace(out)
    except OSError:  # another process finished the same directory first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def warm_start_base(tasks: RunTasks, out: Path, hidden_size: int, embedded: bool, config: WarmStartConfig) -> list[float]:
    """Build the embedded Qwen2 (seed :data:`EMBEDDED_INIT_SEED`), warm-start it on ``tasks.train``'s
    ground truths on :data:`WARM_START_THREADS` CPU threads, and write it to ``out`` (float32).

    Args:
        tasks: the run's tasks; only the training tasks are used (never the held-out ones).
        out: the model directory to write (created).
        hidden_size: the model's hidden size (≥ 128, TOPLOC's top-k).
        embedded: the embedded addition tasks (whole prompts) rather than a public set (prompt
            tails of at most :data:`REAL_TASKS_PROMPT_TAIL_CHARS` characters of its math tasks).
        config: steps, batch size, learning rate and seed of the warm start.

    Returns:
        The loss of each warm-start step (nats per answer token).
    """
    tok = embedded_tokenizer()
    model = build_model(embedded_config(len(tok), hidden_size=hidden_size), seed=EMBEDDED_INIT_SEED)
    if embedded:
        examples = answer_examples(tok, [t.prompt for t in tasks.train], [t.ground_truth for t in tasks.train])
    elif any(t.task_type == ENV_TASK_TYPE for t in tasks.train):
        pairs = [(t.prompt[-REAL_TASKS_PROMPT_TAIL_CHARS:], a) for t in tasks.train if (a := row_answer(t)) is not None][:2000]
        examples = answer_examples(tok, [p for p, _ in pairs], [a for _, a in pairs])
        if examples:
            mean_len = sum(len(p) + len(a) for p, a in examples) / len(examples)
            steps = int(ENV_WARM_START_TOKENS / (config.batch_size * mean_len))
            config = replace(config, steps=max(40, min(config.steps, steps)))
    else:
        math = [t for t in tasks.train if t.task_type == "verifiable_math"][:2000]
        prompts = [t.prompt[-REAL_TASKS_PROMPT_TAIL_CHARS:] for t in math] or ["def f():"]
        answers = [t.ground_truth for t in math] or ["```python\npass\n```"]
        examples = answer_examples(tok, prompts, answers)
    if not examples:  # an environment without reference completions: the model as initialised
        save_model(model, tok, out)
        logger.info("embedded base model without a warm start (the tasks carry no reference answers) in %s", out)
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(WARM_START_THREADS)
    try:
        losses = warm_start(model, examples, config)
    finally:
        torch.set_num_threads(threads)
    save_model(model, tok, out)
    logger.info("embedded base model warm-started (%d steps, loss %.3f → %.3f) in %s", len(losses), losses[0], losses[-1], out)
    return losses
