"""Fit a worker's engine to its machine (pure: numbers in, a plan out; ``docs/operators.md`` §4.1).

From the model's shape (its ``config.json``: layers, hidden size, heads, vocabulary, dtype), the
run's workload (sequences per submission, prompt and completion tokens) and the machine's free
memory (the GPU's, from ``torch.cuda.mem_get_info``, or the host's on a CPU-only machine), it
chooses the engine's GPU memory share, its batch (sequences decoded at once) and its sequence
limit (prompt + completion tokens), or says that the model cannot fit and names the smallest
machine that can (:func:`smallest_machine`). ``node/machine.py`` measures the machine;
the worker and ``doctor`` call :func:`plan_engine`; tests pass made-up numbers.

Memory model, bytes (every term an upper estimate):

* weights: parameters × the engine's compute dtype (``join --dtype``; by default vLLM bfloat16 on
  CUDA, the transformers engine float32 everywhere, as validators compute), plus a float32 copy of
  the LM head for a bfloat16 engine with fp32 logits;
* KV cache: 2 (K and V) × layers × KV heads × head dim × dtype bytes per token, for every
  sequence of the batch at its full length;
* per sequence beyond the cache: float32 logits and the sampling rule's temporaries over the
  vocabulary (3 × V × 4), and the committed bf16 final-norm rows (completion × H × 2);
* prefill activations, 4 H + 2 I values per token prefilled at once: vLLM prefills in chunks of
  at most :data:`VLLM_PREFILL_TOKENS` tokens (a fixed cost); the transformers engine prefills the
  whole batch at once (a cost per sequence, its prompt's tokens);
* fixed: :data:`GPU_RESERVE_BYTES` on a GPU (CUDA context, cuBLAS workspace, allocator slack)
  or :data:`CPU_RESERVE_BYTES` on the host (interpreter, tokenizer, reward sandbox).

A GPU's budget is the share the engine may take of its total memory (vLLM's
``gpu_memory_utilization``), never more than what is free now minus :data:`GPU_HEADROOM_FRACTION`
of the total; chosen as what the plan needs plus :data:`SHARE_SLACK`, within
:data:`MAX_GPU_SHARE`. The host's budget is :data:`CPU_SHARE` of its available memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

GiB = 1 << 30
GPU_RESERVE_BYTES = 1 * GiB
CPU_RESERVE_BYTES = 1 * GiB
VLLM_PREFILL_TOKENS = 8192
"""Tokens vLLM prefills at once (its chunked-prefill budget, ``max_num_batched_tokens``, is at most this by default)."""
MAX_GPU_SHARE = 0.92
"""Largest share of a GPU's memory the engine is given (vLLM's own default is 0.9)."""
GPU_HEADROOM_FRACTION = 0.03
"""Share of the GPU's total memory left free beyond what other processes use now."""
SHARE_SLACK = 0.25
"""The share covers what the plan needs plus this fraction (more KV cache than the batch needs is
wasted on a worker, whose batch is one submission's sequences)."""
CPU_SHARE = 0.7
"""Share of the host's available memory a CPU worker plans to use."""
MAX_BATCH_GPU = 256
MAX_BATCH_CPU = 64
"""Most sequences decoded at once (on a CPU, more than this only adds latency)."""
MIN_BATCH = 1

