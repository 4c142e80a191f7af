"""The engine interface every inference backend implements."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from protocol.sampling import DEFAULT_RULE


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (semantics: ``docs/toploc.md``).

    Attributes:
        max_tokens: completion length limit, tokens.
        temperature: softmax temperature (> 0).
        top_p: nucleus mass (1.0 = off).
        eos_id: token that ends a completion.
        min_eos_prob: EOS may be sampled only where P(EOS) ≥ this (the run's ``toploc.eos_min_prob``).
        rule: the sampling rule, the run spec's ``sampling.rule`` (``protocol.sampling.RULES``).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    eos_id: int = 1
    min_eos_prob: float = 0.0
    rule: str = DEFAULT_RULE


@dataclass
class Generation:
    """One sampled completion.

    Attributes:
        completion_ids: ``[n]`` int64 token IDs, ending with EOS when ``finish == "eos"``.
        logprobs: ``[n]`` float32 sampling log-probs (log-softmax of logits / temperature).
        hidden: ``[n, H]`` bfloat16 committed final-norm rows (positions P-1 … P+n-2).
        finish: ``"eos"`` or ``"length"`` (hit ``max_tokens``).
    """

    completion_ids: torch.Tensor
    logprobs: torch.Tensor
    hidden: torch.Tensor
    finish: Literal["eos", "length"]


class Engine(abc.ABC):
    """Generates completions with seeded sampling and TOPLOC capture, and swaps weights live."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[Generation]:
        """Sample one completion per prompt; ``seeds[i]`` is prompt i's sequence seed (u64)."""

    @abc.abstractmethod
    def load_weights(self, model_dir: Path) -> None:
        """Replace the policy weights with those in ``model_dir`` (safetensors) without a restart."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token IDs the model scores."""


COMPUTE_DTYPE_NAMES = ("float32", "bfloat16")
"""Compute dtypes a worker's engine may run in (``join --dtype``; ``node.engine.hf.COMPUTE_DTYPES`` maps them to torch's)."""


def create_engine(kind: str, model_dir: Path, *, device: str = "cpu", max_batch: int = 64, dtype: str | None = None,
                  fp32_head: bool = False, gpu_memory_share: float | None = None, max_model_len: int | None = None) -> Engine:
    """The engine named ``kind`` (``transformers`` or ``vllm``) loaded from ``model_dir``.

    Args:
        kind: ``transformers`` or ``vllm``.
        model_dir: the policy directory (config + safetensors + tokenizer).
        device: ``cpu`` or ``cuda``.
        max_batch: most sequences decoded at once.
        dtype: compute dtype, ``float32`` or ``bfloat16`` (``join --dtype``); ``None``: the engine's
            default (transformers: float32; vLLM: bfloat16 on CUDA, float32 on the CPU). A bf16
            worker needs a run spec whose replay rule tolerates it (``toploc.replay_rule``,
            ``docs/toploc.md`` §6.2).
        fp32_head: bf16 transformers engine only: logits from the float32 LM head ("fp32 logits").
        gpu_memory_share: share of the GPU's total memory the engine may take (vLLM's
            ``gpu_memory_utilization``; the transformers engine caps torch's allocator at it);
            ``None``: vLLM plans it from the model and the GPU (``node/engine/fit.py``), transformers
            takes what it needs. A worker passes its plan's (:func:`node.engine.fit.plan_engine`).
        max_model_len: prompt + completion limit, tokens (vLLM; default the model's).

    Raises:
        ValueError: unknown ``kind`` or ``dtype``, or ``fp32_head`` where it does not apply.
        ImportError: ``vllm`` requested but the ``gpu`` extra is not installed.
    """
    if dtype is not None and dtype not in COMPUTE_DTYPE_NAMES:
        raise ValueError(f"unknown compute dtype {dtype!r}; choose {' or '.join(COMPUTE_DTYPE_NAMES)}")
    if kind == "transformers":
        from node.engine.hf import COMPUTE_DTYPES, TransformersEngine

        return TransformersEngine.from_dir(model_dir, device=device, max_batch=max_batch, compute_dtype=COMPUTE_DTYPES[dtype or "float32"],
                                           fp32_head=fp32_head, gpu_memory_share=gpu_memory_share)
    if kind == "vllm":
        if fp32_head:
            raise ValueError("fp32_head (fp32 logits) is an option of the transformers engine; vLLM computes its head in its dtype")
        from node.engine.vllm_engine import VllmEngine

        return VllmEngine.from_dir(model_dir, device=device, max_batch=max_batch, dtype=dtype, gpu_memory_utilization=gpu_memory_share,
                                   max_model_len=max_model_len)
    raise ValueError(f"unknown engine {kind!r}; choose transformers or vllm")

