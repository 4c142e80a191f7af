"""``doctor``'s machine fit: will the run's model fit this machine as a worker, and which model
profiles would (a table: this GPU, CPU-only). The arithmetic is :mod:`node.engine.fit`; the
machine's numbers come from :mod:`node.machine` (``nvidia-smi``, no torch imported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from node.engine.fit import QWEN25_SHAPES, EnginePlan, Machine, ModelShape, Workload, gib, plan_engine, smallest_machine

if TYPE_CHECKING:
    from node.commands.doctor import Check
    from protocol.runspec import RunSpec

DOCTOR_PROMPT_TOKENS = 512
"""Prompt length ``doctor`` plans with, tokens (it has no tokenizer; a worker measures its task list's)."""
EMBEDDED_CONFIG = Path(__file__).resolve().parents[1] / "coordinator" / "embedded_base" / "config.json"
"""The shipped embedded base's ``config.json`` (``node.coordinator.base.EMBEDDED_BASE_DIR``, which imports torch: doctor does not)."""


def run_shape(spec: RunSpec, data_dir: Path) -> ModelShape | None:
    """The run's model shape, where this machine can tell it: the embedded base (shipped), a local
    base directory, or a policy step this node already holds (``<data dir>/checkpoints/step-N``).
    ``None`` before a remote run's first step is fetched."""
    if spec.model.base == "embedded":
        config = json.loads(EMBEDDED_CONFIG.read_text())
        h = spec.model.hidden_size
        config.update(hidden_size=h, intermediate_size=2 * h, head_dim=h // config["num_attention_heads"])  # protocol.models.embedded_config
        return ModelShape.from_config(config, name="embedded")
    candidates = [Path(spec.model.base) / "config.json", *sorted(Path(data_dir).glob("checkpoints/step-*/config.json"))]
    for path in candidates:
        try:
            return ModelShape.from_config(json.loads(path.read_text()), name="this run's model")
        except (OSError, ValueError):
            continue
    return None


def run_workload(spec: RunSpec, shape: ModelShape | None = None) -> Workload:
    """One submission of the run (tasks per submission × group size; :data:`DOCTOR_PROMPT_TOKENS`,
    less where the model's positions are fewer)."""
    completion = spec.sampling.max_tokens
    prompt = DOCTOR_PROMPT_TOKENS if shape is None else max(1, min(DOCTOR_PROMPT_TOKENS, shape.max_positions - completion))
    return Workload(spec.data.tasks_per_submission * spec.rl.group_size, prompt, completion)


@dataclass(frozen=True)
class FitRow:
    """One profile in the table: its GPU plan (vLLM, bf16; ``None`` without a GPU) and CPU plan (transformers, float32)."""

    shape: ModelShape
    gpu: EnginePlan | None
    cpu: EnginePlan


def fit_rows(shapes: list[ModelShape], machine: Machine, work_of: dict[str, Workload] | Workload) -> list[FitRow]:
    """Plan every shape on ``machine``'s GPU (vLLM) and on its CPU alone (transformers)."""
    rows = []
    for shape in shapes:
        work = work_of if isinstance(work_of, Workload) else work_of[shape.name]
        gpu = plan_engine(shape, machine, work, engine="vllm", device="cuda") if machine.has_gpu else None
        rows.append(FitRow(shape, gpu, plan_engine(shape, machine, work, engine="transformers", device="cpu")))
    return rows


def _cell(plan: EnginePlan | None) -> str:
    if plan is None:
        return "no GPU"
    if not plan.fits:
        return f"no: needs {gib(plan.min_bytes)}" if plan.min_bytes else "no: sequence too long"
    share = f"share {plan.memory_share:.2f}, " if plan.memory_share is not None else ""
    return f"yes: {share}batch {plan.max_batch}"


def fit_table(rows: list[FitRow], machine: Machine, work: Workload) -> str:
    """The table ``doctor`` prints: which profiles fit this machine (plain text, fixed width)."""
    gpu_head = f"GPU {machine.gpu_name[:24]} ({gib(machine.gpu_free_bytes)} free), vLLM" if machine.has_gpu else "GPU (none found)"
    cpu_head = f"CPU-only ({gib(machine.host_available_bytes)} available), transformers"
    head = ("profile", "parameters", gpu_head, cpu_head)
    body = [(r.shape.name, f"{r.shape.parameters() / 1e9:.2f} B" if r.shape.parameters() >= 1e8 else f"{r.shape.parameters() / 1e6:.1f} M",
             _cell(r.gpu), _cell(r.cpu)) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
    lines = [(f"which profiles fit this machine as a worker ({work.sequences} sequences of {work.prompt_tokens} + "
              f"{work.completion_tokens} tokens per submission):")]
    for row in [head, *body]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def check_fit(spec: RunSpec, data_dir: Path, machine: Machine) -> tuple[Check, str]:
    """The ``machine fit`` check of a worker or validator, and the table to print under the checks.

    The check plans the run's model as a worker started with its defaults would (the transformers
    engine on the GPU when there is one, else on the CPU); the table plans the run's model and the
    Qwen2.5 profiles with vLLM on this GPU and with the transformers engine on the CPU alone.
    """
    from node.commands.doctor import Check

    shape = run_shape(spec, data_dir)
    work = run_workload(spec, shape)
    shapes = ([shape] if shape is not None else []) + list(QWEN25_SHAPES)
    works = {s.name: run_workload(spec, s) for s in shapes}
    table = fit_table(fit_rows(shapes, machine, works), machine, work)
    if shape is None:
        return Check("machine fit", "WARN", "the run's model is not on this machine yet, so its shape is unknown; the table below "
                     "shows the Qwen2.5 sizes", "the worker sizes itself when it has fetched policy step 0, and refuses if it cannot fit"), table
    device = "cuda" if machine.has_gpu else "cpu"
    plan = plan_engine(shape, machine, work, engine="transformers", device=device)
    if plan.fits:
        return Check("machine fit", "PASS", f"{shape.name}: {plan.line()}"), table
    if device == "cuda" and (vllm := plan_engine(shape, machine, work, engine="vllm", device="cuda")).fits:
        return Check("machine fit", "WARN", f"{shape.name}: the transformers engine does not fit ({plan.reason}); vLLM does: {vllm.line()}",
                     "join with --engine vllm (pip install -e '.[gpu]')"), table
    return Check("machine fit", "FAIL", f"{shape.name}: {plan.reason}",
                 f"the smallest machine that can: {smallest_machine(shape, work)}"), table