Device = Literal["cuda", "cpu"]
EngineKind = Literal["transformers", "vllm"]


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Qwen2-architecture model (what its ``config.json`` says).

    Attributes:
        name: a label (a profile name or a path).
        layers, hidden, heads, kv_heads, head_dim, intermediate, vocab: the architecture.
        tied: whether the output head shares the embedding matrix.
        max_positions: the longest sequence the model takes, tokens.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    max_positions: int = 32768

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "") -> ModelShape:
        """Read a ``config.json`` mapping (transformers' Qwen2 keys).

        Raises:
            ValueError: a required key is missing or not a positive integer.
        """
        def need(key: str, default: int | None = None) -> int:
            v = config.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {v!r}")
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        return cls(name=name, layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
                   kv_heads=need("num_key_value_heads", heads), head_dim=need("head_dim", hidden // heads),
                   intermediate=need("intermediate_size"), vocab=need("vocab_size"),
                   tied=bool(config.get("tie_word_embeddings", True)), max_positions=need("max_position_embeddings", 32768))

    def parameters(self) -> int:
        """Parameter count (Qwen2: biases on q, k, v; the tied head counted once)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + q + 2 * (h * kv + kv) + q * h
        per_layer = attn + 3 * h * self.intermediate + 2 * h
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.layers * per_layer + h + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token of one sequence takes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Machine:
    """What a machine has free for a worker, bytes (``node/machine.py`` measures it).

    Attributes:
        gpu_name: the GPU's name (``""``: none).
        gpu_free_bytes: free memory on the GPU now.
        gpu_total_bytes: its total memory.
        host_available_bytes: the host's available memory (RAM).
    """

    gpu_name: str = ""
    gpu_free_bytes: int = 0
    gpu_total_bytes: int = 0
    host_available_bytes: int = 0

    @property
    def has_gpu(self) -> bool:
        return self.gpu_total_bytes > 0


@dataclass(frozen=True)
class Workload:
    """What one submission asks of the engine.

    Attributes:
        sequences: completions generated together (tasks per submission × group size).
        prompt_tokens: the longest prompt, tokens (with its template).
        completion_tokens: the completion limit (``sampling.max_tokens``), tokens.
    """

    sequences: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class EnginePlan:
    """The engine settings chosen for a machine, or why the model does not fit.

    Attributes:
        engine, device: what runs where.
        fits: whether the model and at least one sequence fit the budget.
        memory_share: share of the GPU's total memory given to the engine (``None`` on a CPU).
        max_batch: sequences decoded at once (0 when it does not fit).
        max_model_len: the sequence limit, prompt + completion tokens.
        budget_bytes: memory the plan may use.
        weights_bytes, kv_bytes, other_bytes: what it uses (KV cache for ``max_batch`` sequences;
            the rest: reserve, prefill activations, per-sequence buffers).
        reason: why it does not fit (``""`` when it does).
        min_bytes: what the weights and one sequence need (the least memory that fits).
    """

    engine: EngineKind
    device: Device
    fits: bool
    memory_share: float | None
    max_batch: int
    max_model_len: int
    budget_bytes: int
    weights_bytes: int
    kv_bytes: int
    other_bytes: int
    reason: str = ""
    min_bytes: int = 0

    def line(self) -> str:
        """What a worker prints at start: the choice and its arithmetic."""
        if not self.fits:
            return f"engine {self.engine} on {self.device} does not fit: {self.reason}"
        share = f"GPU memory share {self.memory_share:.2f}, " if self.memory_share is not None else ""
        used = self.weights_bytes + self.kv_bytes + self.other_bytes
        return (f"engine {self.engine} on {self.device}: {share}batch {self.max_batch} sequences, sequence limit "
                f"{self.max_model_len:,} tokens (plans {gib(used)} of a {gib(self.budget_bytes)} budget: weights "
                f"{gib(self.weights_bytes)}, KV cache {gib(self.kv_bytes)}, other {gib(self.other_bytes)})")


def gib(n: float) -> str:
    """Bytes as ``1.23 GiB`` (or MiB below 1 GiB)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.0f} MiB"


def _dtype_bytes(engine: EngineKind, device: Device, dtype: str | None = None) -> int:
    """Bytes per value of the engine's compute dtype: ``dtype`` (``join --dtype``) where given, else the
    engine's default (``node.engine.create_engine``: vLLM bfloat16 on CUDA, float32 otherwise)."""
    if dtype is not None:
        return 2 if dtype == "bfloat16" else 4
    return 2 if engine == "vllm" and device == "cuda" else 4


