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


def create_engine(kind: str, model_dir: Path, *, device: str = "cpu", max_batch: int = 64, gpu_memory_share: float | None = None,
                  max_model_len: int | None = None) -> Engine:
    """The engine named ``kind`` (``transformers`` or ``vllm``) loaded from ``model_dir``.

    Args:
        kind: ``transformers`` or ``vllm``.
        model_dir: the policy directory.
        device: ``cpu`` or ``cuda``.
        max_batch: most sequences decoded at once.
        gpu_memory_share: share of the GPU's total memory the engine may take (vLLM's
            ``gpu_memory_utilization``; the transformers engine caps torch's allocator at it);
            ``None``: vLLM plans it from the model and the GPU (``node/engine/fit.py``), transformers
            takes what it needs. A worker passes its plan's (:func:`node.engine.fit.plan_engine`).
        max_model_len: prompt + completion limit, tokens (vLLM; default the model's).

    Raises:
        ValueError: unknown ``kind``.
        ImportError: ``vllm`` requested but the ``gpu`` extra is not installed.
    """
    if kind == "transformers":
        from node.engine.hf import TransformersEngine

        return TransformersEngine.from_dir(model_dir, device=device, max_batch=max_batch, gpu_memory_share=gpu_memory_share)
    if kind == "vllm":
        from node.engine.vllm_engine import VllmEngine

        return VllmEngine.from_dir(model_dir, device=device, max_batch=max_batch, gpu_memory_utilization=gpu_memory_share,
                                   max_model_len=max_model_len)
    raise ValueError(f"unknown engine {kind!r}; choose transformers or vllm")
