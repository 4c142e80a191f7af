"""Transformers engine: batched generation with a KV cache, seeded sampling and TOPLOC capture."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from node.engine.base import Engine, Generation, SamplingParams
from node.engine.static_decode import StaticDecoder, supports
from protocol import sampling
from protocol.inference import forward, pad_left
from protocol.models import config_int, copy_weights, load_model, load_tokenizer

logger = logging.getLogger(__name__)


class TransformersEngine(Engine):
    """Runs a Qwen2 policy through transformers on CPU or CUDA.

    Generation (``generate``): left-padded prefill of the whole batch, then one batched decode
    step per token with the KV cache. Every step samples with :func:`protocol.sampling.sample`
    (the run's rule) keyed by (sequence seed, completion index; ``icdf-v1``'s uniforms computed
    for 64 positions at a time), and writes the token, its log-prob and the final-norm row that
    produced it into preallocated ``[B, max_tokens]`` tensors, so the loop
    does no per-sequence Python work and, on CUDA, no host synchronisation per token (the sampler is
    device tensor ops; "all done?" is read every 16 steps). Finished sequences keep stepping
    (masked) until all are done. Plain Qwen2 models decode through
    :class:`node.engine.static_decode.StaticDecoder` (a KV cache preallocated per batch, the layers'
    ops called directly: bit-identical rows, tokens and log-probs, without transformers' per-step
    cache concatenation and module overhead; ``benchmarks/worker_bench.py`` times both); other
    models through ``transformers``.

    Attributes:
        model: the policy (eval mode).
        tokenizer: its tokenizer (left padding).
        device: ``"cpu"`` or ``"cuda"``.
        max_batch: sequences per forward pass; larger batches are split.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, device: str = "cpu", max_batch: int = 64) -> None:
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_batch = max_batch
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # "all finished?" reads a device flag: every step on the CPU (free), every 16 steps on CUDA so
        # the decode loop does not wait for the device each token (finished rows step masked meanwhile)
        self.done_check_every = 1 if str(device) == "cpu" else 16
        # decode supported models with StaticDecoder (False: always through transformers, for comparison)
        self.static_decode = True

    @classmethod
    def from_dir(cls, model_dir: Path, *, device: str = "cpu", max_batch: int = 64, gpu_memory_share: float | None = None) -> TransformersEngine:
        """Load model and tokenizer from a local directory (safetensors only).

        Args:
            gpu_memory_share: on CUDA, cap torch's allocator at this share of the GPU's memory
                (``torch.cuda.set_per_process_memory_fraction``): the engine then fails with an
                out-of-memory error rather than take memory others use.
        """
        if gpu_memory_share is not None and str(device).startswith("cuda"):
            torch.cuda.set_per_process_memory_fraction(gpu_memory_share)
        return cls(load_model(Path(model_dir), device=device), load_tokenizer(Path(model_dir)), device=device, max_batch=max_batch)

    @property
    def vocab_size(self) -> int:
        return config_int(self.model, "vocab_size")

    def load_weights(self, model_dir: Path) -> None:
        """Swap in the weights of ``model_dir`` in place (same architecture), safetensors only.

        The engine keeps computing in its own dtype: a bfloat16 checkpoint is cast up to the
        model's float32 tensor by tensor (:func:`protocol.models.copy_weights`), exactly as
        :func:`protocol.models.load_model` loads it for validators, holding the model plus one
        tensor (a whole second state would double a 0.5B worker's memory at every step).
        """
        copy_weights(self.model, Path(model_dir))
        self.model.eval()

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[Generation]:
        """Sample one completion per prompt.

        Args:
            prompts: token IDs per prompt (each non-empty).
            seeds: per-prompt sequence seeds (u64), from :func:`protocol.sampling.derive_sequence_seed`.
            params: sampling parameters.

        Returns:
            One :class:`Generation` per prompt, in order.
        """
        if len(prompts) != len(seeds):
            raise ValueError("one seed per prompt")
        out: list[Generation] = []
        for i in range(0, len(prompts), self.max_batch):
            out.extend(self._generate_batch(prompts[i : i + self.max_batch], seeds[i : i + self.max_batch], params))
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[Generation]:
        b, n_max = len(prompts), params.max_tokens
        ids, mask, pos = (t.to(self.device) for t in pad_left(prompts, self.pad_id))
        seed_t = _seeds_tensor(seeds, self.device)  # [B] int64
        hidden_size = config_int(self.model, "hidden_size")
        tokens = torch.full((b, n_max), self.pad_id, dtype=torch.long, device=self.device)  # [B, N]
        logps = torch.zeros((b, n_max), dtype=torch.float32, device=self.device)  # [B, N]
        rows = torch.zeros((b, n_max, hidden_size), dtype=torch.bfloat16, device=self.device)  # [B, N, H]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        last = torch.tensor([ids.shape[1] - 1], device=self.device)
        step_out = forward(self.model, ids, mask, pos, use_cache=True, logits_positions=last)
        cache = step_out.cache
        h = step_out.hidden[:, -1]  # [B, H] row that predicts completion token i
        logits = step_out.logits[:, -1]  # [B, V]
        static = self.static_decode and supports(self.model) and hasattr(cache, "layers")  # a transformers DynamicCache
        decoder = StaticDecoder(self.model, cache, mask, n_max) if static else None
        next_pos = pos[:, -1:] + 1  # [B, 1] position of the token sampled at step i
        steps = torch.arange(n_max, dtype=torch.int64, device=self.device)  # completion positions
        icdf = params.rule == sampling.RULE_ICDF
        u_block = steps  # icdf-v1: the uniforms of the next _UNIFORM_STEPS positions, [B, S, K + 1]
        eos = (params.eos_id,)
        for i in range(n_max):
            j = i % _UNIFORM_STEPS
            if icdf and j == 0:  # one Philox call per block of positions instead of one per step
                s_ = steps[i : i + _UNIFORM_STEPS]
                u_block = sampling.uniforms(seed_t.repeat_interleave(len(s_)), s_.repeat(b)).view(b, len(s_), -1)
            tok, lp = sampling.sample(logits, seed_t, steps[i].expand(b), params.temperature, params.top_p, eos, params.min_eos_prob,
                                      params.rule, u=u_block[:, j] if icdf else None)
            tok.masked_fill_(done, self.pad_id)  # finished rows step on, masked
            tokens[:, i] = tok
            logps[:, i] = lp
            rows[:, i] = h
            done |= tok == params.eos_id
            if i + 1 == n_max or ((i + 1) % self.done_check_every == 0 and bool(done.all())):
                break
            if decoder is not None:
                h, logits = decoder.step(tok, next_pos)
            else:
                mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
                step_out = forward(self.model, tok.unsqueeze(1), mask, next_pos, cache, use_cache=True)
                cache = step_out.cache
                h, logits = step_out.hidden[:, -1], step_out.logits[:, -1]
            next_pos = next_pos + 1
        # a row ends at its first EOS (after it the row holds padding, or nothing if every row was done)
        is_eos = tokens == params.eos_id  # [B, N]
        lengths = torch.where(done, is_eos.to(torch.int8).argmax(dim=-1) + 1, n_max)  # [B]
        result = []
        lengths_l = lengths.tolist()
        done_l = done.tolist()
        for j in range(b):
            n = lengths_l[j]
            result.append(
                Generation(
                    completion_ids=tokens[j, :n].cpu(),
                    logprobs=logps[j, :n].cpu(),
                    hidden=rows[j, :n].cpu(),
                    finish="eos" if done_l[j] else "length",
                )
            )
        return result


_UNIFORM_STEPS = 64
"""Decode steps whose ``icdf-v1`` uniforms are computed in one call (``[B, 64, 17]`` float64: 8.5 KiB per row)."""


def _seeds_tensor(seeds: list[int], device: str) -> torch.Tensor:
    """u64 seeds as an int64 tensor (two's-complement wrap, the bits are what matter)."""
    wrapped = [s - (1 << 64) if s >= (1 << 63) else s for s in (int(x) & ((1 << 64) - 1) for x in seeds)]
    return torch.tensor(wrapped, dtype=torch.int64, device=device)
