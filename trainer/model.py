"""The policy model on the trainer side: sharding it with FSDP2, and the one forward that gives
per-token log-probs and entropies (used for old, reference and new log-probs alike). Models are
built by ``protocol.models.build_model`` (fresh weights from a config and seed) or loaded by
``protocol.models.load_model`` (a model directory), as on every other node.

FSDP2 layout (``docs/trainer.md`` §6): ``fully_shard`` on each ``Qwen2DecoderLayer`` (one
all-gather/reduce-scatter unit per layer), then on the whole model (embeddings, final norm and
``lm_head`` form the root unit). Parameters are float32 masters; with ``compute_dtype`` bfloat16
the layers compute in bf16 (``MixedPrecisionPolicy``) and reduce gradients in float32.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from transformers import Qwen2Config

from trainer.batch import MicroBatch

logger = logging.getLogger(__name__)

__all__ = ["shard_model", "tiny_qwen2_config", "token_logprobs"]


def tiny_qwen2_config(
    *,
    vocab_size: int = 64,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
) -> Qwen2Config:
    """A small Qwen2 configuration for tests and CPU runs (sdpa attention; build it with
    ``protocol.models.build_model``)."""
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def shard_model(model: torch.nn.Module, mesh: DeviceMesh | None, *, compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Apply FSDP2 in place: ``fully_shard`` per decoder layer, then the root.

    Args:
        model: the full model, on the target device.
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks.
        compute_dtype: float32, or bfloat16 for mixed precision (float32 gradient reduction).

    Returns:
        The same module, now holding ``DTensor`` shards.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of each completion position's target token, and the entropy there, for one packed row.

    Logits are divided by the sampling temperature first, so the distribution matches the one
    the worker sampled from (prime-rl does the same). Only the positions in ``loss_mask`` go
    through the LM head (transformers' ``logits_to_keep``): the loss reads no other, and at the
    real shape the head is the costliest layer per position (896 × 151,936 multiply-adds, more than
    a third of a 0.5B model's) while prompts are often half of a row, and the ``[T, V]`` float32 logits
    of a row (4.9 GB at 8,192 tokens) shrink to the completion tokens'.

    Args:
        model: the policy, a transformers causal LM (plain or FSDP2-sharded); gradients flow if enabled by the caller.
        mb: the packed row, on the model's device.
        temperature: sampling temperature (> 0).
        with_entropy: also return the entropy.

    Returns:
        ``logprobs [1, T] float32`` (log π(targets[t] | prefix of its sequence)) and
        ``entropy [1, T] float32`` in nats (or ``None``), both 0 at positions outside ``loss_mask``.
    """
    keep = mb.loss_mask[0].nonzero().squeeze(-1)  # [K] int64, the completion positions
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=keep)
    logits = out.logits.float() / temperature  # [1, K, V]
    logz = torch.logsumexp(logits, dim=-1)  # [1, K]
    picked = torch.gather(logits, -1, mb.targets[:, keep].unsqueeze(-1)).squeeze(-1)  # [1, K]
    zeros = logits.new_zeros(mb.targets.shape)  # [1, T]
    logprobs = zeros.index_copy(1, keep, picked - logz)  # [1, T]
    entropy = None
    if with_entropy:
        p = F.softmax(logits, dim=-1)  # [1, K, V]
        entropy = zeros.index_copy(1, keep, logz - (p * logits).sum(-1))  # [1, T]
    return logprobs, entropy
