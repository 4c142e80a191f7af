"""Transformers engine: batched generation with a KV cache, seeded sampling and TOPLOC capture."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from node.engine.base import COMPUTE_DTYPE_NAMES, Engine, Generation, SamplingParams
from node.engine.static_decode import StaticDecoder, supports
from protocol import sampling
from protocol.inference import forward, pad_left
from protocol.models import config_int, copy_weights, head_weight, load_model, load_tokenizer

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

    **Compute dtype.** ``compute_dtype`` defaults to the model's own (:meth:`from_dir`: float32,
    the validator's arithmetic). With bfloat16 the weights are cast to bf16 at construction (in
    place, as ``Module.to`` does: pass a copy to keep a float32 model) and after every :meth:`load_weights`, the
    forward passes and the KV cache run in bf16 (through ``transformers``: the static decoder mirrors
    float32 only), the committed rows are bf16 as always and the sampler gets the logits as float32:
    what a GPU contributor runs, and what a run spec's ``toploc.replay_rule = "logit-bound-v1"``
    (``docs/toploc.md`` §6.2) tolerates. ``fp32_head`` (bf16 only: "fp32 logits") computes the
    logits as the final-norm row cast to float32 times a float32 copy of the checkpoint's LM head
    (the validator's own head), so the head's bf16 rounding leaves the logit error.

    Raises (constructor):
        ValueError: a compute dtype other than float32 / bfloat16, or ``fp32_head`` on float32.

    Attributes:
        model: the policy (eval mode) in ``compute_dtype``.
        tokenizer: its tokenizer (left padding).
        device: ``"cpu"`` or ``"cuda"``.
        max_batch: sequences per forward pass; larger batches are split.
        compute_dtype: ``torch.float32`` or ``torch.bfloat16``.
        head_fp32: ``[V, H]`` float32 LM head used for the logits (``fp32_head``), else ``None``.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, device: str = "cpu", max_batch: int = 64,
                 compute_dtype: torch.dtype | None = None, fp32_head: bool = False) -> None:
        compute_dtype = compute_dtype or next(model.parameters()).dtype  # default: the model's own
        if compute_dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"compute dtype {compute_dtype} is not one of {', '.join(COMPUTE_DTYPES)}")
        if fp32_head and compute_dtype == torch.float32:
            raise ValueError("fp32_head is for a bfloat16 engine (a float32 engine's head is float32 already)")
        head = model.lm_head.weight.detach().to(device=device, dtype=torch.float32, copy=True) if fp32_head else None  # [V, H], before the cast
        self.model = model.to(device=device, dtype=compute_dtype).eval()
        self.head_fp32: torch.Tensor | None = head
        self.compute_dtype = compute_dtype
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
    def from_dir(cls, model_dir: Path, *, device: str = "cpu", max_batch: int = 64, compute_dtype: torch.dtype = torch.float32,
                 fp32_head: bool = False, gpu_memory_share: float | None = None) -> TransformersEngine:
        """Load model and tokenizer from a local directory (safetensors only), in ``compute_dtype``
        (the checkpoint's tensors cast one at a time; with ``fp32_head`` the head is read again as float32).

        Args:
            gpu_memory_share: on CUDA, cap torch's allocator at this share of the GPU's memory
                (``torch.cuda.set_per_process_memory_fraction``): the engine then fails with an
                out-of-memory error rather than take memory others use.
        """
        if gpu_memory_share is not None and str(device).startswith("cuda"):
            torch.cuda.set_per_process_memory_fraction(gpu_memory_share)
        model = load_model(Path(model_dir), dtype=compute_dtype, device=device)
        eng = cls(model, load_tokenizer(Path(model_dir)), device=device, max_batch=max_batch, compute_dtype=compute_dtype)
        if fp32_head:
            if compute_dtype == torch.float32:
                raise ValueError("fp32_head is for a bfloat16 engine (a float32 engine's head is float32 already)")
            eng.head_fp32 = head_weight(Path(model_dir), device=device)
        return eng

    @property
    def vocab_size(self) -> int:
        return config_int(self.model, "vocab_size")

    def load_weights(self, model_dir: Path) -> None:
        """Swap in the weights of ``model_dir`` in place (same architecture), safetensors only.

        The engine keeps computing in its own dtype: each tensor of the checkpoint is cast to the
        model's (a bfloat16 checkpoint up to a float32 engine's, exactly as
        :func:`protocol.models.load_model` loads it for validators; a float32 one down to a bf16
        engine's) by :func:`protocol.models.copy_weights`, holding the model plus one tensor (a whole
        second state would double a 0.5B worker's memory at every step). An ``fp32_head`` engine
        reads the head again as float32.
        """
        copy_weights(self.model, Path(model_dir))
        self.model.eval()
        if self.head_fp32 is not None:
            self.head_fp32 = head_weight(Path(model_dir), device=self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float32 logits the sampler gets for final-norm rows ``hidden`` (``[..., H]``, compute dtype):
        the model's head cast to float32, or with ``fp32_head`` the rows in float32 times the float32 head.

        Returns:
            ``[..., V]`` float32.
        """
        if self.head_fp32 is not None:
            return torch.nn.functional.linear(hidden.float(), self.head_fp32)
        out: torch.Tensor = self.model.lm_head(hidden).float()
        return out

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
        seed_t = seeds_tensor(seeds, self.device)  # [B] int64
        hidden_size = config_int(self.model, "hidden_size")
        tokens = torch.full((b, n_max), self.pad_id, dtype=torch.long, device=self.device)  # [B, N]
        logps = torch.zeros((b, n_max), dtype=torch.float32, device=self.device)  # [B, N]
        rows = torch.zeros((b, n_max, hidden_size), dtype=torch.bfloat16, device=self.device)  # [B, N, H]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        last = torch.tensor([ids.shape[1] - 1], device=self.device)
        own_head = self.head_fp32 is None  # the model's own head (float32 engines: bit-identical to before)
        step_out = forward(self.model, ids, mask, pos, use_cache=True, logits_positions=last, with_logits=own_head)
        cache = step_out.cache
        h = step_out.hidden[:, -1]  # [B, H] row that predicts completion token i
        logits = step_out.logits[:, -1] if own_head else self.logits(h)  # [B, V] float32
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
                step_out = forward(self.model, tok.unsqueeze(1), mask, next_pos, cache, use_cache=True, with_logits=own_head)
                cache = step_out.cache
                h = step_out.hidden[:, -1]
                logits = step_out.logits[:, -1] if own_head else self.logits(h)
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


COMPUTE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPE_NAMES}
"""A worker's compute dtypes by name (``join --dtype``; :data:`node.engine.base.COMPUTE_DTYPE_NAMES`)."""

_UNIFORM_STEPS = 64
"""Decode steps whose ``icdf-v1`` uniforms are computed in one call (``[B, 64, 17]`` float64: 8.5 KiB per row)."""


def seeds_tensor(seeds: list[int], device: str) -> torch.Tensor:
    """u64 seeds as an int64 tensor (two's-complement wrap, the bits are what matter)."""
    wrapped = [s - (1 << 64) if s >= (1 << 63) else s for s in (int(x) & ((1 << 64) - 1) for x in seeds)]
    return torch.tensor(wrapped, dtype=torch.int64, device=device)