def _costs(shape: ModelShape, work: Workload, engine: EngineKind, device: Device, dtype: str | None = None,
           fp32_head: bool = False) -> tuple[int, int, int]:
    """``(weights, fixed other, per sequence)`` bytes of the memory model (module docstring)."""
    b = _dtype_bytes(engine, device, dtype)
    weights = shape.parameters() * b + (shape.vocab * shape.hidden * 4 if fp32_head and b != 4 else 0)
    reserve = GPU_RESERVE_BYTES if device == "cuda" else CPU_RESERVE_BYTES
    per_token = (4 * shape.hidden + 2 * shape.intermediate) * b  # activations of one prefilled token
    per_seq = work.sequence_tokens * shape.kv_bytes_per_token(b) + 3 * shape.vocab * 4 + work.completion_tokens * shape.hidden * 2
    if engine == "vllm":
        return weights, reserve + VLLM_PREFILL_TOKENS * per_token, per_seq
    return weights, reserve, per_seq + work.prompt_tokens * per_token


def needed_bytes(shape: ModelShape, work: Workload, engine: EngineKind, device: Device, batch: int = MIN_BATCH,
                 dtype: str | None = None) -> int:
    """Memory a plan with ``batch`` sequences needs, bytes (``dtype``: as :func:`plan_engine`'s)."""
    weights, fixed, per_seq = _costs(shape, work, engine, device, dtype)
    return weights + fixed + batch * per_seq


def plan_engine(shape: ModelShape, machine: Machine, work: Workload, *, engine: EngineKind = "transformers", device: Device = "cpu",
                memory_share: float | None = None, max_batch: int | None = None, dtype: str | None = None,
                fp32_head: bool = False) -> EnginePlan:
    """Choose the engine's memory share, batch and sequence limit for this machine.

    Args:
        shape: the model.
        machine: free memory now (:class:`Machine`).
        work: the run's submission (:class:`Workload`).
        engine, device: the engine and where it runs (``cuda`` needs ``machine.has_gpu``).
        memory_share: the operator's share of the GPU (``--gpu-memory-share``); ``None``: chosen.
        max_batch: the operator's batch cap (``--max-batch``); ``None``: chosen.
        dtype: the engine's compute dtype, ``float32`` or ``bfloat16`` (``join --dtype``); ``None``: the
            engine's default (vLLM bfloat16 on CUDA, float32 otherwise).
        fp32_head: a bfloat16 engine also holds a float32 copy of the LM head (``join --fp32-logits``).

    Returns:
        The :class:`EnginePlan` (``fits`` False with a reason when even one sequence does not fit).

    Raises:
        ValueError: ``device`` is ``cuda`` on a machine without a GPU, or a share outside (0, 1].
    """
    if device == "cuda" and not machine.has_gpu:
        raise ValueError("device cuda on a machine without a GPU")
    if memory_share is not None and not 0.0 < memory_share <= 1.0:
        raise ValueError(f"GPU memory share must be in (0, 1], got {memory_share}")
    seq_len = work.sequence_tokens
    weights, fixed, per_seq = _costs(shape, work, engine, device, dtype, fp32_head)
    kv_seq = seq_len * shape.kv_bytes_per_token(_dtype_bytes(engine, device, dtype))
    cap = max(MIN_BATCH, min(MAX_BATCH_GPU if device == "cuda" else MAX_BATCH_CPU, work.sequences, max_batch or work.sequences))
    share: float | None = None
    if device == "cuda":
        total = machine.gpu_total_bytes
        usable = max(0, machine.gpu_free_bytes - int(GPU_HEADROOM_FRACTION * total))
        if memory_share is not None:
            share = memory_share  # the operator's word (vLLM itself refuses at start when that much is not free)
        else:
            want = (weights + fixed + cap * per_seq) * (1 + SHARE_SLACK)
            share = min(math.floor(min(MAX_GPU_SHARE, usable / total) * 100) / 100, math.ceil(want / total * 100) / 100)
        budget = int(share * total)
    else:
        budget = int(CPU_SHARE * machine.host_available_bytes)

    if seq_len > shape.max_positions:
        why = f"the run's sequences of {seq_len:,} tokens exceed the model's {shape.max_positions:,} positions"
        return EnginePlan(engine, device, False, share, 0, seq_len, budget, weights, 0, fixed, why, weights + fixed + per_seq)
    if budget < weights + fixed + per_seq:
        where = (f"{gib(budget)} of GPU memory ({machine.gpu_name or 'GPU'}: {gib(machine.gpu_free_bytes)} free of {gib(machine.gpu_total_bytes)})"
                 if device == "cuda" else f"{gib(budget)} of host memory ({CPU_SHARE:.0%} of {gib(machine.host_available_bytes)} available)")
        why = f"{shape.name or 'the model'} needs {gib(weights + fixed + per_seq)} for its weights and one sequence, this machine gives {where}"
        return EnginePlan(engine, device, False, share, 0, seq_len, budget, weights, 0, fixed, why, weights + fixed + per_seq)
    batch = int(max(MIN_BATCH, min(cap, (budget - weights - fixed) // per_seq)))
    return EnginePlan(engine, device, True, share, batch, seq_len, budget, weights, batch * kv_seq, fixed + batch * (per_seq - kv_seq),
                      "", weights + fixed + per_seq)


@dataclass(frozen=True)
class GpuClass:
    """A GPU memory size contributors commonly have, and cards of that size."""

    memory_bytes: int
    examples: str


GPU_CLASSES: tuple[GpuClass, ...] = (
    GpuClass(8 * GiB, "RTX 3070, RTX 4060"),
    GpuClass(12 * GiB, "RTX 3060 12 GB, RTX 4070"),
    GpuClass(16 * GiB, "T4, RTX 4080, A4000"),
    GpuClass(24 * GiB, "RTX 3090, RTX 4090, A10, L4"),
    GpuClass(48 * GiB, "A6000, L40S"),
    GpuClass(80 * GiB, "A100 80 GB, H100"),
    GpuClass(141 * GiB, "H200"),
)
"""The machines :func:`smallest_machine` names, smallest first (memory as sold; a card's usable memory is a little less)."""


def smallest_machine(shape: ModelShape, work: Workload, *, engine: EngineKind = "vllm") -> str:
    """The smallest machine that runs ``shape`` for ``work``, as one phrase for a refusal.

    A GPU of the smallest :data:`GPU_CLASSES` size whose whole memory (free, an idle card) gives a
    plan that fits with ``engine``; and a CPU-only host with enough available memory for the
    transformers engine.
    """
    gpu = ""
    for cls in GPU_CLASSES:
        m = Machine(gpu_name=cls.examples, gpu_free_bytes=cls.memory_bytes, gpu_total_bytes=cls.memory_bytes)
        if plan_engine(shape, m, work, engine=engine, device="cuda").fits:
            gpu = f"a GPU with {cls.memory_bytes // GiB} GiB free ({cls.examples})"
            break
    cpu_need = needed_bytes(shape, work, "transformers", "cpu")
    cpu = f"a CPU-only machine with {math.ceil(cpu_need / CPU_SHARE / GiB)} GiB of available memory (slow)"
    if not gpu:
        return f"no single GPU listed here ({GPU_CLASSES[-1].memory_bytes // GiB} GiB at most); {cpu}"
    return f"{gpu}, or {cpu}"


QWEN25_SHAPES: tuple[ModelShape, ...] = (
    ModelShape("qwen2.5-0.5b", layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936),
    ModelShape("qwen2.5-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936),
    ModelShape("qwen2.5-3b", layers=36, hidden=2048, heads=16, kv_heads=2, head_dim=128, intermediate=11008, vocab=151936),
    ModelShape("qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064, tied=False),
    ModelShape("qwen2.5-14b", layers=48, hidden=5120, heads=40, kv_heads=8, head_dim=128, intermediate=13824, vocab=152064, tied=False),
    ModelShape("qwen2.5-32b", layers=64, hidden=5120, heads=40, kv_heads=8, head_dim=128, intermediate=27648, vocab=152064, tied=False),
)
"""The published Qwen2.5 shapes (their ``config.json``s; 32B is INTELLECT-2's QwQ-32B), for ``doctor``'s table."""
